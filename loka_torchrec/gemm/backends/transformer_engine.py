"""``te``: Transformer Engine's FP8 GEMM (cuBLASLt).

Recipes:

* ``tensorwise`` (+ ``tensorwise_fast_accum``): the operands are quantized as every compiled plan
  quantizes them, one scale per tensor from its current amax
  (:func:`~loka_torchrec.gemm.backends.operand_quantize.quantize_operand`: the project's fused
  kernel on the GPU, whose codes equal the torch ops that Inductor fuses into a compiled step), so
  eager and compiled steps compute the same; the GEMM is TE's, through the ``loka::te_fp8_gemm``
  operator (an opaque op with a fake implementation, so compiled plans trace it whole), which hands
  TE the codes and the dequantization scale as TE's own FP8 storage (the scale is TE's ``scale_inv``).
* ``blockwise``: TE's ``Float8BlockQuantizer`` (1x128 tiles for activations and gradients, 128x128
  for weights, per :func:`loka_torchrec.gemm.recipes.recipe_for`) and TE's GEMM on its tensors;
  Hopper (sm90) only, eager only: TE's blockwise GEMM reads its scales in a layout of its own, which
  TE's quantizer writes, and TE's quantizers are Python objects that Dynamo does not trace.

The GEMM is ``transformer_engine.pytorch.cpp_extensions.general_gemm``. TE writes GEMMs in
column-major terms: ``general_gemm(W, X, layout="TN")`` returns ``X @ W^T``, so ``A @ B^T`` is
``general_gemm(B, A)``. Operands are row-wise only (no transposed copy), which is the layout the FP8
"TN" GEMM reads. Without ``fast_accum`` the split accumulator (periodic promotion to fp32) is used;
``_fast_accum`` turns it off. K and N must be multiples of 16. Written against TE 2.12; names and
keyword arguments that differ between releases (the FP8 storage class, the ``workspace`` argument)
are looked up, not assumed.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch

from loka_torchrec.gemm.backends.base import Availability, GemmBackend, get_backend, register_backend
from loka_torchrec.gemm.backends.operand_quantize import quantize_operand, quantize_operand_with_transpose
from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec
from loka_torchrec.evidence import GemmShape
from loka_torchrec.fp8 import Fp8Format, Fp8Tensor, Granularity

__all__ = ["TransformerEngineBackend"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _te_modules() -> Dict[str, Any]:
    """The TE pieces the backend uses (imported on first use; raises ImportError when TE is missing)."""
    import transformer_engine.pytorch  # noqa: F401  (loads the TE core library and the torch extension)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    try:  # TE's FP8 storage without the torch-subclass machinery, named so from TE 2.8 on
        from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
    except ImportError:
        from transformer_engine.pytorch.tensor._internal.float8_tensor_base import (
            Float8TensorBase as Float8TensorStorage,
        )
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
        storage=Float8TensorStorage,
        block=Float8BlockQuantizer,
        workspace=workspace,
    )


@register_backend
class TransformerEngineBackend(GemmBackend):
    name = "te"
    recipes = ("tensorwise", "blockwise", "tensorwise_fast_accum")
    compile_recipes = ("tensorwise", "tensorwise_fast_accum")
    devices = ("cuda",)
    fused_quantize = True  # tensorwise: the project's fused kernel (blockwise: TE's quantizer)

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
        # One tiny GEMM proves this TE build runs here.
        x = quantize_operand(torch.randn(32, 32, device=device), OperandSpec(Fp8Format.E4M3, Granularity.TENSORWISE))
        torch.ops.loka.te_fp8_gemm(x.data, x.data, x.dequant_scale, x.dequant_scale, torch.bfloat16, True)
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
    def _block_quantizer(self, spec: OperandSpec, device: torch.device):
        """TE's blockwise quantizer for ``spec`` (one per format, tile and scale rule)."""
        te = self._modules()
        if te["block"] is None:
            raise ValueError("te: this Transformer Engine has no blockwise FP8")
        fp8_dtype = {Fp8Format.E4M3: te["tex"].DType.kFloat8E4M3, Fp8Format.E5M2: te["tex"].DType.kFloat8E5M2}.get(spec.fmt)
        if fp8_dtype is None:
            raise ValueError(f"te: FP8 format {spec.fmt.value} is not supported (e4m3 or e5m2)")
        if spec.block not in ((128, 128), (1, 128), None):
            raise ValueError(f"te: blockwise tiles are 1x128 or 128x128, got {spec.block}")
        key = (spec.fmt, spec.block, spec.power_of_two, str(device))
        if key not in self._quantizers:
            quantizer = te["block"](
                fp8_dtype, rowwise=True, columnwise=False, force_pow_2_scales=spec.power_of_two,
                block_scaling_dim=2 if spec.block == (128, 128) else 1,
            )  # fmt: skip
            # Internal (storage-only) tensors: no torch-subclass dispatch, which is all general_gemm needs.
            quantizer.internal = True
            self._quantizers[key] = quantizer
        return self._quantizers[key]

    def quantize(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Any:
        """A tensorwise :class:`~loka_torchrec.fp8.Fp8Tensor`, or TE's blockwise FP8 tensor."""
        if t.dim() != 2:
            raise ValueError(f"te: {name} must be a 2-D (rows, K) operand, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"te: {name} must be bfloat16, float16 or float32, got {t.dtype}")
        if spec.granularity == Granularity.TENSORWISE:
            return quantize_operand(t, spec, name=name)
        if spec.granularity == Granularity.BLOCKWISE:
            return self._block_quantizer(spec, t.device)(t.contiguous())
        raise ValueError(f"te: granularity {spec.granularity.value} is not supported; use tensorwise or blockwise")

    def quantize_with_transpose(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Tuple[Fp8Tensor, Fp8Tensor]:
        """``t`` and ``t^T`` as two tensorwise operands from one read of ``t`` on the GPU."""
        if spec.granularity != Granularity.TENSORWISE:
            raise ValueError(f"te: {name}: only tensorwise operands are quantized with their transpose, got {spec.granularity.value}")
        return quantize_operand_with_transpose(t, spec, name=name)

    def _gemm(self, a: Any, b: Any, out_dtype: torch.dtype, *, split_accumulator: bool) -> torch.Tensor:
        te = self._modules()
        kwargs: Dict[str, Any] = dict(out_dtype=out_dtype, layout="TN", use_split_accumulator=split_accumulator)
        if te["workspace"] is not None:
            kwargs["workspace"] = te["workspace"]()
        # TE is column-major: general_gemm(B, A, layout="TN") = A @ B^T.
        return te["general_gemm"](b, a, **kwargs)[0]

    def mm(self, a: Any, b: Any, recipe: GemmRecipe, out_dtype: torch.dtype) -> torch.Tensor:
        kernel_dtype = out_dtype if out_dtype in _OUT_DTYPES else torch.float32
        split_accumulator = not recipe.fast_accum
        if isinstance(a, Fp8Tensor) or isinstance(b, Fp8Tensor):  # tensorwise
            for name, op in (("a", a), ("b", b)):
                if not isinstance(op, Fp8Tensor) or op.granularity != Granularity.TENSORWISE:
                    got = op.granularity.value if isinstance(op, Fp8Tensor) else type(op).__name__
                    raise ValueError(f"te: operand {name} must be a tensorwise Fp8Tensor like the other, got {got}")
            out = torch.ops.loka.te_fp8_gemm(
                a.data.contiguous(), b.data.contiguous(), a.dequant_scale, b.dequant_scale, kernel_dtype, split_accumulator
            )
        else:  # TE's blockwise tensors
            out = self._gemm(a, b, kernel_dtype, split_accumulator=split_accumulator)
        return out if out.dtype == out_dtype else out.to(out_dtype)


@torch.library.custom_op("loka::te_fp8_gemm", mutates_args=())
def _te_fp8_gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    split_accumulator: bool,
) -> torch.Tensor:
    """``a (M, K) @ b (N, K)^T`` of tensorwise FP8 codes (``x = codes * scale``) on TE's GEMM."""
    backend = get_backend("te")
    te = backend._modules()
    return backend._gemm(
        _fp8_storage(te, a, a_scale, "a"), _fp8_storage(te, b, b_scale, "b"), out_dtype, split_accumulator=split_accumulator
    )


def _fp8_storage(te: Dict[str, Any], codes: torch.Tensor, dequant_scale: torch.Tensor, name: str) -> Any:
    """Tensorwise FP8 ``codes`` as TE's FP8 storage, without a copy: the bytes, TE's name of their
    format, and the dequantization scale as TE's ``scale_inv`` (one float32)."""
    fp8_dtypes = {torch.float8_e4m3fn: te["tex"].DType.kFloat8E4M3, torch.float8_e5m2: te["tex"].DType.kFloat8E5M2}
    if codes.dtype not in fp8_dtypes:
        raise TypeError(f"te: operand {name} must be float8_e4m3fn or float8_e5m2 codes, got {codes.dtype}")
    if dequant_scale.numel() != 1:
        raise ValueError(f"te: operand {name} needs one (tensorwise) scale, got shape {tuple(dequant_scale.shape)}")
    return te["storage"](
        data=codes.contiguous().view(torch.uint8),
        fp8_scale_inv=dequant_scale.reshape(1).to(torch.float32),
        fp8_dtype=fp8_dtypes[codes.dtype],
        data_transpose=None,
        quantizer=None,
    )


@_te_fp8_gemm_op.register_fake
def _(a, b, a_scale, b_scale, out_dtype, split_accumulator):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
