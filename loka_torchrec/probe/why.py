"""``loka-inspect RUN_DIR --why LAYER``: everything a run directory knows about one layer.

The layer's latest statistics (input, output gradient, weight), then per GEMM role the kernel in
force and the planned one, the decision's source and whole reason, every candidate the decision
weighed with its error, time and speedup and which gate it failed, and last the layer's events
(layer check, gradient check, the plan trials' choice, safety valve, readmission) in step order.
"""

from __future__ import annotations

import difflib
import fnmatch
import glob
import math
import textwrap
from typing import Any, Dict, List, Optional

from loka_torchrec.probe.run_view import ROLES, RunDirError, RunView
from loka_torchrec.probe.text_table import as_float, number, render_table

__all__ = ["find_layer", "why_lines"]


def _pct(x: Any) -> str:
    v = as_float(x)
    return "-" if math.isnan(v) else f"{100 * v:.2f}%"


def find_layer(view: RunView, query: str) -> str:
    """The glob that selects exactly the layer ``query`` names: its full name, a glob or a dotted
    suffix that matches one layer.

    Raises:
        RunDirError: no layer or several match (the message lists the candidates).
    """
    names = sorted(view.layers)
    if query in view.layers:
        return glob.escape(query)
    matches = [n for n in names if fnmatch.fnmatchcase(n, query)] or [n for n in names if n.endswith("." + query)]
    if len(matches) == 1:
        return glob.escape(matches[0])
    if matches:
        shown = ", ".join(matches[:6]) + (", ..." if len(matches) > 6 else "")
        raise RunDirError(f"--why {query!r} matches {len(matches)} layers ({shown}); name one")
    close = difflib.get_close_matches(query, names, n=3, cutoff=0.4) or names[:3]
    raise RunDirError(f"--why: no layer {query!r} in this run (did you mean {', '.join(close)}?)")


def _stats_lines(entry: Dict[str, Any], width: int) -> List[str]:
    stats = entry.get("stats") or {}
    rows = []
    for label, digest in (("input", stats.get("act") or {}), ("output grad", stats.get("grad") or {}), ("weight", entry.get("weight") or {})):
        under = digest.get("underflow") or {}
        flush = lambda fmt: " / ".join(_pct((under.get(fmt) or {}).get(s)) for s in ("tensorwise", "rowwise"))  # noqa: E731
        rows.append([
            label, number(digest.get("amax")), number(digest.get("kurtosis")), number(digest.get("mean_sq")),
            flush("e4m3") if under else "-", flush("e5m2") if under else "-", _pct(digest.get("saturation")), number(digest.get("nonfinite"), "g"),
        ])  # fmt: skip
    headers = ["tensor", "amax", "kurtosis", "mean(x^2)", "E4M3 underflow tw / rw", "E5M2 underflow tw / rw", "saturated", "non-finite"]
    return ["  " + line for line in render_table(headers, rows, width=width - 2, elastic=0, right=(1, 2, 3, 6, 7))]


def _gate(e: Dict[str, Any], view: RunView) -> str:
    """Which gate a candidate fails at the interval bounds (as Dispatch judges), or ``pass``."""
    if e.get("note") and not math.isfinite(as_float((e.get("error") or {}).get("high"))):
        return str(e["note"])
    if not as_float((e.get("error") or {}).get("high")) < view.max_error:
        return f"MERE hi >= {view.max_error:g}"
    noise = e.get("noise_ratio") or {}
    if view.max_noise_ratio > 0 and noise and as_float(noise.get("high")) > view.max_noise_ratio:
        return f"noise ratio > {view.max_noise_ratio:g}"
    t, b = e.get("time_ms") or {}, e.get("baseline_time_ms") or {}
    low = as_float(b.get("low")) / as_float(t.get("high")) if as_float(t.get("high")) > 0 else math.nan
    return "pass" if low >= view.min_speedup else f"speedup lo < {view.min_speedup:g}"


def _candidate_lines(evidence: List[Dict[str, Any]], view: RunView, width: int) -> List[str]:
    rows = []
    for e in sorted(evidence, key=lambda e: str(e.get("candidate"))):
        err, t, b = e.get("error") or {}, e.get("time_ms") or {}, e.get("baseline_time_ms") or {}
        captured = ((e.get("errors") or {}).get("captured") or {}).get("value")
        t_val, t_hi = as_float(t.get("value")), as_float(t.get("high"))
        speedup = as_float(b.get("value")) / t_val if t_val > 0 else math.nan
        low = as_float(b.get("low")) / t_hi if t_hi > 0 else math.nan
        rows.append([
            str(e.get("candidate")), f"{number(err.get('value'))} [{number(err.get('low'))}, {number(err.get('high'))}]",
            number(captured), number(t_val, ".4g"), number(b.get("value"), ".4g"), f"{number(speedup, '.2f')}x ({number(low, '.2f')}x)",
            "-" if str(e.get("candidate", "")).startswith("bf16:") else _gate(e, view),
        ])  # fmt: skip
    headers = ["candidate", "MERE [95% CI]", "captured", "FP8 ms", "bf16 ms", "speedup (lo)", "gates"]
    if all(row[2] == "-" for row in rows):  # the plan's records carry no captured-rows error
        headers, rows = headers[:2] + headers[3:], [row[:2] + row[3:] for row in rows]
    return ["    " + line for line in render_table(headers, rows, width=width - 4, elastic=-1, right=[i for i, h in enumerate(headers) if h in ("captured", "FP8 ms", "bf16 ms")])]


