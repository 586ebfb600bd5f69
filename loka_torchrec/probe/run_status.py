"""What a run directory says is in force: the FP8 GEMMs planned and running, the safety valve, the
step-time guard and the gradient check, for ``loka-inspect``'s header and its ``--why`` view.

Sources: ``dispatch_plan.json`` (the plan, its coverage, the sites that never ran) and
``dispatch_events.jsonl`` (rank 0's record of every valve, guard and gradient-check event, in
order). A plan in force is the plan less what the events took back: a layer the safety valve holds
runs bf16 until it is readmitted, and once the step-time guard returns every GEMM to bf16 it stays
there for the rest of the run. Without an events file the Probe's per-layer states stand in for
the valve. A plan file that records its own in-force count is believed over this reading.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

from loka_torchrec.evidence import GUARD_HOLD
from loka_torchrec.probe.text_table import as_float

__all__ = ["RunStatus", "run_status", "ROLES", "NEVER_RAN"]

ROLES = ("fwd", "dgrad", "wgrad")
NEVER_RAN = "never ran"


def _is_fp8(choice: str) -> bool:
    return bool(choice) and not choice.startswith("bf16:")


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _recorded_in_force(plan: Dict[str, Any]) -> Optional[int]:
    """The FP8 GEMMs in force as the plan file records them, when it does (``in_force`` as a count
    or as ``{"fp8_gemms": n}``, or ``fp8_gemms: {"in_force": n}``)."""
    in_force, counts = plan.get("in_force"), plan.get("fp8_gemms")
    if isinstance(in_force, dict):
        in_force = in_force.get("fp8_gemms")
    if in_force is None and isinstance(counts, dict):
        in_force = counts.get("in_force")
    return _int(in_force)


@dataclasses.dataclass
class RunStatus:
    """The run's state as its files record it.

    Attributes:
        planned: ``{layer: {role: kernel}}`` from the plan (empty without a plan file).
        never_ran: layer -> why, for converted sites that did not run (their GEMMs are not counted).
        held: layer -> ``{"step", "reason"}`` for each layer the safety valve holds in bf16 now.
        valve_trips: how many times the valve sent a layer to bf16 (``None``: no events file).
        guard_verdicts: every step-time guard verdict on the plan in force (``step``, ``fp8_ms``,
            ``bf16_ms``, ``keep_fp8``, and ``readmitted``: the layers a verdict on a readmission
            judged); not those that judged a candidate of plan trials.
        plan_trials: the candidates plan trials judged (``step``, ``candidate``, ``fp8_ms``, ``bf16_ms``,
            ``fp8_gemms``), in order; a candidate slower than bf16 turned nothing off by itself.
        plan_selected: what the trials kept (``chosen``: a candidate's label, ``None`` for bf16;
            ``summary``), ``None`` while they go on or where none ran.
        grad_check: the last gradient check (:func:`_grad_check`), ``None`` when none ran.
        coverage: the plan's ``coverage`` (share of the linear multiply-adds Dispatch manages).
        recorded_in_force: the FP8 GEMMs in force as the plan file records them (``None``: it does not).
    """

    planned: Dict[str, Dict[str, str]]
    never_ran: Dict[str, str]
    held: Dict[str, Dict[str, Any]]
    valve_trips: Optional[int]
    guard_verdicts: List[Dict[str, Any]]
    grad_check: Optional[Dict[str, Any]]
    coverage: Dict[str, Any]
    recorded_in_force: Optional[int] = None
    plan_trials: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    plan_selected: Optional[Dict[str, Any]] = None

    @property
    def guard_off(self) -> Optional[Dict[str, Any]]:
        """What returned every GEMM to bf16 (``None``: FP8 was kept or not judged yet): plan trials
        that kept no candidate (the ``plan_selected`` event), or the guard's verdict on the plan."""
        if self.plan_selected is not None and self.plan_selected.get("chosen") is None:
            return self.plan_selected
        # A verdict on layers the safety valve readmitted sent only those back (``readmitted``).
        return next((v for v in self.guard_verdicts if v.get("keep_fp8") is False and not v.get("readmitted")), None)

    def guard_off_reason(self) -> str:
        """Why every GEMM is bf16 again, in words (``""`` when it is not)."""
        off = self.guard_off
        if off is None:
            return ""
        if off.get("event") == "plan_selected":
            return f"at step {off.get('step')}: {off.get('summary') or 'plan trials kept no candidate'}"
        return (f"the step-time guard returned every GEMM to bf16 at step {off.get('step')}: median step "
                f"{as_float(off.get('fp8_ms')):.4g} ms with FP8 vs {as_float(off.get('bf16_ms')):.4g} ms in bf16")  # fmt: skip

    def in_force(self, layer: str, role: str) -> Tuple[str, str]:
        """``(kernel, what overrides the plan)`` for one GEMM: ``"never ran"``, bf16 held by the
        valve or the guard (``"valve"``, ``"guard"``), else the planned kernel and ``""``."""
        planned = self.planned.get(layer, {}).get(role, "")
        if layer in self.never_ran:
            return NEVER_RAN, ""
        if _is_fp8(planned) and self.guard_off is not None:
            return "bf16:hp", "guard"
        if _is_fp8(planned) and layer in self.held:  # the guard holds a readmitted layer that made the step slower
            return "bf16:hp", "guard" if str(self.held[layer].get("reason", "")).startswith(GUARD_HOLD) else "valve"
        return planned, ""

    def counts(self) -> Dict[str, int]:
        """GEMMs that ran (``total``), FP8 GEMMs ``planned`` and ``in_force``."""
        ran = [(layer, role) for layer, roles in self.planned.items() if layer not in self.never_ran for role in roles]
        planned = sum(_is_fp8(self.planned[layer][role]) for layer, role in ran)
        in_force = self.recorded_in_force
        if in_force is None:
            in_force = sum(_is_fp8(self.in_force(layer, role)[0]) for layer, role in ran)
        return {"total": len(ran), "planned": planned, "in_force": in_force}

    def to_dict(self) -> Dict[str, Any]:
        guard_off = self.guard_off
        return {
            "fp8_gemms": self.counts(),
            "coverage": dict(self.coverage),
            "never_ran": dict(self.never_ran),
            "safety_valve": {"held": dict(self.held), "trips": self.valve_trips},
            "step_guard": {"verdicts": list(self.guard_verdicts), "fp8_off_at_step": None if guard_off is None else guard_off.get("step")},
            "plan_trials": {"candidates": list(self.plan_trials), "selected": self.plan_selected},
            "grad_check": self.grad_check,
        }


