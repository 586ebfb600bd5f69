"""Forward + backward of a DHEN model's dense part (everything after the embedding lookup), compiled.

The step that LoKA's FP8 GEMMs can speed up, without the embeddings, the input pipeline and the
optimizer around it: the ``over_arch`` of the DHEN-style model at a preset's sizes, batch rows of
random pooled embeddings, bf16 weights, one forward and one backward per step, timed with CUDA
events (median over ``--steps`` after ``--warmup``), every run in this one process:

* ``bf16_compile``, ``bf16_compile_cudagraphs``, ``bf16_compile_max_autotune``: the model with the
  Mods (``ModsConfig("all_but_no_bias")``, as ``e2e_compare.py``'s LoKA runs use them) in bf16,
  ``torch.compile`` default / ``reduce-overhead`` / ``max-autotune-no-cudagraphs`` (Inductor times
  its own GEMM templates and fused epilogues against cuBLAS at every shape);
* ``bf16_nomods_compile_cudagraphs``: the plain model in bf16, compiled with CUDA graphs;
* ``torchao_tensorwise_compile``, ``torchao_rowwise_compile``: torchao's float8 training with its
  size filter on the plain model, compiled with CUDA graphs;
* ``te``, ``te_tensorwise``: Transformer Engine's ``Linear`` on the plain model's aligned layers,
  in its FP8 autocast (``DelayedScaling``, ``Float8CurrentScaling``), eager (TE's modules do not
  trace whole); ``te_graphed``, ``te_tensorwise_graphed``: the same, the training step replayed as
  CUDA graphs captured by TE's ``make_graphed_callables`` (``loka_job.baselines.TeGraphedCall``);
  ``te_compile``: ``te`` under ``torch.compile`` (default mode; Dynamo breaks the graph around TE's
  modules and Inductor compiles what lies between);
* ``loka_compile``: the Mods model with a pinned LoKA plan (``--plan``, e.g. the plan a training
  run wrote) or a static mode (``--mode``), compiled with CUDA graphs; ``loka_compile_max_autotune``:
  the same with ``max-autotune-no-cudagraphs``;
* ``loka_speed_gate_compile``: the same plan's per-GEMM evidence decided by the accuracy and speed
  gates alone (each role the fastest candidate within ``max_mere`` that is ``min_speedup`` faster
  than bf16), without the layer check's verdicts: what the layer check turned down, timed in the
  compiled step;
* ``loka_tensorwise_compile``: as ``loka_speed_gate_compile``, with ``scaled_mm:tensorwise`` for
  every role where that candidate itself passes both gates (one quantization of each operand
  serves every role that reads it).
* ``loka_fast_accum_compile``, ``loka_fast_accum_fwd_compile``: ``--plan`` as it is, with each FP8
  GEMM (or each FP8 forward GEMM) on its recipe's ``_fast_accum`` twin: the speed that fast
  accumulation would add to that plan, whatever its accuracy (a training run measures that).
* ``loka_current_compile``: ``--plan`` with ``forward_scaling="current"``: every FP8 operand
  scaled by its own amax, where every other ``loka_`` run takes the library's default
  (``"delayed"``: the forward's tensorwise input and weight operands scaled by the amax history,
  so their casts need no amax pass first; the warm-up's first step records the history, the next
  one compiles once more); ``loka_delayed_compile`` names the delayed one explicitly.
* ``loka_saved_weight_compile``, ``loka_delayed_saved_weight_compile``,
  ``bf16_compile_cudagraphs_saved_weight``: ``loka_compile``, ``loka_delayed_compile`` and
  ``bf16_compile_cudagraphs`` with parameters not free to save for AOTAutograd's partitioner
  (``torch._functorch.config.treat_parameters_as_free_to_save=False``): the backward then reads
  the forward's FP8 ``W^T`` instead of casting the bf16 weight again.
* ``loka_whole_amax_compile``: ``--plan`` with every tensorwise amax one reduction over the whole
  operand instead of in chunks of a row (``loka_torchrec.fp8.scaling.tensor_amax``): what the
  chunked order is worth, in one process; ``loka_delayed_whole_amax_compile``,
  ``loka_delayed_row_amax_compile``: ``loka_delayed_compile`` with the whole-operand and the
  row-first order (which fuse differently with a cast that no longer waits for the amax).

Each run is also profiled over a few steps: the device time per step by kernel category (bf16
GEMMs, FP8 GEMMs, FP8 quantization, other) and its largest kernels, to show where its time goes.

Writes ``<out>.json`` and ``<out>.md`` (device, versions, command, the table with ratios to the
fastest bf16 compile mode that ran). Example (one GPU)::

    python benchmarks/dense_part_step.py --preset xl --plan PLAN.json --out results/dense-part-dhen-xl
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
from typing import Callable, Dict, Optional

import torch
import torch._functorch.config
from torch import nn

from torchrec.sparse.jagged_tensor import KeyedTensor

import loka_torchrec
from loka_job.models.dhen import DhenConfig, DhenOverArch
from loka_job.training.profiling import StepProfiler
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch.plan import DispatchPlan, RoleDecision
from loka_torchrec.evidence import BF16, KernelChoice
from loka_torchrec.gemm.backends import get_backend
from loka_torchrec.gemm.recipes import FAST_ACCUM_SUFFIX
from loka_torchrec.gemm.measure import call_times_ms
from loka_torchrec.fp8 import scaling
from loka_torchrec.mods import ModsConfig, apply_mods

RUNS = ("bf16_compile", "bf16_compile_cudagraphs", "bf16_compile_max_autotune", "bf16_nomods_compile_cudagraphs",
        "torchao_tensorwise_compile", "torchao_rowwise_compile", "loka_compile", "loka_compile_max_autotune",
        "loka_speed_gate_compile", "loka_tensorwise_compile", "loka_fast_accum_compile",
        "loka_fast_accum_fwd_compile", "loka_whole_amax_compile", "loka_current_compile", "loka_delayed_compile", "loka_saved_weight_compile",
        "loka_delayed_saved_weight_compile", "bf16_compile_cudagraphs_saved_weight",
        "loka_delayed_whole_amax_compile", "loka_delayed_row_amax_compile",
        "te", "te_graphed", "te_tensorwise", "te_tensorwise_graphed", "te_compile")  # fmt: skip
BF16_REFERENCES = ("bf16_compile", "bf16_compile_cudagraphs", "bf16_compile_max_autotune", "bf16_compile_cudagraphs_saved_weight")
"""The bf16 compile modes; the fastest that ran is every ratio's reference."""
PLAN_VARIANTS = {"loka_speed_gate_compile": None, "loka_tensorwise_compile": "scaled_mm:tensorwise"}
"""Runs whose plan is re-decided from ``--plan``'s evidence by the gates alone, with the one
candidate they are restricted to (``None``: the fastest that passes)."""
FAST_ACCUM_VARIANTS = {"loka_fast_accum_compile": ("fwd", "dgrad", "wgrad"), "loka_fast_accum_fwd_compile": ("fwd",)}
"""Runs whose plan is ``--plan`` with these roles' FP8 GEMMs on their ``_fast_accum`` twins."""
AMAX_ORDER_RUNS = {"loka_whole_amax_compile": "whole", "loka_delayed_whole_amax_compile": "whole",
                   "loka_delayed_row_amax_compile": "rows"}  # fmt: skip
