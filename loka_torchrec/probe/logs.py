"""The Probe's files in a run directory, and how to read them back.

Layout under ``RUN_DIR/probe/``:

* ``rank{r}.jsonl``: one JSON object per line, one line per layer per report of rank ``r``,
  appended and flushed line by line (fsynced when the Probe closes), so a killed run
  leaves every complete line readable. Fields: ``v`` (format version), ``step``, ``rank``,
  ``world_size``, ``layer``, ``event`` (``"probe"``, ``"plan"``, ``"fallback"``,
  ``"recovering"``, ``"readmit"``), ``phase`` (``"warmup"``/``"monitor"``), ``shape``
  (``in_features``, ``out_features``, ``rows``), ``stats`` (per tensor ``act``/``grad``: this
  rank's ``local`` digest, the ``merged`` digest of all ranks, and the ``rank_deviation``;
  ``weight``: the weight digest), and, when the report measured them, ``evidence`` (a list of
  :meth:`CandidateEvidence.to_dict` records, each with an ``errors`` dict holding the
  Gaussian, weight-model and captured measurements), ``triggers`` and ``state``.
* ``summary.json``: rank 0's merged view (latest statistics, amax/kurtosis history, latest
  evidence, state and events per layer), replaced atomically after every report.

Non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON);
``float()`` reads them back.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import loka_torchrec.atomic_files as atomic_files
from loka_torchrec.json_values import to_jsonable

__all__ = ["ProbeLog", "write_json_atomic", "read_rank_log", "read_summary", "to_jsonable", "rank_log_paths", "LOG_VERSION"]

LOG_VERSION = 1
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


class ProbeLog:
    """Append-only JSON-lines log of one rank: ``RUN_DIR/probe/rank{rank}.jsonl``.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     log = ProbeLog(d, rank=0)
        ...     log.write({"step": 0, "layer": "fc", "amax": float("inf")})
        ...     log.close()
        ...     read_rank_log(log.path)[0][0]["amax"]
        'inf'
    """

    def __init__(self, run_dir: "str | os.PathLike", rank: int) -> None:
        self.dir = Path(run_dir) / "probe"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank{rank}.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Dict[str, Any]) -> None:
        """Append one record as one line and flush it to the OS."""
        line = json.dumps(to_jsonable(record), separators=(",", ":"), allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()

    def sync(self) -> None:
        """Flush and fsync (called when the log closes)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.sync()
            self._file.close()


def write_json_atomic(path: "str | os.PathLike", obj: Any) -> None:
    """Write ``obj`` as strict JSON to ``path`` atomically and fsynced (non-finite floats as strings)."""
    atomic_files.write_json_atomic(path, obj, fsync=True)


def read_rank_log(path: "str | os.PathLike") -> Tuple[List[Dict[str, Any]], List[str]]:
    """Records of one rank log, skipping lines that do not parse (a killed run's last line).

    Every skipped line raises a ``UserWarning`` and is listed in the returned problems.

    Returns:
        ``(records, problems)``.
    """
    path = Path(path)
    records: List[Dict[str, Any]] = []
    problems: List[str] = []
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                problem = f"{path.name} line {number}: skipped an unreadable record ({exc.__class__.__name__}; a truncated last line means the run was killed mid-write)"
                warnings.warn(problem, stacklevel=2)
                problems.append(problem)
                continue
            records.append(record)
    return records, problems


def read_summary(path: "str | os.PathLike") -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``(summary, None)``, or ``(None, problem)`` when ``summary.json`` is missing or unreadable."""
    path = Path(path)
    if not path.exists():
        return None, f"{path.name} is missing"
    try:
        with open(path, "r", encoding="utf-8") as f:
            summary = json.load(f)
        if not isinstance(summary, dict) or "layers" not in summary:
            raise ValueError("no 'layers' key")
    except ValueError as exc:
        return None, f"{path.name} is unreadable ({exc})"
    return summary, None


def rank_log_paths(probe_dir: "str | os.PathLike") -> Dict[int, Path]:
    """``{rank: path}`` of the ``rank{r}.jsonl`` files in ``probe_dir``."""
    out: Dict[int, Path] = {}
    probe_dir = Path(probe_dir)
    if not probe_dir.is_dir():
        return out
    for entry in probe_dir.iterdir():
        match = _RANK_FILE.match(entry.name)
        if match and entry.is_file():
            out[int(match.group(1))] = entry
    return dict(sorted(out.items()))
