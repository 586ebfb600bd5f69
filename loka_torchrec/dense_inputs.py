"""One training step's inputs to the dense modules, kept to run them again: the gradient check's batch.

The gradient check (:mod:`loka_torchrec.dispatch.grad_check`) needs a loss it can evaluate several
times on the same data without collectives. The dense modules (:func:`loka_torchrec.compile.dense_modules`,
everything after the embedding lookups) are such a function of their inputs. :class:`DenseInputs`
records what each of them received in one step (detached: no autograd history of the step is
kept), and :meth:`DenseInputs.loss` runs them again eagerly, under the autocast of the recorded
step and with a fixed random seed (dropout draws the same masks every time), and sums the mean
squares of their floating outputs: a loss whose weight gradients reach every GEMM of the dense part.
``loss(halves=True)`` gives that loss over each half of the rows, for the batch's sampling noise.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from loka_torchrec.compile import eager, resolve_awaitables

__all__ = ["DenseInputs"]


class DenseInputs:
    """Records the inputs of ``modules`` during one step and replays them as a deterministic loss.

    Args:
        modules: name -> dense module (called by the model's forward).

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 4))
        >>> inputs = DenseInputs({"0": net[0]})
        >>> inputs.record(); _ = net(torch.randn(2, 4)); inputs.stop()
        >>> inputs.recorded, bool(inputs.loss() > 0)
        (True, True)
    """

    def __init__(self, modules: Dict[str, nn.Module]) -> None:
        self.modules = dict(modules)
        self._inputs: Dict[str, Tuple[tuple, dict]] = {}
        self._autocast: Optional[Tuple[str, torch.dtype]] = None
        self._handles: List[Any] = []

    @property
    def recorded(self) -> bool:
        """Whether a step's inputs are held."""
        return bool(self._inputs)

    def record(self) -> None:
        """Record the inputs of the dense modules' next calls (the latest call of each wins)."""
        if self._handles:
            return
        self._inputs.clear()
        for name, module in self.modules.items():
            hook = lambda module, args, kwargs, name=name: self._keep(name, args, kwargs)  # noqa: E731
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def stop(self) -> None:
        """Stop recording (what was recorded stays)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        """Stop recording and drop what was recorded."""
        self.stop()
        self._inputs.clear()
        self._autocast = None

    def loss(self, *, halves: bool = False) -> torch.Tensor:
        """The recorded inputs through the dense modules again: the sum over modules of the mean
        square of each floating output. Raises ``RuntimeError`` if nothing was recorded.

        With ``halves``, two losses instead: the same sum over the first and over the second half
        of each output's rows (dim 0). Their mean is the loss (for an even row count), and the
        difference of their gradients is the batch's own sampling noise, which the gradient check
        compares the FP8 error with. If an output has fewer than 2 rows, the one loss (0-d)."""
        if not self._inputs:
            raise RuntimeError("DenseInputs.loss: no inputs recorded (call record() before a training step)")
        device = next((t.device for t in self._tensors() if t.device.type != "cpu"), torch.device("cpu"))
        devices = [device] if device.type == "cuda" else []
        device_type, dtype = self._autocast or (device.type, None)
        outputs: List[torch.Tensor] = []
        with torch.random.fork_rng(devices=devices), eager(), torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            torch.manual_seed(0)
            for name, (args, kwargs) in self._inputs.items():
                leaves, _ = tree_flatten(self.modules[name](*args, **kwargs))
                outputs += [out.float() for out in leaves if torch.is_tensor(out) and out.is_floating_point()]
        if halves and all(out.dim() > 0 and out.shape[0] >= 2 for out in outputs):
            return sum((torch.stack([part.square().mean() for part in out.tensor_split(2, dim=0)]) for out in outputs), torch.zeros(2, device=device))
        return sum((out.square().mean() for out in outputs), torch.zeros((), device=device))

    def _keep(self, name: str, args: tuple, kwargs: dict) -> None:
        args = resolve_awaitables(args)
        detach = lambda t: t.detach()  # noqa: E731
        self._inputs[name] = (tree_map_only(torch.Tensor, detach, args), tree_map_only(torch.Tensor, detach, kwargs))
        device_type = next((t.device.type for t in self._tensors()), "cpu")
        self._autocast = (device_type, torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else None

    def _tensors(self):
        for args, kwargs in self._inputs.values():
            for leaf in tree_flatten((args, kwargs))[0]:
                if torch.is_tensor(leaf):
                    yield leaf
