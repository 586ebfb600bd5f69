"""``triton``: this project's own Triton kernels (:mod:`loka_torchrec.kernels`).

Quantization is one fused kernel per operand (amax, scale and cast; rowwise operands of up to
8192 columns are read once), and the GEMM applies the rowwise or tensorwise dequantization scales,
an optional bias and an activation in its epilogue. Recipes ``tensorwise`` and ``rowwise``; E4M3
and E5M2 operands (mixed allowed); any shape (the kernels mask their edges, so there is no
alignment constraint); CUDA GPUs of compute capability 8.9 and newer.

Of the :class:`~loka_torchrec.gemm.backends.base.GemmBackend` interface's optional methods it
implements :meth:`TritonBackend.quantize_with_transpose`, which writes an activation and its
transpose (the ``B`` operand of the grad-weight GEMM) from one read; it also takes ``bias`` /
``activation`` arguments to :meth:`TritonBackend.mm` for a fused epilogue.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from loka_torchrec.gemm.backends.base import Availability, GemmBackend, register_backend
from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec
from loka_torchrec.fp8 import Fp8Tensor, Granularity

__all__ = ["TritonBackend"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@register_backend
class TritonBackend(GemmBackend):
    name = "triton"
    recipes = ("tensorwise", "rowwise")
    # Compiled, LokaLinear quantizes with torch ops that Inductor fuses, and the GEMM is the
    # ``loka::fp8_gemm`` op (a fake implementation gives Dynamo its output shape).
    compile_recipes = recipes
    devices = ("cuda",)
    fused_quantize = True
    # Not offered by `auto`: where measured, its GEMM was slower than cuBLAS's (scaled_mm) at LRM
    # shapes, so evaluating it would only cost the Probe compile and timing time. Name it to use it.
    in_auto = False

    def _probe(self, device: torch.device) -> Availability:
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device is available")
        from loka_torchrec.kernels import _compat  # kernels import without Triton; launches need it

        if _compat.TRITON_IMPORT_ERROR is not None:
            return Availability(False, f"triton is not importable ({_compat.TRITON_IMPORT_ERROR})")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return Availability(False, f"FP8 tensor cores need compute capability >= 8.9; this GPU has {major}.{minor}")
        from loka_torchrec.kernels.fp8_gemm import GemmConfig, _gemm_into  # optional: Triton (as below)
        from loka_torchrec.kernels.fp8_quantize import fp8_quantize

        # One tiny launch of each kernel: compiles them and proves this Triton/driver pair runs them.
        q = fp8_quantize(torch.randn(64, 64, device=device), "e4m3", "rowwise")
        out = torch.empty((64, 64), dtype=torch.bfloat16, device=device)
        _gemm_into(q.data, q.data, q.dequant_scale, q.dequant_scale, None, "none", False, out, config=GemmConfig(64, 64, 64))
        torch.cuda.synchronize(device)
        return Availability(True)

    def _check_spec(self, spec: OperandSpec) -> None:
        if spec.granularity not in (Granularity.TENSORWISE, Granularity.ROWWISE):
            raise ValueError(f"triton: granularity {spec.granularity.value} is not supported; use tensorwise or rowwise")

    def quantize(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Fp8Tensor:
        from loka_torchrec.kernels.fp8_quantize import fp8_quantize  # optional: Triton

        self._check_spec(spec)
        return fp8_quantize(t, spec.fmt, spec.granularity, power_of_two=spec.power_of_two, name=name)

    def quantize_with_transpose(
        self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand"
    ) -> Tuple[Fp8Tensor, Fp8Tensor]:
        """Quantize ``t`` (rows, K) and ``t^T`` (K, rows) as two operands of ``spec``'s format and granularity.

        For a linear layer's input ``x`` this yields the ``A`` operand of the forward GEMM and the
        ``B`` operand (``x^T``) of the grad-weight GEMM; for ``dy``, the ``A`` operands of the
        grad-input and grad-weight GEMMs.
        """
        from loka_torchrec.kernels.fp8_quantize import fp8_quantize_with_transpose  # optional: Triton

        self._check_spec(spec)
        return fp8_quantize_with_transpose(t, spec.fmt, spec.granularity, power_of_two=spec.power_of_two, name=name)

    def mm(
        self,
        a: Fp8Tensor,
        b: Fp8Tensor,
        recipe: GemmRecipe,
        out_dtype: torch.dtype,
        *,
        bias: Optional[torch.Tensor] = None,
        activation: str = "none",
    ) -> torch.Tensor:
        """``A @ B^T`` (+ ``bias``, then ``activation``) with the scales applied in the epilogue."""
        from loka_torchrec.kernels.fp8_gemm import fp8_mm  # optional: Triton

        kernel_dtype = out_dtype if out_dtype in _OUT_DTYPES else torch.float32
        out = fp8_mm(a, b, bias=bias, activation=activation, out_dtype=kernel_dtype, fast_accum=recipe.fast_accum)
        return out if out.dtype == out_dtype else out.to(out_dtype)
