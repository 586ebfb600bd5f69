"""What the Probe writes: one record per layer per report, the events, and rank 0's ``summary.json``.

The files and their fields are described in :mod:`loka_torchrec.probe.logs`. Every report appends
this rank's records to ``RUN_DIR/probe/rank{r}.jsonl``; rank 0 rewrites ``summary.json`` when it
has news (see :meth:`ProbeReports.write`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

from loka_torchrec.probe.layer_state import LayerState, StepDigest
from loka_torchrec.probe.logs import LOG_VERSION, ProbeLog, write_json_atomic
from loka_torchrec.probe.merge import Ranks

__all__ = ["ProbeReports", "SUMMARY_INTERVAL_S"]

SUMMARY_INTERVAL_S = 300.0  # seconds between two rewrites of summary.json without news (see ProbeReports.write)


class ProbeReports:
    """The records, events and summary of one rank's Probe.

    Args:
        log: this rank's log file (its folder also holds ``summary.json``).
        layers: the Probe's layer states, by FQN.
        ranks: this rank and the number of ranks, written into every record (rank 0 writes the summary).
        seconds: the Probe's time account; writing adds to ``"logs"``.
    """

    def __init__(self, log: ProbeLog, layers: Dict[str, LayerState], ranks: Ranks, seconds: Dict[str, float]) -> None:
        self.log = log
        self.events: List[Dict[str, Any]] = []
        self._layers = layers
        self._rank = ranks.rank
        self._world_size = ranks.world_size
        self._seconds = seconds
        self._events_in_summary = 0
        self._summary_written_at: Optional[float] = None  # perf_counter of the last summary.json
        self.reports = 0

    # ------------------------------------------------------------------------------ records
    def record(self, step: int, state: LayerState, digest: StepDigest, *, phase: str) -> Dict[str, Any]:
        """The rank-log record of ``state`` at probe step ``step`` (``phase``: ``"warmup"``/``"monitor"``)."""
        return {
            "v": LOG_VERSION,
            "step": step,
            "rank": self._rank,
            "world_size": self._world_size,
            "layer": state.name,
            "event": "probe",
            "phase": phase,
            "shape": state.shape_dict(),
            "stats": {
                "act": {"local": digest.local_act, "merged": digest.merged_act, "rank_deviation": digest.deviation_act},
                "grad": {"local": digest.local_grad, "merged": digest.merged_grad, "rank_deviation": digest.deviation_grad},
                "weight": digest.weight,
            },
            "state": state.state.value,
        }

    def plan_record(self, step: int, state: LayerState) -> Dict[str, Any]:
        """The record of a plan made at a step that probed nothing (no statistics of its own)."""
        return {"v": LOG_VERSION, "step": step, "rank": self._rank, "world_size": self._world_size, "layer": state.name, "event": "plan", "phase": "warmup", "shape": state.shape_dict()}

    def event(self, step: int, layer: Optional[str], event: str, reason: str, **extra: Any) -> None:
        """Note a plan or safety-valve event (``layer`` ``None``: about every layer)."""
        entry = {"step": step, "layer": layer, "event": event, "reason": reason, **extra}
        self.events.append(entry)
        if layer is not None:
            self._layers[layer].events.append(entry)

    def restore_events(self, events: List[Dict[str, Any]]) -> None:
        """The events of a resumed run; the next report rewrites ``summary.json``."""
        self.events = list(events)
        self._events_in_summary = 0

    # ------------------------------------------------------------------------------ files
    def write(self, step: int, records: Dict[str, Dict[str, Any]], *, planned_now: bool, summary: Callable[[], Dict[str, Any]]) -> None:
        """Append this report to the rank log; rank 0 rewrites ``summary.json`` (``summary()``) when it has news.

        The summary (every layer's history, evidence and events) is rewritten at the report that
        planned, at one with a new safety-valve event, at the first report at least
        ``SUMMARY_INTERVAL_S`` seconds after the last rewrite, and at the Probe's ``close``:
        serializing it costs far more than the report itself, so a time bound caps that cost
        whatever the cadence.
        """
        t0 = time.perf_counter()
        for name in self._layers:
            if name in records:
                self.log.write(records[name])  # flushed per line: a killed process loses nothing
        self.reports += 1
        stale = self._summary_written_at is None or t0 - self._summary_written_at >= SUMMARY_INTERVAL_S
        news = planned_now or len(self.events) != self._events_in_summary or stale
        if self._rank == 0 and news:
            self.write_summary(summary())
            self._events_in_summary = len(self.events)
            self._summary_written_at = time.perf_counter()
        self._seconds["logs"] += time.perf_counter() - t0

    def write_summary(self, summary: Dict[str, Any]) -> None:
        """Replace ``summary.json`` (atomically) with ``summary``."""
        write_json_atomic(self.log.dir / "summary.json", summary)

    def layer_summaries(self) -> Dict[str, Dict[str, Any]]:
        """``summary.json``'s ``layers`` section: per layer its state, latest and reference
        statistics, thinned history, evidence and events."""
        layers = {}
        for name, state in self._layers.items():
            last = state.history[-1] if state.history else {}
            layers[name] = {
                "shape": state.shape_dict(),
                "state": state.state.value,
                "reason": state.reason,
                "latest": last,
                "latest_stats": state.latest_stats,
                "reference": {
                    "act": state.reference_act.summary() if state.reference_act is not None else None,
                    "grad": state.reference_grad.summary() if state.reference_grad is not None else None,
                },
                "weight": state.weight.summary(),
                "history": _thin(state.history),
                "evidence_step": state.evidence_step,
                "evidence": state.evidence_records,
                "events": state.events,
            }
        return layers


def _thin(history: List[Dict[str, Any]], head: int = 64, tail: int = 192) -> List[Dict[str, Any]]:
    """The first ``head`` and last ``tail`` entries: summary.json stays small; rank logs keep everything."""
    return history if len(history) <= head + tail else history[:head] + history[-tail:]
