"""Where the peak GPU memory was set: the rises kept, small ones folded, a counter reset, the summary line."""

import pytest

from loka_job.training.peak_memory import GIB, PeakMemoryTrace


def test_the_last_rise_names_the_work_that_set_the_peak():
    trace = PeakMemoryTrace()
    trace.observe("step 1", 3 * GIB)
    trace.observe("step 2", 3 * GIB + 2**20)  # 1 MiB: allocator noise, folded into the next rise
    trace.observe("step 10 (compiled modules eager: a probe step)", 5 * GIB)
    trace.observe("step 40", 4 * GIB)  # the device's counter was reset (the timed window): not a rise
    trace.observe("evaluation after step 50", 5 * GIB)  # equal: not a rise either
    assert [r["at"] for r in trace.rises] == ["step 1", "step 10 (compiled modules eager: a probe step)"]
    assert trace.peak_set_at == "step 10 (compiled modules eager: a probe step)"
    assert trace.rises[-1]["gib"] == 5.0 and trace.rises[-1]["rise_gib"] == pytest.approx(2.0)  # from step 1's 3 GiB
    trace.observe("the final evaluation", 6 * GIB)
    assert trace.peak_set_at == "the final evaluation" and trace.peak == 6 * GIB


def test_only_the_most_recent_rises_are_kept_and_bad_settings_are_refused():
    trace = PeakMemoryTrace(min_rise_bytes=0, min_rise_share=0.0, most=3)
    for step in range(1, 11):
        trace.observe(f"step {step}", step * GIB)
    assert [r["at"] for r in trace.rises] == ["step 8", "step 9", "step 10"]
    assert PeakMemoryTrace().peak_set_at is None
    with pytest.raises(ValueError, match="most: expected >= 1"):
        PeakMemoryTrace(most=0)


def test_the_printed_summary_says_where_the_peak_was_set():
    from loka_job.train import format_summary

    summary = {
        "steps": 300, "steps_this_run": 300, "world_size": 1, "device": "cuda:0", "median_step_ms": 8.0, "qps": 1.0,
        "train_ne": 0.9, "train_auc": 0.7, "eval_ne": 0.9, "eval_auc": 0.7, "run_dir": "/tmp/run",
        "peak_memory_gb": 5.15, "peak_memory_window_gb": 2.95,
        "peak_memory_rises": [{"at": "step 1", "gib": 3.0, "rise_gib": 3.0},
                              {"at": "step 30 (compiled modules eager: a probe step)", "gib": 5.15, "rise_gib": 2.15}],
    }  # fmt: skip
    text = format_summary(summary)
    assert "peak set at      step 30 (compiled modules eager: a probe step) on rank 0 (5.15 GiB; 2 rise(s)" in text
    summary["peak_memory_rises"] = None
    assert "peak set at" not in format_summary(summary)
