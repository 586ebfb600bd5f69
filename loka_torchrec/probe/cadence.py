"""When the monitoring probe steps happen: every ``every_after`` steps, stretched to a time budget.

After the plan, a monitoring step (statistics collected, merged across ranks, checked by the safety
valve) costs some extra wall time over a plain step. With ``ProbeConfig.monitor_budget`` set, the
Probe measures that extra after every monitoring step and waits long enough before the next one
that monitoring stays within the budget::

    interval = clamp(ceil(extra_ms / (monitor_budget * plain_ms)), every_after, every_after_max)

* ``plain_ms`` is the median wall time of the most recent plain steps (no probe, no plan), timed
  by the callback between two ``on_step_end`` calls. On a GPU without a per-step synchronization
  these are host times, whose median is the GPU's step time once the launch queue is full; a
  monitoring step synchronizes, so its time may also include steps still queued before it: the
  extra is over-estimated rather than under, and the interval errs long.
* Every rank measures its own extra; the ranks then take the largest interval (one all-reduce of
  one integer), since a monitoring step merges statistics across ranks and all must take part.
* Without a budget (``monitor_budget=0``) the interval is ``every_after``, as a fixed cadence.

:func:`monitor_interval` is the pure rule; :class:`MonitorCadence` keeps the step clock and the
next monitoring step, and is saved in the Probe's checkpoint state.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Any, Deque, Dict, Mapping, Optional

import torch
import torch.distributed as dist

from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.merge import comm_device, is_distributed

__all__ = ["monitor_interval", "MonitorCadence"]

_PLAIN_WINDOW = 64  # plain steps whose median wall time is the reference


def monitor_interval(extra_ms: Optional[float], plain_ms: Optional[float], config: ProbeConfig) -> int:
    """Steps from one monitoring step to the next, for a measured ``extra_ms`` over ``plain_ms``.

    Args:
        extra_ms: the last monitoring step's wall time minus a plain step's (ms); ``None`` when
            not measured yet.
        plain_ms: a plain step's wall time (ms); ``None`` when not measured yet.
        config: ``every_after`` (shortest interval), ``every_after_max`` (longest) and
            ``monitor_budget`` (the share of training time monitoring may take; 0 = fixed).

    Returns:
        The interval in steps, between ``every_after`` and ``every_after_max``.

    Example::

        >>> cfg = ProbeConfig(every_after=500, monitor_budget=0.0025)
        >>> monitor_interval(136.0, 19.7, cfg)  # 136 ms extra at 19.7 ms a step: every 2762 steps
        2762
    """
    if not config.monitor_budget or extra_ms is None or not plain_ms or plain_ms <= 0 or not math.isfinite(extra_ms):
        return config.every_after
    # rounded first, so that clock noise of a few ulps does not add a step
    wanted = math.ceil(round(max(extra_ms, 0.0) / (config.monitor_budget * plain_ms), 6))
    return int(min(max(wanted, config.every_after), config.every_after_max))


class MonitorCadence:
    """The monitoring schedule of one rank: which steps are probe steps, from a step clock.

    Call :meth:`tick` once per ``on_step_end`` (with whether that step was a probe or plan step),
    and :meth:`after_monitoring` at the end of every monitoring step, on every rank.
    """

    def __init__(self, config: ProbeConfig, *, clock=None) -> None:
        self.config = config
        self._clock = clock or time.perf_counter
        self.next_step: Optional[int] = config.warmup_steps if config.every_after else None
        self.interval = config.every_after
        self.last_extra_ms: Optional[float] = None
        self.last_step_ms: Optional[float] = None
        self._plain_ms: Deque[float] = collections.deque(maxlen=_PLAIN_WINDOW)
        self._last_tick: Optional[float] = None

    # ------------------------------------------------------------------------------ schedule
    def is_probe_step(self, step: int) -> bool:
        """Whether statistics are collected during ``step`` (warm-up cadence, then this schedule)."""
        if step < self.config.warmup_steps:
            return self.config.is_probe_step(step)
        return self.next_step is not None and step == self.next_step

    def resume_at(self, step: int) -> None:
        """Start the schedule at ``step`` (a resumed run without saved cadence state): the next
        monitoring step is the first step of the fixed ``every_after`` grid at or after it."""
        if self.next_step is None or self.next_step >= step:
            return
        behind = step - self.config.warmup_steps
        self.next_step = self.config.warmup_steps + math.ceil(behind / self.config.every_after) * self.config.every_after

    def skip(self, step: int) -> None:
        """Pass over the monitoring step ``step``: the next one comes an interval later."""
        if self.next_step == step:
            self.next_step = step + self.interval

    def tick(self, *, plain: bool) -> None:
        """Close the current step on the clock; a ``plain`` step's wall time joins the reference."""
        now = self._clock()
        if self._last_tick is not None:
            self.last_step_ms = (now - self._last_tick) * 1e3
            if plain:
                self._plain_ms.append(self.last_step_ms)
        self._last_tick = now

    def restart_clock(self) -> None:
        """Forget the open step's start (after a pause that is not training, e.g. a resume)."""
        self._last_tick = None

    @property
    def plain_ms(self) -> Optional[float]:
        return statistics.median(self._plain_ms) if self._plain_ms else None

    def after_monitoring(self, step: int, group: Optional[Any] = None, *, at_most: int = 0) -> int:
        """Set the next monitoring step from this one's measured extra; returns the interval.

        ``at_most`` (> 0) caps this rank's interval, e.g. while a layer waits for readmission.
        Collective when ``group`` spans several ranks: every rank must call it at the
        same step.
        """
        plain = self.plain_ms
        if self.last_step_ms is not None and plain is not None:
            self.last_extra_ms = self.last_step_ms - plain
        mine = monitor_interval(self.last_extra_ms, plain, self.config)
        if at_most > 0:
            mine = min(mine, at_most)
        self.interval = _max_over_ranks(mine, group)  # capped first: every rank ends with the same interval
        self.next_step = step + self.interval
        return self.interval

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        return {"next_step": self.next_step, "interval": self.interval, "last_extra_ms": self.last_extra_ms}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_step = state.get("next_step", self.next_step)
        self.interval = int(state.get("interval", self.interval))
        self.last_extra_ms = state.get("last_extra_ms")
        self._last_tick = None

    def summary(self) -> Dict[str, Any]:
        return {
            "budget": self.config.monitor_budget,
            "interval": self.interval,
            "next_step": self.next_step,
            "last_extra_ms": self.last_extra_ms,
            "plain_step_ms": self.plain_ms,
        }


def _max_over_ranks(value: int, group: Optional[Any]) -> int:
    if not is_distributed(group):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
