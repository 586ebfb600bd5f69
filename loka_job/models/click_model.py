"""The shape the zoo's pooled-feature models share: look the tables up, then run the over arch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TablesThenOverArch"]


class TablesThenOverArch(nn.Module):
    """A click model ``(dense (B, num_dense), sparse KJT) -> logits (B,)``: the pooled embeddings of
    ``embedding_bag_collection``, then ``over_arch(dense_features, pooled)``.

    The top-level forward is only "look up, then the over arch", which TorchRec's train pipelines
    trace with ``torch.fx``; everything dense is the over arch, a leaf there (and what
    :func:`loka_torchrec.compile.compile_dense` compiles).

    Args:
        embedding_bag_collection: the pooled tables.
        over_arch: ``(dense (B, num_dense), KeyedTensor) -> (B,)``.
        config: the model's sizes, kept as ``self.config``.
    """

    def __init__(self, embedding_bag_collection: nn.Module, over_arch: nn.Module, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embedding_bag_collection = embedding_bag_collection
        self.over_arch = over_arch

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        """Click logits ``(B,)`` from ``dense_features (B, num_dense)`` and the sparse ``KeyedJaggedTensor``."""
        return self.over_arch(dense_features, self.embedding_bag_collection(sparse_features))
