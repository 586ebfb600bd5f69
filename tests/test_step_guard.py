"""The step-time guard: FP8 stays on only if the whole training step got faster."""

import json
import os

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch.step_guard import StepTimeGuard
from multirank import process_group, spawn_ranks, write_result


def _feed(guard, times, *, fp8, start=0):
    verdicts = [guard.observe(start + i, t, fp8_active=fp8) for i, t in enumerate(times)]
    return [v for v in verdicts if v is not None]


def test_verdict_compares_medians_after_settling():
    guard = StepTimeGuard(window=4, tolerance=0.05, settle=2)
    assert _feed(guard, [10.0, 10.0, 11.0, 9.0, 100.0], fp8=False) == []  # baseline keeps the last 4
    # two settle steps (a slow first FP8 step is not held against it), then 4 timed steps
    verdicts = _feed(guard, [500.0, 500.0, 10.4, 10.6, 10.2, 99.0], fp8=True, start=5)
    assert len(verdicts) == 1
    v = verdicts[0]
    assert v.step == 10 and v.bf16_ms == pytest.approx(10.5) and v.fp8_ms == pytest.approx(10.5) and v.keep_fp8
    assert _feed(guard, [50.0] * 10, fp8=True, start=11) == []  # one verdict per plan


def test_slower_step_means_bf16_and_tolerance_is_a_margin():
    slow = StepTimeGuard(window=3, tolerance=0.02, settle=0)
    _feed(slow, [10.0] * 3, fp8=False)
    (v,) = _feed(slow, [10.3, 10.3, 10.3], fp8=True, start=3)
    assert not v.keep_fp8 and v.ratio == pytest.approx(1.03) and "returns to bf16" in v.describe()
    lenient = StepTimeGuard(window=3, tolerance=0.05, settle=0)
    _feed(lenient, [10.0] * 3, fp8=False)
    (v,) = _feed(lenient, [10.3, 10.3, 10.3], fp8=True, start=3)
    assert v.keep_fp8 and "keeps FP8" in v.describe()


def test_no_verdict_without_a_baseline_or_when_disabled():
    guard = StepTimeGuard(window=4, settle=0)
    assert _feed(guard, [1.0] * 20, fp8=True) == []  # FP8 from the first step: nothing to compare with
    off = StepTimeGuard(window=0)
    _feed(off, [1.0] * 4, fp8=False)
    assert _feed(off, [9.0] * 20, fp8=True) == [] and not off.enabled
    nan_times = StepTimeGuard(window=2, settle=0)
    _feed(nan_times, [1.0, 1.0], fp8=False)
    assert _feed(nan_times, [float("nan"), -1.0, 1.0], fp8=True) == []  # not times: ignored


def test_restart_starts_a_new_trial_and_bad_settings_name_the_field():
    guard = StepTimeGuard(window=2, settle=0)
    _feed(guard, [1.0, 1.0], fp8=False)
    assert len(_feed(guard, [1.0, 1.0], fp8=True)) == 1
    guard.restart()
    assert len(_feed(guard, [5.0, 5.0], fp8=True)) == 1
    with pytest.raises(ValueError, match="step_guard_window"):
        StepTimeGuard(window=-1)
    with pytest.raises(ValueError, match="step_guard_tolerance"):
        DispatchConfig(step_guard_tolerance=-0.1)
    with pytest.raises(TypeError, match="dispatch.step_guard_window: expected an int"):
        DispatchConfig(step_guard_window=1.5)


