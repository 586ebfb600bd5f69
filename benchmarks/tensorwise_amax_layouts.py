"""How the tensorwise amax of a GEMM input is written, and what it costs under ``torch.compile``.

A tensorwise FP8 operand needs the amax of the whole input before its cast. Under
``torch.compile`` the input is usually not a tensor of its own: Inductor fuses its producer into
the amax reduction and into the cast. How fast that reduction runs depends on how the amax is
written and on the producer's layout. This script times, per producer, the forward quantization
of a ``(rows, K)`` GEMM input as a compiled LoKA layer does it (amax, the row-major FP8 copy for
the forward GEMM, the transposed FP8 copy kept for grad-weight) for each way of writing the amax:

* ``flat``: ``x.abs().amax()``, one reduction over every element;
* ``rows_first``: ``x.abs().amax(dim=1).amax()``, a reduction along each row, then over the rows
  (the same value: max is exact);
* ``flat_tiled``: ``flat`` with Inductor's ``triton.tile_reductions`` on.

Producers (DHEN xl's shapes by default: 8192 rows of 64 tokens x 256):

* ``attention``: ``(weights @ v).transpose(1, 2).reshape(rows, -1)``, an attention block's output;
* ``product``: ``a * b`` of two ``(rows, K)`` tensors (a cross interaction);
* ``norm``: an RMS norm over each 256-wide token, reshaped to ``(rows, K)``.

``producer_only`` is the producer materialized in bf16, no quantization: what the bf16 step pays.
Median of CUDA-event times over ``--reps`` calls, one at a time, after warm-up; one process, one GPU. Example::

    python benchmarks/tensorwise_amax_layouts.py --out results/tensorwise-amax-layouts
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from typing import Callable, Dict

import torch

from loka_torchrec.gemm.measure import call_times_ms

FP8_MAX = 448.0
VARIANTS = ("producer_only", "flat", "rows_first", "flat_tiled")
PRODUCERS = ("attention", "product", "norm")


def amax(x: torch.Tensor, variant: str) -> torch.Tensor:
    if variant == "rows_first":
        return x.abs().amax(dim=1).amax()
    return x.abs().amax()


def quantize_both(x: torch.Tensor, variant: str):
    """The row-major FP8 ``x`` and the row-major FP8 ``x^T`` with one tensorwise scale."""
    scale = FP8_MAX / amax(x, variant).float().clamp(min=1e-12)
    q = (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    qt = (x.t().float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
    return q, qt, scale.reciprocal()


def producer(kind: str, inputs):
    if kind == "attention":
        weights, v = inputs
        rows, heads, tokens, _ = v.shape
        return (weights @ v).transpose(1, 2).reshape(rows, -1)
    if kind == "product":
        a, b = inputs
        return a * b
    (h,) = inputs
    normed = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
    return normed.reshape(h.shape[0], -1)


def make_inputs(kind: str, rows: int, tokens: int, dim: int, heads: int, device):
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    if kind == "attention":
        return (torch.softmax(rnd(rows, heads, tokens, tokens).float(), -1).bfloat16(), rnd(rows, heads, tokens, dim // heads))
    if kind == "product":
        return (rnd(rows, tokens * dim), rnd(rows, tokens * dim))
    return (rnd(rows, tokens, dim),)


def build(kind: str, variant: str) -> Callable:
    def fn(*inputs):
        x = producer(kind, inputs)
        return x.clone() if variant == "producer_only" else quantize_both(x, variant)

    return torch.compile(fn, fullgraph=True, dynamic=False)


def time_ms(fn, inputs, reps: int, warmup: int) -> float:
    """Median ms per call (:func:`loka_torchrec.gemm.measure.call_times_ms`: CUDA events, one call at a time)."""
    return statistics.median(call_times_ms(lambda: fn(*inputs), reps=reps, device=torch.device("cuda"), warmup=warmup))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", required=True, help="output path without extension (.json and .md)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tensorwise_amax_layouts.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results: Dict[str, Dict[str, float]] = {}
    for kind in PRODUCERS:
        inputs = make_inputs(kind, args.rows, args.tokens, args.dim, args.heads, device)
        results[kind] = {}
        for variant in VARIANTS:
            torch._dynamo.reset()
            with torch._inductor.config.patch({"triton.tile_reductions": variant == "flat_tiled"}):
                results[kind][variant] = time_ms(build(kind, variant), inputs, args.reps, args.warmup)
            print(f"[amax] {kind} {variant}: {results[kind][variant]:.3f} ms", flush=True)
        # the variants must agree: max is exact
        x = producer(kind, inputs)
        assert amax(x, "flat").item() == amax(x, "rows_first").item(), kind
    meta = {"device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "command": "python benchmarks/tensorwise_amax_layouts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rows": args.rows, "K": args.tokens * args.dim, "reps": args.reps}  # fmt: skip
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "ms": results}, f, indent=2)
    lines = ["# Tensorwise quantization of a GEMM input, by amax formulation, compiled", ""]
    lines += [f"- {k}: `{v}`" for k, v in meta.items()]
    lines += ["", "| producer | " + " | ".join(f"{v} ms" for v in VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    for kind, row in results.items():
        lines.append(f"| {kind} | " + " | ".join(f"{row[v]:.3f}" for v in VARIANTS) + " |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
