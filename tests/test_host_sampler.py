"""HostSampler: where the training thread's host time goes, by Python function, and the profiler's use of it."""

import json
import sys
import threading
import time

import pytest
import torch

from loka_job.training.host_sampler import HostSampler, format_host_report
from loka_job.training.profiling import StepProfiler


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _step_with_a_slow_helper():
    _busy(0.01)


def test_a_function_the_thread_spends_its_steps_in_leads_both_lists():
    sampler = HostSampler(interval=0.0005)
    sampler.start()
    for _ in range(5):
        _step_with_a_slow_helper()
    report = sampler.stop(num_steps=5)
    assert report["samples"] > 0 and report["num_steps"] == 5
    inclusive = {r["function"].split(" ")[-1]: r for r in report["inclusive"]}
    top_self = report["self"][0]["function"]
    # The caller is on the stack whenever its helper is; only the helper is on top.
    assert top_self.endswith(" _busy")
    assert inclusive["_busy"]["share"] > 0.5 and inclusive["_step_with_a_slow_helper"]["share"] >= inclusive["_busy"]["share"]
    assert not any(r["function"].endswith(" _step_with_a_slow_helper") and r["share"] > 0.5 for r in report["self"])
    assert sum(r["share"] for r in report["self"]) <= 1.0 + 1e-9
    text = format_host_report(report)
    assert "on the stack (inclusive)" in text and "_busy" in text


def test_only_the_named_thread_is_sampled():
    done = threading.Event()

    def other():
        while not done.is_set():
            _busy(0.001)

    worker = threading.Thread(target=other)
    worker.start()
    try:
        sampler = HostSampler(interval=0.0005)  # this thread, which sleeps
        sampler.start()
        time.sleep(0.03)
        report = sampler.stop(num_steps=1)
    finally:
        done.set()
        worker.join()
    assert report["samples"] > 0
    assert not any("_busy" in r["function"] for r in report["inclusive"])


def test_bad_use_is_refused():
    with pytest.raises(ValueError, match="interval"):
        HostSampler(interval=0)
    sampler = HostSampler()
    with pytest.raises(RuntimeError, match="not running"):
        sampler.stop(num_steps=1)
    sampler.start()
    with pytest.raises(RuntimeError, match="already running"):
        sampler.start()
    with pytest.raises(ValueError, match="num_steps"):
        sampler.stop(num_steps=0)
    sampler.stop(num_steps=1)


def test_the_switch_interval_is_lowered_while_sampling_and_restored():
    before = sys.getswitchinterval()
    sampler = HostSampler(interval=before / 10)
    sampler.start()
    try:
        assert sys.getswitchinterval() == pytest.approx(before / 10)
    finally:
        sampler.stop(num_steps=1)
    assert sys.getswitchinterval() == before


def test_the_step_profiler_samples_the_host_over_its_window_only(tmp_path):
    layer = torch.nn.Linear(16, 16)
    profiler = StepProfiler(3, 2, device=torch.device("cpu"), out_dir=str(tmp_path), host_stacks=True)
    for step in range(1, 6):
        profiler.before_step(step)
        layer(torch.randn(8, 16)).sum().backward()
        if step in (3, 4):
            _step_with_a_slow_helper()  # only the window's steps have the slow helper
        profiler.after_step(step)
    report = json.loads((tmp_path / "profile.json").read_text())
    stacks = report["host_stacks"]
    assert stacks["num_steps"] == 2 and stacks["file"].endswith("host_stacks.txt")
    assert any(r["function"].endswith(" _step_with_a_slow_helper") for r in stacks["inclusive"])
    assert "_step_with_a_slow_helper" in (tmp_path / "host_stacks.txt").read_text()


def test_without_host_stacks_the_profiler_writes_none(tmp_path):
    profiler = StepProfiler(1, 1, device=torch.device("cpu"), out_dir=str(tmp_path))
    profiler.before_step(1)
    torch.randn(4, 4) @ torch.randn(4, 4)
    profiler.after_step(1)
    assert "host_stacks" not in json.loads((tmp_path / "profile.json").read_text())
    assert not (tmp_path / "host_stacks.txt").exists()


def _diff_script():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "host_stacks_diff.py")
    spec = importlib.util.spec_from_file_location("host_stacks_diff", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _profile(tmp_path, name, rows, wall):
    stacks = {"wall_ms_per_step": wall, "inclusive": [{"function": f, "ms_per_step": ms} for f, ms in rows],
              "self": [{"function": f, "ms_per_step": ms} for f, ms in rows]}  # fmt: skip
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"host_stacks": stacks}))
    return str(path)


def test_the_diff_puts_the_function_that_grew_most_first_and_names_a_file_without_stacks(tmp_path, capsys):
    diff = _diff_script()
    a = _profile(tmp_path, "a", [("step", 10.0), ("lookup", 2.0), ("gone", 0.5)], 10.0)
    b = _profile(tmp_path, "b", [("step", 12.0), ("lookup", 2.1), ("new_hook", 1.5)], 12.0)
    rows = diff.differences(diff.load_stacks(a), diff.load_stacks(b), "inclusive")
    assert [r[0] for r in rows[:2]] == ["step", "new_hook"] and rows[1][1:] == (0.0, 1.5)
    assert diff.main([a, b]) == 0 and "+2.000  step" in capsys.readouterr().out
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"steps": [1, 2]}))
    assert diff.main([a, str(bare)]) == 2
    assert "no host_stacks" in capsys.readouterr().err
