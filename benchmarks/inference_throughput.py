"""Inference of a model's dense part: latency and throughput per batch size, bf16 against FP8.

The serving side of :mod:`loka_torchrec.inference`: the ``over_arch`` of a pooled-feature model of
the reference job (``--model``: DHEN with the Mods, the architecture LoKA's DHEN runs train; Wukong
or DCN-V2 as their users write them) at a preset's sizes (its recipe's tables), forward only under
``torch.inference_mode``, batches of random pooled embeddings, timed per call (CUDA events on a
GPU; median, p99 and rows per second over ``--reps`` calls after ``--warmup``), every run in this
one process:

* ``bf16``, ``bf16_compile``, ``bf16_compile_cudagraphs``: the model in bf16 (fp32 on a CPU), eager
  / ``torch.compile`` default / with CUDA graphs (``reduce-overhead``); every compiled run here
  compiles each batch size with static shapes;
* ``torchao_rowwise_compile``, ``torchao_tensorwise_compile``: torchao's float8 inference
  quantization (``Float8DynamicActivationFloat8WeightConfig``, per-row or per-tensor: dynamic
  activation scales, FP8 weights) on every ``nn.Linear``, compiled with CUDA graphs (CUDA only);
* ``loka_export``, ``loka_export_compile``, ``loka_export_compile_cudagraphs``: LoKA's plan
  (``--plan``, the ``dispatch_plan.json`` of a training run, pinned; or ``--mode``, a static mode)
  turned into the serving form by :func:`loka_torchrec.inference_modules`, eager / compiled; with
  ``--choose-at-batch``, one serving form per batch size, FP8 only where a layer's forward is faster
  at that batch (``serving_rows``);
* ``loka_export_static``, ``loka_export_static_compile_cudagraphs``: the same with static input
  scales (``input_scaling="static"``: each tensorwise FP8 layer scales its input by a fixed amax,
  so a compiled model reads the input once, not once for its amax and again for its cast). A
  trained run takes these amaxes from the Probe; this model is not trained, so they come from
  ``--calibration-batches`` batches drawn apart from the timed ones, the largest input amax each
  layer saw. A timed batch beyond them saturates, which its SQNR shows.

Each run's logits are compared with eager bf16's on the same batch (SQNR, dB): what FP8 changes in
the output. Writes ``<out>.json`` and ``<out>.md`` (device, versions, command, one table).

Example (one GPU)::

    python benchmarks/inference_throughput.py --preset xl --plan PLAN.json --batch-sizes 512,2048,8192 \\
        --out benchmarks/results/H100/inference-dhen-xl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from typing import Dict, List, Optional

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedTensor

import loka_torchrec
from loka_job.models.dcn_v2 import DcnV2Config, DcnV2OverArch
from loka_job.models.dhen import DhenConfig, DhenOverArch
from loka_job.models.wukong import WukongConfig, WukongOverArch
from loka_torchrec.atomic_files import write_text_atomic
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.fp8.error_metrics import sqnr_db
from loka_torchrec.gemm.measure import call_times_ms
from loka_torchrec.json_values import to_jsonable
from loka_torchrec.mods import ModsConfig, apply_mods

RUNS = (
    "bf16", "bf16_compile", "bf16_compile_cudagraphs", "torchao_rowwise_compile", "torchao_tensorwise_compile",
    "loka_export", "loka_export_compile", "loka_export_compile_cudagraphs", "loka_export_static",
    "loka_export_static_compile_cudagraphs",
)  # fmt: skip
CALIBRATION_SEED = 1_000_003  # the calibration batches' seeds start here; the timed batches' are their sizes
# model -> (its config class, its over arch, the Mods preset of the model served)
MODELS = {"dhen": (DhenConfig, DhenOverArch, "all"), "wukong": (WukongConfig, WukongOverArch, "none"),
          "dcnv2": (DcnV2Config, DcnV2OverArch, "none")}  # fmt: skip
PRESETS = ("small", "large", "xl")
NUM_DENSE = 13
RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


def pooled_tables(model: str, preset: str) -> int:
    """The pooled features of ``model``'s ``preset`` recipe (``recipes/model/<model>[_<preset>].yaml``,
    else the pooled data default), so that a plan trained with that recipe fits the layers built here."""
    import yaml

    name = model if preset == "small" else f"{model}_{preset}"
    with open(os.path.join(RECIPES, "data", "pooled.yaml")) as f:
        tables = yaml.safe_load(f)["num_tables"]
    with open(os.path.join(RECIPES, "model", f"{name}.yaml")) as f:
        return int((yaml.safe_load(f).get("data") or {}).get("num_tables", tables))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dhen", choices=tuple(MODELS))
    p.add_argument("--preset", default="xl", choices=PRESETS)
    p.add_argument("--batch-sizes", default="512,2048,8192", help="comma-separated rows per call")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--plan", help="a dispatch_plan.json of a training run (pinned) for the loka_export runs")
    p.add_argument("--mode", help="a static dispatch mode (e.g. all:scaled_mm:rowwise) for the loka_export runs instead")
    p.add_argument("--choose-at-batch", action="store_true",
                   help="the loka_export runs keep a layer in FP8 only where its forward is faster at each batch size "
                        "(inference_modules(serving_rows=batch): one serving model per batch size)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calibration-batches", type=int, default=8,
                   help="loka_export_static*: batches whose input amaxes set the static scales (default 8)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", required=True, help="output path without extension")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        p.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        p.error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes: at least one size, each >= 1")
    if args.calibration_batches < 1:
        p.error(f"--calibration-batches: expected >= 1, got {args.calibration_batches}")
    if any(r.startswith("loka_") for r in args.runs) and not (args.plan or args.mode):
        p.error("--runs loka_*: need --plan (a training run's dispatch_plan.json) or --mode")
    return args


class DensePart(nn.Module):
    """The model's ``over_arch`` under its own name, so that layer names match a training run's plan;
    ``(dense, pooled values)`` in, the ``KeyedTensor`` made inside (``torch.compile`` and export see tensors)."""

    def __init__(self, over_arch: nn.Module, features: List[str], dim: int) -> None:
        super().__init__()
        self.over_arch = over_arch
        self.features, self.dim = features, dim

    def forward(self, dense: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pooled = KeyedTensor(keys=self.features, length_per_key=[self.dim] * len(self.features), values=values)
        return self.over_arch(dense, pooled)


def build(model_name: str, preset: str, device: torch.device, dtype: torch.dtype) -> DensePart:
    config_class, over_arch, mods = MODELS[model_name]
    config = getattr(config_class, preset)()
    features = [f"f{i}" for i in range(pooled_tables(model_name, preset))]
    torch.manual_seed(0)
    model = DensePart(over_arch(features, NUM_DENSE, config, device), features, config.embedding_dim)
    apply_mods(model, ModsConfig(preset=mods))
    return model.to(dtype).eval()


def make(run: str, args, device: torch.device, dtype: torch.dtype, serving_rows: Optional[int] = None) -> nn.Module:
    """The model of ``run`` (LoKA's serving form chosen at ``serving_rows``, where given); raises
    ``RuntimeError`` with the reason where it cannot run here."""
    model = build(args.model, args.preset, device, dtype)
    if run.startswith("torchao"):
        if device.type != "cuda":
            raise RuntimeError("torchao's float8 inference needs a CUDA GPU")
        try:
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_
        except ImportError as exc:
            raise RuntimeError(f"torchao is not installed ({exc}): pip install torchao") from exc
        granularity = PerRow() if run.startswith("torchao_rowwise") else PerTensor()
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=granularity))
    if run.startswith("loka_"):
        dispatch = DispatchConfig(mode="pinned", plan_path=args.plan) if args.plan else DispatchConfig(mode=args.mode)
        loka_torchrec.apply(model, dispatch)
        static = run.startswith("loka_export_static")
        amaxes = calibrated_input_amaxes(model, args, device, dtype, rows=serving_rows or 512) if static else None
        report = loka_torchrec.inference_modules(
            model, serving_rows=serving_rows, input_scaling="static" if static else "dynamic", input_amaxes=amaxes,
        )  # fmt: skip
        print(f"[inference] {run}: {report.summary()}", flush=True)
        model.loka_report = report.summary()
        model.loka_timings = report.timings  # per layer at serving_rows: FP8 and high-precision forward ms
    # Static shapes for every compiled run: each batch size gets a graph of its own, as LoKA's forms
    # chosen per batch do (with Dynamo's automatic dynamic shapes the second size would run kernels
    # compiled for any size, a handicap only the baselines would carry).
    if run.endswith("_compile"):
        return torch.compile(model, mode="default", dynamic=False)
    if run.endswith("_compile_cudagraphs") or run.startswith("torchao"):
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    return model


def calibrated_input_amaxes(model: nn.Module, args, device: torch.device, dtype: torch.dtype, rows: int) -> Dict[str, List[float]]:
    """``{LoKA layer name: its input amax in each calibration batch}``: ``args.calibration_batches``
    batches of ``rows`` rows, seeded apart from the timed batches, through the converted model."""
    amaxes: Dict[str, List[float]] = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, a, name=name: amaxes.setdefault(name, []).append(float(a[0].detach().abs().amax())))
        for name, module in model.named_modules() if isinstance(module, loka_torchrec.LokaLinear)
    ]  # fmt: skip
    try:
        with torch.inference_mode():
            for i in range(args.calibration_batches):
                model(*inputs(args.model, args.preset, rows, device, dtype, seed=CALIBRATION_SEED + i))
    finally:
        for hook in hooks:
            hook.remove()
    return amaxes


def inputs(model_name: str, preset: str, batch: int, device: torch.device, dtype: torch.dtype, seed: Optional[int] = None):
    """A batch of ``batch`` rows: dense features and pooled embeddings (seeded by ``seed``, default the batch size)."""
    gen = torch.Generator(device=device).manual_seed(batch if seed is None else seed)
    dim = getattr(MODELS[model_name][0], preset)().embedding_dim
    values = torch.randn(batch, pooled_tables(model_name, preset) * dim, generator=gen, device=device, dtype=dtype)
    return torch.randn(batch, NUM_DENSE, generator=gen, device=device, dtype=dtype), values


def measure(model: nn.Module, batch_inputs, args, device) -> Dict[str, float]:
    with torch.inference_mode():
        times = sorted(call_times_ms(lambda: model(*batch_inputs), reps=args.reps, device=device, warmup=args.warmup))
    median = statistics.median(times)
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    return {"median_ms": median, "p99_ms": p99, "rows_per_s": batch_inputs[0].shape[0] / (median / 1e3)}


def _versions() -> Dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torchrec", "fbgemm_gpu", "torchao"):
        try:
            out[name] = md.version(name.replace("_", "-"))
        except md.PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reference = build(args.model, args.preset, device, dtype)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {platform.machine()}"
    meta = {"date": datetime.date.today().isoformat(), "device": device_name, "versions": _versions(),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "model": args.model, "preset": args.preset}  # fmt: skip
    rows: List[Dict[str, object]] = []
    for done, run in enumerate(args.runs):
        # The files are written before each run as well: a run cut short (a deadline) leaves the finished ones.
        write_results(args.out, {**meta, "unfinished": list(args.runs[done:])}, rows)
        per_batch = args.choose_at_batch and run.startswith("loka_")  # FP8 where faster at each batch size
        try:
            model = make(run, args, device, dtype, serving_rows=args.batch_sizes[0] if per_batch else None)
        except RuntimeError as exc:
            rows.append({"run": run, "status": "skipped", "reason": str(exc)})
            print(f"[inference] {run}: skipped: {exc}", flush=True)
            continue
        for i, batch in enumerate(args.batch_sizes):
            if per_batch and i:
                model = make(run, args, device, dtype, serving_rows=batch)
            batch_inputs = inputs(args.model, args.preset, batch, device, dtype)
            with torch.inference_mode():
                agreement = sqnr_db(model(*batch_inputs).double(), reference(*batch_inputs).double())
            row = {"run": run, "status": "ok", "batch": batch, "sqnr_vs_bf16_db": agreement, **measure(model, batch_inputs, args, device)}
            served = getattr(model, "_orig_mod", model)
            if getattr(served, "loka_report", None):
                row["fp8"] = served.loka_report
            if getattr(served, "loka_timings", None):
                row["serving_timings"] = served.loka_timings
            rows.append(row)
            print(f"[inference] {run} batch {batch}: {row['median_ms']:.3f} ms, {row['rows_per_s']:.0f} rows/s, "
                  f"{agreement:.1f} dB vs bf16", flush=True)  # fmt: skip
        del model
    write_results(args.out, {**meta, "unfinished": []}, rows)
    return 0


def write_results(out: str, meta: Dict[str, object], rows: List[Dict[str, object]]) -> None:
    """``<out>.json`` and ``<out>.md``, each replaced whole (atomic)."""
    write_text_atomic(f"{out}.json", json.dumps(to_jsonable({**meta, "rows": rows}), indent=1, allow_nan=False) + "\n")
    write_text_atomic(f"{out}.md", markdown(meta, rows))


def markdown(meta: Dict[str, object], rows: List[Dict[str, object]]) -> str:
    best = {}
    for r in rows:
        if r["status"] == "ok" and str(r["run"]).startswith("bf16"):
            best[r["batch"]] = min(best.get(r["batch"], float("inf")), r["median_ms"])
    lines = [
        f"# Inference of the `{meta.get('model', 'dhen')}` `{meta['preset']}` dense part, {meta['date']}", "",
        f"- device: {meta['device']}; versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
        f"- command: `{meta['command']}`",
        *([f"- not finished (the process ended first): {', '.join(meta['unfinished'])}"] if meta.get("unfinished") else []),
        "- per call, forward only (`torch.inference_mode`); speed-up: the fastest bf16 run's median at that batch over the run's;"
        " SQNR: the logits against eager bf16's on the same batch", "",
        "| run | batch | median ms | p99 ms | rows/s | vs fastest bf16 | SQNR vs bf16 dB | FP8 |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['run']} | | | | | | | skipped: {r['reason']} |")
            continue
        ratio = best[r["batch"]] / r["median_ms"] if r["batch"] in best else float("nan")
        lines.append(f"| {r['run']} | {r['batch']} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {r['rows_per_s']:.0f} "
                     f"| {ratio:.3f}x | {r['sqnr_vs_bf16_db']:.1f} | {r.get('fp8', '')} |")  # fmt: skip
    timed = [r for r in rows if r.get("serving_timings")]
    if timed:
        lines += ["", "## What `serving_rows` timed", "",
                  "Each FP8 layer's forward alone at the batch's rows, FP8 against high precision (ms; one line per layer shape):", "",
                  "| run | batch | layer (first of its shape) | FP8 ms | high precision ms |", "|---|---|---|---|---|"]  # fmt: skip
        for r in timed:
            seen = set()
            for layer, t in r["serving_timings"].items():
                key = (t["fp8_ms"], t["high_precision_ms"])
                if key not in seen:
                    seen.add(key)
                    lines.append(f"| {r['run']} | {r['batch']} | {layer} | {t['fp8_ms']:.4g} | {t['high_precision_ms']:.4g} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