DEFAULT_AMAX_ORDER = scaling._AMAX_ORDER
FORWARD_SCALING_RUNS = {"loka_current_compile": "current", "loka_delayed_compile": "delayed", "loka_delayed_saved_weight_compile": "delayed",
                        "loka_delayed_whole_amax_compile": "delayed", "loka_delayed_row_amax_compile": "delayed"}  # fmt: skip
"""Runs that name their forward scaling; every other run takes ``DispatchConfig``'s default."""
TE_RUNS = {"te": ("delayed", False), "te_graphed": ("delayed", True), "te_tensorwise": ("tensorwise", False),
           "te_tensorwise_graphed": ("tensorwise", True), "te_compile": ("delayed", False)}  # fmt: skip
"""Transformer Engine runs: (recipe, replayed as CUDA graphs by TE's ``make_graphed_callables``)."""
SAVED_WEIGHT_RUNS = ("loka_saved_weight_compile", "loka_delayed_saved_weight_compile", "bf16_compile_cudagraphs_saved_weight")
"""Runs compiled with parameters not free to save (``torch._functorch.config.treat_parameters_as_free_to_save``
off): the partitioner then keeps what the forward computed from a weight (the FP8 ``W^T``) for the
backward instead of recomputing it there from the saved weight."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="xl", choices=("large", "xl"))
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--plan", help="a dispatch_plan.json for loka_compile (pinned mode)")
    p.add_argument("--mode", default=None, help="a static dispatch mode for loka_compile instead of --plan")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per run after timing (0: none)")
    p.add_argument("--top-kernels", type=int, default=40, help="kernel names listed per profiled run")
    p.add_argument("--out", required=True, help="output path without extension")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        p.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    for run in args.runs:
        if run.startswith("loka_") and run not in PLAN_VARIANTS and not (args.plan or args.mode):
            p.error(f"--runs {run}: needs --plan (a dispatch_plan.json) or --mode (e.g. all:scaled_mm:rowwise)")
    if any(r in PLAN_VARIANTS for r in args.runs) and not args.plan:
        p.error(f"--runs {', '.join(PLAN_VARIANTS)}: need --plan (a dispatch_plan.json with its evidence)")
    return args


class DensePart(nn.Module):
    """The model's ``over_arch`` under its own name, so that layer names match a training run's plan."""

    def __init__(self, over_arch: nn.Module) -> None:
        super().__init__()
        self.over_arch = over_arch

    def forward(self, dense, pooled):
        return self.over_arch(dense, pooled)


class TeDensePart(nn.Module):
    """A dense part converted to Transformer Engine, each forward in the baseline's FP8 autocast."""

    def __init__(self, model: nn.Module, report) -> None:
        super().__init__()
        self.model = model
        self.report = report

    def forward(self, dense, pooled):
        with self.report.forward_context():
            return self.model(dense, pooled)


