"""Synthetic user-history data with a learnable target: a fixed teacher scores a candidate item against the history.

Every sample is a user with a jagged history of item ids (``hist_item``, 1 to ``max_seq_len``
of them), a candidate item (``cand_item``, exactly one id), ``num_dense`` standard-normal dense
features, and a 0/1 click label. The items fall into ``num_clusters`` interest clusters; a user
has one interest, draws each history item from it with probability ``interest_prob`` (else from
all items), and is shown a candidate from it with probability ``candidate_interest_prob``.
With ``num_context_features > 0`` every sample also carries that many pooled *context* features
``ctx_i`` (one id each, e.g. a user's profile fields): each is, with probability
``interest_prob``, an id of the user's interest block of its table (the ids congruent to the
cluster modulo ``num_clusters``), else any id. They tell a student about the interest but leave
the teacher (and so the labels and the teacher's NE) unchanged.

The :class:`SequenceTeacher`, drawn from ``seed`` alone, gives each item an embedding near its
cluster's centre and scores

``logit = scale * (w_i * standardized(<e_cand, h>) + w_d * standardized(dense @ w)) + bias``,

where ``h`` is the recency-weighted mean of the history's teacher embeddings (the item ``k``
steps before the last weighs ``recency_decay ** k``). ``scale`` and ``bias`` are calibrated once,
on a sample of the teacher's own, so the logit has standard deviation ``teacher_logit_std`` and
the mean click probability is ``positive_rate``. The label is a Bernoulli draw of
``sigmoid(logit)``. A student that learns which items go together (its own item embeddings) and
that recent items matter more can approach the teacher's NE (:func:`sequence_teacher_ne`), not beat it.

Layout and determinism follow :mod:`loka_job.training.synthetic`: chunk ``c`` of a split is
a pure function of ``(seed, split, c)``; rank ``r`` of ``world_size`` reads chunks ``r, r +
world_size, ...``; the eval split (held out: its own seed stream) is ``eval_batches`` chunks in
total, ``eval_batches // world_size`` per rank.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_job.training.data_spec import DataSpec, TableSpec
from loka_job.training.synthetic import (  # seed mixing and rank sharding, shared on purpose
    RankShardedSplit,
    _generator,
    _is_int,
)

__all__ = [
    "HISTORY_FEATURE",
    "CANDIDATE_FEATURE",
    "CONTEXT_PREFIX",
    "ITEM_TABLE",
    "SyntheticSequenceConfig",
    "SequenceTeacher",
    "SyntheticSequenceDataset",
    "make_sequence_data_spec",
    "sample_users",
    "sample_context",
    "sequence_teacher_ne",
]

HISTORY_FEATURE = "hist_item"
CANDIDATE_FEATURE = "cand_item"
ITEM_TABLE = "t_item"
CONTEXT_PREFIX = "ctx_"  # pooled context feature i is "ctx_{i}", read from its own table "t_ctx_{i}"
_SPLITS = ("train", "eval")

# Stream ids mixed into every seed (distinct from the pooled data's, so the two never share a state).
_STREAM_TRAIN = 101
_STREAM_EVAL = 102
_STREAM_CALIBRATION = 103
_STREAM_TEACHER = 104

_CALIBRATION_SAMPLES = 1 << 15
"""Samples the teacher is calibrated on (error of the positive rate at most about 0.003)."""

_WEIGHT_INTERACTION = 1.0  # share of the history-candidate score in the standardized logit
_WEIGHT_DENSE = 0.5  # share of the dense linear term: quick to learn, so NE drops early
_CLUSTER_NOISE = 0.5  # spread of an item's teacher embedding around its cluster centre


@dataclasses.dataclass(frozen=True)
class SyntheticSequenceConfig:
    """What the synthetic history data looks like.

    Attributes:
        num_dense: dense features per sample (>= 0).
        num_items: rows of the item table (history and candidate share it).
        num_clusters: interest clusters the items fall into (<= ``num_items``).
        min_seq_len, max_seq_len: history length range (uniform, inclusive).
        embedding_dim: columns of the student's item table (recorded in the :class:`DataSpec`).
        batch_size: samples per batch and rank.
        train_batches: batches each rank reads per pass over the train split.
        eval_batches: batches in the whole held-out split, shared among ranks.
        seed: seeds the teacher and every chunk.
        teacher_dim: width of the teacher's item embeddings.
        interest_prob: probability that a history item comes from the user's cluster.
        candidate_interest_prob: probability that the candidate comes from the user's cluster.
        recency_decay: weight ratio of an item to the next more recent one, in (0, 1].
        teacher_logit_std: standard deviation of the teacher's logit (> 0).
        positive_rate: target mean click probability, in (0, 1).
        num_context_features: pooled context features per sample (one id each; 0: none).
        context_embeddings: rows of each context feature's table (>= ``num_clusters``).

    Example::

        >>> cfg = SyntheticSequenceConfig(num_items=100, max_seq_len=8, batch_size=4)
        >>> cfg.max_seq_len, cfg.batch_size
        (8, 4)
    """

    num_dense: int = 4
    num_items: int = 1000
    num_clusters: int = 20
    min_seq_len: int = 1
    max_seq_len: int = 20
    embedding_dim: int = 32
    batch_size: int = 256
    train_batches: int = 200
    eval_batches: int = 16
    seed: int = 0
    teacher_dim: int = 16
    interest_prob: float = 0.8
    candidate_interest_prob: float = 0.5
    recency_decay: float = 0.8
    teacher_logit_std: float = 2.0
    positive_rate: float = 0.25
    num_context_features: int = 0
    context_embeddings: int = 1000

    def __post_init__(self) -> None:
        for name, minimum in (
            ("num_dense", 0),
            ("num_items", 1),
            ("num_clusters", 1),
            ("min_seq_len", 1),
            ("max_seq_len", 1),
            ("embedding_dim", 1),
            ("batch_size", 1),
            ("train_batches", 1),
            ("eval_batches", 1),
            ("seed", 0),
            ("teacher_dim", 1),
            ("num_context_features", 0),
            ("context_embeddings", 1),
        ):
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"SyntheticSequenceConfig.{name} must be an int, got {type(value).__name__}")
            if value < minimum:
                raise ValueError(f"SyntheticSequenceConfig.{name} must be >= {minimum}, got {value}")
        if self.num_clusters > self.num_items:
            raise ValueError(
                f"SyntheticSequenceConfig.num_clusters ({self.num_clusters}) must be <= num_items ({self.num_items})"
            )
        if self.num_context_features and self.context_embeddings < self.num_clusters:
            raise ValueError(
                f"SyntheticSequenceConfig.context_embeddings ({self.context_embeddings}) must be >= num_clusters "
                f"({self.num_clusters}): every interest cluster needs ids in each context table"
            )
        if self.min_seq_len > self.max_seq_len:
            raise ValueError(
                f"SyntheticSequenceConfig.min_seq_len ({self.min_seq_len}) must be <= max_seq_len ({self.max_seq_len})"
            )
        for name in ("interest_prob", "candidate_interest_prob", "recency_decay", "teacher_logit_std", "positive_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"SyntheticSequenceConfig.{name} must be a finite number, got {value!r}")
        for name in ("interest_prob", "candidate_interest_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SyntheticSequenceConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.recency_decay <= 1.0:
            raise ValueError(f"SyntheticSequenceConfig.recency_decay must be in (0, 1], got {self.recency_decay}")
        if self.teacher_logit_std <= 0:
            raise ValueError(f"SyntheticSequenceConfig.teacher_logit_std must be > 0, got {self.teacher_logit_std}")
        if not 0.0 < self.positive_rate < 1.0:
            raise ValueError(f"SyntheticSequenceConfig.positive_rate must be in (0, 1), got {self.positive_rate}")


def make_sequence_data_spec(config: SyntheticSequenceConfig) -> DataSpec:
    """The :class:`DataSpec`: features ``hist_item`` (up to ``max_seq_len`` ids) and ``cand_item``
    (one id), both sequence features of the one table ``t_item``, then the pooled context
    features ``ctx_i`` (one id each, table ``t_ctx_i``).

    Example::

        >>> spec = make_sequence_data_spec(SyntheticSequenceConfig(num_items=100, embedding_dim=8, num_context_features=1))
        >>> [(t.name, t.feature, t.pooling_factor, t.sequence) for t in spec.tables]
        [('t_item', 'hist_item', 20, True), ('t_item', 'cand_item', 1, True), ('t_ctx_0', 'ctx_0', 1, False)]
    """
    history = TableSpec(
        name=ITEM_TABLE,
        feature=HISTORY_FEATURE,
        num_embeddings=config.num_items,
        embedding_dim=config.embedding_dim,
        pooling_factor=config.max_seq_len,
        sequence=True,
    )
    candidate = dataclasses.replace(history, feature=CANDIDATE_FEATURE, pooling_factor=1)
    context = tuple(
        TableSpec(name=f"t_{name}", feature=name, num_embeddings=config.context_embeddings, embedding_dim=config.embedding_dim)
        for name in (f"{CONTEXT_PREFIX}{i}" for i in range(config.num_context_features))
    )
    return DataSpec(num_dense=config.num_dense, tables=(history, candidate, *context))


class SequenceTeacher:
    """The fixed random scorer of :mod:`this module <loka_job.training.synthetic_sequences>`.

    Args:
        config: the data (items, clusters, widths, seed, calibration targets).

    Example::

        >>> teacher = SequenceTeacher(SyntheticSequenceConfig(num_items=100, num_clusters=5))
        >>> history = torch.tensor([3, 4, 5, 7])             # user 0: [3, 4, 5]; user 1: [7]
        >>> logits = teacher.logit(torch.randn(2, 4), history, torch.tensor([3, 1]), torch.tensor([3, 9]))
        >>> logits.shape, logits.dtype
        (torch.Size([2]), torch.float64)
    """

    def __init__(self, config: SyntheticSequenceConfig) -> None:
        self.config = config
        g = _generator(config.seed, _STREAM_TEACHER)
        n, c, dim = config.num_items, config.num_clusters, config.teacher_dim
        # Cluster of item i: a random permutation modulo c, so every cluster has n // c or n // c + 1 items.
        self.cluster_of_item = torch.randperm(n, generator=g) % c
        self.items_by_cluster = torch.argsort(self.cluster_of_item, stable=True)
        sizes = torch.bincount(self.cluster_of_item, minlength=c)
        self.cluster_size = sizes
        self.cluster_start = torch.cumsum(sizes, 0) - sizes
        centres = torch.randn(c, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
        noise = torch.randn(n, dim, generator=g, dtype=torch.float64) * (_CLUSTER_NOISE / math.sqrt(dim))
        self.item_embeddings = centres[self.cluster_of_item] + noise  # (num_items, dim), float64
        self.dense_weights = torch.randn(max(config.num_dense, 1), generator=g, dtype=torch.float64)[: config.num_dense]
        self._term_mean = torch.zeros(2, dtype=torch.float64)
        self._term_std = torch.ones(2, dtype=torch.float64)
        self._scale, self._bias = 1.0, 0.0
        self._calibrate()

    def history_summary(self, history: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Recency-weighted mean of the teacher embeddings of each history, float64 ``(B, dim)``."""
        batch, max_len = lengths.shape[0], int(lengths.max()) if lengths.numel() else 0
        valid = torch.arange(max_len)[None, :] < lengths[:, None]  # (B, L)
        padded = torch.zeros(batch, max_len, dtype=torch.int64)
        padded[valid] = history  # row-major boolean assignment: histories end to end, in order
        steps_before_last = (lengths[:, None] - 1 - torch.arange(max_len)[None, :]).clamp_min(0).to(torch.float64)
        weights = torch.where(valid, self.config.recency_decay**steps_before_last, torch.zeros((), dtype=torch.float64))
        summed = torch.einsum("bl,bld->bd", weights, self.item_embeddings[padded])
        return summed / weights.sum(1).clamp_min(1e-30)[:, None]

    def _terms(
        self, dense: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, candidate: torch.Tensor
    ) -> torch.Tensor:
        summary = self.history_summary(history, lengths)
        interaction = (self.item_embeddings[candidate] * summary).sum(-1)
        dense_term = dense.to(torch.float64) @ self.dense_weights
        return torch.stack([interaction, dense_term], dim=1)

    def logit(
        self, dense: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, candidate: torch.Tensor
    ) -> torch.Tensor:
        """Click logits, float64 ``(B,)``.

        Args:
            dense: ``(B, num_dense)``.
            history: int64 item ids of all histories, end to end.
            lengths: ``(B,)`` history lengths (>= 1).
            candidate: ``(B,)`` candidate item ids.
        """
        terms = (self._terms(dense, history, lengths, candidate) - self._term_mean) / self._term_std
        mixed = terms @ torch.tensor([_WEIGHT_INTERACTION, _WEIGHT_DENSE], dtype=torch.float64)
        return mixed * self._scale + self._bias

    def _calibrate(self) -> None:
        cfg = self.config
        g = _generator(cfg.seed, _STREAM_CALIBRATION)
        dense, history, lengths, candidate = sample_users(self, g, _CALIBRATION_SAMPLES)
        terms = self._terms(dense, history, lengths, candidate)
        self._term_mean = terms.mean(0)
        self._term_std = terms.std(0).clamp_min(1e-12)  # a constant term (num_dense = 0) contributes 0
        if cfg.num_dense == 0:
            self._term_mean[1], self._term_std[1] = 0.0, 1.0
        mixed = self.logit(dense, history, lengths, candidate)  # with scale 1, bias 0
        self._scale = float(cfg.teacher_logit_std / mixed.std().clamp_min(1e-12))
        z = mixed * self._scale
        low, high = -40.0, 40.0
        for _ in range(80):  # bisection: mean(sigmoid(z + b)) grows with b
            mid = 0.5 * (low + high)
            if torch.sigmoid(z + mid).mean().item() < cfg.positive_rate:
                low = mid
            else:
                high = mid
        self._bias = 0.5 * (low + high)


