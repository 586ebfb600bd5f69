"""GEMM benchmark: FP8 backends against bf16 at LRM shapes, per GEMM role and per ``LokaLinear`` step.

Three sections, each a table in the markdown report and a list of records in the JSON:

* **gemm** -- for every shape ``(M, K, N)`` of a linear layer (``M`` rows, ``K`` in, ``N`` out) and
  every role (``fwd`` ``x W^T``, ``dgrad`` ``dy W``, ``wgrad`` ``dy^T x``, operands laid out as
  ``LokaLinear`` passes them): the time of each available backend and recipe *with quantization*
  (the weight quantized once outside the timed region, activations and gradients inside it), the
  GEMM alone on pre-quantized operands, the speedup of both over ``torch.mm`` in bf16, and the
  relative Frobenius error against an fp32 product. ``pick`` is the fastest candidate at least
  1.05x faster than bf16, else bf16 (the Dispatch rule on time alone, accuracy not considered).
* **linear** -- ``LokaLinear`` forward + backward (``torch.autograd.grad`` of input and weight) per
  backend and recipe, and with the per-role picks, against ``nn.Linear`` in bf16. The weight is
  touched in place before every step so each step quantizes it once, as training does. Skipped
  when ``loka_torchrec.dispatch.linear`` is not there.
* **kernels** -- the fused quantization kernels (``loka_torchrec.kernels``) against a
  device-to-device copy of the input and against the same quantization as eager torch ops.

Times are medians of ``triton.testing.do_bench`` (L2 flushed between runs) with the 20th and
80th percentiles as spread; CUDA events where Triton is missing, ``perf_counter`` on the CPU.

Usage::

    python benchmarks/gemm_bench.py --out results/ [--shapes lrm|recipes|all|MxKxN,...]
        [--sections gemm,linear,kernels] [--max-seconds 170] [--device cuda]

Writes ``<out>/<date>-<name>.json`` and ``.md`` with the device, date, versions and command. A
time budget (``--max-seconds``) stops before the next shape once spent; what was not measured is
listed as skipped. ``--device cpu`` runs the CPU backends on small shapes (a smoke test).
"""

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from loka_torchrec.gemm.backends import backend_names, get_backend
from loka_torchrec.gemm.recipes import recipe_for
from loka_torchrec.evidence import GemmRole, GemmShape, KernelChoice
from loka_torchrec.fp8 import relative_frobenius
from loka_torchrec.atomic_files import write_text_atomic

for _module in ("fbgemm", "transformer_engine", "triton"):  # registers the GPU backends (they import lazily)
    importlib.import_module(f"loka_torchrec.gemm.backends.{_module}")

# measurements.md section 1: (M, K, N) of y = x W^T with x (M, K), W (N, K).
LRM_SHAPES = [
    (2048, 256, 256), (2048, 512, 512), (2048, 1024, 1024), (2048, 2048, 2048), (2048, 4096, 4096),
    (2048, 512, 2048), (2048, 2048, 512),
    (8192, 256, 256), (8192, 512, 512), (8192, 1024, 1024), (8192, 2048, 2048), (8192, 4096, 4096),
    (8192, 512, 2048), (8192, 2048, 512),
    (32768, 256, 256), (32768, 512, 512), (32768, 1024, 1024), (32768, 2048, 2048), (32768, 4096, 4096),
    (32768, 512, 2048), (32768, 2048, 512),
]  # fmt: skip
# The dense layers of the GPU DLRM of measurements.md section 3 (batch 8192 per rank).
RECIPE_SHAPES = [(8192, 512, 256), (8192, 256, 128), (8192, 1024, 1024), (8192, 1024, 512)]
# The speed targets (>= 1.5x and >= 1.7x fwd+bwd over bf16): measured first.
TARGET_SHAPES = [(8192, 2048, 2048), (32768, 4096, 4096)]
ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)
PICK_MIN_SPEEDUP = 1.05
# Recipes that are a backend's name for one of recipe_for's granularities.
RECIPE_ALIASES = {"triton_rowwise": "rowwise"}


# ------------------------------------------------------------------------------------ timing


@dataclasses.dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float

    def to_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, *, warmup_ms: int = 10, rep_ms: int = 50) -> Timing:
    """Median and 20th/80th percentile run time of ``fn`` in ms."""
    fn()  # first call: compilation, autotuning, lazy initialization
    _sync(device)
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            med, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
            return Timing(med, p20, p80)
        except ImportError:
            pass
    times: List[float] = []
    deadline = time.perf_counter() + (warmup_ms + rep_ms) / 1e3
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 1000):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=5)
    return Timing(statistics.median(times), q[0], q[3])


