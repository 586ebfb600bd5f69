"""``loka-inspect RUN_DIR``: what runs in FP8 in a run, and why each GEMM got its kernel.

Usage::

    loka-inspect RUN_DIR                 # header and one line per GEMM, fits the terminal
    loka-inspect RUN_DIR --why LAYER     # everything about one layer
    loka-inspect RUN_DIR --rank 1        # rank 1's own (pre-merge) statistics
    loka-inspect RUN_DIR --layer 'over.*' --json
    loka-inspect RUN_DIR --plot probe.png

``--help`` explains the header, the columns and the kernel abbreviations (:data:`EPILOG`). Exit
status: 0 shown, 1 the run directory cannot be shown (one line says why), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import textwrap
from typing import Any, Dict, List, Optional, Sequence

from loka_torchrec.comms.choice import CommsChoice
from loka_torchrec.probe.logs import to_jsonable
from loka_torchrec.evidence import GUARD_HOLD
from loka_torchrec.probe.run_view import ROLES, RunDirError, RunView, best_candidate, load_run, rank_comparison
from loka_torchrec.probe.text_table import as_float, number, render_table
from loka_torchrec.probe.why import find_layer, why_lines

__all__ = ["main", "build_report", "comms_line", "header_lines", "short_kernel", "short_reason", "EPILOG"]

BACKEND_ABBREVIATIONS = {"scaled_mm": "smm", "fbgemm": "fbg", "triton": "tri", "emulated": "emu"}
RECIPE_ABBREVIATIONS = {"tensorwise": "tw", "rowwise": "rw", "blockwise": "bw", "triton_rowwise": "trw"}
FAST_ACCUM = "_fast_accum"
_KERNEL = re.compile(r"\b(?:scaled_mm|fbgemm|te|triton|emulated|bf16):[a-z_]+")

EPILOG = """\
The header:
  plan       the dispatch plan's mode, the step it was made at, the device, the gates.
  FP8 GEMMs  of the GEMMs that ran (three per layer: fwd, dgrad, wgrad), how many the plan puts
             in FP8 and how many run in FP8 now (in force), and the coverage: the share of the
             model's linear multiply-adds per row that LoKA manages.
  checks     the gradient check (weight gradients in FP8 against high precision, floor in dB),
             the safety valve (layers it holds in bf16 now) and the step-time guard (whether the
             step with FP8 was faster than in bf16).
  comms      the precision of the embedding all-to-all, each direction.

The table, one line per GEMM:
  layer      the layer's name in the model (alone on its line when too long).
  rows x in -> out  the layer's rows per step and its in and out features.
  role       fwd: output = input x weight; dgrad: the input's gradient; wgrad: the weight's.
  kernel     the kernel in force: backend:recipe, abbreviated (below); "(valve)" or "(guard)":
             bf16 instead of the planned FP8 kernel; "never ran": the site ran no GEMM.
  MERE       mean relative error against float64 of the FP8 kernel in force, or of the best
             FP8 candidate when the GEMM runs bf16 (the gate: below --max-error).
  speedup    bf16 time / FP8 time of the same kernel (the gate: above --min-speedup).
  why        the decision's reason, kernels abbreviated, cut to the terminal (--why LAYER prints
             it whole).

