"""SIGTERM (preemption) as a request to stop after the step in progress, on every rank together.

A scheduler that preempts a job sends SIGTERM and kills it some seconds later; ``torchrun``
forwards the signal to every worker. Python's default ends the process at once, mid-step, with no
checkpoint. :class:`StopSignal` replaces that with a flag: the handler only records the signal
(nothing else is safe inside a handler), and the training loop reads the flag once per step, in
the all-reduce every step already makes before its backward
(:meth:`~loka_job.training.nonfinite.NonFiniteSteps.install`). A rank that got the signal thus
tells the others in the same step, even when the signal reached only one rank or reached the
ranks in different steps: every rank finishes that step and stops after it.

Not covered: a rank blocked in a collective runs the handler only once the collective returns (a
hung peer is the peer watchdog's, :mod:`~loka_job.training.peer_watchdog`).
"""

from __future__ import annotations

import signal
from typing import Any, Optional

__all__ = ["StopSignal"]


class StopSignal:
    """Records SIGTERM instead of dying of it (see the module docstring).

    Example::

        >>> import os
        >>> stop = StopSignal()
        >>> stop.install()
        >>> os.kill(os.getpid(), signal.SIGTERM)
        >>> stop.received
        'SIGTERM'
        >>> stop.uninstall()
    """

    signals = (signal.SIGTERM,)

    def __init__(self) -> None:
        self.received: Optional[str] = None  # the signal's name, once one came
        self._previous: dict = {}

    def install(self) -> None:
        """Handle the signals from now on (main thread only, as Python requires)."""
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Give the signals their previous handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """Whether this process was asked to stop."""
        return self.received is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
