"""FP8 numerics core: formats, amax -> scale, saturating casts, granularities, error metrics, CPU backends.

Every numeric check compares against a float64 reference with a bound derived from the format:

* ``u = 2**-(mantissa_bits + 1)`` is the unit roundoff of round-to-nearest in the normal range
  (2**-4 for E4M3, 2**-3 for E5M2);
* below the smallest normal the grid spacing is the smallest subnormal, so rounding is off by at
  most half of it (an *absolute* error in the scaled domain).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loka_torchrec.gemm.backends import backend_names, get_backend
from loka_torchrec.gemm.measure import role_operands
from loka_torchrec.gemm.recipes import FP8_RECIPE_NAMES, recipe_for
from loka_torchrec.evidence import GemmRole, GemmShape
from loka_torchrec.fp8 import (
    AMAX_EPS,
    Fp8Format,
    Fp8Tensor,
    Granularity,
    NonFiniteError,
    amax_to_scale,
    dequantize,
    mere,
    quantize,
    relative_frobenius,
    saturated_cast,
    sqnr_db,
)
from loka_torchrec.fp8 import scaling

EPS32 = 2.0**-24  # unit roundoff of float32 (the scales and the dequantization run in float32)
FORMATS = list(Fp8Format)
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize(
    "fmt, dtype, fp8_max, mantissa_bits",
    [
        (Fp8Format.E4M3, torch.float8_e4m3fn, 448.0, 3),
        (Fp8Format.E5M2, torch.float8_e5m2, 57344.0, 2),
        (Fp8Format.E4M3FNUZ, torch.float8_e4m3fnuz, 240.0, 3),
        (Fp8Format.E5M2FNUZ, torch.float8_e5m2fnuz, 57344.0, 2),
    ],
)
def test_format_dtype_max_and_roundoff(fmt, dtype, fp8_max, mantissa_bits):
    assert fmt.dtype == dtype
    assert fmt.max == fp8_max
    assert fmt.mantissa_bits == mantissa_bits
    assert fmt.unit_roundoff == 2.0 ** -(mantissa_bits + 1)
    # fp8_max and the smallest subnormal are representable and survive a round trip.
    edges = torch.tensor([fmt.max, -fmt.max, fmt.smallest_normal, fmt.smallest_subnormal])
    assert torch.equal(edges.to(dtype).float(), edges)
    # Half the smallest subnormal is a tie between 0 and the subnormal: ties-to-even gives 0.
    assert float(torch.tensor(fmt.smallest_subnormal / 2).to(dtype).float()) == 0.0


def test_format_smallest_normal_and_subnormal_match_the_ocp_table():
    expected = {"e4m3": (2**-6, 2**-9), "e5m2": (2**-14, 2**-16), "e4m3fnuz": (2**-7, 2**-10), "e5m2fnuz": (2**-15, 2**-17)}
    for name, (normal, subnormal) in expected.items():
        fmt = Fp8Format(name)
        assert (fmt.smallest_normal, fmt.smallest_subnormal) == (normal, subnormal)


def test_format_parse_accepts_names_and_instances():
    assert Fp8Format.parse("e5m2") is Fp8Format.E5M2
    assert Fp8Format.parse("E4M3FNUZ") is Fp8Format.E4M3FNUZ
    assert Fp8Format.parse(Fp8Format.E4M3) is Fp8Format.E4M3


@pytest.mark.parametrize("bad", ["e3m4", "fp8", "", None])
def test_format_parse_error_names_the_field_and_choices(bad):
    with pytest.raises(ValueError, match=r"^dispatch\.grad_format: unknown FP8 format") as info:
        Fp8Format.parse(bad, field="dispatch.grad_format")
    for fmt in Fp8Format:
        assert fmt.value in str(info.value)
    with pytest.raises(ValueError, match=r"^format:"):
        Fp8Format.parse(bad)


# ----------------------------------------------------------------------------------- amax_to_scale
@pytest.mark.parametrize("fmt", FORMATS)
def test_amax_to_scale_is_fp8_max_over_amax(fmt):
    amax = torch.tensor([1.0, 3.0, 0.125, 1e-3, 7e4])
    scale = amax_to_scale(amax, fmt)
    assert scale.dtype == torch.float32
    expected = fmt.max / amax.double()
    # torch computes `scalar / tensor` as `reciprocal(tensor) * scalar`: two float32 roundings.
    torch.testing.assert_close(scale.double(), expected, rtol=2 * EPS32, atol=0)
    # float64 amax keeps float64 precision.
    scale64 = amax_to_scale(amax.double(), fmt)
    assert scale64.dtype == torch.float64
    torch.testing.assert_close(scale64, expected, rtol=2.0**-52, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_amax_to_scale_clamps_zero_amax_to_a_finite_scale(fmt):
    scale = amax_to_scale(torch.tensor([0.0, 1e-30, AMAX_EPS]), fmt)
    assert torch.isfinite(scale).all()
    torch.testing.assert_close(scale.double(), torch.full((3,), fmt.max / AMAX_EPS, dtype=torch.float64), rtol=2 * EPS32, atol=0)


@given(
    log2_amax=st.floats(-30.0, 30.0, allow_nan=False),
    fmt=st.sampled_from(FORMATS),
    margin_bits=st.integers(0, 4),
)
@PROPERTY
def test_amax_to_scale_power_of_two_rounds_down(log2_amax, fmt, margin_bits):
    amax = torch.tensor([2.0**log2_amax], dtype=torch.float32)
    exact = amax_to_scale(amax, fmt, margin_bits=margin_bits)
    p2 = amax_to_scale(amax, fmt, power_of_two=True, margin_bits=margin_bits)
    mantissa, _ = torch.frexp(p2)
    assert float(mantissa) == 0.5, "power_of_two scale is not a power of two"
    # Rounded down, by less than a factor of two: (product of two float32 values is exact in float64)
    assert float(p2) <= float(exact) < 2 * float(p2)
    assert float(amax.double() * p2.double()) <= fmt.max / 2.0**margin_bits


@pytest.mark.parametrize("fmt", FORMATS)
def test_amax_to_scale_power_of_two_never_exceeds_fp8_max_just_above_a_power_of_two(fmt):
    # amax one float32 ulp above fp8_max / 2**k makes fp8_max / amax one ulp *below* 2**k; its
    # float32 log2 rounds up to the integer k, and exp2(floor(.)) then gives 2**k: a scale rounded
    # UP, with amax * scale > fp8_max (the cast saturates, so the damage is small, but the
    # documented guarantee "never pushes the group's maximum past fp8_max" is broken).
    base = torch.tensor([fmt.max / 2.0**k for k in range(-8, 9)], dtype=torch.float32)
    amax = torch.nextafter(base, torch.tensor(math.inf))
    scale = amax_to_scale(amax, fmt, power_of_two=True)
    products = amax.double() * scale.double()
    assert (products <= fmt.max).all(), f"amax * scale = {products.max().item()!r} > fp8_max = {fmt.max}"


@given(log2_amax=st.floats(-30.0, 30.0, allow_nan=False), fmt=st.sampled_from(FORMATS), margin_bits=st.integers(0, 6))
@PROPERTY
def test_amax_to_scale_margin_bits_divides_by_two_to_the_m(log2_amax, fmt, margin_bits):
    amax = torch.tensor([2.0**log2_amax])
    plain = amax_to_scale(amax, fmt)
    with_margin = amax_to_scale(amax, fmt, margin_bits=margin_bits)
    assert torch.equal(with_margin, plain / 2.0**margin_bits)  # exact: a power-of-two division


def test_amax_to_scale_rejects_bad_options():
    with pytest.raises(ValueError, match="margin_bits"):
        amax_to_scale(torch.tensor(1.0), Fp8Format.E4M3, margin_bits=-1)
    with pytest.raises(ValueError, match="nonfinite"):
        amax_to_scale(torch.tensor(1.0), Fp8Format.E4M3, nonfinite="ignore")


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_amax_to_scale_nonfinite_raise(bad):
    amax = torch.tensor([1.0, bad])
    with pytest.raises(NonFiniteError, match="^weight: holds inf or NaN"):
        amax_to_scale(amax, Fp8Format.E4M3, nonfinite="raise", name="weight")
    # A NonFiniteError is also a ValueError (bad input) and a FloatingPointError.
    assert issubclass(NonFiniteError, ValueError) and issubclass(NonFiniteError, FloatingPointError)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_amax_to_scale_nonfinite_propagate_gives_nan_never_zero_or_finite(bad, power_of_two):
    amax = torch.tensor([2.0, bad, 0.0])
    scale = amax_to_scale(amax, Fp8Format.E4M3, nonfinite="propagate", power_of_two=power_of_two)
    assert torch.isfinite(scale[[0, 2]]).all()
    assert math.isnan(float(scale[1]))


# ----------------------------------------------------------------------------- quantize: reference
def _reference_group_amax(x64: torch.Tensor, granularity: Granularity, block):
    """float64 amax per scaled group, computed independently of the code under test."""
    mag = x64.abs()
    if granularity == Granularity.TENSORWISE:
        return mag.max()
    if granularity == Granularity.ROWWISE:
        return mag.amax(dim=1, keepdim=True)
    # max_pool2d with ceil_mode gives partial edge tiles their own window.
    return F.max_pool2d(mag[None, None], kernel_size=block, stride=block, ceil_mode=True)[0, 0]


def _expand_groups(per_group: torch.Tensor, granularity: Granularity, block, shape):
    rows, k = shape
    if granularity != Granularity.BLOCKWISE:
        return per_group.expand(rows, k)
    br, bk = block
    return per_group[torch.arange(rows) // br][:, torch.arange(k) // bk]


def _check_quantization(x: torch.Tensor, q: Fp8Tensor, granularity: Granularity, block, *, power_of_two=False, margin_bits=0):
    """Check ``q`` against float64 with bounds derived from the format.

    Write ``s`` for the quantization scale and ``r = fl(1/s)`` for the stored float32 dequant
    scale, ``y = fl(x * s)`` for the scaled value and ``q = fp8(y)``.

    * Normal range (``|y| >= smallest_normal``): ``q = y (1 + d)`` with ``|d| <= u``;
      ``y = x s (1 + e1)``, ``r = (1/s)(1 + e2)``, ``xhat = fl(q r) = q r (1 + e3)`` with each
      ``|e_i| <= 2**-24``. So ``xhat = x (1+e1)(1+d)(1+e2)(1+e3)`` and
      ``|xhat - x| / |x| <= (1 + u)(1 + 2**-24)**4 - 1`` (one more float32 rounding covers the
      float64 -> float32 step of float64 inputs): essentially ``u``.
    * Below it (``|y| < 2 * smallest_normal``, where the grid spacing is the smallest subnormal
      ``sub``): ``q = y + a`` with ``|a| <= sub / 2``, so
      ``xhat = x (1+e1)(1+e2)(1+e3) + a r (1+e3)`` and
      ``|xhat - x| <= (sub / 2) r (1 + 2**-24) + 4 * 2**-24 |x|``.
    """
    fmt = q.fmt
    rows, k = q.shape
    x64 = x.reshape(rows, k).double()
    xhat = q.dequantize(torch.float32).double()
    assert q.data.dtype == fmt.dtype and q.dequant_scale.dtype == torch.float32
    assert q.granularity == granularity

    # 1. The dequant scale is amax / fp8_max of each group (amax clamped at AMAX_EPS).
    amax = _reference_group_amax(x64, granularity, block)
    assert q.dequant_scale.shape == amax.shape
    expected = amax.clamp(min=AMAX_EPS) / fmt.max * 2.0**margin_bits
    r = q.dequant_scale.double()
    if power_of_two:
        assert (torch.frexp(r)[0] == 0.5).all(), "power-of-two dequant scale is not a power of two"
        assert ((r >= expected * (1 - 4 * EPS32)) & (r <= 2 * expected * (1 + 4 * EPS32))).all()
    else:
        torch.testing.assert_close(r, expected, rtol=4 * EPS32, atol=0)

    # 2. Elementwise error against the float64 input.
    r_el = _expand_groups(r, granularity, block, (rows, k))
    scaled = x64.abs() / r_el  # |y| up to float32 rounding
    err = (xhat - x64).abs()
    u = fmt.unit_roundoff
    normal = scaled >= fmt.smallest_normal * (1 + 2.0**-18)  # margin: |y| and |x|/r differ by ~2**-23
    rel_bound = (1 + u) * (1 + EPS32) ** 4 - 1
    bad = normal & (err > rel_bound * x64.abs())
    assert not bad.any(), f"relative error {float((err / x64.abs())[bad].max())} > {rel_bound} at {bad.nonzero()[:3].tolist()}"
    abs_bound = fmt.smallest_subnormal / 2 * r_el * (1 + EPS32) + 4 * EPS32 * x64.abs()
    bad = ~normal & (err > abs_bound)
    assert not bad.any(), f"absolute error {float(err[bad].max())} > bound below the normal range"

    # 3. Each group's largest element maps to fp8_max exactly (fp8_max / 2**m with a margin;
    # within [fp8_max/2, fp8_max] with power-of-two scales), and nothing exceeds fp8_max.
    qmag = q.data.double().abs()
    assert (qmag <= fmt.max).all()
    if q.data.numel():
        qmax = _reference_group_amax(q.data.double(), granularity, block)
        live = amax >= 2 * AMAX_EPS  # groups whose scale came from their own amax
        target = fmt.max / 2.0**margin_bits
        if power_of_two:
            assert ((qmax[live] <= target) & (qmax[live] >= target / 2)).all()
        else:
            assert (qmax[live] == target).all(), f"group max mapped to {qmax[live].unique().tolist()}, not {target}"
        # zeros stay zeros
        assert (q.data.double()[x64 == 0] == 0).all()


BLOCKS = [(1, 128), (128, 128), (1, 4), (3, 5), (2, 7)]


@st.composite
def operands(draw, max_rows=150, max_k=300):
    """A ``(rows, K)`` tensor whose magnitudes spread over ``spread`` decades below ``10**log10_max``.

    A wide spread puts many elements in the subnormal range (and to zero) after scaling.
    """
    rows = draw(st.integers(1, max_rows))
    k = draw(st.integers(1, max_k))
    seed = draw(st.integers(0, 2**31 - 1))
    log10_max = draw(st.floats(-6.0, 6.0))
    spread = draw(st.sampled_from([0.5, 3.0, 8.0]))
    p_zero = draw(st.sampled_from([0.0, 0.2]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (log10_max - spread * torch.rand(rows, k, generator=g, dtype=torch.float64))
    sign = torch.where(torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0).double()
    x = sign * mag
    x[torch.rand(rows, k, generator=g) < p_zero] = 0.0
    if draw(st.booleans()):
        x[torch.randint(rows, (1,), generator=g)] = 0.0  # an all-zero row
    return x.to(dtype)


@given(x=operands(), fmt=st.sampled_from(FORMATS), granularity=st.sampled_from(list(Granularity)), block=st.sampled_from(BLOCKS))
@PROPERTY
def test_quantize_matches_float64_reference(x, fmt, granularity, block):
    block = block if granularity == Granularity.BLOCKWISE else None
    q = quantize(x, fmt, granularity, block=block)
    if granularity == Granularity.BLOCKWISE:
        assert q.block == block
    assert q.shape == x.shape
    _check_quantization(x, q, granularity, block)


@given(
    x=operands(max_rows=40, max_k=140),
    fmt=st.sampled_from(FORMATS),
    granularity=st.sampled_from(list(Granularity)),
    power_of_two=st.booleans(),
    margin_bits=st.integers(0, 3),
)
@PROPERTY
def test_quantize_power_of_two_and_margin_match_float64_reference(x, fmt, granularity, power_of_two, margin_bits):
    block = (2, 7) if granularity == Granularity.BLOCKWISE else None
    q = quantize(x, fmt, granularity, block=block, power_of_two=power_of_two, margin_bits=margin_bits)
    _check_quantization(x, q, granularity, block, power_of_two=power_of_two, margin_bits=margin_bits)


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
@pytest.mark.parametrize("rows, k, block", [(130, 300, (128, 128)), (5, 300, (1, 128)), (256, 128, (128, 128)), (3, 129, (1, 128))])
def test_quantize_blockwise_tiles_and_partial_edges(fmt, rows, k, block):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    # Each tile gets its own magnitude, so a wrong tile assignment shows up as a wrong scale.
    br, bk = block
    n_r, n_c = -(-rows // br), -(-k // bk)
    tile_mag = 10.0 ** torch.randint(-3, 4, (n_r, n_c), generator=g).double()
    x = torch.randn(rows, k, generator=g, dtype=torch.float64) * _expand_groups(tile_mag, Granularity.BLOCKWISE, block, (rows, k))
    q = quantize(x.float(), fmt, "blockwise", block=block)
    assert q.dequant_scale.shape == (n_r, n_c)
    _check_quantization(x.float(), q, Granularity.BLOCKWISE, block)


def test_quantize_blockwise_default_tile_is_1x128():
    q = quantize(torch.randn(4, 300), "e4m3", "blockwise")
    assert q.block == (1, 128) and q.dequant_scale.shape == (4, 3)


# ----------------------------------------------------------------------------- saturating cast
@pytest.mark.parametrize("fmt", FORMATS)
def test_saturated_cast_clamps_finite_values(fmt):
    x = torch.tensor([-3e38, -1e6, -(fmt.max * 1.5), -fmt.max, 0.0, fmt.max, fmt.max * 1.01, 1e6, 3e38])
    out = saturated_cast(x, torch.tensor(1.0), fmt).double()
    expected = x.double().clamp(-fmt.max, fmt.max)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturated_cast_inf_becomes_nan_and_nan_stays_nan(fmt):
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    out = saturated_cast(x, torch.tensor(2.0), fmt).float()
    assert torch.isnan(out[:3]).all()
    assert float(out[3]) == 2.0


@given(seed=st.integers(0, 2**31 - 1), log2_scale=st.floats(-20, 20), fmt=st.sampled_from(FORMATS))
@PROPERTY
def test_saturated_cast_is_round_to_nearest_of_the_clamped_value(seed, log2_scale, fmt):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, generator=g) * 10.0 ** torch.randint(-6, 7, (64,), generator=g)
    scale = torch.tensor(2.0**log2_scale)
    out = saturated_cast(x, scale, fmt).double()
    target = (x.double() * scale.double()).clamp(-fmt.max, fmt.max)
    assert torch.isfinite(out).all()
    # Round to nearest: within u relatively in the normal range, within sub/2 below it.
    bound = torch.maximum(fmt.unit_roundoff * target.abs(), torch.full_like(target, fmt.smallest_subnormal / 2))
    assert ((out - target).abs() <= bound * (1 + 2 * EPS32)).all()


# ------------------------------------------------------------------ quantize: special values, errors
@pytest.mark.parametrize("granularity", list(Granularity))
def test_quantize_nonfinite_raise_names_the_tensor(granularity):
    x = torch.randn(4, 8)
    x[1, 3] = math.inf
    with pytest.raises(NonFiniteError, match="^grad_output:"):
        quantize(x, "e4m3", granularity, block=(1, 4) if granularity == "blockwise" else None, name="grad_output")


@pytest.mark.parametrize("granularity", list(Granularity))
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_quantize_nonfinite_propagate_poisons_exactly_the_affected_groups(granularity, bad):
    x = torch.randn(4, 8)
    x[1, 3] = bad
    block = (1, 4) if granularity == "blockwise" else None
    q = quantize(x, "e4m3", granularity, block=block, nonfinite="propagate")
    out = q.dequantize()
    poisoned = torch.zeros(4, 8, dtype=torch.bool)
    if granularity == "tensorwise":
        poisoned[:] = True
    elif granularity == "rowwise":
        poisoned[1] = True
    else:
        poisoned[1, 0:4] = True
    assert torch.isnan(out[poisoned]).all(), "a non-finite group must read back as NaN, never a finite value"
    assert torch.isfinite(out[~poisoned]).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("granularity", list(Granularity))
def test_quantize_all_zero_rows_give_zeros_and_finite_scales(fmt, granularity):
    x = torch.randn(6, 20)
    x[2] = 0.0
    x[5] = 0.0
    q = quantize(x, fmt, granularity, block=(1, 8) if granularity == "blockwise" else None)
    assert torch.isfinite(q.dequant_scale).all()
    out = q.dequantize()
    assert torch.equal(out[[2, 5]], torch.zeros(2, 20))
    assert torch.isfinite(out).all()
    zeros = quantize(torch.zeros(3, 5), fmt, granularity)
    assert torch.isfinite(zeros.dequant_scale).all() and torch.equal(zeros.dequantize(), torch.zeros(3, 5))


@pytest.mark.parametrize("granularity", list(Granularity))
@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (0, 0)])
def test_quantize_empty_tensors(granularity, shape):
    q = quantize(torch.empty(shape), "e4m3", granularity)
    assert q.data.shape == shape
    assert q.dequantize().shape == shape
    assert torch.isfinite(q.dequant_scale).all()
    expected_scale_shape = {
        "tensorwise": (),
        "rowwise": (shape[0], 1),
        "blockwise": (shape[0], -(-shape[1] // 128)),
    }[granularity]
    assert tuple(q.dequant_scale.shape) == expected_scale_shape


@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "head_permuted", "tall", "unchunked"])
@pytest.mark.parametrize("order", scaling.AMAX_ORDERS)
def test_tensorwise_scale_equals_the_whole_tensor_amax_eagerly_and_compiled(order, layout, bad, monkeypatch):
    # Every reduction order of the tensorwise amax (in chunks of a row, rows, whole) must give the whole
    # tensor's maximum, bit for bit, in any layout and with inf/NaN, eager and compiled.
    monkeypatch.setattr(scaling, "_AMAX_ORDER", order)
    src = torch.randn(6, 4, 8, 64, dtype=torch.bfloat16) * 3  # (batch, heads, tokens, head dim)
    tall = torch.randn(20000, 256, dtype=torch.bfloat16)
    odd = torch.randn(24, 40, dtype=torch.bfloat16)  # rows of 40: not a multiple of the chunk
    if bad is not None:
        src[2, 1, 3, 5] = bad
        tall[12345, 100] = bad
        odd[7, 9] = bad
    x = {
        "contiguous": lambda: src.reshape(48, 256),
        "transposed": lambda: src.reshape(48, 256).t(),
        "head_permuted": lambda: src.transpose(1, 2).reshape(6, 2048),  # attention's heads -> features
        "tall": lambda: tall,
        "unchunked": lambda: odd,
    }[layout]()
    expected = amax_to_scale(x.abs().amax(), Fp8Format.E4M3, nonfinite="propagate").reciprocal()

    def scale_of(t):
        return quantize(t, "e4m3", "tensorwise", nonfinite="propagate").dequant_scale

    torch._dynamo.reset()  # the order is read while tracing
    compiled = torch.compile(scale_of, fullgraph=True, dynamic=False)
    for got in (scale_of(x), compiled(x)):
        assert torch.equal(got, expected) or (bad is not None and torch.isnan(got) and torch.isnan(expected))
    torch._dynamo.reset()


@pytest.mark.parametrize("granularity", list(Granularity))
def test_quantize_1d_input_is_one_row(granularity):
    x = torch.linspace(-3, 5, 200)
    q = quantize(x, "e4m3", granularity)
    assert q.shape == (1, 200)
    _check_quantization(x[None], q, Granularity(granularity), (1, 128) if granularity == "blockwise" else None)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match=r"^act: expected a 2-D \(rows, K\) operand, got shape \(2, 3, 4\)"):
        quantize(torch.randn(2, 3, 4), "e4m3", name="act")
    with pytest.raises(ValueError, match="^act: expected a 2-D"):
        quantize(torch.tensor(1.0), "e4m3", name="act")
    with pytest.raises(TypeError, match="^act: expected a floating point tensor, got torch.int64"):
        quantize(torch.arange(6).reshape(2, 3), "e4m3", name="act")
    with pytest.raises(ValueError, match="^format: unknown FP8 format 'e2m5'"):
        quantize(torch.randn(2, 3), "e2m5")
    with pytest.raises(ValueError, match="columnwise"):
        quantize(torch.randn(2, 3), "e4m3", "columnwise")
    with pytest.raises(ValueError, match="block must be positive"):
        quantize(torch.randn(2, 3), "e4m3", "blockwise", block=(0, 128))


def test_quantize_docstring_example():
    q = quantize(torch.tensor([[1.0, -2.0], [0.5, 0.25]]), "e4m3", "rowwise")
    assert torch.equal(q.dequantize(), torch.tensor([[1.0, -2.0], [0.5, 0.25]]))


def test_dequantize_to_float64_and_bfloat16():
    x = torch.randn(8, 16, dtype=torch.float64)
    q = quantize(x, "e4m3", "rowwise")
    out64 = dequantize(q, torch.float64)
    assert out64.dtype == torch.float64
    assert torch.equal(out64, q.data.double() * q.dequant_scale.double())  # exact: 4-bit x 24-bit mantissas
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------ Fp8Tensor.t()
def test_fp8_tensor_transpose_tensorwise():
    x = torch.randn(5, 9)
    q = quantize(x, "e4m3", "tensorwise")
    qt = q.t()
    assert qt.shape == (9, 5)
    assert torch.equal(qt.dequantize(), q.dequantize().t())
    assert qt.data.data_ptr() == q.data.data_ptr()  # a view, no re-quantization


@pytest.mark.parametrize("granularity", ["rowwise", "blockwise"])
def test_fp8_tensor_transpose_refuses_non_tensorwise(granularity):
    q = quantize(torch.randn(5, 9), "e4m3", granularity)
    with pytest.raises(ValueError, match=f"only a tensorwise-scaled operand can be transposed.*{granularity}"):
        q.t()


# ---------------------------------------------------------------------------------- error metrics
def _np_mere(out, ref, floor_fraction):
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    mag = np.abs(ref)
    denom = np.maximum(mag, floor_fraction * mag.mean())
    return float(np.mean(np.abs(out - ref) / denom))


def _np_sqnr_db(out, ref):
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((out - ref) ** 2)))


def _np_relative_frobenius(out, ref):
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@given(seed=st.integers(0, 2**31 - 1), noise=st.floats(1e-4, 1.0), floor_fraction=st.sampled_from([1e-3, 0.1, 0.5]))
@PROPERTY
def test_error_metrics_match_numpy_float64(seed, noise, floor_fraction):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(17, 23, generator=g)
    out = ref + noise * torch.randn(17, 23, generator=g)
    assert mere(out, ref, floor_fraction=floor_fraction) == pytest.approx(_np_mere(out, ref, floor_fraction), rel=1e-12)
    assert sqnr_db(out, ref) == pytest.approx(_np_sqnr_db(out, ref), rel=1e-12)
    assert relative_frobenius(out, ref) == pytest.approx(_np_relative_frobenius(out, ref), rel=1e-12)


def test_mere_floor_guards_reference_near_zero():
    ref = torch.tensor([1.0, -1.0, 2.0, 1e-9], dtype=torch.float64)
    out = ref + torch.tensor([0.01, 0.0, -0.02, 0.01], dtype=torch.float64)
    # The last element's reference is ~0: its error counts against floor_fraction * mean|ref|.
    floor = 0.1 * float(ref.abs().mean())
    err = (out - ref).abs().tolist()
    expected = (err[0] / 1.0 + 0.0 + err[2] / 2.0 + err[3] / floor) / 4
    assert mere(out, ref, floor_fraction=0.1) == pytest.approx(expected, rel=1e-12)
    assert mere(out, ref) == pytest.approx(expected, rel=1e-12)  # the documented default is 0.1
    # Without a floor, a reference of exactly 0 with an error is infinite, without an error 0.
    zero_ref = torch.tensor([1.0, 0.0])
    assert mere(torch.tensor([1.5, 0.0]), zero_ref, floor_fraction=0.0) == pytest.approx(0.25)
    assert mere(torch.tensor([1.0, 0.1]), zero_ref, floor_fraction=0.0) == math.inf


def test_sqnr_db_identical_and_known_noise():
    ref = torch.ones(100, dtype=torch.float64)
    assert sqnr_db(ref.clone(), ref) == math.inf
    noise = 0.1 * torch.tensor([1.0, -1.0]).repeat(50).double()  # noise power 1, signal power 100
    assert sqnr_db(ref + noise, ref) == pytest.approx(20.0, abs=1e-12)
    noise = 1e-3 * torch.tensor([1.0, -1.0]).repeat(50).double()
    assert sqnr_db(ref + noise, ref) == pytest.approx(60.0, abs=1e-9)
    assert sqnr_db(torch.ones(3), torch.zeros(3)) == -math.inf


def test_relative_frobenius_known_values():
    ref = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    assert relative_frobenius(ref + torch.tensor([[0.0, 0.5], [0.0, 0.0]]), ref) == pytest.approx(0.1)
    assert relative_frobenius(ref, ref) == 0.0
    assert relative_frobenius(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_frobenius(torch.ones(2), torch.zeros(2)) == math.inf


def test_error_metrics_empty_reference():
    assert mere(torch.empty(0), torch.empty(0)) == 0.0


@pytest.mark.parametrize("metric", [mere, sqnr_db, relative_frobenius])
def test_error_metrics_shape_mismatch(metric):
    with pytest.raises(ValueError, match=r"out has shape \(2, 3\) but ref has shape \(3, 2\)"):
        metric(torch.zeros(2, 3), torch.zeros(3, 2))


# ------------------------------------------------------------------------------- CPU GEMM backends
ROWS, IN_FEATURES, OUT_FEATURES = 160, 200, 96  # not multiples of 128: partial blockwise tiles


def _role_operands(role: GemmRole, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, IN_FEATURES, generator=g)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=g) / math.sqrt(IN_FEATURES)
    grad_out = torch.randn(ROWS, OUT_FEATURES, generator=g) * 1e-3
    return role_operands(role, x, weight, grad_out)


def _fp8_frobenius_bound(recipe) -> float:
    """Relative Frobenius error bound of an FP8 GEMM on random data.

    Each operand element is rounded with relative error ``d`` of magnitude ``<= u``; the product
    ``a b (1 + d_a)(1 + d_b)`` then carries ``~ d_a + d_b``. Treating ``d`` as uniform on
    ``[-u, u]`` (RMS ``u / sqrt(3)``, an over-estimate: within a binade the relative error shrinks
    as the value grows), the independent errors of a sum over K terms give a relative Frobenius
    error of about ``sqrt(u_a**2 + u_b**2) / sqrt(3)`` (= sqrt(2) * 2**-4 / sqrt(3) ~= 0.051 for
    E4M3 x E4M3). Twice that is the bound.
    """
    u_a, u_b = recipe.a.fmt.unit_roundoff, recipe.b.fmt.unit_roundoff
    return 2 * math.sqrt(u_a**2 + u_b**2) / math.sqrt(3)


def _accumulation_bound(a_hat: torch.Tensor, b_hat: torch.Tensor) -> torch.Tensor:
    """Elementwise float32 GEMM error bound: ``|fl(A B^T) - A B^T| <= (K + 2) eps |A| |B|^T``."""
    k = a_hat.shape[1]
    return (k + 2) * EPS32 * (a_hat.double().abs() @ b_hat.double().abs().t())


FP8_CASES = [("emulated", r) for r in ("tensorwise", "rowwise", "blockwise")] + [
    ("scaled_mm", r) for r in ("tensorwise", "rowwise", "tensorwise_fast_accum", "rowwise_fast_accum")
]


# grad_format only changes the gradient operand (A of dgrad and wgrad).
ROLE_FORMATS = [(GemmRole.FORWARD, "e4m3")] + [(r, f) for r in (GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT) for f in ("e4m3", "e5m2")]


@pytest.mark.parametrize("backend, recipe_name", FP8_CASES)
@pytest.mark.parametrize("role, grad_format", ROLE_FORMATS)
def test_fp8_backend_gemm_vs_float64(backend, recipe_name, role, grad_format):
    a, b = _role_operands(role)
    recipe = recipe_for(recipe_name, role, grad_format=grad_format)
    out = get_backend(backend).gemm(a, b, recipe, torch.float32)
    ref = a.double() @ b.double().t()
    assert out.shape == ref.shape and out.dtype == torch.float32
    err = relative_frobenius(out, ref)
    bound = _fp8_frobenius_bound(recipe)
    assert err <= bound, f"{backend}:{recipe_name} {role.value}: relative Frobenius error {err:.4f} > {bound:.4f}"
    assert err > 1e-3, f"{backend}:{recipe_name} {role.value}: error {err:.2e} is too small for FP8 (was FP8 skipped?)"


@pytest.mark.parametrize("role", list(GemmRole))
def test_bf16_backend_is_the_high_precision_baseline_on_cpu(role):
    a, b = _role_operands(role)
    backend = get_backend("bf16")
    out = backend.gemm(a, b, None, torch.float32)
    ref = a.double() @ b.double().t()
    assert out.dtype == torch.float32
    # On the CPU it multiplies in the operands' own dtype (float32): accumulation error only.
    assert ((out.double() - ref).abs() <= _accumulation_bound(a, b)).all()


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("role", list(GemmRole))
def test_scaled_mm_equals_emulated_to_fp32_accumulation(recipe_name, role):
    a, b = _role_operands(role, seed=1)
    recipe = recipe_for(recipe_name, role)
    scaled, emulated = get_backend("scaled_mm"), get_backend("emulated")
    qa, qb = emulated.quantize(a, recipe.a), emulated.quantize(b, recipe.b)
    # Same operands: both backends quantize with the same code.
    qa2, qb2 = scaled.quantize(a, recipe.a), scaled.quantize(b, recipe.b)
    assert torch.equal(qa.data.view(torch.uint8), qa2.data.view(torch.uint8))
    assert torch.equal(qb.dequant_scale, qb2.dequant_scale)
    out_scaled = scaled.mm(qa2, qb2, recipe, torch.float32)
    out_emulated = emulated.mm(qa, qb, recipe, torch.float32)
    a_hat, b_hat = qa.dequantize(), qb.dequantize()
    # Each is within the float32 accumulation bound of the exact product of the dequantized
    # operands, so they are within twice that of each other (plus the scale roundings).
    bound = 2 * _accumulation_bound(a_hat, b_hat) * (1 + 4 * EPS32)
    diff = (out_scaled.double() - out_emulated.double()).abs()
    assert (diff <= bound).all(), f"max diff {float(diff.max()):.3e}"


def test_scaled_mm_output_dtype():
    a, b = _role_operands(GemmRole.FORWARD)
    out = get_backend("scaled_mm").gemm(a, b, recipe_for("rowwise", GemmRole.FORWARD), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (ROWS, OUT_FEATURES)


@pytest.mark.parametrize("role", list(GemmRole))
def test_scaled_mm_refuses_blockwise(role):
    a, b = _role_operands(role)
    with pytest.raises(ValueError, match="scaled_mm: blockwise scaling is not supported"):
        get_backend("scaled_mm").gemm(a, b, recipe_for("blockwise", role), torch.float32)


def test_backend_check_reports_unavailable_recipes_and_devices():
    shape = GemmShape(ROWS, IN_FEATURES, OUT_FEATURES)
    blockwise = recipe_for("blockwise", GemmRole.FORWARD)
    reason = get_backend("scaled_mm").check(blockwise, shape, "cpu")
    assert reason is not None and "blockwise" in reason and "scaled_mm" in reason
    for name in ("tensorwise", "rowwise"):
        assert get_backend("scaled_mm").check(recipe_for(name, GemmRole.FORWARD), shape, "cpu") is None
    for name in ("tensorwise", "rowwise", "blockwise"):
        assert get_backend("emulated").check(recipe_for(name, GemmRole.GRAD_WEIGHT), shape, "cpu") is None
    reason = get_backend("emulated").check(blockwise, shape, "meta")
    assert reason is not None and "meta" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given on a machine without a GPU")
def test_scaled_mm_unavailable_on_missing_cuda_has_a_reason():
    availability = get_backend("scaled_mm").availability("cuda")
    assert not availability.ok and availability.reason
    reason = get_backend("scaled_mm").check(recipe_for("rowwise", GemmRole.FORWARD), GemmShape(16, 16, 16), "cuda")
    assert reason == availability.reason


def test_backend_registry():
    assert {"bf16", "emulated", "scaled_mm"} <= set(backend_names())
    assert get_backend("scaled_mm").availability("cpu").ok  # torch >= 2.13 runs it on the CPU
    with pytest.raises(ValueError, match="unknown GEMM backend 'nope'; expected one of .*emulated"):
        get_backend("nope")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("role", list(GemmRole))
def test_scaled_mm_on_cuda_matches_emulated(recipe_name, role):
    backend = get_backend("scaled_mm")
    if not backend.availability("cuda").ok:
        pytest.skip(backend.availability("cuda").reason)
    g = torch.Generator().manual_seed(0)
    # K and N of every role multiples of 16 (the CUDA alignment); rows is K of wgrad.
    x, w, dy = torch.randn(208, 256, generator=g), torch.randn(128, 256, generator=g), torch.randn(208, 128, generator=g)
    a, b = (t.cuda() for t in role_operands(role, x, w, dy))
    recipe = recipe_for(recipe_name, role)
    out = backend.gemm(a, b, recipe, torch.float32)
    emulated = get_backend("emulated")
    qa, qb = emulated.quantize(a, recipe.a), emulated.quantize(b, recipe.b)
    ref = emulated.mm(qa, qb, recipe, torch.float32)
    # Hopper's FP8 tensor cores accumulate with about 14 mantissa bits between promotions to fp32
    # (DeepSeek-V3 report, section 3.3.2), not fp32's 24: a recursive-summation bound with unit
    # roundoff 2**-14; plus the rowwise output rounded to bf16 (relative 2**-9) on CUDA.
    k = qa.data.shape[1]
    magnitude = qa.dequantize().double().abs() @ qb.dequantize().double().abs().t()
    bound = (k + 2) * 2.0**-14 * magnitude + 2.0**-8 * ref.double().abs()
    err = (out.double() - ref.double()).abs()
    worst = int((err / bound).argmax())
    assert (err <= bound).all(), (
        f"max err/bound {(err / bound).max().item():.3g} at {divmod(worst, err.shape[1])}: "
        f"out {out.reshape(-1)[worst].item():.6g} ref {ref.reshape(-1)[worst].item():.6g}"
    )
    shape = GemmShape(208, 250, 128)
    assert "multiples of 16" in backend.check(recipe, shape, "cuda")


# --------------------------------------------------------------------------------------- fast accumulation
@pytest.mark.parametrize("base", ["tensorwise", "rowwise", "blockwise", "triton_rowwise"])
@pytest.mark.parametrize("role", list(GemmRole))
def test_fast_accum_twin_has_the_same_operands(base, role):
    plain, fast = recipe_for(base, role, grad_format="e5m2"), recipe_for(base + "_fast_accum", role, grad_format="e5m2")
    assert (plain.fast_accum, fast.fast_accum) == (False, True)
    assert (plain.a, plain.b) == (fast.a, fast.b)
    assert plain.base == fast.base == base and fast.name == base + "_fast_accum"
    assert base + "_fast_accum" in FP8_RECIPE_NAMES


def test_unknown_recipe_names_fail_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown FP8 recipe 'rowwise_fast'.*rowwise_fast_accum"):
        recipe_for("rowwise_fast", GemmRole.FORWARD)


@pytest.mark.parametrize("recipe_name", ["tensorwise_fast_accum", "rowwise_fast_accum"])
def test_scaled_mm_passes_fast_accum_to_torch(recipe_name, monkeypatch):
    seen = []
    original = torch._scaled_mm

    def spy(*args, use_fast_accum=False, **kwargs):
        seen.append(use_fast_accum)
        return original(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    a, b = _role_operands(GemmRole.FORWARD)
    backend = get_backend("scaled_mm")
    for name in (recipe_name, recipe_name.replace("_fast_accum", "")):
        backend.gemm(a, b, recipe_for(name, GemmRole.FORWARD), torch.float32)
    assert seen == [True, False]


def test_auto_offers_fast_accum_only_on_cuda():
    """Off CUDA the twin is the base kernel: ``auto`` leaves it out rather than measure it twice."""
    backend = get_backend("scaled_mm")
    assert set(backend.auto_recipes("cpu")) == {"tensorwise", "rowwise"}
    assert set(backend.auto_recipes(torch.device("cuda"))) == set(backend.recipes) >= {
        "tensorwise_fast_accum", "rowwise_fast_accum",
    }  # fmt: skip
