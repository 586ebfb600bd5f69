"""The one entry point: apply the configured mods to a model, in a fixed order, and report."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

from torch import nn

from loka_torchrec.mods.block_norm import block_norm
from loka_torchrec.mods.config import ModResult, ModsConfig, ModsReport
from loka_torchrec.mods.functional import FUNCTION_REWRITES, rewrite_functions
from loka_torchrec.mods.hard_swish import hard_swish
from loka_torchrec.mods.module_tree import check_unwrapped
from loka_torchrec.mods.no_bias import no_bias
from loka_torchrec.mods.padding import pad_to_16
from loka_torchrec.mods.siblings import fuse_siblings
from loka_torchrec.mods.unmatched import why_unmatched

__all__ = ["apply_mods"]

_MODS: Dict[str, Callable[[nn.Module, ModsConfig], ModResult]] = {
    "no_bias": lambda m, c: no_bias(m, keep_bias=c.keep_bias, keep_prediction_bias=c.keep_prediction_bias),
    "block_norm": lambda m, c: block_norm(m, block_size=c.block_size),
    "hard_swish": lambda m, c: hard_swish(m),
    "fuse_siblings": lambda m, c: fuse_siblings(m),
    "pad_to_16": lambda m, c: pad_to_16(m),
}


def apply_mods(model: nn.Module, config: ModsConfig) -> ModsReport:
    """Apply the mods ``config`` enables to ``model``, in place, and report what each touched.

    The order is fixed (:data:`~loka_torchrec.mods.config.MOD_NAMES`): ``no_bias``,
    ``block_norm``, ``hard_swish``, ``fuse_siblings``, ``pad_to_16``. Call it on the unsharded
    model, after building it and before Dispatch converts its linears and before
    ``DistributedModelParallel`` wraps it. ``preset="none"`` returns an empty report and leaves
    the model untouched. Each mod's docstring states exactly what it changes numerically; the
    embedding tables are never touched.

    Args:
        model: the unsharded model.
        config: which mods.

    Returns:
        A :class:`ModsReport`, one :class:`ModResult` per enabled mod.

    Example::

        >>> import torch
        >>> model = nn.Sequential(nn.Linear(20, 30), nn.LayerNorm(30), nn.SiLU(), nn.Linear(30, 1))
        >>> report = apply_mods(model, ModsConfig(preset="all", block_size=16))
        >>> print(report)
        mods (preset=all):
          no_bias: 1 module(s) [0]; skipped 3 (final prediction layer)
          block_norm: 1 module(s) [1]
          hard_swish: 1 module(s) [2]
          fuse_siblings: 0 module(s)
          pad_to_16: 2 module(s) [0, 3]
        >>> model(torch.randn(4, 20)).shape
        torch.Size([4, 1])
    """
    if not isinstance(config, ModsConfig):
        raise TypeError(f"config must be a ModsConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_unwrapped(model, mod="apply_mods")
    results: List[ModResult] = []
    for name in config.enabled:
        result = _MODS[name](model, config)
        if name in FUNCTION_REWRITES:
            functions = rewrite_functions(model, name, block_size=config.block_size)
            result = dataclasses.replace(result, functions=functions)
        if not result.modules and not result.skipped:
            rewritten = tuple(line.split(" -> ")[0] for line in result.functions)
            result = dataclasses.replace(result, unmatched=why_unmatched(model, name, rewritten=rewritten))
        results.append(result)
    return ModsReport(config, tuple(results))
