"""Probe error quantification and speed: intervals, CI coverage, FP8 error bounds, timings."""

import math

import numpy as np
import pytest
import torch

from loka_torchrec.evidence import BF16, GemmRole, GemmShape, KernelChoice
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.evaluate import choose_error, evaluate_layer
from loka_torchrec.gemm.intervals import iqr_interval, t_interval, t_quantile_975
from loka_torchrec.probe.quantify import CandidateError, LayerSnapshot, quantify_errors, reference_gemm, sampling_noise_power
from loka_torchrec.probe.reservoir import RowReservoir
from loka_torchrec.gemm.speed import SpeedCache, time_gemm
from loka_torchrec.probe.statistics import TensorStatistics
from loka_torchrec.probe.weight_statistics import WeightStatistics

EMU_TW = KernelChoice("emulated", "tensorwise")
EMU_RW = KernelChoice("emulated", "rowwise")
SMM_RW = KernelChoice("scaled_mm", "rowwise")


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _snapshot(*, in_features=32, out_features=16, rows=64, act_shift=0.0, weight=None, reservoir=True, grads=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = weight if weight is not None else torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)
    act, grad = TensorStatistics(in_features), TensorStatistics(out_features)
    res = RowReservoir(in_features, out_features, capacity=256) if reservoir else None
    ws = WeightStatistics(out_features, in_features)
    ws.update(w)
    for _ in range(4):
        x = torch.randn(rows, in_features, generator=gen) + act_shift
        dy = torch.randn(rows, out_features, generator=gen) * 1e-3
        act.update(x)
        if grads:
            grad.update(dy)
        if res is not None:
            token = res.offer_inputs(x)
            if grads:
                res.offer_grads(token, dy)
    return LayerSnapshot("layer", w, act, grad, ws, res, rows)


def test_t_quantiles_match_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 19, 30, 31, 60, 99, 1000):
        assert t_quantile_975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=2e-4)


def test_iqr_interval_is_median_and_quartiles():
    iv = iqr_interval([5.0, 1.0, 3.0, 2.0, 4.0, 100.0, 3.5])
    assert (iv.value, iv.low, iv.high, iv.n, iv.method) == (3.5, 2.5, 4.5, 7, "iqr")
    assert t_interval([2.0]).method == "none" and math.isinf(t_interval([1.0, math.inf]).value)


def test_t_interval_covers_a_known_mean_at_the_stated_rate():
    # Exponential draws (skewed, like per-draw errors) with true mean 1: 400 seeded trials of 30 draws.
    rng = np.random.default_rng(0)
    trials = 400
    hits = 0
    for _ in range(trials):
        iv = t_interval(rng.exponential(1.0, 30))
        hits += iv.low <= 1.0 <= iv.high
    rate = hits / trials
    # 95% nominal; the t interval undercovers slightly for skewed data at n=30 (about 93%).
    assert 0.89 <= rate <= 0.99, rate


def test_mere_interval_covers_the_ground_truth_at_about_the_stated_rate():
    snap = _snapshot(in_features=16, out_features=8, rows=32, reservoir=False)
    candidates = {GemmRole.FORWARD: [EMU_TW]}
    # ground truth: the mean MERE over many draws (a different seed from the trials)
    truth = quantify_errors(snap, candidates, samples=1500, seed=10_000)[(GemmRole.FORWARD, EMU_TW)].gaussian
    trials = 60
    hits = 0
    for seed in range(trials):
        iv = quantify_errors(snap, candidates, samples=12, seed=seed)[(GemmRole.FORWARD, EMU_TW)].gaussian
        assert iv.method == "t95" and iv.n == 12
        hits += iv.low <= truth.value <= iv.high
    # 95% nominal: with 60 trials, 0.83 is 3.5 binomial standard errors below 0.95
    assert hits / trials >= 0.83, (hits, truth)
    assert truth.high - truth.low < 0.1 * truth.value


