"""Synthetic click data: determinism, rank and split layout, label rate, teacher signal, config errors."""

import math

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_job.training.synthetic import (
    _CALIBRATION_SAMPLES,
    SyntheticConfig,
    SyntheticRecDataset,
    make_data_spec,
    sample_ids,
    teacher_ne,
)

# Small tables and batches keep the suite fast; the layout logic does not depend on the sizes.
SMALL = dict(num_tables=3, num_embeddings=(500, 40, 1000), batch_size=64, train_batches=6, eval_batches=4)


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and a.sparse_features.keys() == b.sparse_features.keys()
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


@pytest.fixture(scope="module")
def cfg() -> SyntheticConfig:
    return SyntheticConfig(**SMALL, seed=7)


@pytest.fixture(scope="module")
def train0(cfg) -> SyntheticRecDataset:
    return SyntheticRecDataset(cfg, rank=0, world_size=1, split="train")


def test_batch_shapes_dtypes_and_keys(cfg, train0):
    batch = train0.batch(0)
    assert isinstance(batch, Batch) and isinstance(batch.sparse_features, KeyedJaggedTensor)
    assert batch.dense_features.shape == (cfg.batch_size, cfg.num_dense)
    assert batch.dense_features.dtype == torch.float32
    assert batch.labels.shape == (cfg.batch_size,) and batch.labels.dtype == torch.float32
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    kjt = batch.sparse_features
    assert kjt.keys() == ["cat_0", "cat_1", "cat_2"]
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int64
    assert kjt.lengths().shape == (cfg.num_tables * cfg.batch_size,)
    assert int(kjt.lengths().sum()) == kjt.values().numel()
    for key, rows in zip(kjt.keys(), cfg.table_sizes):
        ids = kjt[key].values()
        assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < rows), key
    assert len(train0) == cfg.train_batches and len(list(train0)) == cfg.train_batches


def test_bag_sizes_are_poisson_with_the_pooling_factor():
    cfg = SyntheticConfig(num_tables=2, num_embeddings=100, pooling_factor=(1, 4), batch_size=2048)
    lengths = SyntheticRecDataset(cfg, rank=0, world_size=1).batch(0).sparse_features.lengths().double()
    for table, rate in enumerate(cfg.table_pooling_factors):
        bags = lengths[table * 2048 : (table + 1) * 2048]
        assert abs(bags.mean().item() - rate) < 5 * math.sqrt(rate / 2048)  # Poisson: var == mean
        # P(empty) = exp(-rate): some bags are empty, within a binomial bound.
        p0 = math.exp(-rate)
        assert abs((bags == 0).double().mean().item() - p0) < 5 * math.sqrt(p0 * (1 - p0) / 2048)


def test_same_seed_gives_the_same_batches(cfg, train0):
    again = SyntheticRecDataset(cfg, rank=0, world_size=1, split="train")
    for i in range(3):
        assert _same(train0.batch(i), again.batch(i))
    assert _same(train0.batch(2), train0.batch(2))  # random access does not advance a shared stream


def test_resume_from_start_matches_the_full_stream(train0):
    tail = list(train0.batches(start=4, stop=6))
    full = list(train0)
    assert len(tail) == 2 and all(_same(a, b) for a, b in zip(tail, full[4:6]))
    # The train split goes on past train_batches for runs longer than one pass.
    beyond = next(train0.batches(start=len(train0)))
    assert not _same(beyond, full[0])


def test_other_seed_gives_other_batches(cfg, train0):
    other = SyntheticRecDataset(SyntheticConfig(**SMALL, seed=8), rank=0, world_size=1)
    assert not torch.equal(other.batch(0).dense_features, train0.batch(0).dense_features)


def test_ranks_read_disjoint_chunks_of_one_global_stream(cfg, train0):
    rank0 = SyntheticRecDataset(cfg, rank=0, world_size=2)
    rank1 = SyntheticRecDataset(cfg, rank=1, world_size=2)
    assert not torch.equal(rank0.batch(0).dense_features, rank1.batch(0).dense_features)
    # Batch i of rank r is global chunk i * world_size + r: the same samples as one process reads.
    for i in range(2):
        assert _same(rank0.batch(i), train0.batch(2 * i))
        assert _same(rank1.batch(i), train0.batch(2 * i + 1))


