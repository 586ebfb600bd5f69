"""A watchdog that turns a peer which stops answering into an error naming it, within a bound.

A rank that is stopped (SIGSTOP, a debugger, a swapped-out host) or hung blocks every other rank
in the next collective, silently, until the process group's timeout (600 s) ends it with an
error that names no rank. :class:`PeerWatchdog` runs a thread on every rank that publishes two
counters in the rendezvous store (the ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` that torchrun
sets up): how far the rank got (``-1`` while setting up, then the last step it finished, then
"the end of the run") and a heartbeat it bumps about once a second. When this rank's own progress
has not moved for half of ``timeout_s``, it reads every peer's counters, reads them again when
``timeout_s`` has passed, and names the peers that did not arrive:

* a peer whose heartbeat did not move in between is not running (stopped, hung with the GIL
  held, or gone);
* a peer that is alive but behind this rank and did not move either is stuck in an earlier step.

A peer that is alive and as far as this rank (every rank in a long evaluation, a checkpoint, the
first step's compile) is waited for: slow is not hung. For the peers it names, the watchdog calls
``on_timeout`` with one line; the job's handler logs it and ends the process with ``EXIT_ERROR``
(the main thread is blocked inside a collective, where no exception can reach it). The step
named is the last one the peer published (at most a second old when it stopped).

The store is read only when this rank is stuck, so a healthy job costs each rank at most two small
store writes a second (the heartbeat, and its step when it moved). If the store itself does not
answer (its host, rank 0 or torchrun, is stopped), the message says so instead of naming ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional

from loka_job.training.errors import exception_line

__all__ = ["END_OF_RUN", "SETTING_UP", "PeerWatchdog", "Progress"]

logger = logging.getLogger("loka_job.train")

SETTING_UP = -1
"""Progress of a rank that has not finished its first step: set-up (sharding, LoKA's plan, resume)."""

END_OF_RUN = 2**62
"""Progress of a rank past its last step: the final evaluation, the summary, the shutdown."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """One rank's counters as read from the store."""

    step: int
    beat: int


def describe_progress(step: int, *, waiting: bool = False) -> str:
    """Where a rank is, in words (for messages): where it got to (``after step 12``) or, with
    ``waiting``, where it waits (``in step 13``)."""
    if step == SETTING_UP:
        return "in the set-up" if waiting else "setting up"
    if step >= END_OF_RUN:
        return "at the end of the run" if waiting else "past its last step"
    return f"in step {step + 1}" if waiting else f"after step {step}"


class PeerWatchdog:
    """Watches that every peer keeps up with this rank (see the module docstring).

    Args:
        rank, world_size: this process's.
        timeout_s: the bound, ``train.peer_timeout_s``: a peer that has not arrived when this rank
            has been stuck this long (plus up to a second of polling) is named.
        on_timeout: called once, from the watchdog's thread, with the one-line error and the ranks
            that did not arrive (empty when the store did not answer).
        host, port: the store's (default: ``MASTER_ADDR``, ``MASTER_PORT``).
        prefix: the store keys' prefix; different per torchrun restart, so that a restarted job
            never reads the previous attempt's counters.

    Example::

        watchdog = PeerWatchdog(rank, world_size, timeout_s=300, on_timeout=fail)
        watchdog.start()          # right after the process group is up: covers the set-up
        for step in ...:
            ...
            watchdog.reached(step)
        watchdog.reached(END_OF_RUN)
        watchdog.stop()           # once the ranks have passed their last barrier
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        timeout_s: float,
        on_timeout: Callable[[str, List[int]], None],
        host: Optional[str] = None,
        port: Optional[int] = None,
        prefix: Optional[str] = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"train.peer_timeout_s: must be > 0 to watch peers, got {timeout_s!r}")
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.on_timeout = on_timeout
        self.host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.port = int(port or os.environ.get("MASTER_PORT", "29500"))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = prefix or f"loka_job/peer_watchdog/{restart}"
        self.poll_s = min(1.0, self.timeout_s / 10)
        self._step = SETTING_UP
        self._step_since = time.monotonic()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the training loop's side
    def start(self) -> None:
        """Start the thread (daemon: it never keeps the process alive)."""
        self._thread = threading.Thread(target=self._run, name="loka-peer-watchdog", daemon=True)
        self._thread.start()

    def reached(self, step: int) -> None:
        """This rank finished ``step`` (or reached :data:`END_OF_RUN`). Cheap: no store access."""
        if step != self._step:
            self._step, self._step_since = step, time.monotonic()

    def stop(self) -> None:
        """Stop watching (after the last barrier: peers that end then are not hung)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s + 1)

    # ------------------------------------------------------------------ the thread
    def _key(self, rank: int, counter: str) -> str:
        return f"{self.prefix}/{rank}/{counter}"

    def _connect(self):
        import torch.distributed as dist

        # Its own connection with a short timeout: a store whose host is stopped blocks a call
        # for that long, not for the process group's 600 s.
        return dist.TCPStore(
            self.host, self.port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=max(1.0, self.timeout_s / 2)),
        )  # fmt: skip

    def _run(self) -> None:
        try:
            store = self._connect()
            store.set(self._key(self.rank, "step"), str(SETTING_UP))
            store.set(self._key(self.rank, "beat"), "0")
        except Exception as exc:  # no store to watch through: the job runs on, unwatched
            logger.warning("train.peer_timeout_s: the store at %s:%d cannot be reached (%s); peers are not watched",
                           self.host, self.port, exception_line(exc))  # fmt: skip
            return
        published = SETTING_UP
        snapshot: Optional[Dict[int, Progress]] = None
        snapshot_at = 0.0
        while not self._stopped.wait(self.poll_s):
            step, since = self._step, self._step_since
            try:
                store.add(self._key(self.rank, "beat"), 1)
                if step != published:
                    store.add(self._key(self.rank, "step"), step - published)
                    published = step
            except Exception:  # the next poll tries again; a stuck rank reads the store below
                pass
            now = time.monotonic()
            if now - since < self.timeout_s / 2:
                snapshot = None  # this rank moves: nothing to check
                continue
            if snapshot is None or snapshot_at < since:
                snapshot, snapshot_at = self._read(store), now
                if snapshot is None:
                    return
                continue
            if now - snapshot_at < self.timeout_s / 2:
                continue
            current = self._read(store)
            if current is None:
                return
            missing = self._missing(step, snapshot, current)
            if missing and not self._stopped.is_set():
                self.on_timeout(self._message(step, missing, current, now - since), sorted(missing))
                return
            snapshot, snapshot_at = current, now  # every peer alive and as far: keep waiting

    def _read(self, store) -> Optional[Dict[int, Progress]]:
        """Every peer's counters, or ``None`` after reporting that the store did not answer."""
        try:
            # add(key, 0) reads a counter without waiting for a key that a peer never wrote.
            return {
                r: Progress(step=store.add(self._key(r, "step"), 0), beat=store.add(self._key(r, "beat"), 0))
                for r in range(self.world_size) if r != self.rank
            }  # fmt: skip
        except Exception as exc:
            if not self._stopped.is_set():
                where = describe_progress(self._step, waiting=True)
                self.on_timeout(
                    f"this rank ({self.rank}) has waited {self.timeout_s:g} s {where} and the store at {self.host}:{self.port} "
                    f"does not answer ({exception_line(exc)}): its host (rank 0 or torchrun) may be stopped or hung",
                    [],
                )
            return None

    @staticmethod
    def _missing(step: int, before: Dict[int, Progress], after: Dict[int, Progress]) -> Dict[int, str]:
        """The peers that did not arrive, each with why: not running, or alive but stuck behind."""
        missing = {}
        for rank, now in after.items():
            was = before.get(rank)
            if was is None:
                continue
            if now.beat == was.beat:
                missing[rank] = f"no sign of life, last seen {describe_progress(now.step)}"
            elif now.step < step and now.step == was.step:
                missing[rank] = f"alive but stuck {describe_progress(now.step)}"
        return missing

    def _message(self, step: int, missing: Dict[int, str], current: Dict[int, Progress], waited_s: float) -> str:
        ranks = ", ".join(str(r) for r in sorted(missing))
        why = "; ".join(f"rank {r}: {missing[r]}" for r in sorted(missing))
        return (
            f"rank(s) {ranks} did not arrive within train.peer_timeout_s={self.timeout_s:g} ({why}); this rank "
            f"({self.rank}) waited {waited_s:.0f} s {describe_progress(step, waiting=True)}"
        )
