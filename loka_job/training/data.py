"""The recipe's ``data:`` section -> datasets for this rank.

The one place that knows both synthetic data kinds: the generators
(:mod:`~loka_job.training.synthetic`, :mod:`~loka_job.training.synthetic_sequences`) know nothing
of the job, and this module turns either into the job's :class:`RankData`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, Optional

from loka_torchrec.config import from_mapping
from loka_job.training.data_spec import DataSpec
from loka_job.training.synthetic import SyntheticConfig, SyntheticRecDataset, make_data_spec, teacher_ne
from loka_job.training.synthetic_sequences import (
    SyntheticSequenceConfig,
    SyntheticSequenceDataset,
    make_sequence_data_spec,
    sequence_teacher_ne,
)

__all__ = ["RankData", "make_data", "rank_data"]


@dataclasses.dataclass
class RankData:
    """This rank's view of the data.

    Attributes:
        spec: what the batches hold (for the model builder).
        train: ``start_batch -> iterator`` over this rank's train batches from ``start_batch`` on.
        eval: ``start_batch -> iterator`` over this rank's share of the held-out split.
        batch_size: per-rank batch size.
        teacher_ne: the best NE any model can reach on the eval split (``None`` if unknown).
        train_split: the train split itself, with random access by batch index, for loader
            workers (:func:`loka_job.training.prefetch.train_batches`); ``None`` if it has none.
    """

    spec: DataSpec
    train: Callable[[int], Iterator]
    eval: Callable[[int], Iterator]
    batch_size: int
    teacher_ne: Optional[float]
    train_split: Optional[Any] = None


def rank_data(config, dataset_cls, spec: DataSpec, teacher_ne: Optional[float], *, rank: int, world_size: int) -> RankData:
    """:class:`RankData` of one synthetic config: its train and eval splits for this rank."""
    train = dataset_cls(config, rank=rank, world_size=world_size, split="train")
    evaluation = dataset_cls(config, rank=rank, world_size=world_size, split="eval")
    return RankData(
        spec=spec,
        train=lambda start: train.batches(start),
        eval=lambda start: evaluation.batches(start),
        batch_size=config.batch_size,
        teacher_ne=teacher_ne,
        train_split=train,
    )


@dataclasses.dataclass(frozen=True)
class _DataKind:
    """One ``data.kind``: its config, dataset, spec builder and teacher NE."""

    config: type
    dataset: type
    spec: Callable[[Any], DataSpec]
    teacher_ne: Callable[..., float]


_KINDS: Dict[str, _DataKind] = {
    "pooled": _DataKind(SyntheticConfig, SyntheticRecDataset, make_data_spec, teacher_ne),
    "sequence": _DataKind(SyntheticSequenceConfig, SyntheticSequenceDataset, make_sequence_data_spec, sequence_teacher_ne),
}


def make_data(options: Dict[str, Any], *, rank: int, world_size: int, seed: int) -> RankData:
    """Build the datasets of the ``data:`` section; ``kind`` is ``"pooled"`` or ``"sequence"``.

    Unknown fields raise a ``ValueError`` naming them (see :func:`_check_fields`).

    Example::

        >>> data = make_data({"kind": "sequence", "num_items": 100, "batch_size": 8, "eval_batches": 2}, rank=0, world_size=2, seed=0)
        >>> data.spec.feature_names, data.batch_size, next(data.train(0)).labels.shape
        (('hist_item', 'cand_item'), 8, torch.Size([8]))
    """
    options = dict(options)
    kind = options.pop("kind", "pooled")
    options.setdefault("seed", seed)
    if kind not in _KINDS:
        raise ValueError(f"data.kind: expected 'pooled' or 'sequence', got {kind!r}")
    data_kind = _KINDS[kind]
    _check_fields(kind, data_kind.config, options)
    config = from_mapping(data_kind.config, options, field="data")
    return rank_data(
        config,
        data_kind.dataset,
        data_kind.spec(config),
        data_kind.teacher_ne(config, max_batches=4),
        rank=rank,
        world_size=world_size,
    )


def _check_fields(kind: str, config_cls: type, options: Dict[str, Any]) -> None:
    """Unknown ``data.*`` fields for this kind: one error that says how to switch kinds cleanly.

    The two kinds have different fields (``num_tables`` vs ``num_items``, ...), so typing only
    ``data.kind=sequence`` keeps the pooled recipe's fields; ``data=sequence`` picks the whole
    ``recipes/data/sequence.yaml`` instead (and ``model=hstu`` does that by itself).
    """
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"data: unknown option(s) {unknown} for data.kind={kind!r}; expected some of {sorted(known)}. "
            f"To switch data kinds select the whole data recipe (`data=pooled` or `data=sequence`) rather "
            f"than only `data.kind`"
        )
