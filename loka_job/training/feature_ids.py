"""Feature ids checked against their tables before the lookup: one line naming the feature.

An id past a table's end makes FBGEMM's CPU lookup print a bounds message to stderr and go on with
a wrong row; a ``-1`` makes it raise an error that names no feature; on a GPU either can read
another table's memory. :class:`FeatureIdCheck` checks each batch where it enters the training
loop (and each evaluation batch), on the host, before the train pipeline copies it to the device:
one ``aminmax`` over the batch's ids, and, only if that falls outside the smallest table, one per
feature to find which. :class:`FeatureIdError` names the feature, its table and its size, the
offending id, and where the batch came from.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, Tuple

import torch
from torch import nn

from loka_job.training.errors import JobError

__all__ = ["FeatureIdCheck", "FeatureIdError"]


class FeatureIdError(JobError, ValueError):
    """A sparse feature holds an id outside its embedding table."""


class FeatureIdCheck:
    """The embedding tables of a model, and the check of a batch's ids against them.

    Args:
        tables: ``{feature name: (table name, rows)}``.

    Example::

        >>> from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        >>> check = FeatureIdCheck({"cat_0": ("t_cat_0", 10)})
        >>> ids = KeyedJaggedTensor.from_lengths_sync(["cat_0"], torch.tensor([3, 10]), torch.tensor([1, 1]))
        >>> check.check(ids, where="batch 0")
        Traceback (most recent call last):
        ...
        loka_job.training.feature_ids.FeatureIdError: id 10 of feature cat_0 is past the end of table t_cat_0 (10 rows: ids 0 to 9), in batch 0
    """

    def __init__(self, tables: Dict[str, Tuple[str, int]]) -> None:
        self.tables = dict(tables)
        self._fewest_rows = min((rows for _, rows in self.tables.values()), default=None)

    @classmethod
    def of_model(cls, model: nn.Module) -> "FeatureIdCheck":
        """The tables of ``model``'s TorchRec ``EmbeddingBagCollection`` and ``EmbeddingCollection``
        modules (before sharding)."""
        from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

        tables: Dict[str, Tuple[str, int]] = {}
        for module in model.modules():
            if isinstance(module, EmbeddingBagCollection):
                configs = module.embedding_bag_configs()
            elif isinstance(module, EmbeddingCollection):
                configs = module.embedding_configs()
            else:
                continue
            for config in configs:
                for feature in config.feature_names:
                    tables[feature] = (config.name, int(config.num_embeddings))
        return cls(tables)

    def check(self, features: Any, *, where: str) -> None:
        """Raise :class:`FeatureIdError` if a feature of ``features`` (a ``KeyedJaggedTensor``)
        holds an id outside its table; ``where`` says which batch, for the message."""
        values = features.values()
        if self._fewest_rows is None or values.numel() == 0:
            return
        low, high = (int(v) for v in torch.aminmax(values))
        if low >= 0 and high < self._fewest_rows:
            return  # every id fits every table: the common case, one reduction
        offsets = features.offset_per_key()
        for index, key in enumerate(features.keys()):
            if key not in self.tables or offsets[index] == offsets[index + 1]:
                continue
            low, high = (int(v) for v in torch.aminmax(values[offsets[index]:offsets[index + 1]]))
            table, rows = self.tables[key]
            if low < 0:
                what = f"id {low} of feature {key} is negative: table {table} has {rows} rows (ids 0 to {rows - 1})"
                raise self._error(f"{what}, in {where}", key)
            if high >= rows:
                what = f"id {high} of feature {key} is past the end of table {table} ({rows} rows: ids 0 to {rows - 1})"
                raise self._error(f"{what}, in {where}", key)

    def checked(self, batches: Iterable[Any], *, split: str, first_batch: int, rank: int) -> Iterator[Any]:
        """``batches`` (TorchRec ``Batch`` objects, ``sparse_features`` checked), named in the
        messages as ``split`` batches of ``rank`` numbered from ``first_batch``."""
        for index, batch in enumerate(batches, start=first_batch):
            self.check(batch.sparse_features, where=f"{split} batch {index} of rank {rank}")
            yield batch

    @staticmethod
    def _error(message: str, feature: str) -> FeatureIdError:
        return FeatureIdError(message, field=f"feature {feature}", every_rank=False)  # this rank's batch: it prints it
