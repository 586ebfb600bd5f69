"""The selection rule: per GEMM, the fastest candidate that is accurate enough, else bf16.

For each layer and role, a candidate is *admissible* when

* its evidence is finite (a MERE, time or bound that is inf or NaN measured nothing), and
* its MERE upper confidence bound is below ``max_mere``, and, for a grad-weight GEMM with
  real-row evidence, the upper bound of its noise ratio (FP8 error power over the weight
  gradient's batch sampling noise) is at most ``max_noise_ratio`` (accuracy gate), and
* its speedup lower bound over bf16 (baseline lower bound / candidate upper bound) is at least
  ``min_speedup`` (speed gate; 1.05 by default, so noise alone never buys FP8).

The admissible candidate with the highest point speedup wins; with none, the GEMM stays in bf16
and the reason names the best rejected candidate and the gate it failed. Forward, grad-input and
grad-weight are decided independently.

**Accumulation is decided by accuracy, not by timing noise.** A recipe's ``_fast_accum`` twin runs
the same GEMM without the periodic promotion of its partial sums to fp32 along ``K``. Where
the winner accumulates with promotion and its fast twin is admissible too, the twin wins unless the
promoted kernel is clearly faster (its whole time interval below the twin's). Per-GEMM timings of
the two differ by a few percent either way from one planning to the next, which would otherwise
pick the accumulation at random.

**Compiled jobs share quantizations** (:func:`share_quantizations`): a layer whose three GEMMs use
tensorwise operands of one backend quantizes each tensor once, the forward's FP8 ``x`` and ``W``
serving grad-weight and grad-input transposed and grad-input's FP8 ``dy`` serving grad-weight
(:mod:`loka_torchrec.dispatch.gemm_function`); Inductor fuses those casts into their producers. A
grad-weight on rowwise operands quantizes ``x`` and ``dy`` again along the other axis. Per-GEMM
evidence charges each candidate its own quantization and cannot see that saving, so in a compiled
job grad-input and grad-weight take the forward's tensorwise backend where one of its candidates
passes both gates for them. Dispatch applies this after the layer check, which decides FP8 against
bf16 per layer by timing eager layers, where tensorwise operands are not fused or shared.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, List, Optional, Tuple

from loka_torchrec.dispatch.plan import DispatchPlan, LayerPlan, RoleDecision
from loka_torchrec.evidence import BF16, CandidateEvidence, GemmRole, KernelChoice
from loka_torchrec.gemm.recipes import FAST_ACCUM_SUFFIX, split_fast_accum

__all__ = ["decide", "decide_role", "share_quantizations"]


def decide_role(
    evidence: List[CandidateEvidence], *, max_mere: float, min_speedup: float, source: str, max_noise_ratio: float = 0.0
) -> RoleDecision:
    """Pick the kernel for one GEMM from its candidates' evidence (``max_noise_ratio`` 0: the noise
    ratio gates nothing)."""
    fp8 = [e for e in evidence if not e.candidate.is_high_precision]
    excluded = [e for e in fp8 if e.note.startswith("excluded")]
    fp8 = [e for e in fp8 if not e.note.startswith("excluded")]
    nonfinite = [e for e in fp8 if not _finite(e)]
    fp8 = [e for e in fp8 if _finite(e)]  # non-finite evidence never passes a gate
    if nonfinite and not fp8:
        reason = f"non-finite evidence: {nonfinite[0].candidate} MERE {nonfinite[0].error.value} (hi {nonfinite[0].error.high})"
        return RoleDecision(BF16, reason, source, None, tuple(evidence))
    admissible = [e for e in fp8 if _admissible(e, max_mere, min_speedup, max_noise_ratio)]
    if admissible:
        best, accumulation = _fastest(admissible)
        noise = ""
        if best.noise_ratio is not None and max_noise_ratio > 0:
            noise = f", noise ratio {best.noise_ratio.value:.3g} (hi {best.noise_ratio.high:.3g} <= {max_noise_ratio})"
        reason = (
            f"fastest accurate of {len(fp8)}: MERE {best.error.value:.4f} (hi {best.error.high:.4f} < {max_mere}){noise}, "
            f"{best.speedup:.2f}x (lo {best.speedup_low:.2f}x >= {min_speedup})"
        ) + accumulation
        return RoleDecision(best.candidate, reason, source, best, tuple(evidence))
    if not fp8:
        why = "; ".join(f"{e.candidate} {e.note}" for e in excluded)
        return RoleDecision(BF16, "no FP8 candidate could run here" + (f" ({why})" if why else ""), source, None, tuple(evidence))
    accurate_ones = [e for e in fp8 if _accurate(e, max_mere, max_noise_ratio)]
    if accurate_ones:
        best = max(accurate_ones, key=lambda e: e.speedup)
        reason = f"none fast enough: best {best.candidate} {best.speedup:.2f}x (lo {best.speedup_low:.2f}x < {min_speedup})"
    elif any(e.error.high < max_mere for e in fp8):  # within the MERE bound, over the noise bound
        best = min((e for e in fp8 if e.error.high < max_mere), key=lambda e: e.noise_ratio.high)
        reason = f"none accurate enough: best {best.candidate} noise ratio hi {best.noise_ratio.high:.3g} > {max_noise_ratio}"
    else:
        best = min(fp8, key=lambda e: e.error.high)
        reason = f"none accurate enough: best {best.candidate} MERE hi {best.error.high:.4f} >= {max_mere}"
    return RoleDecision(BF16, reason, source, None, tuple(evidence))


def _accurate(e: CandidateEvidence, max_mere: float, max_noise_ratio: float) -> bool:
    """The accuracy gate: MERE upper bound below ``max_mere``; where the evidence has a noise ratio
    and ``max_noise_ratio`` > 0, its upper bound at most ``max_noise_ratio``."""
    noise_ok = max_noise_ratio <= 0 or e.noise_ratio is None or e.noise_ratio.high <= max_noise_ratio
    return e.error.high < max_mere and noise_ok


def _admissible(e: CandidateEvidence, max_mere: float, min_speedup: float, max_noise_ratio: float) -> bool:
    """Both gates on usable evidence: not excluded, finite, accurate, and fast enough."""
    return (not e.note.startswith("excluded") and _finite(e) and _accurate(e, max_mere, max_noise_ratio)
            and e.speedup_low >= min_speedup)  # fmt: skip


def _fastest(admissible: List[CandidateEvidence]) -> Tuple[CandidateEvidence, str]:
    """The admissible candidate that wins, and what its reason adds: the highest point speedup,
    ties to the lower error; then its fast-accumulation twin, where that is admissible and not
    clearly slower (module docstring), which the reason notes."""
    top = max(admissible, key=lambda e: (e.speedup, -e.error.value))
    twin = _fast_twin(top, admissible)
    if twin is None or twin.time_ms.low > top.time_ms.high:
        return top, ""
    return twin, f"; over {top.candidate} ({top.speedup:.2f}x, not clearly faster: fast accumulation)"


def _fast_twin(e: CandidateEvidence, pool: List[CandidateEvidence]) -> Optional[CandidateEvidence]:
    """``e``'s candidate with fast accumulation, from ``pool`` (``None``: ``e`` has it already, or
    the pool has no such candidate)."""
    recipe, fast = split_fast_accum(e.candidate.recipe)
    if fast:
        return None
    twin = KernelChoice(e.candidate.backend, recipe + FAST_ACCUM_SUFFIX)
    return next((c for c in pool if c.candidate == twin), None)


def _finite(e: CandidateEvidence) -> bool:
    """Whether the evidence measured something: no NaN in its numbers, and not made from statistics
    that held inf/NaN (an unavailable candidate's inf error and time already fail the gates)."""
    numbers = (e.error.value, e.error.low, e.error.high, e.time_ms.value, e.time_ms.high, e.baseline_time_ms.value, e.baseline_time_ms.low)
    return not any(math.isnan(v) for v in numbers) and "non-finite statistics" not in e.note


def decide(
    evidence: Iterable[CandidateEvidence],
    layers: Dict[str, Tuple[int, int, int]],
    *,
    max_mere: float,
    min_speedup: float,
    source: str,
    max_noise_ratio: float = 0.0,
    mode: str = "policy",
    step: int = 0,
    device: str = "",
) -> DispatchPlan:
    """Make a :class:`DispatchPlan` from evidence.

    Args:
        evidence: candidate evidence for any subset of layers and roles.
        layers: canonical FQN -> ``(rows, in_features, out_features)`` of every managed layer;
            a layer or role without evidence stays in bf16 with the reason "no evidence".
        max_mere, min_speedup, max_noise_ratio: the gates (see the module docstring; 0: the noise
            ratio gates nothing).
        source: recorded in each decision, e.g. ``"policy/probe"``.
    """
    by_key: Dict[Tuple[str, GemmRole], List[CandidateEvidence]] = {}
    for e in evidence:
        by_key.setdefault((e.layer, e.role), []).append(e)
    plans: Dict[str, LayerPlan] = {}
    for name, (rows, in_features, out_features) in layers.items():
        roles = {}
        for role in GemmRole:
            found = by_key.get((name, role))
            if found:
                roles[role] = decide_role(
                    found, max_mere=max_mere, min_speedup=min_speedup, source=source, max_noise_ratio=max_noise_ratio
                )
            else:
                roles[role] = RoleDecision(BF16, "no evidence", source)
        plans[name] = LayerPlan(name, in_features, out_features, rows, roles)
    gates = {"max_mere": max_mere, "min_speedup": min_speedup, "max_grad_noise_ratio": max_noise_ratio}
    return DispatchPlan(plans, mode, step, device, gates)


def share_quantizations(plan: DispatchPlan, *, max_mere: float, min_speedup: float, max_noise_ratio: float = 0.0) -> DispatchPlan:
    """``plan`` with grad-input and grad-weight on the forward's tensorwise backend where admissible.

    For every layer whose forward runs a tensorwise recipe on backend ``b``: each of grad-input and
    grad-weight that runs another FP8 kernel takes instead the fastest ``b`` tensorwise candidate
    (either accumulation) that passes the same gates as :func:`decide_role`; a role in bf16, or
    one with no such candidate, keeps its decision. For compiled jobs (see the module docstring).
    """
    layers = {}
    for name, layer in plan.layers.items():
        fwd = layer.roles.get(GemmRole.FORWARD)
        if fwd is None or fwd.choice.is_high_precision or not _tensorwise(fwd.choice):
            layers[name] = layer
            continue
        roles = dict(layer.roles)
        for role in (GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT):
            own = roles.get(role)
            if own is None or own.choice.is_high_precision or _shares(own.choice, fwd.choice):
                continue
            sharing = [
                e for e in own.considered
                if _shares(e.candidate, fwd.choice) and _admissible(e, max_mere, min_speedup, max_noise_ratio)
            ]
            if not sharing:
                continue
            best, accumulation = _fastest(sharing)
            alone = f"{own.evidence.speedup:.2f}x" if own.evidence is not None else "?"
            reason = (
                f"shares the forward's tensorwise quantization (compiled): MERE {best.error.value:.4f} "
                f"(hi {best.error.high:.4f} < {max_mere}), {best.speedup:.2f}x (lo {best.speedup_low:.2f}x >= "
                f"{min_speedup}); alone {own.choice} was {alone}"
            ) + accumulation
            roles[role] = RoleDecision(best.candidate, reason, own.source, best, own.considered)
        layers[name] = dataclasses.replace(layer, roles=roles)
    return dataclasses.replace(plan, layers=layers)


def _tensorwise(choice) -> bool:
    return split_fast_accum(choice.recipe)[0] == "tensorwise"


def _shares(choice, fwd) -> bool:
    """Whether a GEMM on ``choice`` reuses the forward's (``fwd``) tensorwise operands."""
    return not choice.is_high_precision and choice.backend == fwd.backend and _tensorwise(choice)