def graph_time_ms(fn: Callable[[], Any], device: torch.device, *, rep_ms: int = 50) -> Optional[Timing]:
    """GPU time of ``fn`` replayed from a CUDA graph (no launch overhead), or ``None`` where that fails."""
    if device.type != "cuda":
        return None
    try:
        from triton.testing import do_bench_cudagraph

        med, p20, p80 = do_bench_cudagraph(fn, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return Timing(med, p20, p80)
    except Exception:  # capture can fail (e.g. a host sync); the eager time still stands
        return None


# ------------------------------------------------------------------------------------ candidates


def recipe_named(name: str, role: GemmRole, *, fast_accum: bool = False):
    base = RECIPE_ALIASES.get(name, name)
    recipe = recipe_for(base, role, fast_accum=fast_accum)
    return recipe if base == name else dataclasses.replace(recipe, name=name)


def candidates(device: torch.device, only: Optional[Sequence[str]]) -> Tuple[List[KernelChoice], Dict[str, str]]:
    """Every FP8 (backend, recipe) available on ``device``, and why the others are not."""
    found, skipped = [], {}
    for name in backend_names():
        if name in ("bf16", "emulated") or (only and name not in only):
            continue  # bf16 is the baseline; emulated is a reference, never fast
        backend = get_backend(name)
        available = backend.availability(device)
        if not available.ok:
            skipped[name] = available.reason
            continue
        found.extend(KernelChoice(name, recipe) for recipe in backend.recipes)
    return found, skipped


def role_operands(role: GemmRole, x, w, dy):
    """``(A, B)`` of ``C = A @ B^T`` for ``role``, as views of the layer's tensors (as LokaLinear passes them)."""
    return {GemmRole.FORWARD: (x, w), GemmRole.GRAD_INPUT: (dy, w.t()), GemmRole.GRAD_WEIGHT: (dy.t(), x.t())}[role]


# ------------------------------------------------------------------------------------ sections


def bench_gemm(shape, cands, device, dtype, timing, fast_accum=False) -> Tuple[List[Dict[str, Any]], Dict[str, KernelChoice]]:
    m, k, n = shape
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / math.sqrt(k)
    dy = torch.randn(m, n, device=device, dtype=dtype) * 1e-3
    rows, picks = [], {}
    for role in ROLES:
        a, b = role_operands(role, x, w, dy)
        gshape = GemmShape(a.shape[0], a.shape[1], b.shape[0])
        ref = a.float() @ b.float().t()
        base = time_ms(lambda: torch.mm(a, b.t()), device, **timing)
        best = (KernelChoice("bf16", "hp"), 1.0)
        for choice in cands:
            backend = get_backend(choice.backend)
            recipe = recipe_named(choice.recipe, role, fast_accum=fast_accum)
            record = dict(section="gemm", m=m, k=k, n=n, role=role.value, gemm=str(gshape), kernel=str(choice),
                          bf16=base.to_dict())  # fmt: skip
            reason = backend.check(recipe, gshape, device)
            if reason is not None:
                rows.append(dict(record, skipped=reason))
                continue
            try:
                weight_role = role != GemmRole.GRAD_WEIGHT
                bq = backend.quantize(b, recipe.b, name="B")  # the weight: once per step, not timed
                aq = backend.quantize(a, recipe.a, name="A")
                out = backend.mm(aq, bq, recipe, dtype)
                error = relative_frobenius(out, ref)
                if weight_role:
                    full = time_ms(lambda: backend.mm(backend.quantize(a, recipe.a), bq, recipe, dtype), device, **timing)
                else:  # both operands are activations/gradients: both quantizations count
                    full = time_ms(
                        lambda: backend.mm(backend.quantize(a, recipe.a), backend.quantize(b, recipe.b), recipe, dtype),
                        device, **timing,
                    )  # fmt: skip
                gemm_only = time_ms(lambda: backend.mm(aq, bq, recipe, dtype), device, **timing)
            except Exception as exc:  # a failing kernel is a result too
                rows.append(dict(record, error_message=f"{type(exc).__name__}: {exc}"[:500]))
                continue
            speedup = base.median_ms / full.median_ms
            rows.append(dict(record, time=full.to_dict(), gemm_only=gemm_only.to_dict(), speedup=speedup,
                             speedup_gemm_only=base.median_ms / gemm_only.median_ms, rel_frobenius=error))  # fmt: skip
            if speedup >= PICK_MIN_SPEEDUP and speedup > best[1]:
                best = (choice, speedup)
        picks[role.value] = best[0]
        rows.append(dict(section="gemm", m=m, k=k, n=n, role=role.value, gemm=str(gshape), kernel="pick",
                         pick=str(best[0]), speedup=best[1], bf16=base.to_dict()))  # fmt: skip
    return rows, picks


def bench_linear(shape, cands, picks, device, dtype, timing) -> List[Dict[str, Any]]:
    try:
        from loka_torchrec.dispatch.layer_kernels import LayerKernels
        from loka_torchrec.dispatch.linear import LokaLinear
    except ImportError as exc:
        return [dict(section="linear", m=shape[0], k=shape[1], n=shape[2], skipped=f"LokaLinear unavailable: {exc}")]
    m, k, n = shape
    linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype) * 1e-3

    def step(layer):
        def run():
            with torch.no_grad():
                layer.weight.mul_(1.0)  # a new weight version: quantized once per step, as in training
            return torch.autograd.grad(layer(x), (x, layer.weight), dy)

        return run

    base = time_ms(step(linear), device, **timing)
    plans = [(str(c), LayerKernels.uniform(c)) for c in cands]
    if picks:
        plans.append(("pick", LayerKernels(fwd=picks["fwd"], dgrad=picks["dgrad"], wgrad=picks["wgrad"])))
    rows = []
    for label, kernels in plans:
        record = dict(section="linear", m=m, k=k, n=n, kernel=label, kernels=kernels.to_dict(), bf16=base.to_dict())
        try:
            layer = LokaLinear.from_linear(linear, kernels=kernels)
            step(layer)()
            fallbacks = {r.value if hasattr(r, "value") else str(r): v for r, v in layer.fallback_reasons.items()}
            t = time_ms(step(layer), device, **timing)
        except Exception as exc:
            rows.append(dict(record, error_message=f"{type(exc).__name__}: {exc}"[:500]))
            continue
        rows.append(dict(record, time=t.to_dict(), speedup=base.median_ms / t.median_ms, fallbacks=fallbacks))
    return rows


