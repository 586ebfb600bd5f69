"""Spawning the ranks of a multi-rank test job, each ending the way the project's entry points do.

A rank of a 2-rank gloo job used to die now and then with SIGABRT ("terminate called without an
active exception") as its interpreter exited: a gloo worker thread, dropping a finished ``Work``
that kept Python objects alive, took the GIL in a ``noexcept`` destructor while finalization
started (``loka_job/training/distributed.py`` and ``docs/reliability.md`` give the cause). The entry
points end with :func:`~loka_job.training.distributed.exit_process`, and so does every rank that
:func:`spawn_ranks` starts. No job is run a second time: an abort is the test's failure.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.multiprocessing as mp

from loka_job.training.distributed import exit_process


def spawn_ranks(fn: Callable, args: Sequence, nprocs: int) -> None:
    """``mp.spawn(fn, args=args, nprocs=nprocs, join=True)``, each rank ending with
    ``exit_process(0)`` once ``fn(rank, *args)`` has returned; an exception in ``fn`` reaches
    ``mp.spawn`` (and the test) as before."""
    mp.spawn(_rank, args=(fn, tuple(args)), nprocs=nprocs, join=True)


def _rank(rank: int, fn: Callable, args: tuple) -> None:
    fn(rank, *args)
    exit_process(0)
