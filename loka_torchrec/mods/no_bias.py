"""No Bias: drop the bias of every GEMM layer except the final prediction layer (and a keep list)."""

from __future__ import annotations

from typing import List, Sequence, Tuple

from torch import nn

from loka_torchrec.mods.config import ModResult
from loka_torchrec.mods.module_tree import check_unwrapped, fqn_matches

__all__ = ["PREDICTION_LAYER_ATTR", "mark_prediction_layer", "prediction_layer_fqns", "no_bias"]

PREDICTION_LAYER_ATTR = "loka_prediction_layer"
"""Attribute a model sets to ``True`` on its final prediction layer (see :func:`mark_prediction_layer`)."""


def mark_prediction_layer(linear: nn.Linear) -> nn.Linear:
    """Mark ``linear`` as the model's final prediction layer; returns it.

    Models built by this project mark their last layer, so that :func:`no_bias` keeps its bias
    (the logit's offset, i.e. the base rate) without a keep list.

    Example::

        >>> head = mark_prediction_layer(nn.Linear(8, 1))
        >>> prediction_layer_fqns(nn.Sequential(nn.Linear(4, 8), head))
        ('1',)
    """
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"mark_prediction_layer expects an nn.Linear, got {type(linear).__name__}")
    setattr(linear, PREDICTION_LAYER_ATTR, True)
    return linear


def prediction_layer_fqns(model: nn.Module) -> Tuple[str, ...]:
    """FQNs of the final prediction layer(s) of ``model``.

    The linear layers marked with :func:`mark_prediction_layer`; in a model that marks none (e.g.
    TorchRec's DLRM), the last ``nn.Linear`` in registration order (``model.named_modules()``),
    which for TorchRec's models is the over-arch's last layer.

    Example::

        >>> prediction_layer_fqns(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        ('2',)
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    marked = tuple(name for name, m in linears if getattr(m, PREDICTION_LAYER_ATTR, False))
    if marked:
        return marked
    return (linears[-1][0],) if linears else ()


def no_bias(
    model: nn.Module,
    *,
    keep_bias: Sequence[str] = (),
    keep_prediction_bias: bool = True,
) -> ModResult:
    """Remove the bias of every ``nn.Linear`` in ``model`` except the kept ones, in place.

    Numerically: each affected layer ``y = x W^T + b`` becomes ``y = x W^T``; the bias parameter
    is deleted, not zeroed, so the optimizer never sees it again. This changes the model: applied
    at build time (the intended use) the model just has no offsets to learn; applied to a trained
    model it discards the learned ``b`` and shifts every output of the layer by ``-b``. Weights are
    untouched. Kept: the final prediction layer (its bias carries the base rate) when
    ``keep_prediction_bias``, and layers whose FQN matches a ``keep_bias`` glob. Only
    ``nn.Linear`` (and subclasses) count as GEMM layers; norms' shifts and raw-parameter GEMMs
    (e.g. TorchRec's ``LowRankCrossNet``) are left as they are.

    Args:
        model: the unsharded model.
        keep_bias: FQN globs (``fnmatch``, ``*`` spans dots) of linears that keep their bias.
        keep_prediction_bias: keep the bias of :func:`prediction_layer_fqns`.

    Returns:
        A :class:`ModResult` listing the linears whose bias was removed, and the kept ones (with
        the reason) under ``skipped``.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 1))
        >>> no_bias(model).modules
        ('0',)
        >>> model[0].bias is None, model[2].bias is not None
        (True, True)
    """
    check_unwrapped(model, mod="no_bias")
    keep: Tuple[str, ...] = tuple(keep_bias)
    prediction = set(prediction_layer_fqns(model)) if keep_prediction_bias else set()
    changed: List[str] = []
    skipped: List[Tuple[str, str]] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.bias is None:
            continue
        if name in prediction:
            skipped.append((name, "final prediction layer"))
        elif fqn_matches(name, keep):
            skipped.append((name, "matches keep_bias"))
        else:
            # Deleting (not zeroing) the parameter: it leaves state_dict and optimizer groups.
            module.register_parameter("bias", None)
            changed.append(name)
    return ModResult("no_bias", tuple(changed), tuple(skipped))
