"""Synthetic click data with a learnable signal: a fixed random teacher labels random features.

Every sample has ``num_dense`` standard-normal dense features and, for each of ``num_tables``
sparse features ``cat_i``, a bag of ids (Poisson(``pooling_factor``) of them, so a bag is
sometimes empty) drawn uniformly or from a Zipf law. A fixed random :class:`ClickTeacher`, seeded
from ``seed`` alone (never from the rank), turns the features into a click logit; the label is a
Bernoulli draw of ``sigmoid(logit)``. The teacher's logit is calibrated once, on a sample of its
own, to a chosen spread (``teacher_logit_std``) and to the target ``positive_rate``. A student
model can therefore reach the teacher's normalized entropy (see :func:`teacher_ne`) but not
beat it.

How the data is laid out:

* Both splits are sequences of *chunks* of ``batch_size`` samples. Chunk ``c`` of a split is a
  pure function of ``(seed, split, c)``: its own ``torch.Generator`` is seeded from a hash of
  the three, so any chunk can be produced on its own (random access for resume) and the train
  and eval splits never share a seed (the eval split is held out).
* Rank ``r`` of ``world_size`` reads chunks ``r, r + world_size, r + 2 * world_size, ...``: its
  ``i``-th batch is chunk ``i * world_size + r``. Different ranks therefore read different
  samples, and the union of what all ranks read in the first ``k`` steps is chunks
  ``0 .. k * world_size - 1`` whatever ``world_size`` is.
* The train split is unbounded (:meth:`SyntheticRecDataset.batches` goes on past
  ``train_batches``); iterating the dataset yields ``train_batches`` batches per rank.
* The eval split is ``eval_batches`` chunks in total, shared among the ranks: each rank reads
  ``eval_batches // world_size`` of them. ``eval_batches`` must be a multiple of ``world_size``,
  so that every rank runs the same number of eval steps (sharded embeddings need every rank in
  every forward) and the held-out set is the same samples for any number of ranks. (Features are
  bit-identical everywhere; a label could only differ if a process with another CPU thread count
  rounded a teacher matmul differently and the label's uniform draw fell within that rounding
  of its probability, about 1e-7.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_job.training.data_spec import DataSpec, TableSpec

__all__ = [
    "SyntheticConfig",
    "ClickTeacher",
    "SyntheticRecDataset",
    "make_data_spec",
    "sample_ids",
    "teacher_ne",
]

IdDistribution = str  # "uniform" | "zipf"
_ID_DISTRIBUTIONS = ("uniform", "zipf")
_SPLITS = ("train", "eval")

# Stream ids mixed into every seed, so that the streams never share a generator state.
_STREAM_TRAIN = 1
_STREAM_EVAL = 2
_STREAM_CALIBRATION = 3
_STREAM_TEACHER = 4
_STREAM_ID_PERMUTATION = 5

_CALIBRATION_SAMPLES = 1 << 15
"""Samples the teacher is calibrated on; the standard error of the calibrated positive rate is at
most ``sqrt(r (1 - r) / 32768)`` (0.0024 at ``r = 0.25``)."""

_TEACHER_MAX_ROWS = 1 << 16
"""The teacher hashes ids of larger tables into this many rows (``id % rows``) to bound its memory."""

_TEACHER_HIDDEN = 32

# Share of each teacher term in the logit (each term is standardized first). The dense linear term
# is learned within a few dozen steps, so a student's NE falls below 1.0 early; the first-order
# sparse term (a fixed effect per id) needs each id seen a few hundred times (hot ids under
# "zipf"); the MLP and the pairwise interactions take longest.
# With the defaults (teacher NE about 0.72), a TorchRec DLRM trained with Adagrad on 512 samples
# per step reaches an eval NE of about 0.81 (zipf ids) or 0.88 (uniform ids) after 300 steps.
_TERM_WEIGHTS = (
    0.7,  # dense linear
    0.6,  # first-order sparse
    0.5,  # MLP over dense and pooled embeddings
    0.2,  # pairwise interactions
)


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 finalizer applied after each part)."""
    mask = (1 << 64) - 1
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & mask)) & mask
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        state = z ^ (z >> 31)
    return state >> 1  # torch.Generator.manual_seed takes values below 2**63 on every version


