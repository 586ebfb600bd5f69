"""Why a module-level mod matched nothing: the functional calls and own classes it cannot see.

A mod swaps modules (``nn.LayerNorm``, ``nn.SiLU``). A model that normalizes with
``F.layer_norm`` or a norm class of its own, or activates with ``F.silu``, has none of them, and
the mod then changes nothing. :func:`why_unmatched` says so precisely: it reads the ``forward``
source of each module class in the model (once per class) for the function calls the mod stands
for, and names the norm-like classes that are not ``nn.LayerNorm``, so the report reads e.g.
``no nn.LayerNorm modules; this model calls F.layer_norm in StuLayer.forward (layers.0, layers.1)``.
Calls that :mod:`loka_torchrec.mods.functional` rewrites are not listed; the others stay as they are.
"""

from __future__ import annotations

import inspect
import re
from typing import Dict, List, Optional, Tuple

from torch import nn

__all__ = ["why_unmatched", "forward_source", "name_list"]

# mod -> (what it swaps, the call patterns that do the same job, a word for own classes)
_PATTERNS: Dict[str, Tuple[str, Tuple[Tuple[str, str], ...], Optional[str]]] = {
    "block_norm": (
        "nn.LayerNorm",
        (("F.layer_norm", r"\blayer_norm\("), ("F.rms_norm", r"\brms_norm\("), ("F.group_norm", r"\bgroup_norm\(")),
        "Norm",
    ),
    "hard_swish": (
        "nn.SiLU",
        (("F.silu", r"\bsilu\("), ("x * sigmoid(x)", r"sigmoid\(")),
        None,
    ),
}


def forward_source(cls: type, cache: Dict[type, str]) -> str:
    """The source of ``cls.forward`` (``""`` where none is kept), read once per class into ``cache``."""
    if cls not in cache:
        try:
            cache[cls] = inspect.getsource(cls.forward)
        except (OSError, TypeError):  # built in C, or defined where no source is kept
            cache[cls] = ""
    return cache[cls]


def why_unmatched(model: nn.Module, mod: str, *, rewritten: Tuple[str, ...] = ()) -> str:
    """For a mod that matched no module in ``model``: why, in one line (``""`` if it cannot say).

    ``rewritten``: call labels (``"F.layer_norm"``) the function-level mod rewrote
    (:mod:`loka_torchrec.mods.functional`); they are not listed as calls the mod does not rewrite.

    Example::

        >>> import torch.nn.functional as F
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.proj = nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return F.silu(F.layer_norm(self.proj(x), (4,)))
        >>> why_unmatched(nn.Sequential(Block()), "block_norm")
        'no nn.LayerNorm modules; this model calls F.layer_norm in Block.forward (0), which block_norm does not rewrite'
    """
    if mod not in _PATTERNS:
        return ""
    swaps, calls, own_word = _PATTERNS[mod]
    sources: Dict[type, str] = {}
    found: Dict[Tuple[str, str], List[str]] = {}  # (call, Class.forward) -> module names
    other: Dict[str, List[str]] = {}  # norm classes the mod does not replace -> module names
    for name, module in model.named_modules():
        cls = type(module)
        name = name or "(model)"
        if cls.__module__.startswith("torch.nn."):  # PyTorch's own norms that the mod does not take
            if own_word and own_word in cls.__name__ and not isinstance(module, nn.LayerNorm):
                other.setdefault(f"nn.{cls.__name__}", []).append(name)
            continue
        if own_word and own_word in cls.__name__ and cls.__name__ != "BlockNorm":
            other.setdefault(cls.__name__, []).append(name)
        source = forward_source(cls, sources)
        for label, pattern in calls:
            if label not in rewritten and re.search(pattern, source):
                found.setdefault((label, f"{cls.__name__}.forward"), []).append(name)
    parts = []
    for (label, where), names in found.items():
        parts.append(f"this model calls {label} in {where} ({name_list(names)})")
    for cls_name, names in other.items():
        parts.append(f"{cls_name} modules ({name_list(names)})")
    if not parts:
        return f"no {swaps} modules"
    return f"no {swaps} modules; " + "; ".join(parts) + f", which {mod} does not rewrite"


def name_list(names: List[str], most: int = 3) -> str:
    """The first ``most`` names, comma-separated, and how many more."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
