"""Checkpoints of a DMP model, its optimizers and LoKA's state: per-rank files, checksummed, atomic.

Layout::

    <run_dir>/checkpoints/step_000040/rank0.pt   # this rank's shards (ShardedTensor local shards)
                                     /rank1.pt
                                     /meta.json  # written last, by rank 0, after every rank finished

``meta.json`` holds the step, the world size and, per rank file, its size in bytes and SHA-256
(format 2), and the job's configuration that the state depends on (model name and options, tables,
LoKA's model mods). A checkpoint without ``meta.json`` is incomplete and never loaded; one whose
files do not match their recorded size and checksum, or do not unpickle, is damaged and never loaded.

Older checkpoints (format 1: no sizes, no checksums) are *unverified*: loading one is a warning
naming the file, after the checks that need no record: each record's CRC-32 in the zip that
``torch.save`` writes (``torch.load`` does not check them), and the state's keys, shapes and dtypes
against the model (:func:`state_mismatch`). ``require_verified`` refuses them instead.

A resume checks the recorded configuration and the world size before it loads any state: a
difference is one line naming the field and both values (:class:`CheckpointMismatch`), not an error
from deep inside TorchRec's ``load_state_dict``.

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
import zipfile
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from loka_job.training.errors import JobError
from loka_torchrec.atomic_files import atomic_file, remove_stale_temporaries, write_json_atomic

__all__ = [
    "CheckpointError", "CheckpointMismatch", "checkpoint_problem", "config_mismatch", "list_checkpoints",
    "resume_checkpoint", "save_checkpoint", "state_mismatch", "verify_checkpoint",
]  # fmt: skip

logger = logging.getLogger("loka_job.train")

META = "meta.json"
FORMAT = 2  # 1: no per-file size and checksum (still loaded, checked as far as it goes)
STALE_TEMPORARY_S = 60.0  # a resume source's temporaries untouched this long belong to no live writer


class CheckpointError(JobError, ValueError):
    """No intact checkpoint to resume from; the message names each one tried and what was wrong."""

    def __init__(self, message: str, *, field: str = "train.resume") -> None:
        super().__init__(message, field=field)


class CheckpointMismatch(CheckpointError):
    """The checkpoint was written for another model, other tables or another world size."""


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


def save_checkpoint(
    run_dir: str, step: int, state: Dict[str, Any], *, rank: int, world_size: int, config: Optional[Dict[str, Any]] = None
) -> str:
    """Save this rank's ``state`` for ``step``; returns the checkpoint folder. Collective call.

    Each rank writes its file atomically (fsynced) and reports its size and SHA-256; rank 0 then
    writes ``meta.json`` with all of them and ``config`` (JSON: what a resume must match, see
    :func:`config_mismatch`), and removes what killed writers left in the run dir: temporaries,
    and older step folders that never got their ``meta.json``.
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
        meta = {"format": FORMAT, "step": step, "world_size": world_size, "files": files}
        if config is not None:
            meta["config"] = config
        write_json_atomic(os.path.join(folder, META), meta, fsync=True)
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


