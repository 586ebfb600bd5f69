"""The kernels' pure-torch references against float64 math, and the launchers' input checks (CPU)."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from loka_torchrec.fp8 import AMAX_EPS, Fp8Format, Granularity
from loka_torchrec.kernels.blocknorm_hardswish_quantize import (
    BLOCKNORM_EPS,
    blocknorm_hardswish_quantize,
    blocknorm_hardswish_quantize_reference,
    blocknorm_reference,
    hardswish_reference,
)
from loka_torchrec.kernels.fp8_gemm import (
    candidate_configs,
    fp8_gemm,
    fp8_gemm_error_bound,
    fp8_gemm_reference,
    fp8_mm,
    heuristic_config,
    split_k_for,
)
from loka_torchrec.kernels.fp8_quantize import (
    fp8_quantize,
    fp8_quantize_reference,
    fp8_quantize_with_transpose_reference,
    scale_shape,
)

FORMATS = [Fp8Format.E4M3, Fp8Format.E5M2]
GRANULARITIES = ["tensorwise", "rowwise", "blockwise"]


def _operand(rows, k, *, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))  # rows of different scale
    x[0, : k // 2] *= 50.0  # an outlier region
    x[1] = 0.0  # an all-zero row
    return x


def _group_amax64(x64, granularity, block_k):
    """amax of each element's scaling group, float64."""
    mag = x64.abs()
    if granularity == "tensorwise":
        return mag.amax().expand_as(mag)
    if granularity == "rowwise":
        return mag.amax(1, keepdim=True).expand_as(mag)
    k = mag.shape[1]
    padded = torch.nn.functional.pad(mag, (0, (-k) % block_k)).reshape(mag.shape[0], -1, block_k)
    return padded.amax(2).repeat_interleave(block_k, 1)[:, :k]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize(
    "granularity,block_k", [("tensorwise", 128), ("rowwise", 128), ("blockwise", 128), ("blockwise", 32)]
)
def test_quantize_reference_against_float64(fmt, granularity, block_k):
    x = _operand(19, 300, seed=1)
    q = fp8_quantize_reference(x, fmt, granularity, block_k=block_k)
    x64 = x.double()
    amax = _group_amax64(x64, granularity, block_k)
    assert q.data.dtype == fmt.dtype and q.data.shape == x.shape and q.data.is_contiguous()
    assert tuple(q.dequant_scale.shape) == scale_shape(granularity, 19, 300, block_k)
    assert q.dequant_scale.dtype == torch.float32
    # dequant scale = amax / fp8_max (amax clamped at AMAX_EPS) up to float32 rounding (3 roundings).
    step = torch.clamp(amax, min=AMAX_EPS) / fmt.max
    deq_scale = q.dequant_scale.double()
    if granularity == "rowwise":
        deq_scale = deq_scale.expand_as(x64)
    elif granularity == "blockwise":
        deq_scale = deq_scale.repeat_interleave(block_k, 1)[:, :300]
    assert torch.all((deq_scale / step - 1).abs() <= 3 * 2.0**-24)
    # Every value within one rounding of its format (normal range) or half a subnormal step.
    deq = q.dequantize(torch.float64)
    bound = fmt.unit_roundoff * x64.abs() * (1 + 2.0**-20) + 0.5 * fmt.smallest_subnormal * step * (1 + 2.0**-20)
    assert torch.all((deq - x64).abs() <= bound)
    assert torch.all(q.data.float().abs() <= fmt.max)
    assert torch.all(q.data[1].float() == 0) and torch.isfinite(q.dequant_scale).all()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_transposed_copy_reference(granularity):
    x = _operand(150, 70, seed=2)
    xq, xtq = fp8_quantize_with_transpose_reference(x, "e4m3", granularity)
    assert xtq.data.shape == (70, 150)
    x64 = x.double().t()
    step = torch.clamp(_group_amax64(x64, granularity, 128), min=AMAX_EPS) / 448.0
    bound = 2.0**-4 * x64.abs() * (1 + 2.0**-20) + 2.0**-10 * step * (1 + 2.0**-20)
    assert torch.all((xtq.dequantize(torch.float64) - x64).abs() <= bound)
    if granularity == "tensorwise":  # one scale serves both orientations, so the bytes are transposes
        assert torch.equal(xtq.dequant_scale, xq.dequant_scale)
        assert torch.equal(xtq.data.view(torch.uint8), xq.data.view(torch.uint8).t())


def test_quantize_reference_nonfinite_propagates_per_group():
    x = _operand(6, 40, seed=3)
    x[2, 5] = float("inf")
    x[4, 7] = float("nan")
    q = fp8_quantize_reference(x, "e4m3", "rowwise")
    bad = torch.tensor([False, False, True, False, True, False])
    assert torch.equal(torch.isnan(q.dequant_scale.view(-1)), bad)
    assert torch.isnan(q.data[bad].float()).all() and not torch.isnan(q.data[~bad].float()).any()
    qt = fp8_quantize_reference(x, "e4m3", "tensorwise")
    assert torch.isnan(qt.dequant_scale) and torch.isnan(qt.data.float()).all()