def _generator(*parts: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(_mix_seed(*parts))
    return g


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_table(name: str, value: object, num_tables: int, minimum: int) -> Union[int, Tuple[int, ...]]:
    """Validates an int-or-sequence field; returns an int or a tuple of ``num_tables`` ints."""
    if _is_int(value):
        if value < minimum:
            raise ValueError(f"SyntheticConfig.{name} must be >= {minimum}, got {value}")
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"SyntheticConfig.{name} must be an int or a sequence of {num_tables} ints, "
            f"got {type(value).__name__}"
        )
    values = tuple(value)
    if len(values) != num_tables:
        raise ValueError(
            f"SyntheticConfig.{name} must have one entry per table (num_tables={num_tables}), "
            f"got {len(values)}"
        )
    for i, v in enumerate(values):
        if not _is_int(v) or v < minimum:
            raise ValueError(f"SyntheticConfig.{name}[{i}] must be an int >= {minimum}, got {v!r}")
    return values


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """What the synthetic click data looks like.

    Attributes:
        num_dense: dense features per sample.
        num_tables: sparse features (one embedding table each).
        num_embeddings: rows per table: one int for all tables, or one per table.
        embedding_dim: columns of the student's tables (recorded in the :class:`DataSpec`).
        pooling_factor: mean ids per sample and table (one int, or one per table); the count of
            a sample is Poisson-distributed, so some bags are empty.
        batch_size: samples per batch and rank.
        train_batches: batches each rank reads per pass over the train split.
        eval_batches: batches of ``batch_size`` in the whole held-out split, shared among ranks.
        seed: seeds the teacher and every chunk of data.
        teacher_dim: width of the teacher's own embeddings.
        teacher_logit_std: standard deviation of the teacher's logit; larger means a more
            predictable label and a lower best-possible NE.
        positive_rate: the target fraction of positive labels, in (0, 1).
        id_distribution: ``"uniform"`` or ``"zipf"`` (a few hot ids, scattered over the rows).
        zipf_exponent: the exponent ``a`` of ``P(rank k) ~ 1 / k**a`` for ``"zipf"``.

    Example::

        >>> cfg = SyntheticConfig(num_tables=2, num_embeddings=(100, 50), batch_size=32)
        >>> cfg.table_sizes
        (100, 50)
    """

    num_dense: int = 13
    num_tables: int = 8
    num_embeddings: Union[int, Tuple[int, ...]] = 10_000
    embedding_dim: int = 64
    pooling_factor: Union[int, Tuple[int, ...]] = 3
    batch_size: int = 256
    train_batches: int = 200
    eval_batches: int = 16
    seed: int = 0
    teacher_dim: int = 16
    teacher_logit_std: float = 1.75
    positive_rate: float = 0.25
    id_distribution: IdDistribution = "zipf"
    zipf_exponent: float = 1.05

    def __post_init__(self) -> None:
        for name, minimum in (
            ("num_dense", 1),
            ("num_tables", 1),
            ("embedding_dim", 1),
            ("batch_size", 1),
            ("train_batches", 1),
            ("eval_batches", 1),
            ("seed", 0),
            ("teacher_dim", 1),
        ):
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"SyntheticConfig.{name} must be an int, got {type(value).__name__}")
            if value < minimum:
                raise ValueError(f"SyntheticConfig.{name} must be >= {minimum}, got {value}")
        object.__setattr__(
            self, "num_embeddings", _per_table("num_embeddings", self.num_embeddings, self.num_tables, 1)
        )
        object.__setattr__(
            self, "pooling_factor", _per_table("pooling_factor", self.pooling_factor, self.num_tables, 1)
        )
        for name in ("teacher_logit_std", "positive_rate", "zipf_exponent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"SyntheticConfig.{name} must be a finite number, got {value!r}")
        if self.teacher_logit_std <= 0:
            raise ValueError(f"SyntheticConfig.teacher_logit_std must be > 0, got {self.teacher_logit_std}")
        if not 0.0 < self.positive_rate < 1.0:
            raise ValueError(f"SyntheticConfig.positive_rate must be in (0, 1), got {self.positive_rate}")
        if self.id_distribution not in _ID_DISTRIBUTIONS:
            raise ValueError(
                f"SyntheticConfig.id_distribution must be one of {_ID_DISTRIBUTIONS}, "
                f"got {self.id_distribution!r}"
            )
        if self.zipf_exponent <= 0:
            raise ValueError(f"SyntheticConfig.zipf_exponent must be > 0, got {self.zipf_exponent}")

    @property
    def table_sizes(self) -> Tuple[int, ...]:
        """Rows of each table."""
        n = self.num_embeddings
        return (n,) * self.num_tables if isinstance(n, int) else tuple(n)

    @property
    def table_pooling_factors(self) -> Tuple[int, ...]:
        """Mean ids per sample of each table."""
        p = self.pooling_factor
        return (p,) * self.num_tables if isinstance(p, int) else tuple(p)

    @property
    def feature_names(self) -> Tuple[str, ...]:
        return tuple(f"cat_{i}" for i in range(self.num_tables))


def make_data_spec(config: SyntheticConfig) -> DataSpec:
    """The :class:`DataSpec` of the synthetic data: tables ``t_cat_{i}`` read by features ``cat_{i}``.

    Example::

        >>> spec = make_data_spec(SyntheticConfig(num_tables=2, num_embeddings=100, embedding_dim=8))
        >>> [(t.name, t.feature, t.num_embeddings, t.embedding_dim) for t in spec.tables]
        [('t_cat_0', 'cat_0', 100, 8), ('t_cat_1', 'cat_1', 100, 8)]
    """
    tables = tuple(
        TableSpec(
            name=f"t_cat_{i}",
            feature=f"cat_{i}",
            num_embeddings=rows,
            embedding_dim=config.embedding_dim,
            pooling_factor=pooling,
            sequence=False,
        )
        for i, (rows, pooling) in enumerate(zip(config.table_sizes, config.table_pooling_factors))
    )
    return DataSpec(num_dense=config.num_dense, tables=tables)


def _coprime_multiplier(n: int) -> int:
    """A multiplier near ``0.618 n`` coprime with ``n``: ``k -> k * m mod n`` is then a bijection."""
    m = max(1, int(n * 0.6180339887498949))
    while math.gcd(m, n) != 1:
        m += 1
    return m


def sample_ids(
    uniform: torch.Tensor,
    num_embeddings: torch.Tensor,
    *,
    distribution: IdDistribution = "uniform",
    zipf_exponent: float = 1.05,
) -> torch.Tensor:
    """Turns uniform draws into ids in ``[0, num_embeddings)`` by inverse transform.

    For ``"zipf"`` the id of popularity rank ``k`` (0 is the most popular) is drawn with
    probability close to ``(k + 1) ** -a`` (a continuous power law on ``[1, n + 1)``, floored);
    the caller scatters the ranks over the rows (see :class:`SyntheticRecDataset`).

    Args:
        uniform: float64 draws in ``[0, 1)``, any shape.
        num_embeddings: int64 table size for each draw (same shape, or broadcastable).
        distribution: ``"uniform"`` or ``"zipf"``.
        zipf_exponent: ``a`` for ``"zipf"``.

    Returns:
        int64 ids (popularity ranks for ``"zipf"``), same shape as ``uniform``.

    Example::

        >>> u = torch.tensor([0.0, 0.5, 0.999], dtype=torch.float64)
        >>> sample_ids(u, torch.tensor(10)).tolist()
        [0, 5, 9]
    """
    if distribution not in _ID_DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {_ID_DISTRIBUTIONS}, got {distribution!r}")
    n = num_embeddings.to(torch.float64)
    if distribution == "uniform":
        x = uniform * n
    elif abs(zipf_exponent - 1.0) < 1e-9:
        x = torch.pow(n + 1.0, uniform) - 1.0
    else:
        e = 1.0 - zipf_exponent
        x = torch.pow(1.0 + uniform * (torch.pow(n + 1.0, e) - 1.0), 1.0 / e) - 1.0
    # min() guards against u * n rounding up to n in float64.
    return torch.minimum(x.floor().to(torch.int64), num_embeddings.to(torch.int64) - 1).clamp_min(0)


class ClickTeacher:
    """A fixed random click model: dense + pooled sparse features to a calibrated logit.

    Its parts, all drawn once from ``seed``:

    * ``v_0 = tanh(dense @ W_dense)``: a nonlinear dense embedding of width ``dim``;
    * ``v_t``: the sum of the teacher's own embeddings (``dim`` wide) of the ids of table ``t``;
    * a dense linear term ``dense @ w_linear``;
    * a first-order sparse term ``sum_t <v_t, u_t>``: a fixed effect per id;
    * an MLP (one ReLU layer of 32) over ``[dense, v_1, ..., v_T]``;
    * pairwise interactions ``sum_{i<j} w_ij <v_i, v_j>`` (the dot products DLRM learns).

    Each term is standardized on a calibration sample and mixed; :meth:`calibrate` then fixes
    the final scale and bias, so that the logit has a chosen standard deviation and
    ``mean(sigmoid(logit))`` equals the target positive rate on that sample.

    Args:
        num_dense: dense features.
        num_embeddings: rows of each table (ids of larger tables are hashed into 65536 rows).
        dim: width of the teacher's embeddings.
        seed: the only source of randomness (give it no rank).

    Example::

        >>> teacher = ClickTeacher(num_dense=4, num_embeddings=[10, 20], dim=8, seed=0)
        >>> values = torch.tensor([1, 2, 3, 19])            # cat_0: [1, 2], [];  cat_1: [3], [19]
        >>> lengths = torch.tensor([2, 0, 1, 1])
        >>> pooled = teacher.pooled_embeddings(values, lengths, batch_size=2)
        >>> pooled.shape
        torch.Size([2, 2, 8])
        >>> dense = torch.randn(2, 4)
        >>> teacher.calibrate(torch.randn(512, 4), teacher.pooled_embeddings(
        ...     torch.randint(10, (1024,)), torch.ones(1024, dtype=torch.long), batch_size=512),
        ...     positive_rate=0.3, logit_std=1.0)
        >>> teacher.logit(dense, pooled).shape
        torch.Size([2])
    """

    def __init__(self, *, num_dense: int, num_embeddings: Sequence[int], dim: int, seed: int) -> None:
        self.num_dense = int(num_dense)
        self.num_tables = len(num_embeddings)
        self.dim = int(dim)
        g = _generator(seed, _STREAM_TEACHER)
        rows = [min(int(n), _TEACHER_MAX_ROWS) for n in num_embeddings]
        self._rows: torch.Tensor = torch.tensor(rows, dtype=torch.int64)
        self._row_offsets: torch.Tensor = torch.tensor([0] + rows[:-1], dtype=torch.int64).cumsum(0)
        # Entries N(0, 1/dim): a pooled bag of p ids then has a norm of about sqrt(p).
        self._embeddings: torch.Tensor = torch.randn(sum(rows), dim, generator=g) / math.sqrt(dim)
        self._w_dense: torch.Tensor = torch.randn(num_dense, dim, generator=g) * (1.5 / math.sqrt(num_dense))
        self._w_linear: torch.Tensor = torch.randn(num_dense, generator=g) / math.sqrt(num_dense)
        self._w_first_order: torch.Tensor = torch.randn(self.num_tables, dim, generator=g)
        fields = self.num_tables + 1
        self._w_hidden: torch.Tensor = torch.randn(num_dense + self.num_tables * dim, _TEACHER_HIDDEN, generator=g)
        self._w_hidden /= math.sqrt(fields)
        self._b_hidden: torch.Tensor = 0.5 * torch.randn(_TEACHER_HIDDEN, generator=g)
        self._w_out: torch.Tensor = torch.randn(_TEACHER_HIDDEN, generator=g)
        pairs = torch.triu_indices(fields, fields, offset=1)
        self._pair_rows: torch.Tensor = pairs[0]
        self._pair_cols: torch.Tensor = pairs[1]
        self._w_pairs: torch.Tensor = torch.randn(pairs.shape[1], generator=g)
        # Set by calibrate(): per-term centre and spread, and the final scale and bias.
        self._term_mean: Optional[torch.Tensor] = None
        self._term_std: Optional[torch.Tensor] = None
        self._scale = 1.0
        self._bias = 0.0

    def pooled_embeddings(self, values: torch.Tensor, lengths: torch.Tensor, *, batch_size: int) -> torch.Tensor:
        """Sum-pools the teacher's embeddings of each bag.

        Args:
            values: int64 ids of all bags, table-major (all of table 0's bags, then table 1's).
            lengths: ``(num_tables * batch_size,)`` ids per bag, table-major.
            batch_size: samples ``B``.

        Returns:
            float32 ``(num_tables, B, dim)``; an empty bag gives zeros.
        """
        if lengths.numel() != self.num_tables * batch_size:
            raise ValueError(
                f"lengths must have num_tables * batch_size = {self.num_tables * batch_size} entries, "
                f"got {lengths.numel()}"
            )
        lengths = lengths.to(torch.int64)
        table_of_value = torch.repeat_interleave(
            torch.arange(self.num_tables).repeat_interleave(batch_size), lengths, output_size=values.numel()
        )
        rows = values.to(torch.int64) % self._rows[table_of_value] + self._row_offsets[table_of_value]
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        pooled = F.embedding_bag(rows, self._embeddings, offsets, mode="sum", include_last_offset=True)
        return pooled.view(self.num_tables, batch_size, self.dim)

    def _terms(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The raw terms, float64 ``(B, 4)``: dense linear, first-order sparse, MLP, interactions."""
        dense = dense.to(torch.float32)
        sparse = pooled.transpose(0, 1)  # (B, T, dim)
        linear = dense @ self._w_linear
        first_order = (sparse * self._w_first_order).sum(dim=(1, 2))
        # The hidden layer reads [dense, v_1 .. v_T]; two matmuls spare the concatenated copy.
        w_dense_part, w_sparse_part = self._w_hidden[: self.num_dense], self._w_hidden[self.num_dense :]
        hidden = torch.relu(dense @ w_dense_part + sparse.flatten(1) @ w_sparse_part + self._b_hidden)
        mlp = hidden @ self._w_out
        v0 = torch.tanh(dense @ self._w_dense)
        fields = torch.cat([v0.unsqueeze(1), sparse], dim=1)  # (B, T + 1, dim)
        gram = torch.bmm(fields, fields.transpose(1, 2))  # (B, T + 1, T + 1)
        interaction = gram[:, self._pair_rows, self._pair_cols] @ self._w_pairs
        return torch.stack([linear, first_order, mlp, interaction], dim=1).to(torch.float64)

    def _mix(self, terms: torch.Tensor) -> torch.Tensor:
        if self._term_mean is None or self._term_std is None:
            raise RuntimeError("ClickTeacher.calibrate() must run before logit()")
        standardized = (terms - self._term_mean) / self._term_std
        return standardized @ torch.tensor(_TERM_WEIGHTS, dtype=torch.float64)

    def calibrate(
        self, dense: torch.Tensor, pooled: torch.Tensor, *, positive_rate: float, logit_std: float
    ) -> None:
        """Fixes the logit's scale and bias on a calibration sample.

        After this, on the sample, ``std(logit) == logit_std`` and ``mean(sigmoid(logit)) ==
        positive_rate`` (the bias is found by bisection in float64).

        Args:
            dense: ``(N, num_dense)`` calibration dense features.
            pooled: ``(num_tables, N, dim)`` their :meth:`pooled_embeddings`.
            positive_rate: target mean click probability, in (0, 1).
            logit_std: target standard deviation of the logit, > 0.
        """
        if not 0.0 < positive_rate < 1.0:
            raise ValueError(f"positive_rate must be in (0, 1), got {positive_rate}")
        if not logit_std > 0:
            raise ValueError(f"logit_std must be > 0, got {logit_std}")
        terms = self._terms(dense, pooled)
        self._term_mean = terms.mean(0)
        self._term_std = terms.std(0).clamp_min(1e-12)  # a term that is constant contributes nothing
        mixed = self._mix(terms)
        self._scale = float(logit_std / mixed.std().clamp_min(1e-12))
        z = mixed * self._scale
        low, high = -40.0, 40.0
        for _ in range(80):  # bisection: mean(sigmoid(z + b)) grows with b
            mid = 0.5 * (low + high)
            if torch.sigmoid(z + mid).mean().item() < positive_rate:
                low = mid
            else:
                high = mid
        self._bias = 0.5 * (low + high)

    def logit(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Click logits.

        Args:
            dense: ``(B, num_dense)`` dense features.
            pooled: ``(num_tables, B, dim)`` from :meth:`pooled_embeddings`.

        Returns:
            float64 ``(B,)`` logits; ``sigmoid`` of them is the click probability.
        """
        return self._mix(self._terms(dense, pooled)) * self._scale + self._bias


class RankShardedSplit:
    """Rank sharding shared by the synthetic datasets: batch ``i`` of rank ``r`` is global chunk
    ``i * world_size + r``; the train split has ``train_batches`` per rank (more on demand), the
    eval split ``eval_batches`` in all. Subclasses set ``config``, ``split``, ``rank``,
    ``world_size`` and implement ``batch(index)``.
    """

    def __len__(self) -> int:
        if self.split == "train":
            return self.config.train_batches
        return self.config.eval_batches // self.world_size

    def __iter__(self) -> Iterator[Batch]:
        return self.batches(0, len(self))

    def chunk_index(self, index: int) -> int:
        """The global chunk that this rank's batch ``index`` is: ``index * world_size + rank``."""
        return index * self.world_size + self.rank

    def batches(self, start: int = 0, stop: Optional[int] = None) -> Iterator[Batch]:
        """This rank's batches ``start, start + 1, ...`` up to ``stop`` (exclusive).

        For the train split ``stop=None`` never ends (the teacher gives fresh data forever); for
        the eval split it means ``len(self)``. Use ``start`` to resume after ``start`` steps.
        """
        if not _is_int(start) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        if stop is None and self.split == "eval":
            stop = len(self)
        index = start
        while stop is None or index < stop:
            yield self.batch(index)
            index += 1


class SyntheticRecDataset(RankShardedSplit):
    """Batches of synthetic click data for one rank of one split.

    Iterating yields ``len(self)`` :class:`torchrec.datasets.utils.Batch` objects:
    ``dense_features`` float32 ``(B, num_dense)``, ``sparse_features`` a ``KeyedJaggedTensor``
    with keys ``cat_0 .. cat_{T-1}`` (int64 values and lengths), ``labels`` float32 ``(B,)`` of
    0/1. Batches are generated on the fly on the CPU, deterministically from ``(seed, split,
    chunk)``; see the module docstring for how chunks map to ranks. ``teacher`` is the calibrated
    :class:`ClickTeacher`, shared by every dataset of the same config (do not recalibrate it).

    Args:
        config: the data's shape and seeds.
        rank: this process's rank.
        world_size: number of ranks reading the split.
        split: ``"train"`` (``train_batches`` per rank, more via :meth:`batches`) or ``"eval"``
            (``eval_batches // world_size`` per rank; ``eval_batches`` must be a multiple of
            ``world_size``).

    Example::

        >>> cfg = SyntheticConfig(num_tables=2, num_embeddings=100, batch_size=4, train_batches=3)
        >>> data = SyntheticRecDataset(cfg, rank=0, world_size=2)
        >>> batch = next(iter(data))
        >>> batch.dense_features.shape, batch.sparse_features.keys(), batch.labels.shape
        (torch.Size([4, 13]), ['cat_0', 'cat_1'], torch.Size([4]))
        >>> len(data)
        3
    """

    def __init__(self, config: SyntheticConfig, *, rank: int, world_size: int, split: str = "train") -> None:
        if not isinstance(config, SyntheticConfig):
            raise TypeError(f"config must be a SyntheticConfig, got {type(config).__name__}")
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        if split == "eval" and config.eval_batches % world_size != 0:
            raise ValueError(
                f"SyntheticConfig.eval_batches ({config.eval_batches}) must be a multiple of "
                f"world_size ({world_size}): every rank runs the same number of eval steps and "
                f"the held-out set must not depend on the number of ranks"
            )
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.split = split
        self._stream = _STREAM_TRAIN if split == "train" else _STREAM_EVAL
        self._keys = list(config.feature_names)
        self._sampler = _FeatureSampler(config)
        self.teacher = _calibrated_teacher(_teacher_key(config))

    def batch(self, index: int) -> Batch:
        """This rank's batch ``index`` (random access, the same on every call)."""
        return self._chunk(index)[0]

    def batch_with_logits(self, index: int) -> Tuple[Batch, torch.Tensor]:
        """This rank's batch ``index`` and the teacher's float64 ``(B,)`` logits for it."""
        return self._chunk(index)

    def _chunk(self, index: int) -> Tuple[Batch, torch.Tensor]:
        if not _is_int(index) or index < 0:
            raise ValueError(f"index must be an int >= 0, got {index!r}")
        if self.split == "eval" and index >= len(self):
            raise IndexError(f"eval batch index {index} out of range: this rank has {len(self)} eval batches")
        g = _generator(self.config.seed, self._stream, self.chunk_index(index))
        b = self.config.batch_size
        dense, values, lengths = self._sampler.sample(g, b)
        logits = self.teacher.logit(dense, self.teacher.pooled_embeddings(values, lengths, batch_size=b))
        # Bernoulli(sigmoid(logit)) from the chunk's own generator, compared in float64.
        labels = (torch.rand(b, generator=g, dtype=torch.float64) < torch.sigmoid(logits)).to(torch.float32)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=self._keys, values=values, lengths=lengths)
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels), logits


