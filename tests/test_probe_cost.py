"""The Probe's cost, measured from a run's own step times."""

import pytest

from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.cost import probe_cost


def _times(config, steps, plain_before=10.0, plain_after=8.0, probe_extra=3.0, monitor_extra=1.0, plan_extra=500.0):
    """Synthetic step times: plain steps, +probe_extra on warm-up probe steps, the plan step, monitoring steps."""
    out = {}
    plan = config.warmup_steps - 1
    for s in range(1, steps + 1):
        base = plain_before if s <= plan else plain_after
        if s == plan:
            out[s] = base + plan_extra
        elif config.is_probe_step(s):
            out[s] = base + (probe_extra if s < config.warmup_steps else monitor_extra)
        else:
            out[s] = base
    return out


def test_extras_are_measured_against_nearby_plain_steps():
    config = ProbeConfig(enabled=True, every=10, warmup_steps=100, every_after=50)
    times = _times(config, 300)
    cost = probe_cost(times, config, horizon_steps=10_000)
    # the step time drops from 10 to 8 ms at the plan: not Probe cost
    assert cost["warmup_extra_ms"] == pytest.approx(3.0)
    assert cost["monitoring_extra_ms"] == pytest.approx(1.0) and cost["monitoring_from"] == "monitoring steps"
    assert cost["plan_extra_ms"] == pytest.approx(500.0, abs=2.0)
    assert cost["plain_step_ms"] == pytest.approx(8.0)
    warm = sum(1 for s in range(1, 100) if config.is_probe_step(s))
    monitor = sum(1 for s in range(100, 301) if config.is_probe_step(s))
    assert cost["warmup_probe_steps"] == warm and cost["monitoring_probe_steps"] == monitor
    extra = warm * 3.0 + monitor * 1.0 + cost["plan_extra_ms"]
    assert cost["extra_seconds"] == pytest.approx(extra / 1e3)
    assert cost["measured_share"] == pytest.approx(extra / sum(times.values()))
    # projection: warm-up probes + plan + (10000 - 100) // 50 + 1 monitoring steps over 10000 plain steps
    projected = (warm * 3.0 + cost["plan_extra_ms"] + ((10_000 - 100) // 50 + 1) * 1.0) / (10_000 * 8.0)
    assert cost["projected_share"] == pytest.approx(projected)


def test_without_monitoring_steps_the_warmup_extra_stands_in():
    config = ProbeConfig(enabled=True, every=10, warmup_steps=100, every_after=500)
    times = _times(config, 300)
    del times[100]  # the first monitoring step
    cost = probe_cost(times, config, horizon_steps=100_000)
    assert cost["monitoring_probe_steps"] == 0
    assert cost["monitoring_extra_ms"] == pytest.approx(3.0) and "no monitoring step" in cost["monitoring_from"]
    expected = (9 * 3.0 + cost["plan_extra_ms"] + ((100_000 - 100) // 500 + 1) * 3.0) / (100_000 * 8.0)
    assert cost["projected_share"] == pytest.approx(expected)


def test_with_monitoring_paused_the_projection_counts_no_monitoring_step():
    config = ProbeConfig(enabled=True, every=10, warmup_steps=100, every_after=500)
    times = _times(config, 300)
    del times[100]  # skipped: no layer ran FP8
    cost = probe_cost(times, config, monitoring_paused=True, horizon_steps=100_000)
    assert cost["monitoring_interval"] is None and cost["monitoring_from"].startswith("none: monitoring paused")
    assert cost["projected_share"] == pytest.approx((9 * 3.0 + cost["plan_extra_ms"]) / (100_000 * 8.0))


def test_only_a_window_of_steps_and_bad_arguments():
    config = ProbeConfig(enabled=True, every=10, warmup_steps=100, every_after=500)
    times = {s: t for s, t in _times(config, 300).items() if s > 150}  # the plan and warm-up not in the window
    cost = probe_cost(times, config)
    assert cost["warmup_probe_steps"] == 0 and cost["plan_extra_ms"] is None and cost["projected_share"] is None
    assert cost["extra_seconds"] == 0.0
    with pytest.raises(ValueError, match="horizon_steps"):
        probe_cost(times, config, horizon_steps=0)


def test_the_printed_run_summary_reports_the_layer_check_and_the_probe_cost():
    from loka_job.train import format_summary

    config = ProbeConfig(enabled=True, every=10, warmup_steps=100, every_after=50)
    summary = {
        "steps": 300, "steps_this_run": 300, "world_size": 1, "device": "cpu", "median_step_ms": 8.0, "qps": 1.0,
        "train_ne": 0.9, "train_auc": 0.7, "eval_ne": 0.9, "eval_auc": 0.7, "run_dir": "/tmp/run",
        "loka": {"converted_layers": 2, "plan": "0/6 GEMMs in FP8", "plan_file": "/tmp/run/dispatch_plan.json",
                 "layer_checks": [{"kept_fp8": False}, {"kept_fp8": True}], "forward_scaling": "delayed"},
        "probe_cost": probe_cost(_times(config, 300), config, horizon_steps=10_000),
    }  # fmt: skip
    text = format_summary(summary)
    assert "kept FP8 in 1 of 2 planned FP8 layers" in text
    assert "FP8 scaling      forward inputs and weights: delayed; gradients: current" in text
    summary["loka"].update(grad_scaling="delayed", grad_scaling_events={"calls": 80, "saturated": 14, "nonfinite": 0})
    assert ("FP8 scaling      forward inputs and weights: delayed; gradients: delayed "
            "(14 of 80 backward calls saturated, 0 non-finite)") in format_summary(summary)  # fmt: skip
    cost = summary["probe_cost"]
    assert f"{100 * cost['measured_share']:.2f}% of this run's step time" in text
    assert f"projected {100 * cost['projected_share']:.2f}% of a 10,000-step run, monitoring every 50 steps" in text
    summary["probe_cost"] = probe_cost(_times(config, 300), config, monitoring_paused=True, horizon_steps=10_000)
    assert "of a 10,000-step run, monitoring paused (no layer runs FP8)" in format_summary(summary)


def test_the_projection_uses_the_budgeted_interval_and_the_reported_monitoring_steps():
    config = ProbeConfig(enabled=True, every=10, warmup_steps=100, every_after=50, monitor_budget=0.0025)
    # monitoring steps at 100 and 2100 only (as a stretched schedule runs them), 40 ms extra each
    times = {s: (10.0 if s < 99 else 8.0) for s in range(1, 2301)}
    times[99] += 500.0
    for s in range(10, 100, 10):
        times[s] += 3.0
    for s in (100, 2100):
        times[s] += 40.0
    cost = probe_cost(times, config, monitoring_steps=[100, 2100], horizon_steps=100_000)
    assert cost["monitoring_probe_steps"] == 2 and cost["monitoring_extra_ms"] == pytest.approx(40.0)
    # 40 ms over 8 ms steps at 0.25%: every 2000 steps
    assert cost["monitoring_interval"] == 2000
    expected = (9 * 3.0 + cost["plan_extra_ms"] + ((100_000 - 100) // 2000 + 1) * 40.0) / (100_000 * 8.0)
    assert cost["projected_share"] == pytest.approx(expected)
    # steps of the fixed grid that did not probe are plain steps here, not probe steps
    assert cost["plain_step_ms"] == pytest.approx(8.0)
    fixed = probe_cost(times, config, horizon_steps=100_000)
    assert fixed["monitoring_probe_steps"] == len(range(100, 2301, 50))
