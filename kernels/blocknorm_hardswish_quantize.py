"""Fused BlockNorm + Hard Swish + rowwise FP8 quantization: the producer epilogue of the Mods.

For each row of ``x`` (R, N), in float32 and in one read of ``x``:

1. BlockNorm: a parameter-free RMSNorm over consecutive ``block``-wide groups of features
   (default 256): ``y = x / sqrt(mean_block(x^2) + eps)``. A last group narrower than ``block``
   (when ``block`` does not divide N) is normalized over its own width; when it does divide N
   this is exactly ``rms_norm(x.view(-1, block)).view(R, N)``;
2. Hard Swish: ``h = y * relu6(y + 3) / 6``;
3. rowwise FP8 quantization of ``h`` with the semantics of :mod:`loka_torchrec.kernels.fp8_quantize`
   (amax of the row, ``scale = fp8_max / amax``, saturating round-to-nearest-even cast).

The next GEMM then reads FP8 directly: no bf16 intermediate goes through memory. ``h`` itself can
be written too (``return_hp=True``), in ``x``'s dtype or any other, for the backward pass. The FP8
values are quantized from the float32 ``h``, before it is rounded to that dtype.

``eps`` defaults to :data:`BLOCKNORM_EPS` = 1e-6, added to the mean square of each block (the
RMSNorm convention); it only matters for blocks whose RMS is below about 1e-3.
"""

from typing import Optional, Tuple

import torch

from loka_torchrec.fp8 import AMAX_EPS, Fp8Format, Fp8Tensor, Granularity, quantize

from ._compat import check_launch_device, device_guard, fp8_format, next_power_of_2, require_triton, tl, tracing, triton
from .fp8_quantize import _saturate, _abs_bits, _scales_from_amax_bits

__all__ = [
    "BLOCKNORM_EPS",
    "blocknorm_hardswish_quantize",
    "blocknorm_reference",
    "hardswish_reference",
    "blocknorm_hardswish_reference",
    "blocknorm_hardswish_quantize_reference",
]

BLOCKNORM_EPS = 1e-6
"""Default ``eps`` of BlockNorm, added to the mean square of each feature block."""

_MAX_ROW = 16384  # a whole row lives in registers; wider rows would spill


