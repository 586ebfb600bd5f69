"""FP8 numerics: formats, scaling, casts and error metrics (pure torch, runs on any device)."""

from loka_torchrec.fp8.error_metrics import mere, relative_frobenius, sqnr_db
from loka_torchrec.fp8.formats import Fp8Format
from loka_torchrec.fp8.scaling import (
    AMAX_EPS,
    Fp8Tensor,
    Granularity,
    NonFiniteError,
    amax_to_scale,
    dequantize,
    quantize,
    saturated_cast,
    tensor_amax,
)

__all__ = [
    "AMAX_EPS",
    "Fp8Format",
    "Fp8Tensor",
    "Granularity",
    "NonFiniteError",
    "amax_to_scale",
    "dequantize",
    "mere",
    "quantize",
    "relative_frobenius",
    "saturated_cast",
    "sqnr_db",
    "tensor_amax",
]