def build(preset: str, device: torch.device, mods: bool) -> DensePart:
    config = getattr(DhenConfig, preset)()
    features = [f"f{i}" for i in range({"large": 7, "xl": 63}[preset])]
    torch.manual_seed(0)
    model = DensePart(DhenOverArch(features, 13, config, device))
    if mods:
        apply_mods(model, ModsConfig(preset="all_but_no_bias"))
    return model


def inputs(preset: str, batch: int, device: torch.device):
    n = {"large": 7, "xl": 63}[preset]
    gen = torch.Generator(device=device).manual_seed(1)
    values = torch.randn(batch, n * 256, generator=gen, device=device, dtype=torch.bfloat16)
    pooled = KeyedTensor(keys=[f"f{i}" for i in range(n)], length_per_key=[256] * n, values=values)
    dense = torch.randn(batch, 13, generator=gen, device=device, dtype=torch.bfloat16)
    return dense, pooled


def gates_only_plan(plan: DispatchPlan, only: Optional[str]) -> DispatchPlan:
    """``plan`` re-decided from its own evidence by the accuracy and speed gates alone.

    Each role gets the fastest candidate whose error's upper bound is within ``max_mere`` and
    whose time is ``min_speedup`` below bf16's (medians), restricted to the candidate ``only``
    when given; a role with none stays bf16. The layer check's verdicts are not applied.
    """
    max_mere, min_speedup = plan.gates["max_mere"], plan.gates["min_speedup"]
    layers = {}
    for name, layer in plan.layers.items():
        roles = {}
        for role, decision in layer.roles.items():
            passing = [
                e for e in decision.considered
                if e.error is not None and e.time_ms is not None and e.baseline_time_ms is not None
                and e.error.high <= max_mere and e.baseline_time_ms.value >= min_speedup * e.time_ms.value
                and (only is None or str(e.candidate) == only)
            ]  # fmt: skip
            best = min(passing, key=lambda e: e.time_ms.value, default=None)
            if best is None:
                roles[role] = RoleDecision(BF16, "no candidate passes the gates", "benchmark", None, decision.considered)
            else:
                speedup = best.baseline_time_ms.value / best.time_ms.value
                roles[role] = RoleDecision(KernelChoice.parse(str(best.candidate)), f"gates only: {speedup:.2f}x",
                                           "benchmark", best, decision.considered)  # fmt: skip
        layers[name] = dataclasses.replace(layer, roles=roles)
    return dataclasses.replace(plan, layers=layers, mode="pinned")


