"""What a synthetic (or real) dataset looks like to a model builder."""

from __future__ import annotations

import dataclasses
from typing import Tuple

__all__ = ["TableSpec", "DataSpec"]


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table and the sparse feature that reads it.

    Attributes:
        name: table name, e.g. ``"t_cat_0"``.
        feature: the KeyedJaggedTensor key that looks it up, e.g. ``"cat_0"``.
        num_embeddings: rows.
        embedding_dim: columns.
        pooling_factor: mean number of ids per sample (pooled features), or the maximum
            sequence length (sequence features).
        sequence: ``True`` for a jagged sequence feature (``EmbeddingCollection``), ``False``
            for a pooled one (``EmbeddingBagCollection``).
    """

    name: str
    feature: str
    num_embeddings: int
    embedding_dim: int
    pooling_factor: int = 1
    sequence: bool = False


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The inputs every batch carries: ``Batch(dense_features (B, num_dense), sparse_features KJT, labels (B,))``."""

    num_dense: int
    tables: Tuple[TableSpec, ...]

    @property
    def pooled_tables(self) -> Tuple[TableSpec, ...]:
        return tuple(t for t in self.tables if not t.sequence)

    @property
    def sequence_tables(self) -> Tuple[TableSpec, ...]:
        return tuple(t for t in self.tables if t.sequence)

    @property
    def feature_names(self) -> Tuple[str, ...]:
        return tuple(t.feature for t in self.tables)
