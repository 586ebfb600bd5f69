"""``plain_modules``: a model that LoKA converted, back to plain PyTorch modules (for serving or export).

:func:`loka_torchrec.apply` (and so :func:`loka_torchrec.prepare`) changes a model in place in two
ways that this undoes, keeping every ``Parameter`` object (no copy) and every ``state_dict`` key:

* each ``nn.Linear`` became a :class:`~loka_torchrec.LokaLinear`: it becomes an ``nn.Linear``
  again (:meth:`LokaLinear.to_linear`);
* each module that multiplies by its own 2-D Parameters (``F.linear(x, self.w)``, ``x @ self.w``,
  ``nn.MultiheadAttention``) became a *scope* (:mod:`loka_torchrec.dispatch.sites`): its
  ``forward`` runs under Dispatch's torch-function mode, its sites are children in
  ``_loka_sites``, and a ``TransformerEncoderLayer`` got a forward pre-hook that refuses its fast
  path. The scope goes: the class's ``forward`` runs again (or the function-level mods' forward
  that the scope wrapped), the sites and the pre-hook are removed.

What stays: the model mods (``ModsConfig``). A mod changes the architecture (a fused sibling
GEMM, a layer without bias, BlockNorm for LayerNorm, padded widths), and its ``state_dict`` differs
from the original model's, so a mods-changed model stays mods-changed; to load its checkpoint
elsewhere, apply the same mods there first (:func:`loka_torchrec.mods.apply_mods`). Also kept:
``torch.compile`` of the modules LoKA compiled (they recompile once for the plain modules) and a
``TransformerEncoder``'s ``use_nested_tensor = False``, which changes no result.
"""

from __future__ import annotations

from typing import Dict

from torch import nn

from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.dispatch.sites import _refuse_fast_path, is_scoped

__all__ = ["plain_modules"]


def _unscope(module: nn.Module) -> None:
    """Remove Dispatch's scope from ``module`` (see the module docstring)."""
    inner = module.__dict__["forward"].args[2]  # the forward the scope wrapped (a function-level mod's), if any
    if inner is None:
        del module.__dict__["forward"]  # the class's forward again
    else:
        module.forward = inner
    if "_loka_sites" in module._modules:
        del module._loka_sites
    for key, hook in list(module._forward_pre_hooks.items()):
        if hook is _refuse_fast_path:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)
    module.__dict__.pop("_loka_fast_path_refused", None)


def plain_modules(model: nn.Module) -> nn.Module:
    """Turn ``model``'s LoKA layers back into plain modules, in place, sharing the Parameters.

    Call it after training (after ``loka.close()``; the ``Loka`` object and its Dispatcher no
    longer drive the model afterwards). The result computes what the model computed before
    LoKA converted it (its mods aside: see the module docstring) and has the same ``state_dict``.

    Args:
        model: a model that :func:`loka_torchrec.apply` or :func:`loka_torchrec.prepare` converted
            (unwrapped, or inside ``DistributedModelParallel``); a model without LoKA layers is
            returned unchanged.

    Returns:
        ``model`` (or, when ``model`` itself is a ``LokaLinear``, its ``nn.Linear``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example::

        >>> import torch, loka_torchrec
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
        >>> _ = loka_torchrec.apply(model, loka_torchrec.DispatchConfig(mode="all-bf16"))
        >>> type(model[0]).__name__, type(loka_torchrec.plain_modules(model)[0]).__name__
        ('LokaLinear', 'Linear')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if isinstance(model, LokaLinear):
        return model.to_linear()
    for module in model.modules():
        if is_scoped(module):
            _unscope(module)
    plain: Dict[int, nn.Linear] = {}  # one nn.Linear per LokaLinear, so a layer used twice stays shared
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if isinstance(module, LokaLinear):
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if id(module) not in plain:
                plain[id(module)] = module.to_linear()
            setattr(parent, child, plain[id(module)])
    return model