Kernel abbreviations: smm = torch._scaled_mm, fbg = FBGEMM, te = Transformer Engine,
  tri = the project's Triton GEMM, emu = emulated FP8; tw = tensorwise scales, rw = rowwise,
  bw = blockwise, trw = FBGEMM's Triton rowwise, +fa = fast accumulation; bf16 = high precision
  (bf16, or the model's dtype where it is not bf16).
"""


def short_kernel(choice: str) -> str:
    """``backend:recipe`` abbreviated for the table, e.g. ``scaled_mm:tensorwise_fast_accum`` ->
    ``smm:tw+fa``, ``bf16:hp`` -> ``bf16`` (see :data:`EPILOG`)."""
    backend, _, recipe = str(choice).partition(":")
    if backend == "bf16":
        return "bf16"
    fast = recipe.endswith(FAST_ACCUM)
    recipe = recipe[: -len(FAST_ACCUM)] if fast else recipe
    return f"{BACKEND_ABBREVIATIONS.get(backend, backend)}:{RECIPE_ABBREVIATIONS.get(recipe, recipe)}{'+fa' if fast else ''}"


def short_reason(text: str) -> str:
    """A decision's reason with every ``backend:recipe`` in it abbreviated (:func:`short_kernel`)."""
    return _KERNEL.sub(lambda m: short_kernel(m.group(0)), text)


def _numbers(view: RunView, layer: str, role: str, kernel: str, entry: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The evidence behind ``kernel`` for one GEMM: the plan's (what the decision saw), else the Probe's."""
    decision = ((view.plan.get("layers") or {}).get(layer) or {}).get("roles", {}).get(role) or {}
    evidence = decision.get("evidence") if isinstance(decision, dict) else None
    if isinstance(evidence, dict) and evidence.get("candidate") == kernel:
        return evidence
    return next((e for e in entry.get("evidence") or [] if e.get("role") == role and e.get("candidate") == kernel), None)


def _speedup(e: Optional[Dict[str, Any]]) -> float:
    if not e:
        return math.nan
    if "speedup" in e:
        return as_float(e["speedup"])
    t = as_float((e.get("time_ms") or {}).get("value"))
    return as_float((e.get("baseline_time_ms") or {}).get("value")) / t if t > 0 else math.nan


def build_report(view: RunView, *, layer_glob: Optional[str] = None, z_threshold: float = 5.0) -> Dict[str, Any]:
    """The data behind the view (what ``--json`` prints)."""
    layers = []
    for name, entry in view.filtered(layer_glob).items():
        act = (entry.get("stats") or {}).get("act") or {}
        e4m3 = (act.get("underflow") or {}).get("e4m3") or {}
        roles = {}
        for role in ROLES:
            best = best_candidate(entry.get("evidence") or [], role, view.max_error, view.min_speedup, view.max_noise_ratio)
            state = view.role(name, role)
            fp8 = bool(state.in_force) and not state.in_force.startswith("bf16:")
            shown = _numbers(view, name, role, state.in_force, entry) if fp8 else best
            roles[role] = {
                "best": None
                if best is None
                else {
                    "candidate": best.get("candidate"),
                    "mere": best.get("error"),
                    "mere_captured": ((best.get("errors") or {}).get("captured")),
                    "speedup": best.get("speedup"),
                    "speedup_low": best.get("speedup_low"),
                    "passes_gates": best.get("passes"),
                },
                "planned": state.planned,
                "in_force": state.in_force,
                "held_by": state.held_by,
                "decision": state.text,
                "reason": state.reason,
                # What the table shows: the kernel in force's numbers when it is FP8, else the best FP8 candidate's.
                "shown": None if not shown else {"candidate": shown.get("candidate"), "mere": (shown.get("error") or {}).get("value"), "speedup": _speedup(shown)},
            }
        layers.append(
            {
                "layer": name,
                "shape": entry.get("shape") or {},
                "state": entry.get("state", ""),
                "probe_reason": entry.get("reason", ""),
                "act_amax": act.get("amax"),
                "act_kurtosis": act.get("kurtosis"),
                "grad_amax": ((entry.get("stats") or {}).get("grad") or {}).get("amax"),
                "underflow_e4m3": max([as_float(v) for v in e4m3.values() if not math.isnan(as_float(v))], default=math.nan),
                "saturation": act.get("saturation"),
                "roles": roles,
                "events": entry.get("events") or [],
            }
        )
    plan = view.plan
    return {
        "run_dir": str(view.run_dir),
        "source": view.source,
        "gates": {"max_error": view.max_error, "min_speedup": view.min_speedup},
        "plan": {k: plan.get(k) for k in ("mode", "step", "device")} if plan else None,
        "status": view.status.to_dict(),
        "layers": layers,
        "ranks": rank_comparison(view.ranks, z_threshold=z_threshold),
        "comms": _comms_plan(view),
        "warnings": view.warnings,
    }


def _comms_plan(view: RunView) -> Optional[Dict[str, Any]]:
    """``RUN_DIR/comms_plan.json`` (``None`` when absent; unreadable: a warning)."""
    path = view.run_dir / "comms_plan.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        view.warnings.append(f"comms_plan.json is unreadable ({exc}); the comms precisions are not shown")
        return None


def comms_line(plan: Optional[Dict[str, Any]]) -> str:
    """One line: the comms precision of each direction and, for ``auto``, why."""
    if plan is None:
        return "comms: no comms_plan.json"
    text = f"comms: forward {plan.get('forward')}, backward {plan.get('backward')}"
    if plan.get("choice"):
        try:
            summary = CommsChoice.from_dict(plan["choice"]).summary()
        except (TypeError, ValueError) as exc:
            summary = f"choice unreadable: {exc}"
        restored = "restored from a checkpoint: " if plan.get("restored") else ""
        text += f" (auto, {restored}{summary})"
    return text


def _names(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(list(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _grad_check_text(check: Optional[Dict[str, Any]], has_events: bool) -> str:
    if check is None:
        return "gradient check: not run" if has_events else "gradient check: no dispatch_events.jsonl"
    worst = "-" if check["worst_db"] is None else f"{check['worst_db']:.1f} dB"
    if check["failing"]:
        text = f"gradient check (step {check['step']}): FAILING at {_names(check['failing'])} (worst weight gradient {worst})"
    else:
        text = f"gradient check (step {check['step']}): passed, worst weight gradient {worst} at {check['site'] or '-'}"
    if check["demoted"]:
        text += f"; sent {len(check['demoted'])} FP8 GEMM(s) back to bf16"
    noise = check["passed_by_noise_rule"]
    if noise:
        below = ", ".join(f"{site} {as_float(v.get('db')):.1f} dB" for site, v in list(noise.items())[:3])
        text += f"; under the floor but passed by the noise rule: {below}{' ...' if len(noise) > 3 else ''}"
    return text


def _valve_text(view: RunView) -> str:
    trips = view.status.valve_trips
    guard = {n for n, h in view.status.held.items() if str(h.get("reason", "")).startswith(GUARD_HOLD)}
    held = {n: h for n, h in view.status.held.items() if n not in guard}
    count = "" if trips is None else f" ({trips} trip(s) so far)"
    by_guard = f"; the step-time guard holds {len(guard)} readmitted layer(s): {_names(sorted(guard))}" if guard else ""
    steps = sorted({e["step"] for e in view.batch_events if e.get("step") is not None})
    batch = (f"; {len(view.batch_events)} batch event(s), spikes the bf16 layers shared, tripped nothing"
             f" (step {_names([str(s) for s in steps])})") if view.batch_events else ""  # fmt: skip
    if not held:
        return f"safety valve: holds no layer{count}{by_guard}{batch}"
    since = [f"{name} (step {h['step']})" if h.get("step") is not None else name for name, h in held.items()]
    return f"safety valve: holds {len(held)} layer(s) in bf16: {_names(since)}{count}{by_guard}{batch}"


def _guard_text(view: RunView) -> str:
    status = view.status
    verdicts = status.guard_verdicts
    if status.plan_trials:  # compiled: the candidates were judged one window each
        selected = status.plan_selected
        tried = ", ".join(f"{t.get('candidate')} {as_float(t.get('fp8_ms')):.4g} ms" for t in status.plan_trials)
        if selected is None:
            return f"plan trials: under way ({tried}; bf16 {as_float(status.plan_trials[0].get('bf16_ms')):.4g} ms)"
        return f"plan trials (step {selected.get('step')}): {selected.get('summary')}"
    if not verdicts:
        return "step-time guard: no verdict yet" if view.events is not None else "step-time guard: no dispatch_events.jsonl"
    v = status.guard_off or verdicts[-1]
    if v.get("readmitted"):
        verb = (f"kept the {len(v['readmitted'])} layer(s) the safety valve readmitted" if v.get("keep_fp8")
                else f"sent the {len(v['readmitted'])} layer(s) the safety valve readmitted back to bf16")  # fmt: skip
    else:
        verb = "kept FP8" if v.get("keep_fp8") else "returned every GEMM to bf16"
    return f"step-time guard (step {v.get('step')}): {verb}, median step {as_float(v.get('fp8_ms')):.4g} ms with FP8 vs {as_float(v.get('bf16_ms')):.4g} ms in bf16"


def header_lines(view: RunView, report: Dict[str, Any]) -> List[str]:
    """The header: the run, the FP8 GEMMs planned and in force, coverage, checks, comms."""
    plan = report["plan"]
    gates = report["gates"]
    source = f"statistics: {report['source']}"
    if plan:
        lines = [f"run {report['run_dir']}: plan {plan['mode'] or '?'} at step {plan['step']} on {plan['device'] or '?'}; "
                 f"gates MERE < {gates['max_error']:g}, speedup >= {gates['min_speedup']:g}; {source}"]  # fmt: skip
        counts = view.status.counts()
        text = f"FP8 GEMMs: {counts['planned']}/{counts['total']} planned, {counts['in_force']}/{counts['total']} in force"
        coverage = view.status.coverage
        if coverage.get("share") is not None:
            text += (f"; coverage {100 * as_float(coverage['share']):.1f}% of the linear multiply-adds per row"
                     f" ({coverage.get('managed_macs_per_row')}/{coverage.get('total_macs_per_row')})")  # fmt: skip
        if view.status.never_ran:
            text += f"; {len(view.status.never_ran)} site(s) never ran"
        lines.append(text)
    else:
        lines = [f"run {report['run_dir']}: no dispatch_plan.json (the Probe's view only); {source}"]
    lines += [_grad_check_text(view.status.grad_check, view.events is not None), _valve_text(view), _guard_text(view)]
    lines.append(comms_line(report["comms"]))
    return lines


def _shape_text(shape: Dict[str, Any]) -> str:
    return f"{shape.get('rows', '?')}x{shape.get('in_features', '?')}->{shape.get('out_features', '?')}"


def _kernel_cell(info: Dict[str, Any]) -> str:
    held = {"safety valve": " (valve)", "step-time guard": " (guard)"}.get(info["held_by"], "")
    if info["held_by"] == "never ran":
        return "never ran"
    return short_kernel(info["in_force"]) + held if info["in_force"] else "-"


def table_lines(report: Dict[str, Any], width: int) -> List[str]:
    """One line per GEMM: layer, shape, role, kernel in force, MERE, speedup, why (:data:`EPILOG`)."""
    headers = ["layer", "rows x in -> out", "role", "kernel", "MERE", "speedup", "why"]
    names = [layer["layer"] for layer in report["layers"]]
    layer_width = max(16, min(max(map(len, names), default=5), width // 3))
    rows: List[Any] = []
    for layer in report["layers"]:
        name = layer["layer"]
        if len(name) > layer_width:
            rows.append(name)  # alone on its line; its GEMMs follow
            name = ""
        for i, role in enumerate(ROLES):
            info = layer["roles"][role]
            shown = info["shown"] or {}
            speedup = as_float(shown.get("speedup"))
            rows.append([
                name if i == 0 else "", _shape_text(layer["shape"]) if i == 0 else "", role, _kernel_cell(info),
                number(shown.get("mere")), "-" if math.isnan(speedup) else f"{speedup:.2f}x", short_reason(info["reason"]) or "-",
            ])  # fmt: skip
    return render_table(headers, rows, width=width, elastic=-1, right=(4, 5))


def _print_ranks(report: Dict[str, Any], width: int) -> None:
    if len(report["ranks"]) < 2:
        return
    rows = []
    for row in report["ranks"]:
        flagged = row["flagged_layers"]
        text = ", ".join(f"{k} ({v} step{'s' if v > 1 else ''})" for k, v in sorted(flagged.items())) or "none"
        rows.append([str(row["rank"]), str(row["records"]), str(row["last_step"]), number(row["worst_ratio"]), text])
    print("\nRanks: local statistics against the merged ones (rows as samples)")
    headers = ["rank", "records", "last step", "worst z / threshold", "layers beyond noise"]
    print("\n".join(render_table(headers, rows, width=width, elastic=-1, right=(1, 2, 3))))


def _plot(view: RunView, path: str, layer_glob: Optional[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RunDirError(f"--plot needs matplotlib (pip install 'loka-torchrec[plot]'): {exc}") from exc
    layers = view.filtered(layer_glob)
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for name, entry in list(layers.items())[:20]:
        hist = [h for h in entry.get("history") or [] if not math.isnan(as_float(h.get("act_amax")))]
        steps = [as_float(h["step"]) for h in hist]
        axes[0].plot(steps, [as_float(h["act_amax"]) for h in hist], marker=".", label=name)
        axes[1].plot(steps, [as_float(h.get("act_kurtosis")) for h in hist], marker=".", label=name)
        for event in entry.get("events") or []:
            if event.get("event") == "fallback":  # where the safety valve fired
                axes[0].axvline(as_float(event.get("step")), color="red", lw=0.6, ls=":")
    axes[0].set(title="input amax per probe step", xlabel="step", ylabel="amax", yscale="log")
    axes[1].set(title="input kurtosis (uncentred) per probe step", xlabel="step", ylabel="mean(x^4)/mean(x^2)^2")
    axes[1].axhline(3.0, color="grey", lw=0.8, ls=":")
    if layers:
        axes[0].legend(fontsize="x-small")
    by_candidate: Dict[str, List[tuple]] = {}
    for entry in layers.values():
        for ev in entry.get("evidence") or []:
            err = as_float((ev.get("error") or {}).get("value"))
            t, b = as_float((ev.get("time_ms") or {}).get("value")), as_float((ev.get("baseline_time_ms") or {}).get("value"))
            if str(ev.get("candidate", "")).startswith("bf16:") or not (err > 0 and t > 0 and math.isfinite(err) and math.isfinite(t)):
                continue
            by_candidate.setdefault(str(ev["candidate"]), []).append((err, b / t))
    for cand, points in sorted(by_candidate.items()):
        axes[2].scatter([p[0] for p in points], [p[1] for p in points], label=cand, s=18)
    axes[2].axvline(view.max_error, color="red", ls="--", lw=1, label=f"accuracy gate (MERE {view.max_error:g})")
    axes[2].axhline(view.min_speedup, color="green", ls="--", lw=1, label=f"speed gate ({view.min_speedup:g}x)")
    axes[2].set(title="error vs speedup per candidate (every layer and role)", xlabel="MERE", ylabel="speedup over bf16", xscale="log", yscale="log")
    axes[2].legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _wrapped(lines: Sequence[str], width: int) -> str:
    return "\n".join(textwrap.fill(line, width=width, subsequent_indent="    ", break_on_hyphens=False) for line in lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``loka-inspect``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="loka-inspect", description="Show what runs in FP8 in a LoKA run directory, and why.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("run_dir", help="the run directory (holds probe/ and, optionally, dispatch_plan.json)")
    parser.add_argument("--why", default=None, metavar="LAYER", help="everything about one layer: statistics, every candidate, the decision, events")
    parser.add_argument("--rank", type=int, default=None, help="show this rank's own (pre-merge) statistics")
    parser.add_argument("--layer", default=None, metavar="GLOB", help="only layers whose name matches this glob, e.g. 'over.*'")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="also write amax/kurtosis curves and an error-vs-speedup scatter")
    parser.add_argument("--max-error", type=float, default=None, help="accuracy gate (MERE); default: the plan's, else 0.2")
    parser.add_argument("--min-speedup", type=float, default=None, help="speed gate; default: the plan's, else 1.05")
    parser.add_argument("--z-threshold", type=float, default=5.0, help="rank comparison: |z| of mean(x^2) that counts as disagreement")
    args = parser.parse_args(argv)
    if args.rank is not None and args.rank < 0:
        parser.error(f"--rank: expected a rank >= 0, got {args.rank}")
    width = shutil.get_terminal_size((120, 24)).columns
    try:
        view = load_run(args.run_dir, rank=args.rank, max_error=args.max_error, min_speedup=args.min_speedup)
        layer_glob = find_layer(view, args.why) if args.why is not None else args.layer
        report = build_report(view, layer_glob=layer_glob, z_threshold=args.z_threshold)
        if not report["layers"]:
            raise RunDirError(f"no layer matches --layer {args.layer!r} (layers: {', '.join(sorted(view.layers)[:8])}{', ...' if len(view.layers) > 8 else ''})")
        if args.plot:
            _plot(view, args.plot, layer_glob)
    except RunDirError as exc:
        print(f"loka-inspect: {exc}", file=sys.stderr)
        return 1
    for warning in view.warnings:
        print(f"loka-inspect: warning: {warning}", file=sys.stderr)
    try:
        if args.json:
            print(json.dumps(to_jsonable(report), indent=1))
        elif args.why is not None:
            print(_wrapped(header_lines(view, report)[:1], width))
            print("\n".join(why_lines(view, report["layers"][0], width=width)))
        else:
            print(_wrapped(header_lines(view, report), width))
            print()
            print("\n".join(table_lines(report, width)))
            _print_ranks(report, width)
            if args.plot:
                print(f"plot written to {args.plot}")
    except BrokenPipeError:  # `loka-inspect ... | head`
        sys.stderr.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
