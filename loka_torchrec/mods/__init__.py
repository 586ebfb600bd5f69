"""Mods: FP8-friendly changes to a model, each stated numerically, applied by one verb.

Configuration:
    :class:`ModsConfig` (``loka.mods.*``: ``preset`` none / all / custom, per-mod switches,
    ``block_size``, ``keep_bias``).

Top-level verb:
    :func:`apply_mods` ``(model, config) -> ModsReport``.

The mods (each usable on its own; each returns a :class:`ModResult`):
    :func:`no_bias`, :func:`block_norm`, :func:`hard_swish`, :func:`fuse_siblings`,
    :func:`pad_to_16`.

Calls inside a ``forward`` (``F.layer_norm``, ``F.silu``, ``x * sigmoid(x)``) get ``block_norm``'s
and ``hard_swish``'s rewrite at the function level; :func:`function_scopes` gives each scope's mode
(what it rewrote, what it kept and why).

Modules the mods install, and the ones models use to be modifiable:
    :class:`BlockNorm`, :class:`PaddedLinear`, :class:`SiblingLinears` (a model's marker for
    GEMMs that read one input), :func:`mark_prediction_layer`.
"""

from loka_torchrec.mods.apply import apply_mods
from loka_torchrec.mods.block_norm import BlockNorm, block_norm, block_rms_norm
from loka_torchrec.mods.functional import function_scopes
from loka_torchrec.mods.config import MOD_NAMES, PRESETS, ModResult, ModsConfig, ModsReport
from loka_torchrec.mods.hard_swish import hard_swish, hard_swish_reference
from loka_torchrec.mods.no_bias import mark_prediction_layer, no_bias, prediction_layer_fqns
from loka_torchrec.mods.padding import PaddedLinear, pad_to_16, round_up
from loka_torchrec.mods.siblings import SiblingLinears, fuse_siblings

__all__ = [
    # configuration
    "ModsConfig",
    "MOD_NAMES",
    "PRESETS",
    # top level
    "apply_mods",
    "ModsReport",
    "ModResult",
    # the mods
    "no_bias",
    "block_norm",
    "hard_swish",
    "fuse_siblings",
    "pad_to_16",
    "function_scopes",
    # modules and helpers
    "BlockNorm",
    "block_rms_norm",
    "hard_swish_reference",
    "PaddedLinear",
    "round_up",
    "SiblingLinears",
    "mark_prediction_layer",
    "prediction_layer_fqns",
]
