"""Train batches made in background worker processes, in the same order as made in line.

The synthetic datasets make each batch on the CPU (ids, a teacher's labels): 18 ms for a
DHEN-large batch of 8192 samples on one core. Made in the training loop, that time lands in
every step and the GPU waits for it; a real job reads its data in loader workers instead.
:func:`train_batches` does the same with ``torch.utils.data.DataLoader`` worker processes.

Order is exact: worker ``w`` of ``W`` makes batches ``start + w, start + w + W, ...``, and the
loader hands the workers' outputs back round-robin, so the ``k``-th batch out is batch
``start + k``, the same batch the in-line iterator gives (tested). With ``pin_memory`` the
batches come back in page-locked memory, so the train pipeline's host-to-device copy can run
asynchronously.
"""

from __future__ import annotations

import itertools

import os
from typing import Any, Iterator, Optional, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

__all__ = ["RandomAccessSplit", "train_batches", "resolve_workers"]

PREFETCH_PER_WORKER = 4
"""Batches each worker keeps ready ahead of the loop (``DataLoader(prefetch_factor=...)``)."""


class RandomAccessSplit(Protocol):
    """A split whose batch ``i`` can be made on its own (the synthetic datasets)."""

    def batch(self, index: int) -> Any: ...

    def batches(self, start: int = 0, stop: Optional[int] = None) -> Iterator[Any]: ...


def resolve_workers(workers: Optional[int], device: torch.device, *, local_world_size: int = 1) -> int:
    """``train.data_workers``: an int is taken as it is; ``None`` means none on a CPU (where the
    ranks already use the cores) and, on CUDA, half of this rank's share of the host's cores, from
    2 to 8 (8 on a 16-core host with one GPU: a DLRM-large batch of 26 tables takes 71 ms
    to make on one core)."""
    if workers is not None:
        return int(workers)
    if device.type != "cuda":
        return 0
    share = (os.cpu_count() or 4) // max(1, local_world_size)
    return max(2, min(8, share // 2))


class _WorkerShare(IterableDataset):
    """Batches ``start + w, start + w + W, ...`` of ``split`` for loader worker ``w`` of ``W``."""

    def __init__(self, split: RandomAccessSplit, start: int) -> None:
        super().__init__()
        self.split = split
        self.start = start

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        index = self.start + worker
        while True:  # the train split is unbounded; the loop stops asking
            yield self.split.batch(index)
            index += workers


def reused_batches(batches: Iterator[Any], count: int) -> Iterator[Any]:
    """The first ``count`` items of ``batches``, then the same ones again in the same order, without end.

    ``batches`` is read ``count`` times right away and then dropped (its loader workers stop).

    Raises:
        ValueError: ``count`` is not an int >= 1, or ``batches`` ran out before ``count``.

    Example::

        >>> list(itertools.islice(reused_batches(iter("abcdef"), 2), 5))
        ['a', 'b', 'a', 'b', 'a']
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"train.reuse_batches: expected an int >= 1 here, got {count!r}")
    kept = list(itertools.islice(batches, count))
    if len(kept) < count:
        raise ValueError(f"train.reuse_batches={count}: the data has only {len(kept)} train batches")
    return itertools.cycle(kept)


def train_batches(
    split: RandomAccessSplit, start: int = 0, *, workers: int = 0, pin_memory: bool = False
) -> Iterator[Any]:
    """Batches ``start, start + 1, ...`` of ``split``, without end.

    Args:
        split: the train split (random access by batch index).
        start: the first batch (the resumed step count).
        workers: worker processes making batches ahead of the loop; 0 makes them in line, in the
            caller's process (as ``split.batches(start)`` does).
        pin_memory: return batches in page-locked host memory (for an asynchronous copy to the
            GPU); only with ``workers > 0``.

    Returns:
        an iterator; with workers, drop it (or let it be collected) to stop them.

    Example::

        >>> from loka_job.training.synthetic import SyntheticConfig, SyntheticRecDataset
        >>> split = SyntheticRecDataset(SyntheticConfig(num_tables=2, batch_size=4), rank=0, world_size=1)
        >>> it = train_batches(split, 5, workers=2)
        >>> bool(torch.equal(next(it).labels, split.batch(5).labels))
        True
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"train.data_workers: expected an int >= 0 (or null for the default), got {workers!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if workers == 0:
        return split.batches(start)
    loader = DataLoader(
        _WorkerShare(split, start),
        batch_size=None,  # the split makes whole batches
        num_workers=workers,
        pin_memory=pin_memory,
        prefetch_factor=PREFETCH_PER_WORKER,
    )
    return iter(loader)
