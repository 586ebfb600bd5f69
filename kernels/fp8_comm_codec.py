"""FP8 wire format for embedding all-to-all payloads: one-pass encode and decode.

The payload of a flat tensor of ``n`` values (``n`` a multiple of ``block``) is a ``uint8`` tensor
of ``n / block`` *records*, one per block of ``block`` consecutive values::

    record = [ block FP8 bytes | scale bytes ]
    scale bytes = fp32 dequantization scale, 4 bytes little-endian   (scale_format="fp32")
                = E8M0 exponent byte e, dequantization scale 2**(e-127) (scale_format="e8m0")

Every record is self-contained, so a payload splits at any multiple of ``block`` values (at
``record_bytes`` per block) and the pieces of several senders concatenate into a valid payload:
exactly what an all-to-all needs, since the codec never sees the split sizes.

Numerics of one block ``x`` (all arithmetic in float32):

* ``amax`` = max of ``|x|`` over the *finite* values, at least ``AMAX_EPS`` (an all-zero block
  gets a finite scale and decodes to zeros);
* quantization scale ``s = fp8_max / amax`` (fp32), or for E8M0 the largest power of two with
  ``amax * s <= fp8_max``, found from the bits of ``amax`` (exact, no ``log2``);
* byte = ``cast(clamp(x * s, -fp8_max, fp8_max))``, round to nearest even;
* a non-finite value travels as itself: NaN as the format's NaN byte, +-inf as E5M2's +-inf, or
  as NaN in E4M3 (which has no infinity). The block's finite values keep their accuracy. Each
  side counts the non-finite values it sends / receives (``count`` argument).

Round-trip error of a finite value ``x`` in a block with dequantization scale ``d = 1 / s``:
``|decode(encode(x)) - x| <= u |x| + (sub / 2) d`` with ``u`` the unit roundoff (``2**-4`` E4M3,
``2**-3`` E5M2) and ``sub`` the smallest subnormal (``2**-9`` E4M3, ``2**-16`` E5M2), up to
float32 rounding of the scaling.

Two implementations share this format: :func:`encode_reference` / :func:`decode_reference` in
plain torch ops (any device; the CPU path) and the Triton kernels behind :func:`encode_triton` /
:func:`decode_triton` (one pass each; CUDA, or the CPU interpreter with ``TRITON_INTERPRET=1``).
:func:`encode` / :func:`decode` pick Triton for CUDA tensors when it is importable.

Example::

    >>> x = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, float("nan"), 0.0, 0.0])
    >>> payload = encode(x, block=4, fmt="e4m3", scale_format="fp32")
    >>> payload.dtype, payload.numel()  # 2 records of 4 + 4 bytes
    (torch.uint8, 16)
    >>> decode(payload, block=4, fmt="e4m3", scale_format="fp32")
    tensor([ 1.0000, -2.0000,  0.5000,  0.0000,  3.0000,     nan,  0.0000,  0.0000])
"""

from __future__ import annotations

import functools
import struct
from typing import Optional

import torch

from loka_torchrec.fp8 import AMAX_EPS, Fp8Format

try:  # Triton is optional: the torch reference covers every device.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "SCALE_BYTES",
    "SUPPORTED_FORMATS",
    "record_bytes",
    "encoded_size",
    "encode",
    "decode",
    "encode_reference",
    "decode_reference",
    "encode_triton",
    "decode_triton",
    "triton_usable",
]

SCALE_BYTES = {"fp32": 4, "e8m0": 1}
"""Bytes of one block's scale on the wire, by scale format."""

SUPPORTED_FORMATS = (Fp8Format.E4M3, Fp8Format.E5M2)
"""The OCP formats the wire format carries (the byte codes of NaN and inf are format-specific)."""

_NAN_BYTE = 0x7F  # S.1111.111 is NaN in both E4M3FN and E5M2
_POS_INF_E5M2 = 0x7C
_NEG_INF_E5M2 = 0xFC
_E8M0_BIAS = 127
# Power-of-two exponents kept inside the normal float32 range, so 2**k is built from bits exactly.
_POW2_MIN, _POW2_MAX = -126, 126
_MIN_NORMAL_EXP = {Fp8Format.E4M3: -6, Fp8Format.E5M2: -14}


