"""The host's counters over the timed window: batch waits, garbage collections, allocator calls."""

import gc
import time

import pytest

from loka_job.training.host_window import TimedBatches, host_counters, per_step


def _slow(n, seconds):
    for i in range(n):
        time.sleep(seconds)
        yield i


def test_batch_waits_add_up_and_pass_items_and_the_end_through():
    batches = TimedBatches(_slow(3, 0.02))
    start = host_counters(batches, "cpu")
    assert [next(batches), next(batches)] == [0, 1]
    gc.collect()  # a full collection: every generation's count grows by one
    end = host_counters(batches, "cpu")
    counts = per_step(start, end, steps=2)
    assert 20 <= counts["data_wait_ms"] < 200  # 2 x 20 ms of sleep over 2 steps
    assert counts["gc2_per_step"] == pytest.approx(0.5)
    assert list(batches) == [2]
    with pytest.raises(StopIteration):
        next(batches)


def test_counters_off_cuda_have_no_allocator_fields():
    counts = host_counters(TimedBatches(iter(())), "cpu")
    assert set(counts) == {"data_wait_s", "gc0", "gc1", "gc2"}
    assert per_step(counts, counts, steps=0)["data_wait_ms"] == 0.0  # no steps: divided by one, not by zero
