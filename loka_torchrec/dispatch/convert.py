"""Swap ``nn.Linear`` layers for ``LokaLinear`` and report what changed and what did not."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.fp8 import Fp8Format

__all__ = ["ConversionReport", "convert_linears", "canonical_fqn", "WRAPPER_PREFIXES"]

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
        converted: ``(fqn, in_features, out_features)`` of every layer now a ``LokaLinear``.
        skipped: ``(fqn, reason)`` of every GEMM-like module left alone.
    """

    converted: List[Tuple[str, int, int]] = dataclasses.field(default_factory=list)
    skipped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)


def _selected(fqn: str, module: nn.Linear, config: DispatchConfig) -> Optional[str]:
    """``None`` if ``module`` is to be converted, else the reason it is not."""
    if not any(fnmatch.fnmatchcase(fqn, pattern) for pattern in config.include):
        return f"not matched by dispatch.include {list(config.include)}"
    hit = next((p for p in config.exclude if fnmatch.fnmatchcase(fqn, p)), None)
    if hit:
        return f"excluded by dispatch.exclude {hit!r}"
    if min(module.in_features, module.out_features) < config.min_features:
        return f"smaller than dispatch.min_features={config.min_features} ({module.in_features} -> {module.out_features})"
    return None


def _raw_matmul_owner(module: nn.Module) -> bool:
    """A non-Linear module holding its own 2-D weight parameters (e.g. TorchRec's LowRankCrossNet)."""
    name = type(module).__name__
    containers = (nn.ParameterList, nn.ParameterDict)
    if isinstance(module, (nn.Linear, nn.Embedding, nn.EmbeddingBag) + containers) or "Embedding" in name:
        return False
    own = list(module.parameters(recurse=False))
    for child in module.children():
        if isinstance(child, containers):  # parameters kept in a list are still the module's own
            own.extend(child.parameters())
    return any(p.dim() == 2 for p in own)


def convert_linears(model: nn.Module, config: DispatchConfig) -> Tuple[Dict[str, nn.Module], ConversionReport]:
    """Replace selected ``nn.Linear`` modules of ``model`` in place by ``LokaLinear``.

    The new modules share the old ones' ``Parameter`` objects, so optimizers, DDP and DMP that
    already hold them keep working, and state_dict keys are unchanged.

    Returns:
        canonical FQN -> ``LokaLinear`` of every converted layer, and the report.
    """
    from loka_torchrec.dispatch.linear import LokaLinear

    grad_format = Fp8Format.parse(config.grad_format, field="dispatch.grad_format")
    report = ConversionReport()
    layers: Dict[str, nn.Module] = {}
    for fqn, module in list(model.named_modules()):
        name = canonical_fqn(fqn)
        if isinstance(module, LokaLinear):
            layers[name] = module
            report.converted.append((name, module.in_features, module.out_features))
            continue
        if isinstance(module, nn.Linear):
            reason = _selected(name, module, config)
            if reason:
                report.skipped.append((name, reason))
                continue
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            new = LokaLinear.from_linear(module, grad_format=grad_format)
            setattr(parent, child, new)
            layers[name] = new
            report.converted.append((name, module.in_features, module.out_features))
        elif _raw_matmul_owner(module):
            report.skipped.append(
                (name, f"{type(module).__name__} multiplies by its own Parameters (not nn.Linear): left in high precision")
            )
    return layers, report
