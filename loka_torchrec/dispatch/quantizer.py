"""Operand quantization for one call of a site: through the backend eagerly, with fusable torch ops compiled.

Operands are quantized with ``nonfinite="propagate"``: a scaling group holding inf or NaN gets a
NaN scale, so every output reading it is NaN, never silently finite. The :class:`Quantizer`
counts those scales: compiled, as a tensor the graph returns (:meth:`Quantizer.total`); eagerly,
queued on the site's :class:`~loka_torchrec.dispatch.eager_cache.EagerState` and counted in
batches (one reduction on the device, no sync).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from loka_torchrec.dispatch.eager_cache import EagerState
from loka_torchrec.dispatch.role_kernels import RoleKernel
from loka_torchrec.fp8 import Granularity, quantize
from loka_torchrec.gemm.recipes import OperandSpec

__all__ = ["Quantizer"]


class Quantizer:
    """Quantizes operands for one call: through the backend eagerly, with fusable torch ops when compiled.

    ``counts`` collects, while compiling, the number of NaN scales of each operand (scaling groups
    holding inf/NaN); eagerly the scales are queued on the layer's :class:`EagerState` instead.
    ``prior_amax`` (compiled only): ``"input"`` / ``"weight"`` -> the amax that scales that tensor's
    tensorwise operands (either layout) in place of its own (delayed scaling; see
    :class:`~loka_torchrec.dispatch.gemm_site.GemmSite`).
    """

    def __init__(self, state: Optional[EagerState], prior_amax: Optional[Dict[str, torch.Tensor]] = None) -> None:
        self.state = state
        self.prior_amax = prior_amax or {}
        self.counts: List[torch.Tensor] = []

    def __call__(self, kernel: RoleKernel, t: torch.Tensor, spec: OperandSpec, name: str) -> Any:
        if self.state is None:
            amax = None
            if spec.granularity == Granularity.TENSORWISE:
                amax = self.prior_amax.get(name.split("^")[0])  # "input^T" is scaled as "input"
            op = quantize(t, spec.fmt, spec.granularity, block=spec.block, power_of_two=spec.power_of_two,
                          nonfinite="propagate", name=name, amax=amax)  # fmt: skip
        else:
            op = kernel.backend.quantize(t, spec, name=name)
        return self.counted(op)

    def counted(self, op: Any) -> Any:
        scale = getattr(op, "dequant_scale", None)
        if isinstance(scale, torch.Tensor):
            if self.state is None:
                self.counts.append(torch.isnan(scale).sum())
            else:
                self.state.pending_scales.append(scale.detach())
        return op

    def paired(self, t: torch.Tensor, first: RoleKernel, first_spec: str, second: RoleKernel, second_spec: str,
               cols: int, name: str) -> Optional[Tuple[Any, Any]]:  # fmt: skip
        """``t`` (rows, cols) as an operand of ``first`` and ``t^T`` as one of ``second``, from one read.

        Eager only (compiled, Inductor fuses the two quantizations of one read itself), and only
        where one backend runs both GEMMs with the same tensorwise or rowwise spec, offers
        ``quantize_with_transpose`` (``GemmBackend.quantizes_with_transpose``), and no dim needs
        padding; else ``None``.
        """
        if self.state is None or not (first.fp8 and second.fp8) or first.choice.backend != second.choice.backend:
            return None
        spec = getattr(first.recipe, first_spec)
        if spec != getattr(second.recipe, second_spec) or spec.granularity == Granularity.BLOCKWISE:
            return None
        rows = t.shape[0]
        if first.padded(rows) != rows or second.padded(rows) != rows or first.padded(cols) != cols:
            return None
        backend = first.backend
        if not backend.quantizes_with_transpose:
            return None
        op, op_t = backend.quantize_with_transpose(t, spec, name=name)
        return self.counted(op), self.counted(op_t)

    def total(self) -> Optional[torch.Tensor]:
        """The NaN-scale count of this call's compiled operands, or ``None`` (eager, or none quantized)."""
        if not self.counts:
            return None
        return torch.stack(self.counts).sum()
