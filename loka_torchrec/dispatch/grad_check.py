"""The gradient check: a plan must keep every site's weight gradient accurate, end to end.

The accuracy gate of the policy (:mod:`loka_torchrec.dispatch.policy`) judges each GEMM alone: the
error of its output against float64. It cannot see what the model does with that error downstream.
A forward GEMM's error travels through everything after it, and some models amplify it: in an HSTU
block the fused u|v|q|k projection feeds ``silu(q k^T)`` attention and per-head layer norms, and
a forward error that is small for the projection's output can become a large one in every weight
gradient of the model, while the same projection's grad-weight GEMM alone stays accurate.

This check measures that on the model itself. ``loss_fn`` runs one forward on a fixed batch and
returns the scalar loss, or two losses, one per half of the batch's rows (their mean is the loss);
the check takes the sites' weight gradients of that loss (``torch.autograd.grad``: no ``.grad`` of
any Parameter changes) and runs it

1. with every site in high precision (the reference),
2. with the plan's kernels: the SQNR of each site's weight gradient against the reference;
3. if some site fails (below): once for each planned FP8 role of each site with that role
   alone in FP8 (the rest high precision), which gives each (site, role) its own damage (the worst
   weight-gradient SQNR it causes);
4. then sends the most damaging (site, role) back to bf16 and runs the plan again, one at a time,
   until no site fails (or nothing is left in FP8).

A site fails when its weight gradient is below ``floor_db`` against the reference, unless (with
two half-batch losses and ``max_noise_ratio > 0``) the FP8 error ``E`` is both

* small next to the batch's own sampling noise, ``|E|^2 <= max_noise_ratio * |R_1 - R_2|^2 / 4``
  with ``R_1``, ``R_2`` the reference gradients of the two halves: ``|R_1 - R_2|^2 / 4``
  estimates how far this batch's gradient is from another batch's of the same size, so FP8 adds
  at most ``max_noise_ratio`` to the noise SGD already has (as a batch that much smaller would); and
* not systematic: the part of the error both halves share, ``<E_1, E_2>``, is itself above
  ``floor_db`` against the gradient. An error that is the same on every batch (a forward error
  the model amplifies, values flushed to zero) adds up over steps, where noise averages out.

A grad-weight GEMM whose output is a small sum of large terms (the gradient of a model in
mid-training) can be under an SQNR floor against its own reference while its error is a small
part of the batch's noise: the second rule keeps such GEMMs in FP8 and the first rule alone would not.

A demoted role's reason in the plan names the gradient it damaged and its SQNR. ``loss_fn`` must
be deterministic (fixed batch, no dropout): every run must see the same model and data.

Memory: on a GPU each site's weight gradient moves to host memory as the backward computes it (a
hook on the site's Parameter; autograd then holds a zero-stride stand-in, no memory), and comes
back to the device only while that site is compared. A check then holds no set of the sites'
gradients on the device on top of the training step's memory, only the gradient being computed
and the one site being compared; the gradients of a model's dense Parameters can be several GiB
a set.

The check runs the model eagerly. For a model that trains compiled (``compiled=True``) the sites
scale their forward operands as their compiled calls will
(:func:`~loka_torchrec.dispatch.gemm_site.compiled_scaling`: delayed scaling by each site's amax
history, where it is set), so the check judges the scales that training uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.gemm_site import compiled_scaling
from loka_torchrec.dispatch.plan import DispatchPlan, LayerPlan, RoleDecision
from loka_torchrec.evidence import BF16, GemmRole
from loka_torchrec.fp8.error_metrics import noise_and_signal, sqnr_from_sums

__all__ = ["check_plan_gradients", "site_parameter", "SOURCE", "DEFAULT_FLOOR_DB", "DEFAULT_MAX_NOISE_RATIO"]

SOURCE = "gradient_check"
DEFAULT_FLOOR_DB = 17.0
"""torchao's SQNR floor for the gradients of an FP8-trained layer (dB)."""
DEFAULT_MAX_NOISE_RATIO = 0.1
"""FP8 error power allowed, as a share of the weight gradient's batch sampling noise."""

_ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)

SiteGradient = Tuple[Optional[torch.Tensor], Optional[Tuple[torch.Tensor, torch.Tensor]]]
"""A site's weight gradient of the loss, or (``None`` and) the gradients of the two half-batch
losses, whose mean it is: the halves alone are kept, so that a check holds no more than two
gradients per site and run."""


def _whole(gradient: SiteGradient) -> torch.Tensor:
    full, halves = gradient
    return full if full is not None else (halves[0] + halves[1]) / 2


def site_parameter(module: torch.nn.Module) -> torch.nn.Parameter:
    """The Parameter a site multiplies by: a ``ParameterSite``'s ``operand``, a ``LokaLinear``'s ``weight``."""
    return module.operand if hasattr(module, "operand") else module.weight