def test_errors_respect_the_e4m3_bound_on_positive_data():
    # All-positive operands: no cancellation, so every output element's relative error is at most
    # the two operands' rounding, (1 + u)^2 - 1 with u = 2**-4 for E4M3.
    u = Fp8Format.E4M3.unit_roundoff
    w = torch.rand(16, 32, generator=torch.Generator().manual_seed(1)) + 0.5
    snap = _snapshot(weight=w, act_shift=6.0)
    res = quantify_errors(snap, {GemmRole.FORWARD: [BF16, EMU_TW, EMU_RW, SMM_RW]}, samples=6)
    bound = (1 + u) ** 2 - 1
    for choice in (EMU_TW, EMU_RW, SMM_RW):
        err = res[(GemmRole.FORWARD, choice)]
        assert 0 < err.gaussian.value <= bound and err.gaussian.high <= bound
        assert err.captured is not None and 0 < err.captured.value <= bound
        assert err.weight_model is not None  # weights drawn from the weight model too
        assert err.gaussian_sqnr.value > 20.0  # E4M3 with per-element error <= 2u: SQNR well above 20 dB
    # the fp32 baseline on the CPU is essentially exact against the float64 reference
    assert res[(GemmRole.FORWARD, BF16)].gaussian.value < 1e-5


def _correlated_rows(n, gen, in_features=6, out_features=4):
    """Rows whose gradient has a nonzero mean (dy depends on x) and a spread around it."""
    x = torch.randn(n, in_features, generator=gen, dtype=torch.float64) + 2.0
    dy = 0.8 * x[:, :out_features] + 0.3 * torch.randn(n, out_features, generator=gen, dtype=torch.float64)
    return x, dy


def test_sampling_noise_power_matches_the_spread_of_fresh_batches():
    # Truth: the spread of G = dy^T x over 3000 fresh batches of 32 rows from the same distribution.
    gen = torch.Generator().manual_seed(3)
    grads = []
    for _ in range(3000):
        x, dy = _correlated_rows(32, gen)
        grads.append(dy.t() @ x)
    g = torch.stack(grads)
    truth = float(((g - g.mean(0)) ** 2).sum((1, 2)).mean())
    x, dy = _correlated_rows(20_000, gen)
    estimate = sampling_noise_power(x, dy, rows=32)
    assert estimate == pytest.approx(truth, rel=0.08)
    # The mean outer product is subtracted: without it the estimate would be far larger.
    no_mean = 32 * float((x.square().sum(1) * dy.square().sum(1)).mean())
    assert no_mean > 1.5 * estimate
    with pytest.raises(ValueError, match="dy: expected 20000 rows"):
        sampling_noise_power(x, dy[:10], rows=32)
    with pytest.raises(ValueError, match="x: expected at least 2 rows"):
        sampling_noise_power(x[:1], dy[:1], rows=32)


def _snapshot_with_rows(x, dy):
    res = RowReservoir(x.shape[1], dy.shape[1], capacity=x.shape[0])
    act, grad = TensorStatistics(x.shape[1]), TensorStatistics(dy.shape[1])
    act.update(x), grad.update(dy)
    res.offer_grads(res.offer_inputs(x), dy)
    w = torch.randn(dy.shape[1], x.shape[1], generator=torch.Generator().manual_seed(5)) / math.sqrt(x.shape[1])
    return LayerSnapshot("layer", w, act, grad, None, res, x.shape[0])


def test_grad_weight_noise_is_measured_against_the_gradients_sampling_noise():
    gen = torch.Generator().manual_seed(4)
    roles = {role: [EMU_TW] for role in GemmRole}
    # Rows that differ (independent Gaussians): E4M3's error is a small fraction of the sampling noise.
    x, dy = torch.randn(256, 32, generator=gen), torch.randn(256, 16, generator=gen)
    res = quantify_errors(_snapshot_with_rows(x, dy), roles, samples=4)
    ratio = res[(GemmRole.GRAD_WEIGHT, EMU_TW)].captured_noise_ratio
    assert ratio is not None and ratio.n == 4 and 0 < ratio.value < 0.02
    assert res[(GemmRole.FORWARD, EMU_TW)].captured_noise_ratio is None
    assert res[(GemmRole.GRAD_INPUT, EMU_TW)].captured_noise_ratio is None
    assert res[(GemmRole.GRAD_WEIGHT, EMU_TW)].to_dict()["captured_noise_ratio"]["n"] == 4
    # Rows that are almost the same row: the batch barely changes the gradient, and the same
    # rounding error is now large next to that sampling noise.
    x0, dy0 = torch.randn(1, 32, generator=gen), torch.randn(1, 16, generator=gen)
    x_same = x0 + 1e-3 * torch.randn(256, 32, generator=gen)
    dy_same = dy0 + 1e-3 * torch.randn(256, 16, generator=gen)
    same = quantify_errors(_snapshot_with_rows(x_same, dy_same), roles, samples=4)[(GemmRole.GRAD_WEIGHT, EMU_TW)]
    assert same.captured_noise_ratio.value > 1.0
    # The evidence carries it (grad-weight only), with the Gaussian MERE as its error.
    config = ProbeConfig(samples=4, speed_reps=2)
    evidence, _ = evaluate_layer(_snapshot_with_rows(x, dy), roles, config=config, speed_cache=SpeedCache(reps=2))
    by_role = {ev.role: ev for ev in evidence}
    assert by_role[GemmRole.GRAD_WEIGHT].noise_ratio.value == pytest.approx(ratio.value)
    assert "captured rows by their noise ratio" in by_role[GemmRole.GRAD_WEIGHT].note
    assert by_role[GemmRole.FORWARD].noise_ratio is None and by_role[GemmRole.GRAD_INPUT].noise_ratio is None