def _planned(plan: Dict[str, Any]) -> Dict[str, Dict[str, str]]:
    out: Dict[str, Dict[str, str]] = {}
    for layer, entry in (plan.get("layers") or {}).items():
        roles = (entry or {}).get("roles") if isinstance(entry, dict) else None
        if isinstance(roles, dict):
            out[layer] = {role: str(d.get("choice", "")) for role, d in roles.items() if isinstance(d, dict)}
    return out


def _valve(events: Optional[List[Dict[str, Any]]], probe_layers: Dict[str, Dict[str, Any]]) -> Tuple[Dict[str, Dict[str, Any]], Optional[int]]:
    """Layers held in bf16 now and the number of trips, replayed from the events in order."""
    if events is None:  # no events file: the Probe's own view of each layer
        held = {name: {"step": None, "reason": str(e.get("reason", ""))} for name, e in probe_layers.items() if e.get("state") == "fallback"}
        return held, None
    held, trips = {}, 0
    for event in events:
        layer = event.get("layer")
        if event.get("event") == "fallback" and isinstance(layer, str):
            held[layer] = {"step": event.get("step"), "reason": str(event.get("reason", ""))}
            trips += 1
        elif event.get("event") == "readmit":
            held.pop(layer, None)
    return held, trips


def _grad_check(events: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The last gradient check: its step, the worst weight-gradient SQNR (dB) after it and where,
    the GEMMs it sent back to bf16, the sites still failing, and the sites under the floor that
    its noise rule passed (with their dB)."""
    records = [e for e in events if e.get("event") == "grad_check"]
    starts = [i for i, r in enumerate(records) if r.get("kind") == "plan"]
    if not starts:
        return None
    first, *rest = records[starts[-1]:]
    demoted = [r for r in rest if r.get("kind") == "demote"]
    last = demoted[-1] if demoted else first
    failing = list(last.get("failing_after", last.get("failing")) or [])
    under = first.get("under_floor") or {}
    passed_by_noise = {site: under[site] for site in sorted(under) if site not in (first.get("failing") or [])}
    worst = last.get("worst_db_after", last.get("worst_db"))
    return {
        "step": first.get("step"),
        "worst_db": worst if isinstance(worst, (int, float)) and not math.isnan(worst) else None,
        "site": last.get("site", ""),
        "demoted": [{k: r.get(k) for k in ("layer", "role", "choice", "alone_db", "damaged")} for r in demoted],
        "failing": failing,
        "passed_by_noise_rule": passed_by_noise,
        "seconds": first.get("check_seconds"),
    }


def run_status(plan: Dict[str, Any], events: Optional[List[Dict[str, Any]]], probe_layers: Dict[str, Dict[str, Any]]) -> RunStatus:
    """Read the run's state from its plan (``{}`` when absent), its dispatch events (``None`` when
    there is no events file) and the Probe's per-layer entries (``RunView.layers``)."""
    held, trips = _valve(events, probe_layers)
    # A guard window that judged a candidate of plan trials, or confirmed one, is logged twice
    # (step_guard, plan_trial or plan_confirmation): it belongs to the trials, whose plan_selected
    # event says what they turned off.
    trials = [e for e in events or [] if e.get("event") == "plan_trial"]
    trial_steps = {e.get("step") for e in events or [] if e.get("event") in ("plan_trial", "plan_confirmation")}
    never_ran = plan.get("never_ran")
    coverage = plan.get("coverage")
    return RunStatus(
        planned=_planned(plan),
        never_ran=dict(never_ran) if isinstance(never_ran, dict) else {},
        held=held,
        valve_trips=trips,
        guard_verdicts=[e for e in events or [] if e.get("event") == "step_guard" and e.get("step") not in trial_steps],
        plan_trials=trials,
        plan_selected=next((e for e in reversed(events or []) if e.get("event") == "plan_selected"), None),
        grad_check=_grad_check(events or []),
        coverage=dict(coverage) if isinstance(coverage, dict) else {},
        recorded_in_force=_recorded_in_force(plan),
    )