def sample_users(
    teacher: SequenceTeacher, g: torch.Generator, batch_size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` users: dense ``(B, num_dense)`` float32, history ids (int64, end to end),
    history lengths ``(B,)`` and candidate ids ``(B,)``."""
    return _sample_users(teacher, g, batch_size)[:4]


def _sample_users(teacher: SequenceTeacher, g: torch.Generator, batch_size: int) -> Tuple[torch.Tensor, ...]:
    """:func:`sample_users` and, last, each user's interest cluster ``(B,)``."""
    cfg = teacher.config
    dense = torch.randn(batch_size, cfg.num_dense, generator=g)
    interest = torch.randint(cfg.num_clusters, (batch_size,), generator=g)
    lengths = torch.randint(cfg.min_seq_len, cfg.max_seq_len + 1, (batch_size,), generator=g)
    total = int(lengths.sum())
    owner_interest = torch.repeat_interleave(interest, lengths, output_size=total)

    def draw(clusters: torch.Tensor, prob: float) -> torch.Tensor:
        in_cluster = teacher.items_by_cluster[
            teacher.cluster_start[clusters]
            + (torch.rand(clusters.shape[0], generator=g, dtype=torch.float64) * teacher.cluster_size[clusters])
            .floor()
            .to(torch.int64)
            .clamp_max(teacher.cluster_size[clusters] - 1)
        ]
        anywhere = torch.randint(cfg.num_items, (clusters.shape[0],), generator=g)
        from_interest = torch.rand(clusters.shape[0], generator=g) < prob
        return torch.where(from_interest, in_cluster, anywhere)

    history = draw(owner_interest, cfg.interest_prob)
    candidate = draw(interest, cfg.candidate_interest_prob)
    return dense, history, lengths, candidate, interest


def sample_context(config: SyntheticSequenceConfig, g: torch.Generator, interest: torch.Tensor) -> torch.Tensor:
    """Context ids, int64 ``(num_context_features * B,)`` feature-major: feature ``f`` of user ``u``
    is, with probability ``interest_prob``, a uniform id among those ``= interest[u]`` modulo
    ``num_clusters``, else a uniform id of the table.

    Example::

        >>> cfg = SyntheticSequenceConfig(num_clusters=4, num_context_features=2, context_embeddings=10, interest_prob=1.0)
        >>> ids = sample_context(cfg, torch.Generator().manual_seed(0), torch.tensor([1, 3, 0]))
        >>> ids.shape, (ids % 4).tolist()
        (torch.Size([6]), [1, 3, 0, 1, 3, 0])
    """
    clusters, rows = config.num_clusters, config.context_embeddings
    owner = interest.repeat(config.num_context_features)
    block = (rows - 1 - owner) // clusters + 1  # ids c, c + C, ... below rows
    step = (torch.rand(owner.shape[0], generator=g, dtype=torch.float64) * block).floor().to(torch.int64)
    in_block = owner + clusters * step.clamp_max(block - 1)
    anywhere = torch.randint(rows, (owner.shape[0],), generator=g)
    return torch.where(torch.rand(owner.shape[0], generator=g) < config.interest_prob, in_block, anywhere)


class SyntheticSequenceDataset(RankShardedSplit):
    """Batches of synthetic history data for one rank of one split.

    Iterating yields ``len(self)`` :class:`torchrec.datasets.utils.Batch` objects:
    ``dense_features`` float32 ``(B, num_dense)``; ``sparse_features`` a ``KeyedJaggedTensor``
    with keys ``hist_item`` (the histories), ``cand_item`` (one id per sample) and the context
    features ``ctx_i`` (one id per sample), int64; ``labels`` float32 ``(B,)`` of 0/1.

    Args:
        config: the data.
        rank: this process's rank.
        world_size: ranks reading the split.
        split: ``"train"`` or ``"eval"`` (``eval_batches`` must be a multiple of ``world_size``).

    Example::

        >>> cfg = SyntheticSequenceConfig(num_items=100, max_seq_len=5, batch_size=3, train_batches=2)
        >>> data = SyntheticSequenceDataset(cfg, rank=1, world_size=2)
        >>> batch = next(iter(data))
        >>> batch.sparse_features.keys(), batch.sparse_features["cand_item"].lengths().tolist()
        (['hist_item', 'cand_item'], [1, 1, 1])
        >>> bool(torch.equal(batch.labels, data.batch(0).labels)), len(data)
        (True, 2)
    """

    def __init__(
        self, config: SyntheticSequenceConfig, *, rank: int, world_size: int, split: str = "train"
    ) -> None:
        if not isinstance(config, SyntheticSequenceConfig):
            raise TypeError(f"config must be a SyntheticSequenceConfig, got {type(config).__name__}")
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        if split == "eval" and config.eval_batches % world_size != 0:
            raise ValueError(
                f"SyntheticSequenceConfig.eval_batches ({config.eval_batches}) must be a multiple of "
                f"world_size ({world_size}): every rank runs the same number of eval steps"
            )
        self.config, self.rank, self.world_size, self.split = config, rank, world_size, split
        self._stream = _STREAM_TRAIN if split == "train" else _STREAM_EVAL
        self.teacher = SequenceTeacher(config)

    def batch(self, index: int) -> Batch:
        """This rank's batch ``index`` (random access, the same on every call)."""
        return self.batch_with_logits(index)[0]

    def batch_with_logits(self, index: int) -> Tuple[Batch, torch.Tensor]:
        """This rank's batch ``index`` and the teacher's float64 ``(B,)`` logits for it."""
        if not _is_int(index) or index < 0:
            raise ValueError(f"index must be an int >= 0, got {index!r}")
        if self.split == "eval" and index >= len(self):
            raise IndexError(f"eval batch index {index} out of range: this rank has {len(self)} eval batches")
        g = _generator(self.config.seed, self._stream, self.chunk_index(index))
        b = self.config.batch_size
        dense, history, lengths, candidate, interest = _sample_users(self.teacher, g, b)
        logits = self.teacher.logit(dense, history, lengths, candidate)
        labels = (torch.rand(b, generator=g, dtype=torch.float64) < torch.sigmoid(logits)).to(torch.float32)
        # Drawn after everything else, so that the other features and the labels do not depend on them.
        num_context = self.config.num_context_features
        context = sample_context(self.config, g, interest) if num_context else history[:0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[HISTORY_FEATURE, CANDIDATE_FEATURE, *(f"{CONTEXT_PREFIX}{i}" for i in range(num_context))],
            values=torch.cat([history, candidate, context]),
            lengths=torch.cat([lengths, torch.ones(b * (1 + num_context), dtype=torch.int64)]),
        )
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels), logits


def sequence_teacher_ne(config: SyntheticSequenceConfig, *, max_batches: Optional[int] = None) -> float:
    """The teacher's own NE on the eval split: the best NE a student can expect.

    Example::

        >>> ne = sequence_teacher_ne(SyntheticSequenceConfig(num_items=100, eval_batches=2))
        >>> 0.0 < ne < 1.0
        True
    """
    from loka_job.training.metrics import normalized_entropy

    data = SyntheticSequenceDataset(config, rank=0, world_size=1, split="eval")
    count = len(data) if max_batches is None else min(len(data), max_batches)
    logits: List[torch.Tensor] = []
    labels: List[torch.Tensor] = []
    for i in range(count):
        batch, logit = data.batch_with_logits(i)
        logits.append(logit)
        labels.append(batch.labels)
    return normalized_entropy(torch.cat(logits), torch.cat(labels))

