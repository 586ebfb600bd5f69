"""What a site keeps between its eager calls: the quantized weight and the scales still to count.

Eagerly (probe steps, CPUs, debugging) the weight operand is quantized once per weight value and
reused by the forward, grad-input and micro-batches between two optimizer steps. A weight's value
is stamped by ``(weight._version, optimizer steps, data_ptr, dtype, device)``: PyTorch's fused
optimizers update a weight in place without bumping ``_version``, hence the process's count of
optimizer steps (:class:`OptimizerSteps`). Nothing here is used while ``torch.compile`` traces:
the graph must not depend on Python-side state.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["EagerState", "OptimizerSteps"]


class OptimizerSteps:
    """How many ``torch.optim`` optimizer steps this process has taken (a global post-step hook,
    registered with the first layer's eager state): part of the weight cache's stamp."""

    count = 0
    hook = None

    @classmethod
    def watch(cls) -> None:
        if cls.hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            cls.hook = register_optimizer_step_post_hook(cls._stepped)

    @classmethod
    def _stepped(cls, optimizer, args, kwargs) -> None:
        cls.count += 1


class EagerState:
    """What a layer keeps between eager calls: the weight-operand cache and the scales to count.

    Never used while ``torch.compile`` traces (the graph must not depend on Python-side state).
    """

    def __init__(self) -> None:
        self.weight_cache: Dict[Tuple, Any] = {}
        self.weight_stamp: Optional[Tuple] = None
        self.pending_scales: List[torch.Tensor] = []  # dequantization scales not yet counted
        OptimizerSteps.watch()

    def clear(self) -> None:
        self.weight_cache = {}
        self.weight_stamp = None

    def cache_for(self, weight: torch.Tensor) -> Optional[Dict[Tuple, Any]]:
        """The operand cache valid for ``weight``'s current values, or ``None`` (no caching)."""
        if weight.is_inference() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None  # inference tensors have no version; a captured graph re-reads the weight
        try:
            stamp = (weight._version, OptimizerSteps.count, weight.data_ptr(), weight.dtype, weight.device)
        except RuntimeError:  # a tensor without storage of its own (a wrapper subclass): no caching
            return None
        if stamp != self.weight_stamp:
            self.weight_cache = {}
            self.weight_stamp = stamp
        return self.weight_cache
