"""From a high-precision tensor to FP8 and back: amax, scale, saturating cast, granularities.

Conventions (the same as ``torch._scaled_mm``):

* the *quantization scale* ``s = fp8_max / amax`` multiplies the high-precision value before the
  cast, ``q = cast(x * s)``;
* the *dequantization scale* ``1 / s`` multiplies the FP8 value back, ``x ~= q * (1 / s)``; this
  is what :class:`Fp8Tensor` stores and what ``torch._scaled_mm`` takes as ``scale_a`` / ``scale_b``.

Scales are computed in float32 (float64 inputs keep float64).

Zeros, infinities and NaN:

* an all-zero row or tensor has ``amax = 0``; amax is clamped to ``AMAX_EPS`` first, so the scale
  stays finite and the zeros quantize to zeros;
* a non-finite amax (an inf or NaN somewhere in the scaled group) raises
  :class:`NonFiniteError` when ``nonfinite="raise"`` (the default of this module), or, with
  ``nonfinite="propagate"`` (the training hot path, which must not synchronize with the GPU),
  gives a NaN dequantization scale for that group, so every output that reads the group is NaN:
  never a silently finite value. The Probe counts these events and its safety valve sends the
  layer back to bf16;
* the saturating cast clamps finite values to ``[-fp8_max, fp8_max]`` and turns ``+-inf`` into NaN
  (the ``fn`` formats have no infinity, and clamping inf to the maximum would hide it).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Literal, Optional, Tuple

import torch

from loka_torchrec.fp8.formats import Fp8Format

__all__ = [
    "AMAX_EPS",
    "Granularity",
    "Fp8Tensor",
    "NonFiniteError",
    "amax_to_scale",
    "saturated_cast",
    "quantize",
    "tensor_amax",
    "dequantize",
]

AMAX_EPS = 1e-12
"""amax is clamped to at least this before the scale is computed (all-zero groups)."""

NonFinitePolicy = Literal["raise", "propagate"]


class NonFiniteError(FloatingPointError, ValueError):
    """A tensor to be quantized holds inf or NaN."""


class Granularity(str, enum.Enum):
    """How many scales a GEMM operand of shape ``(rows, K)`` gets (``K`` is the reduction dim).

    * ``tensorwise``: one scale;
    * ``rowwise``: one per row (axiswise over the reduction dim), shape ``(rows, 1)``;
    * ``blockwise``: one per ``block`` tile, ``(1, 128)`` for activations and gradients and
      ``(128, 128)`` for weights by default, shape ``(ceil(rows / br), ceil(K / bk))``.
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """An FP8 GEMM operand and its dequantization scale.

    Attributes:
        data: ``(rows, K)`` FP8 values, row-major.
        dequant_scale: float32 multiplier(s) back to the original values: shape ``()`` for
            tensorwise, ``(rows, 1)`` for rowwise, ``(ceil(rows/br), ceil(K/bk))`` for blockwise.
        fmt: the FP8 format of ``data``.
        granularity: the scaling granularity.
        block: ``(br, bk)`` tile for blockwise scaling, else ``None``.
    """

    data: torch.Tensor
    dequant_scale: torch.Tensor
    fmt: Fp8Format
    granularity: Granularity
    block: Optional[Tuple[int, int]] = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def t(self) -> "Fp8Tensor":
        """The transposed operand (a view; only tensorwise scales are transposition-invariant)."""
        if self.granularity != Granularity.TENSORWISE:
            raise ValueError(
                f"only a tensorwise-scaled operand can be transposed without re-quantizing; "
                f"this one is {self.granularity.value}"
            )
        return dataclasses.replace(self, data=self.data.t())


