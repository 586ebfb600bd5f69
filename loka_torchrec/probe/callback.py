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
import functools
import logging
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from loka_torchrec.gemm.backends import backend_names, get_backend
from loka_torchrec.evidence import BF16, CandidateEvidence, EvidenceConsumer, GemmRole, KernelChoice
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.probe.cadence import MonitorCadence
from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.evaluate import device_name, evaluate_layer
from loka_torchrec.probe.layer_state import LayerState, StepDigest
from loka_torchrec.probe.logs import LOG_VERSION, ProbeLog, write_json_atomic
from loka_torchrec.probe.merge import all_reduce_statistics, is_distributed, rank_deviation
from loka_torchrec.probe.quantify import LayerSnapshot
from loka_torchrec.gemm.speed import SpeedCache
from loka_torchrec.probe.statistics import TensorStatistics
from loka_torchrec.probe.valve import Trigger, check_shift, describe, nonfinite_spread

__all__ = ["ProbeCallback", "canonical_fqn", "default_candidates"]

logger = logging.getLogger("loka_torchrec.probe")

_WRAPPER_PREFIXES = ("_dmp_wrapped_module.", "module.", "_orig_mod.")
_HISTORY_LIMIT = 1000  # probe steps of amax/kurtosis history kept per layer in summary.json
_SUMMARY_INTERVAL_S = 300.0  # seconds between two rewrites of summary.json without news (see _write)
_ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)


