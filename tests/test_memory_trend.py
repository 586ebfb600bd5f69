"""The warning for GPU memory that grows every step (loka_job.training.memory_trend)."""

import doctest

import pytest

from loka_job.training import memory_trend
from loka_job.training.memory_trend import MemoryTrend


def test_steady_growth_warns_once_with_the_rate():
    trend = MemoryTrend(windows=3, skip=1)
    samples = [(5, 15.0), (10, 18.75), (15, 22.5), (20, 26.25), (25, 30.0), (30, 33.75)]
    said = [trend.observe(step, gib) for step, gib in samples]
    assert said[:4] == [None] * 4  # the first sample is skipped, then three intervals are needed
    assert "+0.75 GiB a step" in said[4] and "18.75 GiB allocated after step 10" in said[4]
    assert "train.compile=default" in said[4]
    assert said[5] is None  # once


@pytest.mark.parametrize(
    "samples",
    [
        [(5, 15.0), (10, 15.0), (15, 15.0), (20, 15.0), (25, 15.0)],  # flat
        [(5, 15.0), (10, 20.0), (15, 25.0), (20, 24.0), (25, 30.0)],  # one interval fell
        [(5, 15.0), (10, 15.1), (15, 15.2), (20, 15.3), (25, 15.4)],  # 0.02 GiB a step: noise
    ],
)
def test_no_warning_without_a_steady_trend(samples):
    trend = MemoryTrend(windows=3, skip=1)
    assert all(trend.observe(step, gib) is None for step, gib in samples)


def test_bad_window_count_is_refused():
    with pytest.raises(ValueError, match="windows: expected >= 1"):
        MemoryTrend(windows=0)


def test_docstring_example_runs():
    assert doctest.testmod(memory_trend).failed == 0
