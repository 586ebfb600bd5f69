"""Checkpoints of a DMP model, its optimizers and LoKA's state: per-rank files, written atomically.

Layout::

    <run_dir>/checkpoints/step_000040/rank0.pt   # this rank's shards (ShardedTensor local shards)
                                     /rank1.pt
                                     /meta.json  # written last, by rank 0, after every rank finished

A checkpoint without ``meta.json`` is incomplete and never loaded. Resuming needs the same world
size (each rank reloads its own shards into the same sharding plan).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from loka_torchrec.atomic_files import atomic_file, write_json_atomic

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint"]

META = "meta.json"


def save_checkpoint(run_dir: str, step: int, state: Dict[str, Any], *, rank: int, world_size: int) -> str:
    """Save this rank's ``state`` for ``step``; returns the checkpoint folder. Collective call."""
    folder = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    os.makedirs(folder, exist_ok=True)
    with atomic_file(os.path.join(folder, f"rank{rank}.pt"), "wb", fsync=True) as f:
        torch.save(state, f)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        write_json_atomic(os.path.join(folder, META), {"step": step, "world_size": world_size})
    if dist.is_initialized():
        dist.barrier()
    return folder


def find_checkpoint(path: str) -> str:
    """A complete checkpoint folder from ``path``: a checkpoint folder, or a run dir (its latest).

    Raises:
        ValueError: naming ``train.resume`` when nothing complete is there.
    """
    if not os.path.exists(path):
        raise ValueError(f"train.resume: {path!r} does not exist")
    if os.path.isfile(os.path.join(path, META)):
        return path
    root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    complete = sorted(
        d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d) and os.path.isfile(os.path.join(root, d, META))
    ) if os.path.isdir(root) else []
    if not complete:
        raise ValueError(f"train.resume: no complete checkpoint (a step_* folder with {META}) under {path!r}")
    return os.path.join(root, complete[-1])


def load_checkpoint(folder: str, *, rank: int, world_size: int, map_location: Optional[str] = None) -> Dict[str, Any]:
    """Load this rank's state from a complete checkpoint folder (see :func:`find_checkpoint`)."""
    with open(os.path.join(folder, META)) as f:
        meta = json.load(f)
    if int(meta["world_size"]) != world_size:
        raise ValueError(
            f"train.resume: checkpoint {folder!r} was written by {meta['world_size']} ranks; this job has {world_size}"
        )
    return torch.load(os.path.join(folder, f"rank{rank}.pt"), map_location=map_location, weights_only=False)
