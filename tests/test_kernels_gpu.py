"""The Triton kernels on a CUDA GPU: exact rounding against the references, poisoned outputs.

Every check draws fresh random inputs (shape, scale, outliers, zero and non-finite rows) and fills
the outputs with NaN codes and NaN scales before the launch, so an element the kernel fails to
write cannot pass. Quantization must match :func:`loka_torchrec.fp8.quantize` (run by torch on the
same GPU) bit for bit; GEMMs must match the float64 product of the same FP8 operands within the
accumulation and output rounding of the kernel.
"""

import math

import pytest
import torch

from loka_torchrec.fp8 import Fp8Format, Fp8Tensor, Granularity
from loka_torchrec.kernels.blocknorm_hardswish_quantize import (
    _blocknorm_into,
    blocknorm_hardswish_quantize,
    blocknorm_hardswish_reference,
)
from loka_torchrec.kernels.fp8_gemm import (
    GemmConfig,
    _gemm_into,
    fp8_gemm_error_bound,
    fp8_gemm_reference,
    fp8_mm,
)
from loka_torchrec.kernels.fp8_quantize import (
    _quantize_into,
    fp8_quantize,
    fp8_quantize_reference,
    fp8_quantize_with_transpose_reference,
    scale_shape,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
_GEN = torch.Generator().manual_seed(20261122)


def _randint(lo, hi):
    return int(torch.randint(lo, hi + 1, (1,), generator=_GEN))


def _fresh(rows, k, dtype, *, layout="contiguous", nonfinite=False):
    """New random operand: per-row log-normal scales, an outlier, a zero row, maybe inf/NaN rows."""
    shape = (k, rows) if layout == "transposed" else (rows, k)
    x = torch.randn(*shape, generator=_GEN) * math.exp(float(torch.randn((), generator=_GEN)) * 2)
    x = x.to(DEVICE)
    if layout == "transposed":
        x = x.t()
    x = x * torch.exp(torch.randn(rows, 1, generator=_GEN)).to(DEVICE)
    x[_randint(0, rows - 1), _randint(0, k - 1)] *= 100.0  # an outlier (still finite in float16)
    if rows > 3:
        x[_randint(0, rows - 1)] = 0.0
    if nonfinite and rows > 3:
        x[_randint(0, rows - 1), _randint(0, k - 1)] = float("inf")
        x[_randint(0, rows - 1), _randint(0, k - 1)] = float("nan")
    return x.to(dtype)


def _poisoned(shape, dtype):
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(dtype)  # NaN in both formats
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_bitwise(got: Fp8Tensor, ref: Fp8Tensor):
    """Same codes (NaN as NaN, whatever its sign bit) and the same scales, bit for bit."""
    assert got.data.shape == ref.data.shape and got.data.dtype == ref.data.dtype and got.data.is_contiguous()
    assert got.dequant_scale.shape == ref.dequant_scale.shape and got.dequant_scale.dtype == torch.float32
    k, r = got.data.float(), ref.data.float()
    assert torch.equal(k.isnan(), r.isnan()), f"{int((k.isnan() != r.isnan()).sum())} NaN codes differ"
    finite = ~r.isnan()
    kb, rb = got.data.view(torch.uint8)[finite], ref.data.view(torch.uint8)[finite]
    assert torch.equal(kb, rb), f"{int((kb != rb).sum())} of {kb.numel()} codes differ"
    ks, rs = got.dequant_scale, ref.dequant_scale
    assert torch.equal(ks.isnan(), rs.isnan())
    assert torch.equal(ks[~ks.isnan()].view(torch.int32), rs[~rs.isnan()].view(torch.int32))


# ---------------------------------------------------------------------------------- quantize

_SHAPES = [(1, 1), (7, 33), (129, 257), (1000, 384), (64, 8192), (33, 9000), (2048, 1024), (300, 4096)]


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise", "blockwise"])
@pytest.mark.parametrize("transpose", [False, True])
def test_quantize_is_bit_exact(granularity, transpose):
    fmt_granularity = Granularity(granularity)
    for trial, (rows, k) in enumerate(_SHAPES):
        fmt = Fp8Format.E4M3 if trial % 3 else Fp8Format.E5M2
        dtype = (torch.bfloat16, torch.float32, torch.float16)[trial % 3]
        layout = "transposed" if trial % 4 == 1 else "contiguous"
        block_k = (128, 64, 32)[trial % 3]
        x = _fresh(rows, k, dtype, layout=layout, nonfinite=trial % 2 == 1)
        q = _poisoned((rows, k), fmt.dtype)
        dq = _poisoned(scale_shape(fmt_granularity, rows, k, block_k), torch.float32)
        qt = _poisoned((k, rows), fmt.dtype) if transpose else None
        dqt = _poisoned(scale_shape(fmt_granularity, k, rows, block_k), torch.float32) if transpose else None
        _quantize_into(x, fmt, fmt_granularity, block_k, False, q, dq, qt, dqt)
        ref, ref_t = fp8_quantize_with_transpose_reference(x, fmt, granularity, block_k=block_k)
        block = (1, block_k) if fmt_granularity == Granularity.BLOCKWISE else None
        assert_bitwise(Fp8Tensor(q, dq, fmt, fmt_granularity, block), ref)
        if transpose:
            assert_bitwise(Fp8Tensor(qt, dqt, fmt, fmt_granularity, block), ref_t)


def test_quantize_public_functions_and_power_of_two():
    for rows, k in [(513, 1000), (4096, 256)]:
        x = _fresh(rows, k, torch.bfloat16)
        for granularity in ("rowwise", "tensorwise", "blockwise"):
            assert_bitwise(fp8_quantize(x, "e4m3", granularity), fp8_quantize_reference(x, "e4m3", granularity))
            got = fp8_quantize(x, "e4m3", granularity, power_of_two=True)
            scale = got.dequant_scale
            assert torch.equal(scale, torch.exp2(torch.round(torch.log2(scale))))
            # Same codes as the reference given the same (power-of-two) scale.
            ref = fp8_quantize_reference(x, "e4m3", granularity, power_of_two=True)
            if torch.equal(ref.dequant_scale, scale):
                assert_bitwise(got, ref)


# ---------------------------------------------------------------------------------- GEMM

_GEMM_SHAPES = [(1, 16, 16), (37, 50, 29), (300, 1000, 200), (2048, 512, 256), (4096, 1024, 1024), (256, 32768, 256)]


def _assert_gemm_exact_up_to_rounding(out, a: Fp8Tensor, b: Fp8Tensor, bias, activation, *, fast_accum=False):
    ref = fp8_gemm_reference(
        a.data, b.data, a.dequant_scale, b.dequant_scale, bias=bias, activation=activation,
        out_dtype=torch.float64, compute_dtype=torch.float64,
    )  # fmt: skip
    abs_sum = a.dequantize(torch.float64).abs() @ b.dequantize(torch.float64).abs().t()
    if bias is not None:
        abs_sum = abs_sum + bias.double().abs()
    out_u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[out.dtype]
    accum = 2.0**-6 if not fast_accum else 2.0**-6 * max(1, a.data.shape[1] // 128)
    bound = out_u * ref.abs() * 1.001 + accum * abs_sum * (1 + out_u) + 1e-30
    err = (out.double() - ref).abs()
    assert not out.isnan().any(), "unwritten (poisoned) output elements"
    assert torch.all(err <= bound), f"max error {err.max().item():.3g}"
    # The statistic, far inside the worst case: output rounding plus the FP8 tensor cores' own
    # accumulation within a promotion interval (about 2**-12 relative on an H100: 3.3e-4 at K = 50).
    rel_fro = float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref).clamp(min=1e-30))
    if not fast_accum:
        assert rel_fro <= 2 * out_u + 2.0**-10, rel_fro


