"""Measuring GEMM candidates: one role's work, its error against float64, its time.

Shared by the random-input evidence provider here and by the Probe (which supplies inputs drawn
from learned distributions instead of random ones).
"""

from __future__ import annotations

import math
import statistics
import time
import logging
from typing import Callable, List, Optional, Sequence

import torch

from loka_torchrec.dispatch.backends import get_backend
from loka_torchrec.dispatch.recipes import recipe_for
from loka_torchrec.evidence import GemmRole, Interval, KernelChoice
from loka_torchrec.fp8 import Fp8Format, mere

__all__ = ["excluded_note", "run_role_gemm", "mean_interval", "time_ms", "graph_replay_ms", "role_operands", "t_quantile_975"]

logger = logging.getLogger(__name__)

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30 (standard tables).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)


def t_quantile_975(df: int) -> float:
    """``t_{0.975, df}``: the table up to 30 degrees of freedom, a Cornish-Fisher series beyond."""
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054  # the normal quantile; the series corrects it by powers of 1/df
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean with a Student-t 95% confidence interval (method ``"t95"``)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, mean, mean, 1, "none")
    half = t_quantile_975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t95")


def role_operands(role: GemmRole, x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor):
    """The ``(A, B)`` operands of ``role`` for a linear layer (see :mod:`loka_torchrec.evidence`).

    Args:
        x: ``(rows, in_features)`` layer input.
        weight: ``(out_features, in_features)``.
        grad_out: ``(rows, out_features)`` gradient of the layer output.
    """
    role = GemmRole(role)
    if role == GemmRole.FORWARD:
        return x, weight
    if role == GemmRole.GRAD_INPUT:
        return grad_out, weight.t()
    return grad_out.t(), x.t()


def run_role_gemm(
    choice: KernelChoice, role: GemmRole, a: torch.Tensor, b: torch.Tensor, *, grad_format: Fp8Format, out_dtype=torch.float32
) -> torch.Tensor:
    """``A @ B^T`` through ``choice``, quantization included.

    As in ``LokaLinear``, the operands are zero-padded to the backend's alignment (16 for
    ``torch._scaled_mm`` on CUDA) and the result cropped: the numbers are those of the GEMM
    training would run, at any shape.
    """
    backend = get_backend(choice.backend)
    if choice.is_high_precision:
        return backend.gemm(a, b, None, out_dtype)
    (m, k), n = a.shape, b.shape[0]
    align = backend.alignment(a.device)
    if align > 1 and (m % align or k % align or n % align):
        pad = lambda d: -(-d // align) * align  # noqa: E731
        a = torch.nn.functional.pad(a, (0, pad(k) - k, 0, pad(m) - m))
        b = torch.nn.functional.pad(b, (0, pad(k) - k, 0, pad(n) - n))
    out = backend.gemm(a, b, recipe_for(choice.recipe, role, grad_format=grad_format), out_dtype)
    return out[:m, :n] if out.shape != (m, n) else out


def excluded_note(exc: BaseException) -> str:
    """The ``note`` of a candidate that could not run: ``"excluded: <error, first line>"``."""
    text = str(exc).strip().splitlines()
    return f"excluded: {type(exc).__name__}: {text[0] if text else ''}"[:300]


def error_samples(
    choice: KernelChoice, role: GemmRole, pairs: Sequence, *, grad_format: Fp8Format
) -> List[float]:
    """MERE of ``choice`` against a float64 reference for each ``(A, B)`` pair."""
    out = []
    for a, b in pairs:
        ref = a.double() @ b.double().t()
        got = run_role_gemm(choice, role, a, b, grad_format=grad_format)
        out.append(mere(got, ref))
    return out


def release_generator(device: torch.device) -> None:
    """Hand ``device``'s default CUDA generator back to eager use after a failed capture.

    A capture marks the generators it registers as capturing and unmarks them only when it ends
    cleanly; one that raises leaves the mark, and every later random op on the device fails. A
    capture of one trivial kernel sets and clears the mark again. Harmless when nothing failed.
    """
    try:
        scratch = torch.zeros(1, device=device)
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                scratch.add_(1)
            del graph
    except Exception as exc:  # the device itself is in error: nothing more to do here
        logger.warning("could not reset the CUDA generator of %s after a failed capture: %s", device, exc)


def graph_replay_ms(calls: Sequence[Callable[[], object]], *, reps: int, device: torch.device) -> Optional[List[float]]:
    """Device time per call (ms) of ``calls`` captured in order into one CUDA graph: one sample per
    replay (the replay's time over ``len(calls)``), ``reps`` samples.

    This is the time the calls take inside a captured step, with no host launch gaps between their
    kernels; run each call once beforehand (compilation, workspaces). ``None`` when the calls
    cannot be captured (the caller then times them eagerly).
    """
    try:
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for call in calls:
                call()
    except Exception as exc:  # noqa: BLE001 - any capture failure means: time eagerly
        logger.info("timing in a CUDA graph failed (%s: %s); timing eagerly", type(exc).__name__, exc)
        release_generator(device)
        return None
    graph.replay()  # the first replay uploads the graph
    times: List[float] = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return times


def time_ms(fn: Callable[[], object], *, reps: int, device: torch.device, warmup: int = 1, device_time: bool = False) -> Interval:
    """Median and inter-quartile range of ``fn``'s run time in milliseconds (method ``"iqr"``).

    CUDA: CUDA events around each call after ``warmup`` calls; with ``device_time``, ``fn``
    replayed in a CUDA graph instead (:func:`graph_replay_ms`: no host time), falling back to
    the events if it cannot be captured. CPU: ``time.perf_counter``.
    """
    for _ in range(warmup):
        fn()
    times: List[float] = []
    replayed = graph_replay_ms([fn], reps=reps, device=device) if device_time and device.type == "cuda" else None
    if replayed is not None:
        times = replayed
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    # "inclusive": quartiles within the observed range (the default extrapolates, below 0 for n=2).
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) >= 2 else [times[0]] * 3
    return Interval(statistics.median(times), min(q[0], statistics.median(times)), max(q[2], statistics.median(times)), len(times), "iqr")
