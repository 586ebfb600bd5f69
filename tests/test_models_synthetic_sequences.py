"""Synthetic history data: determinism, rank shards, the held-out split, the learnable teacher."""

from dataclasses import replace as dataclasses_replace

import pytest
import torch

from loka_job.training.synthetic_sequences import (
    CANDIDATE_FEATURE,
    HISTORY_FEATURE,
    SequenceTeacher,
    SyntheticSequenceConfig,
    SyntheticSequenceDataset,
    make_sequence_data_spec,
    sequence_teacher_ne,
)

CONFIG = SyntheticSequenceConfig(num_items=200, num_clusters=10, max_seq_len=8, batch_size=64, eval_batches=4)


def _same(a, b) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def test_batches_are_deterministic_and_shaped_as_the_spec_says():
    data = SyntheticSequenceDataset(CONFIG, rank=0, world_size=1)
    batch = data.batch(3)
    assert _same(batch, SyntheticSequenceDataset(CONFIG, rank=0, world_size=1).batch(3))
    kjt = batch.sparse_features
    assert kjt.keys() == [HISTORY_FEATURE, CANDIDATE_FEATURE]
    history, candidate = kjt[HISTORY_FEATURE], kjt[CANDIDATE_FEATURE]
    assert history.lengths().min() >= 1 and history.lengths().max() <= 8
    assert torch.all(candidate.lengths() == 1)
    assert kjt.values().min() >= 0 and kjt.values().max() < 200
    assert batch.dense_features.shape == (64, 4) and batch.labels.shape == (64,)
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    spec = make_sequence_data_spec(CONFIG)
    assert spec.feature_names == (HISTORY_FEATURE, CANDIDATE_FEATURE)
    assert [t.pooling_factor for t in spec.sequence_tables] == [8, 1]


def test_ranks_read_disjoint_chunks_and_eval_is_held_out():
    rank0 = SyntheticSequenceDataset(CONFIG, rank=0, world_size=2)
    rank1 = SyntheticSequenceDataset(CONFIG, rank=1, world_size=2)
    single = SyntheticSequenceDataset(CONFIG, rank=0, world_size=1)
    assert _same(rank1.batch(0), single.batch(1)) and _same(rank0.batch(1), single.batch(2))
    assert not _same(rank0.batch(0), rank1.batch(0))
    evaluation = SyntheticSequenceDataset(CONFIG, rank=0, world_size=1, split="eval")
    assert not _same(evaluation.batch(0), single.batch(0))
    assert len(evaluation) == 4 and len(SyntheticSequenceDataset(CONFIG, rank=1, world_size=2, split="eval")) == 2
    with pytest.raises(IndexError):
        evaluation.batch(4)
    with pytest.raises(ValueError, match="multiple of world_size"):
        SyntheticSequenceDataset(CONFIG, rank=0, world_size=3, split="eval")


def test_teacher_is_calibrated_and_its_signal_is_learnable():
    teacher = SequenceTeacher(CONFIG)
    # Candidates from the user's cluster are clicked far more often than random ones.
    data = SyntheticSequenceDataset(CONFIG, rank=0, world_size=1)
    rates, same_cluster = [], []
    for i in range(8):
        batch, logits = data.batch_with_logits(i)
        kjt = batch.sparse_features
        last = kjt[HISTORY_FEATURE].offsets()[1:] - 1
        history = kjt[HISTORY_FEATURE].values()
        candidate_cluster = teacher.cluster_of_item[kjt[CANDIDATE_FEATURE].values()]
        same_cluster.append(teacher.cluster_of_item[history[last]] == candidate_cluster)
        rates.append(torch.sigmoid(logits))
    rates, same_cluster = torch.cat(rates), torch.cat(same_cluster)
    assert abs(rates.mean().item() - CONFIG.positive_rate) < 0.05
    assert rates[same_cluster].mean() > rates[~same_cluster].mean() + 0.2
    assert 0.3 < sequence_teacher_ne(CONFIG) < 0.9