def test_teacher_does_not_depend_on_rank(cfg, train0):
    rank1 = SyntheticRecDataset(cfg, rank=1, world_size=2)
    dense = torch.randn(5, cfg.num_dense)
    # cat_0: [1, 2], [], [3], [], [];  cat_1: one id each;  cat_2: all empty.
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    lengths = torch.tensor([2, 0, 1, 0, 0] + [1] * 5 + [0] * 5)
    pooled0 = train0.teacher.pooled_embeddings(values, lengths, batch_size=5)
    pooled1 = rank1.teacher.pooled_embeddings(values, lengths, batch_size=5)
    assert pooled0.shape == (cfg.num_tables, 5, cfg.teacher_dim)
    assert torch.equal(pooled0, pooled1)
    assert torch.equal(train0.teacher.logit(dense, pooled0), rank1.teacher.logit(dense, pooled1))
    assert torch.equal(pooled0[0, 1], torch.zeros(cfg.teacher_dim)) and not pooled0[0, 0].eq(0).all()
    assert torch.equal(pooled0[2], torch.zeros(5, cfg.teacher_dim))
    # A bag's pooled embedding is the sum of its ids' rows.
    one = lambda i: train0.teacher.pooled_embeddings(  # noqa: E731
        torch.tensor([i]), torch.tensor([1] + [0] * 14), batch_size=5)[0, 0]
    torch.testing.assert_close(pooled0[0, 0], one(1) + one(2))


def test_eval_is_held_out_and_the_same_for_any_world_size(cfg, train0):
    single = SyntheticRecDataset(cfg, rank=0, world_size=1, split="eval")
    assert len(single) == cfg.eval_batches
    assert not torch.equal(single.batch(0).dense_features, train0.batch(0).dense_features)
    for world in (2, 4):
        union = {}
        for rank in range(world):
            data = SyntheticRecDataset(cfg, rank=rank, world_size=world, split="eval")
            assert len(data) == cfg.eval_batches // world
            for i, batch in enumerate(data):
                union[data.chunk_index(i)] = batch
        assert sorted(union) == list(range(cfg.eval_batches))
        assert all(_same(union[c], single.batch(c)) for c in union)
    with pytest.raises(IndexError, match="eval batch index"):
        single.batch(cfg.eval_batches)


