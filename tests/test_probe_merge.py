"""Exact cross-rank merge of Probe statistics: 2 gloo ranks equal one process over the union of the data."""

import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

from loka_torchrec.probe.merge import all_reduce_statistics, rank_deviation
from loka_torchrec.probe.statistics import TensorStatistics
from multirank import spawn_ranks

WORLD = 2
DIM, CAP = 10, 6


def _rank_data(rank: int, device: str):
    """Rank 0: single-row batches plus one big one; rank 1: other sizes, another mean."""
    rng = np.random.default_rng(100 + rank)
    sizes = [1, 1, 13] if rank == 0 else [4, 1, 29, 2]
    shift = 3.0 if rank == 0 else -1.0
    return [torch.from_numpy(rng.standard_normal((n, DIM)) * (1 + rank) + shift).to(device) for n in sizes]


def _fill(batches, key: str, cap: int, light=()) -> TensorStatistics:
    stats = TensorStatistics(DIM, max_cov_dim=cap, key=key)
    for b in batches:
        stats.update(b, delayed_amax=2.0)
    for b in light:
        stats.update(b, moments=False)  # monitoring-only updates: power sums and fractions
    return stats


def _rank_stats(rank, device, key, cap):
    data = _rank_data(rank, device)
    return _fill(data, key, cap, light=[2 * data[0]])


def _check_against_union(merged, device: str) -> None:
    union = [b for r in range(WORLD) for b in _rank_data(r, device)]
    light = [2 * _rank_data(r, device)[0] for r in range(WORLD)]
    for got, cap, key in zip(merged, (DIM, CAP), ("full", "capped")):
        ref = _fill(union, key, cap, light=light)
        assert got.count == ref.count and got.numel == ref.numel and got.sat_numel == ref.sat_numel
        assert got.light_rows == ref.light_rows == 1 + 4  # rank 0's first batch has 1 row, rank 1's has 4
        assert got.max_rows == ref.max_rows == 29
        torch.testing.assert_close(got.mean, ref.mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.scatter_matrix(), ref.scatter_matrix(), rtol=1e-11, atol=1e-10)
        torch.testing.assert_close(got.m2_diag, ref.m2_diag, rtol=1e-11, atol=1e-10)
        for name in ("sum_sq", "sum_4th", "sum_row_ms_sq", "amax", "nonfinite", "underflow", "saturation"):
            torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-12, atol=0)
        x = torch.cat(union).cpu().numpy()
        idx = got.cov_index.numpy()
        np.testing.assert_allclose(got.covariance().cpu().numpy(), np.cov(x[:, idx].T), rtol=1e-10, atol=1e-10)
        assert got.kurtosis() == pytest.approx(ref.kurtosis(), rel=1e-12)


def _merge_worker(rank: int, init_file: str, backend: str) -> None:
    torch.set_num_threads(1)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        local = [_rank_stats(rank, device, "full", DIM), _rank_stats(rank, device, "capped", CAP)]
        before = local[0].clone()
        merged = all_reduce_statistics(local)
        torch.testing.assert_close(local[0].scatter_matrix(), before.scatter_matrix(), rtol=0, atol=0)  # inputs untouched
        assert merged[0].device.type == device
        _check_against_union(merged, device)
        # Ranks with shifted means disagree far beyond noise; the rank's rows against themselves do not.
        dev = rank_deviation(local[0], merged[0])
        assert dev["mean_z_max"] > dev["mean_z_crit"]
    finally:
        dist.destroy_process_group()


def _spawn(backend: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_merge_worker, (os.path.join(tmp, "store"), backend), nprocs=WORLD, cuda=backend == "nccl")


@pytest.mark.slow
def test_two_gloo_ranks_merge_to_the_single_process_statistics():
    _spawn("gloo")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for a 2-rank NCCL merge")
def test_two_nccl_ranks_merge_to_the_single_process_statistics():
    _spawn("nccl")


def test_without_a_process_group_the_merge_is_a_copy():
    stats = _rank_stats(0, "cpu", "full", DIM)
    (copy,) = all_reduce_statistics([stats])
    assert copy is not stats and copy.count == stats.count
    torch.testing.assert_close(copy.scatter_matrix(), stats.scatter_matrix(), rtol=0, atol=0)


def test_rank_deviation_is_quiet_for_samples_of_one_distribution():
    rng = np.random.default_rng(0)
    a, b = TensorStatistics(DIM), TensorStatistics(DIM)
    a.update(torch.from_numpy(rng.standard_normal((500, DIM))))
    b.update(torch.from_numpy(rng.standard_normal((500, DIM))))
    merged = a.clone().merge(b)
    dev = rank_deviation(a, merged)
    assert dev["mean_z_max"] < dev["mean_z_crit"] and abs(dev["mean_sq_z"]) < 5
    shifted = TensorStatistics(DIM)
    shifted.update(torch.from_numpy(rng.standard_normal((500, DIM)) * 2.0))
    dev = rank_deviation(shifted, shifted.clone().merge(a))
    assert dev["mean_sq_z"] > 5  # a rank whose scale doubled stands out
