"""One job per run dir: a lock file that a second job given the same run dir is refused by.

Two jobs writing one run dir interleave their metrics and overwrite each other's checkpoints and
summary, and both exit 0. :func:`lock_run_dir` takes an exclusive ``flock`` on
``<run_dir>/job.lock`` for the life of the process and writes the holder's pid, host and start
time into it; a second job finds the lock held and is refused with one line naming the dir and
the holder. The kernel releases a ``flock`` when its process ends, however it ends, so a job that
was killed leaves no lock behind, only the file with its pid: the next job takes the lock and says
(:attr:`RunDirLock.took_over`, which the job logs as a warning) that it took over the lock of a job
that ended without releasing it. A job that ends normally (or
with an error it reports) removes the file.

Rank 0 takes the lock (the other ranks of the job share its run dir). Hydra writes its
``.hydra/`` files into the run dir before the job starts, so a refused job has rewritten those.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from typing import Any, Dict, Optional

from loka_job.training.errors import JobError

__all__ = ["LOCK_FILE", "RunDirLock", "RunDirLocked", "lock_run_dir"]

LOCK_FILE = "job.lock"


class RunDirLocked(JobError):
    """Another live job holds the run dir."""


class RunDirLock:
    """A held run-dir lock; :meth:`release` removes the lock file and lets go of the lock.

    Attributes:
        took_over: one line naming the job whose lock file this one took over (it ended without
            releasing it), or ``None``.
    """

    def __init__(self, path: str, fd: int, took_over: Optional[str] = None) -> None:
        self.path, self._fd, self.took_over = path, fd, took_over

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # first: a job that opens the path now creates a new file
        except FileNotFoundError:
            pass
        os.close(self._fd)  # releases the flock
        self._fd = None


def lock_run_dir(run_dir: str) -> RunDirLock:
    """Take ``run_dir``'s lock for this process, or raise :class:`RunDirLocked` naming the holder.

    A lock file left by a job that ended without releasing it (its process is gone, so its
    ``flock`` is too) is taken over; :attr:`RunDirLock.took_over` names that job.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     lock = lock_run_dir(d)
        ...     os.path.isfile(os.path.join(d, LOCK_FILE)), lock.release(), os.listdir(d)
        (True, None, [])
    """
    path = os.path.join(run_dir, LOCK_FILE)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirLocked(
                f"run dir {run_dir} is in use by another job ({_describe(holder)}); give this job its own run dir",
                field="hydra.run.dir",
            ) from None
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(fd)  # the holder released it and removed the file between our open and flock: again
    previous = _read_holder(fd)
    took_over = None
    if previous:
        took_over = f"run dir {run_dir}: took over the lock of a job that ended without releasing it ({_describe(previous)})"
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_me()).encode() + b"\n", 0)
    return RunDirLock(path, fd, took_over)


def _me() -> Dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def _read_holder(fd: int) -> Optional[Dict[str, Any]]:
    try:
        text = os.pread(fd, 1 << 16, 0).decode(errors="replace").strip()
    except OSError:
        return None
    if not text:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return {"unreadable": text[:80]}
    return holder if isinstance(holder, dict) else {"unreadable": text[:80]}


def _describe(holder: Optional[Dict[str, Any]]) -> str:
    if not holder:
        return "pid and host not recorded yet"
    if "unreadable" in holder:
        return f"its lock file holds {holder['unreadable']!r}"
    alive = ""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        alive = ", running" if _pid_alive(holder["pid"]) else ", not running"
    return f"pid {holder.get('pid')} on {holder.get('host')}{alive}, started {holder.get('started')}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