def fast_accum_plan(plan: DispatchPlan, roles) -> DispatchPlan:
    """``plan`` with every FP8 GEMM of ``roles`` on its recipe's ``_fast_accum`` twin, where its
    backend has one (the decision's evidence and reason are kept, prefixed)."""
    layers = {}
    for name, layer in plan.layers.items():
        decisions = dict(layer.roles)
        for role, decision in layer.roles.items():
            choice = decision.choice
            twin = f"{choice.recipe}{FAST_ACCUM_SUFFIX}"
            if role.value in roles and not choice.is_high_precision and twin in get_backend(choice.backend).recipes:
                decisions[role] = dataclasses.replace(decision, choice=KernelChoice(choice.backend, twin),
                                                      reason="fast accumulation: " + decision.reason)  # fmt: skip
        layers[name] = dataclasses.replace(layer, roles=decisions)
    return dataclasses.replace(plan, layers=layers, mode="pinned")


def make(run: str, args, device) -> nn.Module:
    mods = run.startswith("bf16_compile") or run.startswith("loka_")
    model = build(args.preset, device, mods=mods).to(torch.bfloat16)
    if run in TE_RUNS:  # TE: optional, imported when asked; eager, as TE's CUDA graphs, or compiled around its modules
        from loka_job.baselines import BaselineConfig, apply_baseline

        recipe, graphs = TE_RUNS[run]
        te_model = TeDensePart(model, apply_baseline(model, BaselineConfig(kind="te", recipe=recipe, cuda_graphs=graphs)))
        return torch.compile(te_model, mode="default") if run.endswith("_compile") else te_model
    if run.startswith("torchao"):
        from loka_job.baselines import BaselineConfig, apply_baseline  # torchao: optional, imported when asked

        apply_baseline(model, BaselineConfig(kind="torchao", recipe=run.split("_")[1], auto_filter=True))
    if run.startswith("loka_"):
        plan_path = args.plan
        if run in PLAN_VARIANTS:
            plan_path = f"{args.out}-{run}-plan.json"
            gates_only_plan(DispatchPlan.load(args.plan), PLAN_VARIANTS[run]).save(plan_path)
        elif run in FAST_ACCUM_VARIANTS:
            plan_path = f"{args.out}-{run}-plan.json"
            fast_accum_plan(DispatchPlan.load(args.plan), FAST_ACCUM_VARIANTS[run]).save(plan_path)
        dispatch = DispatchConfig(mode="pinned", plan_path=plan_path) if plan_path else DispatchConfig(mode=args.mode)
        scaling_mode = FORWARD_SCALING_RUNS.get(run, DispatchConfig().forward_scaling)
        report = loka_torchrec.apply(model, dataclasses.replace(dispatch, compiled=True, forward_scaling=scaling_mode))
        print(f"[dense] {run}: {report.dispatcher.plan.counts()}", flush=True)
    if run.endswith("_max_autotune"):
        mode = "max-autotune-no-cudagraphs"
    else:
        mode = "default" if run == "bf16_compile" else "reduce-overhead"
    return torch.compile(model, mode=mode, fullgraph=not run.startswith("torchao"))


