"""An evidence round: every layer's candidates measured (error and speed) from merged statistics.

A round runs at the end of the warm-up window, on the reference statistics, and when a layer the
safety valve sent to bf16 has settled, on its recovery statistics. Each rank measures every
``world_size``-th layer (:func:`~loka_torchrec.probe.evaluate.evaluate_layer`), then all ranks
gather the results, so every rank holds the same evidence. A layer whose evaluation fails gets a
note instead of evidence, and the other ranks still reach the gather.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from loka_torchrec.evidence import BF16, CandidateEvidence, EvidenceConsumer, GemmRole, KernelChoice
from loka_torchrec.gemm.backends import backend_names, get_backend
from loka_torchrec.gemm.speed import SpeedCache
from loka_torchrec.peak_rises import PeakRises
from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.evaluate import evaluate_layer
from loka_torchrec.probe.layer_state import LayerState
from loka_torchrec.probe.merge import Ranks
from loka_torchrec.probe.quantify import LayerSnapshot
from loka_torchrec.probe.statistics import TensorStatistics

__all__ = ["LayerEvaluator", "default_candidates", "errors_grew", "evidence_records"]

logger = logging.getLogger("loka_torchrec.probe")

_ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)

Results = Dict[str, Tuple[List[CandidateEvidence], List[Dict[str, Any]]]]
"""Layer name -> its evidence and, per evidence record, the details (every error measurement)."""


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


class LayerEvaluator:
    """Measures the candidates of the Probe's layers, a share on each rank, and gathers the evidence.

    Args:
        layers: the Probe's layer states, by FQN.
        config: the Probe's configuration (samples, speed repetitions, seed).
        consumer: Dispatch, which names each layer's candidates and how it quantizes, or ``None``
            (then :func:`default_candidates`).
        ranks: the ranks that share the work.
        seconds: the Probe's time account (``"evaluate"``, ``"evaluate_error"``, ``"evaluate_speed"``).
        peak_rises: where each layer's evaluation raised the device's peak memory (``None``: not kept).
    """

    def __init__(
        self, layers: Dict[str, LayerState], config: ProbeConfig, consumer: Optional[EvidenceConsumer], ranks: Ranks,
        seconds: Dict[str, float], peak_rises: Optional[PeakRises] = None,
    ) -> None:
        self._layers = layers
        self._config = config
        self._consumer = consumer
        # How training quantizes and times the layers: the consumer says, else the base class's defaults.
        self._training = consumer if consumer is not None else EvidenceConsumer()
        self._ranks = ranks
        self._seconds = seconds
        self._peak_rises = peak_rises if peak_rises is not None else PeakRises()
        self.speed_cache: Optional[SpeedCache] = None  # made at the first round, on the layers' device

    def candidates(self, name: str) -> Dict[GemmRole, List[KernelChoice]]:
        """The kernels to measure for each role of layer ``name``."""
        if self._consumer is None:
            device = self._layers[name].module.weight.device
            return default_candidates(device)
        raw = self._consumer.candidates(name) or {}
        return {GemmRole(role): list(choices) for role, choices in raw.items()}

    def evaluate(self, names: Sequence[str], stats: Dict[str, Tuple[TensorStatistics, TensorStatistics]]) -> Results:
        """Evidence for ``names`` from ``stats`` (per layer: input and output-gradient statistics):
        each rank measures every ``world_size``-th layer, then all gather (a collective)."""
        if not self._layers:  # nothing to measure (the same on every rank: no collective to skip)
            return {}
        t0 = time.perf_counter()
        if self.speed_cache is None:
            device = next(iter(self._layers.values())).module.weight.device
            # Gradients are quantized as Dispatch will quantize them; under dense CUDA graphs a step
            # pays the candidates' device time only: time them so.
            self.speed_cache = SpeedCache(
                reps=self._config.resolved_speed_reps(device), grad_format=self._training.grad_format,
                device_time=self._training.times_in_graphs,
            )
        mine: Results = {}
        for i, name in enumerate(names):
            if i % self._ranks.world_size != self._ranks.rank:
                continue
            act, grad = stats[name]
            if act is None or act.is_empty:
                mine[name] = ([], [{"note": "no input rows seen at probe steps; no evidence"}])
                continue
            mine[name] = self._evaluate_one(name, act, grad)
        results = mine
        if self._ranks.world_size > 1:
            gathered: List[Any] = [None] * self._ranks.world_size
            dist.all_gather_object(gathered, mine, group=self._ranks.group)
            results = {}
            for part in gathered:
                results.update(part)
        self._seconds["evaluate"] += time.perf_counter() - t0
        return {name: results[name] for name in names if name in results}

    def _evaluate_one(
        self, name: str, act: TensorStatistics, grad: TensorStatistics
    ) -> Tuple[List[CandidateEvidence], List[Dict[str, Any]]]:
        state = self._layers[name]
        weight = state.module.weight.detach()
        # The accumulated statistics live on the host (probe.step_end.HOST): sampled on the layer's device.
        act = act if act.device == weight.device else act.clone(weight.device)
        if grad is not None and grad.device != weight.device:
            grad = grad.clone(weight.device)
        snap = LayerSnapshot(
            name=name,
            weight=weight,
            act=act,
            grad=grad,
            weight_stats=state.weight.on(weight.device),  # its factors are kept on the host
            reservoir=state.reservoir,
            rows=max(state.rows, 1),
        )
        try:
            parts: Dict[str, float] = {}
            with torch.no_grad(), self._peak_rises.phase(f"probe: evaluating {name}", weight.device):
                result = evaluate_layer(
                    snap, self.candidates(name), config=self._config, speed_cache=self.speed_cache,
                    seed=self._config.seed, seconds=parts,
                    forward_scaling=self._training.forward_scaling, grad_scaling=self._training.grad_scaling,
                )  # fmt: skip
            self._seconds["evaluate_error"] += parts.get("error", 0.0)
            self._seconds["evaluate_speed"] += parts.get("speed", 0.0)
            return result
        except Exception as exc:  # one layer's failure must not leave the other ranks waiting in the gather
            logger.warning("Probe: evaluating layer %s failed: %s: %s", name, type(exc).__name__, exc)
            return [], [{"note": f"evaluation failed: {type(exc).__name__}: {exc}"}]


def evidence_records(evidence: List[CandidateEvidence], details: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The evidence as log records: each :meth:`CandidateEvidence.to_dict` with its speedup and errors."""
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


def errors_grew(old: List[CandidateEvidence], new: List[CandidateEvidence], ratio: float) -> bool:
    """Whether any candidate's error point estimate grew beyond ``ratio`` times its earlier one."""
    before = {(ev.role, ev.candidate): ev.error.value for ev in old}
    for ev in new:
        prev = before.get((ev.role, ev.candidate))
        if prev is None or not (ev.error.value <= ratio * prev):
            if prev is not None and prev == ev.error.value:  # inf == inf: unchanged
                continue
            return True
    return False
