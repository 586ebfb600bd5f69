"""How far rounding each FP8 GEMM's output to bf16 moves a small model's output and gradients.

Two FP8 plans of one model can compute the same products and still disagree: ``torch._scaled_mm``'s
rowwise GEMM writes bf16 on CUDA where the project's Triton GEMM writes float32, and every GEMM
output that is quantized again (a hidden activation, a gradient in the backward) turns that small
difference into flipped FP8 roundings. This script measures the effect on the CPU, where
``scaled_mm`` writes float32: the model of the compiled-plan GPU test in ``tests/test_gpu_backends.py``
(512 -> 256 -> ReLU -> 128, 1024 rows), every GEMM planned ``scaled_mm:<recipe>``, run once as it is and once
with each GEMM's output rounded to bf16; it reports the SQNR (dB) of the second run's output and of
its first layer's weight gradient against the first's. Example::

    python benchmarks/gemm_output_rounding_sqnr.py --out benchmarks/results/cpu/gemm-output-rounding-sqnr
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path
from typing import List, Tuple

import torch
from torch import nn

import loka_torchrec
from loka_torchrec.atomic_files import write_text_atomic
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.fp8.error_metrics import sqnr_db
from loka_torchrec.gemm.backends import get_backend


def run(recipe: str, bf16_outputs: bool, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The model's output and first weight gradient, its GEMM outputs rounded to bf16 or not."""
    backend = type(get_backend("scaled_mm"))
    exact_mm = backend.mm

    def rounded_mm(self, a, b, gemm_recipe, out_dtype):
        return exact_mm(self, a, b, gemm_recipe, torch.bfloat16).to(out_dtype)

    backend.mm = rounded_mm if bf16_outputs else exact_mm
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 128))
        loka_torchrec.apply(model, DispatchConfig(mode=f"all:scaled_mm:{recipe}", forward_scaling="current"))
        y = model(x)
        y.square().mean().backward()
        return y.detach(), model[0].weight.grad
    finally:
        backend.mm = exact_mm


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output path without suffix (.md is written)")
    args = parser.parse_args(argv)
    x = torch.randn(1024, 512, generator=torch.Generator().manual_seed(1))
    rows = []
    for recipe in ("rowwise", "tensorwise"):
        (y, grad), (y_bf16, grad_bf16) = run(recipe, False, x), run(recipe, True, x)
        rows.append(f"| {recipe} | {sqnr_db(y_bf16.double(), y.double()):.1f} | {sqnr_db(grad_bf16.double(), grad.double()):.1f} |")
    text = "\n".join([
        f"# GEMM outputs rounded to bf16: SQNR against float32 outputs, {datetime.date.today()}",
        "",
        f"- machine: {platform.machine()} CPU; python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
        "| recipe | output dB | first layer's weight gradient dB |",
        "|---|---|---|",
        *rows,
        "",
    ])  # fmt: skip
    out = Path(args.out).with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