class _FeatureSampler:
    """Draws dense features and id bags (the inputs, not the labels) from a generator."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        sizes = config.table_sizes
        self._sizes: torch.Tensor = torch.tensor(sizes, dtype=torch.int64)
        self._pooling: torch.Tensor = torch.tensor(config.table_pooling_factors, dtype=torch.float32)
        # Zipf ranks are scattered over the rows by a fixed bijection k -> (k * m + o) mod n, so
        # the hot ids do not all land in the first rows (and in one row-wise shard).
        g = _generator(config.seed, _STREAM_ID_PERMUTATION)
        self._perm_mult: torch.Tensor = torch.tensor([_coprime_multiplier(n) for n in sizes], dtype=torch.int64)
        self._perm_offset: torch.Tensor = torch.tensor(
            [int(torch.randint(n, (1,), generator=g)) for n in sizes], dtype=torch.int64
        )

    def sample(self, g: torch.Generator, batch_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense ``(B, num_dense)`` float32, table-major int64 ids and ``(T * B,)`` int64 lengths."""
        cfg = self.config
        dense = torch.randn(batch_size, cfg.num_dense, generator=g)
        rates = self._pooling.repeat_interleave(batch_size)
        lengths = torch.poisson(rates, generator=g).to(torch.int64)
        total = int(lengths.sum())
        table_of_value = torch.repeat_interleave(
            torch.arange(cfg.num_tables).repeat_interleave(batch_size), lengths, output_size=total
        )
        sizes = self._sizes[table_of_value]
        uniform = torch.rand(total, generator=g, dtype=torch.float64)
        ids = sample_ids(uniform, sizes, distribution=cfg.id_distribution, zipf_exponent=cfg.zipf_exponent)
        if cfg.id_distribution == "zipf":
            ids = (ids * self._perm_mult[table_of_value] + self._perm_offset[table_of_value]) % sizes
        return dense, ids, lengths