def bench_kernels(device, timing) -> List[Dict[str, Any]]:
    from loka_torchrec.fp8 import quantize
    from loka_torchrec.kernels.blocknorm_hardswish_quantize import (
        blocknorm_hardswish_quantize,
        blocknorm_hardswish_quantize_reference,
    )
    from loka_torchrec.kernels.fp8_quantize import fp8_quantize, fp8_quantize_with_transpose

    rows = []
    for m, k in [(8192, 1024), (32768, 512), (32768, 4096)]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        buffer = torch.empty_like(x)
        copy = time_ms(lambda: buffer.copy_(x), device, **timing)
        copy_graph = graph_time_ms(lambda: buffer.copy_(x), device, rep_ms=timing["rep_ms"])
        cases = []
        for gran in ("rowwise", "tensorwise", "blockwise"):
            cases.append((f"fp8_quantize {gran}", 3, lambda g=gran: fp8_quantize(x, "e4m3", g)))
            cases.append((f"fp8_quantize {gran} + transpose", 4, lambda g=gran: fp8_quantize_with_transpose(x, "e4m3", g)))
            cases.append((f"eager torch quantize {gran}", 3, lambda g=gran: quantize(x, "e4m3", g, nonfinite="propagate")))
        cases.append(("blocknorm+hardswish+quantize", 3, lambda: blocknorm_hardswish_quantize(x)))
        cases.append(("blocknorm+hardswish+quantize (+bf16 out)", 5, lambda: blocknorm_hardswish_quantize(x, return_hp=True)))
        cases.append(("eager torch blocknorm+hardswish+quantize", 3, lambda: blocknorm_hardswish_quantize_reference(x)))
        for label, bytes_per_elem, fn in cases:
            try:
                t = time_ms(fn, device, **timing)
            except Exception as exc:
                rows.append(dict(section="kernels", kernel=label, m=m, k=k, error_message=f"{type(exc).__name__}: {exc}"[:500]))
                continue
            graph = graph_time_ms(fn, device, rep_ms=timing["rep_ms"])
            record = dict(section="kernels", kernel=label, m=m, k=k, time=t.to_dict(), copy=copy.to_dict(),
                          vs_copy=t.median_ms / copy.median_ms,
                          gb_per_s=bytes_per_elem * m * k / (t.median_ms * 1e6))  # fmt: skip
            if graph is not None and copy_graph is not None:  # GPU time alone, launch overhead removed
                record.update(graph_time=graph.to_dict(), graph_copy=copy_graph.to_dict(),
                              graph_vs_copy=graph.median_ms / copy_graph.median_ms,
                              graph_gb_per_s=bytes_per_elem * m * k / (graph.median_ms * 1e6))  # fmt: skip
            rows.append(record)
    return rows


