"""Read a run directory's Probe logs (and Dispatch plan) into one per-layer view, for ``loka-inspect``.

Sources, in order of preference:

* ``RUN_DIR/probe/summary.json`` (rank 0's merged view), unless a rank is asked for;
* ``RUN_DIR/probe/rank{r}.jsonl`` (rank ``r``'s records; its *local* statistics when ``--rank r``
  is given, the merged ones otherwise), when the summary is missing or unreadable;
* ``RUN_DIR/dispatch_plan.json`` for the decisions: ``{"layers": {fqn: {"roles": {"fwd":
  {"choice": "scaled_mm:rowwise", "reason": "..."}}}}}``; its optional ``"gates"`` (or
  ``"policy"``) with ``max_mere`` (or ``max_error``) and ``min_speedup`` fixes the gates drawn and
  used to pick the candidate shown;
* ``RUN_DIR/dispatch_events.jsonl`` for what took FP8 back since the plan (the safety valve, the
  step-time guard) and the gradient check (:mod:`loka_torchrec.probe.run_status`).

Problems a user can meet are :class:`RunDirError` with a one-line message (missing, empty,
corrupted directory); recoverable ones (a truncated line, a missing summary) become warnings.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from loka_torchrec.probe.logs import rank_log_paths, read_rank_log, read_summary
from loka_torchrec.probe.run_status import NEVER_RAN, ROLES, RunStatus, run_status
from loka_torchrec.probe.text_table import as_float as _float

__all__ = [
    "RunDirError", "RunView", "RoleView", "load_run", "best_candidate", "rank_comparison", "DEFAULT_MAX_ERROR",
    "DEFAULT_MIN_SPEEDUP", "ROLES", "EVENTS_FILE",
]  # fmt: skip

DEFAULT_MAX_ERROR = 0.2
DEFAULT_MIN_SPEEDUP = 1.05
EVENTS_FILE = "dispatch_events.jsonl"


class RunDirError(Exception):
    """A run directory ``loka-inspect`` cannot show (the message is one line for the user)."""


@dataclasses.dataclass(frozen=True)
class RoleView:
    """One GEMM of one layer as the run left it.

    Attributes:
        planned: the plan's kernel (``""``: no plan, or the plan lacks it).
        in_force: the kernel it runs now: the planned one unless ``held_by`` says otherwise.
        held_by: ``""``, ``"safety valve"``, ``"step-time guard"`` (bf16 instead of the plan) or
            ``"never ran"``.
        reason: why it runs what it runs (the plan's reason, or the valve's or guard's).
    """

    planned: str
    in_force: str
    held_by: str
    reason: str

    @property
    def text(self) -> str:
        """The kernel in force and, when it is not the plan's, why, e.g.
        ``"bf16:hp (safety valve; planned scaled_mm:rowwise)"``."""
        if not self.held_by or self.held_by == NEVER_RAN:
            return self.in_force or "-"
        planned = f"; planned {self.planned}" if self.planned and self.planned != self.in_force else ""
        return f"{self.in_force} ({self.held_by}{planned})"


@dataclasses.dataclass
class RunView:
    """Everything ``loka-inspect`` shows, built from a run directory.

    Attributes:
        run_dir: the directory.
        source: where the per-layer view came from (``"summary.json"`` or ``"rank{r}.jsonl"``).
        layers: ``{fqn: layer dict}`` with ``shape``, ``state``, ``reason``, ``stats``
            (``act``/``grad`` digests), ``weight``, ``history`` and ``evidence``.
        ranks: ``{rank: records}`` of every readable rank log.
        plan: the Dispatch plan (``{}`` when absent).
        max_error, min_speedup: the gates.
        warnings: recoverable problems met while reading.
        max_noise_ratio: the grad-weight noise-ratio gate of the plan (0: none).
        events: the dispatch events (``None``: no ``dispatch_events.jsonl``).
        status: what is in force (:class:`~loka_torchrec.probe.run_status.RunStatus`).
        batch_events: the spikes the safety valve judged to be the batch's and tripped nothing on
            (``summary.json``'s ``batch_event`` events; none without the summary).
    """

    run_dir: Path
    source: str
    layers: Dict[str, Dict[str, Any]]
    ranks: Dict[int, List[Dict[str, Any]]]
    plan: Dict[str, Any]
    max_error: float
    min_speedup: float
    warnings: List[str]
    max_noise_ratio: float = 0.0
    events: Optional[List[Dict[str, Any]]] = None
    status: RunStatus = dataclasses.field(default_factory=lambda: run_status({}, None, {}))
    batch_events: List[Dict[str, Any]] = dataclasses.field(default_factory=list)

    def filtered(self, pattern: Optional[str]) -> Dict[str, Dict[str, Any]]:
        """Layers whose FQN matches the glob ``pattern`` (all when ``None``)."""
        if not pattern:
            return self.layers
        return {k: v for k, v in self.layers.items() if fnmatch.fnmatchcase(k, pattern)}

    def role(self, layer: str, role: str) -> RoleView:
        """What one GEMM runs now and why: the plan's kernel unless the safety valve holds its layer,
        the step-time guard returned FP8 to bf16, or the site never ran."""
        status = self.status
        entry = ((self.plan.get("layers") or {}).get(layer) or {}).get("roles", {}).get(role)
        planned = str(entry["choice"]) if isinstance(entry, dict) and entry.get("choice") else ""
        kernel, override = status.in_force(layer, role)
        if kernel == NEVER_RAN:
            return RoleView(planned, "", NEVER_RAN, status.never_ran.get(layer, ""))
        if override == "guard":
            return RoleView(planned, kernel, "step-time guard", status.guard_off_reason())
        if layer in status.held:  # the safety valve overrides the plan until readmission
            return RoleView(planned, "bf16:hp", "safety valve", str(status.held[layer].get("reason", "")))
        if planned:
            return RoleView(planned, planned, "", str(entry.get("reason", "")))
        return RoleView("", "", "", "no dispatch_plan.json" if not self.plan else "not in dispatch_plan.json")


def _load_plan(run_dir: Path, problems: List[str]) -> Dict[str, Any]:
    path = run_dir / "dispatch_plan.json"
    if not path.exists():
        return {}
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(plan, dict):
            raise ValueError("not a JSON object")
        return plan
    except ValueError as exc:
        problems.append(f"dispatch_plan.json is unreadable ({exc}); decisions are not shown")
        return {}


def _gates(plan: Dict[str, Any], max_error: Optional[float], min_speedup: Optional[float]) -> Tuple[float, float]:
    policy = plan.get("gates") or plan.get("policy") or {}
    if not isinstance(policy, dict):
        policy = {}
    err = max_error if max_error is not None else _float(policy.get("max_mere", policy.get("max_error", DEFAULT_MAX_ERROR)))
    spd = min_speedup if min_speedup is not None else _float(policy.get("min_speedup", DEFAULT_MIN_SPEEDUP))
    return (err if math.isfinite(err) else DEFAULT_MAX_ERROR), (spd if math.isfinite(spd) else DEFAULT_MIN_SPEEDUP)


def _layers_from_summary(summary: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    out = {}
    for name, entry in (summary.get("layers") or {}).items():
        out[name] = {
            "shape": entry.get("shape", {}),
            "state": entry.get("state", ""),
            "reason": entry.get("reason", ""),
            "stats": entry.get("latest_stats") or {},
            "weight": entry.get("weight") or {},
            "history": entry.get("history") or [],
            "evidence": [e for e in entry.get("evidence") or [] if isinstance(e, dict) and "candidate" in e],
            "events": entry.get("events") or [],
        }
    return out


def _layers_from_records(records: List[Dict[str, Any]], *, local: bool) -> Dict[str, Dict[str, Any]]:
    key = "local" if local else "merged"
    out: Dict[str, Dict[str, Any]] = {}
    for rec in sorted(records, key=lambda r: (_float(r.get("step")), str(r.get("layer")))):
        name = rec.get("layer")
        if not isinstance(name, str):
            continue
        entry = out.setdefault(name, {"shape": {}, "state": "", "reason": "", "stats": {}, "weight": {}, "history": [], "evidence": [], "events": []})
        entry["shape"] = rec.get("shape") or entry["shape"]
        entry["state"] = rec.get("state", entry["state"])
        entry["reason"] = (rec.get("decision") or {}).get("reason", entry["reason"])
        stats = rec.get("stats") or {}
        if stats:
            act = (stats.get("act") or {}).get(key) or {}
            grad = (stats.get("grad") or {}).get(key) or {}
            entry["stats"] = {"act": act, "grad": grad}
            entry["weight"] = stats.get("weight") or {}
            entry["history"].append(
                {
                    "step": rec.get("step"),
                    "act_amax": act.get("amax"),
                    "act_kurtosis": act.get("kurtosis"),
                    "grad_amax": grad.get("amax"),
                    "grad_kurtosis": grad.get("kurtosis"),
                    "weight_amax": (stats.get("weight") or {}).get("amax"),
                }
            )
        if rec.get("evidence"):
            entry["evidence"] = [e for e in rec["evidence"] if isinstance(e, dict) and "candidate" in e]
        if rec.get("event") in ("fallback", "readmit"):
            entry["events"].append({"step": rec.get("step"), "event": rec["event"], "reason": (rec.get("decision") or {}).get("reason", "")})
    return out


def _load_events(run_dir: Path, problems: List[str]) -> Optional[List[Dict[str, Any]]]:
    path = run_dir / EVENTS_FILE
    if not path.exists():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # collected in `problems` instead
        events, bad = read_rank_log(path)
    problems += bad
    return events


def load_run(run_dir: "str | Path", *, rank: Optional[int] = None, max_error: Optional[float] = None, min_speedup: Optional[float] = None) -> RunView:
    """Build the :class:`RunView` of ``run_dir`` (see the module docstring).

    Raises:
        RunDirError: the directory is missing, has no probe logs, or none of them can be read.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise RunDirError(f"no such run directory: {run_dir}")
    if not run_dir.is_dir():
        raise RunDirError(f"not a directory: {run_dir}")
    probe_dir = run_dir / "probe"
    if not probe_dir.is_dir():
        raise RunDirError(f"{run_dir} has no probe/ directory: was the Probe enabled (loka.probe.enabled=true)?")
    problems: List[str] = []
    paths = rank_log_paths(probe_dir)
    ranks: Dict[int, List[Dict[str, Any]]] = {}
    for r, path in paths.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # collected in `problems` instead
            records, bad = read_rank_log(path)
        problems += bad
        ranks[r] = records
    summary, summary_problem = read_summary(probe_dir / "summary.json")
    if summary is None and not paths:
        raise RunDirError(f"{probe_dir} is empty: the run has not finished its first probe step")
    plan = _load_plan(run_dir, problems)
    err_gate, spd_gate = _gates(plan, max_error, min_speedup)
    if rank is not None:
        if rank not in ranks:
            have = ", ".join(str(r) for r in ranks) or "none"
            raise RunDirError(f"no log for rank {rank} in {probe_dir} (ranks with logs: {have})")
        if not ranks[rank]:
            raise RunDirError(f"rank{rank}.jsonl has no readable record (empty or corrupted)")
        layers, source = _layers_from_records(ranks[rank], local=True), f"rank{rank}.jsonl"
    elif summary is not None:
        layers, source = _layers_from_summary(summary), "summary.json"
    else:
        readable = [r for r, recs in ranks.items() if recs]
        if not readable:
            raise RunDirError(f"no readable probe record in {probe_dir}: {summary_problem}, and every rank log is empty or corrupted")
        first = readable[0]
        problems.append(f"{summary_problem}: the run is partial or was killed; showing merged statistics from rank{first}.jsonl")
        layers, source = _layers_from_records(ranks[first], local=False), f"rank{first}.jsonl"
    if not layers:
        raise RunDirError(f"no layer records in {probe_dir / source}")
    noise_gate = _float((plan.get("gates") or {}).get("max_grad_noise_ratio", 0.0)) if isinstance(plan.get("gates"), dict) else 0.0
    events = _load_events(run_dir, problems)
    return RunView(
        run_dir, source, layers, ranks, plan, err_gate, spd_gate, problems, noise_gate if math.isfinite(noise_gate) else 0.0,
        events=events, status=run_status(plan, events, layers),
        batch_events=[e for e in (summary or {}).get("events") or [] if isinstance(e, dict) and e.get("event") == "batch_event"],
    )  # fmt: skip


def _speedups(e: Dict[str, Any]) -> Tuple[float, float]:
    """``(speedup, speedup_low)`` of an evidence record, as :class:`CandidateEvidence` defines them."""
    t, b = e.get("time_ms") or {}, e.get("baseline_time_ms") or {}
    t_val, t_hi = _float(t.get("value")), _float(t.get("high"))
    speedup = _float(b.get("value")) / t_val if t_val > 0 and math.isfinite(t_val) else 0.0
    low = _float(b.get("low")) / t_hi if t_hi > 0 and math.isfinite(t_hi) else 0.0
    return speedup, low


def best_candidate(
    evidence: List[Dict[str, Any]], role: str, max_error: float, min_speedup: float, max_noise_ratio: float = 0.0
) -> Optional[Dict[str, Any]]:
    """The role's FP8 candidate to show, chosen by Dispatch's rule on the interval bounds.

    Within both gates (MERE upper bound ``< max_error`` and, with ``max_noise_ratio > 0``, a
    grad-weight noise ratio's upper bound ``<= max_noise_ratio``; speedup lower bound ``>= min_speedup``):
    the fastest; else the fastest accurate one; else the one with the lowest MERE upper bound.
    The returned dict is the evidence record plus ``passes`` (both gates), ``speedup`` and
    ``speedup_low``.
    """
    fp8 = [e for e in evidence if e.get("role") == role and not str(e.get("candidate", "")).startswith("bf16:")]
    usable = [e for e in fp8 if math.isfinite(_float((e.get("error") or {}).get("high")))]
    if not usable:
        return None

    def err_hi(e: Dict[str, Any]) -> float:
        return _float(e["error"]["high"])

    def noise_ok(e: Dict[str, Any]) -> bool:
        ratio = e.get("noise_ratio")
        return max_noise_ratio <= 0 or not ratio or _float(ratio.get("high")) <= max_noise_ratio

    accurate = [e for e in usable if err_hi(e) < max_error and noise_ok(e)]
    admissible = [e for e in accurate if _speedups(e)[1] >= min_speedup]
    if admissible:
        best = max(admissible, key=lambda e: _speedups(e)[0])
    elif accurate:
        best = max(accurate, key=lambda e: _speedups(e)[0])
    else:
        best = min(usable, key=err_hi)
    speedup, low = _speedups(best)
    return {**best, "passes": bool(admissible), "speedup": speedup, "speedup_low": low}


def rank_comparison(ranks: Dict[int, List[Dict[str, Any]]], *, z_threshold: float = 5.0) -> List[Dict[str, Any]]:
    """Per rank: records, last step, and the layers whose local statistics disagree with the merged ones.

    A (rank, layer, step) disagrees when the largest per-feature z of the rank's input or
    gradient mean exceeds its Bonferroni threshold (``mean_z_crit``, family-wise 1e-3), or when
    the z of its ``mean(x^2)`` exceeds ``z_threshold``.
    """
    rows = []
    for r, records in sorted(ranks.items()):
        flagged: Dict[str, int] = {}
        worst = 0.0
        last_step = None
        for rec in records:
            if "stats" not in rec:
                continue
            last_step = rec.get("step") if last_step is None else max(last_step, rec.get("step", last_step))
            for tensor in ("act", "grad"):
                dev = ((rec["stats"].get(tensor) or {}).get("rank_deviation")) or {}
                z_mean, crit, z_ms = _float(dev.get("mean_z_max")), _float(dev.get("mean_z_crit")), _float(dev.get("mean_sq_z"))
                ratio = max(z_mean / crit if crit > 0 and math.isfinite(z_mean) else 0.0, abs(z_ms) / z_threshold if math.isfinite(z_ms) else 0.0)
                worst = max(worst, ratio)
                if ratio > 1.0:
                    flagged[str(rec.get("layer"))] = flagged.get(str(rec.get("layer")), 0) + 1
        rows.append({"rank": r, "records": len(records), "last_step": last_step, "flagged_layers": flagged, "worst_ratio": worst})
    return rows
