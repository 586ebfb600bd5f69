"""Process-group set-up for ``torchrun`` (or a single process) on CPU/gloo or CUDA/nccl."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DistContext", "init_distributed", "resolve_device"]


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda if a GPU is visible else cpu; ``"cpu"`` / ``"cuda"`` as given."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: expected one of auto, cpu, cuda; got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA GPU is visible (use device=cpu)")
    return torch.device(name)


def init_distributed(device_name: str = "auto", *, timeout_s: int = 600) -> DistContext:
    """Initialize the default process group from torchrun's environment, or a 1-rank group.

    CPU uses gloo, CUDA uses nccl with ``LOCAL_RANK`` picking the GPU.
    """
    device = resolve_device(device_name)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain single process: make a 1-rank group
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return DistContext(rank, world_size, local_rank, local_world_size, device, backend)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
