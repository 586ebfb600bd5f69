"""Fused FP8 quantization: amax, scale and saturating cast in one kernel, with an optional
transposed copy for the grad-weight GEMM.

The semantics are those of :func:`loka_torchrec.fp8.quantize` with ``nonfinite="propagate"``
(:func:`fp8_quantize_reference` is exactly that call):

* quantization scale ``s = fp8_max * (1 / max(amax, AMAX_EPS))`` in float32 (the reciprocal and the
  product rounded separately, as torch evaluates ``fp8_max / amax``), optionally rounded down to a
  power of two; a non-finite amax gives a NaN scale for its group;
* ``q = cast(clamp(x * s, -fp8_max, fp8_max))`` with round-to-nearest-even, NaN kept;
* returned dequantization scale ``1 / s`` in float32.

Granularities of an operand ``x`` of shape ``(rows, K)``:

* ``rowwise``: one scale per row. When ``K`` fits one tile (up to 8192) this is a single pass that
  reads ``x`` once;
* ``tensorwise``: a two-level reduction: every tile reduces its amax and folds it into one global
  value with an atomic max, then a second pass casts;
* ``blockwise``: one scale per ``1 x block_k`` block along ``K`` (default 128), single pass.

The transposed copy :func:`fp8_quantize_with_transpose` returns is ``x^T`` of shape ``(K, rows)``
quantized *as an operand of its own*: rowwise means one scale per column of ``x``, blockwise one
per ``block_k x 1`` block of ``x``, tensorwise the same scale. This is the ``B = x^T`` operand of the
grad-weight GEMM ``dW = dy^T x``, written while ``x`` is read for the forward GEMM. Blockwise
produces both copies in one pass; rowwise and tensorwise need the amax pass first.

amax is reduced on the int32 bit patterns of ``|x|`` (monotone for non-negative floats, NaN above
inf), so the reduction and the cross-tile atomic are exact and propagate NaN.
"""

from typing import Optional, Tuple

import torch

from loka_torchrec.fp8 import AMAX_EPS, Fp8Format, Fp8Tensor, Granularity, quantize

from ._compat import (
    check_launch_device,
    device_guard,
    fp8_format,
    next_power_of_2,
    require_triton,
    tl,
    tracing,
    triton,
)

__all__ = [
    "fp8_quantize",
    "fp8_quantize_with_transpose",
    "fp8_quantize_reference",
    "fp8_quantize_with_transpose_reference",
    "scale_shape",
]

_ROW_KERNEL_MAX_K = 8192  # rowwise rows up to this length are quantized in one read
_TILE = 64  # tile of the two-pass (amax, then cast) path
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid axis, which holds the column tiles

# ------------------------------------------------------------------------------------ kernels


@triton.jit
def _abs_bits(x):
    """|x| of a float32 tile as int32 bit patterns: ordered like |x|, with NaN above inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _scales_from_amax_bits(amax_bits, FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    """(quantization scale, dequantization scale) from amax bit patterns, as loka_torchrec.fp8 does."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    one = tl.zeros_like(amax) + 1.0
    # torch evaluates ``fp8_max / amax`` as ``amax.reciprocal() * fp8_max``: two correctly rounded steps.
    scale = tl.math.div_rn(one, tl.maximum(amax, EPS)) * FMT_MAX
    if POW2:
        # Round down to a power of two exactly: keep the exponent bits only.
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    scale = tl.where(amax < float("inf"), scale, float("nan"))  # inf or NaN in the group -> NaN scale
    return scale, tl.math.div_rn(one, scale)


