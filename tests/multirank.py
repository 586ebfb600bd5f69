"""The tests' jobs: the ranks of a multi-rank test job (:func:`spawn_ranks`), each ending the way
the project's entry points do, and a job's command line (:func:`run_job`).

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

:func:`run_job` runs a job's command line (``python -m loka_job.train ...``, or a script) in
processes forked from the same server, one per rank, with the environment torchrun gives each rank
(or none, for a plain process), and returns what ``subprocess.run`` would; :func:`start_job`
starts it and returns a :class:`Job`, whose ranks a test can signal while it runs. A test about the job
(what it trains, writes, resumes and survives) saves the 3 s of imports per rank, and torchrun's
own start (1.5 s); tests about the command line itself (argument errors, exit codes, the torchrun
launch) keep running the real command.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Iterator, List, Mapping, Optional, Sequence

import torch.multiprocessing as mp

from loka_job.training.distributed import _free_port, exit_process

# What the ranks' test modules and the training job import (the first rank of the session waits for these).
mp.set_forkserver_preload(["torch", "torch.distributed", "pytest", "loka_torchrec", "loka_job.training.distributed",
                           "torchrec.distributed.model_parallel", "hydra", "loka_job.baselines", "loka_job.models",
                           "loka_job.training.data", "loka_job.training.trainer"])  # fmt: skip


def spawn_ranks(fn: Callable, args: Sequence, nprocs: int, cuda: bool = False) -> None:
    """``mp.spawn(fn, args=args, nprocs=nprocs, join=True)`` with the ``forkserver`` start method,
    each rank ending with ``exit_process(0)`` once ``fn(rank, *args)`` has returned; an exception
    in ``fn`` reaches ``mp.spawn`` (and the test) as before.

    ``cuda=True``: ranks that use a GPU are spawned instead. On a GPU machine the server's imports
    (FBGEMM's among them) initialize CUDA, and a process forked from it cannot use CUDA again."""
    start_method = "spawn" if cuda else "forkserver"
    mp.start_processes(_rank, args=(fn, tuple(args)), nprocs=nprocs, join=True, start_method=start_method)


def _rank(rank: int, fn: Callable, args: tuple) -> None:
    fn(rank, *args)
    exit_process(0)


@contextlib.contextmanager
def process_group(rank: int, world: int, init_file: str, backend: str = "gloo") -> Iterator[None]:
    """A spawned rank's process group for the block (file store ``init_file``), destroyed after it."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def write_result(out_dir: str, rank: int, value) -> None:
    """A rank's result for the test to read back: ``<out_dir>/rank<r>.json``."""
    import json

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(value, f)


def run_job(
    command: Sequence[str], *, env: Mapping[str, str], cwd, nproc: Optional[int] = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """What ``subprocess.run([sys.executable, *command], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)`` returns, ``command`` being ``["-m", module, *args]`` or
    ``[script, *args]``; with ``nproc``, what ``torchrun --standalone --nproc_per_node=nproc``
    returns instead (every rank's output, rank 0's first, and the first failing rank's exit code).

    Each rank is forked from the forkserver and gets ``env`` as its whole environment (plus
    torchrun's rank variables), ``cwd``, and its own ``sys.argv``; then the module or script runs
    as ``__main__``. As with torchrun, a failing rank ends the others.
    """
    return start_job(command, env=env, cwd=cwd, nproc=nproc).wait(timeout)


def start_job(command: Sequence[str], *, env: Mapping[str, str], cwd, nproc: Optional[int] = None) -> "Job":
    """Start :func:`run_job`'s job and return it running (see :class:`Job`)."""
    ranks = nproc or 1
    envs = [dict(env) for _ in range(ranks)]
    if nproc:
        port = str(_free_port())
        for rank, rank_env in enumerate(envs):
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
    out_dir = tempfile.mkdtemp(prefix="job-output-")
    context = mp.start_processes(
        _job_rank, args=(list(command), envs, str(cwd), out_dir), nprocs=ranks, join=False, start_method="forkserver"
    )
    return Job(list(command), context, out_dir)


class Job:
    """A job started by :func:`start_job`: its rank processes (to signal), its output so far, and
    :meth:`wait` for its end. As a context manager, it kills the ranks still running at the end of
    the block (a test that failed half-way leaves no job behind)."""

    def __init__(self, command: List[str], context, out_dir: str) -> None:
        self.command, self._context, self._out_dir = command, context, out_dir

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc_info) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()  # SIGKILL: also ends a rank stopped with SIGSTOP
            process.join()
        shutil.rmtree(self._out_dir, ignore_errors=True)

    @property
    def processes(self) -> List[multiprocessing.Process]:
        """The ranks' processes, rank 0 first (``.pid``, ``.exitcode``, ``.is_alive()``)."""
        return list(self._context.processes)

    def output(self, stream: str = "err") -> str:
        """Every rank's ``"out"`` or ``"err"`` so far, rank 0's first."""
        return "".join(Path(self._out_dir, f"rank{r}.{stream}").read_text() for r in range(len(self.processes)))

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 240) -> None:
        """Poll ``condition`` until it holds; fail the test, with the job's output, if the job ends
        first or ``timeout`` seconds pass (generous: the machine may be loaded)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if not any(p.is_alive() for p in self.processes) and not condition():
                raise AssertionError(f"the job ended before {what}:\n{self.output('out')[-3000:]}{self.output()[-5000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s:\n{self.output('out')[-3000:]}{self.output()[-5000:]}")
            time.sleep(0.2)

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Wait for every rank to end (as torchrun does, a failing rank ends the others) and return
        what ``subprocess.run`` would: every rank's output and the first failing rank's exit code."""
        deadline = time.monotonic() + timeout
        try:
            try:
                while not self._context.join(timeout=max(0.0, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        for process in self.processes:
                            process.kill()
                            process.join()
                        raise subprocess.TimeoutExpired(self.command, timeout)
            except mp.ProcessExitedException:
                pass  # a rank failed, and join() ended the others
            code = next((p.exitcode for p in self.processes if p.exitcode), 0)
            return subprocess.CompletedProcess(self.command, code, self.output("out"), self.output("err"))
        finally:
            shutil.rmtree(self._out_dir, ignore_errors=True)


def _job_rank(rank: int, command: list, envs: list, cwd: str, out_dir: str) -> None:
    os.environ.clear()
    os.environ.update(envs[rank])
    # A new interpreter's start method (fork), not the forkserver that started this process: loader
    # workers forked by the job end with it, while the forkserver's would outlive the job.
    multiprocessing.set_start_method(None, force=True)
    if os.environ.get("PYTHONWARNINGS") == "ignore":  # read by a new interpreter only
        warnings.simplefilter("ignore")
    for fd, stream in ((1, "out"), (2, "err")):  # the process's own descriptors: C++ output too
        with open(os.path.join(out_dir, f"rank{rank}.{stream}"), "w") as f:
            os.dup2(f.fileno(), fd)
    os.chdir(cwd)
    try:
        if command[0] == "-m":
            sys.argv = command[1:]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = command
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
            runpy.run_path(command[0], run_name="__main__")
    except Exception:  # as the interpreter does: the traceback to stderr and exit code 1
        traceback.print_exc()
        sys.exit(1)
