"""What the safety valve does at a monitoring step: verdicts, fallback, recovery and readmission.

The signals are :mod:`loka_torchrec.probe.valve`'s (a layer's merged statistics against those its
kernels were chosen on). Here, per layer, from those signals:

* a gradient or input kurtosis spike that at least ``batch_event_share`` of the layers running
  bf16 by plan show at the same step is the batch's (a few heavy-tailed samples lift every
  layer's kurtosis, in bf16 as much as in FP8): it is logged, as a ``batch_event`` of the run,
  and trips no layer. Each trip costs bf16 steps, a recompile and a step-time window, and
  tripping after the step protects no step the batch has already passed through;
* a ``"planned"`` layer that trips, and that the consumer guards (it runs an FP8 GEMM or waits to),
  falls back: ``consumer.fallback(layer, reason, step=step)`` sends it to bf16; a tripping layer
  that runs bf16 has nothing to fall back from, and its triggers are only logged;
* a ``"fallback"`` layer collects recovery statistics over the probe steps that trip nothing; a
  step that trips again restarts the recovery from that step's statistics (when finite);
* after ``readmit_windows`` clean probe steps the layer is re-evaluated on its recovery
  statistics (by the caller) and readmitted (:meth:`SafetyValve.readmit`).

Verdicts are computed on every rank from merged statistics and broadcast from rank 0, so all
ranks act alike.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from loka_torchrec.evidence import EvidenceConsumer
from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.layer_state import LayerState, LayerStatus
from loka_torchrec.probe.merge import Ranks
from loka_torchrec.probe.reports import ProbeReports
from loka_torchrec.probe.step_end import MergedStep, merged_into
from loka_torchrec.probe.valve import Trigger, check_shift, describe, nonfinite_spread

__all__ = ["SafetyValve", "ValveAction"]

logger = logging.getLogger("loka_torchrec.probe")



class ValveAction(enum.Enum):
    """What the safety valve does to one layer at a monitoring step."""

    OK = "ok"  # nothing: a planned layer that did not trip, or one that runs bf16 anyway
    FALLBACK = "fallback"  # a guarded planned layer tripped: to bf16, recovery starts
    RESTART = "restart"  # a fallen-back layer tripped again: its recovery restarts from this step
    RECOVER = "recover"  # a fallen-back layer's step tripped nothing: one more clean window
    IDLE = "idle"  # a fallen-back layer that saw no rows this step


Verdicts = Dict[str, Tuple[ValveAction, List[Dict[str, Any]]]]
"""Layer name -> its action and the triggers (as dicts) behind it."""


class SafetyValve:
    """Judges every layer at a monitoring step and acts on the verdicts.

    Args:
        config: the Probe's configuration (trigger thresholds, ``readmit_windows``).
        consumer: Dispatch, told of each fallback and readmission, or ``None``.
        reports: where the fallback and readmission events go.
        ranks: the ranks that must agree (rank 0's verdicts are broadcast).
    """

    def __init__(self, config: ProbeConfig, consumer: Optional[EvidenceConsumer], reports: ProbeReports, ranks: Ranks) -> None:
        self._config = config
        self._consumer = consumer
        self._reports = reports
        self._ranks = ranks

    def act(
        self, step: int, states: Sequence[LayerState], merged: MergedStep, guarded: Set[str], records: Dict[str, Dict[str, Any]]
    ) -> List[str]:
        """Judge ``states`` on ``merged``, act on the verdicts, note them in ``records``; returns the
        layers that have recovered and are due for re-evaluation and :meth:`readmit`."""
        verdicts = self._ranks.broadcast(self._judge(states, merged, guarded))
        self._note_batch_events(step, verdicts)
        reevaluate: List[str] = []
        for state, m_act, m_grad in zip(states, merged.act, merged.grad):
            action, trigger_dicts = verdicts[state.name]
            triggers = [Trigger(**t) for t in trigger_dicts]
            record = records[state.name]
            if triggers:
                record["triggers"] = trigger_dicts
            finite = not any(t.signal == "nonfinite" for t in triggers)
            if action is ValveAction.FALLBACK:
                # The tripping window itself is not part of the recovery: a transient spike would
                # otherwise inflate the reference the layer is readmitted with.
                state.state, state.reason, state.clean_windows = LayerStatus.FALLBACK, describe([t for t in triggers if t.trips]), 0
                state.recovery_act = state.recovery_grad = None
                state.reset_reservoir()
                logger.warning("Probe: step %d: layer %s falls back to bf16: %s", step, state.name, state.reason)
                if self._consumer is not None:
                    self._consumer.fallback(state.name, state.reason, step=step)
                self._reports.event(step, state.name, "fallback", state.reason, triggers=trigger_dicts)
                record["event"] = "fallback"
            elif action is ValveAction.RESTART:
                # The distribution moved again: the new level starts a new recovery (when finite).
                fresh = finite and m_act.count > 0
                state.recovery_act, state.recovery_grad = (m_act.clone(), m_grad.clone()) if fresh else (None, None)
                state.clean_windows = 1 if fresh else 0
                record["event"] = "recovering"
            elif action is ValveAction.RECOVER:
                state.recovery_act = merged_into(state.recovery_act, m_act)
                state.recovery_grad = merged_into(state.recovery_grad, m_grad)
                state.clean_windows += 1
                record["event"] = "recovering"
                if state.clean_windows >= self._config.readmit_windows:
                    reevaluate.append(state.name)
            record["state"] = state.state.value
            record["decision"] = {"state": state.state.value, "reason": state.reason}
        return reevaluate

    def readmit(self, step: int, states: Sequence[LayerState], records: Dict[str, Dict[str, Any]], *, replanned: bool) -> None:
        """Readmit the re-evaluated ``states``: their recovery statistics become the reference,
        and ``consumer.readmit`` gives them their planned kernels again."""
        for state in states:
            state.reference_act, state.reference_grad = state.recovery_act, state.recovery_grad
            state.recovery_act = state.recovery_grad = None
            state.state, state.clean_windows = LayerStatus.PLANNED, 0
            reason = (f"statistics settled for {self._config.readmit_windows} probe step(s); "
                      f"re-evaluated{' and re-planned' if replanned else ''}")  # fmt: skip
            state.reason = ""
            if self._consumer is not None:
                self._consumer.readmit(state.name, step=step)
            logger.warning("Probe: step %d: layer %s readmitted: %s", step, state.name, reason)
            self._reports.event(step, state.name, "readmit", reason)
            records[state.name].update(event="readmit", state=state.state.value, decision={"state": state.state.value, "reason": reason})

    def _note_batch_events(self, step: int, verdicts: Verdicts) -> None:
        """Log, once per step and tensor, a spike judged to be the batch's, and note it in the run's events."""
        seen: Dict[str, Tuple[str, List[str]]] = {}
        for name, (_, trigger_dicts) in verdicts.items():
            for t in trigger_dicts:
                if t.get("batch_event"):
                    seen.setdefault(f"{t['tensor']} {t['signal']}", (t["batch_event"], []))[1].append(name)
        for what, (witnesses, layers) in sorted(seen.items()):
            reason = f"{what} on {len(layers)} layer(s), and on {witnesses}: the batch's, not FP8's; no layer trips on it"
            logger.warning("Probe: step %d: %s", step, reason)
            self._reports.event(step, None, "batch_event", reason, layers=sorted(layers))

    def _batch_events(
        self, states: Sequence[LayerState], triggers: Dict[str, List[Trigger]], judged: Dict[str, Set[str]], guarded: Set[str]
    ) -> Dict[str, str]:
        """Tensor (``"act"``, ``"grad"``) -> who else showed its kurtosis spike, where enough of the
        layers running bf16 by plan show it (``batch_event_share``, at least two of them).

        ``judged``: per layer, the tensors compared against a reference at this step.
        """
        share = self._config.batch_event_share
        if share is None:
            return {}
        bf16 = [s.name for s in states if s.state is LayerStatus.PLANNED and s.name not in guarded]
        out: Dict[str, str] = {}
        for tensor in ("act", "grad"):
            witnesses = [name for name in bf16 if tensor in judged[name]]
            spiked = [name for name in witnesses if any(t.tensor == tensor and t.signal == "kurtosis_spike" for t in triggers[name])]
            if len(spiked) >= max(2, share * len(witnesses)):  # spiked is a subset of witnesses
                out[tensor] = f"{len(spiked)} of {len(witnesses)} layers that run bf16"
        return out

    def _judge(self, states: Sequence[LayerState], merged: MergedStep, guarded: Set[str]) -> Verdicts:
        """Each layer's :class:`ValveAction` and the triggers behind it."""
        triggers_of: Dict[str, List[Trigger]] = {}
        judged: Dict[str, Set[str]] = {}
        for state, m_act, m_grad in zip(states, merged.act, merged.grad):
            digest = merged.digests[state.name]
            if state.state is LayerStatus.PLANNED:
                ref_act, ref_grad = state.reference_act, state.reference_grad
            else:
                ref_act, ref_grad = state.recovery_act, state.recovery_grad
            triggers: List[Trigger] = []
            judged[state.name] = set()
            if m_act.rows:
                triggers += check_shift("act", ref_act.summary() if ref_act is not None else None, digest.merged_act, self._config)
                if ref_act is not None:
                    judged[state.name].add("act")
            if m_grad.rows:
                ref = ref_grad.summary() if ref_grad is not None and not ref_grad.is_empty else None
                triggers += check_shift("grad", ref, digest.merged_grad, self._config)
                if ref is not None:
                    judged[state.name].add("grad")
            if digest.weight["nonfinite"]:
                triggers.append(Trigger("weight", "nonfinite", float(digest.weight["nonfinite"]), 0.0, 0.0))
            # Name the recipes that spread an inf/NaN (tensorwise: the whole product turns NaN).
            kernels = getattr(state.module, "kernels", None)
            triggers_of[state.name] = [
                dataclasses.replace(t, spread=nonfinite_spread(t.tensor, kernels)) if t.signal == "nonfinite" else t
                for t in triggers
            ]
        batch = self._batch_events(states, triggers_of, judged, guarded)
        verdicts: Verdicts = {}
        for state, m_act in zip(states, merged.act):
            triggers = [
                dataclasses.replace(t, batch_event=batch[t.tensor]) if t.signal == "kurtosis_spike" and t.tensor in batch else t
                for t in triggers_of[state.name]
            ]
            trips = any(t.trips for t in triggers)
            if state.state is LayerStatus.PLANNED:
                # A layer that runs bf16 has nothing to fall back from; its triggers are only logged.
                action = ValveAction.FALLBACK if trips and state.name in guarded else ValveAction.OK
            elif state.state is LayerStatus.FALLBACK:
                action = ValveAction.RESTART if trips else (ValveAction.RECOVER if m_act.count else ValveAction.IDLE)
            else:
                action = ValveAction.OK
            verdicts[state.name] = (action, [t.to_dict() for t in triggers])
        return verdicts