@pytest.mark.parametrize("split_k", [1, 3])
def test_gemm_rowwise_and_tensorwise_operands(split_k):
    for trial, (m, k, n) in enumerate(_GEMM_SHAPES):
        gran_a = ("rowwise", "tensorwise")[trial % 2]
        gran_b = ("rowwise", "tensorwise")[(trial // 2) % 2]
        fmt_a = Fp8Format.E5M2 if trial % 3 == 2 else Fp8Format.E4M3
        a = fp8_quantize_reference(_fresh(m, k, torch.bfloat16), fmt_a, gran_a)
        b = fp8_quantize_reference(_fresh(n, k, torch.bfloat16), "e4m3", gran_b)
        bias = torch.randn(n, device=DEVICE) if trial % 2 else None
        activation = ("none", "relu", "hardswish")[trial % 3]
        out_dtype = (torch.bfloat16, torch.float32)[trial % 2]
        out = _poisoned((m, n), out_dtype)
        # One explicit tile config keeps compilation short; the autotuned path has its own test.
        _gemm_into(a.data, b.data, a.dequant_scale, b.dequant_scale, bias, activation, False, out,
                   split_k=split_k, config=GemmConfig(128, 128, 128, 8, 3))  # fmt: skip
        _assert_gemm_exact_up_to_rounding(out, a, b, bias, activation)


def test_gemm_autotuned_path_with_automatic_split_k():
    for m, k, n in [(2048, 512, 256), (256, 32768, 256)]:  # the second splits K
        a = fp8_quantize_reference(_fresh(m, k, torch.bfloat16), "e4m3", "rowwise")
        b = fp8_quantize_reference(_fresh(n, k, torch.bfloat16), "e4m3", "rowwise")
        out = _poisoned((m, n), torch.bfloat16)
        _gemm_into(a.data, b.data, a.dequant_scale, b.dequant_scale, None, "none", False, out)
        _assert_gemm_exact_up_to_rounding(out, a, b, None, "none")


def test_gemm_every_tile_config_and_strided_operands():
    """Each autotune config alone, on shapes that are not multiples of any tile, B read transposed."""
    from loka_torchrec.kernels.fp8_gemm import _CONFIGS

    m, k, n = 333, 1000, 201
    a = fp8_quantize_reference(_fresh(m, k, torch.bfloat16), "e4m3", "rowwise")
    b = fp8_quantize_reference(_fresh(n, k, torch.bfloat16), "e4m3", "tensorwise")
    b_col_major = b.data.t().contiguous().t()
    for config in _CONFIGS:
        out = _poisoned((m, n), torch.bfloat16)
        _gemm_into(a.data, b_col_major, a.dequant_scale, b.dequant_scale, None, "none", False, out, config=config)
        _assert_gemm_exact_up_to_rounding(out, a, b, None, "none")


def test_gemm_fast_accum_and_public_entry_point():
    x, w = _fresh(1024, 2048, torch.bfloat16), _fresh(512, 2048, torch.bfloat16)
    xq, wq = fp8_quantize(x, "e4m3", "rowwise"), fp8_quantize(w, "e4m3", "rowwise")
    out = fp8_mm(xq, wq, fast_accum=True)
    _assert_gemm_exact_up_to_rounding(out, xq, wq, None, "none", fast_accum=True)


def test_fused_quantize_and_gemm_against_float64():
    """End to end from bf16 inputs: within the FP8 formats' bound of the exact product, all roles."""
    rows, d_in, d_out = 4096, 768, 512
    x, w, dy = _fresh(rows, d_in, torch.bfloat16), _fresh(d_out, d_in, torch.bfloat16), _fresh(rows, d_out, torch.bfloat16)
    for a_hp, b_hp in ((x, w), (dy, w.t()), (dy.t(), x.t())):
        aq, bq = fp8_quantize(a_hp, "e4m3", "rowwise"), fp8_quantize(b_hp, "e4m3", "rowwise")
        out = fp8_mm(aq, bq, out_dtype=torch.float32)
        bound = fp8_gemm_error_bound(a_hp, b_hp, out_dtype=torch.float32)
        exact = a_hp.double() @ b_hp.double().t()
        assert torch.all((out.double() - exact).abs() <= bound)


# ---------------------------------------------------------------------------------- BlockNorm


def _assert_codes_at_most_float32_ties_apart(got: Fp8Tensor, ref: Fp8Tensor, h: torch.Tensor):
    """``got`` quantizes ``h`` as ``ref`` does, up to float32 rounding of ``h`` itself.

    Scales agree to a few float32 ulps; a code may differ from the reference only by one FP8 step,
    and only where the exactly scaled value sits within float32 rounding of the midpoint between
    the two codes (so that an ulp of ``h`` decides the rounding); at most 0.1% of codes do.
    """
    assert got.data.shape == ref.data.shape and got.dequant_scale.shape == ref.dequant_scale.shape
    assert torch.allclose(got.dequant_scale, ref.dequant_scale, rtol=2.0**-20, atol=0)
    k, r = got.data.double(), ref.data.double()
    scale = (1.0 / ref.dequant_scale.double()).expand_as(r)
    scaled = (h.double() * scale).clamp(-ref.fmt.max, ref.fmt.max)
    differ = k != r
    midpoint = (k + r) / 2
    near_tie = (scaled - midpoint).abs() <= 2.0**-20 * scaled.abs()
    larger = torch.maximum(k.abs(), r.abs()).clamp(min=ref.fmt.smallest_subnormal)
    step = torch.exp2(torch.floor(torch.log2(larger)) - ref.fmt.mantissa_bits).clamp(min=ref.fmt.smallest_subnormal)
    one_step = (k - r).abs() <= step
    bad = differ & ~(near_tie & one_step)
    assert not bad.any(), f"{int(bad.sum())} codes differ beyond float32 rounding, e.g. {k[bad][:4].tolist()} vs {r[bad][:4].tolist()}"
    assert differ.double().mean() <= 1e-3


BLOCKNORM_SHAPES = [(1, 16, 256), (77, 300, 256), (4096, 1024, 256), (513, 2048, 128), (64, 8192, 256)]


def test_blocknorm_hardswish_quantize_against_reference():
    for rows, n, block in BLOCKNORM_SHAPES:
        x = _fresh(rows, n, torch.bfloat16)
        fmt = Fp8Format.E4M3
        q, dq = _poisoned((rows, n), fmt.dtype), _poisoned((rows, 1), torch.float32)
        h = _poisoned((rows, n), torch.float32)
        _blocknorm_into(x, block, 1e-6, fmt, False, q, dq, h)
        h_ref = blocknorm_hardswish_reference(x, block=block)
        # Sums of squares are ordered differently from torch's: float32 rounding only.
        assert torch.allclose(h, h_ref, rtol=2e-6 * math.sqrt(block), atol=1e-6)
        assert not q.float().isnan().any() and not dq.isnan().any()
        ref = fp8_quantize_reference(h, fmt, "rowwise")
        _assert_codes_at_most_float32_ties_apart(Fp8Tensor(q, dq, fmt, Granularity.ROWWISE), ref, h)
        hq, hp = blocknorm_hardswish_quantize(x, block=block, return_hp=True)
        assert hp.dtype == torch.bfloat16 and torch.allclose(hp.float(), h, rtol=2.0**-8, atol=0)
        _assert_codes_at_most_float32_ties_apart(hq, ref, h)


# ---------------------------------------------------------------------------------- compile


def test_kernels_under_torch_compile_match_eager():
    def layer(x, w, bias):
        xq = fp8_quantize(x, "e4m3", "rowwise")
        wq = fp8_quantize(w, "e4m3", "rowwise")
        return fp8_mm(xq, wq, bias=bias, activation="relu")

    x, w, bias = _fresh(512, 256, torch.bfloat16), _fresh(128, 256, torch.bfloat16), torch.randn(128, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x, w, bias), layer(x, w, bias))
