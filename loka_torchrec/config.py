"""The one configuration object of LoKA, assembled from each capability's own frozen dataclass."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, Mapping, Type, TypeVar

from loka_torchrec.comms.config import CommsConfig
from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.mods.config import ModsConfig
from loka_torchrec.probe.config import ProbeConfig

__all__ = ["LokaConfig", "LokaRecipe", "from_mapping"]

T = TypeVar("T")


def from_mapping(cls: Type[T], values: Mapping[str, Any], *, field: str) -> T:
    """Build a frozen dataclass from a mapping; unknown keys raise an error naming them."""
    if values is None:
        return cls()
    if dataclasses.is_dataclass(values):
        return values  # already built
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{field}: unknown option(s) {unknown}; expected some of {sorted(known)}")
    kwargs = {}
    for k, v in values.items():
        kwargs[k] = tuple(v) if isinstance(v, (list, tuple)) else v
    return cls(**kwargs)


class LokaRecipe(str, enum.Enum):
    """The named configurations of :meth:`LokaConfig.from_recipe`."""

    DEFAULT = "default"
    """The Probe learns each layer's statistics over a warm-up window, Dispatch plans each GEMM from
    that evidence (``policy``), the safety valve and the step-time guard watch the plan, and the
    embedding all-to-all precision is timed (``auto``); the model is not changed. The reference
    job's ``recipes/loka/default.yaml``, and ``LokaConfig(enabled=True)``."""
    ALL_MODS = "all_mods"
    """``default`` with every model mod applied before conversion (``ModsConfig(preset="all")``).
    Mods change the architecture and the checkpoint; ``no_bias`` among them costs eval NE
    (``docs/mods.md``), which ``ModsConfig(preset="all_but_no_bias")`` leaves out."""
    NO_PROBE = "no_probe"
    """``default`` without the Probe: no hooks; Dispatch plans once, at ``dispatch.plan_at_step``,
    from random-input evidence, and nothing watches the plan's numerics afterwards."""
    ALL_BF16 = "all_bf16"
    """No FP8 anywhere, with LoKA's plan file and logs: every GEMM in bf16 (``dispatch.mode``
    ``all-bf16``), the embedding all-to-all in fp32, no Probe. The reference to compare with."""
    OFF = "off"
    """``enabled=False``: LoKA changes nothing (``LokaConfig()``)."""


@dataclasses.dataclass(frozen=True)
class LokaConfig:
    """Everything LoKA does to a job. ``enabled=False`` (the default) changes nothing.

    Most jobs pick a recipe (:class:`LokaRecipe`: ``"default"``, ``"all_mods"``, ``"no_probe"``,
    ``"all_bf16"``, ``"off"``) and change a field or two with ``dataclasses.replace``; each
    capability's own config documents its expert knobs.

    Attributes:
        enabled: the one switch: :func:`loka_torchrec.prepare` with ``enabled=False`` returns a
            :class:`~loka_torchrec.Loka` that leaves the model untouched and whose ``step`` blocks
            run the loop unchanged (``loka_torchrec.apply`` converts whatever it is given).
        dispatch: per-GEMM kernel choice (:class:`~loka_torchrec.dispatch.config.DispatchConfig`).
            Its ``evidence="auto"`` resolves to ``"probe"`` when the Probe is on, else ``"random"``.
        probe: in-training statistics and evidence (:class:`~loka_torchrec.probe.config.ProbeConfig`).
        mods: model changes applied before conversion (:class:`~loka_torchrec.mods.config.ModsConfig`).
        comms: embedding all-to-all precisions (:class:`~loka_torchrec.comms.config.CommsConfig`; ``"auto"``
            by default: fp8 or fp32 per direction from a timing before the first step).

    Example::

        >>> config = LokaConfig.from_recipe("default")
        >>> config == LokaConfig(enabled=True), config.probe.enabled, config.dispatch.mode
        (True, True, 'policy')
        >>> LokaConfig.from_recipe("no_probe").dispatch.evidence  # no Probe: random-input evidence
        'random'
        >>> quick = dataclasses.replace(config, probe=dataclasses.replace(config.probe, warmup_steps=20))
        >>> quick.probe.warmup_steps, quick.dispatch.evidence
        (20, 'probe')
        >>> LokaConfig.from_recipe("fp8")
        Traceback (most recent call last):
        ...
        ValueError: recipe: expected one of default, all_mods, no_probe, all_bf16, off, got 'fp8'
    """

    enabled: bool = False
    dispatch: DispatchConfig = DispatchConfig()
    probe: ProbeConfig = ProbeConfig()
    mods: ModsConfig = ModsConfig()
    comms: CommsConfig = CommsConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"loka.enabled: expected true or false, got {self.enabled!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "enabled" and not isinstance(value, type(f.default)):
                hint = f"; build it with {type(f.default).__name__}(...) or use LokaConfig.from_dict" if isinstance(value, Mapping) else ""
                raise TypeError(f"loka.{f.name}: expected a {type(f.default).__name__}, got {type(value).__name__}{hint}")
        if self.dispatch.evidence == "auto":
            resolved = "probe" if self.probe.enabled else "random"
            object.__setattr__(self, "dispatch", dataclasses.replace(self.dispatch, evidence=resolved))

    @classmethod
    def from_recipe(cls, recipe: "LokaRecipe | str") -> "LokaConfig":
        """The configuration :class:`LokaRecipe` ``recipe`` names (a member or its string).

        Raises:
            ValueError: ``recipe`` names none; the message lists the recipes.
        """
        try:
            recipe = LokaRecipe(recipe)
        except ValueError:
            raise ValueError(f"recipe: expected one of {', '.join(r.value for r in LokaRecipe)}, got {recipe!r}") from None
        return _RECIPES[recipe]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LokaConfig":
        """From a plain (e.g. Hydra/OmegaConf-resolved) mapping; names the field of any error."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"loka: unknown option(s) {unknown}; expected some of {sorted(known)}")
        kwargs: Dict[str, Any] = {"enabled": values.get("enabled", False)}  # "false" is not False: checked
        for f in dataclasses.fields(cls):
            if f.name == "enabled" or f.name not in values:
                continue
            kwargs[f.name] = from_mapping(type(f.default), values[f.name], field=f"loka.{f.name}")
        return cls(**kwargs)


_RECIPES: Dict[LokaRecipe, LokaConfig] = {
    LokaRecipe.DEFAULT: LokaConfig(enabled=True),
    LokaRecipe.ALL_MODS: LokaConfig(enabled=True, mods=ModsConfig(preset="all")),
    LokaRecipe.NO_PROBE: LokaConfig(enabled=True, probe=ProbeConfig(enabled=False)),
    LokaRecipe.ALL_BF16: LokaConfig(
        enabled=True, probe=ProbeConfig(enabled=False), dispatch=DispatchConfig(mode="all-bf16"),
        comms=CommsConfig(forward="fp32", backward="fp32"),
    ),
    LokaRecipe.OFF: LokaConfig(),
}
