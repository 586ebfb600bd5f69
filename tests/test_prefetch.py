"""Train batches from loader workers: the same batches, in the same order, as made in the loop."""

import itertools

import pytest
import torch

from loka_job.training.prefetch import resolve_workers, reused_batches, train_batches
from loka_job.training.synthetic import SyntheticConfig, SyntheticRecDataset
from loka_job.training.synthetic_sequences import SyntheticSequenceConfig, SyntheticSequenceDataset
from loka_job.training.trainer import TrainConfig


def _same_batch(a, b) -> bool:
    ka, kb = a.sparse_features, b.sparse_features
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and ka.keys() == kb.keys()
        and torch.equal(ka.values(), kb.values())
        and torch.equal(ka.lengths(), kb.lengths())
    )


def _pooled_split(rank=0, world_size=1):
    cfg = SyntheticConfig(num_tables=3, num_embeddings=500, batch_size=16, train_batches=4)
    return SyntheticRecDataset(cfg, rank=rank, world_size=world_size)


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("start", [0, 7])
def test_worker_batches_equal_in_line_batches_in_order(workers, start):
    split = _pooled_split(rank=1, world_size=2)
    expected = list(itertools.islice(split.batches(start), 10))  # past train_batches: the split is unbounded
    got = list(itertools.islice(train_batches(split, start, workers=workers), 10))
    assert len(got) == 10
    assert all(_same_batch(g, e) for g, e in zip(got, expected))
    # and not trivially: consecutive batches differ
    assert not _same_batch(got[0], got[1])


def test_sequence_batches_through_workers():
    cfg = SyntheticSequenceConfig(num_items=200, batch_size=8, eval_batches=2)
    split = SyntheticSequenceDataset(cfg, rank=0, world_size=1)
    got = list(itertools.islice(train_batches(split, 3, workers=2), 4))
    for i, batch in enumerate(got):
        assert _same_batch(batch, split.batch(3 + i))


def test_no_workers_is_the_split_iterator():
    split = _pooled_split()
    got = next(train_batches(split, 2, workers=0))
    assert _same_batch(got, split.batch(2))


@pytest.mark.parametrize("workers", [-1, 1.5, True, "2"])
def test_bad_worker_count_names_the_field(workers):
    with pytest.raises(ValueError, match="train.data_workers"):
        train_batches(_pooled_split(), 0, workers=workers)


def test_bad_start_is_refused():
    with pytest.raises(ValueError, match="start"):
        train_batches(_pooled_split(), -1, workers=1)


def test_default_workers_by_device(monkeypatch):
    assert resolve_workers(None, torch.device("cpu")) == 0
    assert resolve_workers(2, torch.device("cpu")) == 2
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert resolve_workers(None, torch.device("cuda", 0)) == 8  # one GPU on 16 cores
    assert resolve_workers(None, torch.device("cuda", 0), local_world_size=2) == 4
    assert resolve_workers(None, torch.device("cuda", 0), local_world_size=8) == 2  # never fewer than 2
    monkeypatch.setattr("os.cpu_count", lambda: 128)
    assert resolve_workers(None, torch.device("cuda", 0), local_world_size=8) == 8  # never more than 8


@pytest.mark.parametrize("value", [-1, 1.5, "four", True])
def test_train_config_refuses_bad_data_workers(value):
    with pytest.raises(ValueError, match="train.data_workers"):
        TrainConfig(data_workers=value)


def test_train_config_refuses_non_bool_step_sync():
    with pytest.raises(ValueError, match="train.step_sync"):
        TrainConfig(step_sync="yes")
    assert TrainConfig().step_sync is False and TrainConfig().data_workers is None


def test_batch_cost_benchmark_times_a_recipe_batch():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "synthetic_batch_cost.py")
    spec = importlib.util.spec_from_file_location("synthetic_batch_cost", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert 0.0 < bench.batch_ms("dhen", 2) < 10_000.0  # the small recipe: batches of 256
    assert 0.0 < bench.batch_ms("hstu", 2) < 10_000.0  # sequence data goes through the same path


def test_reused_batches_cycle_the_first_ones_and_refuse_bad_counts():
    made = []

    def batches():
        for i in range(100):
            made.append(i)
            yield i

    it = reused_batches(batches(), 3)
    assert [next(it) for _ in range(8)] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert made == [0, 1, 2]  # made once, up front
    with pytest.raises(ValueError, match=r"train.reuse_batches=5: the data has only 2 train batches"):
        reused_batches(iter([1, 2]), 5)
    with pytest.raises(ValueError, match="train.reuse_batches"):
        reused_batches(iter([1, 2]), 0)


@pytest.mark.parametrize("value", [-1, 1.5, "4", True])
def test_train_config_refuses_bad_reuse_batches(value):
    with pytest.raises(ValueError, match="train.reuse_batches"):
        TrainConfig(reuse_batches=value)
