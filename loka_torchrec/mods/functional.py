"""Function-level mods: an enabled mod's rewrite applied to the calls a module's ``forward`` makes.

``block_norm`` and ``hard_swish`` swap modules (``nn.LayerNorm``, ``nn.SiLU``). A model that calls
``F.layer_norm`` or ``F.silu`` inside its ``forward`` has none of them, yet the same rewrite has an
exact functional counterpart:

=============  ==========================================  ============================================
mod            call                                        becomes
=============  ==========================================  ============================================
``block_norm`` ``F.layer_norm(x, (W,), None, None, eps)``  ``block_rms_norm(x, block_size, eps)`` (what
                                                           :class:`~loka_torchrec.mods.BlockNorm` runs)
``hard_swish`` ``F.silu(x)``                               ``F.hardswish(x)`` (what ``nn.Hardswish`` runs)
``hard_swish`` ``x * torch.sigmoid(x)`` (either order)     ``F.hardswish(x)``
=============  ==========================================  ============================================

The mechanism is the one Dispatch uses for Parameter GEMMs (:mod:`loka_torchrec.dispatch.sites`): a
torch-function mode, :class:`FunctionRewriteMode`, entered around the ``forward`` of each module
whose class's ``forward`` source makes such a call (the module becomes a *scope*; its ``forward``
is an instance attribute, nothing else changes: no Parameter, no ``state_dict`` key). Dynamo traces
the mode inside a compiled region, so a rewritten model compiles with ``fullgraph=True``. The mode
is active for everything the scope's ``forward`` calls, its children's ``forward`` included.

What is not rewritten, and why (the call runs as written; eagerly it is counted in
:attr:`FunctionRewriteMode.kept` with the reason):

* ``F.layer_norm`` with a ``weight`` or ``bias``: the module-level mod drops a LayerNorm's
  ``gamma``/``beta`` with the module; here they are the scope's own Parameters, which would stay in
  the model unused (no gradient, still in the ``state_dict``);
* ``F.layer_norm`` over several trailing dimensions (the module-level mod skips those too);
* ``x * torch.sigmoid(y)`` with ``y`` not ``x`` (a gate, not a Swish), and a ``sigmoid`` whose
  product with its input is not the very next op of the scope (the mode matches the product of the
  last ``sigmoid`` output with that ``sigmoid``'s input only);
* ``F.rms_norm``, ``F.group_norm``: ``block_norm`` has no module-level counterpart for them either
  (reported by :func:`~loka_torchrec.mods.unmatched.why_unmatched`).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from loka_torchrec.mods.block_norm import block_rms_norm
from loka_torchrec.mods.unmatched import forward_source, name_list

__all__ = ["FunctionRewriteMode", "rewrite_functions", "function_scopes", "FUNCTION_REWRITES"]

FUNCTION_REWRITES: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "block_norm": (("F.layer_norm -> block_rms_norm", r"\blayer_norm\("),),
    "hard_swish": (
        ("F.silu -> F.hardswish", r"\bsilu\("),
        (
            "x * sigmoid(x) -> F.hardswish",
            r"\b(\w+)\s*\*\s*(?:torch\.|F\.)?sigmoid\(\s*\1\s*\)"  # x * torch.sigmoid(x)
            r"|(?:torch\.|F\.)?sigmoid\(\s*(\w+)\s*\)\s*\*\s*\2\b"  # torch.sigmoid(x) * x
            r"|\b(\w+)\s*\*\s*\3\.sigmoid\(\)",  # x * x.sigmoid()
        ),
    ),
}
"""mod -> ``(label, pattern)`` per call it rewrites; the pattern finds the call in ``forward`` source."""

_MUL = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)
_SIGMOID = (torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid)
_LAYER_NORM = (F.layer_norm, torch.layer_norm)


class FunctionRewriteMode(TorchFunctionMode):
    """Rewrites the calls of the enabled mods inside one scope's ``forward`` (see the module docstring).

    Args:
        block_size: ``block_rms_norm``'s block width when ``block_norm`` is on.

    Attributes:
        mods: the enabled mods whose calls this mode rewrites.
        rewritten: label -> calls rewritten so far (eager calls only).
        kept: ``"label: reason"`` -> calls left as written (eager calls only).
    """

    def __init__(self, block_size: int = 256) -> None:
        super().__init__()
        self.mods: Tuple[str, ...] = ()
        self.block_size = block_size
        self.rewritten: Dict[str, int] = {}
        self.kept: Dict[str, int] = {}
        self._sigmoid: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (input, output) of the last sigmoid

    def _count(self, table: Dict[str, int], key: str) -> None:
        if not torch.compiler.is_compiling():
            table[key] = table.get(key, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        last, self._sigmoid = self._sigmoid, None
        if "block_norm" in self.mods and func in _LAYER_NORM:
            return self._layer_norm(func, *args, **kwargs)
        if "hard_swish" in self.mods:
            if func is F.silu:
                self._count(self.rewritten, "F.silu -> F.hardswish")
                return F.hardswish(args[0], inplace=kwargs.get("inplace", args[1] if len(args) > 1 else False))
            if func in _SIGMOID and len(args) == 1 and not kwargs:
                out = func(*args)
                self._sigmoid = (args[0], out)
                return out
            if func in _MUL and last is not None and len(args) == 2 and not kwargs:
                x, s = last
                a, b = args
                if (a is x and b is s) or (a is s and b is x):
                    self._count(self.rewritten, "x * sigmoid(x) -> F.hardswish")
                    return F.hardswish(x)
        return func(*args, **kwargs)

    def _layer_norm(self, func, input, normalized_shape, weight=None, bias=None, eps=1e-5, *rest, **options):
        label = "F.layer_norm -> block_rms_norm"
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        if len(normalized_shape) != 1:
            self._count(self.kept, f"{label}: normalizes over {len(normalized_shape)} dimensions")
        elif weight is not None or bias is not None:
            self._count(self.kept, f"{label}: has a weight or bias that the rewrite would leave unused")
        else:
            self._count(self.rewritten, label)
            return block_rms_norm(input, self.block_size, eps)
        return func(input, normalized_shape, weight, bias, eps, *rest, **options)


def _rewritten_forward(module: nn.Module, mode: FunctionRewriteMode, *args: Any, **kwargs: Any) -> Any:
    with mode:
        out = type(module).forward(module, *args, **kwargs)
    mode._sigmoid = None  # hold no activation past the forward
    return out


def function_scopes(model: nn.Module) -> Dict[str, FunctionRewriteMode]:
    """FQN -> the :class:`FunctionRewriteMode` of every module whose calls are rewritten."""
    out = {}
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        while isinstance(forward, functools.partial):  # under a Dispatch scope, the mod's scope is inside
            if forward.func is _rewritten_forward:
                out[name] = forward.args[1]
                break
            forward = forward.args[2] if len(forward.args) > 2 else None
    return out


def rewrite_functions(model: nn.Module, mod: str, *, block_size: int = 256) -> Tuple[str, ...]:
    """Rewrite, at the function level, the calls of ``mod`` in every module whose ``forward`` makes them.

    Modules of ``torch.nn`` itself are never scopes (``nn.SiLU.forward`` calls ``F.silu``: the
    module-level mod handles those). A module already scoped by another mod gets this mod added to
    its mode. Call it on the unsharded model, before Dispatch converts it.

    Args:
        model: the model.
        mod: ``"block_norm"`` or ``"hard_swish"``.
        block_size: ``block_rms_norm``'s block width for ``block_norm``.

    Returns:
        One line per (call, class): ``"<call> -> <replacement> in <Class>.forward (<modules>): <n>
        call(s) each"``, ``n`` the times the call appears in that ``forward``'s source; empty when
        the model makes no such call.
    """
    if mod not in FUNCTION_REWRITES:
        raise ValueError(f"mod: no function-level rewrite for {mod!r}; expected one of {', '.join(FUNCTION_REWRITES)}")
    sources: Dict[type, str] = {}
    found: Dict[Tuple[str, str, int], List[str]] = {}
    scopes = function_scopes(model)
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__module__.startswith("torch.nn."):
            continue
        source = forward_source(cls, sources)
        hits = [(label, len(re.findall(pattern, source))) for label, pattern in FUNCTION_REWRITES[mod]]
        hits = [(label, n) for label, n in hits if n]
        if not hits:
            continue
        mode = scopes.get(name)
        if mode is None:
            if "forward" in module.__dict__:  # an instance forward of someone else's: not ours to wrap
                continue
            mode = FunctionRewriteMode(block_size)
            module.forward = functools.partial(_rewritten_forward, module, mode)
        mode.mods = tuple(dict.fromkeys(mode.mods + (mod,)))
        if mod == "block_norm":
            mode.block_size = block_size
        for label, n in hits:
            found.setdefault((label, f"{cls.__name__}.forward", n), []).append(name or "(model)")
    return tuple(
        f"{label} in {where} ({name_list(names)}): {n} call(s) each" for (label, where, n), names in found.items()
    )

