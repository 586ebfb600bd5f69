"""Quality report for the mods: is each model change neutral in high precision, before FP8 enters?

Trains the DHEN-style model (pooled synthetic click data) and the HSTU-style model (synthetic
user histories) as the baseline, with each mod alone, and with all mods, in float32 on the CPU,
for the same steps, seeds and data, and prints the final eval NE (normalized entropy: mean log
loss over the entropy of the eval base rate; lower is better) of each, with the teacher's NE
(the best reachable). A second baseline with another initialization seed shows how much NE moves
for reasons that have nothing to do with the mods. ``fuse_siblings`` and ``pad_to_16`` preserve
the model function, so their rows must match the baseline up to float32 rounding.

Writes ``report.md`` (the table) and ``report.json`` to ``--output-dir`` (atomically).

Example::

    python scripts/mods_quality_report.py --steps 300 --workers 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

VARIANTS: Tuple[Tuple[str, str, Optional[str], int], ...] = (
    # (row label, ModsConfig preset, the single mod for "custom", init seed offset)
    ("baseline", "none", None, 0),
    ("baseline, other init seed", "none", None, 1),
    ("no_bias", "custom", "no_bias", 0),
    ("block_norm", "custom", "block_norm", 0),
    ("hard_swish", "custom", "hard_swish", 0),
    ("fuse_siblings", "custom", "fuse_siblings", 0),
    ("pad_to_16", "custom", "pad_to_16", 0),
    ("all mods", "all", None, 0),
)
MODELS = ("dhen", "hstu")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    model: str
    label: str
    preset: str
    mod: Optional[str]
    seed: int
    steps: int
    batch_size: int
    eval_batches: int
    lr: float
    block_size: int


def _datasets(model: str, steps: int, batch_size: int, eval_batches: int, data_seed: int):
    """``(spec, train, eval, teacher_ne_fn)`` for the model's synthetic task."""
    if model == "dhen":
        from loka_torchrec.training.synthetic import SyntheticConfig, SyntheticRecDataset, make_data_spec, teacher_ne

        cfg = SyntheticConfig(
            num_dense=13, num_tables=6, num_embeddings=1000, embedding_dim=32, batch_size=batch_size,
            train_batches=steps, eval_batches=eval_batches, seed=data_seed,
        )
        return (
            make_data_spec(cfg),
            SyntheticRecDataset(cfg, rank=0, world_size=1),
            SyntheticRecDataset(cfg, rank=0, world_size=1, split="eval"),
            lambda: teacher_ne(cfg),
        )
    from loka_torchrec.training.synthetic_sequences import (
        SyntheticSequenceConfig, SyntheticSequenceDataset, make_sequence_data_spec, sequence_teacher_ne,
    )

    cfg = SyntheticSequenceConfig(
        num_items=1000, max_seq_len=20, embedding_dim=32, batch_size=batch_size, train_batches=steps,
        eval_batches=eval_batches, seed=data_seed,
    )
    return (
        make_sequence_data_spec(cfg),
        SyntheticSequenceDataset(cfg, rank=0, world_size=1),
        SyntheticSequenceDataset(cfg, rank=0, world_size=1, split="eval"),
        lambda: sequence_teacher_ne(cfg),
    )


def _build(model: str, spec, seed: int) -> torch.nn.Module:
    cpu = torch.device("cpu")
    torch.manual_seed(seed)
    if model == "dhen":
        from loka_torchrec.models.dhen import DhenConfig, build_dhen

        return build_dhen(DhenConfig.small(), spec, cpu, embedding_device=cpu)
    from loka_torchrec.models.hstu import HstuConfig, build_hstu

    return build_hstu(HstuConfig.small(), spec, cpu, embedding_device=cpu)


def _evaluate(net: torch.nn.Module, data) -> float:
    from loka_torchrec.training.metrics import normalized_entropy

    net.eval()
    logits, labels = [], []
    with torch.no_grad():
        for batch in data:
            logits.append(net(batch.dense_features, batch.sparse_features))
            labels.append(batch.labels)
    net.train()
    return normalized_entropy(torch.cat(logits), torch.cat(labels))