def _blocknorm64(x, block, eps):
    """BlockNorm spelled out block by block in float64."""
    x = x.double()
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], block):
        part = x[:, start : start + block]
        out[:, start : start + block] = part / torch.sqrt((part * part).mean(1, keepdim=True) + eps)
    return out


@pytest.mark.parametrize("rows,n,block", [(4, 512, 256), (3, 600, 256), (2, 100, 256), (5, 96, 32)])
def test_blocknorm_hardswish_reference_against_float64(rows, n, block):
    x = _operand(rows, n, seed=4)
    y64 = _blocknorm64(x, block, BLOCKNORM_EPS)
    y = blocknorm_reference(x, block=block)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), y64, rtol=4 * 2.0**-24 * math.sqrt(block), atol=1e-7)
    h64 = y64 * torch.clamp(y64 + 3, 0, 6) / 6
    h = hardswish_reference(y)
    assert torch.allclose(h.double(), h64, rtol=1e-6, atol=1e-7)
    assert torch.allclose(h, torch.nn.functional.hardswish(y), rtol=2.0**-23, atol=0)
    hq, hp = blocknorm_hardswish_quantize_reference(x, block=block, return_hp=True, hp_dtype=torch.float64)
    assert hq.granularity == Granularity.ROWWISE and hp.dtype == torch.float64
    bound = 2.0**-4 * h64.abs() + 2.0**-10 * h64.abs().amax(1, keepdim=True) / 448 + 1e-6
    assert torch.all((hq.dequantize(torch.float64) - h64).abs() <= bound)


def test_blocknorm_reference_matches_the_model_blocknorm():
    """The fused kernel's BlockNorm is the one the Mods put into models (same blocks, same eps)."""
    block_norm = pytest.importorskip("loka_torchrec.mods.block_norm")
    x = _operand(5, 600, seed=5)
    ours = blocknorm_reference(x, block=256)
    theirs = block_norm.block_rms_norm(x, 256, BLOCKNORM_EPS)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("activation", ["none", "relu", "hardswish"])
def test_gemm_reference_against_float64(activation):
    a = fp8_quantize_reference(_operand(33, 200, seed=6), "e4m3", "rowwise")
    b = fp8_quantize_reference(_operand(17, 200, seed=7), "e5m2", "tensorwise")
    bias = torch.randn(17, generator=torch.Generator().manual_seed(8))
    out = fp8_gemm_reference(
        a.data, b.data, a.dequant_scale, b.dequant_scale, bias=bias, activation=activation, out_dtype=torch.float32
    )
    a64 = a.data.double() * a.dequant_scale.double()
    b64 = b.data.double() * b.dequant_scale.double()
    ref = a64 @ b64.t() + bias.double()
    if activation == "relu":
        ref = ref.clamp_min(0)
    elif activation == "hardswish":
        ref = ref * torch.clamp(ref + 3, 0, 6) / 6
    # float32 sums of exact FP8 products (K roundings) and a few float32 epilogue operations.
    scale = (a64.abs() @ b64.abs().t() + bias.double().abs()) * (1 + ref.abs().clamp(max=3))
    assert torch.all((out.double() - ref).abs() <= (200 + 8) * 2.0**-24 * scale)


def test_gemm_error_bound_holds_for_the_emulated_gemm():
    x, w = _operand(40, 256, seed=9), _operand(24, 256, seed=10) / 16
    for granularity in ("tensorwise", "rowwise", "blockwise"):
        xq = fp8_quantize_reference(x, "e4m3", granularity)
        wq = fp8_quantize_reference(w, "e4m3", granularity)
        got = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t()
        bound = fp8_gemm_error_bound(
            x, w, granularity_a=granularity, granularity_b=granularity, block_a=xq.block, block_b=wq.block,
            out_dtype=torch.float64, accum_eps=0.0,
        )  # fmt: skip
        assert torch.all((got - x.double() @ w.double().t()).abs() <= bound)


def test_candidate_tiles_fit_the_problem_and_the_registers():
    precise = candidate_configs(8192, 4096, 4096, fast_accum=False)
    fast = candidate_configs(8192, 4096, 4096, fast_accum=True)
    # Precise accumulation keeps a second accumulator: tiles above 64 registers per thread are out.
    assert precise and all(c.accumulator_registers <= 64 for c in precise)
    assert set(precise) < set(fast) and any(c.accumulator_registers > 64 for c in fast)
    small = candidate_configs(40, 24, 50, fast_accum=True)
    assert small and all(c.block_m <= 64 and c.block_n <= 64 and c.block_k <= 64 for c in small)


