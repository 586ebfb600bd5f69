"""``fbgemm``: FBGEMM's FP8 rowwise GEMMs from ``fbgemm-gpu-genai``.

Recipes:

* ``rowwise``: CUTLASS. ``torch.ops.fbgemm.quantize_fp8_per_row(x)`` gives the E4M3 operand and its
  per-row dequantization scale in one kernel; ``torch.ops.fbgemm.f8f8bf16_rowwise(xq, wq, x_scale,
  w_scale, use_fast_accum=...)`` multiplies ``xq (M, K)`` by ``wq (N, K)^T`` into bf16. Both
  operands must be E4M3 (so gradients too: ``grad_format="e4m3"``, the recipes' default).
  ``rowwise_fast_accum`` is the same GEMM with ``use_fast_accum=True``.
* ``triton_rowwise``: FBGEMM's Triton kernel
  ``fbgemm_gpu.experimental.gemm.triton_gemm.fp8_gemm.matmul_fp8_row(a, b, a_scale, b_scale, ...)``,
  same operands (``a`` may also be E5M2). Its default TMA-persistent mode fails on Triton 3.6
  (``'CudaUtils' object has no attribute 'fill_1d_tma_descriptor'``); the backend tries the
  non-TMA modes in turn on a tiny problem and keeps the first that runs.

Both GEMMs are forward-only ops: the backend computes ``A @ B^T`` of whatever operands it is
given, so the grad-input (``dy @ W``) and grad-weight (``dy^T @ x``) GEMMs go through it like the
forward one. Row-major E4M3 operands are quantized by FBGEMM's own kernel; transposed views, E5M2
operands and power-of-two scales by the project's fused kernel on the GPU
(:mod:`~loka_torchrec.gemm.backends.operand_quantize`).
Needs a CUDA GPU of compute capability 9.0 or newer; K and N must be multiples of 16.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple, Union

import torch

from loka_torchrec.gemm.backends.base import Availability, GemmBackend, register_backend
from loka_torchrec.gemm.backends.operand_quantize import quantize_operand, quantize_operand_with_transpose
from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec
from loka_torchrec.evidence import GemmShape
from loka_torchrec.fp8 import Fp8Format, Fp8Tensor, Granularity

__all__ = ["FbgemmBackend"]

# Modes of matmul_fp8_row to try, first to last; a keyword the installed version lacks is dropped.
_TRITON_MODES = (
    {"tma_persistent": False},
    {"tma_persistent": False, "no_use_persistent": True},
)


def _load_genai() -> Optional[str]:
    """Import FBGEMM's gen_ai ops; ``None`` when they are there, else why not."""
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception as exc:
        return f"fbgemm_gpu is not importable ({type(exc).__name__}: {exc}); install fbgemm-gpu and fbgemm-gpu-genai"
    try:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers torch.ops.fbgemm FP8 ops)
    except Exception as exc:
        return f"fbgemm-gpu-genai is not installed or does not load ({type(exc).__name__}: {exc})"
    for op in ("quantize_fp8_per_row", "f8f8bf16_rowwise"):
        if not hasattr(torch.ops.fbgemm, op):
            return f"this FBGEMM build has no torch.ops.fbgemm.{op}"
    return None


def _matmul_fp8_row():
    from fbgemm_gpu.experimental.gemm.triton_gemm.fp8_gemm import matmul_fp8_row  # optional: FBGEMM gen_ai, Triton

    return matmul_fp8_row


