"""``bf16``: the high-precision baseline every FP8 candidate is measured against.

On CUDA it multiplies in bfloat16 (fp32 accumulation). On the CPU it multiplies in the operands'
own dtype (the model's, usually fp32), since that is what the CPU job would otherwise run.
"""

from __future__ import annotations

import torch

from loka_torchrec.gemm.backends.base import GemmBackend, register_backend
from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec

__all__ = ["HighPrecisionBackend", "high_precision_dtype"]


def high_precision_dtype(t: torch.Tensor) -> torch.dtype:
    """bf16 on CUDA; the tensor's own float dtype elsewhere."""
    return torch.bfloat16 if t.is_cuda else t.dtype


@register_backend
class HighPrecisionBackend(GemmBackend):
    name = "bf16"
    recipes = ("hp",)
    devices = ("cpu", "cuda")
    compile_recipes = ("hp",)

    def quantize(self, t: torch.Tensor, spec: OperandSpec = None, *, name: str = "operand") -> torch.Tensor:
        return t.to(high_precision_dtype(t))

    def mm(self, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe = None, out_dtype: torch.dtype = None) -> torch.Tensor:
        if b.dtype != a.dtype:
            # ``a`` is the activation or gradient, ``b`` the weight (forward, grad-input) or the
            # activation (grad-weight): under torch.autocast a LokaLinear gets bf16 activations next
            # to an fp32 master weight, and on the CPU the GEMM then runs in the activation's dtype.
            b = b.to(a.dtype)
        out = a @ b.t()
        # Not a same-dtype .to(): see EmulatedBackend.mm (zero gradients under torch 2.11's Dynamo).
        return out if out_dtype is None or out.dtype == out_dtype else out.to(out_dtype)

    def gemm(self, a, b, recipe=None, out_dtype=None):
        return self.mm(self.quantize(a), self.quantize(b), recipe, out_dtype)
