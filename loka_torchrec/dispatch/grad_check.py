"""The gradient check: a plan must keep every site's weight gradient above an SQNR floor, end to end.

The accuracy gate of the policy (:mod:`loka_torchrec.dispatch.policy`) judges each GEMM alone: the
error of its output against float64. It cannot see what the model does with that error downstream.
A forward GEMM's error travels through everything after it, and some models amplify it: in an HSTU
block the fused u|v|q|k projection feeds ``silu(q k^T)`` attention and per-head layer norms, and
a forward error that is small for the projection's output can become a large one in every weight
gradient of the model, while the same projection's grad-weight GEMM alone stays accurate.

This check measures that on the model itself. ``loss_fn`` runs one forward on a fixed batch and
returns the scalar loss; the check takes the sites' weight gradients of that loss
(``torch.autograd.grad``: no ``.grad`` of any Parameter changes) and runs it

1. with every site in high precision (the reference),
2. with the plan's kernels: the SQNR of each site's weight gradient against the reference;
3. if some SQNR is below ``floor_db``: once for each planned FP8 role of each site with that role
   alone in FP8 (the rest high precision), which gives each (site, role) its own damage (the worst
   weight-gradient SQNR it causes);
4. then sends the most damaging (site, role) back to bf16 and runs the plan again, one at a time,
   until every weight gradient is at or above the floor (or nothing is left in FP8).

A demoted role's reason in the plan names the gradient it damaged and both SQNRs. ``loss_fn`` must
be deterministic (fixed batch, no dropout): every run must see the same model and data.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

import torch

from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.plan import DispatchPlan, LayerPlan, RoleDecision
from loka_torchrec.evidence import BF16, GemmRole
from loka_torchrec.fp8.error_metrics import sqnr_db

__all__ = ["check_plan_gradients", "site_parameter", "SOURCE", "DEFAULT_FLOOR_DB"]

SOURCE = "gradient_check"
DEFAULT_FLOOR_DB = 17.0
"""torchao's SQNR floor for the gradients of an FP8-trained layer (dB)."""

_ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)


def site_parameter(module: torch.nn.Module) -> torch.nn.Parameter:
    """The Parameter a site multiplies by: a ``ParameterSite``'s ``operand``, a ``LokaLinear``'s ``weight``."""
    return module.operand if hasattr(module, "operand") else module.weight


def _gradients(layers: Dict[str, torch.nn.Module], kernels: Dict[str, LayerKernels], loss_fn: Callable[[], torch.Tensor]):
    """Each site's weight gradient (float64) with ``kernels`` (high precision where none is given)."""
    names = list(layers)
    params = [site_parameter(layers[name]) for name in names]
    for name in names:
        layers[name].set_kernels(kernels.get(name, LayerKernels()))
    grads = torch.autograd.grad(loss_fn(), params, allow_unused=True)
    return {name: (g.detach().double() if g is not None else None) for name, g in zip(names, grads)}


def _worst(grads, reference) -> Tuple[float, str]:
    """The lowest SQNR (dB) over the sites' weight gradients, and the site that has it."""
    worst, where = float("inf"), ""
    for name, ref in reference.items():
        got = grads.get(name)
        if ref is None or got is None:
            continue
        db = sqnr_db(got, ref) if torch.isfinite(got).all() else float("-inf")
        if db < worst:
            worst, where = db, name
    return worst, where


def check_plan_gradients(
    plan: DispatchPlan,
    layers: Dict[str, torch.nn.Module],
    loss_fn: Callable[[], object],
    *,
    floor_db: float = DEFAULT_FLOOR_DB,
) -> Tuple[DispatchPlan, List[dict]]:
    """``plan`` with the FP8 roles that push a weight gradient below ``floor_db`` back in bf16.

    Args:
        plan: the plan to check (any mode's).
        layers: FQN -> site (``LokaLinear`` or ``ParameterSite``); their kernels are the plan's
            again when the check returns.
        loss_fn: one deterministic forward of the model, returning the scalar loss (see the module
            docstring).
        floor_db: the SQNR every site's weight gradient must reach against high precision.

    Returns:
        ``(checked_plan, records)``: a record per run of the plan (the worst SQNR, its site) and
        per demotion (site, role, kernel, the damage it did alone).
    """
    planned = {name: lp.kernels for name, lp in plan.layers.items() if name in layers}
    records: List[dict] = []
    try:
        reference = _gradients(layers, {}, loss_fn)
        current = dict(planned)
        worst, where = _worst(_gradients(layers, current, loss_fn), reference)
        records.append({"kind": "plan", "worst_db": worst, "site": where, "fp8_roles": _fp8_roles(current)})
        if worst >= floor_db:
            return plan, records
        damage = _solo_damage(layers, current, loss_fn, reference)
        order = sorted(damage, key=lambda key: damage[key][0])
        demoted: Dict[Tuple[str, GemmRole], str] = {}  # (site, role) -> the reason written into the plan
        for name, role in order:
            alone, hurt = damage[(name, role)]
            choice = current[name].for_role(role)
            current[name] = current[name].replace(role, BF16)
            before = worst
            worst, where = _worst(_gradients(layers, current, loss_fn), reference)
            demoted[(name, role)] = (
                f"gradient check: {choice} in {role.value} alone puts {hurt}'s weight gradient at {alone:.1f} dB "
                f"vs high precision; the plan's worst was {before:.1f} dB < floor {floor_db} dB"
            )
            records.append({"kind": "demote", "layer": name, "role": role.value, "choice": str(choice),
                            "alone_db": alone, "damaged": hurt, "worst_db_after": worst, "site": where})  # fmt: skip
            if worst >= floor_db:
                break
        return _with_demotions(plan, demoted), records
    finally:
        for name, module in layers.items():
            module.set_kernels(planned.get(name, LayerKernels()))


def _fp8_roles(kernels: Dict[str, LayerKernels]) -> int:
    return sum(not k.for_role(role).is_high_precision for k in kernels.values() for role in _ROLES)


def _solo_damage(layers, kernels: Dict[str, LayerKernels], loss_fn, reference) -> Dict[Tuple[str, GemmRole], Tuple[float, str]]:
    """(site, role) -> (worst weight-gradient SQNR with that role alone in FP8, the site it hit)."""
    damage = {}
    for name, k in kernels.items():
        for role in _ROLES:
            choice = k.for_role(role)
            if choice.is_high_precision:
                continue
            alone = {name: LayerKernels().replace(role, choice)}
            damage[(name, role)] = _worst(_gradients(layers, alone, loss_fn), reference)
    return damage


def _with_demotions(plan: DispatchPlan, demoted: Dict[Tuple[str, GemmRole], str]) -> DispatchPlan:
    layers: Dict[str, LayerPlan] = dict(plan.layers)
    for (name, role), reason in demoted.items():
        lp = layers[name]
        roles = dict(lp.roles)
        considered = roles[role].considered if role in roles else ()
        roles[role] = RoleDecision(BF16, reason, SOURCE, None, considered)
        layers[name] = dataclasses.replace(lp, roles=roles)
    return dataclasses.replace(plan, layers=layers)