def test_captured_chunks_stay_inside_one_batch():
    # Two steps whose rows contribute alike to the weight gradient (dy * x of the same size) but
    # with operands 1e5 apart: dy large and x small in the first, the other way round in the second.
    gen = torch.Generator().manual_seed(6)
    x_a, dy_a = 1e-2 * torch.randn(128, 32, generator=gen), 1e2 * torch.randn(128, 16, generator=gen)
    x_b, dy_b = 1e3 * torch.randn(128, 32, generator=gen), 1e-3 * torch.randn(128, 16, generator=gen)
    w = torch.randn(16, 32, generator=gen)

    def captured_wgrad_error(batches):
        res = RowReservoir(32, 16, capacity=256)
        act, grad = TensorStatistics(32), TensorStatistics(16)
        for x, dy in batches:
            act.update(x), grad.update(dy)
            res.offer_grads(res.offer_inputs(x), dy)
        snap = LayerSnapshot("layer", w, act, grad, None, res, 256)
        return quantify_errors(snap, {GemmRole.GRAD_WEIGHT: [EMU_TW]}, samples=4)[(GemmRole.GRAD_WEIGHT, EMU_TW)].captured

    per_batch = captured_wgrad_error([(x_a, dy_a), (x_b, dy_b)])
    assert per_batch.n == 4 and per_batch.value < 0.15  # E4M3's own error: each chunk's rows share a scale that fits them
    # The same rows offered as one batch: chunks mix the two steps, and one tensorwise scale flushes
    # the small operand of each, an error no training GEMM has.
    order = torch.randperm(256, generator=gen)
    mixed = captured_wgrad_error([(torch.cat([x_a, x_b])[order], torch.cat([dy_a, dy_b])[order])])
    assert mixed.value > 0.5


def test_every_role_gets_measured_and_missing_gradients_are_explained():
    snap = _snapshot()
    roles = {role: [EMU_RW, KernelChoice("scaled_mm", "blockwise"), KernelChoice("nope", "x")] for role in GemmRole}
    res = quantify_errors(snap, roles, samples=3)
    for role in GemmRole:
        assert res[(role, EMU_RW)].available and res[(role, EMU_RW)].gaussian.value > 0
        assert res[(role, KernelChoice("scaled_mm", "blockwise"))].note.startswith("unavailable: scaled_mm has no recipe")
        assert "unknown GEMM backend 'nope'" in res[(role, KernelChoice("nope", "x"))].note
    assert res[(GemmRole.GRAD_WEIGHT, EMU_RW)].weight_model is None  # wgrad reads no weight
    no_grad = quantify_errors(_snapshot(grads=False), roles, samples=3)
    assert no_grad[(GemmRole.FORWARD, EMU_RW)].available
    assert "no output gradients" in no_grad[(GemmRole.GRAD_INPUT, EMU_RW)].note


def test_same_seed_same_draws():
    snap = _snapshot()
    a = quantify_errors(snap, {GemmRole.FORWARD: [EMU_TW]}, samples=4, seed=3)
    b = quantify_errors(snap, {GemmRole.FORWARD: [EMU_TW]}, samples=4, seed=3)
    assert a[(GemmRole.FORWARD, EMU_TW)].gaussian == b[(GemmRole.FORWARD, EMU_TW)].gaussian


def test_quantify_rejects_bad_arguments():
    with pytest.raises(ValueError, match="samples"):
        quantify_errors(_snapshot(), {GemmRole.FORWARD: [EMU_TW]}, samples=1)
    empty = _snapshot()
    empty.act = TensorStatistics(32)
    with pytest.raises(ValueError, match="no input rows"):
        quantify_errors(empty, {GemmRole.FORWARD: [EMU_TW]}, samples=2)