def _check(fmt, scale_format: str, block: int) -> Fp8Format:
    fmt = Fp8Format.parse(fmt, field="fmt")
    if fmt not in SUPPORTED_FORMATS:
        raise ValueError(f"fmt: the comm wire format supports e4m3 and e5m2, got {fmt.value}")
    if scale_format not in SCALE_BYTES:
        raise ValueError(f"scale_format: expected one of {sorted(SCALE_BYTES)}, got {scale_format!r}")
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"block: expected a positive int, got {block!r}")
    return fmt


def record_bytes(block: int, scale_format: str) -> int:
    """Bytes on the wire for one block of ``block`` values."""
    return block + SCALE_BYTES[scale_format]


def encoded_size(numel: int, block: int, scale_format: str) -> int:
    """Length in bytes of the payload of ``numel`` values; ``numel`` must be a multiple of ``block``."""
    if numel % block:
        raise ValueError(
            f"a payload of {numel} values is not a multiple of the comm block of {block} values; "
            "use a block_size that divides every embedding dim (block_size=0 takes the dims' gcd)"
        )
    return numel // block * record_bytes(block, scale_format)


def _fp8_max_bits(fmt: Fp8Format):
    """Biased-free exponent and mantissa bits of ``fp8_max`` as a float32 (448 = 1.75 * 2**8)."""
    bits = struct.unpack("<i", struct.pack("<f", fmt.max))[0]
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


