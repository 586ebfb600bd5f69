"""FP8 GEMM ``C = A (M, K) @ B (N, K)^T`` with the dequantization scales applied in the epilogue.

Both operands are FP8 (E4M3 or E5M2, mixed allowed) with float32 *dequantization* scales, one per
row of each operand (rowwise) or one per operand (tensorwise), so that
``C[m, n] = a_scale[m] * b_scale[n] * sum_k A[m, k] * B[n, k]``, then ``+ bias[n]`` and an
activation, all in float32 before the single rounding to the output dtype.

* Accumulation is float32. Without ``fast_accum`` the tensor-core partial sums are promoted to the
  float32 accumulator after every ``BLOCK_K`` products (Hopper's FP8 MMA otherwise accumulates in
  reduced precision over the whole K loop); with ``fast_accum`` they are not.
* Any shape: loads are masked along K, rows and columns past M and N re-read valid ones and are
  masked on store, so nothing needs to be a multiple of the block sizes.
* Any strides: a transposed view (e.g. ``Fp8Tensor.t()`` of a tensorwise operand) is read in place.
* Tile sizes are autotuned per ``(M bucket, N, K)`` (and flags, dtypes, layouts) over configs
  chosen for LRM shapes (K, N in 256..4096, M in 2k..64k): the first call of a shape times each
  candidate on the real operands and keeps the fastest; GEMMs under 4 GFLOP, whose time is launch
  overhead, take the largest tile that still fills the GPU.
* When the output has too few tiles to fill the GPU and K is long (the grad-weight GEMM of small
  layers, K = batch rows) the K loop is split over several programs whose float32 partials are
  summed, deterministically, by a second small kernel.

:func:`fp8_gemm_reference` is the same computation in plain torch (float32), and
:func:`fp8_mm` the entry point for two :class:`~loka_torchrec.fp8.Fp8Tensor` operands.
"""

import functools
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from loka_torchrec.fp8 import Fp8Format, Fp8Tensor, Granularity

from ._compat import (
    INTERPRET,
    check_launch_device,
    device_guard,
    next_power_of_2,
    require_triton,
    tl,
    tracing,
    triton,
)

__all__ = [
    "ACTIVATIONS",
    "GemmConfig",
    "fp8_gemm",
    "fp8_mm",
    "fp8_gemm_reference",
    "fp8_gemm_error_bound",
    "split_k_for",
    "candidate_configs",
    "heuristic_config",
]

ACTIVATIONS = ("none", "relu", "hardswish")
"""Epilogue activations: identity, ``max(x, 0)`` and ``x * relu6(x + 3) / 6``."""

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_SPLIT_K = 8
_SPLIT_K_WORKSPACE_ELEMENTS = 1 << 24  # 64 MiB of float32 partials at most


