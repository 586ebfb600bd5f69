"""The host's counters over the timed window: batch waits, garbage collections, allocator calls."""

import gc
import threading
import time

import pytest

from loka_job.training.host_window import HostWindow, TimedBatches, host_counters, per_step


def _slow(n, seconds):
    for i in range(n):
        time.sleep(seconds)
        yield i


def _spin(cpu_seconds):
    """Work until this thread has used ``cpu_seconds`` of CPU time (however loaded the machine is)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def test_batch_waits_add_up_and_pass_items_and_the_end_through():
    batches = TimedBatches(_slow(3, 0.02))
    start = host_counters(batches, "cpu")
    assert [next(batches), next(batches)] == [0, 1]
    gc.collect()  # a full collection: every generation's count grows by one
    end = host_counters(batches, "cpu")
    counts = per_step(start, end, steps=2)
    assert counts["data_wait_ms"] >= 20  # 2 x 20 ms of sleep (at least) over 2 steps
    assert counts["gc2_per_step"] >= 0.5  # at least the one above (an automatic one may join it)
    assert counts["thread_switches_voluntary_per_step"] >= 1  # each sleep gives the CPU up
    assert counts["threads"] >= 1
    assert list(batches) == [2]
    with pytest.raises(StopIteration):
        next(batches)


def test_cpu_time_of_the_training_thread_and_of_other_threads():
    batches = TimedBatches(iter(()))
    start = host_counters(batches, "cpu")
    _spin(0.05)  # the training thread works
    helper = threading.Thread(target=_spin, args=(0.1,))  # another thread of the process works
    helper.start()
    helper.join()
    counts = per_step(start, host_counters(batches, "cpu"), steps=1)
    # CPU time, not wall time: exact lower bounds on any machine. The training thread's counter has
    # its own 50 ms; the process's has the helper's 100 ms on top (were the helper's in the thread's
    # counter too, the process would need 250 ms, which it did not use).
    assert counts["thread_cpu_ms"] >= 50
    assert counts["process_cpu_ms"] >= counts["thread_cpu_ms"] + 100


def test_a_window_leaves_out_the_stretches_that_are_not_training_steps():
    """A profiled stretch (its steps and the work after them) and an evaluation are not counted: the
    window's CPU time per step is the training steps' alone, over the steps not left out."""
    batches = TimedBatches(_slow(10, 0.0))
    window = HostWindow(batches, "cpu")
    window.leave_out()  # not open yet: nothing to leave out
    window.take_back(steps=3)
    window.open()
    assert window.is_open and window.per_step is None
    _spin(0.04)  # 2 training steps
    window.leave_out()
    _spin(0.3)  # 2 profiled steps and the profiler's work
    window.take_back(steps=2)
    _spin(0.04)  # 2 training steps
    window.leave_out()
    _spin(0.3)  # an evaluation
    window.take_back()
    window.close(steps=6)
    counts = window.per_step
    assert not window.is_open
    # 80 ms of training over 4 counted steps: 20 ms each and a little more (the counters' own work),
    # far from the 170 ms per step a window that counted everything over 6 steps would say
    assert 20 <= counts["thread_cpu_ms"] < 40
    window.close(steps=6)  # closed once: the second call changes nothing
    assert window.per_step is counts


def test_counters_off_cuda_have_no_allocator_fields():
    counts = host_counters(TimedBatches(iter(())), "cpu")
    assert set(counts) == {"data_wait_s", "thread_cpu_s", "process_cpu_s", "thread_switches_voluntary",
                           "thread_switches_involuntary", "gc0", "gc1", "gc2"}
    assert per_step(counts, counts, steps=0)["data_wait_ms"] == 0.0  # no steps: divided by one, not by zero


def test_the_printed_summary_says_what_the_cuda_graphs_did():
    from loka_job.train import format_summary

    summary = {
        "steps": 300, "steps_this_run": 300, "world_size": 1, "device": "cuda:0", "median_step_ms": 8.0, "qps": 1.0,
        "train_ne": 0.9, "train_auc": 0.7, "eval_ne": 0.9, "eval_auc": 0.7, "run_dir": "/tmp/run",
        "compile": {"mode": "reduce-overhead", "modules": ["over_arch"], "graphs": 4, "graph_breaks": 0,
                    "cuda_graphs": {"functions": 12, "graphs": 8, "new_paths": 1, "rerecords": 0, "skips": 2}},
        "host_window": {"data_wait_ms": 0.0684, "thread_cpu_ms": 7.514, "process_cpu_ms": 9.02},
    }  # fmt: skip
    text = format_summary(summary)
    assert "CUDA graphs      8 recorded, 0 re-recorded, 2 graph(s) run without" in text
    assert "host per step    0.07 ms waiting for batches, 7.51 ms CPU on the training thread, 9.02 ms in the process" in text
    summary["compile"]["cuda_graphs"], summary["host_window"] = None, None
    assert "CUDA graphs" not in format_summary(summary) and "host per step" not in format_summary(summary)
