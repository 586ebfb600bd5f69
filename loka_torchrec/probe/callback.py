"""``ProbeCallback``: hooks that learn each layer's statistics during training and feed Dispatch.

Use from any training loop::

    probe = ProbeCallback(model, ProbeConfig(enabled=True), run_dir="runs/exp1", consumer=dispatcher)
    for step, batch in enumerate(loader):
        loss = model(batch).mean()
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
        probe.on_step_end(step)
    probe.close()

What happens, step by step:

* Hooks are registered only for probe steps (every ``every`` steps of the warm-up window, then the
  monitoring steps of :class:`~loka_torchrec.probe.cadence.MonitorCadence`): a forward hook
  on every layer folds the layer's input rows into this step's statistics and registers a tensor
  hook on the output that folds the output gradient rows in during the backward pass. Other steps
  run without any hook (no cost at all).
* At the end of a probe step, every rank all-reduces the step's sufficient statistics
  (:func:`~loka_torchrec.probe.merge.all_reduce_statistics`), writes one record per layer to
  ``RUN_DIR/probe/rank{r}.jsonl``, and rank 0 rewrites ``RUN_DIR/probe/summary.json``.
* At the end of the warm-up window the merged statistics of all warm-up probe steps are the
  reference: each rank measures error and speed for a share of the layers, the evidence is
  gathered on every rank, and ``consumer.replan(evidence, source="probe", step=step)`` is called
  (identically on every rank).
* After the warm-up window, monitoring steps come every ``every_after`` steps or, when their
  measured cost needs it, less often, so that they take at most ``monitor_budget`` of the
  training time (:mod:`loka_torchrec.probe.cadence`; all ranks agree on the interval).
  Each monitoring step is compared with the reference
  (:mod:`loka_torchrec.probe.valve`): a layer that trips is sent to bf16 with
  ``consumer.fallback(layer, reason, step=step)``; only the consumer's ``guarded_layers()``
  (those that run FP8, or wait to) can trip, and while none is guarded, as after a plan without
  FP8 GEMMs, the monitoring steps are skipped (no hooks, no collective). Once
  ``readmit_windows`` later probe steps show a settled distribution, the layer is re-evaluated
  on the new statistics; if some candidate's error grew past ``readmit_error_ratio`` times its
  plan-time error, Dispatch re-plans with the new evidence first; then
  ``consumer.readmit(layer, step=step)``.
  Verdicts are computed from merged statistics and broadcast from rank 0, so all ranks agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Set

import torch
from torch import nn

from loka_torchrec.evidence import CandidateEvidence, EvidenceConsumer
from loka_torchrec.peak_rises import PeakRises
from loka_torchrec.probe.cadence import MonitorCadence
from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.evaluate import device_name
from loka_torchrec.probe.evidence_rounds import LayerEvaluator, default_candidates, errors_grew, evidence_records
from loka_torchrec.probe.hooks import ProbeHooks, canonical_fqn, resolve_layers
from loka_torchrec.probe.layer_state import LayerState, LayerStatus
from loka_torchrec.probe.logs import LOG_VERSION, ProbeLog
from loka_torchrec.probe.merge import Ranks
from loka_torchrec.probe.reports import ProbeReports
from loka_torchrec.probe.step_end import merge_step, merged_into
from loka_torchrec.probe.valve_actions import SafetyValve

__all__ = ["ProbeCallback", "canonical_fqn", "default_candidates"]

logger = logging.getLogger("loka_torchrec.probe")


class ProbeCallback:
    """Learns per-layer statistics on probe steps and turns them into evidence for Dispatch.

    Args:
        model: the model being trained (possibly wrapped by DMP or DDP).
        config: a :class:`ProbeConfig`; with ``enabled=False`` the callback does nothing.
        run_dir: directory of the run; logs go to ``run_dir/probe/``.
        consumer: Dispatch (an :class:`EvidenceConsumer`): its ``managed_layers()`` are probed,
            its ``candidates()`` evaluated, and it receives ``replan``/``fallback``/``readmit``.
        layers: ``{fqn: module}`` to probe when there is no consumer; default: every
            ``nn.Linear`` in ``model`` (FQNs without wrapper prefixes).
        process_group: group to merge over (default: the world, when initialized).
        start_step: the first step number the loop will pass to :meth:`on_step_end`.

    Example::

        >>> import tempfile
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        >>> cfg = ProbeConfig(enabled=True, every=1, warmup_steps=2, samples=2, speed_reps=1, max_rows_per_step=16)
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     probe = ProbeCallback(model, cfg, run_dir=run_dir)
        ...     for step in range(2):
        ...         model(torch.randn(32, 8)).sum().backward()
        ...         probe.on_step_end(step)
        ...     probe.close()
        ...     sorted(probe.layer_names), probe.planned
        (['0', '2'], True)
    """

    def __init__(
        self,
        model: nn.Module,
        config: ProbeConfig,
        *,
        run_dir: str,
        consumer: Optional[EvidenceConsumer] = None,
        layers: Optional[Mapping[str, nn.Module]] = None,
        process_group: Optional[Any] = None,
        start_step: int = 0,
    ) -> None:
        if not isinstance(config, ProbeConfig):
            raise TypeError(f"config: expected a ProbeConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        self.config = config
        self.enabled = config.enabled
        self.planned = False
        self._closed = False
        self._layers: Dict[str, LayerState] = {}
        self._monitoring_steps: List[int] = []  # the steps after the warm-up window that probed
        self.skipped_monitoring_steps = 0  # monitoring steps skipped: no layer to guard
        self.seconds = {"hooks": 0.0, "merge": 0.0, "evaluate": 0.0, "evaluate_error": 0.0, "evaluate_speed": 0.0, "logs": 0.0}
        self.peak_rises = PeakRises()  # the layer evaluations that raised the device's peak memory
        self._hooks = ProbeHooks(self._layers, consumer, self.seconds)
        if not self.enabled:
            return
        self.model = model
        self.consumer = consumer
        self.run_dir = run_dir
        self.group = process_group
        ranks = Ranks.of(process_group)
        self.rank, self.world_size = ranks.rank, ranks.world_size
        for name, module in sorted(resolve_layers(model, consumer, layers).items()):
            self._layers[name] = LayerState(name, module, config)
        if not self._layers:
            logger.warning("Probe: no layers to probe (no consumer layers, no `layers`, no nn.Linear in the model)")
        self._log = ProbeLog(run_dir, self.rank)
        self._reports = ProbeReports(self._log, self._layers, ranks, self.seconds)
        self._evaluator = LayerEvaluator(self._layers, config, consumer, ranks, self.seconds, self.peak_rises)
        self._valve = SafetyValve(config, consumer, self._reports, ranks)
        self._probe_steps = 0
        self._last_step: Optional[int] = None
        self.cadence = MonitorCadence(config)
        self.resume_at(start_step)

    # ------------------------------------------------------------------------------ checkpoints
    _STATE_VERSION = 1
    # What a LayerState carries from one probe step to the next (not the per-step windows).
    _LAYER_FIELDS = (
        "act_amax", "grad_amax", "reference_act", "reference_grad", "recovery_act", "recovery_grad", "rows",
        "state", "clean_windows", "reason", "evidence", "evidence_step", "evidence_records", "history",
        "events", "weight", "reservoir",
    )  # fmt: skip

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to go on where this one stopped (for ``torch.save``).

        The learned statistics the plan was made from (the safety valve's reference), amax
        histories, the weight model, the reservoir, every layer's state (planned, tripped,
        recovering) with its evidence and events, and whether the plan was made. Tensors stay
        on their device; load with ``map_location`` to move them.
        """
        if not self.enabled:
            return {"version": self._STATE_VERSION, "enabled": False}
        layers = {name: {field: getattr(st, field) for field in self._LAYER_FIELDS} for name, st in self._layers.items()}
        for fields in layers.values():
            fields["state"] = fields["state"].value  # a plain str: loads with torch.load(weights_only=True)
        return {
            "version": self._STATE_VERSION,
            "enabled": True,
            "planned": self.planned,
            "probe_steps": self._probe_steps,
            "monitoring_steps": list(self._monitoring_steps),
            "cadence": self.cadence.state_dict(),
            "events": list(self._reports.events),
            "layers": layers,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; after it, the Probe does not re-plan a planned run.

        Raises:
            ValueError: the state is from another version, or its layers are not this Probe's.
        """
        if not self.enabled or not state.get("enabled", False):
            return
        if state.get("version") != self._STATE_VERSION:
            raise ValueError(f"probe state: version {state.get('version')!r}, expected {self._STATE_VERSION}")
        saved, mine = set(state["layers"]), set(self._layers)
        if saved != mine:
            raise ValueError(
                f"probe state: layers differ from this model's (only saved: {sorted(saved - mine)}; "
                f"only here: {sorted(mine - saved)})"
            )
        statuses = {name: _status(name, fields["state"]) for name, fields in state["layers"].items()}
        for name, fields in state["layers"].items():
            layer = self._layers[name]
            for field in self._LAYER_FIELDS:
                setattr(layer, field, fields[field])
            layer.state = statuses[name]
        self.planned = bool(state["planned"])
        self._probe_steps = int(state["probe_steps"])
        self._monitoring_steps = list(state.get("monitoring_steps", []))
        if "cadence" in state:  # states saved before the budgeted cadence start on the fixed grid
            self.cadence.load_state_dict(state["cadence"])
        self._reports.restore_events(state["events"])

    # ------------------------------------------------------------------------------ public API
    @property
    def layer_names(self) -> List[str]:
        return list(self._layers)

    @property
    def probing(self) -> bool:
        """Whether hooks are collecting statistics during the current step."""
        return self._hooks.armed

    def layer_state(self, name: str) -> LayerState:
        return self._layers[name]

    def input_amaxes(self, within: nn.Module) -> Dict[str, List[float]]:
        """The merged input amax of the probe steps each layer remembers (``probe.amax_history`` of
        them, warm-up and monitoring), for the layers inside ``within``, keyed by their name there
        (found by identity, so a copy of ``within`` has the same names): what a static serving scale
        may be taken from (``loka_torchrec.inference_modules(input_amaxes=...)``)."""
        local = {id(module): fqn for fqn, module in within.named_modules(remove_duplicate=False)}
        return {local[id(s.module)]: list(s.act_amax) for s in self._layers.values() if id(s.module) in local}

    @property
    def monitoring_paused(self) -> bool:
        """Whether monitoring steps are skipped: the plan is made and no layer is guarded (none runs
        an FP8 GEMM or waits to), so the safety valve has nothing to act on."""
        return self.enabled and self.planned and not self._guarded()

    @property
    def monitoring_steps(self) -> List[int]:
        """The steps after the warm-up window that collected statistics, in order."""
        return list(self._monitoring_steps)

    def is_probe_step(self, step: int) -> bool:
        """Whether ``step`` collects statistics (warm-up cadence, then the monitoring schedule,
        whose steps are skipped while monitoring is paused)."""
        return self.cadence.is_probe_step(step) and not self._skips(step)

    def resume_at(self, step: int) -> None:
        """The next step the loop runs is ``step`` (the start, or a resume after
        :meth:`load_state_dict`): the hooks are armed if it is a probe step, the step clock restarts."""
        if not self.enabled:
            return
        self.cadence.resume_at(step)
        self.cadence.restart_clock()
        self._hooks.disarm()
        self._arm_for(step)

    def on_step_end(self, step: int) -> None:
        """Call once after every optimizer step, with the step's number, on every rank."""
        if not self.enabled or self._closed:
            return
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step: expected an int, got {type(step).__name__}")
        self._last_step = step
        records: Dict[str, Dict[str, Any]] = {}
        planned_before = self.planned
        probed = self._hooks.armed
        if probed:
            self._hooks.disarm()
            records = self._end_probe_step(step)
        if not self.planned and step >= self.config.warmup_steps - 1 and self._probe_steps > 0:
            self._plan(step, records)
        if records:
            self._reports.write(step, records, planned_now=self.planned and not planned_before, summary=self._summary)
        # The step clock: plain steps are the reference of what a monitoring step costs.
        self.cadence.tick(plain=not probed and self.planned == planned_before)
        if probed and step >= self.config.warmup_steps:
            self._monitoring_steps.append(step)
            waiting = any(state.state is LayerStatus.FALLBACK for state in self._layers.values())  # the same on every rank
            at_most = self.config.readmit_every if waiting else 0
            interval = self.cadence.after_monitoring(step, self.group, at_most=at_most)  # collective
            if self.rank == 0 and self.config.monitor_budget:
                logger.info(
                    "Probe: monitoring step %d cost %s ms over a plain step; next one in %d steps (budget %.2f%%)",
                    step, "?" if self.cadence.last_extra_ms is None else f"{self.cadence.last_extra_ms:.1f}",
                    interval, 100 * self.config.monitor_budget,
                )
        self._arm_for(step + 1)

    def close(self) -> None:
        """Remove the hooks, flush the logs and write the final summary (rank 0). Idempotent."""
        if not self.enabled or self._closed:
            return
        self._hooks.disarm()
        self._closed = True
        if self.rank == 0:
            self._reports.write_summary(self._summary())
        self._log.close()

    def __enter__(self) -> "ProbeCallback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------ hooks
    def _guarded(self) -> Set[str]:
        """The layers the safety valve may send to bf16 (all of them without a consumer)."""
        if self.consumer is None:
            return set(self._layers)
        return set(self.consumer.guarded_layers()) & set(self._layers)

    def _skips(self, step: int) -> bool:
        """Whether the schedule's probe step ``step`` is a monitoring step skipped for want of a guarded layer."""
        return step >= self.config.warmup_steps and self.monitoring_paused

    def _arm_for(self, step: int) -> None:
        """Arm the hooks when ``step`` is a probe step, unless it is a monitoring step with no layer to guard
        (then the schedule moves one interval on; every rank decides alike, from the same plan)."""
        if not self.cadence.is_probe_step(step):
            return
        if self._skips(step):
            if self.skipped_monitoring_steps == 0 and self.rank == 0:
                logger.info("Probe: no layer runs an FP8 GEMM: monitoring steps are skipped until one does (from step %d)", step)
            self.skipped_monitoring_steps += 1
            self.cadence.skip(step)
            return
        self._hooks.arm()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside this block the hooks record nothing: passes that are not training steps (the
        gradient check's forward and backward on its own loss, between two steps while the next
        step's hooks are armed) must not enter the statistics the safety valve compares."""
        with self._hooks.paused():
            yield

    # ------------------------------------------------------------------------------ probe steps
    def _end_probe_step(self, step: int) -> Dict[str, Dict[str, Any]]:
        """Merge the step over the ranks, one record per layer; before the plan the step joins the
        reference statistics, after it the safety valve judges it."""
        t0 = time.perf_counter()
        self._probe_steps += 1
        states = list(self._layers.values())
        merged = merge_step(states, self.group, step)
        phase = "warmup" if not self.planned else "monitor"
        records = {s.name: self._reports.record(step, s, merged.digests[s.name], phase=phase) for s in states}
        if not self.planned:
            for state, m_act, m_grad in zip(states, merged.act, merged.grad):
                state.reference_act = merged_into(state.reference_act, m_act)
                state.reference_grad = merged_into(state.reference_grad, m_grad)
        else:
            reevaluate = self._valve.act(step, states, merged, self._guarded(), records)
            if reevaluate:
                self._reevaluate(step, reevaluate, records)
        for state in states:
            state.reset_windows()
        self.seconds["merge"] += time.perf_counter() - t0
        return records

    # ------------------------------------------------------------------------------ evidence
    def _all_evidence(self) -> List[CandidateEvidence]:
        return [ev for state in self._layers.values() for ev in state.evidence]

    def _plan(self, step: int, records: Dict[str, Dict[str, Any]]) -> None:
        """The evidence of every layer from its reference statistics, and the plan from it."""
        names = list(self._layers)
        results = self._evaluator.evaluate(names, {n: (self._layers[n].reference_act, self._layers[n].reference_grad) for n in names})
        for name, (evidence, details) in results.items():
            state = self._layers[name]
            state.evidence, state.evidence_step, state.state = evidence, step, LayerStatus.PLANNED
            state.evidence_records = evidence_records(evidence, details)
            state.reset_reservoir()  # the evidence is made: its rows are not read again
            record = records.get(name) or self._reports.plan_record(step, state)
            record.update(event="plan", evidence=state.evidence_records, state=state.state.value)
            if state.reference_act is not None:
                record["reference"] = {"act": state.reference_act.summary(), "grad": state.reference_grad.summary()}
            records[name] = record
        self.planned = True
        if self.consumer is not None:
            self.consumer.replan(self._all_evidence(), source="probe", step=step)
        self._reports.event(step, None, "replan", f"evidence for {len(results)} layer(s) at the end of the warm-up window")

    def _reevaluate(self, step: int, names: List[str], records: Dict[str, Dict[str, Any]]) -> None:
        """Evidence for the recovered layers ``names`` from their recovery statistics; a re-plan
        where some candidate's error grew; then their readmission."""
        results = self._evaluator.evaluate(names, {n: (self._layers[n].recovery_act, self._layers[n].recovery_grad) for n in names})
        replan = False
        for name in names:
            state = self._layers[name]
            evidence, details = results.get(name, ([], []))
            if errors_grew(state.evidence, evidence, self.config.readmit_error_ratio):
                replan = True
            state.evidence, state.evidence_step = evidence, step
            state.evidence_records = evidence_records(evidence, details)
            state.reset_reservoir()  # the evidence is made: its rows are not read again
            records[name]["evidence"] = state.evidence_records
        if replan and self.consumer is not None:
            self.consumer.replan(self._all_evidence(), source="probe", step=step)
            self._reports.event(step, None, "replan", f"errors grew for some of {', '.join(names)}")
        self._valve.readmit(step, [self._layers[n] for n in names], records, replanned=replan)

    # ------------------------------------------------------------------------------ summary
    def _summary(self) -> Dict[str, Any]:
        """``summary.json``: the run's progress, configuration and time account, every layer and every event."""
        device = next(iter(self._layers.values())).module.weight.device if self._layers else torch.device("cpu")
        return {
            "v": LOG_VERSION,
            "world_size": self.world_size,
            "step": self._last_step,
            "probe_steps": self._probe_steps,
            "planned": self.planned,
            "device": device_name(device),
            "config": dataclasses.asdict(self.config),
            "seconds": dict(self.seconds),
            "cadence": self.cadence.summary(),
            "monitoring_steps": list(self._monitoring_steps),
            "skipped_monitoring_steps": self.skipped_monitoring_steps,
            "layers": self._reports.layer_summaries(),
            "events": self._reports.events,
        }


def _status(layer: str, value: str) -> LayerStatus:
    """A checkpoint's status string of ``layer`` as a :class:`LayerStatus`."""
    try:
        return LayerStatus(value)
    except ValueError:
        expected = ", ".join(s.value for s in LayerStatus)
        raise ValueError(f"probe state: layer {layer!r} has state {value!r}; expected one of {expected}") from None
