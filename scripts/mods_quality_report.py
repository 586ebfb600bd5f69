"""Quality report for the mods: is each model change neutral in high precision, before FP8 enters?

Trains the DHEN-style model (pooled synthetic click data) and the HSTU-style model (synthetic
user histories) as the baseline, with each mod alone, and with all mods, in float32 on the CPU,
for the same steps, seeds and data, and prints the final eval NE (normalized entropy: mean log
loss over the entropy of the eval base rate; lower is better) of each, with the teacher's NE
(the best reachable). Every variant is trained with ``--seeds`` model-initialization seeds (the
data is the same for all); the table gives the mean NE over seeds, its change against the
baseline's mean, and the baseline's seed-to-seed spread: how much NE moves for reasons that have
nothing to do with the mods. A mod's change counts as beyond seed noise when it exceeds twice
the seed standard deviation of one run (pooled over the baseline and the mod's row; with one
seed there is no spread and no verdict). ``fuse_siblings`` and ``pad_to_16`` preserve the model
function, so their rows must match the baseline up to float32 rounding.

Writes ``PREFIX.md`` (the command, then the table) and ``PREFIX.json`` (the command, arguments,
per-variant summary and every run), atomically, for ``--output PREFIX`` (default
``outputs/mods_quality/report``; ``--output-dir DIR`` means ``DIR/report``).

Example::

    python scripts/mods_quality_report.py --steps 300 --seeds 3 --workers 2 \
        --output benchmarks/results/cpu/2026-11-22-mods-quality
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from loka_torchrec.atomic_files import write_text_atomic

VARIANTS: Tuple[Tuple[str, str, Optional[str]], ...] = (
    # (row label, ModsConfig preset, the single mod for "custom")
    ("baseline", "none", None),
    ("no_bias", "custom", "no_bias"),
    ("block_norm", "custom", "block_norm"),
    ("hard_swish", "custom", "hard_swish"),
    ("fuse_siblings", "custom", "fuse_siblings"),
    ("pad_to_16", "custom", "pad_to_16"),
    ("all mods", "all", None),
)
NOISE_FACTOR = 2.0
"""A change of the mean beyond ``NOISE_FACTOR`` seed standard deviations is flagged (see :func:`aggregate`)."""
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
        from loka_job.training.synthetic import SyntheticConfig, SyntheticRecDataset, make_data_spec, teacher_ne

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
    from loka_job.training.synthetic_sequences import (
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
        from loka_job.models.dhen import DhenConfig, build_dhen

        return build_dhen(DhenConfig.small(), spec, cpu, embedding_device=cpu)
    from loka_job.models.hstu import HstuConfig, build_hstu

    return build_hstu(HstuConfig.small(), spec, cpu, embedding_device=cpu)


def _evaluate(net: torch.nn.Module, data) -> float:
    from loka_job.training.metrics import normalized_entropy

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
        "seed": spec.seed,
        "eval_ne": _evaluate(net, evaluation),
        "train_loss_last20": sum(last_losses) / len(last_losses),
        "train_seconds": seconds,
        "modules_touched": sum(len(r.modules) for r in report),
    }


def _teacher_ne(args: Tuple[str, int, int, int]) -> Tuple[str, float]:
    torch.set_num_threads(1)
    model, steps, batch_size, eval_batches = args
    return model, _datasets(model, steps, batch_size, eval_batches, 0)[3]()



def aggregate(results: List[Dict[str, Any]], models: List[str]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """``{model: {variant: {"mean", "sd", "per_seed", "delta_pct", "noise_pct", "beyond_noise", "worse_seeds"}}}``.

    ``delta_pct`` is the change of the mean NE against the baseline's mean, in percent;
    ``noise_pct`` is the seed-to-seed standard deviation of one run, pooled over the baseline and
    the variant (root of the mean of their two sample variances), in percent of the baseline's
    mean (on the baseline row: its own sd); ``beyond_noise`` says whether
    ``|delta_pct| > NOISE_FACTOR * noise_pct`` (``None`` with fewer than two seeds);
    ``worse_seeds`` counts the seeds whose NE is above the baseline's with the same seed (the
    paired view: same initialization, same data).
    """
    table: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for m in models:
        rows: Dict[str, Dict[str, Any]] = {}
        for label, *_ in VARIANTS:
            values = [r["eval_ne"] for r in sorted(results, key=lambda r: r["seed"]) if (r["model"], r["variant"]) == (m, label)]
            if values:
                rows[label] = {
                    "mean": statistics.fmean(values),
                    "sd": statistics.stdev(values) if len(values) > 1 else None,
                    "per_seed": values,
                }
        base = rows.get("baseline")
        if base and base["sd"] is not None:
            base["noise_pct"] = 100.0 * base["sd"] / base["mean"]
        for label, row in rows.items():
            if label == "baseline" or base is None:
                continue
            row["delta_pct"] = 100.0 * (row["mean"] - base["mean"]) / base["mean"]
            row["worse_seeds"] = sum(v > b for v, b in zip(row["per_seed"], base["per_seed"]))
            if base["sd"] is None or row["sd"] is None:
                row["noise_pct"], row["beyond_noise"] = None, None
            else:
                row["noise_pct"] = 100.0 * ((base["sd"] ** 2 + row["sd"] ** 2) / 2) ** 0.5 / base["mean"]
                row["beyond_noise"] = abs(row["delta_pct"]) > NOISE_FACTOR * row["noise_pct"]
        table[m] = rows
    return table


def markdown_table(results: List[Dict[str, Any]], teacher: Dict[str, float], models: List[str]) -> str:
    """One row per variant; per model: mean eval NE (± sd over seeds), change vs baseline, verdict."""
    table = aggregate(results, models)
    header = "| variant | " + " | ".join(
        f"{m.upper()} eval NE | vs baseline | worse on seeds | beyond seed noise?" for m in models
    ) + " |"
    rule = "|---|" + "---:|---:|:---:|:---:|" * len(models)
    lines = [header, rule]
    for label, *_ in VARIANTS:
        cells = []
        for m in models:
            row = table[m].get(label)
            if row is None:
                cells += ["", "", "", ""]
                continue
            ne = f"{row['mean']:.4f}" + (f" ± {row['sd']:.4f}" if row["sd"] is not None else "")
            if label == "baseline":
                noise = row.get("noise_pct")
                cells += [ne, "" if noise is None else f"(seed sd {noise:.2f}%)", "", ""]
            else:
                beyond = row.get("beyond_noise")
                verdict = "n/a" if beyond is None else "no" if not beyond else (
                    "**yes, worse**" if row["delta_pct"] > 0 else "yes, better")
                worse = f"{row['worse_seeds']}/{len(row['per_seed'])}"
                cells += [ne, f"{row['delta_pct']:+.2f}%", worse, verdict]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| teacher (best reachable) | " + " | ".join(f"{teacher[m]:.4f} | | | " for m in models) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out batches for the final NE")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate, all parameters")
    parser.add_argument("--seed", type=int, default=0, help="first model initialization seed")
    parser.add_argument("--seeds", type=int, default=3, help="initialization seeds per variant (seed, seed+1, ...)")
    parser.add_argument("--block-size", type=int, default=256, help="BlockNorm block size")
    parser.add_argument("--workers", type=int, default=2, help="variants trained in parallel, one core each")
    parser.add_argument("--output", default=None,
                        help="writes OUTPUT.md and OUTPUT.json (a trailing .md or .json is dropped); "
                             "default outputs/mods_quality/report")
    parser.add_argument("--output-dir", default=None, help="the older form: writes DIR/report.md and DIR/report.json")
    args = parser.parse_args(argv)
    if args.output and args.output_dir:
        parser.error("give --output or --output-dir, not both")
    if min(args.steps, args.batch_size, args.eval_batches, args.workers, args.seeds) < 1:
        parser.error("--steps, --batch-size, --eval-batches, --workers and --seeds must be >= 1")
    prefix = args.output or os.path.join(args.output_dir or os.path.join("outputs", "mods_quality"), "report")
    prefix = prefix[: -len(".md")] if prefix.endswith(".md") else prefix
    prefix = prefix[: -len(".json")] if prefix.endswith(".json") else prefix

    runs = [
        RunSpec(m, label, preset, mod, args.seed + offset, args.steps, args.batch_size, args.eval_batches, args.lr,
                args.block_size)
        for m in args.models
        for offset in range(args.seeds)
        for label, preset, mod in VARIANTS
    ]
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.workers) as pool:
        teacher_args = [(m, args.steps, args.batch_size, args.eval_batches) for m in args.models]
        teacher_jobs = pool.map_async(_teacher_ne, teacher_args)
        results = []
        for result in pool.imap_unordered(run_one, runs):
            results.append(result)
            print(f"  {result['model']:5s} {result['variant']:14s} seed {result['seed']:<3d} "
                  f"eval NE {result['eval_ne']:.4f} ({result['train_seconds']:.0f} s)", flush=True)
        teacher = dict(teacher_jobs.get())
    elapsed = time.perf_counter() - started
    table = markdown_table(results, teacher, args.models)
    command = shlex.join(["python", "scripts/mods_quality_report.py", *(argv if argv is not None else sys.argv[1:])])
    seeds = f"{args.seed}" if args.seeds == 1 else f"{args.seed}..{args.seed + args.seeds - 1}"
    summary = (
        f"Final eval NE after {args.steps} steps of batch {args.batch_size} (Adam, lr {args.lr}, float32, CPU), "
        f"{args.eval_batches * args.batch_size} held-out samples; model seeds {seeds} (mean ± sample sd over "
        f"them), data seed 0; block size {args.block_size}. A change is beyond seed noise when it exceeds "
        f"{NOISE_FACTOR:g}x the seed sd of one run (pooled over the baseline and the variant). Total {elapsed:.0f} s with {args.workers} worker(s).\n"
    )
    print("\n" + summary + "\n" + table)
    results.sort(key=lambda r: (r["model"], r["seed"], [v[0] for v in VARIANTS].index(r["variant"])))
    write_text_atomic(prefix + ".md", f"Produced by:\n\n    {command}\n\n{summary}\n{table}")
    write_text_atomic(
        prefix + ".json",
        json.dumps(
            {"command": command, "args": vars(args), "teacher_ne": teacher,
             "summary": aggregate(results, args.models), "results": results, "seconds": elapsed},
            indent=2,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