def _planned_model(tmp_path, window=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    cfg = DispatchConfig(mode="policy", plan_at_step=1, min_speedup=0.0, samples=3, timing_reps=1, step_guard_window=window)
    report = loka_torchrec.apply(model, cfg, run_dir=str(tmp_path))
    return model, report.dispatcher


@pytest.mark.parametrize("fp8_ms, keeps", [(12.0, False), (8.0, True)])
def test_dispatcher_returns_every_gemm_to_bf16_when_the_step_got_slower(tmp_path, fp8_ms, keeps):
    model, d = _planned_model(tmp_path)
    model(torch.randn(64, 32)).sum().backward()
    for step in range(1, 5):
        d.observe_step_time(step, 10.0)  # bf16 steps: the baseline
    d.on_step_end(1)  # plan_at_step=1: a plan from random evidence, FP8 everywhere (min_speedup=0)
    assert d.plan.fp8_gemm_count() > 0 and d._runs_fp8()
    verdicts = [d.observe_step_time(step, fp8_ms) for step in range(5, 5 + 5 + 4)]  # 5 settle + 4 timed
    (verdict,) = [v for v in verdicts if v is not None]
    assert verdict.keep_fp8 is keeps
    assert d._runs_fp8() is keeps and (d.step_guard_reason is None) is keeps
    events = [json.loads(line) for line in (tmp_path / "dispatch_events.jsonl").read_text().splitlines()]
    guard_events = [e for e in events if e["event"] == "step_guard"]
    assert guard_events == [{"event": "step_guard", "step": 13, "bf16_ms": 10.0, "fp8_ms": fp8_ms, "keep_fp8": keeps}]
    if not keeps:
        assert all(layer.kernels.all_high_precision for layer in d.managed_layers().values())
        assert "12.00 ms with FP8 vs 10.00 ms in bf16" in d.step_guard_reason
        d.readmit("0", step=20)  # a readmission by the Probe's valve does not override the guard
        assert not d._runs_fp8()
    assert d.guarded_layers() == (["0", "2"] if keeps else [])  # the valve guards nothing once FP8 is off


def _guard_worker(rank, world, init_file, out_dir):
    with process_group(rank, world, init_file):
        model, d = _planned_model(os.path.join(out_dir, f"run{rank}"))
        model(torch.randn(16, 32)).sum().backward()
        for step in range(1, 5):
            d.observe_step_time(step, 10.0)
        d.on_step_end(1)
        for step in range(5, 14):
            # rank 0 got faster, rank 1 slower: the slowest rank counts, on both ranks
            d.observe_step_time(step, 8.0 if rank == 0 else 12.0)
        write_result(out_dir, rank, {"reason": d.step_guard_reason, "fp8": d._runs_fp8()})


@pytest.mark.slow
def test_two_ranks_take_the_same_verdict(tmp_path):
    spawn_ranks(_guard_worker, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1] and results[0]["fp8"] is False
    assert "12.00 ms with FP8 vs 10.00 ms in bf16" in results[0]["reason"]


def test_a_resumed_dispatcher_keeps_the_guard_verdict_and_rewrites_its_files(tmp_path):
    """The guard's bf16 verdict, the plan and the valve's holds survive a checkpoint; a resumed
    run's dispatch_plan.json is the planned one (not step 0, "not planned yet")."""
    model, d = _planned_model(tmp_path / "a")
    model(torch.randn(64, 32)).sum().backward()
    for step in range(1, 5):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    for step in range(5, 14):
        d.observe_step_time(step, 12.0)  # slower: every GEMM back to bf16
    d.fallback("2", "injected", step=14)
    assert d.step_guard_reason is not None
    state = torch.load(_saved(tmp_path, d.state_dict()), weights_only=False)

    resumed_model, resumed = _fresh_model(tmp_path / "b")
    resumed.start()  # what the trainer does before resuming: writes the initial (unplanned) plan
    assert json.loads((tmp_path / "b" / "dispatch_plan.json").read_text())["step"] == 0
    resumed.load_state_dict(state)
    assert resumed.step_guard_reason == d.step_guard_reason and resumed.fallen_back == {"2": "injected"}
    assert not resumed._runs_fp8()  # the guard's verdict holds: bf16 everywhere
    plan = json.loads((tmp_path / "b" / "dispatch_plan.json").read_text())
    assert plan["step"] == 1 and plan["gates"] and plan == d.plan.to_dict(d.in_force())
    assert plan["in_force"]["fp8_gemms"] == 0 and plan["in_force"]["fp8_gemms_planned"] > 0  # the guard's bf16 runs
    events = [json.loads(line) for line in (tmp_path / "b" / "dispatch_events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == [e["event"] for e in d.events] and "step_guard" in [e["event"] for e in events]
    # the guard stays decided: more slow steps give no second verdict
    assert all(resumed.observe_step_time(step, 50.0) is None for step in range(14, 30))


def test_a_trial_cut_by_a_checkpoint_goes_on_after_resume(tmp_path):
    model, d = _planned_model(tmp_path / "a")
    model(torch.randn(64, 32)).sum().backward()
    for step in range(1, 5):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    for step in range(5, 11):  # 5 settle steps + 1 of the 4 timed ones
        assert d.observe_step_time(step, 12.0) is None
    _, resumed = _fresh_model(tmp_path / "b")
    resumed.load_state_dict(d.state_dict())
    verdicts = [resumed.observe_step_time(step, 12.0) for step in range(11, 14)]
    assert verdicts[-1] is not None and not verdicts[-1].keep_fp8 and resumed.step_guard_reason


def _fresh_model(run_dir):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    cfg = DispatchConfig(mode="policy", plan_at_step=1, min_speedup=0.0, samples=3, timing_reps=1, step_guard_window=4)
    return model, loka_torchrec.apply(model, cfg, run_dir=str(run_dir)).dispatcher


def _saved(tmp_path, state):
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def _judged(tmp_path, fp8_ms=9.0):
    """A planned model whose FP8 plan the guard judged (bf16 10 ms before the plan, FP8 ``fp8_ms``)."""
    model, d = _planned_model(tmp_path)
    model(torch.randn(64, 32)).sum().backward()
    for step in range(1, 5):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    assert [v for v in (d.observe_step_time(step, fp8_ms) for step in range(5, 14)) if v is not None][0].keep_fp8
    return d


@pytest.mark.parametrize("readmitted_ms, kept", [(12.0, False), (9.5, True)])
def test_a_layer_readmitted_after_the_verdict_is_timed_again(tmp_path, readmitted_ms, kept):
    """The valve's readmission after the guard's verdict puts a set of FP8 layers in force that no window
    timed: it is timed (one window against the same bf16 steps), and the readmitted layer goes back to
    bf16 for good if the step is slower with it; the rest of the plan stays."""
    d = _judged(tmp_path)
    d.fallback("2", "amax jumped", step=14)
    assert not d.judging_step_times  # fewer FP8 layers: nothing to time
    d.readmit("2", step=15)
    assert d.judging_step_times and not d.managed_layers()["2"].kernels.all_high_precision
    state = d.state_dict()  # a checkpoint in the middle of the window: it goes on after resume
    _, d = _fresh_model(tmp_path / "resumed")
    d.load_state_dict(state)
    (verdict,) = [v for v in (d.observe_step_time(step, readmitted_ms) for step in range(16, 25)) if v is not None]
    assert verdict.keep_fp8 is kept and d.step_guard_reason is None  # the plan judged before stays either way
    layers = d.managed_layers()
    assert not layers["0"].kernels.all_high_precision
    assert layers["2"].kernels.all_high_precision is not kept
    (event,) = [e for e in d.events if e["event"] == "step_guard" and e["step"] == 24]
    assert event["readmitted"] == ["2"] and event["keep_fp8"] is kept
    if not kept:
        assert d.fallen_back["2"] == "step-time guard: readmitting made the step slower (12.00 ms against 10.00 ms in bf16)"
        assert "the step-time guard holds 1 readmitted layer(s) in bf16" in d.summary()
        assert "2" not in d.guarded_layers()  # the valve no longer watches it ...
        d.readmit("2", step=40)  # ... nor readmits it
        assert layers["2"].kernels.all_high_precision and not d.judging_step_times


def test_a_valve_change_during_a_window_times_the_window_anew(tmp_path):
    model, d = _planned_model(tmp_path)
    model(torch.randn(64, 32)).sum().backward()
    for step in range(1, 5):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    for step in range(5, 12):  # 5 settling steps, then 2 of the 4 timed ones, slow
        assert d.observe_step_time(step, 30.0) is None
    d.fallback("2", "amax jumped", step=12)  # another set of FP8 layers from here: its own window
    verdicts = [d.observe_step_time(step, 9.0) for step in range(12, 21)]
    assert verdicts[:-1] == [None] * 8 and verdicts[-1].keep_fp8 and verdicts[-1].fp8_ms == 9.0