def amax_to_scale(
    amax: torch.Tensor,
    fmt: Fp8Format,
    *,
    power_of_two: bool = False,
    margin_bits: int = 0,
    nonfinite: NonFinitePolicy = "raise",
    name: str = "tensor",
) -> torch.Tensor:
    """Quantization scale ``fp8_max / amax`` (float32, or float64 for float64 amax).

    Args:
        amax: absolute maxima of the scaled groups, any shape.
        fmt: target FP8 format.
        power_of_two: round the scale *down* to a power of two, so scaling is exact in binary
            and never pushes the group's maximum past ``fp8_max``.
        margin_bits: extra headroom: the scale is divided by ``2 ** margin_bits``.
        nonfinite: ``"raise"`` a :class:`NonFiniteError` for a non-finite amax, or
            ``"propagate"`` a NaN scale for that group without synchronizing with the device.
        name: the tensor's name, for error messages.
    """
    if margin_bits < 0:
        raise ValueError(f"margin_bits must be >= 0, got {margin_bits}")
    work_dtype = torch.float64 if amax.dtype == torch.float64 else torch.float32
    amax = amax.to(work_dtype)
    finite = torch.isfinite(amax)
    if nonfinite == "raise":
        if not bool(finite.all()):
            raise NonFiniteError(f"{name}: holds inf or NaN values; cannot compute an FP8 scale")
    elif nonfinite != "propagate":
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    # The literal is AMAX_EPS: torch.compile(dynamic=True) would trace a module-level float as symbolic.
    scale = fmt.max / torch.clamp(amax, min=1e-12)
    if margin_bits:
        scale = scale / (2.0**margin_bits)
    if power_of_two:
        rounded = torch.exp2(torch.floor(torch.log2(scale)))
        # log2 can round up to an integer just above the true value: step down once more then.
        scale = torch.where(rounded > scale, rounded / 2, rounded)
    # amax = inf would give scale 0, which turns every finite value into a silent 0: use NaN.
    return torch.where(finite, scale, torch.full_like(scale, math.nan))


def saturated_cast(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """``cast(clamp(x * scale, -max, max))`` to ``fmt``; +-inf becomes NaN, NaN stays NaN."""
    scaled = x.to(scale.dtype) * scale
    # (scaled - scaled) is 0 for finite values and NaN for +-inf and NaN: one fused elementwise op.
    clamped = scaled.clamp(-fmt.max, fmt.max) + (scaled - scaled)
    return clamped.to(fmt.dtype)


def quantize(
    x: torch.Tensor,
    fmt: "Fp8Format | str" = Fp8Format.E4M3,
    granularity: "Granularity | str" = Granularity.TENSORWISE,
    *,
    block: Optional[Tuple[int, int]] = None,
    power_of_two: bool = False,
    margin_bits: int = 0,
    nonfinite: NonFinitePolicy = "raise",
    name: str = "tensor",
    amax: Optional[torch.Tensor] = None,
) -> Fp8Tensor:
    """Quantize a GEMM operand ``x`` of shape ``(rows, K)`` (``K`` = reduction dim) to FP8.

    Args:
        x: ``(rows, K)`` float tensor (a 1-D tensor is treated as one row).
        fmt: FP8 format, e.g. ``"e4m3"``.
        granularity: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.
        block: blockwise tile ``(br, bk)``; default ``(1, 128)``. Partial tiles at the edges
            get their own scale.
        power_of_two, margin_bits, nonfinite: see :func:`amax_to_scale`.
        name: the tensor's name, for error messages.
        amax: tensorwise only: scale from this amax (a 0-d tensor, e.g. the maximum of earlier
            steps' amaxes: *delayed* scaling) instead of ``x``'s own. The cast then needs no
            reduction over ``x`` first, so a compiled step can fuse it into the op that produces
            ``x``; values of ``x`` beyond ``amax`` saturate to the format's maximum. ``nonfinite``
            then judges that amax: an inf or NaN in ``x`` itself becomes a NaN code.

    Returns:
        An :class:`Fp8Tensor` with row-major ``data`` of ``x``'s shape.

    Example::

        >>> q = quantize(torch.tensor([[1.0, -2.0], [0.5, 0.25]]), "e4m3", "rowwise")
        >>> q.dequantize()
        tensor([[ 1.0000, -2.0000],
                [ 0.5000,  0.2500]])
    """
    fmt = Fp8Format.parse(fmt)
    granularity = Granularity(granularity)
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating point tensor, got {x.dtype}")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D (rows, K) operand, got shape {tuple(x.shape)}")
    opts = dict(power_of_two=power_of_two, margin_bits=margin_bits, nonfinite=nonfinite, name=name)
    if amax is not None and (granularity != Granularity.TENSORWISE or amax.dim() != 0):
        raise ValueError(f"{name}: amax is for tensorwise scaling and must be 0-d; got {granularity.value} "
                         f"scaling with amax of shape {tuple(amax.shape)}")  # fmt: skip
    if granularity == Granularity.TENSORWISE:
        scale = amax_to_scale(tensor_amax(x) if amax is None else amax, fmt, **opts)
        return Fp8Tensor(saturated_cast(x, scale, fmt).contiguous(), scale.reciprocal().float(), fmt, granularity)
    if granularity == Granularity.ROWWISE:
        amax = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros((x.shape[0], 1))
        scale = amax_to_scale(amax, fmt, **opts)
        return Fp8Tensor(saturated_cast(x, scale, fmt).contiguous(), scale.reciprocal().float(), fmt, granularity)
    br, bk = block or (1, 128)
    if br <= 0 or bk <= 0:
        raise ValueError(f"block must be positive, got {(br, bk)}")
    rows, k = x.shape
    tiles = _pad_to_tiles(x, br, bk)  # (R, br, C, bk)
    amax = tiles.abs().amax(dim=(1, 3))  # (R, C)
    scale = amax_to_scale(amax, fmt, **opts)
    expanded = scale[:, None, :, None].expand_as(tiles)
    data = saturated_cast(tiles, expanded, fmt)
    data = data.reshape(tiles.shape[0] * br, tiles.shape[2] * bk)[:rows, :k].contiguous()
    return Fp8Tensor(data, scale.reciprocal().float(), fmt, granularity, (br, bk))


