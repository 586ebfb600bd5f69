"""The Triton encode/decode kernels against the torch reference of the same wire format.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess because
the flag is read when the kernels are defined); its FP8 cast rounds differently from hardware,
so those checks are bounded by the format, not bitwise. The ``gpu`` tests run the compiled
kernels on the device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.kernels import fp8_comm_codec as wire

_INTERPRETER_SCRIPT = r"""
import json, torch
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.kernels import fp8_comm_codec as wire

torch.manual_seed(0)
results = []
for fmt in ("e4m3", "e5m2"):
    f = Fp8Format(fmt)
    for scale_format in ("fp32", "e8m0"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            block, n_blocks = 24, 70  # not a power of two; more blocks than one program takes
            x = torch.randn(n_blocks, block) * torch.logspace(-3, 3, n_blocks)[:, None]
            x[5] = 0.0
            x[7, 3], x[9, 0], x[9, 1] = float("inf"), float("nan"), -float("inf")
            x = x.to(dtype)
            c_enc, c_dec = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
            payload = wire.encode_triton(x, block=block, fmt=fmt, scale_format=scale_format, count=c_enc)
            ref_payload = wire.encode_reference(x, block=block, fmt=fmt, scale_format=scale_format)
            out = wire.decode_triton(payload, block=block, fmt=fmt, scale_format=scale_format, out_dtype=torch.float32, count=c_dec)
            out_of_ref = wire.decode_triton(ref_payload, block=block, fmt=fmt, scale_format=scale_format, out_dtype=dtype)
            ref_of_ref = wire.decode_reference(ref_payload, block=block, fmt=fmt, scale_format=scale_format, out_dtype=dtype)
            xf = x.double().view(-1)
            finite = torch.isfinite(xf)
            amax = torch.where(finite.view(n_blocks, block), x.double().abs(), 0).amax(1, keepdim=True).expand(n_blocks, block).reshape(-1)
            d = amax / f.max * (2 if scale_format == "e8m0" else 1)
            bound = (f.unit_roundoff * xf.abs() + f.smallest_subnormal / 2 * d) * (1 + 2**-20) + 2**-20 * d
            err = (out.double() - xf).abs()
            results.append(dict(
                case=f"{fmt}/{scale_format}/{dtype}",
                size_ok=payload.numel() == ref_payload.numel(),
                excess=float((err - bound)[finite].max()),
                nonfinite_ok=bool(torch.equal(~torch.isfinite(out), ~finite)),
                inf_sign_ok=fmt == "e4m3" or (out[7 * block + 3] == float("inf") and out[9 * block + 1] == -float("inf")).item(),
                counts=[int(c_enc), int(c_dec)],
                decode_dtype_ok=out_of_ref.dtype == dtype,
                decode_same_nonfinite=bool(torch.equal(~torch.isfinite(out_of_ref), ~torch.isfinite(ref_of_ref))),
                decode_rel_diff=float(((out_of_ref.double() - ref_of_ref.double()).abs() / ref_of_ref.double().abs().clamp(min=1e-30))[torch.isfinite(ref_of_ref)].max()),
                out_eps=torch.finfo(dtype).eps,
                scale_bytes_equal=bool(torch.equal(payload.view(n_blocks, -1)[:, block:], ref_payload.view(n_blocks, -1)[:, block:])),
            ))
empty = wire.encode_triton(torch.empty(0), block=8)
results.append(dict(case="empty", empty_ok=empty.numel() == 0 and wire.decode_triton(empty, block=8).numel() == 0))
print("RESULTS" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    if not wire.HAS_TRITON:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")][-1]
    return json.loads(line[len("RESULTS") :])


def test_interpreted_kernels_round_trip_within_format_bound(interpreted):
    for r in interpreted[:-1]:
        assert r["size_ok"], r["case"]
        assert r["excess"] <= 0.0, r
        assert r["nonfinite_ok"] and r["inf_sign_ok"], r["case"]
        assert r["counts"] == [3, 3], r["case"]


def test_interpreted_decode_matches_reference_decode(interpreted):
    for r in interpreted[:-1]:
        assert r["decode_dtype_ok"], r["case"]
        assert r["decode_same_nonfinite"], r["case"]
        # the same payload decodes to the same value up to one rounding to the output dtype
        assert r["decode_rel_diff"] <= r["out_eps"], r
        if "e8m0" in r["case"]:  # power-of-two scales come from integer bit arithmetic: exact
            assert r["scale_bytes_equal"], r["case"]


def test_interpreted_empty_payload(interpreted):
    assert interpreted[-1]["empty_ok"]


# --- on the device ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernels_match_reference(fmt, scale_format, dtype):
    if not wire.HAS_TRITON:
        pytest.skip("triton is not installed")
    torch.manual_seed(0)
    block, n_blocks = 128, 26 * 1024
    x = (torch.randn(n_blocks, block, device="cuda") * torch.logspace(-3, 3, n_blocks, device="cuda")[:, None]).to(dtype)
    x[3] = 0
    x[5, 7] = float("nan")
    c_tri, c_ref = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
    payload = wire.encode_triton(x, block=block, fmt=fmt, scale_format=scale_format, count=c_tri)
    ref = wire.encode_reference(x, block=block, fmt=fmt, scale_format=scale_format, count=c_ref)
    # data bytes: the kernel rounds to the FP8 grid itself, exactly as the torch cast does
    data, ref_data = payload.view(n_blocks, -1)[:, :block], ref.view(n_blocks, -1)[:, :block]
    assert torch.equal(data, ref_data)
    out = wire.decode_triton(payload, block=block, fmt=fmt, scale_format=scale_format, out_dtype=dtype)
    ref_out = wire.decode_reference(ref, block=block, fmt=fmt, scale_format=scale_format, out_dtype=dtype)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2.0**-20, atol=0.0, equal_nan=True)
    assert int(c_tri) == int(c_ref) == 1
    f = Fp8Format(fmt)
    finite = torch.isfinite(x.float())
    err = (out.view(n_blocks, block).double() - x.double()).abs()
    amax = torch.where(finite, x.double().abs(), 0).amax(1, keepdim=True)
    # + the spacing of the output dtype's subnormals: float16 outputs round tiny values to a grid of 2**-24
    subnormal_step = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    bound = (
        f.unit_roundoff * x.double().abs() + f.smallest_subnormal / 2 * amax / f.max * 2 + 2.0**-7 * x.double().abs()
        + subnormal_step
    )
    assert (err <= bound)[finite].all()


@pytest.mark.gpu
def test_gpu_codec_uses_triton_on_cuda_tensors():
    from loka_torchrec.comms import Fp8CommCodec

    codec = Fp8CommCodec("e4m3", block=64)
    x = torch.randn(32, 64, device="cuda")
    assert codec._kernel_for(x) == ("triton" if wire.HAS_TRITON else "torch")
    assert codec._kernel_for(x.cpu()) == "torch"
    assert ("triton" in repr(codec)) == wire.HAS_TRITON
    out = codec.decode(codec.encode(x, ctx := codec.create_context()), ctx)
    assert out.is_cuda and ((out.view(32, 64) - x).abs() <= 2.0**-4 * x.abs() + 1e-3 * x.abs().amax(1, keepdim=True)).all()
