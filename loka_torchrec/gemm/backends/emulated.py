"""``emulated``: quantize, dequantize, multiply in fp32. The reference for every FP8 kernel.

It rounds exactly as a real FP8 GEMM does on its inputs (same scales, same saturating cast) and
then accumulates in fp32, so it runs anywhere and isolates quantization error from accumulation
error. It is never faster than the baseline and the policy will never pick it for speed; it exists
to check kernels and as the CPU fallback a user asks for by name.
"""

from __future__ import annotations

import torch

from loka_torchrec.gemm.backends.base import GemmBackend, register_backend
from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec
from loka_torchrec.fp8 import Fp8Tensor, quantize

__all__ = ["EmulatedBackend"]


@register_backend
class EmulatedBackend(GemmBackend):
    name = "emulated"
    recipes = ("tensorwise", "rowwise", "blockwise")
    devices = ("cpu", "cuda")
    compile_recipes = ("tensorwise", "rowwise", "blockwise")

    def quantize(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Fp8Tensor:
        return quantize(
            t,
            spec.fmt,
            spec.granularity,
            block=spec.block,
            power_of_two=spec.power_of_two,
            nonfinite="propagate",
            name=name,
        )

    def mm(self, a: Fp8Tensor, b: Fp8Tensor, recipe: GemmRecipe, out_dtype: torch.dtype) -> torch.Tensor:
        out = a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()
        # A same-dtype .to() is the tensor itself: returned from an autograd.Function's forward,
        # torch 2.11's Dynamo then gives the Function's inputs zero gradients.
        return out if out.dtype == out_dtype else out.to(out_dtype)
