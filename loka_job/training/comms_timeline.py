"""What the collectives cost a profiled step: time per collective and phase, and how much of it is exposed.

:func:`comms_breakdown` takes the profiled window's events (device kernels on CUDA, CPU operators
on a CPU run), each with the phase of the step it was launched in, and reports per step:

* per collective kind (:data:`KINDS`: the embedding ``all_to_all`` and the dense ``all_reduce``
  are the two that matter for a TorchRec job; ``other`` is every other collective) and phase
  (:data:`PHASES`): the time its events ran;
* ``exposed_ms_per_step``: per kind, and in all, the time a collective of that kind ran while no
  other (non-collective) event did: the part the step waited on, since overlapped communication
  costs nothing while compute runs beside it. NCCL kernels spin while a peer is late, so a slow
  rank's lag shows up here too.

The phase of an event comes from TorchRec's train pipeline, which wraps its forward and backward
in ``## forward <i> ##`` / ``## backward <i> ##`` ranges (``record_function``): a collective whose
launch started inside a backward range is ``backward``, inside a forward range ``forward``, else
``outside`` (the next batch's input distribution, which the pipeline starts before the current
batch's forward, and anything else). See :class:`PhaseRanges`. A collective launched inside the
FP8 all-reduce hook's range (:data:`loka_torchrec.comms.fp8_allreduce.PROFILER_RANGE`) is the dense
``all_reduce``, whatever its kernel (an all-to-all and an all-gather there).
"""

from __future__ import annotations

import bisect
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from loka_torchrec.comms.fp8_allreduce import PROFILER_RANGE as _FP8_ALLREDUCE_RANGE

__all__ = ["KINDS", "PHASES", "collective_kind", "comms_breakdown", "PhaseRanges"]

KINDS = ("all_to_all", "all_reduce", "other")
PHASES = ("forward", "backward", "outside")

# NCCL runs all_to_all as grouped send/recv ("ncclDevKernel_SendRecv"); gloo and c10d name the
# collective ("gloo:all_to_all", "c10d::alltoall_base_", "c10d::allreduce_").
_ALL_TO_ALL = re.compile(r"all_?to_?all|sendrecv", re.IGNORECASE)
_ALL_REDUCE = re.compile(r"all_?reduce", re.IGNORECASE)
_FORWARD_RANGE = re.compile(r"^## forward\b")
_BACKWARD_RANGE = re.compile(r"^## backward\b")


def collective_kind(name: str) -> str:
    """``"all_to_all"``, ``"all_reduce"`` or ``"other"`` for a collective's kernel or operator name."""
    if _ALL_TO_ALL.search(name):
        return "all_to_all"
    if _ALL_REDUCE.search(name):
        return "all_reduce"
    return "other"


class PhaseRanges:
    """The forward and backward ranges of the pipeline's steps, and the FP8 all-reduce hook's ranges
    (host times, microseconds): the phase of a launch, and the kind of a collective launched there.

    Args:
        ranges: ``(name, start_us, end_us)`` of the window's host-side ranges; those named as
            TorchRec's pipeline names its forward and backward are kept, the rest ignored.
    """

    def __init__(self, ranges: Iterable[Tuple[str, float, float]]) -> None:
        self._ranges: Dict[str, List[Tuple[float, float]]] = {"forward": [], "backward": [], "dense_all_reduce": []}
        for name, start, end in ranges:
            if _BACKWARD_RANGE.search(name):
                self._ranges["backward"].append((start, end))
            elif _FORWARD_RANGE.search(name):
                self._ranges["forward"].append((start, end))
            elif name == _FP8_ALLREDUCE_RANGE:
                self._ranges["dense_all_reduce"].append((start, end))
        for spans in self._ranges.values():
            spans.sort()
        self._starts = {phase: [s for s, _ in spans] for phase, spans in self._ranges.items()}

    def __bool__(self) -> bool:
        return bool(self._ranges["forward"] or self._ranges["backward"])

    def _inside(self, phase: str, t_us: float) -> bool:
        i = bisect.bisect_right(self._starts[phase], t_us) - 1
        return i >= 0 and self._ranges[phase][i][1] >= t_us

    def phase_of(self, launch_us: Optional[float]) -> str:
        """The phase whose range holds the host time ``launch_us``; ``"outside"`` when none does or
        the launch time is unknown. Backward first: a forward range never holds a backward one."""
        if launch_us is None:
            return "outside"
        for phase in ("backward", "forward"):
            if self._inside(phase, launch_us):
                return phase
        return "outside"

    def kind_of(self, launch_us: Optional[float]) -> Optional[str]:
        """``"all_reduce"`` where ``launch_us`` falls in the FP8 all-reduce hook's range, else ``None``
        (the kernel's name decides, :func:`collective_kind`)."""
        if launch_us is not None and self._inside("dense_all_reduce", launch_us):
            return "all_reduce"
        return None



def _union(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The disjoint, sorted intervals covering ``intervals``."""
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _uncovered_us(intervals: Sequence[Tuple[float, float]], cover: Sequence[Tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` outside the (disjoint, sorted) ``cover``."""
    total = 0.0
    starts = [s for s, _ in cover]
    for start, end in _union(intervals):
        covered = 0.0
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while i < len(cover) and cover[i][0] < end:
            covered += max(0.0, min(end, cover[i][1]) - max(start, cover[i][0]))
            i += 1
        total += (end - start) - covered
    return total


def comms_breakdown(events: Sequence, *, is_collective, num_steps: int) -> Dict[str, object]:
    """Per-step collective time by kind and phase, and exposed time (module docstring); ms.

    Args:
        events: the window's events, each with ``name``, ``start_us``, ``end_us``, ``self_us``,
            ``phase`` (one of :data:`PHASES`; events that are not collectives may have any) and
            optionally ``kind`` (one of :data:`KINDS`, where the launch says more than the name).
        is_collective: ``name -> bool``: whether an event is a collective (the profiler's
            ``comms`` category).
        num_steps: steps in the window.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
    per_kind = {kind: {phase: 0.0 for phase in PHASES} for kind in KINDS}
    spans: Dict[str, List[Tuple[float, float]]] = {kind: [] for kind in KINDS}
    compute: List[Tuple[float, float]] = []
    for event in events:
        if not is_collective(event.name):
            compute.append((event.start_us, event.end_us))
            continue
        kind = getattr(event, "kind", None) or collective_kind(event.name)
        phase = event.phase if event.phase in PHASES else "outside"
        per_kind[kind][phase] += event.self_us / 1e3
        spans[kind].append((event.start_us, event.end_us))
    cover = _union(compute)
    exposed = {kind: _uncovered_us(spans[kind], cover) / 1e3 / num_steps for kind in KINDS}
    all_spans = [span for kind in KINDS for span in spans[kind]]
    return {
        "ms_per_step": {
            kind: {phase: ms / num_steps for phase, ms in phases.items()} for kind, phases in per_kind.items()
        },
        "total_ms_per_step": sum(sum(p.values()) for p in per_kind.values()) / num_steps,
        "exposed_ms_per_step": {**exposed, "all": _uncovered_us(all_spans, cover) / 1e3 / num_steps},
    }
