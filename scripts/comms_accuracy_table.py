"""Accuracy of embedding all-to-all codecs: loka FP8 vs TorchRec's FP8 (FBGEMM HFP8) vs BF16.

Each codec encodes and decodes the flat payload of a ``(rows, dim)`` block of pooled embeddings
the way TorchRec's pooled all-to-all does (``create_context``, ``encode``, ``decode``); the
errors are measured in float64 against the input. TorchRec's codecs are built with its own
``get_qcomm_codecs_registry``; where one raises on this machine the table says so with the error.

Data sets:

* ``N(0,1)``: standard normal values;
* ``Student-t(3)``: heavy tailed, the outliers that break one scale for everything;
* ``pooled EBC``: real-scale embeddings: sum pooling of 1 to 40 rows of tables initialized as
  TorchRec does (uniform in ``+-1/sqrt(num_embeddings)``, 200k rows), with per-table scales
  spread over four decades as trained tables drift apart.

Usage::

    python scripts/comms_accuracy_table.py --out docs/comms_accuracy.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import sys
from typing import Callable, Dict, List, Tuple

import torch

from loka_torchrec.comms import CommsConfig, registry
from loka_torchrec.fp8 import mere, relative_frobenius, sqnr_db
from loka_torchrec.atomic_files import write_text_atomic

POOLED = "POOLED_EMBEDDINGS_ALL_TO_ALL"


def datasets(rows: int, dim: int, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, dim, generator=g)
    student = torch.distributions.StudentT(3.0).sample((rows, dim))
    num_embeddings, n_tables = 200_000, 26
    bound = 1.0 / math.sqrt(num_embeddings)
    table_scale = torch.logspace(-2, 2, n_tables)
    pooled = torch.zeros(rows, dim)
    for r in range(rows):  # one table per row of the payload, as in a (B, F * D) all-to-all chunk
        t = r % n_tables
        bag = int(torch.randint(1, 41, (1,), generator=g))
        pooled[r] = ((torch.rand(bag, dim, generator=g) * 2 - 1) * bound * table_scale[t]).sum(0)
    return {"N(0,1)": normal, "Student-t(3)": student, "pooled EBC (real scale)": pooled}


def _codec_round_trip(codec) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        ctx = codec.create_context()
        payload = codec.encode(x.reshape(-1), ctx)
        return codec.decode(payload, ctx).reshape(x.shape).to(torch.float32), payload

    return run


def methods(dim: int) -> List[Tuple[str, Callable]]:
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    out = []
    for label, config in (
        ("loka FP8 E4M3, fp32 row scale", CommsConfig(forward="fp8")),
        ("loka FP8 E4M3, e8m0 row scale", CommsConfig(forward="fp8", scale_format="e8m0")),
        ("loka FP8 E5M2 (gradient format), fp32 row scale", CommsConfig(forward="fp8", forward_format="e5m2")),
    ):
        out.append((label, _codec_round_trip(registry(config, embedding_dims=[dim])[POOLED].forward)))
    for label, kwargs in (
        ("TorchRec FP8 (HFP8), per tensor", {}),
        (f"TorchRec FP8 (HFP8), fp8_quantize_dim={dim}", {"fp8_quantize_dim": dim}),
    ):
        reg = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP8, **kwargs))
        out.append((label, _codec_round_trip(reg[POOLED].forward)))
    out.append(("FBGEMM HFP8 op on a 2-D view (not TorchRec's 1-D call)", _hfp8_2d))
    reg = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.BF16))
    out.append(("TorchRec BF16", _codec_round_trip(reg[POOLED].forward)))
    return out


def _hfp8_2d(x: torch.Tensor):
    from fbgemm_gpu.quantize_comm import bias, ebits, mbits
    from fbgemm_gpu.quantize_utils import fp32_to_hfp8_with_clamp, hfp8_to_fp32

    q = fp32_to_hfp8_with_clamp(x, ebits, mbits, bias)
    return hfp8_to_fp32(q, ebits, bias), q


def measure(rows: int, dim: int, seed: int) -> List[dict]:
    results = []
    data = datasets(rows, dim, seed)
    for label, run in methods(dim):
        for name, x in data.items():
            row = {"codec": label, "data": name}
            try:
                out, payload = run(x)
                row.update(
                    rel_frobenius=relative_frobenius(out, x),
                    mere=mere(out, x),
                    sqnr_db=sqnr_db(out, x),
                    bytes_per_value=payload.numel() * payload.element_size() / x.numel(),
                    nonfinite=int((~torch.isfinite(out)).sum()),
                )
            except Exception as e:  # reported in the table, never hidden
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            results.append(row)
    return results


def markdown(results: List[dict], command: str, rows: int, dim: int) -> str:
    lines = [
        f"Payload: {rows} x {dim} values per data set; errors vs the float32 input, computed in float64.",
        f"Device: CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}; "
        f"date {datetime.date.today().isoformat()}; command: `{command}`",
        "",
        "| codec | data | bytes/value | rel. Frobenius | MERE | SQNR dB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['codec']} | {r['data']} | - | fails on CPU: {r['error']} | | |")
        else:
            lines.append(
                f"| {r['codec']} | {r['data']} | {r['bytes_per_value']:.4f} | {r['rel_frobenius']:.4f} | "
                f"{r['mere']:.4f} | {r['sqnr_db']:.1f} |"
            )
    return "\n".join(lines) + "\n"



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="markdown file to write (a .json beside it holds the numbers)")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # TorchRec's codec factory logs its reduce-scatter fallback
    torch.manual_seed(args.seed)
    results = measure(args.rows, args.dim, args.seed)
    command = "python scripts/comms_accuracy_table.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown(results, command.strip(), args.rows, args.dim)
    print(table)
    if args.out:
        write_text_atomic(args.out, table)
        write_text_atomic(os.path.splitext(args.out)[0] + ".json", json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