def _pow2_exponent(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Largest ``k`` with ``amax * 2**k <= fp8_max`` (int32), from the bits of normal float32 ``amax``."""
    exp_max, mant_max = _fp8_max_bits(fmt)
    bits = amax.contiguous().view(torch.int32)
    exp_amax = ((bits >> 23) & 0xFF) - 127
    mant_amax = bits & 0x7FFFFF
    k = (exp_max - exp_amax) - (mant_amax > mant_max).to(torch.int32)
    return k.clamp(_POW2_MIN, _POW2_MAX)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0 ** k`` as float32, exact, for int32 ``k`` in the normal range."""
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def _nonfinite_bytes(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The byte that carries each non-finite value of ``x`` (NaN, or E5M2's signed infinity)."""
    nan = torch.full_like(x, _NAN_BYTE, dtype=torch.uint8)
    if fmt == Fp8Format.E4M3:
        return nan  # E4M3FN has no infinity: inf travels as NaN, never as a finite 448
    inf = torch.where(x > 0, _POS_INF_E5M2, _NEG_INF_E5M2).to(torch.uint8)
    return torch.where(torch.isnan(x), nan, inf)


def encode_reference(
    x: torch.Tensor,
    *,
    block: int,
    fmt="e4m3",
    scale_format: str = "fp32",
    count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Encode ``x`` (any shape, float32/bf16/fp16/float64, ``numel % block == 0``) in plain torch ops.

    Args:
        x: values to send, read in row-major order.
        block: values per scale.
        fmt: ``"e4m3"`` or ``"e5m2"``.
        scale_format: ``"fp32"`` or ``"e8m0"``.
        count: optional 1-element int64 tensor on ``x``'s device; the number of non-finite values
            of ``x`` is added to it (no host synchronization).

    Returns:
        1-D ``uint8`` payload of ``encoded_size(x.numel(), block, scale_format)`` bytes.
    """
    fmt = _check(fmt, scale_format, block)
    encoded_size(x.numel(), block, scale_format)  # raises for a partial block
    n_blocks = x.numel() // block
    if n_blocks == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    xf = x.reshape(n_blocks, block).to(torch.float32)
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), torch.zeros_like(xf)).amax(dim=1).clamp(min=AMAX_EPS)
    if scale_format == "e8m0":
        k = _pow2_exponent(amax, fmt)
        scale = _pow2(k)
        scale_bytes = (_E8M0_BIAS - k).to(torch.uint8).unsqueeze(1)
    else:
        scale = fmt.max / amax
        scale_bytes = scale.reciprocal().contiguous().view(torch.uint8).view(n_blocks, 4)
    scaled = (xf * scale.unsqueeze(1)).clamp(-fmt.max, fmt.max)
    data = scaled.to(fmt.dtype).view(torch.uint8)
    data = torch.where(finite, data, _nonfinite_bytes(xf, fmt))
    payload = torch.cat([data, scale_bytes], dim=1).reshape(-1)
    if count is not None:
        count += (~finite).sum()
    return payload


def decode_reference(
    payload: torch.Tensor,
    *,
    block: int,
    fmt="e4m3",
    scale_format: str = "fp32",
    out_dtype: torch.dtype = torch.float32,
    count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode a payload of :func:`encode_reference` back to a flat ``out_dtype`` tensor.

    Args:
        payload: 1-D ``uint8`` tensor, a whole number of records (possibly from several senders).
        block, fmt, scale_format: as given to the encoder.
        out_dtype: dtype of the result.
        count: optional 1-element int64 tensor; the number of non-finite decoded values is added.

    Returns:
        1-D tensor of ``payload.numel() / record_bytes * block`` values.
    """
    fmt = _check(fmt, scale_format, block)
    rec = record_bytes(block, scale_format)
    _check_payload(payload, rec)
    n_blocks = payload.numel() // rec
    records = payload.reshape(n_blocks, rec)
    values = records[:, :block].contiguous().view(fmt.dtype).to(torch.float32)
    if scale_format == "e8m0":
        dequant = _pow2(records[:, block:].to(torch.int32) - _E8M0_BIAS)
    else:
        scale_bytes = torch.empty((n_blocks, 4), dtype=torch.uint8, device=payload.device)
        dequant = scale_bytes.copy_(records[:, block:]).view(torch.float32)  # fresh, 4-byte aligned
    out = (values * dequant).to(out_dtype).reshape(-1)
    if count is not None:
        count += (~torch.isfinite(out)).sum()
    return out


def _check_payload(payload: torch.Tensor, rec: int) -> None:
    if payload.dtype != torch.uint8:
        raise TypeError(f"payload: expected a uint8 tensor, got {payload.dtype}")
    if payload.numel() % rec:
        raise ValueError(f"payload: {payload.numel()} bytes is not a whole number of {rec}-byte records")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


def triton_usable(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on ``t`` (a CUDA tensor, Triton importable)."""
    return HAS_TRITON and t.is_cuda


def _tile(block: int):
    """(BLOCK_P2, ROWS): the padded block width and the blocks per program (~4096 values)."""
    block_p2 = triton.next_power_of_2(block)
    rows = max(1, min(64, 4096 // block_p2))
    return block_p2, rows


if HAS_TRITON:

    @triton.jit
    def _encode_kernel(
        x_ptr,
        out_ptr,
        count_ptr,
        n_blocks,
        BLOCK: tl.constexpr,
        BLOCK_P2: tl.constexpr,
        ROWS: tl.constexpr,
        REC: tl.constexpr,
        FP8_MAX: tl.constexpr,
        EXP_MAX: tl.constexpr,
        MANT_MAX: tl.constexpr,
        MANT_BITS: tl.constexpr,
        MIN_NORMAL_EXP: tl.constexpr,
        IS_E4M3: tl.constexpr,
        E8M0: tl.constexpr,
        AMAX_MIN: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_P2)
        row_mask = rows < n_blocks
        mask = row_mask[:, None] & (cols < BLOCK)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * BLOCK + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        finite = ax < float("inf")  # False for +-inf and NaN
        amax = tl.maximum(tl.max(tl.where(finite, ax, 0.0), axis=1), AMAX_MIN)
        if E8M0:
            bits = amax.to(tl.int32, bitcast=True)
            exp_amax = ((bits >> 23) & 0xFF) - 127
            k = (EXP_MAX - exp_amax) - ((bits & 0x7FFFFF) > MANT_MAX).to(tl.int32)
            k = tl.minimum(tl.maximum(k, -126), 126)
            scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
        else:
            # As torch evaluates the reference's ``fp8_max / amax``: ``amax.reciprocal() * fp8_max``,
            # two correctly rounded steps (one division rounds differently in the last bit).
            scale = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * FP8_MAX
        y = tl.minimum(tl.maximum(x * scale[:, None], -FP8_MAX), FP8_MAX)
        y = tl.where(finite, y, 0.0)
        # Round to the FP8 grid here (round to nearest even, in exact float32 steps), so the cast
        # below only re-encodes a representable value: the result does not depend on how a
        # device, or Triton's CPU interpreter, rounds in its fp8 conversion.
        ybits = y.to(tl.int32, bitcast=True)
        exp_y = tl.maximum(((ybits >> 23) & 0xFF) - 127, MIN_NORMAL_EXP)
        spacing = ((exp_y - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
        steps = tl.abs(y) / spacing  # exact: division by a power of two; at most 2**(MANT_BITS+1)
        steps = (steps + 8388608.0) - 8388608.0  # 2**23: float32 addition rounds to an integer, ties to even
        rounded = (steps * spacing).to(tl.int32, bitcast=True) | (ybits & -2147483648)
        y = rounded.to(tl.float32, bitcast=True)
        if IS_E4M3:
            data = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            special = tl.full(data.shape, 0x7F, tl.uint8)
        else:
            data = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
            inf_byte = tl.where(x > 0, 0x7C, 0xFC).to(tl.uint8)
            special = tl.where(x != x, 0x7F, inf_byte).to(tl.uint8)
        data = tl.where(finite, data, special)
        tl.store(out_ptr + rows64[:, None] * REC + cols[None, :], data, mask=mask)
        scale_at = out_ptr + rows64 * REC + BLOCK
        if E8M0:
            tl.store(scale_at, (127 - k).to(tl.uint8), mask=row_mask)
        else:
            dequant = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
            dbits = dequant.to(tl.int32, bitcast=True)
            tl.store(scale_at, (dbits & 0xFF).to(tl.uint8), mask=row_mask)
            tl.store(scale_at + 1, ((dbits >> 8) & 0xFF).to(tl.uint8), mask=row_mask)
            tl.store(scale_at + 2, ((dbits >> 16) & 0xFF).to(tl.uint8), mask=row_mask)
            tl.store(scale_at + 3, ((dbits >> 24) & 0xFF).to(tl.uint8), mask=row_mask)
        n_bad = tl.sum(tl.sum(tl.where(finite, 0, 1), axis=1), axis=0)  # masked lanes loaded 0.0: finite
        tl.atomic_add(count_ptr, n_bad.to(tl.int64))

    @triton.jit
    def _decode_kernel(
        in_ptr,
        out_ptr,
        count_ptr,
        n_blocks,
        BLOCK: tl.constexpr,
        BLOCK_P2: tl.constexpr,
        ROWS: tl.constexpr,
        REC: tl.constexpr,
        IS_E4M3: tl.constexpr,
        E8M0: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_P2)
        row_mask = rows < n_blocks
        mask = row_mask[:, None] & (cols < BLOCK)[None, :]
        rows64 = rows.to(tl.int64)
        data = tl.load(in_ptr + rows64[:, None] * REC + cols[None, :], mask=mask, other=0)
        scale_at = in_ptr + rows64 * REC + BLOCK
        if E8M0:
            e = tl.load(scale_at, mask=row_mask, other=127).to(tl.int32)
            dequant = (e << 23).to(tl.float32, bitcast=True)
        else:
            b0 = tl.load(scale_at, mask=row_mask, other=0).to(tl.int32)
            b1 = tl.load(scale_at + 1, mask=row_mask, other=0).to(tl.int32)
            b2 = tl.load(scale_at + 2, mask=row_mask, other=0).to(tl.int32)
            b3 = tl.load(scale_at + 3, mask=row_mask, other=0).to(tl.int32)
            dequant = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
        magnitude = data & 0x7F
        if IS_E4M3:
            values = data.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            values = tl.where(magnitude == 0x7F, float("nan"), values)
        else:
            values = data.to(tl.float8e5, bitcast=True).to(tl.float32)
            inf = tl.where(data > 0x7F, -float("inf"), float("inf"))
            values = tl.where(magnitude == 0x7C, inf, values)
            values = tl.where(magnitude > 0x7C, float("nan"), values)
        out = (values * dequant[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows64[:, None] * BLOCK + cols[None, :], out, mask=mask)
        back = tl.abs(out.to(tl.float32))
        n_bad = tl.sum(tl.sum(tl.where(mask & ~(back < float("inf")), 1, 0), axis=1), axis=0)
        tl.atomic_add(count_ptr, n_bad.to(tl.int64))


def _scratch_count(t: torch.Tensor, count: Optional[torch.Tensor]) -> torch.Tensor:
    if count is None:
        return torch.zeros(1, dtype=torch.int64, device=t.device)
    if count.dtype != torch.int64 or count.numel() != 1 or count.device != t.device:
        raise ValueError(f"count: expected a 1-element int64 tensor on {t.device}, got {count.dtype} {tuple(count.shape)} on {count.device}")
    return count


def encode_triton(
    x: torch.Tensor,
    *,
    block: int,
    fmt="e4m3",
    scale_format: str = "fp32",
    count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`encode_reference` in one Triton kernel (amax, scale, cast and pack per block)."""
    if not HAS_TRITON:
        raise RuntimeError("encode_triton needs triton; install it or use encode_reference")
    fmt = _check(fmt, scale_format, block)
    n_bytes = encoded_size(x.numel(), block, scale_format)
    out = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    n_blocks = x.numel() // block
    if n_blocks == 0:
        return out
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)
    x = x.contiguous().reshape(-1)
    count = _scratch_count(x, count)
    block_p2, rows = _tile(block)
    exp_max, mant_max = _fp8_max_bits(fmt)
    _encode_kernel[(triton.cdiv(n_blocks, rows),)](
        x, out, count, n_blocks,
        BLOCK=block, BLOCK_P2=block_p2, ROWS=rows, REC=record_bytes(block, scale_format),
        FP8_MAX=fmt.max, EXP_MAX=exp_max, MANT_MAX=mant_max,
        MANT_BITS=fmt.mantissa_bits, MIN_NORMAL_EXP=_MIN_NORMAL_EXP[fmt],
        IS_E4M3=fmt == Fp8Format.E4M3, E8M0=scale_format == "e8m0", AMAX_MIN=AMAX_EPS,
    )  # fmt: skip
    return out


def decode_triton(
    payload: torch.Tensor,
    *,
    block: int,
    fmt="e4m3",
    scale_format: str = "fp32",
    out_dtype: torch.dtype = torch.float32,
    count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`decode_reference` in one Triton kernel."""
    if not HAS_TRITON:
        raise RuntimeError("decode_triton needs triton; install it or use decode_reference")
    fmt = _check(fmt, scale_format, block)
    rec = record_bytes(block, scale_format)
    _check_payload(payload, rec)
    n_blocks = payload.numel() // rec
    out = torch.empty(n_blocks * block, dtype=out_dtype, device=payload.device)
    if n_blocks == 0:
        return out
    payload = payload.contiguous()
    count = _scratch_count(payload, count)
    block_p2, rows = _tile(block)
    _decode_kernel[(triton.cdiv(n_blocks, rows),)](
        payload, out, count, n_blocks,
        BLOCK=block, BLOCK_P2=block_p2, ROWS=rows, REC=rec,
        IS_E4M3=fmt == Fp8Format.E4M3, E8M0=scale_format == "e8m0",
    )  # fmt: skip
    return out


@functools.lru_cache(maxsize=None)
def _triton_dtype_ok(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16, torch.float16)


def encode(x: torch.Tensor, *, block: int, fmt="e4m3", scale_format: str = "fp32", count=None, kernel: str = "auto"):
    """Encode with the Triton kernel on CUDA tensors when available (``kernel="auto"``), else torch ops.

    ``kernel`` forces ``"triton"`` or ``"torch"``.
    """
    if kernel == "triton" or (kernel == "auto" and triton_usable(x)):
        return encode_triton(x, block=block, fmt=fmt, scale_format=scale_format, count=count)
    return encode_reference(x, block=block, fmt=fmt, scale_format=scale_format, count=count)


def decode(
    payload: torch.Tensor,
    *,
    block: int,
    fmt="e4m3",
    scale_format: str = "fp32",
    out_dtype: torch.dtype = torch.float32,
    count=None,
    kernel: str = "auto",
):
    """Decode with the Triton kernel on CUDA tensors when available (``kernel="auto"``), else torch ops."""
    use_triton = kernel == "triton" or (kernel == "auto" and triton_usable(payload))
    if use_triton and _triton_dtype_ok(out_dtype):
        return decode_triton(payload, block=block, fmt=fmt, scale_format=scale_format, out_dtype=out_dtype, count=count)
    return decode_reference(payload, block=block, fmt=fmt, scale_format=scale_format, out_dtype=out_dtype, count=count)