def test_recency_weights_make_the_last_item_count_most():
    teacher = SequenceTeacher(SyntheticSequenceConfig(num_items=50, num_clusters=5, recency_decay=0.5))
    summary = teacher.history_summary(torch.tensor([1, 2, 3]), torch.tensor([3]))
    e = teacher.item_embeddings
    expected = (e[1] * 0.25 + e[2] * 0.5 + e[3]) / 1.75
    torch.testing.assert_close(summary[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_clusters": 300, "num_items": 200}, "num_clusters"),
        ({"min_seq_len": 9, "max_seq_len": 8}, "min_seq_len"),
        ({"positive_rate": 1.0}, "positive_rate"),
        ({"recency_decay": 0.0}, "recency_decay"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_context_features": 1, "context_embeddings": 5, "num_clusters": 10}, r"context_embeddings \(5\) must be >= num_clusters"),
        ({"num_context_features": -1}, "num_context_features"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SyntheticSequenceConfig(**kwargs)


def test_make_data_builds_the_jobs_view_of_sequences_and_names_unknown_options():
    from loka_job.training.data import make_data

    options = {"kind": "sequence", "num_items": 100, "batch_size": 8, "eval_batches": 2, "max_seq_len": 5}
    data = make_data(options, rank=1, world_size=2, seed=3)
    assert data.spec.feature_names == (HISTORY_FEATURE, CANDIDATE_FEATURE) and data.batch_size == 8
    expected = SyntheticSequenceDataset(
        SyntheticSequenceConfig(num_items=100, batch_size=8, eval_batches=2, max_seq_len=5, seed=3), rank=1, world_size=2
    )
    assert _same(next(data.train(3)), expected.batch(3))
    assert len(list(data.eval(0))) == 1 and 0.0 < data.teacher_ne < 1.5
    with pytest.raises(ValueError, match=r"data: unknown option\(s\) \['items'\]"):
        make_data({"kind": "sequence", "items": 100}, rank=0, world_size=1, seed=0)


def test_context_features_hint_at_the_interest_and_change_nothing_else():
    """Pooled context features ``ctx_i`` (one id each, own table) come after the history and the
    candidate; the dense features, histories, candidates and labels are those of the data
    without them, and with ``interest_prob=1`` every context id of a user is in one interest block."""
    plain = dataclasses_replace(CONFIG, interest_prob=1.0)
    with_context = dataclasses_replace(plain, num_context_features=3, context_embeddings=50)
    spec = make_sequence_data_spec(with_context)
    assert spec.feature_names == (HISTORY_FEATURE, CANDIDATE_FEATURE, "ctx_0", "ctx_1", "ctx_2")
    assert [(t.name, t.num_embeddings, t.sequence) for t in spec.pooled_tables] == [(f"t_ctx_{i}", 50, False) for i in range(3)]
    batch = SyntheticSequenceDataset(with_context, rank=0, world_size=1).batch(2)
    reference = SyntheticSequenceDataset(plain, rank=0, world_size=1).batch(2)
    kjt, ref = batch.sparse_features, reference.sparse_features
    assert torch.equal(batch.labels, reference.labels) and torch.equal(batch.dense_features, reference.dense_features)
    for key in (HISTORY_FEATURE, CANDIDATE_FEATURE):
        assert torch.equal(kjt[key].values(), ref[key].values()) and torch.equal(kjt[key].lengths(), ref[key].lengths())
    context = torch.stack([kjt[f"ctx_{i}"].values() for i in range(3)])  # (3, B)
    assert all(torch.all(kjt[f"ctx_{i}"].lengths() == 1) for i in range(3))
    assert context.min() >= 0 and context.max() < 50
    residues = context % CONFIG.num_clusters
    assert torch.all(residues == residues[0])  # one interest per user
    assert len(residues[0].unique()) > 1  # users differ
