"""``te``: Transformer Engine's FP8 GEMM (cuBLASLt) on TE's own quantized tensors.

Recipes:

* ``tensorwise``: ``Float8CurrentScalingQuantizer`` (one scale per tensor from its current amax);
* ``blockwise``: ``Float8BlockQuantizer`` (1x128 tiles for activations and gradients, 128x128 for
  weights, per :func:`loka_torchrec.gemm.recipes.recipe_for`); Hopper (sm90) only.

The GEMM is ``transformer_engine.pytorch.cpp_extensions.general_gemm``. TE writes GEMMs in
column-major terms: ``general_gemm(W, X, layout="TN")`` returns ``X @ W^T``, so ``A @ B^T`` is
``general_gemm(B, A)``. Operands are quantized row-wise only (no transposed copy), which is the
layout the FP8 "TN" GEMM reads. Without ``fast_accum`` the split accumulator (periodic promotion
to fp32) is used; ``tensorwise_fast_accum`` turns it off. K and N must be multiples of 16. Written against TE 2.12; keyword arguments
whose presence differs between releases (the ``workspace`` argument) are looked up, not assumed.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch

from loka_torchrec.gemm.backends.base import Availability, GemmBackend, register_backend
from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec
from loka_torchrec.evidence import GemmShape
from loka_torchrec.fp8 import Fp8Format, Granularity

__all__ = ["TransformerEngineBackend"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _te_modules() -> Dict[str, Any]:
    """The TE pieces the backend uses (imported on first use; raises ImportError when TE is missing)."""
    import transformer_engine.pytorch  # noqa: F401  (loads the TE core library and the torch extension)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    try:
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    except ImportError:  # releases without blockwise FP8
        Float8BlockQuantizer = None
    workspace = None
    if "workspace" in inspect.signature(general_gemm).parameters:
        from transformer_engine.pytorch.module.base import get_workspace

        workspace = get_workspace
    return dict(
        tex=tex,
        general_gemm=general_gemm,
        current=Float8CurrentScalingQuantizer,
        block=Float8BlockQuantizer,
        workspace=workspace,
    )


@register_backend
class TransformerEngineBackend(GemmBackend):
    name = "te"
    recipes = ("tensorwise", "blockwise", "tensorwise_fast_accum")
    devices = ("cuda",)
    fused_quantize = False  # current scaling is an amax kernel, then a cast kernel

    def __init__(self) -> None:
        super().__init__()
        self._te: Optional[Dict[str, Any]] = None
        self._quantizers: Dict[Tuple, Any] = {}

    def _modules(self) -> Dict[str, Any]:
        if self._te is None:
            self._te = _te_modules()
        return self._te

    # ----------------------------------------------------------------------------- capability
    def _probe(self, device: torch.device) -> Availability:
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device is available")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return Availability(False, f"FP8 GEMMs need compute capability >= 8.9; this GPU has {major}.{minor}")
        try:
            self._modules()
        except Exception as exc:
            return Availability(
                False, f"transformer_engine is not installed or does not load ({type(exc).__name__}: {exc})"
            )
        spec = OperandSpec(Fp8Format.E4M3, Granularity.TENSORWISE)
        x = self.quantize(torch.randn(32, 32, device=device, dtype=torch.bfloat16), spec)
        self._gemm(x, x, torch.bfloat16, split_accumulator=True)
        torch.cuda.synchronize(device)
        return Availability(True)

    def alignment(self, device, recipe: Optional[GemmRecipe] = None) -> int:
        # blockwise quantizes in 1x128 / 128x128 tiles along K: every dim padded to 128 (rows too,
        # which are grad-weight's K)
        return 128 if recipe is not None and recipe.base == "blockwise" else 16

    def check(self, recipe: GemmRecipe, shape: GemmShape, device: "torch.device | str") -> Optional[str]:
        reason = super().check(recipe, shape, device)
        if reason is not None:
            return reason
        if recipe.base == "blockwise":
            if self._modules()["block"] is None:
                return "te: this Transformer Engine has no Float8BlockQuantizer (blockwise FP8)"
            major, minor = torch.cuda.get_device_capability(torch.device(device))
            if (major, minor) != (9, 0):
                return f"te:blockwise runs on Hopper (sm90) GPUs; this one is sm{major}{minor}"
            if shape.k % 128:
                return f"te:blockwise needs K to be a multiple of 128, got K={shape.k}"
            if shape.m % 8:
                # TE asserts this in its GEMM ("Outer dimension requirement on B ... Caller must
                # pad"): jagged inputs (HSTU's tokens) have such row counts at some steps.
                return f"te:blockwise needs M (rows) to be a multiple of 8, got M={shape.m}"
        return None

    # ----------------------------------------------------------------------------- compute
    def _quantizer(self, spec: OperandSpec, device: torch.device):
        te = self._modules()
        fp8_dtype = {Fp8Format.E4M3: te["tex"].DType.kFloat8E4M3, Fp8Format.E5M2: te["tex"].DType.kFloat8E5M2}.get(spec.fmt)
        if fp8_dtype is None:
            raise ValueError(f"te: FP8 format {spec.fmt.value} is not supported (e4m3 or e5m2)")
        key = (spec.granularity, spec.fmt, spec.block, spec.power_of_two, str(device))
        if key not in self._quantizers:
            if spec.granularity == Granularity.TENSORWISE:
                quantizer = te["current"](
                    fp8_dtype, device, rowwise=True, columnwise=False, force_pow_2_scales=spec.power_of_two
                )
            elif spec.granularity == Granularity.BLOCKWISE:
                if te["block"] is None:
                    raise ValueError("te: this Transformer Engine has no blockwise FP8")
                dim = 2 if spec.block == (128, 128) else 1
                if spec.block not in ((128, 128), (1, 128), None):
                    raise ValueError(f"te: blockwise tiles are 1x128 or 128x128, got {spec.block}")
                quantizer = te["block"](
                    fp8_dtype, rowwise=True, columnwise=False,
                    force_pow_2_scales=spec.power_of_two, block_scaling_dim=dim,
                )  # fmt: skip
            else:
                raise ValueError(f"te: granularity {spec.granularity.value} is not supported; use tensorwise or blockwise")
            # Internal (storage-only) tensors: no torch-subclass dispatch, which is all general_gemm needs.
            quantizer.internal = True
            self._quantizers[key] = quantizer
        return self._quantizers[key]

    def quantize(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Any:
        if t.dim() != 2:
            raise ValueError(f"te: {name} must be a 2-D (rows, K) operand, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"te: {name} must be bfloat16, float16 or float32, got {t.dtype}")
        quantizer = self._quantizer(spec, t.device)
        return quantizer(t.contiguous())

    def _gemm(self, a: Any, b: Any, out_dtype: torch.dtype, *, split_accumulator: bool) -> torch.Tensor:
        te = self._modules()
        kwargs: Dict[str, Any] = dict(out_dtype=out_dtype, layout="TN", use_split_accumulator=split_accumulator)
        if te["workspace"] is not None:
            kwargs["workspace"] = te["workspace"]()
        # TE is column-major: general_gemm(B, A, layout="TN") = A @ B^T.
        return te["general_gemm"](b, a, **kwargs)[0]

    def mm(self, a: Any, b: Any, recipe: GemmRecipe, out_dtype: torch.dtype) -> torch.Tensor:
        kernel_dtype = out_dtype if out_dtype in _OUT_DTYPES else torch.float32
        out = self._gemm(a, b, kernel_dtype, split_accumulator=not recipe.fast_accum)
        return out if out.dtype == out_dtype else out.to(out_dtype)