def _gradients(
    layers: Dict[str, torch.nn.Module], kernels: Dict[str, LayerKernels], loss_fn: Callable[[], torch.Tensor], *,
    halves: bool = True, park: Optional[torch.device] = None,
) -> Dict[str, Optional[SiteGradient]]:
    """Each site's weight gradient with ``kernels`` (high precision where none is given); when
    ``loss_fn`` gives two half-batch losses (and ``halves``), each half's gradient too.

    ``park``: where each gradient goes as the backward computes it (the host, on a GPU), so that
    the device never holds a set of them (module docstring)."""
    names = list(layers)
    params = [site_parameter(layers[name]) for name in names]
    for name in names:
        layers[name].set_kernels(kernels.get(name, LayerKernels()))
    loss = loss_fn()
    if loss.dim() == 0 or not halves:
        whole = _grads_of(loss if loss.dim() == 0 else loss.mean(), params, park, retain_graph=False)
        return {name: None if g is None else (g, None) for name, g in zip(names, whole)}
    first = _grads_of(loss[0], params, park, retain_graph=True)
    second = _grads_of(loss[1], params, park, retain_graph=False)
    return {name: None if a is None or b is None else (None, (a, b)) for name, a, b in zip(names, first, second)}


def _grads_of(
    loss: torch.Tensor, params: List[torch.nn.Parameter], park: Optional[torch.device], *, retain_graph: bool
) -> List[Optional[torch.Tensor]]:
    """The float32 gradients of ``loss`` for ``params`` (``None`` for one the loss does not use),
    without touching any ``.grad``; with ``park``, each is moved there by a hook the moment autograd
    has it, and autograd keeps an expanded zero in its place."""
    if park is None:
        grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
        return [None if g is None else g.detach().float() for g in grads]
    parked: List[Optional[torch.Tensor]] = [None] * len(params)
    slots: Dict[int, List[int]] = {}  # one hook per Parameter, also where several sites share one
    for i, p in enumerate(params):
        slots.setdefault(id(p), []).append(i)

    def parking(indices: List[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            moved = grad.detach().to(park).float()
            for i in indices:
                parked[i] = moved
            return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)

        return hook

    handles = [params[indices[0]].register_hook(parking(indices)) for indices in slots.values()]
    try:
        torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return parked


def _moved(gradient: Optional[SiteGradient], device: torch.device) -> Optional[SiteGradient]:
    """``gradient`` (a site's, or ``None``) with its tensors on ``device``."""
    if gradient is None:
        return None
    full, halves = gradient
    return (None if full is None else full.to(device), None if halves is None else (halves[0].to(device), halves[1].to(device)))


def _host_for(layers: Dict[str, torch.nn.Module]) -> Optional[torch.device]:
    """Where the gradients wait (module docstring): the host when the sites are on a GPU."""
    on_cuda = any(site_parameter(m).device.type == "cuda" for m in layers.values())
    return torch.device("cpu") if on_cuda else None


def _noise_rule(got: SiteGradient, ref: SiteGradient, error: float, signal: float) -> Optional[Dict[str, float]]:
    """The numbers of the noise rule (module docstring) for one site whose whole gradient has
    ``error`` and ``signal`` power against the reference; ``None`` without halves."""
    g_halves, r_halves = got[1], ref[1]
    if g_halves is None or r_halves is None:
        return None
    r1, r2 = r_halves
    e1, e2 = g_halves[0] - r1, g_halves[1] - r2  # float32 differences, summed in float64
    batch_noise = float((r1 - r2).square().sum(dtype=torch.float64)) / 4
    shared = max(float((e1 * e2).sum(dtype=torch.float64)), 0.0)
    return {
        "noise_ratio": error / batch_noise if batch_noise > 0 else float("inf"),
        "systematic_db": sqnr_from_sums(shared, signal),
    }


def _assess(
    grads, reference, floor_db: float, max_noise_ratio: float, devices: Optional[Dict[str, torch.device]] = None
) -> Tuple[float, str, List[str], Dict[str, dict]]:
    """The lowest weight-gradient SQNR (dB) and its site; the sites that fail (module docstring);
    and for each site under the floor, its SQNR and the noise rule's numbers. Gradients that wait
    on the host come to ``devices[site]`` (the site's own device) one site at a time."""
    worst, where, failing, under = float("inf"), "", [], {}
    for name, ref in reference.items():
        got = grads.get(name)
        if ref is None or got is None:
            continue
        if devices is not None:
            got, ref = _moved(got, devices[name]), _moved(ref, devices[name])
        whole = _whole(got)
        finite = bool(torch.isfinite(whole).all())
        error, signal = noise_and_signal(whole, _whole(ref)).tolist() if finite else (math.inf, math.nan)
        del whole
        db = sqnr_from_sums(error, signal) if finite else -math.inf
        if db < worst:
            worst, where = db, name
        if db >= floor_db:
            continue
        rule = _noise_rule(got, ref, error, signal) if finite and max_noise_ratio > 0 else None
        under[name] = {"db": db, **(rule or {})}
        if rule is None or not (rule["noise_ratio"] <= max_noise_ratio and rule["systematic_db"] >= floor_db):
            failing.append(name)
    return worst, where, failing, under


def check_plan_gradients(
    plan: DispatchPlan,
    layers: Dict[str, torch.nn.Module],
    loss_fn: Callable[[], torch.Tensor],
    *,
    floor_db: float = DEFAULT_FLOOR_DB,
    max_noise_ratio: float = DEFAULT_MAX_NOISE_RATIO,
    compiled: bool = False,
) -> Tuple[DispatchPlan, List[dict]]:
    """``plan`` with the FP8 roles that make a site's weight gradient fail (module docstring) back in bf16.

    Args:
        plan: the plan to check (any mode's).
        layers: FQN -> site (``LokaLinear`` or ``ParameterSite``); their kernels are the plan's
            again when the check returns.
        loss_fn: one deterministic forward of the model, returning the scalar loss or the two
            half-batch losses (see the module docstring).
        floor_db: the SQNR every site's weight gradient must reach against high precision, unless
            the noise rule holds.
        max_noise_ratio: the noise rule's bound (0: no noise rule, the floor alone).
        compiled: the model trains compiled: its sites scale as compiled calls do (module docstring).

    Returns:
        ``(checked_plan, records)``: a record per run of the plan (the worst SQNR and its site, the
        failing sites, the sites under the floor with the noise rule's numbers) and per demotion
        (site, role, kernel, the damage it did alone).
    """
    planned = {name: lp.kernels for name, lp in plan.layers.items() if name in layers}
    records: List[dict] = []

    host = _host_for(layers)
    devices = {name: site_parameter(module).device for name, module in layers.items()}

    def run(kernels: Dict[str, LayerKernels]) -> Tuple[float, str, List[str], Dict[str, dict]]:
        grads = _gradients(layers, kernels, loss_fn, halves=max_noise_ratio > 0, park=host)
        return _assess(grads, reference, floor_db, max_noise_ratio, devices)

    try:
        with compiled_scaling(layers.values()) if compiled else contextlib.nullcontext():
            reference = _gradients(layers, {}, loss_fn, halves=max_noise_ratio > 0, park=host)
            current = dict(planned)
            worst, where, failing, under = run(current)
            records.append({"kind": "plan", "worst_db": worst, "site": where, "fp8_roles": _fp8_roles(current), "failing": failing, "under_floor": under})
            if not failing:
                return plan, records
            damage = _solo_damage(layers, current, loss_fn, reference, host, devices)
            order = sorted(damage, key=lambda key: damage[key][0])
            demoted: Dict[Tuple[str, GemmRole], str] = {}  # (site, role) -> the reason written into the plan
            for name, role in order:
                alone, hurt = damage[(name, role)]
                choice = current[name].for_role(role)
                current[name] = current[name].replace(role, BF16)
                before, failed = worst, len(failing)
                worst, where, failing, under = run(current)
                noise = f" and the noise rule (FP8 error <= {max_noise_ratio} of the batch noise, not systematic)" if max_noise_ratio > 0 else ""
                demoted[(name, role)] = (
                    f"gradient check: {choice} in {role.value} alone puts {hurt}'s weight gradient at {alone:.1f} dB "
                    f"vs high precision; the plan's worst was {before:.1f} dB, and {failed} site(s) failed floor {floor_db} dB{noise}"
                )
                records.append({"kind": "demote", "layer": name, "role": role.value, "choice": str(choice), "alone_db": alone,
                                "damaged": hurt, "worst_db_after": worst, "site": where, "failing_after": failing})  # fmt: skip
                if not failing:
                    break
            return _with_demotions(plan, demoted), records
    finally:
        for name, module in layers.items():
            module.set_kernels(planned.get(name, LayerKernels()))


def _fp8_roles(kernels: Dict[str, LayerKernels]) -> int:
    return sum(not k.for_role(role).is_high_precision for k in kernels.values() for role in _ROLES)


def _solo_damage(
    layers, kernels: Dict[str, LayerKernels], loss_fn, reference, park: Optional[torch.device], devices: Dict[str, torch.device]
) -> Dict[Tuple[str, GemmRole], Tuple[float, str]]:
    """(site, role) -> (worst weight-gradient SQNR with that role alone in FP8, the site it hit)."""
    damage = {}
    for name, k in kernels.items():
        for role in _ROLES:
            choice = k.for_role(role)
            if choice.is_high_precision:
                continue
            alone = {name: LayerKernels().replace(role, choice)}
            grads = _gradients(layers, alone, loss_fn, halves=False, park=park)
            worst, where, _, _ = _assess(grads, reference, float("inf"), 0.0, devices)
            damage[(name, role)] = (worst, where)
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
