"""The dense parameters' optimizer of the reference job: Adagrad, its update in one pass per step.

PyTorch's default (``foreach``) Adagrad makes one pass over all dense parameters per elementwise
operation of the update, each reading and writing 4 bytes per parameter; on an LRM's dense part
those passes are a visible share of the step. PyTorch's fused Adagrad does it in one pass; where
this PyTorch has none for the device (PyTorch 2.11 refuses ``fused=True`` on CUDA) and the job
compiles, Inductor compiles the step and fuses the passes instead.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

__all__ = ["dense_adagrad", "dense_optimizer_kind"]

logger = logging.getLogger("loka_job.train")


def dense_adagrad(params, *, lr: float, fused: bool, compiled: bool = False) -> torch.optim.Adagrad:
    """The dense parameters' Adagrad, its update in one pass over the parameters where it can be.

    With ``fused``: PyTorch's fused implementation where this PyTorch runs it on every device the
    parameters are on; else, with ``compiled`` (the job compiles its dense modules), the default
    implementation with its step compiled by Inductor, which fuses the per-tensor updates of each
    group of tensors into a few kernels; else the default implementation (and a warning). The
    default implementation makes one pass over the parameters per elementwise operation of the
    update, several passes of 4 bytes per parameter each.
    """
    params = list(params)
    if not fused:
        return torch.optim.Adagrad(params, lr=lr)
    missing = [d for d in sorted({p.device.type for p in params}) if not _fused_adagrad_runs(d)]
    if not missing:
        return torch.optim.Adagrad(params, lr=lr, fused=True)
    optimizer = torch.optim.Adagrad(params, lr=lr)
    if compiled:
        logger.info("train.fused_optimizer: no fused Adagrad for %s in this PyTorch; the dense Adagrad's step is compiled", ", ".join(missing))
        optimizer.step = _CompiledStep(optimizer.step)
    else:
        logger.warning("train.fused_optimizer: this PyTorch has no fused Adagrad for %s; the dense Adagrad runs unfused", ", ".join(missing))
    return optimizer


class _CompiledStep:
    """An optimizer's bound ``step`` compiled; a call with a closure runs it eagerly. (PyTorch's
    ``Optimizer.step`` breaks its graph on purpose around the update, so it compiles to two graphs.)"""

    def __init__(self, step: Callable) -> None:
        self.eager, self.compiled = step, torch.compile(step)

    def __call__(self, closure=None):
        return self.eager(closure) if closure is not None else self.compiled()


def dense_optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """How :func:`dense_adagrad`'s optimizer runs its update, for the run's summary."""
    if optimizer.defaults.get("fused"):
        return "fused"
    return "step compiled" if isinstance(optimizer.step, _CompiledStep) else "foreach"


def _fused_adagrad_runs(device_type: str) -> bool:
    """Whether a fused Adagrad step runs on ``device_type`` (PyTorch checks the device at the first
    step, and which devices it accepts depends on its version): one step on a one-element tensor."""
    param = torch.zeros(1, device=device_type, requires_grad=True)
    param.grad = torch.zeros_like(param)
    try:
        torch.optim.Adagrad([param], fused=True).step()
    except (RuntimeError, NotImplementedError):
        return False
    return True