def canonical_fqn(name: str) -> str:
    """A module's FQN without the wrapper prefixes of DMP (``_dmp_wrapped_module.``), DDP
    (``module.``) and ``torch.compile`` (``_orig_mod.``).

    Example::

        >>> canonical_fqn("_dmp_wrapped_module.module.over.layers.0")
        'over.layers.0'
    """
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def default_candidates(device: "torch.device | str") -> Dict[GemmRole, List[KernelChoice]]:
    """Without a consumer: bf16 plus every recipe of every available FP8 backend in ``auto`` (see ``GemmBackend.in_auto``)."""
    device = torch.device(device)
    choices = [BF16]
    for name in backend_names():
        if name in ("bf16", "emulated"):
            continue
        backend = get_backend(name)
        if backend.in_auto and backend.availability(device).ok:
            choices += [KernelChoice(name, recipe) for recipe in backend.auto_recipes(device)]
    return {role: list(choices) for role in _ROLES}


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
        self._armed = False
        self._paused = False  # paused(): passes that are not training steps
        self._handles: List[Any] = []
        self._layers: Dict[str, LayerState] = {}
        self._monitoring_steps: List[int] = []  # the steps after the warm-up window that probed
        self.skipped_monitoring_steps = 0  # monitoring steps skipped: no layer to guard
        if not self.enabled:
            return
        self.model = model
        self.consumer = consumer
        self.run_dir = run_dir
        self.group = process_group
        distributed = is_distributed(process_group)
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        for name, module in sorted(self._resolve_layers(model, consumer, layers).items()):
            self._layers[name] = LayerState(name, module, config)
        if not self._layers:
            logger.warning("Probe: no layers to probe (no consumer layers, no `layers`, no nn.Linear in the model)")
        self._log = ProbeLog(run_dir, self.rank)
        self._speed_cache: Optional[SpeedCache] = None
        self._events: List[Dict[str, Any]] = []
        self._events_in_summary = 0
        self._reports = 0
        self._summary_written_at: Optional[float] = None  # perf_counter of the last summary.json
        self._probe_steps = 0
        self._last_step: Optional[int] = None
        self.seconds = {"hooks": 0.0, "merge": 0.0, "evaluate": 0.0, "evaluate_error": 0.0, "evaluate_speed": 0.0, "logs": 0.0}
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
        return {
            "version": self._STATE_VERSION,
            "enabled": True,
            "planned": self.planned,
            "probe_steps": self._probe_steps,
            "monitoring_steps": list(self._monitoring_steps),
            "cadence": self.cadence.state_dict(),
            "events": list(self._events),
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
        for name, fields in state["layers"].items():
            layer = self._layers[name]
            for field in self._LAYER_FIELDS:
                setattr(layer, field, fields[field])
        self.planned = bool(state["planned"])
        self._probe_steps = int(state["probe_steps"])
        self._monitoring_steps = list(state.get("monitoring_steps", []))
        if "cadence" in state:  # states saved before the budgeted cadence start on the fixed grid
            self.cadence.load_state_dict(state["cadence"])
        self._events = list(state["events"])
        self._events_in_summary = 0  # the next report rewrites summary.json

    # ------------------------------------------------------------------------------ public API
    @property
    def layer_names(self) -> List[str]:
        return list(self._layers)

    @property
    def probing(self) -> bool:
        """Whether hooks are collecting statistics during the current step."""
        return self._armed

    def layer_state(self, name: str) -> LayerState:
        return self._layers[name]

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
        self._disarm()
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
        probed = self._armed
        if probed:
            self._disarm()
            records = self._end_probe_step(step)
        if not self.planned and step >= self.config.warmup_steps - 1 and self._probe_steps > 0:
            self._plan(step, records)
        if records:
            self._write(step, records, planned_now=self.planned and not planned_before)
        # The step clock: plain steps are the reference of what a monitoring step costs.
        self.cadence.tick(plain=not probed and self.planned == planned_before)
        if probed and step >= self.config.warmup_steps:
            self._monitoring_steps.append(step)
            waiting = any(state.state == "fallback" for state in self._layers.values())  # the same on every rank
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
        self._disarm()
        self._closed = True
        if self.rank == 0:
            write_json_atomic(self._log.dir / "summary.json", self._summary())
        self._log.close()

    def __enter__(self) -> "ProbeCallback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------ layers and hooks
    @staticmethod
    def _resolve_layers(model: nn.Module, consumer: Optional[EvidenceConsumer], layers: Optional[Mapping[str, nn.Module]]) -> Dict[str, nn.Module]:
        if consumer is not None:
            found = dict(consumer.managed_layers())
        elif layers is not None:
            if not isinstance(layers, Mapping):
                raise TypeError(f"layers: expected a mapping of FQN to module, got {type(layers).__name__}")
            found = dict(layers)
        else:
            found = {}
            for name, module in model.named_modules():
                if isinstance(module, nn.Linear):
                    found.setdefault(canonical_fqn(name), module)
        for name in found:
            if not isinstance(name, str):
                raise TypeError(f"layers: expected str FQNs as keys, got {name!r}")
        return found

    def _arm(self) -> None:
        if self._armed:
            return
        if self.consumer is not None:
            # Dispatch may have swapped modules (e.g. nn.Linear -> LokaLinear) since the last probe step.
            current = dict(self.consumer.managed_layers())
            for name, state in self._layers.items():
                if current.get(name) is not None:
                    state.module = current[name]
        for state in self._layers.values():
            hook = functools.partial(self._forward_hook, state)
            self._handles.append(state.module.register_forward_hook(hook, with_kwargs=True))
        self._armed = True

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
        self._arm()

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._armed = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside this block the hooks record nothing: passes that are not training steps (the
        gradient check's forward and backward on its own loss, between two steps while the next
        step's hooks are armed) must not enter the statistics the safety valve compares."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def _forward_hook(self, state: LayerState, module: nn.Module, args: Tuple, kwargs: Dict[str, Any], output: Any) -> None:
        if not module.training or self._paused:
            return  # evaluation passes inside a probe step, and paused passes, are not training data
        x = args[0] if args else next(iter(kwargs.values()), None)
        if not torch.is_tensor(x) or not x.is_floating_point():
            return
        t0 = time.perf_counter()
        moments = state.collect_moments
        token = None
        try:
            with torch.no_grad():
                state.window_act.update(x, delayed_amax=state.delayed_amax("act"), moments=moments)
                if moments:
                    token = state.reservoir.offer_inputs(x)
        except ValueError as exc:
            if not state.warned:
                logger.warning("Probe: skipping layer %s: %s", state.name, exc)
                state.warned = True
            return
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(functools.partial(self._grad_hook, state, token))
        self.seconds["hooks"] += time.perf_counter() - t0

    def _grad_hook(self, state: LayerState, token: Any, grad: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            state.window_grad.update(grad, delayed_amax=state.delayed_amax("grad"), moments=token is not None)
            if token is not None:
                state.reservoir.offer_grads(token, grad)
        self.seconds["hooks"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------------ probe steps
    def _end_probe_step(self, step: int) -> Dict[str, Dict[str, Any]]:
        t0 = time.perf_counter()
        self._probe_steps += 1
        states = list(self._layers.values())
        for state in states:
            state.weight.update(state.module.weight, factors=state.collect_moments)
        windows = [s.window_act for s in states] + [s.window_grad for s in states]
        merged = all_reduce_statistics(windows, self.group)
        merged_act, merged_grad = merged[: len(states)], merged[len(states) :]
        records: Dict[str, Dict[str, Any]] = {}
        digests: Dict[str, StepDigest] = {}
        for state, m_act, m_grad in zip(states, merged_act, merged_grad):
            digest = StepDigest(
                local_act=state.window_act.summary(),
                local_grad=state.window_grad.summary(),
                merged_act=m_act.summary(),
                merged_grad=m_grad.summary(),
                deviation_act=rank_deviation(state.window_act, m_act),
                deviation_grad=rank_deviation(state.window_grad, m_grad),
                weight=state.weight.summary(),
            )
            digests[state.name] = digest
            state.latest_stats = {"act": digest.merged_act, "grad": digest.merged_grad}
            state.rows = max(state.rows, m_act.max_rows)
            if m_act.rows:
                state.act_amax.append(float(m_act.amax))
            if m_grad.rows:
                state.grad_amax.append(float(m_grad.amax))
            state.history.append(
                {
                    "step": step,
                    "act_amax": digest.merged_act["amax"],
                    "act_kurtosis": digest.merged_act["kurtosis"],
                    "grad_amax": digest.merged_grad["amax"],
                    "grad_kurtosis": digest.merged_grad["kurtosis"],
                    "weight_amax": digest.weight["amax"],
                }
            )
            del state.history[:-_HISTORY_LIMIT]
            records[state.name] = self._record(step, state, digest, phase="warmup" if not self.planned else "monitor")
        if not self.planned:
            for state, m_act, m_grad in zip(states, merged_act, merged_grad):
                state.reference_act = _merged_into(state.reference_act, m_act)
                state.reference_grad = _merged_into(state.reference_grad, m_grad)
        else:
            self._safety_valve(step, states, merged_act, merged_grad, digests, records)
        for state in states:
            state.reset_windows()
        self.seconds["merge"] += time.perf_counter() - t0
        return records

    def _record(self, step: int, state: LayerState, digest: StepDigest, *, phase: str) -> Dict[str, Any]:
        return {
            "v": LOG_VERSION,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "layer": state.name,
            "event": "probe",
            "phase": phase,
            "shape": state.shape_dict(),
            "stats": {
                "act": {"local": digest.local_act, "merged": digest.merged_act, "rank_deviation": digest.deviation_act},
                "grad": {"local": digest.local_grad, "merged": digest.merged_grad, "rank_deviation": digest.deviation_grad},
                "weight": digest.weight,
            },
            "state": state.state,
        }

    # ------------------------------------------------------------------------------ evidence
    def _candidates(self, name: str) -> Dict[GemmRole, List[KernelChoice]]:
        if self.consumer is None:
            device = self._layers[name].module.weight.device
            return default_candidates(device)
        raw = self.consumer.candidates(name) or {}
        return {GemmRole(role): list(choices) for role, choices in raw.items()}

    def _evaluate(self, names: Sequence[str], stats: Dict[str, Tuple[TensorStatistics, TensorStatistics]]) -> Dict[str, Tuple[List[CandidateEvidence], List[Dict[str, Any]]]]:
        """Evidence for ``names``: each rank measures every ``world_size``-th layer, then all gather."""
        if not self._layers:  # nothing to measure (the same on every rank: no collective to skip)
            return {}
        t0 = time.perf_counter()
        if self._speed_cache is None:
            device = next(iter(self._layers.values())).module.weight.device
            # Gradients are quantized as Dispatch will quantize them (E4M3 unless it says otherwise).
            grad_format = getattr(self.consumer, "grad_format", None) or Fp8Format.E4M3
            # Under dense CUDA graphs a step pays the candidates' device time only: time them so.
            device_time = bool(getattr(self.consumer, "times_in_graphs", False))
            self._speed_cache = SpeedCache(
                reps=self.config.resolved_speed_reps(device), grad_format=grad_format, device_time=device_time
            )
        mine: Dict[str, Tuple[List[CandidateEvidence], List[Dict[str, Any]]]] = {}
        for i, name in enumerate(names):
            if i % self.world_size != self.rank:
                continue
            state = self._layers[name]
            act, grad = stats[name]
            if act is None or act.is_empty:
                mine[name] = ([], [{"note": "no input rows seen at probe steps; no evidence"}])
                continue
            snap = LayerSnapshot(
                name=name,
                weight=state.module.weight.detach(),
                act=act,
                grad=grad,
                weight_stats=state.weight,
                reservoir=state.reservoir,
                rows=max(state.rows, 1),
            )
            try:
                parts: Dict[str, float] = {}
                with torch.no_grad():
                    mine[name] = evaluate_layer(
                        snap, self._candidates(name), config=self.config, speed_cache=self._speed_cache,
                        seed=self.config.seed, seconds=parts,
                        forward_scaling=getattr(self.consumer, "forward_scaling", "current"),
                    )
                self.seconds["evaluate_error"] += parts.get("error", 0.0)
                self.seconds["evaluate_speed"] += parts.get("speed", 0.0)
            except Exception as exc:  # one layer's failure must not leave the other ranks waiting in the gather
                logger.warning("Probe: evaluating layer %s failed: %s: %s", name, type(exc).__name__, exc)
                mine[name] = ([], [{"note": f"evaluation failed: {type(exc).__name__}: {exc}"}])
        results = mine
        if self.world_size > 1:
            gathered: List[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, mine, group=self.group)
            results = {}
            for part in gathered:
                results.update(part)
        self.seconds["evaluate"] += time.perf_counter() - t0
        return {name: results[name] for name in names if name in results}

    def _all_evidence(self) -> List[CandidateEvidence]:
        return [ev for state in self._layers.values() for ev in state.evidence]

    def _plan(self, step: int, records: Dict[str, Dict[str, Any]]) -> None:
        names = list(self._layers)
        results = self._evaluate(names, {n: (self._layers[n].reference_act, self._layers[n].reference_grad) for n in names})
        for name, (evidence, details) in results.items():
            state = self._layers[name]
            state.evidence, state.evidence_step, state.state = evidence, step, "planned"
            state.evidence_records = _evidence_records(evidence, details)
            record = records.get(name) or self._bare_record(step, state)
            record.update(event="plan", evidence=state.evidence_records, state=state.state)
            if state.reference_act is not None:
                record["reference"] = {"act": state.reference_act.summary(), "grad": state.reference_grad.summary()}
            records[name] = record
        self.planned = True
        if self.consumer is not None:
            self.consumer.replan(self._all_evidence(), source="probe", step=step)
        self._event(step, None, "replan", f"evidence for {len(results)} layer(s) at the end of the warm-up window")

    def _bare_record(self, step: int, state: LayerState) -> Dict[str, Any]:
        return {"v": LOG_VERSION, "step": step, "rank": self.rank, "world_size": self.world_size, "layer": state.name, "event": "plan", "phase": "warmup", "shape": state.shape_dict()}

    # ------------------------------------------------------------------------------ safety valve
    def _safety_valve(self, step, states, merged_act, merged_grad, digests, records) -> None:
        verdicts: Dict[str, Tuple[str, List[Dict[str, Any]]]] = {}
        guarded = self._guarded()
        for state, m_act, m_grad in zip(states, merged_act, merged_grad):
            digest = digests[state.name]
            if state.state == "planned":
                ref_act, ref_grad = state.reference_act, state.reference_grad
            else:
                ref_act, ref_grad = state.recovery_act, state.recovery_grad
            triggers: List[Trigger] = []
            if m_act.rows:
                triggers += check_shift("act", ref_act.summary() if ref_act is not None else None, digest.merged_act, self.config)
            if m_grad.rows:
                ref = ref_grad.summary() if ref_grad is not None and not ref_grad.is_empty else None
                triggers += check_shift("grad", ref, digest.merged_grad, self.config)
            if digest.weight["nonfinite"]:
                triggers.append(Trigger("weight", "nonfinite", float(digest.weight["nonfinite"]), 0.0, 0.0))
            # Name the recipes that spread an inf/NaN (tensorwise: the whole product turns NaN).
            kernels = getattr(state.module, "kernels", None)
            triggers = [
                dataclasses.replace(t, spread=nonfinite_spread(t.tensor, kernels)) if t.signal == "nonfinite" else t
                for t in triggers
            ]
            if state.state == "planned":
                # A layer that runs bf16 has nothing to fall back from; its triggers are only logged.
                action = "fallback" if triggers and state.name in guarded else "ok"
            elif state.state == "fallback":
                action = "restart" if triggers else ("recover" if m_act.count else "idle")
            else:
                action = "ok"
            verdicts[state.name] = (action, [t.to_dict() for t in triggers])
        verdicts = self._broadcast(verdicts)
        reevaluate: List[str] = []
        for state, m_act, m_grad in zip(states, merged_act, merged_grad):
            action, trigger_dicts = verdicts[state.name]
            triggers = [Trigger(**t) for t in trigger_dicts]
            record = records[state.name]
            if triggers:
                record["triggers"] = trigger_dicts
            finite = not any(t.signal == "nonfinite" for t in triggers)
            if action == "fallback":
                # The tripping window itself is not part of the recovery: a transient spike would
                # otherwise inflate the reference the layer is readmitted with.
                state.state, state.reason, state.clean_windows = "fallback", describe(triggers), 0
                state.recovery_act = state.recovery_grad = None
                state.reset_reservoir()
                logger.warning("Probe: step %d: layer %s falls back to bf16: %s", step, state.name, state.reason)
                if self.consumer is not None:
                    self.consumer.fallback(state.name, state.reason, step=step)
                self._event(step, state.name, "fallback", state.reason, triggers=trigger_dicts)
                record["event"] = "fallback"
            elif action == "restart":
                # The distribution moved again: the new level starts a new recovery (when finite).
                fresh = finite and m_act.count > 0
                state.recovery_act, state.recovery_grad = (m_act.clone(), m_grad.clone()) if fresh else (None, None)
                state.clean_windows = 1 if fresh else 0
                record["event"] = "recovering"
            elif action == "recover":
                state.recovery_act = _merged_into(state.recovery_act, m_act)
                state.recovery_grad = _merged_into(state.recovery_grad, m_grad)
                state.clean_windows += 1
                record["event"] = "recovering"
                if state.clean_windows >= self.config.readmit_windows:
                    reevaluate.append(state.name)
            record["state"] = state.state
            record["decision"] = {"state": state.state, "reason": state.reason}
        if reevaluate:
            self._reevaluate(step, reevaluate, records)

    def _reevaluate(self, step: int, names: List[str], records: Dict[str, Dict[str, Any]]) -> None:
        results = self._evaluate(names, {n: (self._layers[n].recovery_act, self._layers[n].recovery_grad) for n in names})
        replan = False
        for name in names:
            state = self._layers[name]
            evidence, details = results.get(name, ([], []))
            if _errors_grew(state.evidence, evidence, self.config.readmit_error_ratio):
                replan = True
            state.evidence, state.evidence_step = evidence, step
            state.evidence_records = _evidence_records(evidence, details)
            records[name]["evidence"] = state.evidence_records
        if replan and self.consumer is not None:
            self.consumer.replan(self._all_evidence(), source="probe", step=step)
            self._event(step, None, "replan", f"errors grew for some of {', '.join(names)}")
        for name in names:
            state = self._layers[name]
            state.reference_act, state.reference_grad = state.recovery_act, state.recovery_grad
            state.recovery_act = state.recovery_grad = None
            state.state, state.clean_windows = "planned", 0
            reason = f"statistics settled for {self.config.readmit_windows} probe step(s); re-evaluated{' and re-planned' if replan else ''}"
            state.reason = ""
            if self.consumer is not None:
                self.consumer.readmit(name, step=step)
            logger.warning("Probe: step %d: layer %s readmitted: %s", step, name, reason)
            self._event(step, name, "readmit", reason)
            records[name].update(event="readmit", state=state.state, decision={"state": "planned", "reason": reason})

    def _broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    # ------------------------------------------------------------------------------ logs
    def _event(self, step: int, layer: Optional[str], event: str, reason: str, **extra: Any) -> None:
        entry = {"step": step, "layer": layer, "event": event, "reason": reason, **extra}
        self._events.append(entry)
        if layer is not None:
            self._layers[layer].events.append(entry)

    def _write(self, step: int, records: Dict[str, Dict[str, Any]], *, planned_now: bool) -> None:
        """Append this report to the rank log; rank 0 rewrites ``summary.json`` when it has news.

        The summary (every layer's history, evidence and events) is rewritten at the report that
        planned, at one with a new safety-valve event, at the first report at least
        ``_SUMMARY_INTERVAL_S`` seconds after the last rewrite, and at :meth:`close`: serializing it
        costs far more than the report itself, so a time bound caps that cost whatever the cadence.
        """
        t0 = time.perf_counter()
        for name in self._layers:
            if name in records:
                self._log.write(records[name])  # flushed per line: a killed process loses nothing
        self._reports += 1
        stale = self._summary_written_at is None or t0 - self._summary_written_at >= _SUMMARY_INTERVAL_S
        news = planned_now or len(self._events) != self._events_in_summary or stale
        if self.rank == 0 and news:
            write_json_atomic(self._log.dir / "summary.json", self._summary())
            self._events_in_summary = len(self._events)
            self._summary_written_at = time.perf_counter()
        self.seconds["logs"] += time.perf_counter() - t0

    def _summary(self) -> Dict[str, Any]:
        layers = {}
        for name, state in self._layers.items():
            last = state.history[-1] if state.history else {}
            layers[name] = {
                "shape": state.shape_dict(),
                "state": state.state,
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
            "layers": layers,
            "events": self._events,
        }


def _thin(history: List[Dict[str, Any]], head: int = 64, tail: int = 192) -> List[Dict[str, Any]]:
    """The first ``head`` and last ``tail`` entries: summary.json stays small; rank logs keep everything."""
    return history if len(history) <= head + tail else history[:head] + history[-tail:]


def _merged_into(acc: Optional[TensorStatistics], new: TensorStatistics) -> TensorStatistics:
    return new.clone() if acc is None else acc.merge(new)


def _evidence_records(evidence: List[CandidateEvidence], details: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for ev, detail in zip(evidence, details):
        d = ev.to_dict()
        d["speedup"] = ev.speedup
        d["speedup_low"] = ev.speedup_low
        d["errors"] = detail.get("errors")
        out.append(d)
    if not evidence and details:
        out.append({"note": details[0].get("note", "")})
    return out


def _errors_grew(old: List[CandidateEvidence], new: List[CandidateEvidence], ratio: float) -> bool:
    """Whether any candidate's error point estimate grew beyond ``ratio`` times its earlier one."""
    before = {(ev.role, ev.candidate): ev.error.value for ev in old}
    for ev in new:
        prev = before.get((ev.role, ev.candidate))
        if prev is None or not (ev.error.value <= ratio * prev):
            if prev is not None and prev == ev.error.value:  # inf == inf: unchanged
                continue
            return True
    return False