def profile_steps(step: Callable[[], None], steps: int, out_dir: str, top: int = 40) -> Dict[str, float]:
    """Device ms per step by kernel category over ``steps`` profiled steps (the job's categories),
    and the ``top`` kernels with the most time."""
    profiler = StepProfiler(1, steps, device=torch.device("cuda"), out_dir=out_dir, top=top)
    for i in range(1, steps + 1):
        profiler.before_step(i)
        step()
        profiler.after_step(i)
    report = profiler.finish()
    per_step = {c: v["ms_per_step"] for c, v in report["categories"].items()}
    top = [{"name": k["name"], "category": k["category"], "ms_per_step": k["ms"] / steps, "calls_per_step": k["calls"] / steps}
           for k in report["top_kernels"]]  # fmt: skip
    return {"kernel_ms": report["kernel_ms_per_step"], **per_step, "top_kernels": top}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("dense_part_step.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dense, pooled = inputs(args.preset, args.batch, device)
    results: Dict[str, Dict] = {}
    for run in args.runs:
        try:
            # Each run compiles from scratch: the runs share the models' code objects, and their
            # graphs would otherwise count against one recompile limit (fullgraph=True fails past it).
            torch._dynamo.reset()
            scaling._AMAX_ORDER = AMAX_ORDER_RUNS.get(run, DEFAULT_AMAX_ORDER)  # read while compiling
            torch._functorch.config.treat_parameters_as_free_to_save = run not in SAVED_WEIGHT_RUNS
            model = make(run, args, device)
            params = list(model.parameters())

            def step() -> None:
                for p in params:  # as an optimizer's zero_grad: CUDA-graph outputs are not accumulated into
                    p.grad = None
                torch.compiler.cudagraph_mark_step_begin()
                model(dense, pooled).float().sum().backward()

            times = call_times_ms(step, reps=args.steps, device=device, warmup=args.warmup)
            results[run] = {"status": "ok", "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
            if args.profile_steps:
                results[run]["profile"] = profile_steps(step, args.profile_steps, f"{args.out}-profiles/{run}", args.top_kernels)
        except Exception as exc:  # noqa: BLE001 - one failing run is recorded, the others still run
            results[run] = {"status": "failed", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
        print(f"[dense] {run}: {results[run]}", flush=True)
        model = None
        torch.cuda.empty_cache()
    ok = {r: v["median_ms"] for r, v in results.items() if v["status"] == "ok"}
    ref_name = min((r for r in BF16_REFERENCES if r in ok), key=ok.get, default=None)
    meta = {
        "device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "command": "python benchmarks/dense_part_step.py " + " ".join(argv or sys.argv[1:]),
        "preset": args.preset, "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "reference": ref_name,
    }  # fmt: skip
    try:
        import torchao

        meta["torchao"] = torchao.__version__
    except ImportError:
        meta["torchao"] = None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "runs": results}, f, indent=2)
    lines = [f"# DHEN {args.preset} dense part, forward + backward, compiled", ""]
    lines += [f"- {k}: `{v}`" for k, v in meta.items()]
    lines += ["", f"| run | ms per step (median) [min, max] | vs {ref_name} | device ms: bf16 GEMM | FP8 GEMM | "
              "FP8 quantize | other | all |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run, v in results.items():
        if v["status"] != "ok":
            lines.append(f"| {run} | {v['status']}: {v['error']} | | | | | | |")
            continue
        ratio = f"{ok[ref_name] / v['median_ms']:.3f}x" if ref_name else "n/a"
        prof = v.get("profile")
        if prof:
            rest = prof["kernel_ms"] - prof["gemm_bf16"] - prof["gemm_fp8"] - prof["fp8_quantize"]
            cols = f"{prof['gemm_bf16']:.2f} | {prof['gemm_fp8']:.2f} | {prof['fp8_quantize']:.2f} | {rest:.2f} | {prof['kernel_ms']:.2f}"
        else:
            cols = "| | | |"
        lines.append(f"| {run} | {v['median_ms']:.2f} [{v['min_ms']:.2f}, {v['max_ms']:.2f}] | {ratio} | {cols} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