def test_padded_candidate_equals_the_unpadded_one():
    # On CUDA scaled_mm needs K and N in multiples of 16; the Probe pads as LokaLinear does.
    from loka_torchrec.gemm.recipes import recipe_for
    from loka_torchrec.gemm.candidates import CandidateRun, resolve_candidate

    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(24, 20, generator=gen), torch.randn(10, 20, generator=gen)
    for recipe in ("tensorwise", "rowwise"):
        plain = CandidateRun(KernelChoice("emulated", recipe), recipe_for(recipe, GemmRole.FORWARD))
        padded = CandidateRun(plain.choice, plain.recipe, align=16)
        out = padded.gemm(a, b, torch.float32)
        assert out.shape == (24, 10)
        torch.testing.assert_close(out, plain.gemm(a, b, torch.float32), rtol=1e-6, atol=1e-6)
    run = resolve_candidate(SMM_RW, GemmRole.GRAD_INPUT, GemmShape(24, 10, 20), "cpu", grad_format="e5m2")
    assert run.align == 1 and run.recipe.a.fmt == Fp8Format.E5M2  # dgrad's A is the gradient
    assert "unknown GEMM backend" in resolve_candidate(KernelChoice("nope", "x"), GemmRole.FORWARD, GemmShape(1, 1, 1), "cpu")


def test_reference_is_float64_on_cpu():
    a, b = torch.randn(4, 8), torch.randn(3, 8)
    assert reference_gemm(a, b).dtype == torch.float64


def test_choose_error_basis():
    from loka_torchrec.evidence import Interval

    g, c = Interval(0.1, 0.09, 0.11, 8, "t95"), Interval(0.2, 0.15, 0.25, 8, "t95")
    err = CandidateError(gaussian=g, gaussian_sqnr=g, captured=c, captured_sqnr=c)
    assert choose_error(err, "gaussian")[0] == g
    assert choose_error(err, "captured")[0] == c
    assert choose_error(err, "max")[0] == c
    assert choose_error(CandidateError(gaussian=g, gaussian_sqnr=g), "max")[0] == g
    # A grad-weight GEMM's real rows with a noise ratio: "max" takes the Gaussian MERE (the ratio is
    # the real rows' evidence, gated by Dispatch); an explicit "captured" still takes theirs.
    noisy = CandidateError(gaussian=g, gaussian_sqnr=g, captured=c, captured_sqnr=c, captured_noise_ratio=g)
    assert choose_error(noisy, "max")[0] == g
    assert choose_error(noisy, "captured")[0] == c