SCALINGS = ("current", "delayed")
"""What scales a layer's FP8 operands (forward and ``dy`` alike): each tensor's own amax, or the
largest of earlier calls' amaxes (``quantize(..., amax=)``); a ``LokaLinear`` setting, named here
so that every part that measures or runs the GEMMs agrees on the names."""


def check_scaling(value: str, field: str) -> None:
    """Refuse a scaling setting other than :data:`SCALINGS`, naming ``field``."""
    if value not in SCALINGS:
        raise ValueError(f"{field}: expected one of {', '.join(SCALINGS)}, got {value!r}")

AMAX_ORDERS = ("chunks", "rows", "whole")
_AMAX_ORDER = "chunks"
"""How :func:`tensor_amax` orders its reduction (one of ``AMAX_ORDERS``; a benchmark compares them)."""
_AMAX_CHUNK = 256


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of a 2-D ``x``, reduced in an order that ``torch.compile`` turns into fast kernels.

    The maximum is exact in any order, so every order equals ``x.abs().amax()`` bit for bit. Inductor
    inlines a pointwise producer (a transpose's copy, an add) into the reduction and fuses the
    reduction into a producer that reduces over the same ranges (a norm over blocks of a row).

    * ``"chunks"`` (default): along the contiguous dim in chunks of ``_AMAX_CHUNK`` elements (when
      they divide it; else as "whole"), then over each row's chunk maxima, then over the rows. An
      inlined transpose is read with index arithmetic within a chunk, and the chunks match a norm
      over blocks of that width, which then computes them in its own kernel. The step over each
      row's maxima keeps the last reduction to one value per row: a single reduction over all the
      chunk maxima can be left to one thread block.
    * ``"rows"``: along each row, then over the rows (a benchmark's alternative).
    * ``"whole"``: ``x.abs().amax()``, one reduction over all ``rows * K`` elements that Inductor
      splits into chunks crossing rows: an inlined transpose is then read with div/mod index
      arithmetic per element, from unaligned chunk starts.
    """
    if not x.numel():
        return x.new_zeros(())
    if x.stride(1) != 1 and x.stride(0) == 1:
        x = x.t()  # the contiguous dim last: a transposed view's amax is the tensor's
    cols = x.shape[1]
    if _AMAX_ORDER == "chunks" and x.stride(1) == 1 and cols % _AMAX_CHUNK == 0:
        # reshape, not Tensor.unflatten: unflatten is Python code ending in super().unflatten(), which
        # Dynamo (torch 2.11) refuses to trace inside a torch-function mode (a Parameter site's scope)
        chunks = x.reshape(x.shape[0], cols // _AMAX_CHUNK, _AMAX_CHUNK)
        return chunks.abs().amax(dim=2).amax(dim=1).amax()
    if _AMAX_ORDER == "rows" and x.stride(1) == 1:
        return x.abs().amax(dim=1).amax()
    return x.abs().amax()


def dequantize(q: Fp8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Back to high precision: ``data * dequant_scale`` broadcast per the granularity."""
    values = q.data.to(torch.float32 if dtype != torch.float64 else torch.float64)
    scale = q.dequant_scale.to(values.dtype)
    if q.granularity != Granularity.BLOCKWISE:
        return (values * scale).to(dtype)
    br, bk = q.block
    rows, k = values.shape
    full = scale.repeat_interleave(br, dim=0).repeat_interleave(bk, dim=1)[:rows, :k]
    return (values * full).to(dtype)


def _pad_to_tiles(x: torch.Tensor, br: int, bk: int) -> torch.Tensor:
    """``(rows, K)`` -> ``(ceil(rows/br), br, ceil(K/bk), bk)``, zero-padded at the edges."""
    rows, k = x.shape
    pad_r, pad_k = (-rows) % br, (-k) % bk
    if pad_r or pad_k:
        x = torch.nn.functional.pad(x, (0, pad_k, 0, pad_r))
    return x.reshape(x.shape[0] // br, br, x.shape[1] // bk, bk)