def test_eval_batches_must_divide_among_ranks(cfg):
    with pytest.raises(ValueError, match=r"eval_batches \(4\) must be a multiple of world_size \(3\)"):
        SyntheticRecDataset(cfg, rank=0, world_size=3, split="eval")
    SyntheticRecDataset(cfg, rank=2, world_size=3, split="train")  # train has no such constraint


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=2, world_size=2), "rank must be an int in"),
        (dict(rank=0, world_size=0), "world_size must be an int >= 1"),
        (dict(rank=0, world_size=1, split="test"), "split must be one of"),
    ],
)
def test_dataset_arguments_are_checked(cfg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticRecDataset(cfg, **kwargs)


@pytest.mark.parametrize("positive_rate", [0.25, 0.05])
def test_label_rate_matches_the_target(positive_rate):
    cfg = SyntheticConfig(num_tables=2, num_embeddings=300, batch_size=1024, positive_rate=positive_rate)
    data = SyntheticRecDataset(cfg, rank=0, world_size=1)
    labels = torch.cat([data.batch(i).labels for i in range(16)]).double()
    n = labels.numel()
    # Binomial noise of the labels plus the calibration's own sampling error (var(p) <= r (1 - r)).
    r = positive_rate
    bound = 5 * math.sqrt(r * (1 - r) / n + r * (1 - r) / _CALIBRATION_SAMPLES)
    assert abs(labels.mean().item() - r) < bound


def test_teacher_ne_is_informative():
    cfg = SyntheticConfig(num_tables=4, num_embeddings=2000, batch_size=1024, eval_batches=4)
    ne = teacher_ne(cfg)
    # The default spread aims for 0.7-0.85; below 1.0 means the labels carry signal at all.
    assert 0.5 < ne < 0.9
    weaker = teacher_ne(SyntheticConfig(num_tables=4, num_embeddings=2000, batch_size=1024, eval_batches=4,
                                        teacher_logit_std=0.5))
    assert ne < weaker < 1.0


def test_labels_follow_the_teacher_probabilities(cfg):
    data = SyntheticRecDataset(SyntheticConfig(**{**SMALL, "batch_size": 2048}), rank=0, world_size=1)
    batch, logits = data.batch_with_logits(0)
    p = torch.sigmoid(logits)
    high, low = p > p.median(), p <= p.median()
    assert batch.labels[high].mean() > batch.labels[low].mean() + 0.1
    assert abs(batch.labels.double().sum().item() - p.sum().item()) < 5 * math.sqrt((p * (1 - p)).sum().item())


def test_zipf_ids_are_skewed_and_scattered():
    n = 1000
    cfg = SyntheticConfig(num_tables=1, num_embeddings=n, batch_size=4096, id_distribution="zipf", zipf_exponent=1.1)
    ids = SyntheticRecDataset(cfg, rank=0, world_size=1).batch(0).sparse_features.values()
    counts = torch.bincount(ids, minlength=n).double()
    assert counts.max() > 30 * counts.mean()  # uniform would give about mean + 5 std
    hot = torch.topk(counts, 10).indices
    assert sorted(hot.tolist()) != list(range(10))  # the hot ids are not the first rows
    uniform = SyntheticConfig(num_tables=1, num_embeddings=n, batch_size=4096, id_distribution="uniform")
    uids = SyntheticRecDataset(uniform, rank=0, world_size=1).batch(0).sparse_features.values()
    assert torch.bincount(uids, minlength=n).double().max() < 5 * counts.mean()


def test_sample_ids_follows_the_power_law():
    n, a, draws = 50, 1.2, 200_000
    g = torch.Generator().manual_seed(0)
    ids = sample_ids(torch.rand(draws, generator=g, dtype=torch.float64), torch.tensor(n), distribution="zipf",
                     zipf_exponent=a)
    assert int(ids.min()) >= 0 and int(ids.max()) < n
    freq = torch.bincount(ids, minlength=n).double() / draws

    def cdf(x: float) -> float:  # continuous power law on [1, n + 1)
        return (x ** (1 - a) - 1) / ((n + 1) ** (1 - a) - 1)

    for k in (0, 1, 5, 20):
        p = cdf(k + 2) - cdf(k + 1)
        assert abs(freq[k].item() - p) < 5 * math.sqrt(p * (1 - p) / draws), k
    edges = torch.tensor([0.0, 0.5, 1 - 1e-16], dtype=torch.float64)
    assert sample_ids(edges, torch.tensor(10)).tolist() == [0, 5, 9]
    assert sample_ids(edges, torch.tensor(10), distribution="zipf", zipf_exponent=1.0).tolist()[::2] == [0, 9]


def test_make_data_spec_names_tables_and_features():
    cfg = SyntheticConfig(num_tables=2, num_embeddings=(10, 20), embedding_dim=16, pooling_factor=(1, 5))
    spec = make_data_spec(cfg)
    assert spec.num_dense == cfg.num_dense
    assert [(t.name, t.feature, t.num_embeddings, t.embedding_dim, t.pooling_factor, t.sequence)
            for t in spec.tables] == [("t_cat_0", "cat_0", 10, 16, 1, False), ("t_cat_1", "cat_1", 20, 16, 5, False)]
    assert spec.feature_names == cfg.feature_names


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_dense=0), ValueError, "num_dense must be >= 1"),
        (dict(num_tables=0), ValueError, "num_tables must be >= 1"),
        (dict(num_tables=2.5), TypeError, "num_tables must be an int"),
        (dict(batch_size=True), TypeError, "batch_size must be an int"),
        (dict(train_batches=0), ValueError, "train_batches must be >= 1"),
        (dict(eval_batches=0), ValueError, "eval_batches must be >= 1"),
        (dict(seed=-1), ValueError, "seed must be >= 0"),
        (dict(teacher_dim=0), ValueError, "teacher_dim must be >= 1"),
        (dict(num_embeddings=0), ValueError, "num_embeddings must be >= 1"),
        (dict(num_tables=2, num_embeddings=[10, 20, 30]), ValueError, r"num_embeddings must have one entry per table"),
        (dict(num_tables=2, num_embeddings=[10, 0]), ValueError, r"num_embeddings\[1\] must be an int >= 1"),
        (dict(num_embeddings="100"), TypeError, "num_embeddings must be an int or a sequence"),
        (dict(pooling_factor=0), ValueError, "pooling_factor must be >= 1"),
        (dict(positive_rate=1.0), ValueError, r"positive_rate must be in \(0, 1\)"),
        (dict(positive_rate=float("nan")), TypeError, "positive_rate must be a finite number"),
        (dict(teacher_logit_std=0.0), ValueError, "teacher_logit_std must be > 0"),
        (dict(id_distribution="pareto"), ValueError, "id_distribution must be one of"),
        (dict(zipf_exponent=0.0), ValueError, "zipf_exponent must be > 0"),
    ],
)
def test_config_validation_names_the_field(kwargs, error, match):
    with pytest.raises(error, match="SyntheticConfig." + match):
        SyntheticConfig(**kwargs)


def test_config_normalizes_sequences_to_tuples():
    cfg = SyntheticConfig(num_tables=2, num_embeddings=[10, 20], pooling_factor=[2, 3])
    assert cfg.num_embeddings == (10, 20) and cfg.table_pooling_factors == (2, 3)
    assert hash(cfg) == hash(SyntheticConfig(num_tables=2, num_embeddings=(10, 20), pooling_factor=(2, 3)))
    assert SyntheticConfig(num_tables=3, num_embeddings=7).table_sizes == (7, 7, 7)
