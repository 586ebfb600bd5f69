"""Make every GEMM of a model a Dispatch site (``LokaLinear``, Parameter sites) and report what was not reached."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.dispatch.gemm_site import GemmSite
from loka_torchrec.dispatch.gemm_source import LINEAR, SiteLayout, parameter_use
from loka_torchrec.dispatch.sites import FAST_PATH_MODULES, ParameterSite, scope_module, scoped_sites
from loka_torchrec.fp8 import Fp8Format

__all__ = ["ConversionReport", "convert_linears", "canonical_fqn", "WRAPPER_PREFIXES"]

logger = logging.getLogger(__name__)

WRAPPER_PREFIXES = ("_dmp_wrapped_module.", "module.", "_orig_mod.")
"""Prefixes DMP, DDP and torch.compile add to FQNs; canonical names drop them."""


def canonical_fqn(fqn: str) -> str:
    """``"_dmp_wrapped_module.module.over_arch.x"`` -> ``"over_arch.x"``."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if fqn.startswith(prefix):
                fqn = fqn[len(prefix):]
                changed = True
    return fqn


@dataclasses.dataclass
class ConversionReport:
    """What :func:`convert_linears` did.

    Attributes:
        converted: ``(fqn, in_features, out_features)`` of every GEMM site Dispatch now manages
            (``LokaLinear`` modules by module FQN, Parameter sites by the Parameter's FQN).
        skipped: ``(fqn, reason)`` of every GEMM-like module or Parameter left alone.
        unreached: fqn -> multiply-adds per forward row of each GEMM left in high precision (the
            coverage denominator adds these to the managed sites').
        scopes: FQNs of the modules whose forward now runs under a :class:`~loka_torchrec.dispatch.sites.SiteMode`.
    """

    converted: List[Tuple[str, int, int]] = dataclasses.field(default_factory=list)
    skipped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    unreached: Dict[str, int] = dataclasses.field(default_factory=dict)
    scopes: List[str] = dataclasses.field(default_factory=list)


def _selected(fqn: str, module: nn.Module, config: DispatchConfig) -> Optional[str]:
    """``None`` if ``module`` (anything with ``in_features``/``out_features``) is to be converted, else why not."""
    if not any(fnmatch.fnmatchcase(fqn, pattern) for pattern in config.include):
        return f"not matched by dispatch.include {list(config.include)}"
    hit = next((p for p in config.exclude if fnmatch.fnmatchcase(fqn, p)), None)
    if hit:
        return f"excluded by dispatch.exclude {hit!r}"
    if min(module.in_features, module.out_features) < config.min_features:
        return f"smaller than dispatch.min_features={config.min_features} ({module.in_features} -> {module.out_features})"
    return None


_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


def _not_a_gemm_owner(module: nn.Module) -> bool:
    kinds = (nn.Linear, GemmSite, nn.Embedding, nn.EmbeddingBag, nn.ModuleDict) + _CONTAINERS
    return isinstance(module, kinds) or "Embedding" in type(module).__name__


def _own_parameters(module: nn.Module) -> List[Tuple[nn.Module, str, str, str]]:
    """``(holder, key, path, attr)`` of the Parameters ``module`` owns, list/dict entries included:
    ``path`` is relative to ``module``, ``attr`` the attribute its forward reads."""
    out = [(module, k, k, k) for k, p in module._parameters.items() if p is not None]
    for child_name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            out += [(child, k, f"{child_name}.{k}", child_name) for k, p in child._parameters.items() if p is not None]
    return out


def _mha_unsupported(module: nn.MultiheadAttention) -> Optional[str]:
    if not module._qkv_same_embed_dim:
        return "separate q/k/v projection weights (kdim/vdim != embed_dim)"
    if module.bias_k is not None or module.add_zero_attn:
        return "bias_k/bias_v or add_zero_attn"
    return None


def _site_layout(
    module: nn.Module, attr: str, param: torch.Tensor, pname: str, report: ConversionReport, *, entry: bool
) -> Optional[SiteLayout]:
    """The orientation of a new site for ``module``'s Parameter ``param`` (``self.<attr>``, or an entry
    of that container: ``entry``), from how its code multiplies by it; ``None`` (and why, in
    ``report``, under ``pname``) if it is not to be a site."""
    use = parameter_use(module, attr, entry=entry)
    if use.layout is not None:
        return use.layout
    if use.unresolved or not use.readable:
        # Passed to code whose GEMM cannot be read from the source: a site all the same, whose first
        # eager call sets its orientation; if it never runs as a GEMM, the Dispatcher says so.
        logger.info("dispatch: %s: no GEMM on it in the source (%s): a site oriented by its first call", pname,
                    "; ".join(use.unresolved) or f"{type(module).__name__}'s source is not available")  # fmt: skip
        return LINEAR
    if use.transformed:
        report.skipped.append((pname, f"multiplied only as a view or cast ({'; '.join(use.transformed)}): no site reaches it"))
        report.unreached[pname] = int(param.numel())
        return None
    report.skipped.append((pname, f"{type(module).__name__}'s code multiplies no GEMM by it: left as is"))
    return None


