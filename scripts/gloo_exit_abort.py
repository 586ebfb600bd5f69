"""Minimal reproduction of the SIGABRT at the end of 2-rank gloo jobs (no TorchRec, no LoKA).

Each rank issues an asynchronous gloo all-reduce, drops the ``Work`` and ends. The gloo worker
thread that finishes the ``Work`` then holds its last reference and releases it: ``~AsyncWork``
(``noexcept``) releases the Python objects the ``Work`` keeps alive and takes the GIL for that.
Issued during a backward (from a gradient hook, as DDP's reducer and TorchRec's backward
all-to-alls are), the ``Work`` holds the ``contextvars.Context`` that ``Tensor.backward`` stashed
in the thread-local state; issued outside one, it holds its input tensor, whose Python object
outlived the script's last reference to it (torch keeps a tensor's Python object while C++ holds
the tensor). If the main thread is starting interpreter finalization then, Python 3.11 ends the
worker with ``pthread_exit`` and the forced unwind calls ``std::terminate``: the rank dies with
"terminate called without an active exception". ``docs/reliability.md`` has the stacks.

    python scripts/gloo_exit_abort.py --runs 30                     # issued in a backward
    python scripts/gloo_exit_abort.py --runs 30 --issue forward     # issued outside a backward
    python scripts/gloo_exit_abort.py --runs 30 --end exit_process  # the project's ending
    python scripts/gloo_exit_abort.py --runs 5 --staged             # the race forced

``--staged`` makes the race near certain instead of likely: rank 0 joins the all-reduce a second
late while rank 1's main thread keeps the GIL (``sys.setswitchinterval``) in a busy loop, so rank
1's worker finishes the ``Work`` while it waits for the GIL, and still waits when finalization
starts.

``--end``: ``return`` ends the script normally; ``shutdown`` runs
:func:`loka_job.training.distributed.shutdown_distributed` (barrier, destroy the group) first;
``exit_process`` runs it and then :func:`~loka_job.training.distributed.exit_process`
(``os._exit``), as the project's entry points do. Prints one line: how many jobs had a rank abort.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from loka_job.training.distributed import exit_process, shutdown_distributed

ABORT = "terminate called without an active exception"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="2-rank jobs to run")
    p.add_argument("--issue", choices=("backward", "forward"), default="backward", help="where the all-reduce is issued")
    p.add_argument("--end", choices=("return", "shutdown", "exit_process"), default="return", help="how each rank ends")
    p.add_argument("--staged", action="store_true", help="force the race (see the module's docstring)")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def rank_main(args) -> None:
    """One rank: a gloo all-reduce issued asynchronously and never waited for, then the end."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=2)
    x = torch.ones(4, requires_grad=True)

    def all_reduce_in_backward(grad):
        dist.all_reduce(grad.detach().clone(), async_op=True)  # the Work is dropped at once

    if args.issue == "backward":
        x.register_hook(all_reduce_in_backward)
    else:
        dist.all_reduce(torch.ones(4), async_op=True)
    if args.staged and args.rank == 0:
        time.sleep(1.0)
    if args.staged:
        sys.setswitchinterval(1000.0)  # the main thread hands the GIL over only when it blocks
    (2 * x).sum().backward()
    if args.staged and args.rank == 1:
        start = time.perf_counter()
        while time.perf_counter() - start < 2.0:  # rank 0's all-reduce arrives meanwhile
            pass
    if args.end != "return":
        shutdown_distributed()
    if args.end == "exit_process":
        exit_process(0)


def run_jobs(args) -> collections.Counter:
    """``args.runs`` 2-rank jobs of this script; counts the jobs by their outcome."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    flags = ["--issue", args.issue, "--end", args.end] + (["--staged"] if args.staged else [])
    outcomes = collections.Counter()
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            ranks = [
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), *flags, "--rank", str(r), "--store", os.path.join(tmp, "store")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                )
                for r in range(2)
            ]  # fmt: skip
            errors = [p.communicate(timeout=300)[1] for p in ranks]
            codes = [p.returncode for p in ranks]
        if any(ABORT in e for e in errors):
            outcomes["aborted"] += 1
        elif codes == [0, 0]:
            outcomes["ok"] += 1
        else:
            outcomes[f"failed {codes}"] += 1
            print(errors[0][-1000:], errors[1][-1000:], file=sys.stderr)
    return outcomes


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    outcomes = run_jobs(args)
    mode = f"issue={args.issue} end={args.end}" + (" staged" if args.staged else "")
    print(f"{mode}: {args.runs} jobs, {outcomes['aborted']} with a rank aborted ({ABORT!r}), {outcomes['ok']} ok, "
          f"{args.runs - outcomes['aborted'] - outcomes['ok']} failed otherwise", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
