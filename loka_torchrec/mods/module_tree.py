"""Walking and editing a module tree by fully qualified name (FQN): what every mod shares."""

from __future__ import annotations

import fnmatch
from typing import Iterable, Iterator, Tuple, Type, Union

from torch import nn

__all__ = ["replace_module", "fqn_matches", "check_unwrapped", "named_modules_of_type"]

# Wrappers that own parameter registration (DDP buckets, sharded tables): a mod that swaps a module
# inside them would leave them holding stale parameters, so mods refuse to run on them.
_WRAPPER_NAMES = ("DistributedModelParallel", "DistributedDataParallel", "FullyShardedDataParallel")


def replace_module(root: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    """Put ``new`` where the submodule ``fqn`` of ``root`` is; returns the old module.

    Args:
        root: the model.
        fqn: dotted name of the submodule, as in ``root.named_modules()``; not ``""``.
        new: its replacement.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.SiLU())
        >>> old = replace_module(model, "1", nn.Hardswish())
        >>> type(old).__name__, type(model[1]).__name__
        ('SiLU', 'Hardswish')
    """
    if not fqn:
        raise ValueError("fqn: cannot replace the root module itself")
    parent_name, _, child_name = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, child_name)
    setattr(parent, child_name, new)  # nn.Module.__setattr__ re-registers it under the same name
    return old


def fqn_matches(fqn: str, globs: Iterable[str]) -> bool:
    """Whether ``fqn`` matches any of the shell-style ``globs`` (``*`` spans dots too).

    Example::

        >>> fqn_matches("head.prediction", ["*prediction"]), fqn_matches("head.mlp.0", ["*prediction"])
        (True, False)
    """
    return any(fnmatch.fnmatchcase(fqn, g) for g in globs)


def check_unwrapped(model: nn.Module, *, mod: str) -> None:
    """Raise ``TypeError`` if ``model`` (or a submodule) is already wrapped for distributed training."""
    for name, module in model.named_modules():
        if type(module).__name__ in _WRAPPER_NAMES:
            where = f"at {name!r}" if name else "at the root"
            raise TypeError(
                f"{mod}: the model is wrapped in {type(module).__name__} ({where}); apply mods to the "
                f"unsharded model, before DistributedModelParallel / DDP wraps it"
            )


def named_modules_of_type(
    model: nn.Module, types: Union[Type[nn.Module], Tuple[Type[nn.Module], ...]]
) -> Iterator[Tuple[str, nn.Module]]:
    """``(fqn, module)`` for every submodule that is an instance of ``types``, listed up front.

    The list is taken before the caller edits the tree, so replacing modules while iterating is safe.
    """
    return iter([(n, m) for n, m in model.named_modules() if n and isinstance(m, types)])
