"""Hard Swish: replace SiLU / Swish, and the sigmoid gate of ``SwishLayerNorm``, by their hard versions."""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from loka_torchrec.mods.config import ModResult
from loka_torchrec.mods.module_tree import check_unwrapped, named_modules_of_type, replace_module

__all__ = ["hard_swish_reference", "hard_swish"]


def hard_swish_reference(x: torch.Tensor) -> torch.Tensor:
    """``x * relu6(x + 3) / 6``, written out (the formula ``nn.Hardswish`` computes).

    Example::

        >>> hard_swish_reference(torch.tensor([-4.0, -1.5, 0.0, 1.5, 4.0]))
        tensor([-0.0000, -0.3750,  0.0000,  1.1250,  4.0000])
    """
    return x * torch.clamp(x + 3.0, min=0.0, max=6.0) / 6.0


def _swish_layer_norm_type():
    try:
        from torchrec.modules.activation import SwishLayerNorm
    except ImportError:  # torchrec is a dependency; without it there is simply no SwishLayerNorm
        return None
    return SwishLayerNorm


def hard_swish(model: nn.Module) -> ModResult:
    """Swap Swish activations for Hard Swish, in place.

    Numerically: every ``nn.SiLU`` module, ``x * sigmoid(x)``, becomes ``nn.Hardswish``,
    ``x * relu6(x + 3) / 6``: exactly 0 for ``x <= -3`` and ``x`` for ``x >= 3`` (where SiLU
    only tends to those), the quadratic ``x (x + 3) / 6`` in between; the largest gap to SiLU
    is about 0.14, at ``x = -3`` and ``x = 3``. In TorchRec's ``SwishLayerNorm``, ``x * sigmoid(LN(x))``,
    the sigmoid gate becomes ``nn.Hardsigmoid``, ``relu6(z + 3) / 6``, giving
    ``x * relu6(LN(x) + 3) / 6``; its LayerNorm (or the BlockNorm that replaced it) stays.
    Activations called as functions (``F.silu``) are not modules: :func:`~loka_torchrec.mods.apply_mods`
    rewrites them at the function level (:mod:`loka_torchrec.mods.functional`).

    Args:
        model: the unsharded model.

    Returns:
        A :class:`ModResult` listing the replaced ``nn.SiLU`` modules and ``SwishLayerNorm`` gates.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.SiLU())
        >>> hard_swish(model).modules
        ('1',)
        >>> model[1]
        Hardswish()
    """
    check_unwrapped(model, mod="hard_swish")
    changed: List[str] = []
    for name, _ in named_modules_of_type(model, nn.SiLU):
        replace_module(model, name, nn.Hardswish())
        changed.append(name)
    swish_layer_norm = _swish_layer_norm_type()
    if swish_layer_norm is not None:
        for name, module in named_modules_of_type(model, swish_layer_norm):
            # SwishLayerNorm.forward is `input * self.norm(input)` with norm = Sequential(LayerNorm, Sigmoid).
            for child_name, child in list(module.norm.named_children()):
                if isinstance(child, nn.Sigmoid):
                    replace_module(module.norm, child_name, nn.Hardsigmoid())
                    changed.append(f"{name}.norm.{child_name}")
    return ModResult("hard_swish", tuple(changed))
