"""PeakRises: which planning phase raised the device's peak memory."""

import pytest
import torch

from loka_torchrec.peak_rises import GIB, PeakRises


def test_only_phases_that_raised_the_peak_by_enough_are_kept_in_order():
    rises = PeakRises(min_rise_bytes=GIB // 4, most=2)
    rises.observe("probe: evaluating a", 2 * GIB, 2 * GIB)  # stayed under the peak so far
    rises.observe("probe: evaluating b", 2 * GIB, 2 * GIB + GIB // 8)  # allocator noise
    rises.observe("dispatch: layer check at step 39", 2 * GIB, 5 * GIB)
    assert rises.rises == [{"phase": "dispatch: layer check at step 39", "rise_gib": 3.0, "gib": 5.0}]
    rises.observe("dispatch: gradient check at step 39", 5 * GIB, 6 * GIB)
    rises.observe("probe: evaluating c", 6 * GIB, 7 * GIB)
    assert [r["phase"] for r in rises.rises] == ["dispatch: gradient check at step 39", "probe: evaluating c"]  # most=2


def test_off_cuda_a_phase_runs_and_nothing_is_read():
    rises = PeakRises(min_rise_bytes=0)
    ran = []
    with rises.phase("probe: evaluating a", torch.device("cpu")):
        ran.append(True)
    with rises.phase("dispatch: layer check", None):
        ran.append(True)
    assert ran == [True, True] and rises.rises == []


def test_a_phase_that_raises_still_ends_its_block_and_bad_settings_are_refused():
    rises = PeakRises()
    with pytest.raises(RuntimeError, match="boom"):
        with rises.phase("probe: evaluating a", "cpu"):
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match="min_rise_bytes"):
        PeakRises(min_rise_bytes=-1)
    with pytest.raises(ValueError, match="most"):
        PeakRises(most=0)