class GemmConfig(NamedTuple):
    """A tile configuration of the GEMM kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    @property
    def accumulator_registers(self) -> int:
        """float32 accumulator registers per thread."""
        return self.block_m * self.block_n // (32 * self.num_warps)


# Tiles for FP8 on Hopper-class GPUs: K tiles of 128 (four 32-deep FP8 MMAs per promotion), wide
# tiles for the large GEMMs, 64-wide ones so that LRM shapes (N = 256..1024) still fill 132 SMs,
# 64-deep ones for short K.
_CONFIGS = [
    GemmConfig(128, 256, 128, 8, 3),
    GemmConfig(256, 128, 128, 8, 3),
    GemmConfig(128, 128, 128, 8, 4),
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 128, 128, 4, 4),
    GemmConfig(128, 64, 128, 4, 4),
    GemmConfig(64, 128, 128, 4, 4),
    GemmConfig(64, 64, 128, 4, 4),
    GemmConfig(128, 128, 64, 8, 5),
    GemmConfig(64, 64, 64, 4, 4),
]
_MAX_PRECISE_ACCUMULATOR_REGISTERS = 64
_TUNE_MIN_FLOPS = 4e9  # below this a GEMM takes microseconds: launch overhead decides, not the tile
_TUNED: Dict[Tuple, GemmConfig] = {}


def candidate_configs(m: int, n: int, k: int, *, fast_accum: bool) -> List[GemmConfig]:
    """The tile configs worth trying for an ``(M, N, K)`` GEMM.

    Tiles much larger than the problem only add masked work. Without ``fast_accum`` the promotion
    keeps a second accumulator as large as the first, so tiles whose accumulator already takes
    more than 64 registers per thread would spill.
    """
    keep = [
        c
        for c in _CONFIGS
        if c.block_m <= max(64, next_power_of_2(m))
        and c.block_n <= max(64, next_power_of_2(n))
        and c.block_k <= max(64, next_power_of_2(k))
        and (fast_accum or c.accumulator_registers <= _MAX_PRECISE_ACCUMULATOR_REGISTERS)
    ]
    return keep or [GemmConfig(64, 64, 64, 4, 4)]


def heuristic_config(m: int, n: int, split_k: int, num_sms: int, configs: List[GemmConfig]) -> GemmConfig:
    """The largest tile that still gives every SM a program (the smallest tile where none does)."""
    by_area = sorted(configs, key=lambda c: -c.block_m * c.block_n)
    for c in by_area:
        if -(-m // c.block_m) * -(-n // c.block_n) * split_k >= num_sms:
            return c
    return by_area[-1]


# ------------------------------------------------------------------------------------ kernels


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == 2:
        relu6 = tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0)
        x = tl.math.div_rn(x * relu6, tl.zeros_like(x) + 6.0)
    return x


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, ws_ptr,
    M, N, K, m_key,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_as, stride_bs,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, FAST_ACCUM: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped ordering: GROUP_M row tiles share the same B column tiles while they are in L2.
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * grid_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_size
    pid_n = (pid % tiles_per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows/columns past the edge re-read valid ones (modulo); the store masks them out.
    load_m = (offs_m % M).to(tl.int64)
    load_n = (offs_n % N).to(tl.int64)

    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * tiles_per_split
    kt_end = tl.minimum(kt_start + tiles_per_split, k_tiles)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + load_m[:, None] * stride_am + (kt_start * BLOCK_K + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (kt_start * BLOCK_K + offs_k)[:, None] * stride_bk + load_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if FAST_ACCUM:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    m_ok = offs_m < M
    n_ok = offs_n < N
    a_scale = tl.load(a_scale_ptr + offs_m * stride_as, mask=m_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n * stride_bs, mask=n_ok, other=0.0)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc = _activation(acc, ACTIVATION)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        ws_ptrs = ws_ptr + (pid_k * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptrs, acc, mask=mask)


@triton.jit
def _split_k_epilogue_kernel(
    ws_ptr, c_ptr, bias_ptr, M, N, stride_cm, stride_cn,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Sum the SPLIT_K float32 partials in a fixed order, add bias, activate, round once."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    mask = (offs_m < M)[:, None] & n_ok[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(ws_ptr + (s * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = _activation(acc, ACTIVATION)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------ launcher


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k_for(m: int, n: int, k: int, num_sms: int) -> int:
    """How many programs share the K loop: 1 unless the output tiles leave most SMs idle and K is long."""
    tiles = -(-m // 128) * -(-n // 128)
    if k < 4096 or tiles * 2 > num_sms:
        return 1
    split = min(_MAX_SPLIT_K, num_sms // tiles, k // 2048, _SPLIT_K_WORKSPACE_ELEMENTS // max(1, m * n))
    return max(1, split)


def _scale_vector(scale: torch.Tensor, rows: int, name: str) -> Tuple[torch.Tensor, int]:
    """A dequantization scale as a 1-D view and its stride (0 broadcasts one tensorwise scale)."""
    flat = scale.reshape(-1)
    if flat.numel() == 1:
        return flat, 0
    if flat.numel() != rows:
        raise ValueError(f"{name}: expected 1 (tensorwise) or {rows} (rowwise) scales, got shape {tuple(scale.shape)}")
    return flat, flat.stride(0)


def _gemm_into(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    fast_accum: bool,
    out: torch.Tensor,
    *,
    split_k: Optional[int] = None,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """Launch the GEMM into a preallocated ``out`` (M, N). Inputs are checked by the caller."""
    require_triton("fp8_gemm")
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return out
    a_scale, stride_as = _scale_vector(a_scale, m, "a_scale")
    b_scale, stride_bs = _scale_vector(b_scale, n, "b_scale")
    if k == 0:  # an empty sum: the epilogue of zeros
        acc = torch.zeros((m, n), dtype=torch.float32, device=out.device)
        out.copy_(_epilogue_reference(acc, bias, activation))
        return out
    num_sms = 1 if (INTERPRET or not a.is_cuda) else _num_sms(a.device.index or 0)
    if split_k is None:
        split_k = 1 if num_sms == 1 else split_k_for(m, n, k, num_sms)
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=a.device) if split_k > 1 else out
    act = ACTIVATIONS.index(activation)
    args = (
        a, b, out, a_scale, b_scale, bias if bias is not None else a_scale, ws,
        m, n, k, next_power_of_2(m) if m < 65536 else 65536,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), stride_as, stride_bs,
    )  # fmt: skip
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=act, FAST_ACCUM=bool(fast_accum), SPLIT_K=split_k, GROUP_M=8)

    def launch(c: GemmConfig) -> None:
        grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), split_k)
        _fp8_gemm_kernel[grid](
            *args, EVEN_K=k % c.block_k == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            num_warps=c.num_warps, num_stages=c.num_stages, **flags,
        )  # fmt: skip

    with device_guard(a):
        if config is None:
            if INTERPRET:
                config = GemmConfig(32, 32, 32, 4, 1)  # the interpreter cannot time configs; small tiles are quick there
            else:
                key = (a.device.index, args[10], n, k, split_k, bias is not None, act, bool(fast_accum),
                       a.dtype, b.dtype, out.dtype, a.stride(1) == 1, b.stride(1) == 1)  # fmt: skip
                config = _TUNED.get(key)
                if config is None:
                    config = _tune(launch, m, n, k, split_k, num_sms, bool(fast_accum))
                    _TUNED[key] = config
        launch(config)
        if split_k > 1:
            grid2 = (triton.cdiv(m, 64), triton.cdiv(n, 64))
            _split_k_epilogue_kernel[grid2](
                ws, out, bias if bias is not None else a_scale, m, n, out.stride(0), out.stride(1),
                SPLIT_K=split_k, HAS_BIAS=bias is not None, ACTIVATION=act, BLOCK_M=64, BLOCK_N=64, num_warps=4,
            )  # fmt: skip
    return out


def _tune(launch, m: int, n: int, k: int, split_k: int, num_sms: int, fast_accum: bool) -> GemmConfig:
    """Time each candidate tile on the real operands (once per shape key) and keep the fastest.

    Small GEMMs are not timed: their run time is launch overhead whatever the tile, so the tile
    that fills the GPU is taken.
    """
    configs = candidate_configs(m, n, k, fast_accum=fast_accum)
    fallback = heuristic_config(m, n, split_k, num_sms, configs)
    if len(configs) == 1 or 2.0 * m * n * k < _TUNE_MIN_FLOPS:
        return fallback
    from triton.testing import do_bench

    best, best_ms = fallback, float("inf")
    for c in configs:
        try:
            ms = do_bench(lambda: launch(c), warmup=2, rep=10)
        except Exception:  # a tile that does not compile here (shared memory, registers) is skipped
            continue
        if ms < best_ms:
            best, best_ms = c, ms
    return best


@torch.library.custom_op("loka::fp8_gemm", mutates_args=())
def _fp8_gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    return _gemm(a, b, a_scale, b_scale, bias, activation, out_dtype, fast_accum)


def _gemm(a, b, a_scale, b_scale, bias, activation, out_dtype, fast_accum) -> torch.Tensor:
    out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    return _gemm_into(a, b, a_scale, b_scale, bias, activation, fast_accum, out)


@_fp8_gemm_op.register_fake
def _(a, b, a_scale, b_scale, bias, activation, out_dtype, fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _check_gemm_inputs(a, b, a_scale, b_scale, bias, activation, out_dtype) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _FP8_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: expected a float8_e4m3fn or float8_e5m2 tensor, got {got}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D operand, got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b: expected shape (N, K) with K={a.shape[1]} to match a {tuple(a.shape)}, got {tuple(b.shape)}")
    for name, s, rows in (("a_scale", a_scale, a.shape[0]), ("b_scale", b_scale, b.shape[0])):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise TypeError(f"{name}: expected a float32 tensor of dequantization scales")
        if s.numel() not in (1, rows):
            raise ValueError(f"{name}: expected 1 (tensorwise) or {rows} (rowwise) scales, got shape {tuple(s.shape)}")
        if s.device != a.device:
            raise ValueError(f"{name}: expected a tensor on {a.device}, got {s.device}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[0] or not bias.is_floating_point()):
        raise ValueError(f"bias: expected a float tensor of shape ({b.shape[0]},), got {tuple(bias.shape)} {bias.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    if b.device != a.device:
        raise ValueError(f"b: expected a tensor on {a.device}, got {b.device}")
    check_launch_device(a, "a")


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    activation: str = "none",
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``C = act((A @ B^T) * a_scale * b_scale^T + bias)`` on FP8 operands, in one kernel.

    Args:
        a: ``(M, K)`` float8_e4m3fn or float8_e5m2, any strides.
        b: ``(N, K)`` FP8, any strides (``B``, not ``B^T``).
        a_scale: float32 dequantization scale(s) of ``a``: 1 value or ``M`` (shape ``(M, 1)`` or ``(M,)``).
        b_scale: float32 dequantization scale(s) of ``b``: 1 value or ``N``.
        bias: optional ``(N,)`` float tensor added before the activation.
        activation: ``"none"``, ``"relu"`` or ``"hardswish"``.
        out_dtype: bfloat16 (default), float16 or float32.
        fast_accum: skip the periodic promotion of FP8 partial sums (faster, less accurate).

    Returns:
        ``(M, N)`` tensor in ``out_dtype``.

    Example::

        >>> a = fp8_quantize(torch.randn(4096, 1024, device="cuda"))  # doctest: +SKIP
        >>> w = fp8_quantize(torch.randn(512, 1024, device="cuda"))  # doctest: +SKIP
        >>> fp8_gemm(a.data, w.data, a.dequant_scale, w.dequant_scale).shape  # doctest: +SKIP
        torch.Size([4096, 512])
    """
    _check_gemm_inputs(a, b, a_scale, b_scale, bias, activation, out_dtype)
    if tracing():  # torch.compile sees the custom op; eager mode skips its dispatch
        return _fp8_gemm_op(a, b, a_scale, b_scale, bias, activation, out_dtype, bool(fast_accum))
    return _gemm(a, b, a_scale, b_scale, bias, activation, out_dtype, bool(fast_accum))


