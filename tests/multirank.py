"""Spawning the ranks of a multi-rank test job, each ending the way the project's entry points do.

A rank of a 2-rank gloo job used to die now and then with SIGABRT ("terminate called without an
active exception") as its interpreter exited: a gloo worker thread, dropping a finished ``Work``
that kept Python objects alive, took the GIL in a ``noexcept`` destructor while finalization
started (``loka_job/training/distributed.py`` and ``docs/reliability.md`` give the cause). The entry
points end with :func:`~loka_job.training.distributed.exit_process`, and so does every rank that
:func:`spawn_ranks` starts. No job is run a second time: an abort is the test's failure.

The ranks are forked from a ``forkserver`` process that imported torch, TorchRec and the project
once per pytest process: a spawned interpreter spent about 3 s of a CI core on those imports, for
every rank of every job. The server does nothing but import them (one thread), so a rank starts as
clean as a spawned one and imports the test's module itself; it sees the environment that the
server started with (the first job's of the pytest process).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.multiprocessing as mp

from loka_job.training.distributed import exit_process

# What the ranks' test modules import (the first rank of the session waits for these).
mp.set_forkserver_preload(["torch", "torch.distributed", "pytest", "loka_torchrec", "loka_job.training.distributed",
                           "torchrec.distributed.model_parallel"])  # fmt: skip


def spawn_ranks(fn: Callable, args: Sequence, nprocs: int) -> None:
    """``mp.spawn(fn, args=args, nprocs=nprocs, join=True)`` with the ``forkserver`` start method,
    each rank ending with ``exit_process(0)`` once ``fn(rank, *args)`` has returned; an exception
    in ``fn`` reaches ``mp.spawn`` (and the test) as before."""
    mp.start_processes(_rank, args=(fn, tuple(args)), nprocs=nprocs, join=True, start_method="forkserver")


def _rank(rank: int, fn: Callable, args: tuple) -> None:
    fn(rank, *args)
    exit_process(0)