def convert_linears(model: nn.Module, config: DispatchConfig) -> Tuple[Dict[str, nn.Module], ConversionReport]:
    """Make every selected GEMM of ``model`` a Dispatch site, in place; report what was not reached.

    * ``nn.Linear`` modules become ``LokaLinear`` (sharing their ``Parameter`` objects);
    * 2-D Parameters that a module multiplies by itself (``F.linear``, ``@``, ``mm``, ``addmm``,
      ``einsum``; ``nn.MultiheadAttention``'s in- and out-projections) become
      :class:`~loka_torchrec.dispatch.sites.ParameterSite` sites, reached through the owner's
      :class:`~loka_torchrec.dispatch.sites.SiteMode` (see :mod:`loka_torchrec.dispatch.sites`).

    Optimizers, DDP and DMP that already hold the parameters keep working, and state_dict keys
    are unchanged.

    Returns:
        canonical FQN -> site module of every converted GEMM, and the report.
    """
    grad_format = Fp8Format.parse(config.grad_format, field="dispatch.grad_format")
    report = ConversionReport()
    layers: Dict[str, nn.Module] = {}
    for fqn, module in list(model.named_modules()):
        name = canonical_fqn(fqn)
        if isinstance(module, ParameterSite):
            continue  # an earlier apply's site: registered with its scope below
        if isinstance(module, LokaLinear):
            layers[name] = module
            report.converted.append((name, module.in_features, module.out_features))
            continue
        if isinstance(module, nn.Linear):
            reason = _selected(name, module, config)
            if reason:
                report.skipped.append((name, reason))
                report.unreached[name] = module.in_features * module.out_features
                continue
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            new = LokaLinear.from_linear(module, grad_format=grad_format, forward_scaling=config.site_forward_scaling)
            setattr(parent, child, new)
            layers[name] = new
            report.converted.append((name, module.in_features, module.out_features))

    for fqn, module in list(model.named_modules()):
        if _not_a_gemm_owner(module):
            continue
        name = canonical_fqn(fqn)
        prefix = f"{name}." if name else ""
        previous = {s.path: s for s in scoped_sites(module) if isinstance(s, ParameterSite)}
        sites: List[nn.Module] = []
        mha_problem = _mha_unsupported(module) if isinstance(module, nn.MultiheadAttention) else None
        for holder, key, path, attr in _own_parameters(module):
            param = holder._parameters[key]
            pname = prefix + path
            if not param.is_floating_point() or not param.requires_grad or param.dim() < 2:
                continue
            if param.dim() > 2:
                if min(param.shape[-2:]) > 1:
                    report.skipped.append((pname, f"{param.dim()}-D Parameter of {type(module).__name__}: a batched GEMM (bmm/baddbmm) is not a site"))
                    report.unreached[pname] = int(param[0].numel())
                continue
            if mha_problem is not None:
                report.skipped.append((pname, f"MultiheadAttention with {mha_problem}: left in high precision"))
                report.unreached[pname] = int(param.numel())
                continue
            if path in previous:
                site = previous[path]
            else:
                layout = LINEAR if isinstance(module, nn.MultiheadAttention) else _site_layout(
                    module, attr, param, pname, report, entry=holder is not module
                )
                if layout is None:
                    continue
                site = ParameterSite(
                    holder, key, layout=layout, grad_format=grad_format, forward_scaling=config.site_forward_scaling
                )
                site.path = path
            reason = _selected(pname, site, config)
            if reason:
                report.skipped.append((pname, reason))
                report.unreached[pname] = site.in_features * site.out_features
                continue
            sites.append(site)
            layers[pname] = site
            report.converted.append((pname, site.in_features, site.out_features))
        if isinstance(module, nn.MultiheadAttention) and isinstance(module.out_proj, LokaLinear):
            if mha_problem is None:
                sites.append(module.out_proj)  # MultiheadAttention reads out_proj.weight, never calls out_proj
            else:  # it would never run: back to nn.Linear, reported as not reached
                out_name = prefix + "out_proj"
                module.out_proj = module.out_proj.to_linear()
                layers.pop(out_name, None)
                report.converted = [c for c in report.converted if c[0] != out_name]
                report.skipped.append((out_name, f"MultiheadAttention with {mha_problem} reads out_proj.weight directly: left in high precision"))
                report.unreached[out_name] = module.out_proj.in_features * module.out_proj.out_features
        if sites or isinstance(module, FAST_PATH_MODULES):
            scope_module(module, sites)
            report.scopes.append(name)
    for site in layers.values():  # new sites, and an earlier apply's, take this config's scaling
        site.forward_scaling = config.site_forward_scaling
        site.grad_scaling = config.site_grad_scaling
    return layers, report
