"""The monitoring cadence under a time budget: the rule, the schedule, checkpoints, 2 gloo ranks."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loka_torchrec.probe import ProbeCallback, ProbeConfig
from loka_torchrec.probe.cadence import MonitorCadence, monitor_interval
from multirank import spawn_ranks


class FakeClock:
    """A clock the test advances by hand (seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_interval_fits_the_measured_extra_into_the_budget():
    cfg = ProbeConfig(every_after=500, monitor_budget=0.0025, every_after_max=10_000)
    # 100 ms extra over 10 ms steps at 0.25%: one monitoring step per 4000 steps
    assert monitor_interval(100.0, 10.0, cfg) == 4000
    assert 100.0 / (monitor_interval(100.0, 10.0, cfg) * 10.0) <= cfg.monitor_budget
    assert monitor_interval(100.1, 10.0, cfg) == 4004  # rounded up, never over the budget
    # never shorter than every_after, never longer than every_after_max
    assert monitor_interval(1.0, 10.0, cfg) == 500
    assert monitor_interval(-5.0, 10.0, cfg) == 500
    assert monitor_interval(1e6, 10.0, cfg) == 10_000
    # nothing measured, or no budget: the fixed cadence
    assert monitor_interval(None, 10.0, cfg) == 500
    assert monitor_interval(100.0, None, cfg) == 500
    assert monitor_interval(100.0, 10.0, ProbeConfig(every_after=500, monitor_budget=0.0)) == 500


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("monitor_budget", -0.1, "monitor_budget"),
        ("monitor_budget", 1.0, "monitor_budget"),
        ("monitor_budget", True, "monitor_budget"),
        ("every_after_max", 0, "every_after_max"),
        ("every_after_max", 100, "at least every_after"),
        ("error_rows", 0, "error_rows"),
    ],
)
def test_bad_cadence_settings_are_refused(field, value, match):
    with pytest.raises(TypeError if isinstance(value, bool) else ValueError, match=match):
        ProbeConfig(every_after=500, **{field: value})


def _run_schedule(cadence, clock, steps, plain_ms=10.0, monitor_extra_ms=100.0):
    """Drive ``cadence`` as the callback does; returns the steps that probed after the warm-up."""
    monitored = []
    for step in range(steps):
        probing = cadence.is_probe_step(step)
        clock.now += (plain_ms + (monitor_extra_ms if probing else 0.0)) / 1e3
        cadence.tick(plain=not probing)
        if probing and step >= cadence.config.warmup_steps:
            monitored.append(step)
            cadence.after_monitoring(step)
    return monitored


def test_the_schedule_stretches_after_the_first_measured_monitoring_step():
    cfg = ProbeConfig(every=5, warmup_steps=20, every_after=50, monitor_budget=0.01, every_after_max=5000)
    clock = FakeClock()
    cadence = MonitorCadence(cfg, clock=clock)
    monitored = _run_schedule(cadence, clock, 3000)
    # 100 ms extra over 10 ms steps at 1%: every 1000 steps, from the first monitoring step on
    assert monitored == [20, 1020, 2020]
    assert cadence.last_extra_ms == pytest.approx(100.0)
    assert cadence.summary()["interval"] == 1000 and cadence.summary()["plain_step_ms"] == pytest.approx(10.0)
    # the warm-up cadence is the config's
    assert [s for s in range(20) if cadence.is_probe_step(s)] == [0, 5, 10, 15]


def test_without_a_budget_the_schedule_is_the_fixed_grid():
    cfg = ProbeConfig(every=5, warmup_steps=20, every_after=50, monitor_budget=0.0)
    clock = FakeClock()
    monitored = _run_schedule(MonitorCadence(cfg, clock=clock), clock, 300)
    assert monitored == [s for s in range(20, 300) if cfg.is_probe_step(s)] == [20, 70, 120, 170, 220, 270]


def test_a_resumed_schedule_goes_on_from_the_saved_state_or_from_the_grid():
    cfg = ProbeConfig(every=5, warmup_steps=20, every_after=50, monitor_budget=0.01, every_after_max=5000)
    clock = FakeClock()
    cadence = MonitorCadence(cfg, clock=clock)
    _run_schedule(cadence, clock, 100)
    state = cadence.state_dict()
    resumed = MonitorCadence(cfg, clock=clock)
    resumed.load_state_dict(state)
    resumed.resume_at(101)
    assert resumed.next_step == cadence.next_step == 1020 and resumed.interval == 1000
    # a state without the cadence (saved before it existed): the next step of the fixed grid
    fresh = MonitorCadence(cfg, clock=clock)
    fresh.resume_at(101)
    assert fresh.next_step == 120
    fresh.resume_at(5)  # never moves backwards
    assert fresh.next_step == 120


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _train(cb, model, steps, clock, start=1, monitor_extra_ms=100.0):
    hooked = []
    for step in range(start, start + steps):
        if cb.probing:
            hooked.append(step)
        model(torch.randn(8, 16)).sum().backward()
        clock.now += (10.0 + (monitor_extra_ms if cb.probing and step >= cb.config.warmup_steps else 0.0)) / 1e3
        cb.on_step_end(step)
    return hooked


def test_the_callback_probes_on_the_stretched_schedule_and_resumes_it(tmp_path):
    cfg = ProbeConfig(
        enabled=True, every=2, warmup_steps=6, every_after=5, monitor_budget=0.05, every_after_max=1000,
        samples=2, speed_reps=1, max_rows_per_step=16,
    )  # fmt: skip
    model = _mlp()
    clock = FakeClock()
    cb = ProbeCallback(model, cfg, run_dir=str(tmp_path / "a"), start_step=1)
    cb.cadence = MonitorCadence(cfg, clock=clock)
    hooked = _train(cb, model, 60, clock)
    # warm-up probe steps 2 and 4, the plan at the end of step 5, the first monitoring step at 6:
    # on the fake clock it costs 100 ms over 10 ms steps, so at 5% the next one is 200 steps on
    assert hooked == [2, 4, 6]
    assert cb.monitoring_steps == [6] and cb.cadence.interval == 200 and cb.cadence.next_step == 206
    state = cb.state_dict()
    cb.close()
    resumed = ProbeCallback(_mlp(), cfg, run_dir=str(tmp_path / "b"), start_step=1)
    resumed.load_state_dict(state)
    resumed.resume_at(61)
    assert resumed.cadence.next_step == 206 and resumed.monitoring_steps == [6]
    assert not resumed.probing and resumed.is_probe_step(206) and not resumed.is_probe_step(11)
    resumed.close()


def _agree_worker(rank: int, init_file: str, result_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cfg = ProbeConfig(every=5, warmup_steps=20, every_after=50, monitor_budget=0.01, every_after_max=5000)
        clock = FakeClock()
        cadence = MonitorCadence(cfg, clock=clock)
        # rank 1's monitoring steps cost 3x rank 0's: both must take rank 1's (longer) interval
        monitored = _run_schedule(cadence, clock, 1200, monitor_extra_ms=100.0 * (1 + 2 * rank))
        with open(f"{result_file}.{rank}", "w") as f:
            f.write(f"{cadence.interval} {monitored}")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_agree_on_the_longest_interval():
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result")
        spawn_ranks(_agree_worker, (os.path.join(tmp, "store"), result), nprocs=2)
        outputs = [open(f"{result}.{r}").read() for r in range(2)]
    assert outputs[0] == outputs[1] == "3000 [20]"
