"""NE and AUC against float64 / pairwise references, exact merges over 2 gloo ranks, step timing."""

import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

import loka_job.training.metrics as metrics_module
from loka_job.training.metrics import (
    BinaryClassificationMetrics,
    StepTimer,
    binary_entropy,
    normalized_entropy,
)
from multirank import spawn_ranks

WORLD = 2


def _ne_reference(logits: np.ndarray, labels: np.ndarray) -> float:
    """NE from the textbook formula in float64."""
    z, y = logits.astype(np.float64), labels.astype(np.float64)
    p = 1.0 / (1.0 + np.exp(-z))
    log_loss = -(y * np.log(p) + (1 - y) * np.log(1 - p))
    rate = y.mean()
    return log_loss.mean() / -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))


def _auc_reference(scores: np.ndarray, labels: np.ndarray) -> float:
    """Probability that a random positive outscores a random negative, ties counting one half."""
    pos, neg = scores[labels == 1][:, None], scores[labels == 0][None, :]
    return ((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size)


def _random_batches(seed: int, sizes, ties: bool = False):
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        labels = (rng.random(n) < 0.3).astype(np.float32)
        logits = rng.normal(size=n) + 1.2 * labels - 0.8  # informative, not separable
        if ties:
            logits = np.round(logits, 1)  # many equal scores exercise the tie handling
        out.append((torch.from_numpy(logits.astype(np.float32)), torch.from_numpy(labels)))
    return out


def _fill(batches) -> BinaryClassificationMetrics:
    m = BinaryClassificationMetrics("cpu")
    for logits, labels in batches:
        m.update(logits, labels)
    return m


def test_ne_auc_loss_match_float64_references():
    batches = _random_batches(0, [17, 1, 200, 64], ties=True)
    got = _fill(batches).compute()
    logits = np.concatenate([b[0].numpy() for b in batches])
    labels = np.concatenate([b[1].numpy() for b in batches])
    assert got["count"] == logits.size
    assert got["positive_rate"] == pytest.approx(labels.mean(), rel=1e-12)
    assert got["ne"] == pytest.approx(_ne_reference(logits, labels), rel=1e-12)
    # torchmetrics turns the exact integer ROC counts into rates in float32.
    assert got["auc"] == pytest.approx(_auc_reference(logits, labels), rel=1e-6)
    z, y = logits.astype(np.float64), labels.astype(np.float64)
    assert got["loss"] == pytest.approx(np.mean(np.logaddexp(0, z) - y * z), rel=1e-12)
    assert normalized_entropy(torch.from_numpy(logits), torch.from_numpy(labels)) == pytest.approx(got["ne"], rel=1e-12)


def test_logits_are_kept_as_a_copy():
    """A compiled model under CUDA graphs hands back logits that its next replay overwrites in place:
    what was added must not change with the caller's tensor."""
    batches = _random_batches(3, [50, 80])
    expected = _fill(batches).compute()
    m = BinaryClassificationMetrics("cpu")
    for logits, labels in batches:
        reused = logits.clone()
        m.update(reused, labels)
        reused.fill_(-30.0)  # the buffer reused by the next step
    got = m.compute()
    assert got["auc"] == pytest.approx(expected["auc"], rel=1e-12)
    assert got["ne"] == pytest.approx(expected["ne"], rel=1e-12)


def test_perfect_and_constant_predictors():
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    perfect = _fill([(torch.where(labels > 0, 30.0, -30.0), labels)]).compute()
    assert perfect["auc"] == 1.0 and 0.0 <= perfect["ne"] < 1e-10
    rate = labels.mean().item()
    base = _fill([(torch.full((8,), math.log(rate / (1 - rate))), labels)]).compute()
    assert base["ne"] == pytest.approx(1.0, rel=1e-12)  # predicting the base rate is the NE unit
    assert base["auc"] == pytest.approx(0.5, rel=1e-12)  # all scores tied
    assert base["loss"] == pytest.approx(binary_entropy(rate), rel=1e-12)
    off = _fill([(torch.zeros(8), labels)]).compute()  # always 0.5: worse than the base rate
    assert off["ne"] == pytest.approx(math.log(2) / binary_entropy(rate), rel=1e-12) and off["ne"] > 1.0
    inverted = _fill([(torch.where(labels > 0, -3.0, 3.0), labels)]).compute()
    assert inverted["auc"] == 0.0


def test_large_logits_keep_their_order():
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    # float32 sigmoid rounds all of these to 1.0; the AUC must still see 40 > 30 > 20 > 10.
    got = _fill([(torch.tensor([40.0, 30.0, 20.0, 10.0]), labels)]).compute()
    assert got["auc"] == pytest.approx(_auc_reference(np.array([40.0, 30, 20, 10]), labels.numpy()))


def test_reset_and_degenerate_windows():
    m = _fill(_random_batches(1, [50]))
    m.reset()
    empty = m.compute()
    assert empty["count"] == 0.0 and all(math.isnan(empty[k]) for k in ("ne", "auc", "loss", "positive_rate"))
    m.update(torch.randn(5, 1), torch.zeros(5, 1))  # (B, 1) is accepted; one class only
    one_class = m.compute()
    assert one_class["count"] == 5.0 and one_class["positive_rate"] == 0.0
    assert math.isnan(one_class["ne"]) and math.isnan(one_class["auc"]) and one_class["loss"] > 0


@pytest.mark.parametrize(
    "logits, labels, error, match",
    [
        (torch.zeros(4), torch.zeros(5), ValueError, "same number of elements"),
        (torch.zeros(4, 2), torch.zeros(8), ValueError, r"logits must have shape \(N,\) or \(N, 1\)"),
        (torch.zeros(4, dtype=torch.long), torch.zeros(4), TypeError, "logits must be a floating-point"),
        (torch.zeros(3), torch.tensor([0.0, 1.0, 0.5]), ValueError, "labels must be 0 or 1"),
        ([0.0], torch.zeros(1), TypeError, "logits and labels must be tensors"),
    ],
)
def test_bad_input_is_refused(logits, labels, error, match):
    with pytest.raises(error, match=match):
        BinaryClassificationMetrics("cpu").update(logits, labels)


def test_step_timer_window_median_p90_and_qps(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 4.0, 100.0, 104.0, 105.0, 106.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    timer = StepTimer(global_batch_size=100, window=3)
    assert math.isnan(timer.stats()["qps"])
    for _ in range(4):
        timer.tick()  # steps of 1, 2, 1 s
    timer.restart()  # t = 100: eval time is not a step
    for _ in range(3):
        timer.tick()  # steps of 4, 1, 1 s; the window keeps the last 3
    stats = timer.stats()
    assert stats["steps"] == 3.0
    assert stats["step_time_ms_median"] == pytest.approx(1000.0)
    assert stats["step_time_ms_p90"] == pytest.approx(4000.0)
    assert stats["qps"] == pytest.approx(300 / 6.0)


@pytest.mark.parametrize("kwargs, match", [(dict(global_batch_size=0), "global_batch_size"),
                                           (dict(global_batch_size=8, window=0), "window")])
def test_step_timer_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepTimer(**kwargs)


# ---------------------------------------------------------------------------- 2 gloo ranks
_RANK_SIZES = {0: [40, 3, 120], 1: [7, 90]}


def _merge_worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        local = _random_batches(10 + rank, _RANK_SIZES[rank], ties=True)
        metrics = _fill(local)
        merged = metrics.compute()
        # The reference: one process over the union of both ranks' samples (rebuilt from the seeds).
        union = [b for r in range(WORLD) for b in _random_batches(10 + r, _RANK_SIZES[r], ties=True)]
        single = _fill(union).compute(sync=False)
        assert merged["count"] == single["count"] == sum(sum(s) for s in _RANK_SIZES.values())
        for key in ("ne", "auc", "loss", "positive_rate"):
            assert merged[key] == pytest.approx(single[key], rel=1e-12, abs=1e-15), key
        assert metrics.compute(sync=False)["count"] == sum(_RANK_SIZES[rank])  # the local view is kept
        # A rank without samples still takes part and gets the other rank's metrics.
        sparse = BinaryClassificationMetrics("cpu")
        if rank == 1:
            for logits, labels in local:
                sparse.update(logits, labels)
        only_rank1 = sparse.compute()
        reference = _fill(_random_batches(11, _RANK_SIZES[1], ties=True)).compute(sync=False)
        for key in ("ne", "auc", "count"):
            assert only_rank1[key] == pytest.approx(reference[key], rel=1e-12), key
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_merge_to_the_single_process_metrics():
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_merge_worker, (os.path.join(tmp, "store"),), nprocs=WORLD)


@pytest.mark.gpu
def test_cuda_metrics_match_cpu():
    batches = _random_batches(3, [100, 37], ties=True)
    cpu = _fill(batches).compute()
    gpu = BinaryClassificationMetrics("cuda")
    for logits, labels in batches:
        gpu.update(logits.cuda(), labels.cuda())
    got = gpu.compute()
    for key in ("ne", "auc", "loss", "positive_rate", "count"):
        assert got[key] == pytest.approx(cpu[key], rel=1e-9), key


@pytest.mark.gpu
def test_cuda_bad_labels_are_counted_and_refused_at_compute():
    """On a GPU the label check costs no host synchronization per update: bad labels are counted
    on the device, and compute() refuses them (after a reset the window is clean again)."""
    m = BinaryClassificationMetrics("cuda")
    m.update(torch.zeros(4, device="cuda"), torch.tensor([0.0, 1.0, 0.5, 2.0], device="cuda"))  # no error yet
    with pytest.raises(ValueError, match="labels must be 0 or 1: 2 label"):
        m.compute()
    m.reset()
    m.update(torch.zeros(2, device="cuda"), torch.tensor([0.0, 1.0], device="cuda"))
    assert m.compute()["count"] == 2.0
