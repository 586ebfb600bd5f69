"""Probe statistics: batched Welford/Chan moments, kurtosis, underflow/saturation, covariance cap,
Gaussian sampling and the weight model, against float64 NumPy/SciPy references."""

import math

import numpy as np
import pytest
import torch

from loka_torchrec.fp8 import Fp8Format, quantize, saturated_cast
from loka_torchrec.probe.sampling import GaussianModel, cholesky_with_jitter, make_generator
from loka_torchrec.probe.statistics import HOST, TensorStatistics, covariance_subset
from loka_torchrec.probe.weight_statistics import WeightStatistics


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention
    yield
    torch.set_num_threads(saved)


def _batches(rng, sizes, dim, scale=3.0, shift=5.0):
    return [torch.from_numpy(rng.standard_normal((n, dim)) * scale + shift) for n in sizes]


@pytest.mark.parametrize("sizes", [[1, 1, 1, 1], [1, 7, 1, 30, 2, 1], [64], [3, 0, 5]])
def test_welford_chan_matches_numpy_including_single_rows(sizes):
    rng = np.random.default_rng(len(sizes))
    dim = 6
    stats = TensorStatistics(dim)
    batches = _batches(rng, sizes, dim)
    for b in batches:
        stats.update(b)
    x = np.concatenate([b.numpy() for b in batches])
    assert stats.count == x.shape[0] and stats.numel == x.size
    np.testing.assert_allclose(stats.mean.numpy(), x.mean(0), rtol=1e-13, atol=1e-12)
    ddof_cov = np.cov(x.T, ddof=1) if x.shape[0] > 1 else np.zeros((dim, dim))
    np.testing.assert_allclose(stats.covariance().numpy(), ddof_cov, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(stats.variance().numpy(), np.diag(ddof_cov), rtol=1e-11, atol=1e-11)
    assert float(stats.amax) == pytest.approx(np.abs(x).max(), rel=0)
    assert stats.max_rows == max(sizes)


def test_merge_equals_single_pass_and_no_cancellation_at_large_offset():
    rng = np.random.default_rng(1)
    # mean 1e6, std 1: a raw second moment would lose every digit of the variance
    parts = [torch.from_numpy(rng.standard_normal((n, 4)) + 1e6) for n in (1, 5, 17)]
    single = TensorStatistics(4)
    for p in parts:
        single.update(p)
    a, b = TensorStatistics(4), TensorStatistics(4)
    a.update(parts[0])
    b.update(parts[1])
    b.update(parts[2])
    merged = a.merge(b)
    x = np.concatenate([p.numpy() for p in parts])
    ref = np.cov((x - 1e6).T, ddof=1)  # shifted reference, exact in float64
    np.testing.assert_allclose(merged.covariance().numpy(), ref, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(merged.covariance().numpy(), single.covariance().numpy(), rtol=1e-10, atol=1e-10)
    assert merged.count == single.count


def test_a_clone_on_another_device_is_an_independent_copy_made_there():
    stats = TensorStatistics(6, max_cov_dim=4, key="layer|act")
    stats.update(torch.randn(10, 6, dtype=torch.float64))
    copy = stats.clone("cpu")
    assert copy.m2_cov.data_ptr() != stats.m2_cov.data_ptr() and copy.summary() == stats.summary()
    copy.update(torch.randn(3, 6, dtype=torch.float64))
    assert (copy.count, stats.count) == (13, 10)  # the original is untouched
    on_meta = stats.clone("meta")  # straight onto the target device
    assert on_meta.device.type == "meta" and all(
        getattr(on_meta, name).device.type == "meta" for name in ("mean", "m2_diag", "m2_cov", "amax")
    )
    assert on_meta.count == 10 and torch.equal(on_meta.cov_index, stats.cov_index)


def test_accumulated_statistics_are_merged_on_the_host():
    from loka_torchrec.probe.step_end import HOST, merged_into

    step = TensorStatistics(4)
    step.update(torch.randn(8, 4, dtype=torch.float64))
    acc = merged_into(None, step)
    assert acc.device == HOST and acc is not step
    acc = merged_into(acc, step)
    assert acc.count == 16
    assert torch.allclose(acc.mean, step.mean) and torch.allclose(acc.m2_cov, 2 * step.m2_cov)  # same rows twice


def test_uncentred_kurtosis_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(2)
    x = rng.standard_t(df=5, size=(200, 8))
    stats = TensorStatistics(8)
    stats.update(torch.from_numpy(x[:120]))
    stats.update(torch.from_numpy(x[120:]))
    # The uncentred kurtosis of x equals SciPy's (centred, Pearson) kurtosis of the data mirrored
    # around zero, whose mean is exactly zero.
    mirrored = np.concatenate([x.ravel(), -x.ravel()])
    assert stats.kurtosis() == pytest.approx(scipy_stats.kurtosis(mirrored, fisher=False), rel=1e-12)
    assert stats.mean_square() == pytest.approx((x**2).mean(), rel=1e-12)


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_underflow_fraction_equals_elements_that_quantize_to_zero(fmt, granularity):
    gen = torch.Generator().manual_seed(3)
    # log-uniform magnitudes over 12 decades: a good share underflows
    x = torch.exp(torch.empty(64, 32).uniform_(-28, 0, generator=gen)) * torch.sign(torch.randn(64, 32, generator=gen))
    x[0, :4] = 0.0  # exact zeros are not underflow
    stats = TensorStatistics(32)
    stats.update(x)
    q = quantize(x, fmt, granularity).data.float()
    expected = float(((q == 0) & (x != 0)).sum()) / x.numel()
    assert expected > 0.01
    assert stats.underflow_fraction(fmt, granularity) == pytest.approx(expected, abs=0.5 / x.numel())
    assert stats.summary()["underflow"][fmt.value][granularity] == stats.underflow_fraction(fmt, granularity)


def test_delayed_saturation_counts_what_a_stale_scale_clamps():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(50, 16, generator=gen)
    delayed_amax = 1.5
    stats = TensorStatistics(16)
    stats.update(x, delayed_amax=delayed_amax)
    fmt = Fp8Format.E4M3
    scale = torch.tensor(fmt.max / delayed_amax)
    clamped = saturated_cast(x, scale, fmt).float() / scale
    expected = float(((x * scale).abs() > fmt.max).sum()) / x.numel()
    assert expected > 0
    assert stats.saturation_fraction() == pytest.approx(expected)
    # the clamped elements are exactly those beyond the delayed amax (up to one FP8 rounding step)
    assert bool(((clamped.abs() - delayed_amax).abs() <= delayed_amax * 2**-3)[x.abs() > delayed_amax].all())


def test_nonfinite_values_are_counted_and_moments_stay_finite():
    x = torch.randn(10, 4)
    x[2, 1] = float("nan")
    x[5, 3] = float("inf")
    stats = TensorStatistics(4)
    stats.update(x)
    assert stats.summary()["nonfinite"] == 2
    assert bool(torch.isfinite(stats.covariance()).all()) and math.isfinite(float(stats.amax))


def test_covariance_cap_keeps_a_fixed_subset_and_every_variance():
    rng = np.random.default_rng(5)
    dim, cap = 40, 8
    a = TensorStatistics(dim, max_cov_dim=cap, key="layer|act")
    b = TensorStatistics(dim, max_cov_dim=cap, key="layer|act")
    assert torch.equal(a.cov_index, b.cov_index)  # same key: same subset on every rank
    assert not torch.equal(a.cov_index, covariance_subset(dim, cap, "other|act"))
    assert a.scatter_matrix().shape == (cap, cap) and not a.is_full_covariance
    x = rng.standard_normal((100, dim)) @ rng.standard_normal((dim, dim))
    a.update(torch.from_numpy(x))
    idx = a.cov_index.numpy()
    np.testing.assert_allclose(a.covariance().numpy(), np.cov(x[:, idx].T), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(a.variance().numpy(), x.var(0, ddof=1), rtol=1e-10)


def test_bad_input_is_rejected_with_the_tensor_named():
    stats = TensorStatistics(4)
    with pytest.raises(ValueError, match=r"x: expected a \(\.\.\., 4\) tensor"):
        stats.update(torch.randn(3, 5))
    with pytest.raises(TypeError, match="x: expected a floating point tensor"):
        stats.update(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="dim"):
        TensorStatistics(0)


def test_sampled_covariance_reproduces_the_learned_one_within_sampling_error():
    rng = np.random.default_rng(6)
    dim = 5
    mix = rng.standard_normal((dim, dim))
    stats = TensorStatistics(dim)
    stats.update(torch.from_numpy(rng.standard_normal((400, dim)) @ mix + 2.0))
    model = GaussianModel.from_statistics(stats)
    n = 20000
    draws = model.sample(n, make_generator("cpu", 0)).numpy()
    learned = stats.covariance().numpy()
    sampled = np.cov(draws.T)
    # Var of a sample covariance entry: (S_ij^2 + S_ii S_jj) / (n - 1); allow 5 standard errors.
    se = np.sqrt((learned**2 + np.outer(np.diag(learned), np.diag(learned))) / (n - 1))
    assert np.all(np.abs(sampled - learned) <= 5 * se)
    np.testing.assert_array_less(np.abs(draws.mean(0) - stats.mean.numpy()), 5 * np.sqrt(np.diag(learned) / n))


def test_capped_sampling_keeps_the_subset_covariance_and_other_variances():
    rng = np.random.default_rng(7)
    dim, cap, n = 12, 4, 20000
    stats = TensorStatistics(dim, max_cov_dim=cap, key="capped")
    stats.update(torch.from_numpy(rng.standard_normal((300, dim)) @ rng.standard_normal((dim, dim))))
    draws = GaussianModel.from_statistics(stats).sample(n, make_generator("cpu", 1)).numpy()
    idx = stats.cov_index.numpy()
    learned = stats.covariance().numpy()
    se = np.sqrt((learned**2 + np.outer(np.diag(learned), np.diag(learned))) / (n - 1))
    assert np.all(np.abs(np.cov(draws[:, idx].T) - learned) <= 5 * se)
    var = stats.variance().numpy()
    assert np.all(np.abs(draws.var(0, ddof=1) - var) <= 5 * var * np.sqrt(2 / (n - 1)))


def test_cholesky_jitter_on_a_singular_covariance():
    v = torch.randn(6, 2, dtype=torch.float64)
    cov = v @ v.t()  # rank 2
    factor, jitter, method = cholesky_with_jitter(cov)
    assert method == "cholesky" and jitter > 0
    torch.testing.assert_close(factor @ factor.t(), cov, atol=1e-4 * float(cov.diagonal().mean()), rtol=0)


def test_weight_model_matches_row_and_column_second_moments():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(6, 10, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 2.0, 10, dtype=torch.float64)
    w[2] *= 3.0
    ws = WeightStatistics(6, 10, ema=0.0)
    ws.update(w)
    n = 4000
    sample_gen = make_generator("cpu", 9)
    draws = torch.stack([ws.sample(sample_gen) for _ in range(n)])
    row = torch.einsum("sik,sjk->ij", draws, draws) / n
    col = torch.einsum("ski,skj->ij", draws, draws) / n
    # E[W_s W_s^T] = W W^T and E[W_s^T W_s] = W^T W; compare on the diagonals (row and column
    # norms) within 5 standard errors of a mean of n chi-square-like terms.
    for est, ref in ((row, w @ w.t()), (col, w.t() @ w)):
        d_ref = ref.diagonal()
        assert torch.all((est.diagonal() - d_ref).abs() <= 5 * d_ref * math.sqrt(2 / n))
    assert ws.amax == pytest.approx(float(w.abs().max()))
    assert ws.kurtosis == pytest.approx(float((w**4).mean() / (w**2).mean() ** 2))


def test_weight_model_ema_and_diagonal_cap():
    ws = WeightStatistics(4, 3, ema=0.5, max_cov_dim=3)
    ws.update(torch.ones(4, 3))
    ws.update(3 * torch.ones(4, 3))
    assert ws.row_factor.shape == (4,)  # 4 > max_cov_dim: diagonal
    assert ws.col_factor.shape == (3, 3)
    assert ws.sigma2 == pytest.approx(0.5 * 1 + 0.5 * 9)
    with pytest.raises(ValueError, match="weight: expected shape"):
        ws.update(torch.ones(3, 4))


def test_the_weight_model_is_kept_on_the_host_and_sampled_from_a_copy_on_the_device():
    ws = WeightStatistics(6, 5)
    ws.update(torch.randn(6, 5))
    assert ws.row_factor.device == HOST and ws.col_factor.device == HOST
    before = ws.sample(torch.Generator().manual_seed(0))
    roots = ws._roots
    copy = ws.on("cpu")
    assert copy._roots is None and ws._roots is roots  # the copy factorizes its own; the original keeps its cache
    torch.testing.assert_close(copy.sample(torch.Generator().manual_seed(0)), before, rtol=0, atol=0)  # same draws
    copy.amax_history.append(99.0)
    assert 99.0 not in ws.amax_history  # an independent history
    on_meta = ws.on("meta")
    assert on_meta.row_factor.device.type == "meta" and ws.row_factor.device == HOST


def test_monitoring_updates_skip_moments_but_keep_amax_kurtosis_and_fractions():
    x = torch.randn(30, 6, dtype=torch.float64)
    full, light = TensorStatistics(6), TensorStatistics(6)
    full.update(x)
    light.update(x, moments=False)
    assert light.count == 0 and light.light_rows == 30 and light.rows == full.rows == 30
    assert light.is_empty and light.m2_cov is None and float(light.scatter_matrix().abs().sum()) == 0.0
    assert light.kurtosis() == pytest.approx(full.kurtosis(), rel=1e-14)
    assert float(light.amax) == float(full.amax)
    assert light.summary()["rows"] == 30 and light.summary()["moment_rows"] == 0
    digest = full.summary()
    assert digest["kurtosis"] == full.kurtosis() and digest["mean_sq"] == full.mean_square()
    assert digest["std_mean"] == pytest.approx(float(x.std(dim=0).mean()), rel=1e-12)
    assert digest["mean_norm"] == pytest.approx(float(x.mean(dim=0).norm()), rel=1e-12)


def test_underflow_counts_do_not_depend_on_the_comparison_chunking(monkeypatch):
    """The batched (format x granularity) comparison is chunked by rows to bound memory; counts are exact either way."""
    import loka_torchrec.probe.statistics as statistics_module

    torch.manual_seed(4)
    x = torch.randn(300, 40) * torch.exp(6 * torch.randn(300, 40))
    whole = TensorStatistics(40)
    whole.update(x)
    monkeypatch.setattr(statistics_module, "_UNDERFLOW_CHUNK", 4 * 40 * 7)  # 7 rows per comparison
    chunked = TensorStatistics(40)
    chunked.update(x)
    assert torch.equal(whole.underflow, chunked.underflow) and whole.underflow.sum() > 0


def test_update_in_row_blocks_equals_one_pass(monkeypatch):
    """update() works on bounded row blocks (its temporaries stay small at LRM shapes): the counts,
    amax and nonfinite tally are exact and the sums equal to float64 rounding, whatever the blocks."""
    import loka_torchrec.probe.statistics as statistics_module

    torch.manual_seed(5)
    x = torch.randn(301, 40) * torch.exp(6 * torch.randn(301, 40))
    x[17, 3], x[250, 0], x[120, :] = float("nan"), float("-inf"), 0.0
    whole = TensorStatistics(40)
    whole.update(x, delayed_amax=1.0)
    monkeypatch.setattr(statistics_module, "_PASS_ELEMENTS", 40 * 23)  # 23 rows per block, 14 blocks
    blocked = TensorStatistics(40)
    blocked.update(x, delayed_amax=1.0)
    for name in ("amax", "underflow", "below_floor", "nonfinite", "saturation"):
        assert torch.equal(torch.as_tensor(getattr(whole, name)), torch.as_tensor(getattr(blocked, name))), name
    assert int(whole.nonfinite) == 2 and whole.underflow.sum() > 0
    for name in ("sum_sq", "sum_4th", "sum_row_ms_sq"):
        torch.testing.assert_close(getattr(blocked, name), getattr(whole, name), rtol=1e-12, atol=0)
    torch.testing.assert_close(blocked.covariance(), whole.covariance(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_groups_below_the_scaling_floor_are_counted_and_their_flushes_are_underflow(fmt, granularity):
    # Rows 0-1 have amax 1e-14 and 1e-16, below the 1e-12 floor that amax_to_scale clamps to:
    # their small values flush to 0 in FP8 (nn.Linear keeps them). Row 3 is all zero (amax 0: not
    # below the floor). The other rows are O(1) or tiny-scaled copies.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    x[0] = torch.logspace(-14, -24, 16, dtype=torch.float64)
    x[1] = torch.logspace(-16, -20, 16, dtype=torch.float64)
    x[3] = 0.0
    for tiny_only in (False, True):
        data = x[:3].clone() if tiny_only else x.clone()
        if tiny_only:
            data[2] = 1e-13  # the whole tensor is below the floor: tensorwise counts every nonzero element
        stats = TensorStatistics(16)
        stats.update(data)
        q = quantize(data, fmt, granularity).data.float()
        flushed = float(((q == 0) & (data != 0)).sum()) / data.numel()
        assert flushed > 0
        assert stats.underflow_fraction(fmt, granularity) == pytest.approx(flushed, abs=0.5 / data.numel())
        if granularity == "rowwise" or tiny_only:
            expected_floor = 1.0 if tiny_only else 2 * 16 / data.numel()
        else:
            expected_floor = 0.0  # the tensor's amax is O(1): one group, above the floor
        assert stats.below_floor_fraction(granularity) == pytest.approx(expected_floor)
        assert stats.summary()["below_floor"][granularity] == pytest.approx(expected_floor)
        merged = stats.clone().merge(stats)  # counts add with the rows
        assert merged.below_floor_fraction(granularity) == pytest.approx(expected_floor)


def test_statistics_pickled_without_the_floor_count_load_with_none():
    import pickle

    stats = TensorStatistics(4)
    stats.update(torch.ones(2, 4))
    state = stats.__dict__.copy()
    del state["below_floor"]
    old = TensorStatistics.__new__(TensorStatistics)
    old.__setstate__(state)
    assert old.summary()["below_floor"] == {"tensorwise": 0.0, "rowwise": 0.0}
    assert pickle.loads(pickle.dumps(stats)).below_floor_fraction("rowwise") == 0.0
