"""How a rank ends: ``exit_process`` (flushed output, no interpreter teardown), ``spawn_ranks``,
and the gloo abort at interpreter exit that this avoids (scripts/gloo_exit_abort.py)."""

import os
import re
import subprocess
import sys

import pytest
import torch.multiprocessing as mp

from multirank import spawn_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPRO = os.path.join(ROOT, "scripts", "gloo_exit_abort.py")

# Output still in Python's buffers, a log record, an exit handler that must not run.
_EXITS = """
import atexit, logging, sys
from loka_job.training.distributed import exit_process
atexit.register(lambda: print("exit handler ran"))
handler = logging.FileHandler(sys.argv[1], delay=False)
logging.getLogger("t").addHandler(handler)
logging.getLogger("t").warning("logged")
print("buffered", end="")
sys.stderr.write("err")
exit_process(3)
"""


def test_exit_process_flushes_the_output_and_skips_interpreter_teardown(tmp_path):
    log = tmp_path / "log.txt"
    proc = subprocess.run([sys.executable, "-c", _EXITS, str(log)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == "buffered" and proc.stderr == "err"  # no "exit handler ran": no teardown
    assert log.read_text() == "logged\n"


def _write(rank, out_dir):
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write("done")


def _fail_on_rank_1(rank):
    if rank == 1:
        raise ValueError("rank 1 fails")


@pytest.mark.slow
def test_spawned_ranks_run_to_the_end_and_a_failing_rank_still_fails(tmp_path):
    spawn_ranks(_write, (str(tmp_path),), nprocs=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails"):
        spawn_ranks(_fail_on_rank_1, (), nprocs=2)


def _staged(runs, end):
    """How many of ``runs`` forced-race jobs of the reproducer had a rank abort."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, REPRO, "--runs", str(runs), "--staged", "--end", end]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(re.search(r"(\d+) with a rank aborted", proc.stdout).group(1))


@pytest.mark.slow
def test_the_forced_race_aborts_a_rank_that_returns_and_not_one_that_ends_with_exit_process():
    # Rank 1's gloo worker finishes a Work issued in a backward while the main thread keeps the
    # GIL up to interpreter exit. Returning normally aborted 9 of 10 such jobs (torch 2.13,
    # Python 3.11): one of 3 fails to abort about once in a thousand. If none aborts any more,
    # an upgrade has fixed it upstream and exit_process may no longer be needed.
    assert _staged(3, "return") >= 1
    assert _staged(2, "exit_process") == 0