def _events(view: RunView, name: str, entry: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The layer's events from Dispatch and from the Probe, one per (step, kind), in step order."""
    merged: Dict[tuple, Dict[str, Any]] = {}
    for e in view.events or []:
        kind = e.get("event")
        if kind == "grad_check":
            if e.get("layer") == name:
                merged[(e.get("step"), "demote")] = {**e, "event": "grad_check_demote"}
            elif e.get("kind") == "plan" and e.get("site") == name:
                merged[(e.get("step"), kind)] = e
        elif kind == "plan_selected":  # the plan trials' choice holds for every layer (its summary names the plan)
            merged[(e.get("step"), kind)] = e
        elif kind == "never_ran" and name in (e.get("layers") or {}):
            merged[(e.get("step"), kind)] = {**e, "reason": e["layers"][name]}
        elif e.get("layer") == name:
            merged[(e.get("step"), kind)] = e
    for e in entry.get("events") or []:  # the Probe's records say why, where Dispatch's do not
        key = (e.get("step"), e.get("event"))
        merged[key] = {**merged.get(key, {}), **e}
    return [merged[k] for k in sorted(merged, key=lambda k: (as_float(k[0]), str(k[1])))]


def _event_text(e: Dict[str, Any]) -> str:
    kind = e.get("event")
    if kind == "layer_check":
        if "error" in e:
            return f"layer check: could not time the layer ({e['error']}); bf16"
        verdict = "kept FP8" if e.get("kept_fp8") else "back to bf16"
        return (f"layer check: fwd+bwd {number(e.get('fp8_ms'), '.4g')} ms with FP8 vs {number(e.get('bf16_ms'), '.4g')} ms in bf16 "
                f"({number(e.get('speedup'), '.2f')}x, lo {number(e.get('speedup_low'), '.2f')}x): {verdict}")  # fmt: skip
    if kind == "grad_check":
        return f"gradient check: this layer had the plan's worst weight gradient, {number(e.get('worst_db'), '.1f')} dB"
    if kind == "grad_check_demote":
        return (f"gradient check: {e.get('role')} {e.get('choice')} back to bf16 (alone it put {e.get('damaged')}'s weight "
                f"gradient at {number(e.get('alone_db'), '.1f')} dB)")  # fmt: skip
    if kind == "plan_selected":
        return e.get("summary") or "plan trials ended"
    if kind == "fallback":
        return f"safety valve: to bf16: {e.get('reason', '')}"
    if kind == "readmit":
        return "readmitted to its planned kernels" + (f": {e['reason']}" if e.get("reason") else "")
    if kind == "never_ran":
        return f"never ran: {e.get('reason', '')}"
    return f"{kind}: {e.get('reason', '')}"


def _wrap(text: str, width: int, indent: str) -> List[str]:
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False) or [indent]


def why_lines(view: RunView, layer: Dict[str, Any], *, width: int) -> List[str]:
    """The ``--why`` text for one layer of :func:`~loka_torchrec.probe.inspect.build_report`."""
    name = layer["layer"]
    entry = view.layers[name]
    shape = layer["shape"] or {}
    state = f"; Probe state: {layer['state']}" + (f" ({layer['probe_reason']})" if layer["probe_reason"] else "") if layer["state"] else ""
    lines = _wrap(f"layer {name}: {shape.get('rows', '?')} rows x {shape.get('in_features', '?')} in -> {shape.get('out_features', '?')} out{state}", width, "")
    lines += ["", f"statistics at the latest probe step ({view.source}):"] + _stats_lines(entry, width)
    plan_layer = (view.plan.get("layers") or {}).get(name) or {}
    for role in ROLES:
        info = layer["roles"][role]
        decision: Optional[Dict[str, Any]] = (plan_layer.get("roles") or {}).get(role)
        planned = f"planned {info['planned']} by {decision.get('source', '?')} at step {view.plan.get('step', '?')}" if decision else "no plan"
        lines += ["", f"{role}: runs {info['in_force'] or '-'}" + (f" ({info['held_by']})" if info["held_by"] else "") + f"; {planned}"]
        lines += _wrap(f"why: {info['reason'] or '-'}", width, "  ")
        considered = [e for e in (decision or {}).get("considered") or [] if isinstance(e, dict)]
        evidence = considered or [e for e in entry.get("evidence") or [] if e.get("role") == role]
        if evidence:
            lines.append("  candidates (" + ("as the decision weighed them" if considered else "the Probe's latest evidence") + "):")
            lines += _candidate_lines(evidence, view, width)
        else:
            lines.append("  candidates: no evidence recorded")
    events = _events(view, name, entry)
    lines += ["", "events:" if events else "events: none"]
    for e in events:
        lines += _wrap(f"step {e.get('step')}: {_event_text(e)}", width, "  ")
    return lines
