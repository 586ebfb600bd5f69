"""What the Probe cost a training run, measured from the run's own step times.

A probe step (statistics collected) and the planning step (candidates evaluated) take longer
than a plain step. Each one's extra time is its wall time minus the median of the nearest plain
steps around it (``neighbours`` of them, both sides, from the same side of the plan), so a plan
that changes the step time (FP8 on) does not count as Probe cost. From those extras:

* ``measured_share``: the Probe's extra time over the run's total step time;
* ``projected_share``: the same for a run of ``horizon_steps`` steps at this cadence, i.e. the
  warm-up's probe steps, the planning step and the monitoring steps, over ``horizon_steps``
  plain steps of the steady state (the median plain step after the plan). Monitoring steps come
  every ``monitoring_interval`` steps: the interval the Probe's budgeted cadence
  (:func:`~loka_torchrec.probe.cadence.monitor_interval`) sets for the measured extra. When the
  run saw no monitoring step, the warm-up probe step's extra stands in for it (a stand-in, not a
  bound: monitoring collects less, but one measured run had a slower monitoring step than its
  warm-up steps) and ``monitoring_from`` says so. When the run ended with monitoring paused (no
  layer runs FP8, so the Probe skips its monitoring steps), the projection counts none.

Step numbers are the training loop's (from 1). A step ``s < warmup_steps`` is a probe step when
``ProbeConfig.is_probe_step(s)``; after the warm-up window the monitoring steps are the ones the
run reports (``monitoring_steps``; without them, the fixed ``every_after`` grid). The plan is made
at the end of step ``warmup_steps - 1``.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Any, Dict, Iterable, List, Mapping, Optional

from loka_torchrec.probe.cadence import monitor_interval
from loka_torchrec.probe.config import ProbeConfig

__all__ = ["probe_cost"]


def _nearby_median(plain_steps: List[int], plain_ms: Mapping[int, float], step: int, neighbours: int) -> Optional[float]:
    """Median time of the ``neighbours`` plain steps closest to ``step`` (``None`` when there are none)."""
    if not plain_steps:
        return None
    i = bisect.bisect_left(plain_steps, step)
    lo, hi = i - 1, i
    picked: List[int] = []
    while len(picked) < neighbours and (lo >= 0 or hi < len(plain_steps)):
        take_low = hi >= len(plain_steps) or (lo >= 0 and step - plain_steps[lo] <= plain_steps[hi] - step)
        if take_low:
            picked.append(plain_steps[lo])
            lo -= 1
        else:
            picked.append(plain_steps[hi])
            hi += 1
    return statistics.median(plain_ms[s] for s in picked)


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def probe_cost(
    step_ms: Mapping[int, float],
    config: ProbeConfig,
    *,
    monitoring_steps: Optional[Iterable[int]] = None,
    monitoring_paused: bool = False,
    horizon_steps: int = 100_000,
    neighbours: int = 10,
) -> Dict[str, Any]:
    """The Probe's extra time in a run, and its share of a ``horizon_steps`` run at this cadence.

    Args:
        step_ms: loop step number -> wall time of that step (ms, device-synchronized).
        config: the Probe's configuration (its cadence).
        monitoring_steps: the steps after the warm-up window that probed (``ProbeCallback.
            monitoring_steps``); ``None``: those of the fixed ``every_after`` grid.
        monitoring_paused: the run ended with its monitoring steps skipped
            (``ProbeCallback.monitoring_paused``): the projection counts none.
        horizon_steps: the run length the projection is for.
        neighbours: plain steps whose median is the reference of each probe step.

    Returns:
        A dict of plain numbers (times in ms, shares as fractions); ``projected_share`` is ``None``
        when the run had no plain step or no probe step to measure.

    Raises:
        ValueError: ``horizon_steps`` or ``neighbours`` below 1.
    """
    if horizon_steps < 1 or neighbours < 1:
        raise ValueError(f"probe_cost: horizon_steps and neighbours must be >= 1, got {horizon_steps}, {neighbours}")
    plan_step = config.warmup_steps - 1
    if monitoring_steps is None:
        is_probe = config.is_probe_step
    else:
        monitored = set(monitoring_steps)

        def is_probe(s: int) -> bool:
            return config.is_probe_step(s) if s < config.warmup_steps else s in monitored

    plain = sorted(s for s in step_ms if s != plan_step and not is_probe(s))
    # References come from the same phase (up to the plan, after it): FP8 may change the step.
    phases = ([s for s in plain if s <= plan_step], [s for s in plain if s > plan_step])
    extras: Dict[str, List[float]] = {"warmup": [], "monitoring": [], "plan": []}
    for step in sorted(step_ms):
        if step == plan_step:
            kind = "plan"
        elif is_probe(step):
            kind = "warmup" if step < config.warmup_steps else "monitoring"
        else:
            continue
        same_phase = phases[0] if step <= plan_step else phases[1]
        reference = _nearby_median(same_phase or plain, step_ms, step, neighbours)
        if reference is not None:
            extras[kind].append(step_ms[step] - reference)
    total_ms = sum(step_ms.values())
    extra_ms = sum(max(0.0, e) for values in extras.values() for e in values)
    after_plan = [step_ms[s] for s in plain if s > plan_step]
    steady_ms = _median(after_plan) or _median([step_ms[s] for s in plain])
    warmup_extra = _median(extras["warmup"])
    monitoring_extra = _median(extras["monitoring"])
    monitoring_from = "monitoring steps"
    if monitoring_paused:
        monitoring_from = "none: monitoring paused (no layer runs an FP8 GEMM)"
    elif monitoring_extra is None:
        monitoring_extra, monitoring_from = warmup_extra, "warm-up probe steps (no monitoring step in this run)"
    projected = None
    interval = None
    if config.every_after and not monitoring_paused:
        interval = monitor_interval(monitoring_extra, steady_ms, config)
    if steady_ms and warmup_extra is not None:
        warmup_probes = sum(1 for s in range(1, min(config.warmup_steps, horizon_steps + 1)) if config.is_probe_step(s))
        monitoring_probes = 0
        if interval and horizon_steps >= config.warmup_steps:
            monitoring_probes = (horizon_steps - config.warmup_steps) // interval + 1
        plan_extra = max(extras["plan"]) if extras["plan"] else 0.0
        projected_ms = warmup_probes * warmup_extra + plan_extra + monitoring_probes * (monitoring_extra or 0.0)
        projected = max(0.0, projected_ms) / (horizon_steps * steady_ms)
    return {
        "steps": len(step_ms),
        "plain_step_ms": steady_ms,
        "warmup_probe_steps": len(extras["warmup"]),
        "warmup_extra_ms": warmup_extra,
        "monitoring_probe_steps": len(extras["monitoring"]),
        "monitoring_extra_ms": monitoring_extra,
        "monitoring_from": monitoring_from,
        "monitoring_paused": monitoring_paused,
        "monitoring_interval": interval,
        "plan_extra_ms": max(extras["plan"]) if extras["plan"] else None,
        "extra_seconds": extra_ms / 1e3,
        "measured_share": extra_ms / total_ms if total_ms > 0 else None,
        "horizon_steps": horizon_steps,
        "projected_share": projected,
    }
