"""Operand quantization shared by the backends whose GEMMs take :class:`~loka_torchrec.fp8.Fp8Tensor`.

On a CUDA GPU of compute capability 8.9 or newer with Triton importable, an operand is quantized by
the project's fused kernel (:mod:`loka_torchrec.kernels.fp8_quantize`: amax, scale and cast in one
or two passes over the input, about the time of a device-to-device copy). Everywhere else it is
quantized with eager torch ops (:func:`loka_torchrec.fp8.quantize`), which read the input several
times. Both compute the same scales and codes (the kernel's reference *is* the eager call; the GPU
tests check it). Under ``torch.compile`` ``LokaLinear`` uses neither: its quantization is the
eager torch ops, traced, which Inductor fuses into one kernel with the producing op.

Set ``LOKA_EAGER_QUANTIZE=1`` to force the eager path on the GPU too (for comparisons and debugging).
"""

from __future__ import annotations

import functools
import os
from typing import Tuple

import torch

from loka_torchrec.gemm.recipes import OperandSpec
from loka_torchrec.fp8 import Fp8Tensor, Granularity, quantize

__all__ = ["fused_quantize_available", "quantize_operand", "quantize_operand_with_transpose"]


@functools.lru_cache(maxsize=None)
def _fused_on(device_index: int) -> bool:
    from loka_torchrec.kernels import _compat  # optional: the kernel modules import Triton

    if _compat.TRITON_IMPORT_ERROR is not None:
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def fused_quantize_available(t: torch.Tensor) -> bool:
    """Whether ``t`` (an operand about to be quantized) goes through the fused Triton kernel."""
    if not t.is_cuda or os.environ.get("LOKA_EAGER_QUANTIZE", "0") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _fused_on(index)


def _fused_granularity(spec: OperandSpec) -> bool:
    # The kernel's blockwise tile is 1 x block_k; other tiles (the 128 x 128 weight tiles) go eager.
    if spec.granularity != Granularity.BLOCKWISE:
        return True
    return spec.block is not None and spec.block[0] == 1 and spec.block[1] in (16, 32, 64, 128)


def quantize_operand(t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Fp8Tensor:
    """``t`` (rows, K), any strides, quantized as ``spec`` says; NaN scales mark inf/NaN groups.

    Never synchronizes with the device (non-finite values propagate; see :mod:`loka_torchrec.fp8`).
    """
    if fused_quantize_available(t) and t.dtype in (torch.float32, torch.bfloat16, torch.float16) and _fused_granularity(spec):
        from loka_torchrec.kernels.fp8_quantize import fp8_quantize  # optional: Triton

        block_k = spec.block[1] if spec.block is not None else 128
        return fp8_quantize(t, spec.fmt, spec.granularity, block_k=block_k, power_of_two=spec.power_of_two, name=name)
    return quantize(
        t, spec.fmt, spec.granularity, block=spec.block, power_of_two=spec.power_of_two, nonfinite="propagate", name=name
    )


def quantize_operand_with_transpose(
    t: torch.Tensor, spec: OperandSpec, *, name: str = "operand"
) -> Tuple[Fp8Tensor, Fp8Tensor]:
    """``(t, t^T)`` as two operands of ``spec`` (``t^T`` row-major with scales of its own).

    For a layer's input ``x`` these are ``A`` of the forward GEMM and ``B`` (``x^T``) of grad-weight;
    for ``dy``, ``A`` of grad-input and ``A`` (``dy^T``) of grad-weight. On the GPU one kernel reads
    ``t`` and writes both; elsewhere it is two eager quantizations.
    """
    if spec.granularity == Granularity.BLOCKWISE:
        raise ValueError("quantize_operand_with_transpose: tensorwise or rowwise operands only")
    if fused_quantize_available(t) and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from loka_torchrec.kernels.fp8_quantize import fp8_quantize_with_transpose  # optional: Triton

        return fp8_quantize_with_transpose(t, spec.fmt, spec.granularity, power_of_two=spec.power_of_two, name=name)
    return quantize_operand(t, spec, name=name), quantize_operand(t.t(), spec, name=f"{name}^T")