# ------------------------------------------------------------------------------------ report


def _fmt_speedup(row) -> str:
    if "skipped" in row:
        return "n/a"
    if "error_message" in row:
        return "error"
    return f"{row['speedup']:.2f} ({row['speedup_gemm_only']:.2f})"


def markdown(meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> str:
    out = [
        f"# GEMM benchmark: {meta['device']}",
        "",
        f"Date {meta['date']}; torch {meta['versions'].get('torch')}, triton {meta['versions'].get('triton')}; "
        f"command `{meta['command']}`.",
        "",
    ]
    if meta.get("unavailable"):
        out += ["Unavailable backends: " + "; ".join(f"`{k}`: {v}" for k, v in meta["unavailable"].items()), ""]
    gemm = [r for r in rows if r["section"] == "gemm"]
    if gemm:
        kernels = sorted({r["kernel"] for r in gemm if r["kernel"] != "pick"})
        out += [
            "## Per GEMM role, quantization included",
            "",
            "Speedup over bf16 `torch.mm` with quantization (GEMM alone in parentheses); the weight is "
            "quantized once outside the timing, activations and gradients inside it. `pick`: fastest at "
            f">= {PICK_MIN_SPEEDUP}x, else bf16. Accumulation: "
            + ("fast (no promotion)." if meta.get("fast_accum") else "with promotion to fp32 (the recipes' default)."),
            "",
            "| M | K | N | role | bf16 ms | " + " | ".join(kernels) + " | pick |",
            "|" + "---|" * (6 + len(kernels)),
        ]
        keys = sorted({(r["m"], r["k"], r["n"], r["role"]) for r in gemm}, key=lambda t: (t[0], t[1], t[2], ["fwd", "dgrad", "wgrad"].index(t[3])))
        for m, k, n, role in keys:
            cell = {r["kernel"]: r for r in gemm if (r["m"], r["k"], r["n"], r["role"]) == (m, k, n, role)}
            pick = cell.get("pick", {})
            base = pick.get("bf16", {}).get("median_ms", float("nan"))
            cells = [_fmt_speedup(cell[c]) if c in cell else "" for c in kernels]
            out.append(f"| {m} | {k} | {n} | {role} | {base:.3f} | " + " | ".join(cells) + f" | {pick.get('pick', '')} |")
        out.append("")
    linear = [r for r in rows if r["section"] == "linear" and "kernel" in r]
    if linear:
        labels = sorted({r["kernel"] for r in linear if r["kernel"] != "pick"}) + ["pick"]
        out += [
            "## LokaLinear forward + backward",
            "",
            "Speedup over `nn.Linear` in bf16 (one weight quantization per step included).",
            "",
            "| M | K | N | bf16 ms | " + " | ".join(labels) + " |",
            "|" + "---|" * (4 + len(labels)),
        ]
        for m, k, n in sorted({(r["m"], r["k"], r["n"]) for r in linear}):
            cell = {r["kernel"]: r for r in linear if (r["m"], r["k"], r["n"]) == (m, k, n)}
            base = next(iter(cell.values()))["bf16"]["median_ms"]
            cells = []
            for label in labels:
                r = cell.get(label)
                if r is None:
                    cells.append("")
                elif "error_message" in r:
                    cells.append("error")
                else:
                    cells.append(f"{r['speedup']:.2f}" + ("*" if r.get("fallbacks") else ""))
            out.append(f"| {m} | {k} | {n} | {base:.3f} | " + " | ".join(cells) + " |")
        out.append("")
        if any(r.get("fallbacks") for r in linear):
            out += ["`*`: some GEMMs fell back to high precision (see the JSON).", ""]
    kern = [r for r in rows if r["section"] == "kernels" and "time" in r]
    if kern:
        out += [
            "## Quantization kernels",
            "",
            "Against a device-to-device copy of the bf16 input. Eager: as called from Python (launch "
            "overhead included); graph: replayed from a CUDA graph (GPU time). GB/s counts bytes read "
            "and written (bf16 in, FP8 out, another FP8 copy with the transpose, bf16 out where asked).",
            "",
            "| kernel | M | K | eager ms | eager / copy | graph ms | graph / copy | graph GB/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in kern:
            g = r.get("graph_time")
            graph = f"{g['median_ms']:.4f} | {r['graph_vs_copy']:.2f} | {r['graph_gb_per_s']:.0f}" if g else "n/a | n/a | n/a"
            out.append(f"| {r['kernel']} | {r['m']} | {r['k']} | {r['time']['median_ms']:.4f} | {r['vs_copy']:.2f} | {graph} |")
        out.append("")
    problems = [r for r in rows if "error_message" in r or ("skipped" in r and r.get("section") != "gemm")]
    if problems or meta.get("skipped_shapes"):
        out += ["## Not measured", ""]
        for r in problems:
            what = f"{r.get('section')} {r.get('m')}x{r.get('k')}x{r.get('n', '')} {r.get('role', '')} {r.get('kernel', '')}"
            out.append(f"- {what}: {r.get('error_message') or r.get('skipped')}")
        for s in meta.get("skipped_shapes", []):
            out.append(f"- {s}: time budget spent")
        out.append("")
    return "\n".join(out)



def _versions() -> Dict[str, Optional[str]]:
    versions: Dict[str, Optional[str]] = {"torch": torch.__version__, "python": platform.python_version()}
    for module in ("triton", "fbgemm_gpu", "transformer_engine", "torchrec"):
        try:
            versions[module] = getattr(__import__(module), "__version__", "unknown")
        except Exception:
            versions[module] = None
    return versions


def parse_shapes(spec: str) -> List[Tuple[int, int, int]]:
    if spec == "lrm":
        return list(LRM_SHAPES)
    if spec == "recipes":
        return list(RECIPE_SHAPES)
    if spec == "all":  # targets first, so that a time budget never cuts them
        ordered = TARGET_SHAPES + RECIPE_SHAPES + LRM_SHAPES
        return [s for i, s in enumerate(ordered) if s not in ordered[:i]]
    shapes = []
    for item in spec.split(","):
        try:
            m, k, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shapes: expected lrm, recipes, all or MxKxN,..., got {item!r}") from None
        shapes.append((m, k, n))
    return shapes


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for <date>-<name>.json and .md")
    parser.add_argument("--name", default="gemm-bench")
    parser.add_argument("--shapes", default="all", help="lrm | recipes | all (targets first) | MxKxN,MxKxN,...")
    parser.add_argument("--sections", default="gemm,linear,kernels")
    parser.add_argument("--backends", default="", help="comma-separated subset (default: every available one)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-seconds", type=float, default=float("inf"), help="stop starting new shapes after this")
    parser.add_argument("--fast-accum", action="store_true", help="per-role GEMMs with fast accumulation")
    parser.add_argument("--warmup-ms", type=int, default=10)
    parser.add_argument("--rep-ms", type=int, default=50)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gemm_bench: no CUDA device; use --device cpu for a smoke run", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sections = set(args.sections.split(","))
    shapes = parse_shapes(args.shapes)
    timing = dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    cands, unavailable = candidates(device, [b for b in args.backends.split(",") if b])
    start = time.perf_counter()
    today = datetime.date.today().isoformat()
    meta: Dict[str, Any] = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        date=today,
        command="python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        versions=_versions(),
        candidates=[str(c) for c in cands],
        unavailable=unavailable,
        timing=dict(timing, method="triton.testing.do_bench median, p20/p80" if device.type == "cuda" else "perf_counter"),
        fast_accum=args.fast_accum,
        skipped_shapes=[],
    )
    base = os.path.join(args.out, f"{today}-{args.name}")
    rows: List[Dict[str, Any]] = []

    def flush():
        meta["elapsed_s"] = round(time.perf_counter() - start, 1)
        write_text_atomic(base + ".json", json.dumps(dict(meta, rows=rows), indent=1, default=str))
        write_text_atomic(base + ".md", markdown(meta, rows))

    print(f"gemm_bench: {meta['device']}, candidates: {', '.join(meta['candidates']) or 'none'}", flush=True)
    for reason_backend, reason in unavailable.items():
        print(f"  unavailable {reason_backend}: {reason}", flush=True)
    if "kernels" in sections and device.type == "cuda":
        try:
            rows += bench_kernels(device, timing)
        except Exception as exc:
            rows.append(dict(section="kernels", error_message=f"{type(exc).__name__}: {exc}"[:500]))
        flush()
    for shape in shapes:
        if time.perf_counter() - start > args.max_seconds:
            meta["skipped_shapes"].append("x".join(map(str, shape)))
            continue
        t0 = time.perf_counter()
        picks: Dict[str, KernelChoice] = {}
        if "gemm" in sections:
            new, picks = bench_gemm(shape, cands, device, dtype, timing, fast_accum=args.fast_accum)
            rows += new
        if "linear" in sections:
            rows += bench_linear(shape, cands, picks, device, dtype, timing)
        flush()
        print(f"  {'x'.join(map(str, shape))}: {time.perf_counter() - t0:.1f} s", flush=True)
    flush()
    print(f"gemm_bench: wrote {base}.json and {base}.md ({meta['elapsed_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