@triton.jit
def _blocknorm_hardswish_quantize_kernel(
    x_ptr, q_ptr, dq_ptr, h_ptr,
    R, N, stride_xr, stride_xn, eps,
    FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr, WRITE_HP: tl.constexpr,
    NORM_BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :] * stride_xn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    # Per-block mean square: view the row as NUM_BLOCKS x NORM_BLOCK (BLOCK_N = their product).
    sum_sq = tl.sum(tl.reshape(x * x, (BLOCK_R, NUM_BLOCKS, NORM_BLOCK)), axis=2)
    first = tl.arange(0, NUM_BLOCKS) * NORM_BLOCK
    width = tl.minimum(tl.maximum(N - first, 1), NORM_BLOCK).to(tl.float32)  # a partial last block
    mean_sq = tl.math.div_rn(sum_sq, tl.broadcast_to(width[None, :], (BLOCK_R, NUM_BLOCKS)))
    rstd = tl.math.div_rn(tl.zeros_like(mean_sq) + 1.0, tl.math.sqrt_rn(mean_sq + eps))
    rstd = tl.reshape(tl.broadcast_to(rstd[:, :, None], (BLOCK_R, NUM_BLOCKS, NORM_BLOCK)), (BLOCK_R, BLOCK_N))
    y = x * rstd
    relu6 = tl.minimum(tl.maximum(y + 3.0, 0.0), 6.0)
    h = tl.math.div_rn(y * relu6, tl.zeros_like(y) + 6.0)
    h = tl.where(mask, h, 0.0)
    scale, dequant = _scales_from_amax_bits(tl.max(_abs_bits(h), axis=1), FMT_MAX, EPS, POW2)
    q = _saturate(h * scale[:, None], FMT_MAX)
    tl.store(q_ptr + rows64[:, None] * N + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(dq_ptr + rows, dequant, mask=row_ok)
    if WRITE_HP:
        tl.store(h_ptr + rows64[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def _blocknorm_into(
    x: torch.Tensor,
    block: int,
    eps: float,
    fmt: Fp8Format,
    power_of_two: bool,
    q: torch.Tensor,
    dq: torch.Tensor,
    h: Optional[torch.Tensor],
) -> None:
    """Launch into preallocated ``q`` (R, N), ``dq`` (R, 1) and optional ``h`` (R, N), all contiguous."""
    require_triton("blocknorm_hardswish_quantize")
    rows, n = x.shape
    if rows == 0 or n == 0:
        return
    block_n = max(16, next_power_of_2(n))
    norm_block = min(block, block_n)  # a row narrower than one block is one (partial) block
    block_r = max(1, min(32, 4096 // block_n))
    with device_guard(x):
        _blocknorm_hardswish_quantize_kernel[(triton.cdiv(rows, block_r),)](
            x, q, dq, h if h is not None else q,
            rows, n, x.stride(0), x.stride(1), float(eps),
            FMT_MAX=fmt.max, EPS=AMAX_EPS, POW2=bool(power_of_two), WRITE_HP=h is not None,
            NORM_BLOCK=norm_block, NUM_BLOCKS=block_n // norm_block, BLOCK_R=block_r, BLOCK_N=block_n,
            num_warps=4 if block_r * block_n <= 2048 else 8,
            # Every multiply and add rounded on its own, as in torch: no contraction into FMAs, which
            # the compiler may apply differently to the copies of h it keeps for the store and the
            # quantization (the FP8 codes then missed the quantization of the stored h on an H100).
            enable_fp_fusion=False,
        )  # fmt: skip


def _outputs(x: torch.Tensor, fmt: Fp8Format, hp_dtype: Optional[torch.dtype]):
    rows, n = x.shape
    q = torch.empty((rows, n), dtype=fmt.dtype, device=x.device)
    dq = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    h = torch.empty((rows, n) if hp_dtype is not None else (0,), dtype=hp_dtype or x.dtype, device=x.device)
    return q, dq, h


def _blocknorm(x, block, eps, fmt: Fp8Format, power_of_two, return_hp, hp_dtype):
    q, dq, h = _outputs(x, fmt, hp_dtype if return_hp else None)
    _blocknorm_into(x, block, eps, fmt, power_of_two, q, dq, h if return_hp else None)
    return q, dq, h


@torch.library.custom_op("loka::blocknorm_hardswish_quantize", mutates_args=())
def _blocknorm_op(
    x: torch.Tensor, block: int, eps: float, fmt: str, power_of_two: bool, return_hp: bool, hp_dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _blocknorm(x, block, eps, Fp8Format(fmt), power_of_two, return_hp, hp_dtype)


@_blocknorm_op.register_fake
def _(x, block, eps, fmt, power_of_two, return_hp, hp_dtype):
    return _outputs(x, Fp8Format(fmt), hp_dtype if return_hp else None)


def _check(x: torch.Tensor, block: int, eps: float, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected a float32, bfloat16 or float16 tensor, got {got}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D (rows, features) tensor, got shape {tuple(x.shape)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= 16, got {block}")
    if not eps > 0:
        raise ValueError(f"eps: expected a positive value, got {eps}")
    if x.shape[1] > _MAX_ROW:
        raise ValueError(f"{name}: rows of at most {_MAX_ROW} features are supported, got {x.shape[1]}")
    return x


def blocknorm_hardswish_quantize(
    x: torch.Tensor,
    *,
    block: int = 256,
    eps: float = BLOCKNORM_EPS,
    fmt: "Fp8Format | str" = Fp8Format.E4M3,
    power_of_two: bool = False,
    return_hp: bool = False,
    hp_dtype: Optional[torch.dtype] = None,
    name: str = "x",
) -> Tuple[Fp8Tensor, Optional[torch.Tensor]]:
    """``quantize_rowwise(hardswish(blocknorm(x)))`` in one kernel (see the module docstring).

    Args:
        x: ``(R, N)`` float32/bfloat16/float16 activations (e.g. a GEMM output), on a CUDA device
            (or the CPU under ``TRITON_INTERPRET=1``); ``N`` up to 16384.
        block: BlockNorm group width, a power of two (default 256); the same in training and inference.
        eps: added to each block's mean square.
        fmt: FP8 format of the output, ``"e4m3"`` (default) or ``"e5m2"``.
        power_of_two: round the row scales down to powers of two.
        return_hp: also return ``h = hardswish(blocknorm(x))`` in high precision (for backward).
        hp_dtype: dtype of that ``h`` (default ``x.dtype``).
        name: the tensor's name, for error messages.

    Returns:
        ``(hq, h)``: ``hq`` a rowwise :class:`~loka_torchrec.fp8.Fp8Tensor` of shape ``(R, N)``;
        ``h`` the high-precision activation, or ``None`` unless ``return_hp``.

    Example::

        >>> y = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> hq, h = blocknorm_hardswish_quantize(y, return_hp=True)  # doctest: +SKIP
        >>> hq.data.dtype, h.dtype  # doctest: +SKIP
        (torch.float8_e4m3fn, torch.bfloat16)
    """
    x = _check(x, block, eps, name)
    fmt = fp8_format(fmt)
    check_launch_device(x, name)
    hp_dtype = hp_dtype or x.dtype
    if x.numel() == 0:
        return blocknorm_hardswish_quantize_reference(
            x, block=block, eps=eps, fmt=fmt, power_of_two=power_of_two, return_hp=return_hp, hp_dtype=hp_dtype
        )
    if tracing():  # torch.compile sees the custom op; eager mode skips its dispatch
        q, dq, h = _blocknorm_op(x, int(block), float(eps), fmt.value, bool(power_of_two), bool(return_hp), hp_dtype)
    else:
        q, dq, h = _blocknorm(x, int(block), float(eps), fmt, bool(power_of_two), bool(return_hp), hp_dtype)
    return Fp8Tensor(q, dq, fmt, Granularity.ROWWISE), (h if return_hp else None)


# ------------------------------------------------------------------------------------ reference


def blocknorm_reference(x: torch.Tensor, *, block: int = 256, eps: float = BLOCKNORM_EPS) -> torch.Tensor:
    """BlockNorm in float32 (float64 stays float64): ``x / sqrt(mean_block(x^2) + eps)``.

    Example::

        >>> blocknorm_reference(torch.tensor([[3.0, 4.0, 0.0, 2.0]]), block=2, eps=0.0)
        tensor([[0.8485, 1.1314, 0.0000, 1.4142]])
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(work)
    rows, n = x.shape
    pad = (-n) % block
    padded = torch.nn.functional.pad(x, (0, pad)).reshape(rows, -1, block)
    width = torch.full((padded.shape[1],), float(block), dtype=work, device=x.device)
    width[-1] = block - pad  # a partial last block is normalized over its own width
    mean_sq = (padded * padded).sum(dim=2) / width
    rstd = 1.0 / torch.sqrt(mean_sq + eps)
    return (padded * rstd[:, :, None]).reshape(rows, -1)[:, :n]


def hardswish_reference(y: torch.Tensor) -> torch.Tensor:
    """``y * relu6(y + 3) / 6``."""
    return y * torch.clamp(y + 3.0, 0.0, 6.0) / 6.0


def blocknorm_hardswish_reference(x: torch.Tensor, *, block: int = 256, eps: float = BLOCKNORM_EPS) -> torch.Tensor:
    """``hardswish(blocknorm(x))`` in float32 (float64 for float64 input)."""
    return hardswish_reference(blocknorm_reference(x, block=block, eps=eps))


def blocknorm_hardswish_quantize_reference(
    x: torch.Tensor,
    *,
    block: int = 256,
    eps: float = BLOCKNORM_EPS,
    fmt: "Fp8Format | str" = Fp8Format.E4M3,
    power_of_two: bool = False,
    return_hp: bool = False,
    hp_dtype: Optional[torch.dtype] = None,
) -> Tuple[Fp8Tensor, Optional[torch.Tensor]]:
    """What :func:`blocknorm_hardswish_quantize` computes, in plain torch."""
    h = blocknorm_hardswish_reference(x, block=block, eps=eps)
    hq = quantize(h, fmt, Granularity.ROWWISE, power_of_two=power_of_two, nonfinite="propagate")
    return hq, (h.to(hp_dtype or x.dtype) if return_hp else None)
