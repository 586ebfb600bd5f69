"""Plan trials: candidate plans judged by the compiled training step itself, the fastest kept.

The policy plans each GEMM from evidence measured on that GEMM alone, and the layer check then
times each FP8 layer alone, eagerly: its operand casts are separate kernels there. In a compiled
step Inductor fuses those casts into the ops that produce the operands and shares them between
GEMMs, so a layer that lost the layer check can still make the step faster (and, the other way,
host work or a broken fusion can make a plan that passed it slower). Only the step can tell.

So where the layers run compiled, Dispatch keeps the plans worth trying, the conservative one
first:

1. ``"layer-checked"``: the policy's plan after the layer check (every layer whose FP8 variant
   was not faster alone back in bf16);
2. ``"layer-ranked K/N"`` (``dispatch.ranked_trials`` of them, default one): the layer-checked
   plan plus the ``K`` of the ``N`` layers the layer check sent back whose FP8 variant came
   closest to bf16 alone (its speedup there, highest first). Where a few large layers gain and
   many small ones lose, the whole accuracy-gated plan can be slower than bf16 while a part of
   it is faster; the layer check's ranking says which part to try (:func:`ranked_plans`);
3. ``"accuracy-gated"``: the policy's plan before the layer check (every GEMM that passed the
   accuracy and speed gates on its own evidence).

Plans without an FP8 GEMM, and a plan equal to an earlier one, are dropped. Each candidate runs
for one window of the step-time guard (:mod:`loka_torchrec.dispatch.step_guard`: a few settling
steps, then ``window`` timed steps, against the bf16 steps before the plan); when every candidate
has its median, the fastest one is kept if it beats bf16 by more than the guard's tolerance, else
every GEMM returns to bf16. Within the tolerance the two are a tie, and bf16 wins a tie: it adds no
FP8 error, and on a step bound by the host (where FP8 GEMMs cannot shorten the step) the medians
of two windows differ by noise alone, whatever runs. An eager plan's guard keeps FP8 within
its tolerance instead (:mod:`loka_torchrec.dispatch.step_guard`): there the layer check has timed
each FP8 layer as it runs; compiled, only the step shows a gain. The gradient check runs on the
broadest candidate and what it sends back to bf16 is sent back in every candidate
(:meth:`PlanTrials.demote_like`).

**Confirmation** (``dispatch.confirm_trials``, on by default). A training step drifts: its host
work, the data and the GPU's clock change over hundreds of steps, so a candidate's window can beat
a bf16 window taken a few hundred steps earlier by drift alone. So the fastest candidate, when it
beat bf16, is confirmed against bf16 measured next to it: every GEMM runs bf16 for one more guard
window (its settling steps first), then the candidate for one more, and it is kept only if it beats
that fresh bf16 window by more than the tolerance too; else every GEMM returns to bf16. The two
windows add ``2 * (settle + window)`` steps to the trials.

:class:`PlanTrials` is bookkeeping only; the
:class:`~loka_torchrec.dispatch.dispatcher.Dispatcher` applies the plans, makes ranks agree on
each verdict and records the events.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from loka_torchrec.dispatch.plan import DispatchPlan

__all__ = ["PlanTrials", "candidate_plans", "ranked_plans", "LAYER_CHECKED", "ACCURACY_GATED", "BF16_CHOSEN"]

LAYER_CHECKED = "layer-checked"
ACCURACY_GATED = "accuracy-gated"
BF16_CHOSEN = -1
""":attr:`PlanTrials.chosen` when no candidate beat bf16 by more than the tolerance."""


@dataclasses.dataclass
class PlanTrials:
    """Candidate plans tried one after the other, each for one step-time guard window.

    Attributes:
        candidates: the plans, in the order they are tried (see the module docstring).
        labels: what each candidate is (:data:`LAYER_CHECKED`, ``"layer-ranked K/N"``, :data:`ACCURACY_GATED`).
        medians: per tried candidate, ``(bf16_ms, fp8_ms)``: the guard's medians before the plan and
            with it (``None`` while not tried).
        index: the candidate on trial now (``len(candidates)`` once all are tried).
        chosen: the kept candidate's index, :data:`BF16_CHOSEN`, or ``None`` while trials go on.
        tolerance: the margin by which a candidate must beat bf16 (a share of bf16's median), as
            :meth:`record` last had it.
        confirm: whether the fastest candidate is confirmed against a fresh bf16 window (see the
            module docstring).
        pending: the candidate under confirmation (``None`` when none is).
        confirming: ``"bf16"`` while the fresh bf16 window runs, ``"fp8"`` while the candidate runs
            again, ``None`` otherwise.
        confirm_steps: steps run so far in the fresh bf16 window.
        confirm_medians: the confirmation's ``(bf16_ms, fp8_ms)`` (``None`` until it is done).

    Example::

        >>> from loka_torchrec.dispatch.plan import DispatchPlan
        >>> trials = PlanTrials.of([(LAYER_CHECKED, DispatchPlan({}, "policy")), (ACCURACY_GATED, DispatchPlan({}, "policy", step=1))])
        >>> trials.record(20.0, 19.0, tolerance=0.02)  # the layer-checked plan: 19 ms against 20 ms in bf16 (5% faster)
        >>> trials.record(20.0, 17.0, tolerance=0.02)  # the accuracy-gated plan: faster still
        >>> trials.chosen, trials.describe()
        (1, 'plan trials kept the accuracy-gated plan: median step 17.00 ms against 20.00 ms in bf16 (layer-checked 19.00 ms)')
    """

    candidates: List[DispatchPlan]
    labels: List[str]
    medians: List[Optional[Tuple[float, float]]]
    index: int = 0
    chosen: Optional[int] = None
    tolerance: float = 0.0
    confirm: bool = False
    pending: Optional[int] = None
    confirming: Optional[str] = None
    confirm_steps: int = 0
    confirm_medians: Optional[Tuple[float, float]] = None

    @classmethod
    def of(cls, labelled: Sequence[Tuple[str, DispatchPlan]], *, confirm: bool = False) -> "PlanTrials":
        """Trials of ``(label, plan)`` pairs, in order; ``confirm``: confirm the fastest (module docstring)."""
        if not labelled:
            raise ValueError("plan trials: need at least one candidate plan")
        return cls([p for _, p in labelled], [label for label, _ in labelled], [None] * len(labelled), confirm=confirm)

    @property
    def done(self) -> bool:
        return self.chosen is not None

    def current(self) -> DispatchPlan:
        """The plan to run now: the one on trial, or the kept one (the first for bf16: the caller
        turns FP8 off)."""
        if self.chosen is not None:
            return self.candidates[max(self.chosen, 0)]
        if self.pending is not None:
            return self.candidates[self.pending]
        return self.candidates[self.index]

    def broadest(self) -> DispatchPlan:
        """The candidate with the most FP8 GEMMs (the one the gradient check must see)."""
        return max(self.candidates, key=lambda p: p.fp8_gemm_count())

    def record(self, bf16_ms: float, fp8_ms: float, *, tolerance: float) -> None:
        """The guard's medians for the candidate on trial; after the last one, choose (the fastest
        candidate if it beats bf16 by more than ``tolerance``, a share of bf16's median)."""
        if self.chosen is not None or self.pending is not None:
            raise RuntimeError("plan trials: every candidate was tried already")
        self.tolerance = float(tolerance)
        self.medians[self.index] = (float(bf16_ms), float(fp8_ms))
        self.index += 1
        if self.index == len(self.candidates):
            best = self._fastest(tolerance)
            if self.confirm and best != BF16_CHOSEN:
                self.pending, self.confirming, self.confirm_steps = best, "bf16", 0
            else:
                self.chosen = best

    def bf16_step(self, needed: int) -> bool:
        """One step of the fresh bf16 window ran; ``True`` when it has run ``needed`` steps (the
        caller then runs the candidate again: :attr:`confirming` becomes ``"fp8"``)."""
        if self.confirming != "bf16":
            raise RuntimeError(f"plan trials: no bf16 confirmation window under way (confirming={self.confirming!r})")
        self.confirm_steps += 1
        if self.confirm_steps < needed:
            return False
        self.confirming = "fp8"
        return True

    def record_confirmation(self, bf16_ms: float, fp8_ms: float, *, tolerance: float) -> None:
        """The candidate's second window against the fresh bf16 window: keep it if it beats that by
        more than ``tolerance`` too, else choose bf16."""
        if self.confirming != "fp8" or self.pending is None:
            raise RuntimeError(f"plan trials: no candidate window to confirm (confirming={self.confirming!r})")
        self.tolerance = float(tolerance)
        self.confirm_medians = (float(bf16_ms), float(fp8_ms))
        self.chosen = self.pending if fp8_ms < bf16_ms * (1.0 - tolerance) else BF16_CHOSEN
        self.confirming = None

    def _fastest(self, tolerance: float) -> int:
        tried = [(m[1], i) for i, m in enumerate(self.medians) if m is not None]
        if not tried:
            return BF16_CHOSEN
        fp8_ms, best = min(tried)
        bf16_ms = self.medians[best][0]
        return best if fp8_ms < bf16_ms * (1.0 - tolerance) else BF16_CHOSEN

    def demote_like(self, original: DispatchPlan, checked: DispatchPlan) -> None:
        """Where ``checked`` (the gradient check's result for ``original``) sent an FP8 role back to
        bf16, send it back in every candidate too, with the check's reason."""
        demoted = {
            (name, role): decision
            for name, layer in checked.layers.items()
            for role, decision in layer.roles.items()
            if decision.choice.is_high_precision
            and name in original.layers and role in original.layers[name].roles
            and not original.layers[name].roles[role].choice.is_high_precision
        }  # fmt: skip
        self.candidates = [_with_decisions(plan, demoted) for plan in self.candidates]

    def describe(self) -> str:
        """One line: what was kept, with every candidate's median."""
        tried = [(label, m) for label, m in zip(self.labels, self.medians) if m is not None]
        if not tried:
            return "plan trials: nothing tried yet"
        bf16_ms = tried[0][1][0]
        confirmed = ""
        if self.confirm_medians is not None and self.pending is not None:
            cb, cf = self.confirm_medians
            confirmed = f"; confirmed against bf16 run next to it: {cf:.2f} ms against {cb:.2f} ms"
        if self.chosen == BF16_CHOSEN and confirmed:
            label, m = self.labels[self.pending], self.medians[self.pending]
            return (f"plan trials returned to bf16: the {label} plan ran {m[1]:.2f} ms against {m[0]:.2f} ms in bf16, "
                    f"but not faster by more than {100 * self.tolerance:g}% when run again next to bf16 "
                    f"({cf:.2f} ms against {cb:.2f} ms)")
        if self.chosen == BF16_CHOSEN:
            each = ", ".join(f"{label} {m[1]:.2f} ms" for label, m in tried)
            return (f"plan trials returned to bf16: no candidate plan beat {bf16_ms:.2f} ms in bf16 by more than "
                    f"{100 * self.tolerance:g}% ({each})")
        if self.chosen is None and self.pending is not None:
            label, m = self.labels[self.pending], self.medians[self.pending]
            step = "in bf16 for one window" if self.confirming == "bf16" else "it again"
            return (f"plan trials: the {label} plan was fastest ({m[1]:.2f} ms against {m[0]:.2f} ms in bf16); "
                    f"confirming it next to bf16: running {step}")
        if self.chosen is None:
            label, m = tried[-1]
            return f"plan trials: the {label} plan ran a median step of {m[1]:.2f} ms against {bf16_ms:.2f} ms in bf16"
        others = ", ".join(f"{label} {m[1]:.2f} ms" for i, (label, m) in enumerate(tried) if i != self.chosen)
        kept = self.medians[self.chosen]
        return (
            f"plan trials kept the {self.labels[self.chosen]} plan: median step {kept[1]:.2f} ms against "
            f"{kept[0]:.2f} ms in bf16" + (f" ({others})" if others else "") + confirmed
        )

    # ------------------------------------------------------------------ checkpoints
    def to_dict(self) -> Dict[str, Any]:
        return {
            "candidates": [p.to_dict() for p in self.candidates],
            "labels": list(self.labels),
            "medians": [None if m is None else list(m) for m in self.medians],
            "index": self.index,
            "chosen": self.chosen,
            "tolerance": self.tolerance,
            "confirm": self.confirm,
            "pending": self.pending,
            "confirming": self.confirming,
            "confirm_steps": self.confirm_steps,
            "confirm_medians": None if self.confirm_medians is None else list(self.confirm_medians),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PlanTrials":
        if d.get("confirming") not in (None, "bf16", "fp8"):
            raise ValueError(f"plan trials: confirming must be null, 'bf16' or 'fp8'; got {d.get('confirming')!r}")
        return cls(
            [DispatchPlan.from_dict(p) for p in d["candidates"]],
            list(d["labels"]),
            [None if m is None else (float(m[0]), float(m[1])) for m in d["medians"]],
            int(d["index"]),
            None if d.get("chosen") is None else int(d["chosen"]),
            float(d.get("tolerance", 0.0)),  # trials saved before the tolerance was kept: 0
            # trials saved before confirmations existed: none under way
            bool(d.get("confirm", False)),
            None if d.get("pending") is None else int(d["pending"]),
            d.get("confirming"),
            int(d.get("confirm_steps", 0)),
            None if d.get("confirm_medians") is None else (float(d["confirm_medians"][0]), float(d["confirm_medians"][1])),
        )


def _with_decisions(plan: DispatchPlan, decisions: Dict[Tuple[str, Any], Any]) -> DispatchPlan:
    layers = dict(plan.layers)
    for (name, role), decision in decisions.items():
        layer = layers.get(name)
        if layer is None or role not in layer.roles or layer.roles[role].choice.is_high_precision:
            continue
        layers[name] = dataclasses.replace(layer, roles={**layer.roles, role: decision})
    return dataclasses.replace(plan, layers=layers)


def ranked_plans(
    layer_checked: DispatchPlan, accuracy_gated: DispatchPlan, layer_check: Sequence[Mapping[str, Any]], parts: int
) -> List[Tuple[str, DispatchPlan]]:
    """Plans between ``layer_checked`` and ``accuracy_gated``, the layers the layer check sent back
    to bf16 added back best first, in ``parts + 1`` equal steps (the last step, all of them, is
    ``accuracy_gated`` itself and not returned).

    Args:
        layer_checked, accuracy_gated: the policy's plan after and before the layer check.
        layer_check: the check's records (:func:`~loka_torchrec.dispatch.layer_check.check_plan_layers`):
            a layer's ``speedup`` (bf16 time over FP8 time, the layer alone) ranks it, its
            multiply-adds (``rows`` times the layer's sizes) break ties, then its name. A layer whose
            FP8 variant failed to run (a record with ``error``), or with no record, is never added back.
        parts: how many intermediate plans (``dispatch.ranked_trials``); 0 gives none.

    Returns:
        ``[("layer-ranked K/N", plan), ...]``, ``K`` growing, each plan holding ``accuracy_gated``'s
        kernels for the ``K`` best of the ``N`` layers sent back, ``layer_checked``'s for the rest.

    Example::

        >>> from loka_torchrec.dispatch.plan import DispatchPlan
        >>> empty = DispatchPlan({}, "policy")
        >>> ranked_plans(empty, empty, [], parts=1)
        []
    """
    sent_back = [
        r for r in layer_check
        if "speedup" in r and not r.get("kept_fp8") and r["layer"] in accuracy_gated.layers
        and r["layer"] in layer_checked.layers and not accuracy_gated.layers[r["layer"]].kernels.all_high_precision
    ]  # fmt: skip

    def multiply_adds(record) -> int:
        layer = accuracy_gated.layers[record["layer"]]
        return int(record.get("rows") or 0) * layer.in_features * layer.out_features

    sent_back.sort(key=lambda r: (-float(r["speedup"]), -multiply_adds(r), r["layer"]))
    total = len(sent_back)
    out: List[Tuple[str, DispatchPlan]] = []
    for part in range(1, max(int(parts), 0) + 1):
        count = math.ceil(total * part / (parts + 1))
        if count == 0 or count == total:
            continue
        added = {r["layer"] for r in sent_back[:count]}
        layers = {name: (accuracy_gated.layers[name] if name in added else lp) for name, lp in layer_checked.layers.items()}
        out.append((f"layer-ranked {count}/{total}", dataclasses.replace(layer_checked, layers=layers)))
    return out


def candidate_plans(*labelled: Tuple[str, DispatchPlan]) -> List[Tuple[str, DispatchPlan]]:
    """The ``(label, plan)`` pairs worth a trial, in the order given: those with an FP8 GEMM, a
    plan equal to an earlier one dropped."""
    out: List[Tuple[str, DispatchPlan]] = []
    for label, plan in labelled:
        if plan.fp8_gemm_count() and all(plan.digest() != p.digest() for _, p in out):
            out.append((label, plan))
    return out
