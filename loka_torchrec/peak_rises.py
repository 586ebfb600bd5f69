"""Which part of LoKA's planning raised the device's peak memory, and by how much.

A job's peak GPU memory can be set by the step that makes a plan rather than by its steady
steps: the Probe evaluates each candidate at the layer's real shape, the layer check times
scratch layers forward and backward, the gradient check runs the model again. Each of those
phases runs inside :meth:`PeakRises.phase`, which reads ``torch.cuda.max_memory_allocated`` (a
host-side counter: no sync) before and after, and keeps the phases after which it was higher, with
the peak they left. A phase that stayed under the peak so far leaves nothing, so the list is short,
and its last entry is the planning work that set the highest peak of the run so far. Off CUDA,
nothing is read or kept.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Union

import torch

__all__ = ["PeakRises"]

GIB = 2**30


class PeakRises:
    """The phases that raised the peak allocated memory of one device, in order.

    Args:
        min_rise_bytes: a rise smaller than this is not kept (allocator noise).
        most: entries kept; past it the oldest ones are dropped.

    ``rises``: ``[{"phase": name, "rise_gib": by how much, "gib": the peak after it}]``.
    """

    def __init__(self, min_rise_bytes: int = 64 * 2**20, most: int = 16) -> None:
        if min_rise_bytes < 0 or most < 1:
            raise ValueError(f"min_rise_bytes >= 0 and most >= 1 expected, got {min_rise_bytes} and {most}")
        self.min_rise_bytes, self.most = min_rise_bytes, most
        self.rises: List[Dict[str, Union[str, float]]] = []

    @contextlib.contextmanager
    def phase(self, name: str, device: "torch.device | str | None") -> Iterator[None]:
        """Run the block as the phase ``name`` on ``device``; keep its rise of the peak, if any."""
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda":
            yield
            return
        before = torch.cuda.max_memory_allocated(device)
        try:
            yield
        finally:
            self.observe(name, before, torch.cuda.max_memory_allocated(device))

    def observe(self, name: str, before_bytes: int, after_bytes: int) -> None:
        """The peak counter before and after the phase ``name`` (what :meth:`phase` reads)."""
        rise = after_bytes - before_bytes
        if rise > 0 and rise >= self.min_rise_bytes:
            entry = {"phase": name, "rise_gib": rise / GIB, "gib": after_bytes / GIB}
            self.rises = (self.rises + [entry])[-self.most :]
