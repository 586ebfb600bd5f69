"""``loka_torchrec.apply``: the one call that turns LoKA on for a model."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple, Union

from torch import nn

from loka_torchrec.config import LokaConfig
from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.dispatch.convert import convert_linears
from loka_torchrec.dispatch.dispatcher import Dispatcher
from loka_torchrec.mods import apply_mods
from loka_torchrec.probe.config import ProbeConfig

__all__ = ["apply", "ApplyReport"]


@dataclasses.dataclass
class ApplyReport:
    """What :func:`apply` changed.

    Attributes:
        converted: ``(fqn, in_features, out_features)`` of each GEMM site: a layer now a
            ``LokaLinear``, or a Parameter multiplied through a ``ParameterSite``.
        skipped: ``(fqn, reason)`` of each GEMM-like module left in high precision.
        mods: the model mods' own report (``None`` when no mod ran).
        dispatcher: the runtime that owns the plan; call ``dispatcher.on_step_end(step)`` after
            each training step (the Probe callback does it for you) and read ``dispatcher.plan``.
    """

    converted: List[Tuple[str, int, int]]
    skipped: List[Tuple[str, str]]
    mods: Optional[object]
    dispatcher: Dispatcher

    def __str__(self) -> str:
        lines = [f"LoKA made {len(self.converted)} GEMM site(s) (LokaLinear layers and Parameter sites):"]
        lines += [f"  {name}: {fan_in} -> {fan_out}" for name, fan_in, fan_out in self.converted]
        if self.skipped:
            lines.append(f"left in high precision ({len(self.skipped)}):")
            lines += [f"  {name}: {reason}" for name, reason in self.skipped]
        if self.mods is not None:
            lines.append(str(self.mods))
        return "\n".join(lines)


def apply(
    model: nn.Module,
    config: Union[LokaConfig, DispatchConfig, None] = None,
    *,
    run_dir: Optional[str] = None,
    process_group=None,
) -> ApplyReport:
    """Convert ``model`` for LoKA in place, before ``DistributedModelParallel`` wraps it.

    Runs the configured model mods, swaps the selected ``nn.Linear`` layers for ``LokaLinear``
    (same parameters, same state_dict keys) and sets up the :class:`Dispatcher` that decides each
    GEMM's kernel. Also works on the dense part of an already wrapped model (FQN prefixes added by
    DMP/DDP are dropped from layer names).

    Args:
        model: the model (or its dense part).
        config: a :class:`LokaConfig` (its ``enabled`` flag is not consulted: calling ``apply`` is
            the decision) or just a :class:`DispatchConfig` (then a ``policy`` plans from
            random-input evidence); ``None`` means the defaults. ``apply`` starts no Probe: with
            the Probe on (the default), :func:`loka_torchrec.prepare` is the call that runs one.
        run_dir: where the plan JSON and dispatch events are written (rank 0).
        process_group: the ranks that must agree on the plan (default: the default group).

    Example::

        >>> import torch
        >>> import loka_torchrec
        >>> from loka_torchrec.dispatch import DispatchConfig
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        >>> report = loka_torchrec.apply(mlp, DispatchConfig(mode="all:scaled_mm:rowwise"))
        >>> [name for name, _, _ in report.converted]
        ['0', '2']
        >>> mlp(torch.randn(8, 64)).shape
        torch.Size([8, 1])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (the model or its dense part), got {type(model).__name__}")
    if config is None:
        config = LokaConfig()
    if isinstance(config, DispatchConfig):
        # No Probe comes with a bare DispatchConfig: a policy plans from random-input evidence.
        config = LokaConfig(enabled=True, dispatch=config, probe=ProbeConfig(enabled=False))
    if not isinstance(config, LokaConfig):
        raise TypeError(f"config: expected LokaConfig or DispatchConfig, got {type(config).__name__}")
    mods_report = None
    mods_config = getattr(config, "mods", None)
    if mods_config is not None and getattr(mods_config, "preset", "none") != "none":
        mods_report = apply_mods(model, mods_config)
    layers, conversion = convert_linears(model, config.dispatch)
    dispatcher = Dispatcher(
        layers, config.dispatch, run_dir=run_dir, process_group=process_group, unreached=conversion.unreached
    )
    return ApplyReport(conversion.converted, conversion.skipped, mods_report, dispatcher)
