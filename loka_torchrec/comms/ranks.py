"""The ranks of a comms decision: how many there are, and one answer for all of them.

Each rank times what it runs; a decision that differs between ranks would send different payloads
through one collective. :func:`max_over_ranks` gives every rank the largest of the ranks' numbers
(the slowest rank counts), so all decide alike.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["max_over_ranks", "world_size"]


def world_size(process_group=None) -> int:
    """Ranks of ``process_group`` (1 without an initialized process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def max_over_ranks(values: Sequence[float], process_group=None, device: Optional[torch.device] = None) -> List[float]:
    """Each of ``values``, the largest over the ranks of ``process_group`` (a collective; alone: as
    given). ``device``: where the reduction runs; default the current CUDA device under NCCL, else CPU."""
    if world_size(process_group) == 1:
        return [float(v) for v in values]
    if device is None:
        nccl = "nccl" in str(dist.get_backend(process_group))
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    reduced = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=process_group)
    return reduced.tolist()