def fp8_mm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    activation: str = "none",
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> torch.Tensor:
    """:func:`fp8_gemm` of two tensorwise- or rowwise-scaled :class:`~loka_torchrec.fp8.Fp8Tensor` operands."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Fp8Tensor):
            raise TypeError(f"{name}: expected an Fp8Tensor, got {type(t).__name__}")
        if t.granularity not in (Granularity.TENSORWISE, Granularity.ROWWISE):
            raise ValueError(f"{name}: fp8_mm takes tensorwise or rowwise operands, got {t.granularity.value}")
    return fp8_gemm(
        a.data, b.data, a.dequant_scale, b.dequant_scale,
        bias=bias, activation=activation, out_dtype=out_dtype, fast_accum=fast_accum,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ reference


def _epilogue_reference(acc: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    if activation == "relu":
        acc = torch.clamp_min(acc, 0.0)
    elif activation == "hardswish":
        acc = acc * torch.clamp(acc + 3.0, 0.0, 6.0) / 6.0
    return acc


def fp8_gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    activation: str = "none",
    out_dtype: torch.dtype = torch.bfloat16,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What :func:`fp8_gemm` computes, in plain torch: exact FP8 products summed in ``compute_dtype``.

    Args:
        a, b, a_scale, b_scale, bias, activation, out_dtype: as for :func:`fp8_gemm`.
        compute_dtype: dtype of the sums and the epilogue (float32 as the kernel; float64 for an
            exact reference of the same FP8 operands).

    Example::

        >>> a = torch.tensor([[1.0, 2.0]]).to(torch.float8_e4m3fn)
        >>> b = torch.tensor([[3.0, 4.0], [1.0, 0.5]]).to(torch.float8_e4m3fn)
        >>> fp8_gemm_reference(a, b, torch.tensor(0.5), torch.tensor([1.0, 2.0]), out_dtype=torch.float32)
        tensor([[5.5000, 2.0000]])
    """
    acc = a.to(compute_dtype) @ b.to(compute_dtype).t()
    a_scale = a_scale.reshape(-1, 1).to(compute_dtype)
    b_scale = b_scale.reshape(1, -1).to(compute_dtype)
    return _epilogue_reference(acc * a_scale * b_scale, bias, activation).to(out_dtype)


