"""Delayed scaling on a GPU: Inductor computes a delayed cast and its recorded amax in one kernel.

A delayed cast does not wait for its operand's amax, so the two are independent reads of the
operand. Where the operand is a pointwise producer that Inductor inlines (here an attention
output's transpose), they share one Triton kernel only when they index it alike: the cast reads
the operand in the chunks the amax reduces (``loka_torchrec.fp8.scaling._cast_as_amax_reads``).
"""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from loka_torchrec.fp8 import quantize, scaling, tensor_amax

pytestmark = pytest.mark.gpu


def _attention_output_quantized(weights: torch.Tensor, values: torch.Tensor, amax: torch.Tensor):
    """``(B * heads, m, dh)`` mixed values -> ``(B, m * heads * dh)`` FP8 with a given amax, and its own amax."""
    batch = weights.shape[0] // 4
    mixed = torch.bmm(weights, values).view(batch, 4, 64, 64).transpose(1, 2).reshape(batch, 64 * 256)
    return quantize(mixed, "e4m3", "tensorwise", amax=amax, nonfinite="propagate").data, tensor_amax(mixed)


def _kernels(code: str) -> dict:
    """Triton kernel name -> its source, from Inductor's generated module."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"def (triton_\w+)\(", code)]
    return {name: code[begin : (starts[i + 1][0] if i + 1 < len(starts) else len(code))] for i, (begin, name) in enumerate(starts)}


@pytest.mark.parametrize("alike", [True, False])
def test_a_delayed_cast_and_its_amax_share_one_kernel_when_they_read_alike(alike, monkeypatch):
    monkeypatch.setattr(scaling, "_CAST_AS_AMAX_READS", alike)
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.randn(256 * 4, 64, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    values = torch.randn(256 * 4, 64, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    amax = torch.tensor(3.0, device="cuda")
    (codes, observed), sources = run_and_get_code(torch.compile(_attention_output_quantized, fullgraph=True), weights, values, amax)
    eager_codes, eager_amax = _attention_output_quantized(weights, values, amax)
    assert torch.equal(codes.view(torch.uint8), eager_codes.view(torch.uint8))
    assert torch.equal(observed, eager_amax)
    kernels = _kernels("\n".join(sources))
    casting = [name for name, src in kernels.items() if "float8e4nv" in src and "tl.store" in src]
    reducing = [name for name, src in kernels.items() if "max2" in src and "in_ptr0" in src]
    assert casting, "no kernel casts to FP8"
    # Alike: the kernel that casts is the one that also reduces the chunks; else two kernels read the input.
    assert (set(casting) <= set(reducing)) == alike
    torch._dynamo.reset()
