"""The Triton kernels against their references in Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Triton decides between compiled and interpreted kernels when a kernel module is imported, so the
interpreted run happens in a child process: this module's one test in the parent starts
``pytest`` on this same file with ``TRITON_INTERPRET=1`` and a marker variable, and the child
collects the real tests below. Nothing leaks into the other tests (or into the GPU run).

What the interpreter can and cannot check: masking, strides, transposition, scales and the whole
index arithmetic run exactly as on the GPU, and scales are compared bitwise. The interpreter's own
float -> FP8 conversion is not the hardware's: it resolves exact ties away from the even
neighbour, writes ``2**e / 2`` where rounding carries into the next binade, truncates values in the
subnormal range instead of rounding them, and does not produce NaN codes. Codes are therefore
compared exactly except for those three documented cases (each checked against the exactly
recomputed scaled value), and NaN codes only on the GPU.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

_CHILD = "LOKA_KERNELS_INTERPRETER_CHILD"

if os.environ.get(_CHILD) != "1":

    def test_kernels_in_the_triton_interpreter():
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD: "1"})
        cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider", "-o", "addopts="]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        output = result.stdout[-12000:] + result.stderr[-4000:]
        assert result.returncode == 0, output
        passed = re.search(r"(\d+) passed", result.stdout)
        assert passed and int(passed.group(1)) >= 20, output

else:
    import torch

    from loka_torchrec.fp8 import Fp8Format, Fp8Tensor, Granularity, amax_to_scale
    from loka_torchrec.kernels import fp8_quantize as quantize_module
    from loka_torchrec.kernels._compat import INTERPRET
    from loka_torchrec.kernels.blocknorm_hardswish_quantize import (
        _blocknorm_into,
        blocknorm_hardswish_quantize,
        blocknorm_hardswish_reference,
    )
    from loka_torchrec.kernels.fp8_gemm import _gemm_into, fp8_gemm, fp8_gemm_reference, fp8_mm
    from loka_torchrec.kernels.fp8_quantize import (
        _quantize_into,
        fp8_quantize,
        fp8_quantize_reference,
        fp8_quantize_with_transpose,
        fp8_quantize_with_transpose_reference,
        scale_shape,
    )

    assert INTERPRET, "the child process must run the kernels in the interpreter"

    DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

    # ------------------------------------------------------------------------------ helpers

    def _data(rows, k, dtype, *, seed, layout="contiguous"):
        """Random operand (rows, k) in ``layout``: contiguous, a transposed view, or a strided slice."""
        g = torch.Generator().manual_seed(seed)
        if layout == "transposed":
            base = torch.randn(k, rows, generator=g) * torch.exp(torch.randn(1, rows, generator=g))
            return base.to(dtype).t()
        if layout == "sliced":
            base = torch.randn(rows, 2 * k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
            return base.to(dtype)[:, ::2]
        x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
        return x.to(dtype)

    def _quantization_scale(x, fmt, granularity, block_k=128, power_of_two=False):
        """The float32 scale each element was multiplied by, exactly as loka_torchrec.fp8 computes it."""
        mag = x.float().abs()
        if granularity == Granularity.TENSORWISE:
            amax = mag.amax().expand_as(mag)
        elif granularity == Granularity.ROWWISE:
            amax = mag.amax(1, keepdim=True).expand_as(mag)
        else:
            k = mag.shape[1]
            blocks = torch.nn.functional.pad(mag, (0, (-k) % block_k)).reshape(mag.shape[0], -1, block_k).amax(2)
            amax = blocks.repeat_interleave(block_k, 1)[:, :k]
        return amax_to_scale(amax, fmt, power_of_two=power_of_two, nonfinite="propagate")

    def assert_codes_match(got: Fp8Tensor, ref: Fp8Tensor, x: torch.Tensor, *, block_k=128, power_of_two=False):
        """Scales bitwise; codes bitwise except the interpreter's tie and carry conversions."""
        assert got.data.dtype == ref.data.dtype and got.data.shape == ref.data.shape
        assert got.data.is_contiguous()
        assert got.dequant_scale.dtype == torch.float32 and got.dequant_scale.shape == ref.dequant_scale.shape
        assert got.granularity == ref.granularity and got.block == ref.block
        assert torch.equal(got.dequant_scale.isnan(), ref.dequant_scale.isnan())
        assert torch.equal(got.dequant_scale.nan_to_num(0.0), ref.dequant_scale.nan_to_num(0.0))
        k, r = got.data.double(), ref.data.double()
        scaled = (x.float() * _quantization_scale(x, ref.fmt, ref.granularity, block_k, power_of_two)).double()
        scaled = scaled.clamp(-ref.fmt.max, ref.fmt.max)
        finite = ~r.isnan()
        differ = (k != r) & finite
        tie = (scaled - k).abs() == (scaled - r).abs()
        power = r.abs() == torch.exp2(torch.round(torch.log2(r.abs().clamp(min=1e-30))))
        carry = (2 * k == r) & power & (scaled.abs() > k.abs())
        sub = ref.fmt.smallest_subnormal
        truncated_subnormal = (scaled.abs() < ref.fmt.smallest_normal) & (
            k == torch.sign(scaled) * torch.floor(scaled.abs() / sub) * sub
        )
        bad = differ & ~tie & ~carry & ~truncated_subnormal
        assert not bad.any(), (
            f"{int(bad.sum())} codes differ beyond interpreter artefacts, e.g. got {k[bad][:4].tolist()} "
            f"want {r[bad][:4].tolist()} for scaled {scaled[bad][:4].tolist()}"
        )
        assert differ.double().mean() < 0.1

    # ------------------------------------------------------------------------------ quantize

    QUANTIZE_CASES = [
        # rows, k, granularity, fmt, dtype, layout, transpose, block_k
        (37, 50, "rowwise", "e4m3", "bf16", "contiguous", False, 128),
        (37, 50, "rowwise", "e5m2", "fp32", "contiguous", True, 128),
        (130, 300, "rowwise", "e4m3", "bf16", "transposed", False, 128),
        (70, 90, "rowwise", "e4m3", "fp16", "sliced", True, 128),
        (37, 50, "tensorwise", "e4m3", "bf16", "contiguous", True, 128),
        (130, 300, "tensorwise", "e5m2", "fp32", "transposed", True, 128),
        (3, 17, "tensorwise", "e4m3", "fp32", "contiguous", False, 128),
        (37, 50, "blockwise", "e4m3", "bf16", "contiguous", True, 32),
        (130, 300, "blockwise", "e4m3", "fp32", "contiguous", False, 128),
        (130, 300, "blockwise", "e5m2", "bf16", "transposed", True, 64),
        (1, 1, "rowwise", "e4m3", "fp32", "contiguous", True, 128),
    ]

    @pytest.mark.parametrize("case", QUANTIZE_CASES, ids=lambda c: "-".join(map(str, c)))
    def test_quantize_matches_reference(case):
        rows, k, granularity, fmt, dtype, layout, transpose, block_k = case
        x = _data(rows, k, DTYPES[dtype], seed=rows * 1000 + k, layout=layout)
        if rows > 2:
            x[2] = 0  # an all-zero row
        if transpose:
            got, got_t = fp8_quantize_with_transpose(x, fmt, granularity, block_k=block_k)
            ref, ref_t = fp8_quantize_with_transpose_reference(x, fmt, granularity, block_k=block_k)
            assert_codes_match(got_t, ref_t, x.t(), block_k=block_k)
        else:
            got = fp8_quantize(x, fmt, granularity, block_k=block_k)
            ref = fp8_quantize_reference(x, fmt, granularity, block_k=block_k)
        assert_codes_match(got, ref, x, block_k=block_k)

    def test_rowwise_long_rows_take_the_two_pass_path(monkeypatch):
        monkeypatch.setattr(quantize_module, "_ROW_KERNEL_MAX_K", 32)
        x = _data(40, 100, torch.bfloat16, seed=5)
        assert_codes_match(fp8_quantize(x, "e4m3", "rowwise"), fp8_quantize_reference(x, "e4m3", "rowwise"), x)

    def test_nonfinite_rows_get_nan_scales_and_zero_rows_stay_zero():
        x = _data(9, 40, torch.float32, seed=6)
        x[1] = 0
        x[3, 4] = float("inf")
        x[6, 0] = float("nan")
        for granularity in ("rowwise", "blockwise"):
            got, ref = fp8_quantize(x, "e4m3", granularity), fp8_quantize_reference(x, "e4m3", granularity)
            assert_codes_match(got, ref, x)
            assert torch.isnan(got.dequant_scale[[3, 6]]).all() and torch.isfinite(got.dequant_scale[[0, 1, 2]]).all()
            assert torch.all(got.data[1].float() == 0)
        got = fp8_quantize(x, "e4m3", "tensorwise")
        assert torch.isnan(got.dequant_scale)

    def test_power_of_two_scales():
        x = _data(33, 70, torch.bfloat16, seed=7)
        for granularity in ("rowwise", "tensorwise", "blockwise"):
            got = fp8_quantize(x, "e4m3", granularity, power_of_two=True, block_k=32)
            ref = fp8_quantize_reference(x, "e4m3", granularity, power_of_two=True, block_k=32)
            assert_codes_match(got, ref, x, block_k=32, power_of_two=True)
            scale = got.dequant_scale
            assert torch.equal(scale, torch.exp2(torch.round(torch.log2(scale))))

    def test_quantize_writes_every_output_element():
        """Poisoned outputs (NaN codes and scales) must be overwritten everywhere."""
        x = _data(67, 45, torch.bfloat16, seed=8)
        fmt = Fp8Format.E4M3
        for granularity in (Granularity.ROWWISE, Granularity.TENSORWISE, Granularity.BLOCKWISE):
            q = torch.full((67, 45), 0x7F, dtype=torch.uint8).view(fmt.dtype)
            qt = torch.full((45, 67), 0x7F, dtype=torch.uint8).view(fmt.dtype)
            dq = torch.full(scale_shape(granularity, 67, 45, 32), float("nan"))
            dqt = torch.full(scale_shape(granularity, 45, 67, 32), float("nan"))
            _quantize_into(x, fmt, granularity, 32, False, q, dq, qt, dqt)
            ref, ref_t = fp8_quantize_with_transpose_reference(x, fmt, granularity, block_k=32)
            block = (1, 32) if granularity == Granularity.BLOCKWISE else None
            assert_codes_match(Fp8Tensor(q, dq, fmt, granularity, block), ref, x, block_k=32)
            assert_codes_match(Fp8Tensor(qt, dqt, fmt, granularity, block), ref_t, x.t(), block_k=32)

    # ------------------------------------------------------------------------------ GEMM

    def _operands(m, k, n, granularity_a, granularity_b, fmt_a, fmt_b, *, seed, b_layout="contiguous"):
        a = fp8_quantize_reference(_data(m, k, torch.float32, seed=seed), fmt_a, granularity_a)
        b = fp8_quantize_reference(_data(n, k, torch.float32, seed=seed + 1), fmt_b, granularity_b)
        if b_layout == "transposed":  # the same values, stored column-major
            b = Fp8Tensor(b.data.t().contiguous().t(), b.dequant_scale, b.fmt, b.granularity)
        return a, b

    def _assert_gemm_close(out, a, b, bias, activation, out_dtype):
        ref = fp8_gemm_reference(
            a.data, b.data, a.dequant_scale, b.dequant_scale, bias=bias, activation=activation, out_dtype=torch.float64,
            compute_dtype=torch.float64,
        )  # fmt: skip
        k = a.data.shape[1]
        abs_sum = (a.dequantize(torch.float64).abs() @ b.dequantize(torch.float64).abs().t()) + (
            0 if bias is None else bias.double().abs()
        )
        # The interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest): one bf16 ulp.
        out_u = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[out_dtype]
        bound = out_u * ref.abs() * 1.01 + (k + 8) * 2.0**-24 * 2 * abs_sum + 1e-30
        assert out.dtype == out_dtype and out.shape == ref.shape
        err = (out.double() - ref).abs()
        assert torch.all(err <= bound), f"max error {err.max().item()}, at most {bound.max().item()} allowed"

    GEMM_CASES = [
        # m, k, n, granularity a, b, fmt a, b, b layout, bias, activation, out dtype, split_k
        (37, 50, 29, "rowwise", "rowwise", "e4m3", "e4m3", "contiguous", False, "none", "bf16", 1),
        (64, 128, 64, "rowwise", "tensorwise", "e4m3", "e4m3", "contiguous", True, "relu", "fp32", 1),
        (70, 200, 33, "tensorwise", "tensorwise", "e5m2", "e4m3", "transposed", True, "hardswish", "fp32", 2),
        (5, 300, 70, "rowwise", "rowwise", "e4m3", "e5m2", "contiguous", False, "none", "fp16", 3),
        (1, 1, 1, "rowwise", "rowwise", "e4m3", "e4m3", "contiguous", True, "none", "fp32", 1),
    ]

    @pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: "-".join(map(str, c)))
    def test_gemm_matches_reference(case):
        m, k, n, gran_a, gran_b, fmt_a, fmt_b, b_layout, has_bias, activation, out_dtype, split_k = case
        a, b = _operands(m, k, n, gran_a, gran_b, fmt_a, fmt_b, seed=m + k + n, b_layout=b_layout)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(1)) if has_bias else None
        out = torch.full((m, n), float("nan"), dtype=DTYPES[out_dtype])  # poisoned
        _gemm_into(a.data, b.data, a.dequant_scale, b.dequant_scale, bias, activation, False, out, split_k=split_k)
        _assert_gemm_close(out, a, b, bias, activation, DTYPES[out_dtype])

    def test_fp8_mm_public_path_and_transposed_tensorwise_operand():
        a, b = _operands(40, 96, 24, "tensorwise", "tensorwise", "e4m3", "e4m3", seed=11)
        bt = Fp8Tensor(b.data.t().contiguous(), b.dequant_scale, b.fmt, b.granularity).t()  # a (24, 96) view
        for fast_accum in (False, True):
            out = fp8_mm(a, bt, out_dtype=torch.float32, fast_accum=fast_accum)
            _assert_gemm_close(out, a, b, None, "none", torch.float32)
        out = fp8_gemm(a.data, b.data, a.dequant_scale, b.dequant_scale, activation="relu")
        _assert_gemm_close(out, a, b, None, "relu", torch.bfloat16)

    # ------------------------------------------------------------------------------ BlockNorm

    BLOCKNORM_CASES = [(7, 300, 256, "fp32"), (33, 512, 256, "bf16"), (5, 100, 256, None), (9, 96, 32, "fp32")]

    @pytest.mark.parametrize("case", BLOCKNORM_CASES, ids=lambda c: "-".join(map(str, c)))
    def test_blocknorm_hardswish_quantize_matches_reference(case):
        rows, n, block, hp = case
        x = _data(rows, n, torch.bfloat16, seed=rows + n) * 3
        fmt = Fp8Format.E4M3
        q = torch.full((rows, n), 0x7F, dtype=torch.uint8).view(fmt.dtype)
        dq = torch.full((rows, 1), float("nan"))
        h = torch.full((rows, n), float("nan"), dtype=torch.float32)  # always fetch h to check the codes
        _blocknorm_into(x, block, 1e-6, fmt, False, q, dq, h)
        h_ref = blocknorm_hardswish_reference(x, block=block)
        assert torch.allclose(h, h_ref, rtol=1e-5, atol=1e-6)
        # The codes are exactly the rowwise quantization of the kernel's own float32 h.
        assert_codes_match(Fp8Tensor(q, dq, fmt, Granularity.ROWWISE), fp8_quantize_reference(h, fmt, "rowwise"), h)
        hq, hp_out = blocknorm_hardswish_quantize(x, block=block, return_hp=hp is not None, hp_dtype=DTYPES.get(hp))
        assert torch.equal(hq.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(hq.dequant_scale, dq)
        if hp is None:
            assert hp_out is None
        else:
            assert hp_out.dtype == DTYPES[hp]
            # The same h, rounded to hp_dtype (the interpreter truncates to bfloat16: within one ulp).
            assert torch.all((hp_out.float() - h).abs() <= 2.0**-7 * h.abs())

    # ------------------------------------------------------------------------------ torch.library

    def test_custom_ops_schema_and_fake_registrations():
        x = _data(20, 48, torch.bfloat16, seed=12)
        a, b = _operands(20, 48, 16, "rowwise", "rowwise", "e4m3", "e4m3", seed=13)
        checks = ("test_schema", "test_faketensor")
        torch.library.opcheck(torch.ops.loka.fp8_quantize.default, (x, "e4m3", "rowwise", 128, False, True), test_utils=checks)
        torch.library.opcheck(torch.ops.loka.fp8_quantize.default, (x, "e5m2", "blockwise", 32, False, False), test_utils=checks)
        # test_schema runs arithmetic on the inputs, which the CPU does not implement for FP8 tensors.
        torch.library.opcheck(
            torch.ops.loka.fp8_gemm.default,
            (a.data, b.data, a.dequant_scale, b.dequant_scale, torch.randn(16), "relu", torch.bfloat16, False),
            test_utils=("test_faketensor",),
        )
        torch.library.opcheck(
            torch.ops.loka.blocknorm_hardswish_quantize.default,
            (x, 32, 1e-6, "e4m3", False, True, torch.float32),
            test_utils=checks,
        )

    def test_kernels_trace_under_torch_compile():
        def layer(x, w):
            xq = fp8_quantize(x, "e4m3", "rowwise")
            wq = fp8_quantize(w, "e4m3", "rowwise")
            return fp8_mm(xq, wq, activation="hardswish", out_dtype=torch.float32)

        x, w = _data(24, 64, torch.bfloat16, seed=14), _data(32, 64, torch.bfloat16, seed=15)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x, w), layer(x, w))

    @pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
    def test_a_layer_on_the_triton_backend_compiles_whole(recipe, monkeypatch):
        """A model planned on ``triton:<recipe>`` compiles with ``fullgraph=True`` (the GEMM is the
        ``loka::fp8_gemm`` op) and computes, forward and backward, what the compiled ``scaled_mm``
        plan computes from the same FP8 operands (only the summation order differs; that plan is held to
        its eager self in ``test_compile.py``, and the eager one to float64 in ``test_linear.py``)."""
        from compiled_plans import compiled_over_arch_step

        from loka_torchrec.gemm.backends import get_backend
        from loka_torchrec.gemm.backends.base import Availability

        backend = type(get_backend("triton"))  # the interpreter runs its kernels on the CPU
        monkeypatch.setattr(backend, "devices", ("cpu",))
        monkeypatch.setattr(backend, "_probe", lambda self, device: Availability(True))
        monkeypatch.setattr(get_backend("triton"), "_availability", {})
        assert get_backend("triton").compile_reason(recipe) is None  # offered to compiled plans
        results = {name: compiled_over_arch_step(f"{name}:{recipe}") for name in ("triton", "scaled_mm")}
        for got, want in zip(results["triton"], results["scaled_mm"]):
            assert got is not None and torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
