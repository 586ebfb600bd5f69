"""A small uniform sample of the real rows a layer saw: inputs with their output gradients.

Every row offered at a probe step has the same chance to be in the reservoir (Vitter's
Algorithm R, vectorized over a batch). A row's input is stored in the forward pass and its output
gradient, when the backward pass comes, in the same slot, so the reservoir holds real
``(x, dy)`` pairs: the error of all three GEMMs can be measured on captured data.

Each slot also remembers which offer (one call of the layer: one batch) its row came from.
Training multiplies the rows of one batch together, and a layer's magnitudes move from step to
step (its gradients can grow tenfold within a warm-up): a GEMM over rows of several steps would
scale small rows by the largest step's amax, a range no training GEMM sees. :meth:`by_batch`
gives the rows batch by batch, so that measurements use rows of one batch at a time.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

__all__ = ["RowReservoir"]


class RowReservoir:
    """Up to ``capacity`` rows of a layer's input ``(in_features,)`` and output gradient ``(out_features,)``.

    Args:
        in_features, out_features: row widths.
        capacity: rows kept.
        seed: seed of the slot choices.

    Example::

        >>> r = RowReservoir(3, 2, capacity=4)
        >>> token = r.offer_inputs(torch.randn(10, 3))
        >>> r.offer_grads(token, torch.randn(10, 2))
        >>> [(x.shape, dy.shape) for x, dy in r.by_batch(with_grads=True)]
        [(torch.Size([4, 3]), torch.Size([4, 2]))]
    """

    def __init__(self, in_features: int, out_features: int, *, capacity: int = 512, seed: int = 0) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        self.in_features, self.out_features, self.capacity = in_features, out_features, capacity
        self.seen = 0
        self._gen = torch.Generator().manual_seed(seed)
        self.inputs: Optional[torch.Tensor] = None  # (capacity, in_features)
        self.grads: Optional[torch.Tensor] = None  # (capacity, out_features)
        self.filled = torch.zeros(capacity, dtype=torch.bool)
        self.has_grad = torch.zeros(capacity, dtype=torch.bool)
        self.batch = torch.full((capacity,), -1, dtype=torch.long)  # the offer each slot's row came from
        self.offers = 0

    def __setstate__(self, state: dict) -> None:
        # A reservoir saved before slots remembered their batch: its rows count as one batch.
        self.__dict__.update(state)
        if "batch" not in state:
            self.batch = torch.where(self.filled, 0, -1).long()
            self.offers = 1

    @torch.no_grad()
    def offer_inputs(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Offer the rows of ``x`` ``(rows, in_features)``; returns a token for :meth:`offer_grads`."""
        x = x.detach().reshape(-1, self.in_features)
        rows = x.shape[0]
        t = self.seen + torch.arange(rows, dtype=torch.float64)
        self.seen += rows
        # Algorithm R: row number t (0-based) takes slot t while the reservoir fills, then a
        # uniform slot j in [0, t] when j < capacity.
        j = torch.floor(torch.rand(rows, generator=self._gen, dtype=torch.float64) * (t + 1))
        slot = torch.where(t < self.capacity, t, j).long()
        keep = slot < self.capacity
        row_idx = torch.arange(rows)[keep]
        slot = slot[keep]
        if slot.numel():
            # Several rows of one batch may land on one slot: the later row wins, as in the serial algorithm.
            last = torch.full((self.capacity,), -1, dtype=torch.long).scatter_reduce(0, slot, row_idx, "amax")
            winner = last[slot] == row_idx
            slot, row_idx = slot[winner], row_idx[winner]
        if self.inputs is None:
            self.inputs = torch.zeros(self.capacity, self.in_features, dtype=x.dtype, device=x.device)
            self.grads = torch.zeros(self.capacity, self.out_features, dtype=x.dtype, device=x.device)
        self.inputs[slot.to(x.device)] = x[row_idx.to(x.device)].to(self.inputs.dtype)
        self.filled[slot] = True
        self.has_grad[slot] = False
        self.batch[slot] = self.offers
        self.offers += 1
        return slot, row_idx

    @torch.no_grad()
    def offer_grads(self, token: Tuple[torch.Tensor, torch.Tensor], dy: torch.Tensor) -> None:
        """Store the output gradients ``(rows, out_features)`` of the rows that :meth:`offer_inputs` kept."""
        slot, row_idx = token
        if not slot.numel() or self.grads is None:
            return
        dy = dy.detach().reshape(-1, self.out_features)
        self.grads[slot.to(dy.device)] = dy[row_idx.to(dy.device)].to(self.grads.dtype)
        self.has_grad[slot] = True

    def by_batch(self, *, with_grads: bool) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The stored rows grouped by the offer (batch) they came from, the latest batch first:
        ``(x, dy)`` pairs with ``with_grads`` (rows whose gradient came), else ``(x, None)`` for
        every stored input row."""
        if self.inputs is None:
            return []
        kept = self.filled & self.has_grad if with_grads else self.filled
        groups = []
        for b in torch.unique(self.batch[kept]).flip(0).tolist():
            idx = torch.nonzero(kept & (self.batch == b)).squeeze(1).to(self.inputs.device)
            groups.append((self.inputs[idx], self.grads[idx] if with_grads else None))
        return groups