def _teacher_key(config: SyntheticConfig) -> SyntheticConfig:
    """The config with the fields the teacher does not read set to 1, so equal teachers share a key."""
    return dataclasses.replace(config, embedding_dim=1, batch_size=1, train_batches=1, eval_batches=1)


@functools.lru_cache(maxsize=4)
def _calibrated_teacher(key: SyntheticConfig) -> ClickTeacher:
    """The teacher of a config, calibrated on its own stream; cached because the train and eval
    datasets of a run (and every test) share it, and calibration is the slow part."""
    teacher = ClickTeacher(
        num_dense=key.num_dense, num_embeddings=key.table_sizes, dim=key.teacher_dim, seed=key.seed
    )
    dense, values, lengths = _FeatureSampler(key).sample(
        _generator(key.seed, _STREAM_CALIBRATION), _CALIBRATION_SAMPLES
    )
    teacher.calibrate(
        dense,
        teacher.pooled_embeddings(values, lengths, batch_size=_CALIBRATION_SAMPLES),
        positive_rate=key.positive_rate,
        logit_std=key.teacher_logit_std,
    )
    return teacher


def teacher_ne(config: SyntheticConfig, *, max_batches: Optional[int] = None) -> float:
    """The teacher's own normalized entropy on the eval split: the best NE any model can expect.

    Uses the teacher's probabilities as predictions for the labels sampled from them, over all
    ``eval_batches`` chunks (or the first ``max_batches``).

    Args:
        config: the data.
        max_batches: read at most this many eval chunks.

    Returns:
        NE (mean log loss over the entropy of the positive rate); below 1.0 means the labels
        carry signal.

    Example::

        >>> ne = teacher_ne(SyntheticConfig(num_tables=2, num_embeddings=100, eval_batches=4))
        >>> 0.0 < ne < 1.0
        True
    """
    from loka_job.training.metrics import normalized_entropy  # metrics does not import this module

    data = SyntheticRecDataset(config, rank=0, world_size=1, split="eval")
    count = len(data) if max_batches is None else min(len(data), max_batches)
    logits: List[torch.Tensor] = []
    labels: List[torch.Tensor] = []
    for i in range(count):
        batch, logit = data.batch_with_logits(i)
        logits.append(logit)
        labels.append(batch.labels)
    return normalized_entropy(torch.cat(logits), torch.cat(labels))
