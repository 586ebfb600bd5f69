"""What to change (``ModsConfig``, the ``loka.mods.*`` options) and what was changed (``ModsReport``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, Tuple

from loka_torchrec.config_fields import check_field_types

__all__ = ["MOD_NAMES", "PRESETS", "ModsConfig", "ModResult", "ModsReport"]

MOD_NAMES: Tuple[str, ...] = ("no_bias", "block_norm", "hard_swish", "fuse_siblings", "pad_to_16")
"""Every mod, in the order :func:`~loka_torchrec.mods.apply_mods` applies them.

The order matters in two places: biases go before fusion (a sibling group fuses only when its
members agree on having a bias), and padding goes last, so a fused GEMM is padded once as a whole.
"""

PRESETS: Tuple[str, ...] = ("none", "all", "all_but_no_bias", "custom")
"""``none`` changes nothing, ``all`` applies every mod, ``all_but_no_bias`` every mod but
``no_bias`` (the architecture changes that leave every bias in place), ``custom`` the switches."""


@dataclasses.dataclass(frozen=True)
class ModsConfig:
    """Which model changes to make (``loka.mods.*`` in the recipes).

    Attributes:
        preset: ``"none"`` changes nothing; ``"all"`` turns every mod on; ``"all_but_no_bias"``
            every mod but ``no_bias`` (dropping biases is the one mod that costs eval NE in the
            project's measurements, ``docs/mods.md``); ``"custom"`` uses the per-mod switches
            below. A switch set to ``True`` under ``"none"``, or ``no_bias`` under
            ``"all_but_no_bias"``, is an error (it would be silently ignored otherwise).
        no_bias: drop the bias of every linear layer but the kept ones (see :func:`no_bias`).
        block_norm: replace LayerNorms (also inside TorchRec's ``SwishLayerNorm``) by
            :class:`BlockNorm`, and ``F.layer_norm`` calls without weight or bias inside a
            ``forward`` by what it computes (:mod:`loka_torchrec.mods.functional`).
        hard_swish: replace ``nn.SiLU`` by ``nn.Hardswish`` and the sigmoid gate of
            ``SwishLayerNorm`` by ``nn.Hardsigmoid``, and ``F.silu(x)`` / ``x * sigmoid(x)`` calls
            inside a ``forward`` by ``F.hardswish(x)``.
        fuse_siblings: fuse each :class:`SiblingLinears` group into one GEMM.
        pad_to_16: zero-pad every linear layer so that its K and N are multiples of 16.
        block_size: BlockNorm's block width (features per RMS statistic), > 0.
        keep_bias: FQN globs of linear layers that keep their bias under ``no_bias``, on top of
            the final prediction layer (an error where ``no_bias`` is not applied).
        keep_prediction_bias: keep the final prediction layer's bias (see
            :func:`~loka_torchrec.mods.prediction_layer_fqns`; ``False`` is an error where
            ``no_bias`` is not applied).

    Example::

        >>> ModsConfig(preset="all").enabled
        ('no_bias', 'block_norm', 'hard_swish', 'fuse_siblings', 'pad_to_16')
        >>> ModsConfig(preset="all_but_no_bias").enabled
        ('block_norm', 'hard_swish', 'fuse_siblings', 'pad_to_16')
        >>> ModsConfig(preset="custom", hard_swish=True, pad_to_16=True).enabled
        ('hard_swish', 'pad_to_16')
        >>> ModsConfig().enabled
        ()
    """

    preset: str = "none"
    no_bias: bool = False
    block_norm: bool = False
    hard_swish: bool = False
    fuse_siblings: bool = False
    pad_to_16: bool = False
    block_size: int = 256
    keep_bias: Tuple[str, ...] = ()
    keep_prediction_bias: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, "ModsConfig")  # types first; keep_bias may be one glob or a list
        if self.preset not in PRESETS:
            raise ValueError(f"ModsConfig.preset must be one of {PRESETS}, got {self.preset!r}")
        if not all(self.keep_bias):
            raise ValueError(f"ModsConfig.keep_bias: expected non-empty FQN globs, got {list(self.keep_bias)}")
        if self.preset == "none":
            on = [name for name in MOD_NAMES if getattr(self, name)]
            if on:
                raise ValueError(
                    f"ModsConfig: preset='none' changes nothing, but {on} are switched on; "
                    f"use preset='custom' to apply single mods"
                )
        if self.preset == "all_but_no_bias" and self.no_bias:
            raise ValueError(
                "ModsConfig: preset='all_but_no_bias' keeps every bias, but no_bias is switched on; "
                "use preset='all' to drop them"
            )
        if "no_bias" not in self.enabled and (self.keep_bias or not self.keep_prediction_bias):
            field = "keep_bias" if self.keep_bias else "keep_prediction_bias"
            raise ValueError(
                f"ModsConfig.{field}: says which biases no_bias keeps, but no_bias is not applied "
                f"(preset={self.preset!r}); use preset='all', or 'custom' with no_bias=true"
            )
        if self.block_size < 1:
            raise ValueError(f"ModsConfig.block_size must be an int >= 1, got {self.block_size!r}")

    @property
    def enabled(self) -> Tuple[str, ...]:
        """The mods this config applies, in application order."""
        if self.preset == "none":
            return ()
        if self.preset == "all":
            return MOD_NAMES
        if self.preset == "all_but_no_bias":
            return tuple(name for name in MOD_NAMES if name != "no_bias")
        return tuple(name for name in MOD_NAMES if getattr(self, name))

    @classmethod
    def only(cls, name: str, **options: Any) -> "ModsConfig":
        """A ``"custom"`` config with the single mod ``name`` on.

        Example::

            >>> ModsConfig.only("block_norm", block_size=64).enabled
            ('block_norm',)
        """
        if name not in MOD_NAMES:
            raise ValueError(f"mod name must be one of {MOD_NAMES}, got {name!r}")
        return cls(preset="custom", **{name: True}, **options)


@dataclasses.dataclass(frozen=True)
class ModResult:
    """What one mod did.

    Attributes:
        name: the mod (one of :data:`MOD_NAMES`).
        modules: FQNs of the modules it changed or replaced (as named before the change).
        skipped: ``(fqn, reason)`` for candidates it left alone on purpose.
        unmatched: when it changed no module, why (:func:`~loka_torchrec.mods.unmatched.why_unmatched`).
        functions: the calls it rewrites at the function level, one line per call and module class
            (:func:`~loka_torchrec.mods.functional.rewrite_functions`).
    """

    name: str
    modules: Tuple[str, ...] = ()
    skipped: Tuple[Tuple[str, str], ...] = ()
    unmatched: str = ""
    functions: Tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.name}: {len(self.modules)} module(s)"
        if self.modules:
            text += " [" + ", ".join(self.modules) + "]"
        elif self.unmatched:
            text += f" ({self.unmatched})"
        if self.skipped:
            text += "; skipped " + ", ".join(f"{fqn} ({why})" for fqn, why in self.skipped)
        if self.functions:
            text += "; function level: " + "; ".join(self.functions)
        return text


@dataclasses.dataclass(frozen=True)
class ModsReport:
    """What :func:`~loka_torchrec.mods.apply_mods` did: one :class:`ModResult` per enabled mod.

    Example::

        >>> report = ModsReport(ModsConfig(preset="custom", hard_swish=True), (ModResult("hard_swish", ("mlp.1",)),))
        >>> report["hard_swish"].modules
        ('mlp.1',)
        >>> report.changed
        True
    """

    config: ModsConfig
    results: Tuple[ModResult, ...] = ()

    def __getitem__(self, name: str) -> ModResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(f"mod {name!r} was not applied (applied: {[r.name for r in self.results]})")

    def __iter__(self) -> Iterator[ModResult]:
        return iter(self.results)

    @property
    def changed(self) -> bool:
        """Whether any mod changed any module or rewrites any function call."""
        return any(r.modules or r.functions for r in self.results)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready summary: ``{"preset": ..., "mods": {name: {"modules": [...], "skipped": [...], "functions": [...]}}}``."""
        return {
            "preset": self.config.preset,
            "mods": {
                r.name: {"modules": list(r.modules), "skipped": [list(s) for s in r.skipped], "functions": list(r.functions)}
                for r in self.results
            },
        }

    def __str__(self) -> str:
        if not self.results:
            return f"mods (preset={self.config.preset}): none applied"
        lines = [f"mods (preset={self.config.preset}):"] + [f"  {r}" for r in self.results]
        return "\n".join(lines)
