"""``loka-inspect RUN_DIR``: what the Probe learned about each layer, and why it got its kernel.

Usage::

    loka-inspect RUN_DIR                 # per-layer table from probe/summary.json
    loka-inspect RUN_DIR --rank 1        # rank 1's own (pre-merge) statistics
    loka-inspect RUN_DIR --layer 'over.*' --json
    loka-inspect RUN_DIR --plot probe.png

Columns: the layer and its shape (``rows x in -> out``), the merged input amax, kurtosis, the
largest E4M3 underflow fraction and the delayed-scaling saturation fraction, then per GEMM role
the best FP8 candidate (fastest within the gates, else most accurate) with its MERE and speedup
(intervals in brackets), the decision and its reason (from ``RUN_DIR/dispatch_plan.json`` when
present). A first line gives the GEMMs planned in FP8 and in force (what runs after the safety
valve, the step-time guard and kernels that cannot run at a shape; from the plan file's ``in_force``
section). A second table compares ranks. A last line gives the embedding comms precisions from
``RUN_DIR/comms_plan.json`` (for ``auto``: the timings and the reason). Exit status: 0 shown, 1 the run directory cannot be
shown (one line says why), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from typing import Any, Dict, List, Optional, Sequence

from loka_torchrec.comms.choice import CommsChoice
from loka_torchrec.probe.logs import to_jsonable
from loka_torchrec.probe.run_view import ROLES, RunDirError, RunView, best_candidate, load_run, rank_comparison

__all__ = ["main", "build_report", "comms_line", "dispatch_line"]


def _f(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _fmt(x: Any, spec: str = ".3g") -> str:
    v = _f(x)
    return "-" if math.isnan(v) else format(v, spec)


def _pct(x: Any) -> str:
    v = _f(x)
    return "-" if math.isnan(v) else f"{100 * v:.2f}%"


def build_report(view: RunView, *, layer_glob: Optional[str] = None, z_threshold: float = 5.0) -> Dict[str, Any]:
    """The data behind the tables (what ``--json`` prints)."""
    layers = []
    for name, entry in view.filtered(layer_glob).items():
        act = (entry.get("stats") or {}).get("act") or {}
        under = act.get("underflow") or {}
        e4m3 = under.get("e4m3") or {}
        roles = {}
        for role in ROLES:
            best = best_candidate(entry.get("evidence") or [], role, view.max_error, view.min_speedup, view.max_noise_ratio)
            choice, reason = view.decision(name, role)
            roles[role] = {
                "best": None
                if best is None
                else {
                    "candidate": best.get("candidate"),
                    "mere": best.get("error"),
                    "mere_captured": ((best.get("errors") or {}).get("captured")),
                    "speedup": best.get("speedup"),
                    "speedup_low": best.get("speedup_low"),
                    "speedup_high": _f(best.get("baseline_time_ms", {}).get("high")) / _f(best.get("time_ms", {}).get("low"))
                    if _f(best.get("time_ms", {}).get("low")) > 0
                    else math.nan,
                    "passes_gates": best.get("passes"),
                },
                "decision": choice,
                "reason": reason,
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
                "underflow_e4m3": max([_f(v) for v in e4m3.values() if not math.isnan(_f(v))], default=math.nan),
                "saturation": act.get("saturation"),
                "roles": roles,
                "events": entry.get("events") or [],
            }
        )
    return {
        "run_dir": str(view.run_dir),
        "source": view.source,
        "gates": {"max_error": view.max_error, "min_speedup": view.min_speedup},
        "layers": layers,
        "ranks": rank_comparison(view.ranks, z_threshold=z_threshold),
        "comms": _comms_plan(view),
        "dispatch": view.plan.get("in_force"),
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


def dispatch_line(in_force: Optional[Dict[str, Any]]) -> str:
    """One line: the GEMMs planned in FP8 and in force, and what holds the others in bf16."""
    if not isinstance(in_force, dict):
        return "dispatch: no in-force counts in dispatch_plan.json"
    text = f"dispatch: {in_force.get('fp8_gemms_planned')}/{in_force.get('gemms')} GEMMs planned in FP8, {in_force.get('fp8_gemms')} in force"
    held: Dict[str, List[str]] = {}
    for layer, entry in sorted((in_force.get("held") or {}).items()):
        held.setdefault(str((entry or {}).get("by")), []).append(layer)
    return text + "".join(f"; in bf16 ({by}): {', '.join(layers)}" for by, layers in held.items())


def _shorten(text: str, limit: int = 90) -> str:
    """A fallback's first trigger and a count of the others; ``--json`` has them all."""
    parts = [p for p in text.split("; ") if p]
    if len(parts) > 1:
        text = f"{parts[0]} (+{len(parts) - 1} more)"
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _interval(iv: Any) -> str:
    if not isinstance(iv, dict):
        return "-"
    value, low, high = _f(iv.get("value")), _f(iv.get("low")), _f(iv.get("high"))
    if math.isnan(value):
        return "-"
    if low == high:
        return f"{value:.3g}"
    return f"{value:.3g} [{low:.3g}, {high:.3g}]"


