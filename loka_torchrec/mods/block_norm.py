"""BlockNorm: a parameter-free RMSNorm over fixed-width feature blocks, and the mod that installs it."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from loka_torchrec.mods.config import ModResult
from loka_torchrec.mods.module_tree import check_unwrapped, named_modules_of_type, replace_module

__all__ = ["block_rms_norm", "BlockNorm", "block_norm"]


def block_rms_norm(x: torch.Tensor, block_size: int, eps: float = 1e-6) -> torch.Tensor:
    """RMS-normalize each ``block_size``-wide block of the last dimension of ``x`` on its own.

    ``y[..., j] = x[..., j] / sqrt(mean_{i in block(j)} x[..., i]**2 + eps)``, where the blocks
    are ``[0, b), [b, 2b), ...`` and, when the width ``W`` is not a multiple of ``b``, the last
    block is the ``W mod b`` remaining features, normalized over its own (smaller) size. A width
    below ``b`` is therefore one block. No mean is subtracted and nothing is learned. Half and
    bfloat16 inputs are normalized in float32 and returned in their own dtype.

    Args:
        x: ``(..., W)`` features.
        block_size: ``b``, features per RMS statistic.
        eps: added to the mean square (same units as ``x**2``).

    Returns:
        ``(..., W)`` tensor, same dtype as ``x``.

    Example::

        >>> x = torch.tensor([[3.0, 4.0, 0.0, 2.0, 2.0]])
        >>> block_rms_norm(x, 2, eps=0.0)  # blocks [3, 4], [0, 2], [2]
        tensor([[0.8485, 1.1314, 0.0000, 1.4142, 1.0000]])
    """
    width = x.shape[-1]
    compute = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    full = (width // block_size) * block_size
    parts = []
    if full:
        blocks = compute[..., :full].reshape(*x.shape[:-1], full // block_size, block_size)
        scaled = blocks * torch.rsqrt(blocks.pow(2).mean(dim=-1, keepdim=True) + eps)
        parts.append(scaled.reshape(*x.shape[:-1], full))
    if full < width:
        tail = compute[..., full:]
        parts.append(tail * torch.rsqrt(tail.pow(2).mean(dim=-1, keepdim=True) + eps))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y.to(x.dtype)


class BlockNorm(nn.Module):
    """Parameter-free RMSNorm over fixed-width blocks of the last dimension (see :func:`block_rms_norm`).

    The block size is part of the model: it is saved in the ``state_dict`` as the int64 buffer
    ``block_size``, and loading a checkpoint whose ``block_size`` differs raises ``ValueError``
    (training and inference must normalize over the same blocks).

    Args:
        width: ``W``, the normalized (last) dimension.
        block_size: ``b``, features per RMS statistic (default 256).
        eps: added to each block's mean square.
        device: where the ``block_size`` buffer lives.

    Example::

        >>> norm = BlockNorm(6, block_size=4)
        >>> norm(torch.randn(2, 6)).shape
        torch.Size([2, 6])
        >>> norm.state_dict()["block_size"]
        tensor(4)
        >>> BlockNorm(6, block_size=3).load_state_dict(norm.state_dict())
        Traceback (most recent call last):
          ...
        ValueError: BlockNorm: the checkpoint's block_size is 4 but this model's is 3 (BlockNorm of width 6, key 'block_size'); training and inference must use the same block size: build the model with ModsConfig.block_size=4
    """

    block_size: torch.Tensor

    def __init__(self, width: int, block_size: int = 256, eps: float = 1e-6, device: Optional[torch.device] = None):
        super().__init__()
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"BlockNorm width must be an int >= 1, got {width!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"BlockNorm block_size must be an int >= 1, got {block_size!r}")
        if not eps >= 0:
            raise ValueError(f"BlockNorm eps must be >= 0, got {eps!r}")
        self.width = width
        self.eps = float(eps)
        # The Python int drives forward (no device sync); the buffer is what checkpoints carry.
        self._block_size = block_size
        self.register_buffer("block_size", torch.tensor(block_size, dtype=torch.int64, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., width)`` -> ``(..., width)``, blockwise RMS-normalized."""
        if x.shape[-1] != self.width:
            raise ValueError(f"BlockNorm of width {self.width} got input with last dimension {x.shape[-1]}")
        return block_rms_norm(x, self._block_size, self.eps)

    def extra_repr(self) -> str:
        return f"{self.width}, block_size={self._block_size}, eps={self.eps}"

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: D401 (torch hook)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # Write the block size this module computes with, whatever the buffer holds: a buffer
        # materialized from "meta" (DistributedModelParallel zero-fills those) would read 0.
        buffer = self.block_size
        device = buffer.device if buffer.device.type != "meta" else torch.device("cpu")
        destination[prefix + "block_size"] = torch.tensor(self._block_size, dtype=torch.int64, device=device)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "block_size"
        if key in state_dict:
            stored = state_dict[key]
            stored_int = int(stored.item()) if isinstance(stored, torch.Tensor) else int(stored)
            if stored_int != self._block_size:
                raise ValueError(
                    f"BlockNorm: the checkpoint's block_size is {stored_int} but this model's is "
                    f"{self._block_size} (BlockNorm of width {self.width}, key {key!r}); training and "
                    f"inference must use the same block size: build the model with "
                    f"ModsConfig.block_size={stored_int}"
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def block_norm(
    model: nn.Module,
    *,
    block_size: int = 256,
    module_filter: Optional[Callable[[nn.Module, str], bool]] = None,
) -> ModResult:
    """Replace every ``nn.LayerNorm`` over one (the last) dimension by :class:`BlockNorm`, in place.

    Numerically: ``LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta`` over the
    whole width becomes ``x / sqrt(mean_block(x**2) + eps)`` per ``block_size``-wide block (same
    ``eps``): no mean subtraction, no learned ``gamma``/``beta`` (they are dropped, so a trained
    model's outputs change), and one statistic per block instead of per row. For a width that is
    not a multiple of ``block_size`` the last block is the remainder (see :func:`block_rms_norm`).
    The LayerNorm inside TorchRec's ``SwishLayerNorm`` (``x * sigmoid(LayerNorm(x))``) is replaced
    the same way, giving ``x * sigmoid(BlockNorm(x))``. LayerNorms over several trailing
    dimensions are left alone (reported under ``skipped``).

    Args:
        model: the unsharded model.
        block_size: features per RMS statistic.
        module_filter: ``(module, fqn) -> bool``; only LayerNorms for which it returns ``True``
            are replaced (default: all).

    Returns:
        A :class:`ModResult` listing the replaced LayerNorms.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 300), nn.LayerNorm(300))
        >>> block_norm(model).modules
        ('1',)
        >>> model[1]
        BlockNorm(300, block_size=256, eps=1e-05)
    """
    check_unwrapped(model, mod="block_norm")
    changed: List[str] = []
    skipped: List[Tuple[str, str]] = []
    for name, norm in named_modules_of_type(model, nn.LayerNorm):
        if module_filter is not None and not module_filter(norm, name):
            continue
        if len(norm.normalized_shape) != 1:
            skipped.append((name, f"normalizes over {len(norm.normalized_shape)} dimensions"))
            continue
        device = norm.weight.device if norm.weight is not None else None
        replace_module(model, name, BlockNorm(norm.normalized_shape[0], block_size, eps=norm.eps, device=device))
        changed.append(name)
    return ModResult("block_norm", tuple(changed), tuple(skipped))