def test_time_gemm_and_cache():
    iv = time_gemm(SMM_RW, GemmRole.FORWARD, GemmShape(32, 16, 8), dtype=torch.float32, device="cpu", reps=3)
    assert iv.n == 3 and iv.method == "iqr" and 0 < iv.low <= iv.value <= iv.high
    cache = SpeedCache(reps=2)
    first = cache.time(BF16, GemmRole.FORWARD, GemmShape(16, 8, 8), dtype=torch.float32, device=torch.device("cpu"))
    again = cache.time(BF16, GemmRole.GRAD_INPUT, GemmShape(16, 8, 8), dtype=torch.float32, device=torch.device("cpu"))
    assert first is again  # same kernel, same shape: timed once
    failed = cache.time(KernelChoice("scaled_mm", "blockwise"), GemmRole.FORWARD, GemmShape(16, 8, 8), dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(failed, str) and "blockwise" in failed
    with pytest.raises(ValueError, match="reps"):
        time_gemm(BF16, GemmRole.FORWARD, GemmShape(2, 2, 2), dtype=torch.float32, device="cpu", reps=0)


def test_evaluate_layer_builds_evidence_for_dispatch():
    snap = _snapshot(rows=300)
    cfg = ProbeConfig(samples=3, speed_reps=2, max_rows_per_step=64)
    roles = {role: [BF16, SMM_RW, KernelChoice("scaled_mm", "blockwise")] for role in GemmRole}
    evidence, details = evaluate_layer(snap, roles, config=cfg, speed_cache=SpeedCache(reps=2))
    assert len(evidence) == len(details) == 9
    by_key = {(ev.role, ev.candidate): ev for ev in evidence}
    fwd = by_key[(GemmRole.FORWARD, SMM_RW)]
    assert fwd.source == "probe" and fwd.device == "cpu"
    assert fwd.shape == GemmShape(300, 32, 16)  # the real shape, even though timing used M = 64
    assert "timed at M=64" in fwd.note and "error: " in fwd.note
    assert math.isfinite(fwd.time_ms.value) and math.isfinite(fwd.baseline_time_ms.value)
    assert by_key[(GemmRole.GRAD_WEIGHT, SMM_RW)].shape == GemmShape(16, 300, 32)
    blocked = by_key[(GemmRole.FORWARD, KernelChoice("scaled_mm", "blockwise"))]
    assert math.isinf(blocked.error.value) and blocked.note.startswith("unavailable")
    assert blocked.speedup == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_reference_is_fp32_without_tf32_and_timing_uses_events():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    a = torch.randn(64, 256, device="cuda")
    b = torch.randn(32, 256, device="cuda")
    try:
        ref = reference_gemm(a, b)
        assert ref.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32  # restored afterwards
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    torch.testing.assert_close(ref.double(), a.double() @ b.double().t(), rtol=1e-5, atol=1e-4)
    iv = time_gemm(BF16, GemmRole.FORWARD, GemmShape(1024, 256, 256), dtype=torch.bfloat16, device="cuda", reps=10)
    assert iv.n == 10 and iv.value > 0
    snap = _snapshot()
    snap.weight = snap.weight.cuda()
    snap.act.to("cuda")
    snap.grad.to("cuda")
    res = quantify_errors(snap, {GemmRole.FORWARD: [SMM_RW]}, samples=4, dtype=torch.bfloat16)
    assert 0 < res[(GemmRole.FORWARD, SMM_RW)].gaussian.value < 0.5


def test_error_draws_capped_at_the_cuda_default_rows_measure_the_full_rows_error():
    # FP8's relative error per output element does not depend on how many rows a draw has once
    # rowwise scales see enough of them: at the CUDA default (2048 rows) every role's MERE is
    # within 3% of the 8192-row value (measured: under 1%). Far fewer rows do show a bias in
    # wgrad, whose reduction runs over the rows (128 rows: about -5%).
    snap = _snapshot(in_features=64, out_features=32, rows=8192)
    roles = {role: [EMU_TW, EMU_RW] for role in GemmRole}
    capped_rows = ProbeConfig().resolved_error_rows("cuda")
    assert capped_rows == 2048
    full = quantify_errors(snap, roles, samples=8, max_rows=8192)
    capped = quantify_errors(snap, roles, samples=8, max_rows=capped_rows)
    for key, err in full.items():
        assert capped[key].gaussian.value == pytest.approx(err.gaussian.value, rel=0.03), key


def test_error_rows_resolution_and_the_evaluation_clock():
    assert ProbeConfig().resolved_error_rows("cpu") == 128
    assert ProbeConfig(max_rows_per_step=64).resolved_error_rows("cuda") == 64  # the older knob caps both
    assert ProbeConfig(max_rows_per_step=64, error_rows=512).resolved_error_rows("cuda") == 512
    seconds = {}
    evaluate_layer(_snapshot(rows=300), {GemmRole.FORWARD: [BF16, SMM_RW]}, config=ProbeConfig(samples=2, speed_reps=2),
                   speed_cache=SpeedCache(reps=2), seconds=seconds)  # fmt: skip
    assert set(seconds) == {"error", "speed"} and all(v > 0 for v in seconds.values())


@pytest.mark.parametrize("where", ["weight", "act"])
def test_statistics_with_inf_or_nan_give_no_error_numbers(where):
    """Non-finite statistics measure nothing: every candidate is unavailable, and says why."""
    snap = _snapshot()
    if where == "weight":
        snap.weight[0, 0] = float("inf")
    else:
        snap.act.update(torch.full((4, snap.in_features), float("nan")))
    errors = quantify_errors(snap, {GemmRole.FORWARD: [KernelChoice("emulated", "rowwise")]}, samples=3)
    (err,) = errors.values()
    assert not err.available and "non-finite statistics" in err.note and math.isinf(err.gaussian.high)


def test_a_reservoir_saved_before_batches_were_kept_loads_as_one_batch(tmp_path):
    res = RowReservoir(4, 2, capacity=8)
    for _ in range(3):
        res.offer_grads(res.offer_inputs(torch.randn(4, 4)), torch.randn(4, 2))
    assert len(res.by_batch(with_grads=True)) >= 2  # 8 slots for 12 rows of three batches
    old = res.__dict__.copy()
    del old["batch"], old["offers"]
    restored = RowReservoir.__new__(RowReservoir)
    restored.__setstate__(old)
    groups = restored.by_batch(with_grads=True)
    assert len(groups) == 1 and groups[0][0].shape == (8, 4)
    restored.offer_inputs(torch.randn(2, 4))  # offers go on from there
    assert restored.offers == 2