def test_heuristic_tile_fills_the_gpu_when_it_can():
    configs = candidate_configs(32768, 4096, 4096, fast_accum=False)
    largest = max(c.block_m * c.block_n for c in configs)
    big = heuristic_config(32768, 4096, 1, 132, configs)
    assert big.block_m * big.block_n == largest
    mid = heuristic_config(2048, 2048, 1, 132, configs)
    assert -(-2048 // mid.block_m) * -(-2048 // mid.block_n) >= 132
    tiny = heuristic_config(256, 256, 1, 132, configs)  # nothing fills 132 SMs: the smallest tile
    assert tiny.block_m * tiny.block_n == min(c.block_m * c.block_n for c in configs)


def test_split_k_only_for_long_k_and_few_tiles():
    assert split_k_for(8192, 2048, 2048, 132) == 1  # many tiles
    assert split_k_for(256, 256, 1024, 132) == 1  # short K
    split = split_k_for(256, 256, 32768, 132)
    assert 2 <= split <= 8


# ------------------------------------------------------------------------------ input checks


def _fp8(shape, dtype=torch.float8_e4m3fn):
    return torch.zeros(shape).to(dtype)


def test_quantize_rejects_bad_input():
    with pytest.raises(TypeError, match="x: expected a float32"):
        fp8_quantize(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        fp8_quantize(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="granularity"):
        fp8_quantize(torch.zeros(4, 4), "e4m3", "colwise")
    with pytest.raises(ValueError, match="fmt: the Triton kernels write e4m3 or e5m2"):
        fp8_quantize(torch.zeros(4, 4), "e4m3fnuz")
    with pytest.raises(ValueError, match="block_k"):
        fp8_quantize(torch.zeros(4, 4), "e4m3", "blockwise", block_k=100)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="x: expected a CUDA"):
            fp8_quantize(torch.zeros(4, 4))


def test_gemm_rejects_bad_input():
    a, b, s = _fp8((8, 32)), _fp8((16, 32)), torch.ones(())
    with pytest.raises(TypeError, match="a: expected a float8"):
        fp8_gemm(torch.zeros(8, 32), b, s, s)
    with pytest.raises(ValueError, match=r"b: expected shape \(N, K\) with K=32"):
        fp8_gemm(a, _fp8((16, 48)), s, s)
    with pytest.raises(ValueError, match="a_scale: expected 1 .* or 8"):
        fp8_gemm(a, b, torch.ones(5), s)
    with pytest.raises(TypeError, match="b_scale: expected a float32"):
        fp8_gemm(a, b, s, torch.ones((), dtype=torch.float64))
    with pytest.raises(ValueError, match="bias: expected a float tensor of shape \\(16,\\)"):
        fp8_gemm(a, b, s, s, bias=torch.zeros(8))
    with pytest.raises(ValueError, match="activation"):
        fp8_gemm(a, b, s, s, activation="gelu")
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_gemm(a, b, s, s, out_dtype=torch.float64)
    blockwise = fp8_quantize_reference(torch.randn(8, 32), "e4m3", "blockwise")
    with pytest.raises(ValueError, match="a: fp8_mm takes tensorwise or rowwise"):
        fp8_mm(blockwise, blockwise)


def test_blocknorm_rejects_bad_input():
    with pytest.raises(ValueError, match="block: expected a power of two"):
        blocknorm_hardswish_quantize(torch.zeros(4, 256), block=100)
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        blocknorm_hardswish_quantize(torch.zeros(4))
    with pytest.raises(ValueError, match="eps"):
        blocknorm_hardswish_quantize(torch.zeros(4, 256), eps=0.0)
    with pytest.raises(TypeError, match="x: expected a float32"):
        blocknorm_hardswish_quantize(torch.zeros(4, 256, dtype=torch.float64))


def test_kernel_modules_import_without_triton(tmp_path):
    """Without Triton the modules import, the references work, and launches name the problem."""
    script = textwrap.dedent(
        """
        import sys, os
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked for this test")
        sys.meta_path.insert(0, _Block())
        import torch
        from loka_torchrec.kernels import _compat
        from loka_torchrec.kernels.fp8_quantize import fp8_quantize, fp8_quantize_reference
        from loka_torchrec.kernels.fp8_gemm import fp8_gemm_reference
        from loka_torchrec.kernels.blocknorm_hardswish_quantize import blocknorm_hardswish_quantize
        assert _compat.TRITON_IMPORT_ERROR is not None
        fp8_quantize_reference(torch.randn(4, 8))
        try:
            fp8_quantize(torch.randn(4, 8))
        except RuntimeError as exc:
            assert "needs Triton" in str(exc), exc
        else:
            raise AssertionError("no error")
        print("OK")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")  # so the CPU tensor passes the device check
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