def _dequant_step(x: torch.Tensor, fmt: Fp8Format, granularity: Granularity, block, power_of_two: bool) -> torch.Tensor:
    """Largest dequantization scale ``amax_group / fp8_max`` (x2 for power-of-two scales) per element."""
    mag = x.abs()
    if granularity == Granularity.TENSORWISE:
        amax = mag.amax().expand_as(mag) if mag.numel() else mag
    elif granularity == Granularity.ROWWISE:
        amax = mag.amax(dim=1, keepdim=True).expand_as(mag)
    else:
        br, bk = block or (1, 128)
        rows, k = mag.shape
        tiles = torch.nn.functional.pad(mag, (0, (-k) % bk, 0, (-rows) % br))
        tiles = tiles.reshape(tiles.shape[0] // br, br, tiles.shape[1] // bk, bk).amax(dim=(1, 3))
        amax = tiles.repeat_interleave(br, 0).repeat_interleave(bk, 1)[:rows, :k]
    return amax / fmt.max * (2.0 if power_of_two else 1.0)


def fp8_gemm_error_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    fmt_a: "Optional[Fp8Format | str]" = Fp8Format.E4M3,
    fmt_b: "Optional[Fp8Format | str]" = Fp8Format.E4M3,
    granularity_a: "Granularity | str" = Granularity.ROWWISE,
    granularity_b: "Granularity | str" = Granularity.ROWWISE,
    block_a: Optional[Tuple[int, int]] = None,
    block_b: Optional[Tuple[int, int]] = None,
    power_of_two: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    accum_eps: float = 2.0**-6,
) -> torch.Tensor:
    """Elementwise worst-case ``|C - A @ B^T|`` of an FP8 GEMM of high-precision ``a``, ``b``, from the formats.

    Each operand element is rounded to nearest in its format after scaling, so its error is at
    most ``u |x| + s/2 * d`` (``u`` the unit roundoff, ``s`` the smallest subnormal, ``d`` the
    dequantization scale of its group, at most ``amax_group / fp8_max``, twice that for power-of-two
    scales). Products of exact FP8 values are exact; the accumulation adds at most
    ``accum_eps * sum_k |a_k b_k|`` (default ``2**-6``: Hopper's FP8 tensor cores keep at least 13
    bits between promotions to float32 every <= 128 products, and fp32 accumulation is far
    tighter); the final rounding to ``out_dtype`` adds its unit roundoff times the result. A
    ``None`` format means the operand enters unrounded (a high-precision GEMM).

    Args:
        a: ``(M, K)`` high-precision operand, ``b``: ``(N, K)``.
        fmt_a, fmt_b: FP8 formats (``None`` = not quantized).
        granularity_a, granularity_b, block_a, block_b: their scaling groups.
        power_of_two: scales rounded down to powers of two.
        out_dtype: dtype of the GEMM output.
        accum_eps: relative accumulation error allowance.

    Returns:
        ``(M, N)`` float64 bound.

    Example::

        >>> a, b = torch.ones(2, 4), torch.ones(3, 4)
        >>> fp8_gemm_error_bound(a, b, out_dtype=torch.float32).shape
        torch.Size([2, 3])
    """
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    errors = []
    for x, fmt, granularity, block in ((a64, fmt_a, granularity_a, block_a), (b64, fmt_b, granularity_b, block_b)):
        if fmt is None:
            errors.append(torch.zeros_like(x))
            continue
        fmt = Fp8Format.parse(fmt)
        step = _dequant_step(x, fmt, Granularity(granularity), block, power_of_two)
        errors.append(fmt.unit_roundoff * x.abs() + 0.5 * fmt.smallest_subnormal * step)
    e_a, e_b = errors
    abs_prod = a64.abs() @ b64.abs().t()
    bound = e_a @ b64.abs().t() + a64.abs() @ e_b.t() + e_a @ e_b.t() + accum_eps * abs_prod
    out_u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}.get(out_dtype, 0.0)
    return bound + out_u * ((a64 @ b64.t()).abs() + bound)
