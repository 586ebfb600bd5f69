"""Measuring GEMM candidates: one role's work, its error against float64, its time.

Shared by Dispatch's random-input evidence provider and by the Probe (which supplies inputs drawn
from learned distributions instead of random ones); intervals come from
:mod:`loka_torchrec.gemm.intervals`.
"""

from __future__ import annotations

import time
import logging
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from loka_torchrec.evidence import GemmRole, GemmShape, Interval, KernelChoice
from loka_torchrec.gemm.candidates import resolve_candidate
from loka_torchrec.fp8 import Fp8Format, mere, tensor_amax
from loka_torchrec.fp8.scaling import check_scaling
from loka_torchrec.gemm.intervals import iqr_interval

__all__ = ["DelayedOperandAmax", "call_times_ms", "excluded_note", "run_role_gemm", "time_ms", "graph_replay_ms", "role_operands"]

logger = logging.getLogger(__name__)

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


class DelayedOperandAmax:
    """The amaxes that scale successive draws of one role's operands as training scales them.

    Under ``"current"`` scaling every operand is scaled by its own amax: ``(None, None)``. Under
    ``"delayed"`` forward scaling (a compiled layer) the operand that is the layer's input, ``x``
    (the forward's ``A``) or ``x^T`` (grad-weight's ``B``), is scaled by the largest amax of the
    draws before it, as a compiled call is by the calls before it, so a draw whose input is
    larger than all earlier ones saturates as a growing input does in training; the first draw
    (a run's first call) uses its own. Under ``"delayed"`` gradient scaling the operand that is
    the layer's output gradient, ``dy`` (grad-input's ``A``) or ``dy^T`` (grad-weight's ``A``), is
    scaled the same way. The weight keeps its own amax: it changes little from one step to the
    next, so its own amax stands for its history.
    """

    _INPUT_OPERAND = {GemmRole.FORWARD: 0, GemmRole.GRAD_WEIGHT: 1}
    _GRAD_OPERAND = {GemmRole.GRAD_INPUT: 0, GemmRole.GRAD_WEIGHT: 0}

    def __init__(self, role: GemmRole, forward_scaling: str, grad_scaling: str = "current") -> None:
        check_scaling(forward_scaling, "forward_scaling")
        check_scaling(grad_scaling, "grad_scaling")
        role = GemmRole(role)
        slots = set()
        if forward_scaling == "delayed" and role in self._INPUT_OPERAND:
            slots.add(self._INPUT_OPERAND[role])
        if grad_scaling == "delayed" and role in self._GRAD_OPERAND:
            slots.add(self._GRAD_OPERAND[role])
        self._slots = sorted(slots)
        self._largest: List[Optional[torch.Tensor]] = [None, None]

    @property
    def delayed(self) -> bool:
        """Whether any operand of this role is scaled by earlier draws (the draws' order then matters)."""
        return bool(self._slots)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The amaxes for the next draw ``(A, B)`` (``None``: its own), and that draw recorded."""
        given: List[Optional[torch.Tensor]] = [None, None]
        for slot in self._slots:
            own = tensor_amax((a, b)[slot].detach()).float()
            largest = self._largest[slot]
            given[slot] = own if largest is None else largest
            self._largest[slot] = own if largest is None else torch.fmax(largest, own)
        return given[0], given[1]


def run_role_gemm(
    choice: KernelChoice, role: GemmRole, a: torch.Tensor, b: torch.Tensor, *, grad_format: Fp8Format, out_dtype=torch.float32,
    amax: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
) -> torch.Tensor:  # fmt: skip
    """``A @ B^T`` through ``choice``, quantization included (``amax``: see :meth:`CandidateRun.gemm`).

    As in ``LokaLinear``, the operands are zero-padded to the backend's alignment (16 for
    ``torch._scaled_mm`` on CUDA) and the result cropped: the numbers are those of the GEMM
    training would run, at any shape.
    """
    shape = GemmShape(a.shape[0], a.shape[1], b.shape[0])
    run = resolve_candidate(choice, role, shape, a.device, grad_format=grad_format)
    if isinstance(run, str):
        raise ValueError(f"{choice} cannot run {GemmRole(role).value} GEMM {shape} on {a.device}: {run}")
    return run.gemm(a, b, out_dtype, amax)


def excluded_note(exc: BaseException) -> str:
    """The ``note`` of a candidate that could not run: ``"excluded: <error, first line>"``."""
    text = str(exc).strip().splitlines()
    return f"excluded: {type(exc).__name__}: {text[0] if text else ''}"[:300]


def error_samples(
    choice: KernelChoice, role: GemmRole, pairs: Sequence, *, grad_format: Fp8Format, forward_scaling: str = "current",
    grad_scaling: str = "current",
) -> List[float]:
    """MERE of ``choice`` against a float64 reference for each ``(A, B)`` pair, in order, scaled
    as ``forward_scaling`` and ``grad_scaling`` scale training's operands (:class:`DelayedOperandAmax`)."""
    out = []
    amaxes = DelayedOperandAmax(role, forward_scaling, grad_scaling)
    for a, b in pairs:
        ref = a.double() @ b.double().t()
        got = run_role_gemm(choice, role, a, b, grad_format=grad_format, amax=amaxes(a, b))
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


def call_times_ms(fn: Callable[[], object], *, reps: int, device: torch.device, warmup: int = 1) -> List[float]:
    """``fn``'s run time in milliseconds, once per call, for ``reps`` calls after ``warmup`` calls:
    CUDA events around each call on CUDA (the device synchronized first), ``time.perf_counter``
    elsewhere."""
    for _ in range(warmup):
        fn()
    times: List[float] = []
    if device.type == "cuda":
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
    return times


def time_ms(fn: Callable[[], object], *, reps: int, device: torch.device, warmup: int = 1, device_time: bool = False) -> Interval:
    """Median and inter-quartile range of ``fn``'s run time in milliseconds (method ``"iqr"``).

    CUDA: CUDA events around each call after ``warmup`` calls; with ``device_time``, ``fn``
    replayed in a CUDA graph instead (:func:`graph_replay_ms`: no host time), falling back to
    the events if it cannot be captured. CPU: ``time.perf_counter``.
    """
    if device_time and device.type == "cuda":
        for _ in range(warmup):
            fn()
        replayed = graph_replay_ms([fn], reps=reps, device=device)
        if replayed is not None:
            return iqr_interval(replayed)
        warmup = 0
    return iqr_interval(call_times_ms(fn, reps=reps, device=device, warmup=warmup))