def checkpoint_problem(folder: str, *, rank: int, world_size: int, require_verified: bool = False) -> Optional[str]:
    """What is wrong with this rank's part of a checkpoint, in a few words, or ``None`` if intact.

    Checks ``meta.json`` (present, valid, written for ``world_size`` ranks) and this rank's file
    (present, the recorded size, the recorded SHA-256). Reads the whole file once. A format-1
    file (no size or SHA-256 recorded) is checked by its zip records' CRC-32 instead, or refused
    with ``require_verified``.
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
    if recorded is None:  # format 1: nothing recorded to compare with
        if require_verified:
            return f"{name} is unverified: {META} records no size or SHA-256 (train.require_verified_checkpoints=true)"
        return f"{name} is empty" if size == 0 else _zip_problem(path, name)
    if size != int(recorded["bytes"]):
        return f"{name} has {size} bytes, {META} records {recorded['bytes']} ({'truncated' if size < int(recorded['bytes']) else 'grown'})"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != recorded["sha256"]:
        return f"{name} does not match its SHA-256 in {META} (the file is damaged)"
    return None


def _zip_problem(path: str, name: str) -> Optional[str]:
    """Damage that the zip container of ``torch.save`` shows without any record of ours: a record
    whose bytes do not match its CRC-32 (``torch.load`` reads them unchecked). ``None`` for an
    intact zip, and for a file of the legacy (non-zip) format, which has nothing to check."""
    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"{name} is not a readable zip ({type(exc).__name__}: {str(exc)[:120]})"
    return None if bad is None else f"{name}: its record {bad!r} does not match its CRC-32 (the file is damaged)"


def is_verified(folder: str, *, rank: int) -> bool:
    """Whether ``meta.json`` records this rank's file's size and SHA-256 (format 2)."""
    meta, problem = _read_meta(folder)
    return problem is None and _rank_file(rank) in (meta.get("files") or {})


def verify_checkpoint(folder: str, *, rank: int, world_size: int) -> List[str]:
    """Read every rank's file back and check it against ``meta.json``; ``["rank r: problem", ...]``,
    empty when all are intact. Collective call (every rank reads its own file)."""
    problem = checkpoint_problem(folder, rank=rank, world_size=world_size, require_verified=True)
    return [f"rank {r}: {p}" for r, p in enumerate(_gather(problem)) if p]


def config_mismatch(recorded: Optional[Dict[str, Any]], expected: Optional[Dict[str, Any]]) -> Optional[Tuple[str, Any, Any]]:
    """The first field (dotted path, sorted order) whose value differs between the configuration a
    checkpoint recorded and this run's, as ``(field, recorded value, this run's value)``; a field
    present on one side only has ``"absent"`` on the other. ``None`` when they agree, or when
    either side has no record (an older checkpoint: the state check still runs)."""
    if recorded is None or expected is None:
        return None
    there, here = _flatten(recorded), _flatten(json.loads(json.dumps(expected, default=str)))
    for field in sorted(set(there) | set(here)):
        if there.get(field, "absent") != here.get(field, "absent"):
            return field, there.get(field, "absent"), here.get(field, "absent")
    return None


def _flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def state_mismatch(saved: Dict[str, Any], expected: Dict[str, Any]) -> Optional[str]:
    """How a saved ``state_dict`` does not fit ``expected`` (the model's own), in a few words: the
    first key missing on either side, or whose shape or dtype differs (global shapes for sharded
    tables); ``None`` when every key, shape and dtype agrees."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing:
        return f"{missing[0]} is not in the checkpoint ({len(missing)} key(s) missing)"
    if unexpected:
        return f"{unexpected[0]} is in the checkpoint but not in this model ({len(unexpected)} key(s) more)"
    for key in sorted(expected):
        there, here = _shape_and_dtype(saved[key]), _shape_and_dtype(expected[key])
        if there != here:
            return f"{key} is {_describe_tensor(there)} there, {_describe_tensor(here)} here"
    return None


def _shape_and_dtype(value: Any) -> Optional[Tuple[Tuple[int, ...], str]]:
    """A tensor's (or ShardedTensor's global) shape and dtype; ``None`` for anything else."""
    if isinstance(value, torch.Tensor) and not hasattr(value, "metadata"):
        return tuple(value.shape), str(value.dtype)
    if hasattr(value, "metadata") and callable(value.metadata):  # ShardedTensor: the whole table
        try:
            return tuple(value.size()), str(value.metadata().tensor_properties.dtype)
        except AttributeError:
            return None
    return None


def _describe_tensor(shape_and_dtype: Optional[Tuple[Tuple[int, ...], str]]) -> str:
    if shape_and_dtype is None:
        return "not a tensor"
    shape, dtype = shape_and_dtype
    return f"{tuple(shape)} {dtype.removeprefix('torch.')}"


def _check_and_load(folder: str, *, rank: int, world_size: int, map_location: Optional[str], require_verified: bool):
    problem = checkpoint_problem(folder, rank=rank, world_size=world_size, require_verified=require_verified)
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


def _check_fit(folder: str, *, world_size: int, config: Optional[Dict[str, Any]]) -> None:
    """Raise :class:`CheckpointMismatch` (on every rank: they read the same ``meta.json``) if the
    checkpoint in ``folder`` was written by another world size or configuration."""
    meta, problem = _read_meta(folder)
    if problem:
        return  # unreadable: the integrity checks name it
    differences = []
    if int(meta["world_size"]) != world_size:
        differences.append(("world_size", meta["world_size"], world_size))
    difference = config_mismatch(meta.get("config"), config)
    if difference is not None:
        differences.append(difference)
    found = [d for per_rank in _gather(differences) for d in per_rank]
    if found:
        field, there, here = found[0]
        need = "the same world size (each rank reloads its own shards)" if field == "world_size" else "the same model and tables"
        raise CheckpointMismatch(
            f"checkpoint {folder} was written with {field}={_show(there)}; this run has {field}={_show(here)} "
            f"(a resume needs {need})",
            field=field,
        )


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def resume_checkpoint(
    path: str,
    *,
    rank: int,
    world_size: int,
    map_location: Optional[str] = None,
    config: Optional[Dict[str, Any]] = None,
    model_state: Optional[Dict[str, Any]] = None,
    require_verified: bool = False,
) -> Tuple[str, Dict[str, Any], List[str]]:
    """The newest checkpoint that every rank reads intact, from ``path``. Collective call.

    Args:
        path: a run dir (its newest intact checkpoint, falling back to older ones) or one
            checkpoint folder (that one, or an error).
        rank, world_size: this process's.
        map_location: ``torch.load``'s.
        config: this run's configuration (as :func:`save_checkpoint` records it); checked against
            the checkpoint's record before any state is read.
        model_state: the model's own ``state_dict``: the checkpoint's model state must have the
            same keys, shapes and dtypes (:func:`state_mismatch`).
        require_verified: refuse (skip, as damaged) a file whose size and SHA-256 are not recorded.

    Returns:
        ``(folder, this rank's state, skipped)``: ``skipped`` says, one line each, which newer
        checkpoints were passed over and why (the caller logs them as warnings). Loading an
        unverified file is a warning here, naming it.

    Raises:
        CheckpointError: one line naming ``train.resume``, each checkpoint tried and its problem;
            raised on every rank together.
        CheckpointMismatch: the checkpoint to load was written for another world size,
            configuration or model (no fallback: older ones were too); every rank together.
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
        _check_fit(folder, world_size=world_size, config=config)
        state, problem = _check_and_load(
            folder, rank=rank, world_size=world_size, map_location=map_location, require_verified=require_verified
        )
        problems = [(r, p) for r, p in enumerate(_gather(problem)) if p]
        if not problems:
            _check_state(folder, state, model_state)
            if not is_verified(folder, rank=rank):
                logger.warning(
                    "train.resume: %s is unverified: its %s (format 1) records no size or SHA-256; checked only that its "
                    "zip records match their CRC-32 and that its keys, shapes and dtypes fit the model "
                    "(train.require_verified_checkpoints=true refuses such files)",
                    os.path.join(folder, _rank_file(rank)), META,
                )  # fmt: skip
            return folder, state, skipped
        del state
        skipped.append(f"checkpoint {folder} is unusable: " + "; ".join(f"rank {r}: {p}" for r, p in problems))
    if single:
        raise CheckpointError(f"train.resume: {skipped[0]}")
    raise CheckpointError(
        f"train.resume: no intact checkpoint under {path!r} ({len(skipped)} tried): " + " | ".join(skipped)
    )


def _check_state(folder: str, state: Dict[str, Any], model_state: Optional[Dict[str, Any]]) -> None:
    """Raise :class:`CheckpointMismatch` on every rank if any rank's model state does not fit its model."""
    mismatch = None if model_state is None else state_mismatch(state.get("model") or {}, model_state)
    found = [(r, m) for r, m in enumerate(_gather(mismatch)) if m]
    if found:
        r, mismatch = found[0]
        raise CheckpointMismatch(
            f"checkpoint {folder} does not fit this model (rank {r}): {mismatch}", field="model"
        )