@triton.jit
def _saturate(y, FMT_MAX: tl.constexpr):
    """clamp(y, -fp8_max, fp8_max), keeping NaN."""
    y = tl.maximum(y, -FMT_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(y, FMT_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, dq_ptr,
    R, C, stride_xr, stride_xc,
    FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Rowwise quantization of whole rows (C <= BLOCK_C): one read of x."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < C)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale, dequant = _scales_from_amax_bits(tl.max(_abs_bits(x), axis=1), FMT_MAX, EPS, POW2)
    q = _saturate(x * scale[:, None], FMT_MAX)
    tl.store(q_ptr + rows64[:, None] * C + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(dq_ptr + rows, dequant, mask=row_ok)


@triton.jit
def _amax_tiles_kernel(
    s_ptr, row_amax_ptr, col_amax_ptr,
    R, C, stride_sr, stride_sc,
    TENSOR: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """First pass: fold each tile's amax into the per-row / per-column / global amax (atomic max)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_sr + cols[None, :] * stride_sc, mask=mask, other=0.0)
    bits = _abs_bits(x.to(tl.float32))
    if TENSOR:
        tl.atomic_max(row_amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))
    else:
        if ROW:
            tl.atomic_max(row_amax_ptr + rows, tl.max(bits, axis=1), mask=rows < R)
        if COL:
            tl.atomic_max(col_amax_ptr + cols, tl.max(bits, axis=0), mask=cols < C)


@triton.jit
def _quantize_tiles_kernel(
    s_ptr, q_ptr, qt_ptr, dq_ptr, dqt_ptr, row_amax_ptr, col_amax_ptr,
    R, C, stride_sr, stride_sc, stride_dq, stride_dqt,
    FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
    MODE: tl.constexpr, WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Cast a tile of S (R, C) to q (R, C) with row scales and/or to qt (C, R) with column scales.

    MODE 0: one global amax; MODE 1: per-row / per-column amax from the first pass;
    MODE 2: blockwise, the tile is one block (BLOCK_C wide for q, BLOCK_R tall for qt).
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < R
    col_ok = cols < C
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    x = tl.load(s_ptr + rows64[:, None] * stride_sr + cols[None, :] * stride_sc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if MODE == 0:
        scale, dequant = _scales_from_amax_bits(tl.load(row_amax_ptr), FMT_MAX, EPS, POW2)
        if (pid_r == 0) & (pid_c == 0):
            if WRITE_ROW:
                tl.store(dq_ptr, dequant)
            if WRITE_COL:
                tl.store(dqt_ptr, dequant)
    if WRITE_ROW:
        if MODE == 0:
            row_scale = tl.zeros((BLOCK_R,), dtype=tl.float32) + scale
        else:
            if MODE == 1:
                row_bits = tl.load(row_amax_ptr + rows, mask=row_ok, other=0)
            else:
                row_bits = tl.max(_abs_bits(x), axis=1)
            row_scale, row_dequant = _scales_from_amax_bits(row_bits, FMT_MAX, EPS, POW2)
            if MODE == 1:
                if pid_c == 0:
                    tl.store(dq_ptr + rows, row_dequant, mask=row_ok)
            else:
                tl.store(dq_ptr + rows64 * stride_dq + pid_c, row_dequant, mask=row_ok)
        q = _saturate(x * row_scale[:, None], FMT_MAX)
        tl.store(q_ptr + rows64[:, None] * C + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    if WRITE_COL:
        # Computed on its own even for one global scale: with one FP8 tile feeding both the
        # row-major and the transposed store, the transposed codes failed the bit-exactness test on
        # an H100 (Triton 3.6); the per-row and per-block modes, computed this way, were exact.
        if MODE == 0:
            col_scale = tl.zeros((BLOCK_C,), dtype=tl.float32) + scale
        else:
            if MODE == 1:
                col_bits = tl.load(col_amax_ptr + cols, mask=col_ok, other=0)
            else:
                col_bits = tl.max(_abs_bits(x), axis=0)
            col_scale, col_dequant = _scales_from_amax_bits(col_bits, FMT_MAX, EPS, POW2)
            if MODE == 1:
                if pid_r == 0:
                    tl.store(dqt_ptr + cols, col_dequant, mask=col_ok)
            else:
                tl.store(dqt_ptr + cols64 * stride_dqt + pid_r, col_dequant, mask=col_ok)
        qt = _saturate(x * col_scale[None, :], FMT_MAX)
        tl.store(qt_ptr + cols64[None, :] * R + rows[:, None], qt.to(qt_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------ launcher


def scale_shape(granularity: "Granularity | str", rows: int, k: int, block_k: int = 128) -> Tuple[int, ...]:
    """Shape of the dequantization scale of a ``(rows, k)`` operand."""
    granularity = Granularity(granularity)
    if granularity == Granularity.TENSORWISE:
        return ()
    if granularity == Granularity.ROWWISE:
        return (rows, 1)
    return (rows, -(-k // block_k))


def _column_tiles(cols: int, block_c: int, x: torch.Tensor) -> int:
    tiles = -(-cols // block_c)
    if tiles > _MAX_GRID_Y:
        raise ValueError(f"fp8_quantize: shape {tuple(x.shape)} has more column tiles than a launch grid allows")
    return tiles


def _quantize_into(
    x: torch.Tensor,
    fmt: Fp8Format,
    granularity: Granularity,
    block_k: int,
    power_of_two: bool,
    q: Optional[torch.Tensor],
    dq: Optional[torch.Tensor],
    qt: Optional[torch.Tensor],
    dqt: Optional[torch.Tensor],
) -> None:
    """Quantize ``x`` (R, C), any strides, into preallocated outputs.

    ``q`` (R, C) and ``dq`` receive the operand ``x``; ``qt`` (C, R) and ``dqt`` the operand ``x^T``;
    either pair may be ``None``. Shapes, dtypes and devices are the caller's responsibility
    (the public functions check them). Tests call this with poisoned outputs.
    """
    require_triton("fp8_quantize")
    # Read along the smaller stride: a transposed view (x = y^T) is quantized as y with roles swapped.
    if x.stride(0) == 1 and x.stride(1) != 1 and x.shape[0] > 1:
        s, q, dq, qt, dqt = x.t(), qt, dqt, q, dq
    else:
        s = x
    rows, cols = s.shape
    write_row, write_col = q is not None, qt is not None
    if not (write_row or write_col) or rows == 0 or cols == 0:
        return
    consts = dict(FMT_MAX=fmt.max, EPS=AMAX_EPS, POW2=bool(power_of_two))
    dummy = s  # stands in for pointers a constexpr branch never touches
    with device_guard(s):
        if granularity == Granularity.ROWWISE and write_row and not write_col and cols <= _ROW_KERNEL_MAX_K:
            block_c = max(16, next_power_of_2(cols))
            block_r = max(1, min(64, 8192 // block_c))
            _quantize_rows_kernel[(triton.cdiv(rows, block_r),)](
                s, q, dq, rows, cols, s.stride(0), s.stride(1),
                BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4 if block_r * block_c <= 4096 else 8, **consts,
            )  # fmt: skip
            return
        if granularity == Granularity.BLOCKWISE:
            # The tile is the block: block_k wide for row blocks, block_k tall for column blocks.
            block_r = block_k if write_col else 32
            block_c = block_k if write_row else 64
            grid = (triton.cdiv(rows, block_r), _column_tiles(cols, block_c, x))
            _quantize_tiles_kernel[grid](
                s, q if write_row else dummy, qt if write_col else dummy,
                dq if write_row else dummy, dqt if write_col else dummy, dummy, dummy,
                rows, cols, s.stride(0), s.stride(1),
                dq.stride(0) if write_row else 0, dqt.stride(0) if write_col else 0,
                MODE=2, WRITE_ROW=write_row, WRITE_COL=write_col, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=8 if block_r * block_c > 4096 else 4, **consts,
            )  # fmt: skip
            return
        tensor = granularity == Granularity.TENSORWISE
        if tensor and write_col:
            # The transposed store of a tensorwise tile wrote wrong (NaN) codes for some shapes on an
            # H100 (Triton 3.6), where the rowwise and blockwise transposed stores are exact. One
            # scale serves both orientations, so the transposed codes are the row-major codes moved:
            # quantize row-major (into a scratch tensor where only the transpose was asked for),
            # then copy the FP8 bytes transposed.
            q_rows = q if write_row else torch.empty((rows, cols), dtype=qt.dtype, device=s.device)
            dq_rows = dq if write_row else torch.empty((), dtype=torch.float32, device=s.device)
            _quantize_into(s, fmt, granularity, block_k, power_of_two, q_rows, dq_rows, None, None)
            qt.copy_(q_rows.t())
            dqt.copy_(dq_rows)
            return
        # One zeroed buffer (one memset) holds the per-row and per-column (or the global) amax bits.
        n_row = 1 if tensor or not write_row else rows
        amax_bits = torch.zeros(n_row + (0 if tensor or not write_col else cols), dtype=torch.int32, device=s.device)
        row_amax, col_amax = amax_bits, amax_bits[n_row:] if (write_col and not tensor) else amax_bits
        grid = (triton.cdiv(rows, _TILE), _column_tiles(cols, _TILE, x))
        _amax_tiles_kernel[grid](
            s, row_amax, col_amax, rows, cols, s.stride(0), s.stride(1),
            TENSOR=tensor, ROW=write_row, COL=write_col, BLOCK_R=_TILE, BLOCK_C=_TILE, num_warps=4,
        )  # fmt: skip
        _quantize_tiles_kernel[grid](
            s, q if write_row else dummy, qt if write_col else dummy,
            dq if write_row else dummy, dqt if write_col else dummy, row_amax, col_amax,
            rows, cols, s.stride(0), s.stride(1), 0, 0,
            MODE=0 if tensor else 1, WRITE_ROW=write_row, WRITE_COL=write_col,
            BLOCK_R=_TILE, BLOCK_C=_TILE, num_warps=4, **consts,
        )  # fmt: skip


def _empty_outputs(x: torch.Tensor, fmt: Fp8Format, granularity: Granularity, block_k: int, transpose: bool):
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=fmt.dtype, device=x.device)
    dq = torch.empty(scale_shape(granularity, rows, k, block_k), dtype=torch.float32, device=x.device)
    if transpose:
        qt = torch.empty((k, rows), dtype=fmt.dtype, device=x.device)
        dqt = torch.empty(scale_shape(granularity, k, rows, block_k), dtype=torch.float32, device=x.device)
    else:  # custom ops return tensors, never None: empty placeholders
        qt = torch.empty((0,), dtype=fmt.dtype, device=x.device)
        dqt = torch.empty((0,), dtype=torch.float32, device=x.device)
    return q, dq, qt, dqt


def _quantize(x: torch.Tensor, fmt: Fp8Format, granularity: Granularity, block_k: int, power_of_two: bool, transpose: bool):
    q, dq, qt, dqt = _empty_outputs(x, fmt, granularity, block_k, transpose)
    _quantize_into(x, fmt, granularity, block_k, power_of_two, q, dq, qt if transpose else None, dqt if transpose else None)
    return q, dq, qt, dqt


@torch.library.custom_op("loka::fp8_quantize", mutates_args=())
def _fp8_quantize_op(
    x: torch.Tensor, fmt: str, granularity: str, block_k: int, power_of_two: bool, transpose: bool
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize(x, Fp8Format(fmt), Granularity(granularity), block_k, power_of_two, transpose)


def _run(x: torch.Tensor, fmt: Fp8Format, granularity: Granularity, block_k: int, power_of_two: bool, transpose: bool):
    """The custom op while torch.compile traces (it sees through nothing else); the launcher otherwise."""
    if tracing():
        return _fp8_quantize_op(x, fmt.value, granularity.value, int(block_k), bool(power_of_two), transpose)
    return _quantize(x, fmt, granularity, int(block_k), bool(power_of_two), transpose)


@_fp8_quantize_op.register_fake
def _(x, fmt, granularity, block_k, power_of_two, transpose):
    return _empty_outputs(x, Fp8Format(fmt), Granularity(granularity), block_k, transpose)


def _check_input(
    x: torch.Tensor, fmt, granularity, block_k: int, name: str
) -> Tuple[torch.Tensor, Fp8Format, Granularity]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: expected a float32, bfloat16 or float16 tensor, got {x.dtype}")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D (rows, K) operand, got shape {tuple(x.shape)}")
    fmt = fp8_format(fmt)
    try:
        granularity = Granularity(granularity)
    except ValueError:
        raise ValueError(
            f"granularity: expected one of {', '.join(g.value for g in Granularity)}, got {granularity!r}"
        ) from None
    if granularity == Granularity.BLOCKWISE and (block_k not in (16, 32, 64, 128)):
        raise ValueError(f"block_k: expected 16, 32, 64 or 128, got {block_k}")
    check_launch_device(x, name)
    return x, fmt, granularity


def _as_fp8_tensor(data, scale, fmt: Fp8Format, granularity: Granularity, block_k: int) -> Fp8Tensor:
    block = (1, block_k) if granularity == Granularity.BLOCKWISE else None
    return Fp8Tensor(data, scale, fmt, granularity, block)


def fp8_quantize(
    x: torch.Tensor,
    fmt: "Fp8Format | str" = Fp8Format.E4M3,
    granularity: "Granularity | str" = Granularity.ROWWISE,
    *,
    block_k: int = 128,
    power_of_two: bool = False,
    name: str = "x",
) -> Fp8Tensor:
    """Quantize a GEMM operand to FP8 in one fused kernel (see the module docstring).

    Args:
        x: ``(rows, K)`` float32/bfloat16/float16 tensor, any strides (a transposed view is read
            along its contiguous dim), on a CUDA device (or the CPU under ``TRITON_INTERPRET=1``).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        granularity: ``"rowwise"``, ``"tensorwise"`` or ``"blockwise"`` (``1 x block_k``).
        block_k: block width along ``K`` for blockwise scaling (16, 32, 64 or 128).
        power_of_two: round scales down to powers of two.
        name: the tensor's name, for error messages.

    Returns:
        An :class:`~loka_torchrec.fp8.Fp8Tensor` equal to
        ``fp8_quantize_reference(x, fmt, granularity, ...)``: row-major ``(rows, K)`` data and
        float32 dequantization scales.

    Example::

        >>> x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> q = fp8_quantize(x, "e4m3", "rowwise")  # doctest: +SKIP
        >>> q.dequant_scale.shape  # doctest: +SKIP
        torch.Size([256, 1])
    """
    x, fmt, granularity = _check_input(x, fmt, granularity, block_k, name)
    if x.numel() == 0:  # nothing to launch; the reference defines the scales of empty groups
        return fp8_quantize_reference(x, fmt, granularity, block_k=block_k, power_of_two=power_of_two)
    q, dq, _, _ = _run(x, fmt, granularity, block_k, power_of_two, False)
    return _as_fp8_tensor(q, dq, fmt, granularity, block_k)


def fp8_quantize_with_transpose(
    x: torch.Tensor,
    fmt: "Fp8Format | str" = Fp8Format.E4M3,
    granularity: "Granularity | str" = Granularity.ROWWISE,
    *,
    block_k: int = 128,
    power_of_two: bool = False,
    name: str = "x",
) -> Tuple[Fp8Tensor, Fp8Tensor]:
    """Quantize ``x`` and ``x^T`` as two GEMM operands from one read of ``x`` (blockwise) or two.

    Args: as :func:`fp8_quantize`.

    Returns:
        ``(xq, xtq)``: ``xq`` as :func:`fp8_quantize` returns it, and ``xtq`` the operand ``x^T``
        of shape ``(K, rows)`` (row-major) with its own scales: one per column of ``x`` (rowwise),
        per ``block_k x 1`` block of ``x`` (blockwise), or the tensor scale (tensorwise).
    """
    x, fmt, granularity = _check_input(x, fmt, granularity, block_k, name)
    if x.numel() == 0:
        return fp8_quantize_with_transpose_reference(x, fmt, granularity, block_k=block_k, power_of_two=power_of_two)
    q, dq, qt, dqt = _run(x, fmt, granularity, block_k, power_of_two, True)
    return _as_fp8_tensor(q, dq, fmt, granularity, block_k), _as_fp8_tensor(qt, dqt, fmt, granularity, block_k)


# ------------------------------------------------------------------------------------ reference


def fp8_quantize_reference(
    x: torch.Tensor,
    fmt: "Fp8Format | str" = Fp8Format.E4M3,
    granularity: "Granularity | str" = Granularity.ROWWISE,
    *,
    block_k: int = 128,
    power_of_two: bool = False,
) -> Fp8Tensor:
    """What :func:`fp8_quantize` computes, in plain torch (:func:`loka_torchrec.fp8.quantize`).

    Example::

        >>> q = fp8_quantize_reference(torch.tensor([[1.0, -2.0], [0.5, 0.25]]), "e4m3", "rowwise")
        >>> q.dequant_scale.shape, q.dequantize()
        (torch.Size([2, 1]), tensor([[ 1.0000, -2.0000],
                [ 0.5000,  0.2500]]))
    """
    granularity = Granularity(granularity)
    block = (1, block_k) if granularity == Granularity.BLOCKWISE else None
    return quantize(x, fmt, granularity, block=block, power_of_two=power_of_two, nonfinite="propagate")


def fp8_quantize_with_transpose_reference(
    x: torch.Tensor,
    fmt: "Fp8Format | str" = Fp8Format.E4M3,
    granularity: "Granularity | str" = Granularity.ROWWISE,
    *,
    block_k: int = 128,
    power_of_two: bool = False,
) -> Tuple[Fp8Tensor, Fp8Tensor]:
    """What :func:`fp8_quantize_with_transpose` computes: the two operands ``x`` and ``x^T``."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    opts = dict(block_k=block_k, power_of_two=power_of_two)
    return fp8_quantize_reference(x, fmt, granularity, **opts), fp8_quantize_reference(x.t(), fmt, granularity, **opts)
