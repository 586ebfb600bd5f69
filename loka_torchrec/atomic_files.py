"""Files written atomically: a reader sees the old file or the new one, never a half-written one.

Every writer of the project (checkpoints, plans, summaries, benchmark reports) goes through
:func:`atomic_file`: the content goes to a temporary file in the target's folder, is flushed (and
fsynced where asked), and then renamed over the target with ``os.replace``. A failure removes the
temporary file and leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from typing import IO, Any, Iterator, List

from loka_torchrec.json_values import to_jsonable

__all__ = ["atomic_file", "is_temporary", "remove_stale_temporaries", "write_text_atomic", "write_json_atomic"]


@contextlib.contextmanager
def atomic_file(path: "str | os.PathLike", mode: str = "w", *, fsync: bool = False) -> Iterator[IO]:
    """Open a temporary file next to ``path`` (``mode`` ``"w"`` or ``"wb"``); rename it onto ``path`` on success.

    Args:
        path: the target; its folder is created if missing.
        mode: ``"w"`` (text, UTF-8) or ``"wb"``.
        fsync: also ``fsync`` before the rename (survives a machine crash, not only a killed process).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with atomic_file(os.path.join(d, "a.txt")) as f:
        ...         _ = f.write("hello")
        ...     open(os.path.join(d, "a.txt")).read()
        'hello'
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode: expected 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are for every reader of the folder
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def is_temporary(name: str) -> bool:
    """Whether ``name`` (a file name, no folder) is one of :func:`atomic_file`'s temporaries."""
    return name.startswith(".") and name.endswith(".tmp")


def remove_stale_temporaries(root: "str | os.PathLike", *, older_than_s: float = 0.0) -> List[str]:
    """Delete the temporaries that a killed writer left under ``root`` (a ``SIGKILL`` skips the
    clean-up of :func:`atomic_file`); returns the paths removed.

    Args:
        root: searched recursively; a missing folder removes nothing.
        older_than_s: only temporaries not modified for this many seconds (a live writer's file
            changes as it grows); 0 removes every temporary, for a caller that knows no writer runs.
    """
    removed: List[str] = []
    now = time.time()
    for folder, _, files in os.walk(os.fspath(root)):
        for name in files:
            path = os.path.join(folder, name)
            try:
                if is_temporary(name) and now - os.path.getmtime(path) >= older_than_s:
                    os.unlink(path)
                    removed.append(path)
            except FileNotFoundError:  # another rank removed it first
                continue
    return removed


def write_text_atomic(path: "str | os.PathLike", text: str, *, fsync: bool = False) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, "w", fsync=fsync) as f:
        f.write(text)


def write_json_atomic(path: "str | os.PathLike", obj: Any, *, fsync: bool = False, **dump_kwargs: Any) -> None:
    """``json.dump(obj, indent=1, **dump_kwargs)`` to ``path`` atomically (see :func:`atomic_file`),
    as strict JSON: non-finite floats become strings (:func:`~loka_torchrec.json_values.to_jsonable`)."""
    with atomic_file(path, "w", fsync=fsync) as f:
        json.dump(to_jsonable(obj), f, **{"indent": 1, **dump_kwargs, "allow_nan": False})
