"""What a resumed run's configuration can change of the checkpoint's plan, and what it cannot.

A static or pinned ``dispatch.mode`` decides the plan: where it gives another plan than the
checkpoint's, that field overrides the checkpoint (:func:`overriding_field`). Under ``policy`` the
checkpoint's plan runs on; the fields that shape a policy plan and differ from the checkpoint's
apply from the next plan, said in a warning (:func:`warn_differing_fields`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional

from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.dispatch.plan import DispatchPlan

__all__ = ["APPLY_AT_ONCE", "overriding_field", "warn_differing_fields"]

logger = logging.getLogger("loka_torchrec.dispatch")

APPLY_AT_ONCE = ("mode", "plan_path", "step_guard_window", "step_guard_tolerance", "include", "exclude", "min_features")
"""``DispatchConfig`` fields that a resumed run applies at once (``mode`` and ``plan_path`` are
judged on their own; the layers were converted by this run's selection). The others shape a
policy plan: a resumed run keeps the checkpoint's plan, and they apply from its next plan."""


def overriding_field(
    config: DispatchConfig, plan: DispatchPlan, saved: DispatchPlan, saved_config: Mapping[str, Any]
) -> Optional[str]:
    """The field (``mode`` or ``plan_path``) by which this run's static or pinned mode gives
    another plan (``plan``) than the checkpoint's (``saved``), else ``None`` (the checkpoint's plan
    is restored)."""
    if config.mode == "policy" or saved.digest() == plan.digest():
        return None
    if saved_config.get("mode", saved.mode) == config.mode and config.mode == "pinned":
        return "plan_path"
    return "mode"


def warn_differing_fields(config: DispatchConfig, saved: DispatchPlan, saved_config: Mapping[str, Any]) -> None:
    """Resume under ``policy``: warn about what this run's configuration cannot change now."""
    if config.mode != "policy":
        return
    saved_mode = saved_config.get("mode", saved.mode)
    if saved_mode != "policy":
        logger.warning(
            "dispatch.mode: the checkpoint ran %s, this run has policy: a resumed run does not plan again, so the "
            "checkpoint's plan runs on (%d FP8 GEMM(s) planned); start a new run to plan under policy",
            saved_mode, saved.fp8_gemm_count(),
        )  # fmt: skip
        return
    mine = dataclasses.asdict(config)
    differ = [
        f"{name}={_plain(mine[name])!r} (checkpoint: {_plain(value)!r})"
        for name, value in sorted(saved_config.items())
        if name in mine and name not in APPLY_AT_ONCE and _plain(value) != _plain(mine[name])
    ]
    if differ:
        logger.warning(
            "dispatch: this run's %s differ from the checkpoint's: its plan (made at step %d) runs on, and they apply "
            "from the next plan", ", ".join(differ), saved.step,
        )  # fmt: skip


def _plain(value: Any) -> Any:
    """A configuration value as a checkpoint holds it: sequences as lists."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value
