"""``scaled_mm``: PyTorch's own FP8 GEMM, ``torch._scaled_mm``, tensorwise and rowwise.

It runs on CUDA GPUs of compute capability 8.9 and newer, and on the CPU from torch 2.13 on.
``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` wants ``a`` row-major ``(M, K)``,
``b`` column-major ``(K, N)`` (so we pass ``B.t()`` of a row-major ``(N, K)`` operand), and fp32
*dequantization* scales: ``()`` for tensorwise, ``(M, 1)`` and ``(1, N)`` for rowwise. On CUDA, K
and N must be multiples of 16, and rowwise scaling needs a bfloat16 output. The ``_fast_accum`` recipes pass ``use_fast_accum``.

Operands are quantized by :mod:`~loka_torchrec.gemm.backends.operand_quantize`: the fused
Triton kernel on the GPU, eager torch ops on the CPU.
"""

from __future__ import annotations

import torch

from typing import Optional, Tuple

from loka_torchrec.gemm.backends.base import Availability, GemmBackend, register_backend
from loka_torchrec.gemm.backends.operand_quantize import quantize_operand, quantize_operand_with_transpose
from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec
from loka_torchrec.fp8 import Fp8Tensor, Granularity

__all__ = ["ScaledMMBackend"]


@register_backend
class ScaledMMBackend(GemmBackend):
    name = "scaled_mm"
    recipes = ("tensorwise", "rowwise", "tensorwise_fast_accum", "rowwise_fast_accum")
    devices = ("cpu", "cuda")
    compile_recipes = recipes

    def _probe(self, device: torch.device) -> Availability:
        if not hasattr(torch, "_scaled_mm"):
            return Availability(False, f"torch {torch.__version__} has no torch._scaled_mm")
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                return Availability(False, f"torch._scaled_mm needs compute capability >= 8.9, this GPU has {major}.{minor}")
        # One tiny call tells whether this build implements it on this device.
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16)
        return Availability(True)

    def alignment(self, device, recipe: Optional[GemmRecipe] = None) -> int:
        return 16 if torch.device(device).type == "cuda" else 1

    def quantize(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Fp8Tensor:
        if spec.granularity == Granularity.BLOCKWISE:
            raise ValueError("scaled_mm: blockwise scaling is not supported; use tensorwise or rowwise")
        return quantize_operand(t, spec, name=name)

    def quantize_with_transpose(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Tuple[Fp8Tensor, Fp8Tensor]:
        """``t`` and ``t^T`` as two operands of ``spec`` from one read of ``t`` on the GPU."""
        if spec.granularity == Granularity.BLOCKWISE:
            raise ValueError("scaled_mm: blockwise scaling is not supported; use tensorwise or rowwise")
        return quantize_operand_with_transpose(t, spec, name=name)

    def mm(self, a: Fp8Tensor, b: Fp8Tensor, recipe: GemmRecipe, out_dtype: torch.dtype) -> torch.Tensor:
        scale_b = b.dequant_scale
        if b.granularity == Granularity.ROWWISE:
            scale_b = scale_b.reshape(1, -1)
        mm_dtype = out_dtype
        if a.data.is_cuda and a.granularity == Granularity.ROWWISE:
            mm_dtype = torch.bfloat16  # CUDA rowwise _scaled_mm produces bf16 only
        out = torch._scaled_mm(
            _with_strides(a.data, row_major=True),
            _with_strides(b.data.t(), row_major=False),
            scale_a=a.dequant_scale,
            scale_b=scale_b,
            out_dtype=mm_dtype,
            use_fast_accum=recipe.fast_accum,
        )
        return out if out.dtype == out_dtype else out.to(out_dtype)


def _with_strides(t: torch.Tensor, *, row_major: bool) -> torch.Tensor:
    """``t`` (2-D) viewed with the strides of a row- or column-major matrix where a dim of size 1
    leaves them free: the same elements, but Inductor's ``_scaled_mm`` lowering checks the strides
    themselves (``mat_b must be col_major``) where eager PyTorch ignores a size-1 dim's stride."""
    rows, cols = t.shape
    if rows != 1 and cols != 1:
        return t
    strides = (cols, 1) if row_major else (1, rows)
    return t if t.stride() == strides else t.as_strided((rows, cols), strides)  # the storage offset stays