@register_backend
class FbgemmBackend(GemmBackend):
    name = "fbgemm"
    recipes = ("rowwise", "triton_rowwise", "rowwise_fast_accum")
    devices = ("cuda",)
    compile_recipes = ("rowwise", "rowwise_fast_accum")
    fused_quantize = True

    def __init__(self) -> None:
        super().__init__()
        self._triton_modes: Dict[str, Union[Dict[str, Any], str]] = {}

    # ----------------------------------------------------------------------------- capability
    def _probe(self, device: torch.device) -> Availability:
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device is available")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (9, 0):
            return Availability(False, f"FBGEMM's FP8 rowwise GEMM needs compute capability >= 9.0; this GPU has {major}.{minor}")
        problem = _load_genai()
        if problem is not None:
            return Availability(False, problem)
        x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
        xq, x_scale = torch.ops.fbgemm.quantize_fp8_per_row(x)
        torch.ops.fbgemm.f8f8bf16_rowwise(xq, xq, x_scale, x_scale, use_fast_accum=True)
        torch.cuda.synchronize(device)
        return Availability(True)

    def _triton_mode(self, device: torch.device) -> Union[Dict[str, Any], str]:
        """Keyword arguments of the first ``matmul_fp8_row`` mode that runs here, or why none does."""
        key = str(device)
        if key not in self._triton_modes:
            try:
                matmul_fp8_row = _matmul_fp8_row()
            except Exception as exc:
                self._triton_modes[key] = f"FBGEMM's Triton FP8 GEMM is not importable ({type(exc).__name__}: {exc})"
                return self._triton_modes[key]
            params = inspect.signature(matmul_fp8_row).parameters
            x = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
            xq, x_scale = torch.ops.fbgemm.quantize_fp8_per_row(x)
            failures = []
            for mode in _TRITON_MODES:
                kwargs = {k: v for k, v in mode.items() if k in params}
                try:
                    matmul_fp8_row(xq, xq, x_scale, x_scale, **kwargs)
                    torch.cuda.synchronize(device)
                except Exception as exc:
                    failures.append(f"{kwargs}: {type(exc).__name__}: {exc}")
                    continue
                self._triton_modes[key] = kwargs
                break
            else:
                self._triton_modes[key] = "no mode of matmul_fp8_row runs here: " + "; ".join(failures)
        return self._triton_modes[key]

    def alignment(self, device, recipe: Optional[GemmRecipe] = None) -> int:
        return 16

    def check(self, recipe: GemmRecipe, shape: GemmShape, device: "torch.device | str") -> Optional[str]:
        reason = super().check(recipe, shape, device)
        if reason is not None:
            return reason
        if recipe.a.granularity != Granularity.ROWWISE or recipe.b.granularity != Granularity.ROWWISE:
            return "fbgemm: both operands must be rowwise-scaled"
        if recipe.b.fmt != Fp8Format.E4M3:
            return f"fbgemm: the B operand must be e4m3, got {recipe.b.fmt.value}"
        if recipe.base == "rowwise" and recipe.a.fmt != Fp8Format.E4M3:
            return f"fbgemm:rowwise (CUTLASS) takes e4m3 operands only, got A in {recipe.a.fmt.value}; use grad_format=e4m3 or fbgemm:triton_rowwise"
        if recipe.name == "triton_rowwise":
            mode = self._triton_mode(torch.device(device))
            if isinstance(mode, str):
                return mode
        return None

    # ----------------------------------------------------------------------------- compute
    def quantize(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Fp8Tensor:
        if spec.granularity != Granularity.ROWWISE:
            raise ValueError(f"fbgemm: only rowwise operands are supported, got {spec.granularity.value} for {name}")
        if spec.fmt == Fp8Format.E4M3 and not spec.power_of_two and t.dtype == torch.bfloat16 and t.is_contiguous():
            # FBGEMM's fused kernel reads bf16 row-major rows.
            xq, x_scale = torch.ops.fbgemm.quantize_fp8_per_row(t)
            return Fp8Tensor(xq, x_scale.reshape(-1, 1).to(torch.float32), Fp8Format.E4M3, Granularity.ROWWISE)
        return quantize_operand(t, spec, name=name)

    def quantize_with_transpose(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Tuple[Fp8Tensor, Fp8Tensor]:
        """``t`` and ``t^T`` as two rowwise operands from one read of ``t`` (the project's kernel)."""
        if spec.granularity != Granularity.ROWWISE:
            raise ValueError(f"fbgemm: only rowwise operands are supported, got {spec.granularity.value} for {name}")
        return quantize_operand_with_transpose(t, spec, name=name)

    def mm(self, a: Fp8Tensor, b: Fp8Tensor, recipe: GemmRecipe, out_dtype: torch.dtype) -> torch.Tensor:
        a_data, b_data = a.data.contiguous(), b.data.contiguous()
        a_scale = a.dequant_scale.reshape(-1).contiguous()
        b_scale = b.dequant_scale.reshape(-1).contiguous()
        if recipe.name == "triton_rowwise":
            mode = self._triton_mode(a_data.device)
            if isinstance(mode, str):
                raise RuntimeError(mode)
            out = _matmul_fp8_row()(a_data, b_data, a_scale, b_scale, fp8_fast_accum=recipe.fast_accum, **mode)
        elif recipe.base == "rowwise":
            out = torch.ops.fbgemm.f8f8bf16_rowwise(a_data, b_data, a_scale, b_scale, use_fast_accum=recipe.fast_accum)
        else:
            raise ValueError(f"fbgemm has no recipe {recipe.name!r} (has: {', '.join(self.recipes)})")
        return out if out.dtype == out_dtype else out.to(out_dtype)
