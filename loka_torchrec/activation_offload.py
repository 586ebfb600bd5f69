"""Autograd's saved activations kept in host memory between the forward and the backward.

A compiled model's probe steps run its modules eagerly, and an eager forward saves more for the
backward than the compiled one: those steps, and the gradient check's passes over the planning
step's inputs, can set a job's peak GPU memory. :func:`offload_saved_activations` moves what
autograd saves to pinned host memory in the forward and brings it back in the backward.

It differs from ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` in two ways that decide its
cost. The copies are asynchronous on the current stream (``non_blocking=True``): the GPU orders
them with the kernels around them and the host does not wait for each one, where a blocking copy
stops the host once per saved tensor. And only tensors of at least ``min_bytes`` move: the many
small ones (scales, norms' statistics, masks) cost a copy each and free almost nothing. Parameters
stay too: they are on the device for the whole step whatever autograd saves.

Why an asynchronous copy is safe: the device-to-host copy reads the activation on the stream that
produced it, so any later kernel that reuses the activation's memory is ordered after the copy;
the pinned buffer comes from PyTorch's caching host allocator, which does not hand it out again
until the copies that use it have completed (it records their stream). The copy back to the GPU
in the backward is ordered the same way. Off CUDA, or for tensors that are not on a CUDA device,
nothing moves.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Tuple

import torch

__all__ = ["offload_saved_activations", "MIN_OFFLOAD_BYTES"]

MIN_OFFLOAD_BYTES = 1 << 20
"""Saved tensors smaller than this (1 MiB) stay on the device."""


def _pack(min_bytes: int):
    def pack(tensor: torch.Tensor) -> Any:
        if (
            tensor.device.type != "cuda" or tensor.is_sparse or isinstance(tensor, torch.nn.Parameter)
            or tensor.numel() * tensor.element_size() < min_bytes
        ):  # fmt: skip
            return tensor  # a Parameter stays on the device anyway: a host copy would only add one back
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return (tensor.device, host)

    return pack


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed  # type: Tuple[torch.device, torch.Tensor]
    return host.to(device, non_blocking=True)


@contextlib.contextmanager
def offload_saved_activations(min_bytes: int = MIN_OFFLOAD_BYTES) -> Iterator[None]:
    """Within the block, autograd keeps each saved CUDA tensor of at least ``min_bytes`` in pinned
    host memory until the backward needs it (see the module docstring). A tensor saved with
    non-contiguous strides comes back contiguous, as with ``save_on_cpu``.

    Example::

        >>> x = torch.ones(4, requires_grad=True)
        >>> with offload_saved_activations():
        ...     y = (x * x).sum()
        >>> y.backward(); x.grad.tolist()
        [2.0, 2.0, 2.0, 2.0]
    """
    if min_bytes < 0:
        raise ValueError(f"min_bytes: expected >= 0, got {min_bytes}")
    with torch.autograd.graph.saved_tensors_hooks(_pack(min_bytes), _unpack):
        yield
