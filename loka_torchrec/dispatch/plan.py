"""The dispatch plan: which kernel each GEMM of each layer runs, and why.

A plan is plain data. It is saved as JSON in the run dir (atomically), printed as a table at the
start of training, loaded back for ``mode="pinned"`` (resume, inference), and compared across ranks
by :meth:`DispatchPlan.digest`.

What the layers run can differ from their plan: the safety valve holds a layer in bf16, the
step-time guard returns every GEMM to bf16, or a planned kernel cannot run at a layer's shape on its
device. :class:`InForce` says what runs; every count LoKA reports gives both (:meth:`DispatchPlan.summary`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from loka_torchrec.atomic_files import write_json_atomic
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.evidence import BF16, GUARD_HOLD, CandidateEvidence, GemmRole, KernelChoice

__all__ = ["RoleDecision", "LayerPlan", "DispatchPlan", "InForce", "HELD_BY", "GUARD_HOLD", "PLAN_FORMAT_VERSION"]

PLAN_FORMAT_VERSION = 1

HELD_BY = ("safety valve", "step-time guard", "kernel cannot run here")
"""What can hold a GEMM in bf16 that its plan has in FP8 (:attr:`InForce.held`)."""


def _count(choices: Iterable[KernelChoice]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for choice in choices:
        out[str(choice)] = out.get(str(choice), 0) + 1
    return dict(sorted(out.items()))


def _fp8(counts: Mapping[str, int]) -> int:
    return sum(n for k, n in counts.items() if not k.startswith("bf16:"))


@dataclasses.dataclass(frozen=True)
class InForce:
    """What the layers run now (:meth:`~loka_torchrec.dispatch.Dispatcher.in_force`), next to their plan.

    Attributes:
        kernels: layer -> the kernels its three GEMMs run now; the sites that never ran are left
            out, as :meth:`DispatchPlan.counts` leaves them out.
        held: layer -> ``(by, reason)`` for each layer that runs in bf16 a GEMM its plan has in
            FP8; ``by`` is one of :data:`HELD_BY`.

    Example::

        >>> now = InForce({"fc": LayerKernels()}, {"fc": ("safety valve", "amax jumped 40x")})
        >>> now.fp8_gemm_count(), now.held_summary()
        (0, 'safety valve holds 1 layer(s) in bf16')
    """

    kernels: Dict[str, LayerKernels]
    held: Dict[str, Tuple[str, str]] = dataclasses.field(default_factory=dict)

    def counts(self) -> Dict[str, int]:
        """How many GEMMs run on each kernel now."""
        return _count(c for k in self.kernels.values() for c in (k.fwd, k.dgrad, k.wgrad))

    def fp8_gemm_count(self) -> int:
        return _fp8(self.counts())

    def held_summary(self) -> str:
        """What holds planned FP8 GEMMs in bf16, e.g. ``"safety valve holds 2 layer(s) in bf16"``."""
        parts = []
        for by in HELD_BY:
            layers = sorted(name for name, (who, _) in self.held.items() if who == by)
            if not layers:
                continue
            if by == "step-time guard":
                reasons = {self.held[name][1] for name in layers}
                if all(r.startswith(GUARD_HOLD) for r in reasons):
                    parts.append(f"the step-time guard holds {len(layers)} readmitted layer(s) in bf16 (the step was slower with them)")
                else:
                    parts.append("the step-time guard returned every GEMM to bf16")
            elif by == "safety valve":
                parts.append(f"safety valve holds {len(layers)} layer(s) in bf16")
            else:
                parts.append(f"{len(layers)} layer(s) run a planned kernel in bf16: it cannot run at their shape here")
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class RoleDecision:
    """The kernel chosen for one GEMM role of one layer.

    Attributes:
        choice: the kernel.
        reason: one line a user can read, e.g. ``"fastest accurate: MERE 0.031 <= 0.2, 1.31x"``.
        source: who decided: ``"policy/random"``, ``"policy/probe"``, ``"static"``, ``"pinned"``,
            ``"safety-valve"``.
        evidence: the chosen candidate's evidence (``None`` for static decisions and bf16).
        considered: every candidate's evidence that the decision looked at.
    """

    choice: KernelChoice
    reason: str
    source: str
    evidence: Optional[CandidateEvidence] = None
    considered: tuple = ()

    def to_dict(self) -> Dict[str, Any]:
        return {
            "choice": str(self.choice),
            "reason": self.reason,
            "source": self.source,
            "evidence": self.evidence.to_dict() if self.evidence else None,
            "considered": [e.to_dict() for e in self.considered],
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RoleDecision":
        return cls(
            choice=KernelChoice.parse(d["choice"]),
            reason=d.get("reason", ""),
            source=d.get("source", "pinned"),
            evidence=CandidateEvidence.from_dict(d["evidence"]) if d.get("evidence") else None,
            considered=tuple(CandidateEvidence.from_dict(e) for e in d.get("considered", ())),
        )


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Decisions for the three GEMMs of one linear layer.

    Attributes:
        layer: canonical FQN.
        in_features, out_features: the layer's size.
        rows: rows per step the layer saw when the plan was made (0 if unknown).
        roles: one :class:`RoleDecision` per :class:`GemmRole`.
    """

    layer: str
    in_features: int
    out_features: int
    rows: int
    roles: Dict[GemmRole, RoleDecision]

    @property
    def kernels(self) -> LayerKernels:
        get = lambda role: self.roles[role].choice if role in self.roles else BF16  # noqa: E731
        return LayerKernels(get(GemmRole.FORWARD), get(GemmRole.GRAD_INPUT), get(GemmRole.GRAD_WEIGHT))

    def to_dict(self) -> Dict[str, Any]:
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "rows": self.rows,
            "roles": {role.value: decision.to_dict() for role, decision in self.roles.items()},
        }

    @classmethod
    def from_dict(cls, layer: str, d: Dict[str, Any]) -> "LayerPlan":
        return cls(
            layer=layer,
            in_features=int(d["in_features"]),
            out_features=int(d["out_features"]),
            rows=int(d.get("rows", 0)),
            roles={GemmRole(r): RoleDecision.from_dict(v) for r, v in d["roles"].items()},
        )


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Every managed layer's :class:`LayerPlan`.

    Attributes:
        layers: canonical FQN -> plan.
        mode: the dispatch mode that produced it.
        step: the training step at which it was made.
        device: the device its evidence was measured on.
        gates: the policy's gates (``max_mere``, ``min_speedup``) when it was made.
        never_ran: layer -> why, for each managed site that did not run in the first training
            step(s) that ran eagerly; their GEMMs are not counted (:meth:`counts`).
        coverage: the share of the model's linear multiply-adds per forward row that Dispatch
            manages and that ran: ``managed_macs_per_row``, ``total_macs_per_row``, ``share``,
            ``ran_checked`` (whether never-ran sites were detected yet) and ``unreached``
            (GEMM -> multiply-adds per row left in high precision).
    """

    layers: Dict[str, LayerPlan]
    mode: str
    step: int = 0
    device: str = ""
    gates: Dict[str, float] = dataclasses.field(default_factory=dict)
    never_ran: Dict[str, str] = dataclasses.field(default_factory=dict)
    coverage: Dict[str, Any] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ views
    def kernels(self) -> Dict[str, LayerKernels]:
        return {name: plan.kernels for name, plan in self.layers.items()}

    def digest(self) -> str:
        """SHA-256 of the choices alone (layer, role, kernel): equal digests = identical behaviour."""
        canonical = json.dumps(
            {name: self.layers[name].kernels.to_dict() for name in sorted(self.layers)}, sort_keys=True
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    def counts(self) -> Dict[str, int]:
        """How many GEMMs the plan puts on each kernel, e.g. ``{"bf16:hp": 4, "scaled_mm:rowwise": 8}``
        (the sites that never ran are left out: a GEMM that never ran is not one the plan runs)."""
        return _count(d.choice for name, plan in self.layers.items() if name not in self.never_ran for d in plan.roles.values())

    def fp8_gemm_count(self) -> int:
        """GEMMs the plan puts in FP8 (what runs now may be fewer: :class:`InForce`)."""
        return _fp8(self.counts())

    def shape_mismatch(self, shapes: Mapping[str, Tuple[int, int]]) -> Optional[str]:
        """What differs between this plan's layers and a model's (``layer -> (in_features,
        out_features)``), in one line naming the layers; ``None`` when they match."""
        missing = sorted(set(shapes) - set(self.layers))
        extra = sorted(set(self.layers) - set(shapes))
        if missing or extra:
            return f"layers missing from the plan {missing[:5]}, plan layers not in the model {extra[:5]}"
        other = sorted(n for n, lp in self.layers.items() if (lp.in_features, lp.out_features) != tuple(shapes[n]))
        if other:
            shown = ", ".join(
                f"{n} (plan {self.layers[n].in_features} -> {self.layers[n].out_features}, model {shapes[n][0]} -> {shapes[n][1]})"
                for n in other[:5]
            )
            return f"{len(other)} layer(s) of another shape: {shown}"
        return None

    def summary(self, in_force: Optional[InForce] = None) -> str:
        """One line: the GEMMs planned in FP8 by kernel and, given ``in_force``, how many run in FP8
        now and what holds the others in bf16; then coverage and the sites that never ran, or that
        this is not known yet (a compiled run whose steps all ran compiled, the Probe off)."""
        total = sum(self.counts().values())
        parts = ", ".join(f"{k} x{n}" for k, n in self.counts().items())
        text = f"{self.fp8_gemm_count()}/{total} GEMMs planned in FP8 ({parts})"
        if in_force is not None:
            text += f", {in_force.fp8_gemm_count()}/{total} in force"
            held = in_force.held_summary()
            text += f" ({held})" if held else ""
        if self.coverage:
            c = self.coverage
            text += f"; Dispatch manages {100 * c['share']:.1f}% of the linear multiply-adds per row ({c['managed_macs_per_row']}/{c['total_macs_per_row']})"
        if self.never_ran:
            text += f"; {len(self.never_ran)} converted site(s) never ran: {', '.join(sorted(self.never_ran))}"
        elif self.coverage and not self.coverage.get("ran_checked", True):
            text += "; which sites run is not checked yet (no step ran them eagerly): the counts take every site as running"
        return text

    def table(self, in_force: Optional[InForce] = None) -> str:
        """A plain-text table: layer, shape, and per role the kernel, MERE, speedup and reason; the
        last line is :meth:`summary` (with ``in_force``, what runs now)."""
        from rich.console import Console  # rich loads only where a table is printed
        from rich.table import Table

        table = Table(title=f"LoKA dispatch plan ({self.mode}, step {self.step}, {self.device or 'device ?'})")
        for col in ("layer", "rows x in -> out", "role", "kernel", "MERE (hi)", "speedup (lo)", "reason"):
            table.add_column(col, overflow="fold")
        for name in sorted(self.layers):
            plan = self.layers[name]
            if name in self.never_ran:
                table.add_row(name, f"0 x {plan.in_features} -> {plan.out_features}", "-", "never ran", "-", "-", self.never_ran[name])
                continue
            first = True
            for role in GemmRole:
                if role not in plan.roles:
                    continue
                d = plan.roles[role]
                ev = d.evidence
                table.add_row(
                    name if first else "",
                    f"{plan.rows or '?'} x {plan.in_features} -> {plan.out_features}" if first else "",
                    role.value,
                    str(d.choice),
                    f"{ev.error.value:.4f} ({ev.error.high:.4f})" if ev else "-",
                    f"{ev.speedup:.2f}x ({ev.speedup_low:.2f}x)" if ev else "-",
                    d.reason,
                )
                first = False
        buffer = io.StringIO()
        Console(file=buffer, width=200, force_terminal=False, color_system=None).print(table)
        return buffer.getvalue() + self.summary(in_force) + "\n"

    # ------------------------------------------------------------------ JSON
    def to_dict(self, in_force: Optional[InForce] = None) -> Dict[str, Any]:
        """The plan as JSON data; with ``in_force``, an ``"in_force"`` section says what runs now
        (``fp8_gemms_planned``, ``fp8_gemms`` in force, ``gemms``, ``kernels`` in force, ``held``:
        layer -> ``{"by", "reason"}``, ``summary``). The digest covers the plan's choices only."""
        out = {
            "format_version": PLAN_FORMAT_VERSION,
            "mode": self.mode,
            "step": self.step,
            "device": self.device,
            "gates": dict(self.gates),
            "digest": self.digest(),
            "layers": {name: self.layers[name].to_dict() for name in sorted(self.layers)},
            "never_ran": dict(sorted(self.never_ran.items())),
            "coverage": dict(self.coverage),
        }
        if in_force is not None:
            out["in_force"] = {
                "fp8_gemms_planned": self.fp8_gemm_count(),
                "fp8_gemms": in_force.fp8_gemm_count(),
                "gemms": sum(self.counts().values()),
                "kernels": in_force.counts(),
                "held": {name: {"by": by, "reason": reason} for name, (by, reason) in sorted(in_force.held.items())},
                "summary": self.summary(in_force),
            }
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DispatchPlan":
        if not isinstance(d, dict) or "layers" not in d:
            raise ValueError("dispatch plan: expected a JSON object with a 'layers' field")
        version = d.get("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"dispatch plan: format_version {version} is not supported (expected {PLAN_FORMAT_VERSION})")
        plan = cls(
            layers={name: LayerPlan.from_dict(name, v) for name, v in d["layers"].items()},
            mode=d.get("mode", "pinned"),
            step=int(d.get("step", 0)),
            device=d.get("device", ""),
            gates=dict(d.get("gates", {})),
            never_ran=dict(d.get("never_ran", {})),
            coverage=dict(d.get("coverage", {})),
        )
        if "digest" in d and d["digest"] != plan.digest():
            raise ValueError("dispatch plan: its 'digest' does not match its layers (edited or corrupted file?)")
        return plan

    def save(self, path: str, in_force: Optional[InForce] = None) -> None:
        """Write the plan as JSON atomically (temp file in the same folder, then rename); with
        ``in_force``, what runs now too (:meth:`to_dict`)."""
        write_json_atomic(path, self.to_dict(in_force), fsync=True)

    @classmethod
    def load(cls, path: str) -> "DispatchPlan":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dispatch.plan_path: no plan file at {path!r}")
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"dispatch.plan_path: {path!r} is not valid JSON ({exc})") from None
        return cls.from_dict(data)
