"""Time a candidate GEMM at a layer's real shape, quantization included.

What is timed is ``backend.gemm(A, B, recipe, out_dtype)``: the casts and scale computations of
both operands plus the multiplication, i.e. what a training step pays for that GEMM.

* CUDA: one pair of CUDA events around every call, after warm-up calls; the operands rotate
  through enough distinct sets to exceed twice the L2 cache, so no call finds its inputs cached.
* CUDA with ``device_time`` (a compiled step: ``dispatch.compiled``): the calls replayed in a CUDA graph,
  so that host launch time, which a captured step does not pay, is not counted.
* CPU: ``time.perf_counter`` around every call (few repetitions: the CPU is a test bed, not a
  target).

The result is the median with the 25th..75th percentiles (:func:`~loka_torchrec.gemm.intervals.iqr_interval`).
Times of identical ``(candidate, role, shape, dtype, device)`` are cached per :class:`SpeedCache`,
since many layers of a model share shapes.
"""

from __future__ import annotations

import math
import time
from typing import Dict, Optional, Tuple

import torch

from loka_torchrec.evidence import GemmRole, GemmShape, Interval, KernelChoice
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.gemm.candidates import resolve_candidate
from loka_torchrec.gemm.intervals import iqr_interval
from loka_torchrec.gemm.measure import graph_replay_ms

__all__ = ["time_gemm", "SpeedCache", "l2_cache_bytes"]

_MAX_SETS = 64
_DEFAULT_L2 = 50 * 2**20  # H100: 50 MiB


def l2_cache_bytes(device: torch.device) -> int:
    """L2 size of a CUDA device (50 MiB when torch does not report it)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or _DEFAULT_L2)


def _rotation_sets(shape: GemmShape, dtype: torch.dtype, device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    elem = torch.finfo(dtype).bits // 8
    set_bytes = (shape.m * shape.k + shape.n * shape.k + shape.m * shape.n) * elem
    return max(1, min(_MAX_SETS, math.ceil(2 * l2_cache_bytes(device) / max(set_bytes, 1))))


@torch.no_grad()
def time_gemm(
    choice: KernelChoice,
    role: GemmRole,
    shape: GemmShape,
    *,
    dtype: torch.dtype,
    device: "torch.device | str",
    reps: int,
    warmup: Optional[int] = None,
    seed: int = 0,
    grad_format: "Fp8Format | str" = Fp8Format.E4M3,
    device_time: bool = False,
) -> Interval:
    """Median time (ms) with its IQR of ``choice`` on random ``A (M, K)``, ``B (N, K)`` in ``dtype``.

    Args:
        choice: the candidate; ``bf16:hp`` is the baseline.
        role: the GEMM role (it fixes the recipe's operand formats).
        shape: ``(M, K, N)``.
        dtype: operand and output dtype (the model's).
        device: where to run.
        reps: timed calls.
        warmup: untimed calls first (default ``max(2, reps // 5)``).
        seed: seed of the random operands.
        grad_format: FP8 format of gradient operands.
        device_time: on CUDA, time the calls replayed in a CUDA graph (one call per operand set,
            one sample per replay): the device time a captured step pays, without the host's
            launch gaps (a compiled step: ``dispatch.compiled``). Falls back to per-call events when the
            candidate cannot be captured.

    Raises:
        ValueError: the candidate cannot run here (the message says why); otherwise whatever
        the backend raises (the caller records it as unavailable).

    Example::

        >>> from loka_torchrec.evidence import BF16
        >>> time_gemm(BF16, GemmRole.FORWARD, GemmShape(32, 16, 8), dtype=torch.float32, device="cpu", reps=3).n
        3
    """
    if reps < 1:
        raise ValueError(f"reps: expected a positive int, got {reps}")
    device = torch.device(device)
    warmup = max(2, reps // 5) if warmup is None else warmup
    run = resolve_candidate(choice, role, shape, device, grad_format=grad_format)
    if isinstance(run, str):
        raise ValueError(f"{choice} cannot run {role.value} at {shape} on {device}: {run}")
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = [
        (
            torch.randn(shape.m, shape.k, generator=gen, device=device, dtype=torch.float32).to(dtype),
            torch.randn(shape.n, shape.k, generator=gen, device=device, dtype=torch.float32).to(dtype),
        )
        for _ in range(_rotation_sets(shape, dtype, device))
    ]
    for i in range(warmup):
        a, b = sets[i % len(sets)]
        run.gemm(a, b, dtype)
    times = []
    replayed = None
    if device_time and device.type == "cuda":
        calls = [lambda a=a, b=b: run.gemm(a, b, dtype) for a, b in sets]
        replayed = graph_replay_ms(calls, reps=reps, device=device)
    if replayed is not None:
        times = replayed
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (start, end) in enumerate(events):
            a, b = sets[i % len(sets)]
            start.record()
            run.gemm(a, b, dtype)
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for i in range(reps):
            a, b = sets[i % len(sets)]
            t0 = time.perf_counter()
            run.gemm(a, b, dtype)
            times.append((time.perf_counter() - t0) * 1e3)
    return iqr_interval(times)


class SpeedCache:
    """Memoizes :func:`time_gemm` by ``(candidate, role, shape, dtype, device)``; failures are cached too."""

    def __init__(self, *, reps: int, grad_format: "Fp8Format | str" = Fp8Format.E4M3, device_time: bool = False) -> None:
        self.reps = reps
        self.grad_format = grad_format
        self.device_time = device_time  # time as CUDA-graph replays (see time_gemm)
        self._times: Dict[Tuple, "Interval | str"] = {}

    def time(self, choice: KernelChoice, role: GemmRole, shape: GemmShape, *, dtype: torch.dtype, device: torch.device) -> "Interval | str":
        """The timing, or a string with the reason the candidate could not run."""
        run = resolve_candidate(choice, role, shape, device, grad_format=self.grad_format)
        if isinstance(run, str):
            return run
        # Roles whose recipes have the same operand formats share a timing at the same shape.
        key = (run, (shape.m, shape.k, shape.n), dtype, str(device))
        if key not in self._times:
            try:
                self._times[key] = time_gemm(
                    choice, role, shape, dtype=dtype, device=device, reps=self.reps, grad_format=self.grad_format,
                    device_time=self.device_time,
                )
            except Exception as exc:  # a kernel that fails at this shape is unavailable there, with its reason
                self._times[key] = f"{type(exc).__name__}: {exc}"
        return self._times[key]