def _print_tables(report: Dict[str, Any], *, show_ranks: bool) -> None:
    from rich.console import Console  # rich loads only where tables are printed
    from rich.table import Table

    console = Console(width=max(shutil.get_terminal_size((180, 24)).columns, 120), soft_wrap=False)
    gates = report["gates"]
    table = Table(
        title=f"Probe: {report['run_dir']} ({report['source']}; gates: MERE < {gates['max_error']:g}, speedup > {gates['min_speedup']:g})",
        show_lines=False,
    )
    for col in ("layer", "shape", "amax", "kurt", "uflow e4m3", "sat", "role", "best FP8", "MERE [95% CI]", "speedup [IQR]", "decision", "reason"):
        table.add_column(col, overflow="fold")
    for layer in report["layers"]:
        shape = layer["shape"] or {}
        shape_text = f"{shape.get('rows', '?')}x{shape.get('in_features', '?')}->{shape.get('out_features', '?')}"
        for i, role in enumerate(ROLES):
            info = layer["roles"][role]
            best = info["best"]
            if best is None:
                cand, err, spd = "-", "-", "-"
            else:
                cand = f"{best['candidate']}{'' if best['passes_gates'] else ' (fails gates)'}"
                err = _interval(best["mere"])
                spd = f"{_fmt(best['speedup'])} [{_fmt(best['speedup_low'])}, {_fmt(best['speedup_high'])}]"
            first = i == 0
            table.add_row(
                layer["layer"] if first else "",
                shape_text if first else "",
                _fmt(layer["act_amax"]) if first else "",
                _fmt(layer["act_kurtosis"]) if first else "",
                _pct(layer["underflow_e4m3"]) if first else "",
                _pct(layer["saturation"]) if first else "",
                role,
                cand,
                err,
                spd,
                info["decision"],
                _shorten(info["reason"]),
            )
    console.print(table)
    if show_ranks and len(report["ranks"]) > 1:
        ranks = Table(title="Ranks: local statistics against the merged ones (rows as samples)")
        for col in ("rank", "records", "last step", "worst z / threshold", "layers beyond noise"):
            ranks.add_column(col, overflow="fold")
        for row in report["ranks"]:
            flagged = row["flagged_layers"]
            text = ", ".join(f"{k} ({v} step{'s' if v > 1 else ''})" for k, v in sorted(flagged.items())) or "none"
            ranks.add_row(str(row["rank"]), str(row["records"]), str(row["last_step"]), _fmt(row["worst_ratio"]), text if flagged else "none")
        console.print(ranks)


def _plot(view: RunView, report: Dict[str, Any], path: str, layer_glob: Optional[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RunDirError(f"--plot needs matplotlib (pip install 'loka-torchrec[plot]'): {exc}") from exc
    layers = view.filtered(layer_glob)
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for name, entry in list(layers.items())[:20]:
        hist = [h for h in entry.get("history") or [] if not math.isnan(_f(h.get("act_amax")))]
        steps = [_f(h["step"]) for h in hist]
        axes[0].plot(steps, [_f(h["act_amax"]) for h in hist], marker=".", label=name)
        axes[1].plot(steps, [_f(h.get("act_kurtosis")) for h in hist], marker=".", label=name)
        for event in entry.get("events") or []:
            if event.get("event") == "fallback":  # where the safety valve fired
                axes[0].axvline(_f(event.get("step")), color="red", lw=0.6, ls=":")
    axes[0].set(title="input amax per probe step", xlabel="step", ylabel="amax", yscale="log")
    axes[1].set(title="input kurtosis (uncentred) per probe step", xlabel="step", ylabel="mean(x^4)/mean(x^2)^2")
    axes[1].axhline(3.0, color="grey", lw=0.8, ls=":")
    if layers:
        axes[0].legend(fontsize="x-small")
    by_candidate: Dict[str, List[tuple]] = {}
    for entry in layers.values():
        for ev in entry.get("evidence") or []:
            err = _f((ev.get("error") or {}).get("value"))
            t, b = _f((ev.get("time_ms") or {}).get("value")), _f((ev.get("baseline_time_ms") or {}).get("value"))
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``loka-inspect``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="loka-inspect", description="Show what the Probe learned in a run directory.")
    parser.add_argument("run_dir", help="the run directory (holds probe/ and, optionally, dispatch_plan.json)")
    parser.add_argument("--rank", type=int, default=None, help="show this rank's own (pre-merge) statistics")
    parser.add_argument("--layer", default=None, metavar="GLOB", help="only layers whose FQN matches this glob, e.g. 'over.*'")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="also write amax/kurtosis curves and an error-vs-speedup scatter")
    parser.add_argument("--max-error", type=float, default=None, help="accuracy gate (MERE); default: the plan's, else 0.2")
    parser.add_argument("--min-speedup", type=float, default=None, help="speed gate; default: the plan's, else 1.05")
    parser.add_argument("--z-threshold", type=float, default=5.0, help="rank comparison: |z| of mean(x^2) that counts as disagreement")
    args = parser.parse_args(argv)
    if args.rank is not None and args.rank < 0:
        parser.error(f"--rank: expected a rank >= 0, got {args.rank}")
    try:
        view = load_run(args.run_dir, rank=args.rank, max_error=args.max_error, min_speedup=args.min_speedup)
        report = build_report(view, layer_glob=args.layer, z_threshold=args.z_threshold)
        if not report["layers"]:
            raise RunDirError(f"no layer matches --layer {args.layer!r} (layers: {', '.join(sorted(view.layers)[:8])}{', ...' if len(view.layers) > 8 else ''})")
        if args.plot:
            _plot(view, report, args.plot, args.layer)
    except RunDirError as exc:
        print(f"loka-inspect: {exc}", file=sys.stderr)
        return 1
    for warning in view.warnings:
        print(f"loka-inspect: warning: {warning}", file=sys.stderr)
    try:
        if args.json:
            print(json.dumps(to_jsonable(report), indent=1))
        else:
            print(dispatch_line(report["dispatch"]))
            _print_tables(report, show_ranks=True)
            print(comms_line(report["comms"]))
            if args.plot:
                print(f"plot written to {args.plot}")
    except BrokenPipeError:  # `loka-inspect ... | head`
        sys.stderr.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
