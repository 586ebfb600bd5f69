"""The hooks the job registers itself on DDP's dense gradient all-reduce (:func:`register_hooks`).

``train.dense_allreduce=fp8``: :mod:`loka_torchrec.comms.fp8_allreduce`'s hook, always (lossy: only
where asked). ``train.dense_allreduce=auto``: fp32 or compressed, whichever makes the step faster.

DDP takes one communication hook, registered before the first forward. :func:`install` registers
one whose precision an :class:`AllreduceSwitch` sets between steps: fp32 (DDP's own all-reduce,
PyTorch's ``allreduce_hook``) or compressed (PyTorch's ``bf16_compress_hook``; ``fp16_compress_hook``
where there is no NCCL, e.g. on a CPU). :class:`DenseAllreduceCheck` then times the training step
with each, in alternating blocks (the bookkeeping of :mod:`loka_torchrec.comms.step_check`), once
LoKA needs no step times (``Loka.step_times_free``), agrees on the medians across ranks (the
slowest rank counts) and keeps compressed only if its step is at least 1% faster. Until the check
ends, and where it never starts, the all-reduce runs in fp32, as DDP's own.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from loka_torchrec.comms.fp8_allreduce import Fp8AllreduceState, fp8_allreduce_hook
from loka_torchrec.comms.step_check import CommsStepCheck, StepCheckDriver, StepCheckRun

__all__ = ["AllreduceSwitch", "DenseAllreduceCheck", "compressed_candidate", "install", "register_hooks"]

logger = logging.getLogger("loka_job.train")

_COMPRESS_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


class AllreduceSwitch:
    """The precision the installed hook sends the gradients in: ``"fp32"`` or :attr:`compressed`."""

    def __init__(self, compressed: str) -> None:
        if compressed not in _COMPRESS_HOOKS:
            raise ValueError(f"compressed: expected one of {', '.join(_COMPRESS_HOOKS)}, got {compressed!r}")
        self.compressed = compressed
        self.precision = "fp32"


def install(ddp_module, compressed: str) -> AllreduceSwitch:
    """Register on ``ddp_module`` (a ``DistributedDataParallel``, before its first forward) the hook
    that follows the returned switch; it starts in fp32."""
    switch = AllreduceSwitch(compressed)

    def switchable_allreduce_hook(process_group, bucket):
        if switch.precision == "fp32":
            return default_hooks.allreduce_hook(process_group, bucket)
        return _COMPRESS_HOOKS[switch.compressed](process_group, bucket)

    ddp_module.register_comm_hook(None, switchable_allreduce_hook)
    return switch


class DenseAllreduceCheck(StepCheckDriver):
    """Times the step with the compressed all-reduce and with fp32 and sets ``switch`` to the faster
    (see the module docstring).

    Args:
        switch: the installed hook's switch.
        block: step times per block; the blocks alternate compressed, fp32, fp32, compressed.
        process_group: the ranks that agree on the medians (default: the world).
    """

    def __init__(self, switch: AllreduceSwitch, *, block: int = 10, process_group: Any = None) -> None:
        self.switch = switch
        self.run = StepCheckRun(CommsStepCheck(block=block), self._apply_arm, process_group)

    def observe(self, step: int, step_ms: Optional[float], *, ready: bool) -> None:
        """The step that just ran took ``step_ms`` (``None``: not a timed step). Starts the check at
        the first step when ``ready``; then switches between blocks and at the end keeps the faster."""
        was_started = self.run.started
        _, verdict = self.run.observe(step, step_ms, ready=ready)
        if self.run.started and not was_started:
            logger.info("train: checking the dense all-reduce in %s against fp32, blocks of %d steps",
                        self.switch.compressed, self.check.block)  # fmt: skip
        if verdict is not None:
            self.switch.precision = self.switch.compressed if verdict.keep_chosen else "fp32"
            logger.info("train: dense all-reduce in %s: %s, median step %.2f ms vs %.2f ms in fp32",
                        self.switch.precision, "kept" if verdict.keep_chosen else "not faster",
                        verdict.chosen_ms, verdict.fp32_ms)  # fmt: skip

    def _apply_arm(self, arm: Optional[str]) -> None:
        if arm is not None:
            self.switch.precision = self.switch.compressed if arm == "chosen" else "fp32"

    def summary(self) -> Dict[str, Any]:
        """For the run's summary: the precision in force and the verdict (``None`` until there is one)."""
        return {
            "candidate": self.switch.compressed,
            "in_force": self.switch.precision,
            "started": self.started,
            "verdict": None if self.verdict is None else dataclasses.asdict(self.verdict),
        }

    def state_dict(self) -> Dict[str, Any]:
        return {"precision": self.switch.precision, **self.run.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.switch.precision = str(state.get("precision", "fp32"))
        self.run.load_state_dict(state)


def register_hooks(ddp_module, precision: str, device: torch.device, *, check_steps: int) -> Optional[DenseAllreduceCheck]:
    """Register the job's own hook for ``train.dense_allreduce=precision`` on ``ddp_module`` (a
    ``DistributedDataParallel``, before its first forward): ``fp8``, the FP8 hook on DDP's own process
    group (TorchRec's DDP runs on its global group; a hook is not told which); ``auto``, the
    switchable hook, with the check that drives it (returned). ``fp32``, ``bf16`` and ``fp16`` are
    registered by TorchRec's DDP wrapper: nothing here, ``None``."""
    if precision == "fp8":
        ddp_module.register_comm_hook(Fp8AllreduceState(process_group=ddp_module.process_group), fp8_allreduce_hook)
        return None
    if precision != "auto":
        return None
    return DenseAllreduceCheck(install(ddp_module, compressed_candidate(device)), block=check_steps)


def compressed_candidate(device: torch.device) -> str:
    """The compressed precision ``auto`` tries: bf16 under NCCL (CUDA), fp16 elsewhere (PyTorch's
    bf16 hook needs NCCL)."""
    return "bf16" if device.type == "cuda" and dist.is_nccl_available() else "fp16"
