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
from typing import Any, Iterator, IO

__all__ = ["atomic_file", "write_text_atomic", "write_json_atomic"]


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


def write_text_atomic(path: "str | os.PathLike", text: str, *, fsync: bool = False) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, "w", fsync=fsync) as f:
        f.write(text)


def write_json_atomic(path: "str | os.PathLike", obj: Any, *, fsync: bool = False, **dump_kwargs: Any) -> None:
    """``json.dump(obj, indent=1, **dump_kwargs)`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, "w", fsync=fsync) as f:
        json.dump(obj, f, **{"indent": 1, **dump_kwargs})