def run_one(spec: RunSpec) -> Dict[str, Any]:
    """Train one variant and return its eval NE (runs in a worker process)."""
    torch.set_num_threads(1)  # one core per worker: oversubscribed BLAS threads are far slower
    from loka_torchrec.mods import ModsConfig, apply_mods

    data_spec, train, evaluation, _ = _datasets(spec.model, spec.steps, spec.batch_size, spec.eval_batches, 0)
    net = _build(spec.model, data_spec, spec.seed)
    if spec.preset == "custom":
        config = ModsConfig.only(spec.mod, block_size=spec.block_size)
    else:
        config = ModsConfig(preset=spec.preset, block_size=spec.block_size)
    report = apply_mods(net, config)
    optimizer = torch.optim.Adam(net.parameters(), lr=spec.lr)
    start = time.perf_counter()
    last_losses: List[float] = []
    for batch in train:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            net(batch.dense_features, batch.sparse_features), batch.labels
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        last_losses = (last_losses + [loss.item()])[-20:]
    seconds = time.perf_counter() - start
    return {
        "model": spec.model,
        "variant": spec.label,
        "eval_ne": _evaluate(net, evaluation),
        "train_loss_last20": sum(last_losses) / len(last_losses),
        "train_seconds": seconds,
        "modules_touched": sum(len(r.modules) for r in report),
    }


def _teacher_ne(args: Tuple[str, int, int, int]) -> Tuple[str, float]:
    torch.set_num_threads(1)
    model, steps, batch_size, eval_batches = args
    return model, _datasets(model, steps, batch_size, eval_batches, 0)[3]()


def _write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def markdown_table(results: List[Dict[str, Any]], teacher: Dict[str, float], models: List[str]) -> str:
    """One row per variant, one NE column (and change vs baseline, in %) per model."""
    by_key = {(r["model"], r["variant"]): r for r in results}
    header = "| variant | " + " | ".join(f"{m.upper()} eval NE | vs baseline" for m in models) + " |"
    rule = "|---|" + "---:|---:|" * len(models)
    lines = [header, rule]
    for label, *_ in VARIANTS:
        cells = []
        for m in models:
            r, base = by_key.get((m, label)), by_key.get((m, "baseline"))
            if r is None:
                cells += ["", ""]
                continue
            delta = 100.0 * (r["eval_ne"] - base["eval_ne"]) / base["eval_ne"] if base else float("nan")
            cells += [f"{r['eval_ne']:.4f}", "" if label == "baseline" else f"{delta:+.2f}%"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| teacher (best reachable) | " + " | ".join(f"{teacher[m]:.4f} | " for m in models) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out batches for the final NE")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate, all parameters")
    parser.add_argument("--seed", type=int, default=0, help="model initialization seed")
    parser.add_argument("--block-size", type=int, default=256, help="BlockNorm block size")
    parser.add_argument("--workers", type=int, default=2, help="variants trained in parallel, one core each")
    parser.add_argument("--output-dir", default="outputs/mods_quality")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.eval_batches < 1 or args.workers < 1:
        parser.error("--steps, --batch-size, --eval-batches and --workers must be >= 1")

    runs = [
        RunSpec(m, label, preset, mod, args.seed + offset, args.steps, args.batch_size, args.eval_batches, args.lr,
                args.block_size)
        for m in args.models
        for label, preset, mod, offset in VARIANTS
    ]
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.workers) as pool:
        teacher_args = [(m, args.steps, args.batch_size, args.eval_batches) for m in args.models]
        teacher_jobs = pool.map_async(_teacher_ne, teacher_args)
        results = []
        for result in pool.imap_unordered(run_one, runs):
            results.append(result)
            print(f"  {result['model']:5s} {result['variant']:28s} eval NE {result['eval_ne']:.4f} "
                  f"({result['train_seconds']:.0f} s)", flush=True)
        teacher = dict(teacher_jobs.get())
    elapsed = time.perf_counter() - started
    table = markdown_table(results, teacher, args.models)
    command = "python scripts/mods_quality_report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    summary = (
        f"Final eval NE after {args.steps} steps of batch {args.batch_size} (Adam, lr {args.lr}, float32, CPU), "
        f"{args.eval_batches * args.batch_size} held-out samples; model seed {args.seed}, data seed 0; "
        f"block size {args.block_size}. Total {elapsed:.0f} s with {args.workers} worker(s).\n"
    )
    print("\n" + summary + "\n" + table)
    _write_atomic(os.path.join(args.output_dir, "report.md"), f"`{command.strip()}`\n\n{summary}\n{table}")
    _write_atomic(
        os.path.join(args.output_dir, "report.json"),
        json.dumps({"args": vars(args), "teacher_ne": teacher, "results": results, "seconds": elapsed}, indent=2),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
