"""GEMM operands between quantization and the kernel: zero padding, transposes, and packing for autograd.

Stateless tensor helpers, shared by the GEMM helpers of
:mod:`~loka_torchrec.dispatch.gemm_function` and the weight cache:

* padding to a backend's alignment (:func:`pad2d`) and cropping the result (:func:`crop`): zeros
  add nothing to a dot product and change no amax, so a padded GEMM is exact;
* the operand of ``T^T`` from that of ``T`` (:func:`transpose_fp8`), where one quantization of
  ``T`` serves both orientations (:func:`transpose_reusable`);
* an operand split into tensors for ``ctx.save_for_backward`` and rebuilt in the backward
  (:func:`pack_operand`, :func:`unpack_operand`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from loka_torchrec.fp8 import Fp8Tensor, Granularity
from loka_torchrec.gemm.recipes import OperandSpec

__all__ = ["OperandKind", "crop", "pack_operand", "pad2d", "transpose_fp8", "transpose_reusable", "transposed_spec", "unpack_operand"]


def pad2d(t: torch.Tensor, rows, cols) -> torch.Tensor:
    """``t`` zero-padded at the bottom and right to ``(rows, cols)`` (sizes may be symbolic)."""
    pad_rows, pad_cols = rows - t.shape[0], cols - t.shape[1]
    if statically_known_true(pad_rows == 0) and statically_known_true(pad_cols == 0):
        return t
    return F.pad(t, (0, pad_cols, 0, pad_rows))


def crop(t: torch.Tensor, rows, cols: int) -> torch.Tensor:
    """The top-left ``(rows, cols)`` of a padded GEMM result."""
    if statically_known_true(t.shape[0] == rows) and t.shape[1] == cols:
        return t
    return t[:rows, :cols]


def transposed_spec(spec: OperandSpec) -> OperandSpec:
    """The spec whose quantization of ``T^T`` is the transpose of ``spec``'s quantization of ``T``."""
    if spec.block is None:
        return spec
    return dataclasses.replace(spec, block=(spec.block[1], spec.block[0]))


def transpose_reusable(src: OperandSpec, dst: OperandSpec) -> bool:
    """Whether ``dst``-quantizing ``T^T`` gives exactly the transposed ``src``-quantized ``T``.

    True for tensorwise (one scale) and for blockwise when ``dst``'s tile is ``src``'s tile
    transposed (the 128x128 weight tiles); never for rowwise (rows of ``T^T`` are columns of ``T``).
    """
    if src.granularity == Granularity.ROWWISE:
        return False
    return transposed_spec(src) == dst


def transpose_fp8(q: Fp8Tensor) -> Fp8Tensor:
    """The operand of ``T^T`` from that of ``T``: FP8 bytes copied transposed, scales reused."""
    scale = q.dequant_scale if q.granularity == Granularity.TENSORWISE else q.dequant_scale.t().contiguous()
    block = None if q.block is None else (q.block[1], q.block[0])
    # Row-major copy: GEMM kernels (torch._scaled_mm on CUDA) want A row-major and B column-major.
    return Fp8Tensor(q.data.t().contiguous(), scale, q.fmt, q.granularity, block)


class OperandKind(enum.Enum):
    """What a packed operand was: an :class:`Fp8Tensor`, a plain tensor, or a backend's own type."""

    FP8 = "fp8"
    TENSOR = "tensor"
    OPAQUE = "opaque"  # a backend's own operand type (eager only): kept as is, not saved as tensors


def pack_operand(op: Any) -> Tuple[Tuple[torch.Tensor, ...], Any]:
    """Split an operand into tensors for ``ctx.save_for_backward`` and the metadata to rebuild it."""
    if isinstance(op, Fp8Tensor):
        return (op.data, op.dequant_scale), (OperandKind.FP8, op.fmt, op.granularity, op.block)
    if isinstance(op, torch.Tensor):
        return (op,), (OperandKind.TENSOR,)
    return (), (OperandKind.OPAQUE, op)


def unpack_operand(tensors: Tuple[torch.Tensor, ...], meta: Any) -> Any:
    """The operand :func:`pack_operand` split into ``tensors`` and ``meta``."""
    if meta[0] is OperandKind.FP8:
        return Fp8Tensor(tensors[0], tensors[1], meta[1], meta[2], meta[3])
    if meta[0] is OperandKind.TENSOR:
        return tensors[0]
    return meta[1]
