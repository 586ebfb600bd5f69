"""The training steps a :class:`~loka_torchrec.Loka` hears about: one block at a time, numbers increasing.

``with loka.step(s):`` around each training step is how a job drives LoKA. What goes wrong
silently otherwise, and is refused here:

* ``loka.step(s)`` without ``with`` does nothing (the block is never entered): the object warns
  when it is dropped unentered, and the next ``loka.step`` raises;
* a step number that repeats or goes backwards (the Probe and Dispatch schedule by it; a plan due
  at step 2 would never come): raises;
* a ``loka.step`` block inside another: raises.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional

__all__ = ["StepBlock", "StepOrder"]


class StepOrder:
    """The step numbers seen so far, and the block that is open or waiting to be entered.

    Attributes:
        last: the last step that ended (0: none yet; a resumed run starts from its checkpoint's step).
        inside: the step whose block is open, else ``None``.
        pending: the step of a block made by ``loka.step`` and not entered yet, else ``None``.
    """

    def __init__(self) -> None:
        self.last = 0
        self.inside: Optional[int] = None
        self.pending: Optional[int] = None

    def made(self, step: Any) -> None:
        """``loka.step(step)`` was called: the previous block must have been entered."""
        if self.pending is not None:
            never = self.pending
            self.pending = None
            raise RuntimeError(
                f"loka.step({never}) was never entered, so LoKA did nothing in that step: "
                f"write `with loka.step(step):` around each training step"
            )
        self.check_number(step, call="loka.step")
        self.pending = step

    def enter(self, step: int) -> None:
        """A block opens: not inside another, with a number after the last one."""
        self.pending = None
        if self.inside is not None:
            raise RuntimeError(
                f"loka.step({step}) inside the block of loka.step({self.inside}): one `with loka.step(step):` per "
                f"training step, not nested"
            )
        self.check_next(step, call="loka.step")

    def check_number(self, step: Any, *, call: str) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{call}: step: expected the training step's number, an int >= 1, got {step!r}")

    def check_next(self, step: Any, *, call: str) -> None:
        """``step`` is a valid number after :attr:`last`."""
        self.check_number(step, call=call)
        if step <= self.last:
            raise ValueError(
                f"{call}({step}): step {self.last} has already ended; step numbers must increase by training step "
                f"(a resumed run goes on from its checkpoint's step + 1)"
            )


class StepBlock:
    """What :meth:`Loka.step <loka_torchrec.Loka.step>` returns: a context manager for one training step.

    Entering it starts the step (compiled modules run eagerly where the Probe needs it), leaving it
    without an exception reports the step (:meth:`Loka.step_end <loka_torchrec.Loka.step_end>`).
    A block that is dropped without ever being entered warns (``RuntimeWarning``) where it was made.
    """

    def __init__(self, loka: Any, step: int, *, timed: bool, where: tuple) -> None:
        # loka: the Loka whose _begin_step / _end_step run the step (not imported: prepare imports this module)
        self._loka, self.step, self._timed, self._where = loka, step, timed, where
        self._entered = False
        self._eager: Any = None
        self._ran_eagerly = True

    def __enter__(self) -> "StepBlock":
        self._entered = True
        self._eager, self._ran_eagerly = self._loka._begin_step(self.step)
        self._eager.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._eager.__exit__(exc_type, exc, tb)
        finally:
            self._loka._end_step(self.step, completed=exc_type is None, timed=self._timed, ran_eagerly=self._ran_eagerly)
        return False

    def __del__(self) -> None:
        if self._entered or sys is None or sys.meta_path is None:  # entered, or the interpreter is shutting down
            return
        try:
            filename, lineno = self._where
            warnings.warn_explicit(
                f"loka.step({self.step}) was never entered, so LoKA did nothing in that step: write "
                f"`with loka.step(step):` around each training step",
                RuntimeWarning, filename, lineno,
            )  # fmt: skip
        except Exception:  # a warning filter set to "error": __del__ cannot raise
            pass
