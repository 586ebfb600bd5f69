"""The job's expected fatal errors, the exit codes, and the one line the entry point prints for them.

An expected error is one a user can act on: a bad override, a missing resume path, a run dir in
use, a checkpoint that does not fit the model, a feature id outside its table, a peer that stopped
answering. The entry point (``python -m loka_job.train``) prints it as one line on stderr,
``error: <what> (<field>)``, with ``<field>`` the setting or input to look at, and exits with
:data:`EXIT_ERROR`; the traceback goes to the rank's ``train.log`` only. Any other exception is a
bug and keeps its traceback on stderr.

Example::

    >>> error_line(ValueError("train.steps: expected an int, got 'abc'"))
    "error: expected an int, got 'abc' (train.steps)"
    >>> error_line(JobError("the loss was not finite", field="train.max_nonfinite_steps"))
    'error: the loss was not finite (train.max_nonfinite_steps)'
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["EXIT_ERROR", "EXIT_PREEMPTED", "ConfigError", "JobError", "error_field", "error_line", "peer_gone_error"]

EXIT_ERROR = 1
"""An expected fatal error (one line on stderr) or an unexpected one (its traceback)."""

EXIT_PREEMPTED = 75
"""Stopped by SIGTERM after the step in progress, with a final checkpoint where checkpoints are on:
resume to go on. 75 is ``EX_TEMPFAIL`` of ``sysexits.h`` ("try again later")."""

# What gloo's collectives raise (a plain RuntimeError) when the rank at the other end has ended.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")

# A message that starts with the setting it is about: "train.steps: ...", "dispatch.max_mere: ...",
# or with its dotted path ("model.hidden must be ...").
_LEADING_FIELD = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)*): ")
_LEADING_PATH = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)+)\b")


class JobError(Exception):
    """An expected fatal error of the job: printed as one line naming ``field``.

    Args:
        message: what went wrong and what to do, one line.
        field: the setting or input it is about (``train.resume``, ``feature cat_3``).
        every_rank: raised by every rank together (the ranks agreed on it, or it came from the
            same configuration): printed by rank 0 only. ``False``: raised by this rank alone
            (its own batch, its own peers' silence): printed by the rank that raised it.
    """

    def __init__(self, message: str, *, field: Optional[str] = None, every_rank: bool = True) -> None:
        super().__init__(message)
        self.field = field
        self.every_rank = every_rank


class ConfigError(JobError, ValueError):
    """A configuration error found while the job is set up (a ``ValueError`` or ``TypeError`` of a
    config check, re-raised as this with the same message)."""


def error_field(exc: BaseException) -> Optional[str]:
    """The setting ``exc`` is about: a :class:`JobError`'s ``field``, else the ``field: `` or the
    dotted path that starts its message, else ``None``."""
    field = getattr(exc, "field", None)
    if field:
        return field
    match = _LEADING_FIELD.match(str(exc)) or _LEADING_PATH.match(str(exc))
    return match.group(1) if match else None


def error_line(exc: BaseException) -> str:
    """``error: <what> (<field>)``: the first line of ``exc``'s message, without a leading
    ``<field>: `` (it moves to the end)."""
    lines = str(exc).strip().splitlines()
    message = lines[0] if lines else type(exc).__name__
    field = error_field(exc)
    if field and message.startswith(f"{field}: "):
        message = message[len(field) + 2:]
    return f"error: {message} ({field})" if field else f"error: {message}"


def exception_line(exc: BaseException, limit: int = 200) -> str:
    """``<Type>: <first line of the message>`` (at most ``limit`` characters of it), or the type alone:
    a failure named in one line of a log, a report or a JSON file."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:limit]}" if text else type(exc).__name__


def peer_gone_error(exc: BaseException, *, rank: int) -> Optional[JobError]:
    """``exc`` as a :class:`JobError` if it is a collective that failed because a peer rank ended
    (its own error says why, on its own stderr), else ``None``. Printed by every rank that saw
    it, since each saw it alone."""
    import torch.distributed as dist

    text = str(exc)
    if not (isinstance(exc, dist.DistError) or isinstance(exc, RuntimeError) and any(s in text for s in _PEER_GONE)):
        return None
    said = re.search(r"Connection (?:closed|reset) by peer[^.]*", text)
    first = said.group(0) if said else (text.strip().splitlines() or [type(exc).__name__])[0][:200]
    return JobError(
        f"a collective of rank {rank} failed: {first}: a peer rank ended or cannot be reached (its own error says why)",
        field="peer ranks",
        every_rank=False,
    )
