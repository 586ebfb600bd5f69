"""Checkpoints of a DMP model, its optimizers and LoKA's state: per-rank files, checksummed, atomic.

Layout::

    <run_dir>/checkpoints/step_000040/rank0.pt   # this rank's shards (ShardedTensor local shards)
                                     /rank1.pt
                                     /meta.json  # written last, by rank 0, after every rank finished

``meta.json`` holds the step, the world size and, per rank file, its size in bytes and SHA-256
(format 2). A checkpoint without ``meta.json`` is incomplete and never loaded; one whose files do
not match their recorded size and checksum, or do not unpickle, is damaged and never loaded.

Resuming (:func:`resume_checkpoint`) tries the newest checkpoint first. Every rank checks and
reads its own file, the ranks all-gather what each found, and only a checkpoint that every rank
read intact is taken: ranks never disagree on where they resume, and a damaged file on any rank
is a one-line warning naming it, then the next older checkpoint is tried. Resuming needs the same
world size (each rank reloads its own shards into the same sharding plan).

A writer killed mid-file leaves a temporary (``.rank0.pt.<random>.tmp``): the next save in that
run dir removes them, and so does a resume from it (those untouched for a minute).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from loka_torchrec.atomic_files import atomic_file, remove_stale_temporaries, write_json_atomic

__all__ = ["CheckpointError", "save_checkpoint", "resume_checkpoint", "checkpoint_problem", "list_checkpoints"]

logger = logging.getLogger("loka_job.train")

META = "meta.json"
FORMAT = 2  # 1: no per-file size and checksum (still loaded, checked as far as it goes)
STALE_TEMPORARY_S = 60.0  # a resume source's temporaries untouched this long belong to no live writer


class CheckpointError(ValueError):
    """No intact checkpoint to resume from; the message names each one tried and what was wrong."""


class _HashingWriter:
    """A binary file that also counts and hashes what ``torch.save`` writes into it."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.bytes += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _gather(obj: Any) -> List[Any]:
    """Every rank's ``obj`` (a list of one without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_checkpoint(run_dir: str, step: int, state: Dict[str, Any], *, rank: int, world_size: int) -> str:
    """Save this rank's ``state`` for ``step``; returns the checkpoint folder. Collective call.

    Each rank writes its file atomically (fsynced) and reports its size and SHA-256; rank 0 then
    writes ``meta.json`` with all of them, and removes what killed writers left in the run dir:
    temporaries, and older step folders that never got their ``meta.json``.
    """
    folder = os.path.join(_checkpoints_root(run_dir), f"step_{step:06d}")
    os.makedirs(folder, exist_ok=True)
    with atomic_file(os.path.join(folder, _rank_file(rank)), "wb", fsync=True) as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)
    entries = _gather({"rank": rank, "bytes": writer.bytes, "sha256": writer.sha256.hexdigest()})
    if rank == 0:  # every rank has finished its file: any temporary left is a killed writer's
        for path in remove_stale_temporaries(_checkpoints_root(run_dir)):
            logger.warning("checkpoint: removed %s, left by a writer that was killed", path)
        for name, path in list_checkpoints(run_dir):
            if name < os.path.basename(folder) and not os.path.isfile(os.path.join(path, META)):
                shutil.rmtree(path, ignore_errors=True)
                logger.warning("checkpoint: removed the incomplete %s (no %s: its writer was killed)", path, META)
        files = {_rank_file(e["rank"]): {"bytes": e["bytes"], "sha256": e["sha256"]} for e in entries}
        write_json_atomic(
            os.path.join(folder, META), {"format": FORMAT, "step": step, "world_size": world_size, "files": files}, fsync=True
        )
    _gather(None)  # a barrier: nobody goes on before meta.json is there
    return folder


def list_checkpoints(path: str) -> List[Tuple[str, str]]:
    """``(name, folder)`` of the ``step_*`` folders under a run dir (or its ``checkpoints/``),
    oldest first, complete or not."""
    root = _checkpoints_root(path) if os.path.isdir(_checkpoints_root(path)) else path
    if not os.path.isdir(root):
        return []
    names = sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d) and os.path.isdir(os.path.join(root, d)))
    return [(d, os.path.join(root, d)) for d in names]


def _read_meta(folder: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    path = os.path.join(folder, META)
    if not os.path.isfile(path):
        return None, f"incomplete: no {META} (its writer stopped before every rank finished)"
    try:
        with open(path) as f:
            meta = json.load(f)
        step, world_size = int(meta["step"]), int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{META} is unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if not isinstance(meta, dict) or step < 0 or world_size < 1:
        return None, f"{META} is unreadable (step {meta.get('step')!r}, world_size {meta.get('world_size')!r})"
    return meta, None


def checkpoint_problem(folder: str, *, rank: int, world_size: int) -> Optional[str]:
    """What is wrong with this rank's part of a checkpoint, in a few words, or ``None`` if intact.

    Checks ``meta.json`` (present, valid, written for ``world_size`` ranks) and this rank's file
    (present, the recorded size, the recorded SHA-256). Reads the whole file once.
    """
    meta, problem = _read_meta(folder)
    if problem:
        return problem
    if int(meta["world_size"]) != world_size:
        return f"written by {meta['world_size']} ranks; this job has {world_size} (resume needs the same world size)"
    name = _rank_file(rank)
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    recorded = (meta.get("files") or {}).get(name)
    if recorded is None:  # format 1: nothing recorded to compare with; an empty file is still damage
        return f"{name} is empty" if size == 0 else None
    if size != int(recorded["bytes"]):
        return f"{name} has {size} bytes, {META} records {recorded['bytes']} ({'truncated' if size < int(recorded['bytes']) else 'grown'})"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != recorded["sha256"]:
        return f"{name} does not match its SHA-256 in {META} (the file is damaged)"
    return None


def _check_and_load(folder: str, *, rank: int, world_size: int, map_location: Optional[str]):
    problem = checkpoint_problem(folder, rank=rank, world_size=world_size)
    if problem:
        return None, problem
    try:
        state = torch.load(os.path.join(folder, _rank_file(rank)), map_location=map_location, weights_only=False)
    except Exception as exc:  # any unpickling failure is a damaged file: report it in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"{_rank_file(rank)} cannot be read ({type(exc).__name__}: {first[:200]})"
    if not isinstance(state, dict) or "step" not in state:
        return None, f"{_rank_file(rank)} holds no training state"
    return state, None


def resume_checkpoint(
    path: str, *, rank: int, world_size: int, map_location: Optional[str] = None
) -> Tuple[str, Dict[str, Any], List[str]]:
    """The newest checkpoint that every rank reads intact, from ``path``. Collective call.

    Args:
        path: a run dir (its newest intact checkpoint, falling back to older ones) or one
            checkpoint folder (that one, or an error).
        rank, world_size: this process's.
        map_location: ``torch.load``'s.

    Returns:
        ``(folder, this rank's state, skipped)``: ``skipped`` says, one line each, which newer
        checkpoints were passed over and why (the caller logs them as warnings).

    Raises:
        CheckpointError: one line naming ``train.resume``, each checkpoint tried and its problem;
            raised on every rank together.
    """
    if not os.path.exists(path):
        raise CheckpointError(f"train.resume: {path!r} does not exist")
    single = os.path.isfile(os.path.join(path, META)) or re.fullmatch(r"step_\d+", os.path.basename(os.path.normpath(path)))
    candidates = [path] if single else [folder for _, folder in reversed(list_checkpoints(path))]
    if not candidates:
        raise CheckpointError(f"train.resume: no checkpoint (a step_* folder with {META}) under {path!r}")
    if rank == 0 and not single:
        for stale in remove_stale_temporaries(os.path.dirname(candidates[0]), older_than_s=STALE_TEMPORARY_S):
            logger.warning("checkpoint: removed %s, left by a writer that was killed", stale)
    skipped: List[str] = []
    for folder in candidates:
        state, problem = _check_and_load(folder, rank=rank, world_size=world_size, map_location=map_location)
        problems = [(r, p) for r, p in enumerate(_gather(problem)) if p]
        if not problems:
            return folder, state, skipped
        del state
        skipped.append(f"checkpoint {folder} is unusable: " + "; ".join(f"rank {r}: {p}" for r, p in problems))
    if single:
        raise CheckpointError(f"train.resume: {skipped[0]}")
    raise CheckpointError(
        f"train.resume: no intact checkpoint under {path!r} ({len(skipped)} tried): " + " | ".join(skipped)
    )
