"""One table and one plot from several committed ``e2e_compare.py`` results.

Each device call writes its own ``<date>-<name>.json``; a comparison across recipes usually needs
runs from several calls. This reads those files, keeps one record per (recipe, run, seed) (the
first file that has it wins, so list the files in order of preference), and writes the per-run
table and the step-time / NE plot with ``e2e_compare``'s own aggregation: speed-ups over the best
bf16 compile mode of the same recipe and seed (``bf16_compile`` or ``bf16_compile_cudagraphs``,
else eager ``bf16``; files from before the compiled runs have only the last), NE vs bf16 of the
same seed (eager ``bf16``, else ``bf16_compile``, else ``bf16_compile_cudagraphs``).
Step times of runs from different calls are not paired: the table names each run's source file,
and a speed-up is printed only where a run and its reference came from the same file (``other
call`` elsewhere). Usage::

    python benchmarks/combine_results.py --out benchmarks/results/H100/2026-11-25-e2e-latest \\
        benchmarks/results/H100/2026-11-25-e2e-dhen-1gpu-dense.json ...

Writes ``<out>.md``, ``<out>.json`` (the records combined, without their profiles; an input of
this script itself) and ``<out>.png``. Needs no GPU (the numbers come from the files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_compare import NE_REFERENCES, _fmt, _times, aggregate, plot, reference_words  # noqa: E402  (the same aggregation as one call's report)

from loka_torchrec.mods import MOD_NAMES, PRESETS, ModsConfig  # noqa: E402


def mods_variant(command: str) -> str:
    """What Mods a run with LoKA on applied, when overrides after its own settings changed them:
    the name of the preset that applies the same mods, else the mods joined by ``,``; ``""`` when
    LoKA is off or the run applied its own Mods (overridden or not).

    A run's command lists its own settings first and the call's extra overrides after them (the
    last value of a key wins, as in Hydra), so a ``loka.mods.*`` key after the run's first
    ``loka.mods.preset`` is an override of the call.

    Example::

        >>> mods_variant("train loka.enabled=true loka.mods.preset=all loka.mods.preset=custom loka.mods.pad_to_16=true")
        'pad_to_16'
        >>> mods_variant("train loka.enabled=false loka.mods.preset=custom loka.mods.pad_to_16=true")
        ''
        >>> mods_variant("train loka.enabled=true loka.mods.preset=all_but_no_bias loka.mods.preset=all")
        'all'
        >>> mods_variant("train loka.enabled=true loka.mods.preset=all loka.mods.preset=all")
        ''
    """
    settings: Dict[str, str] = {}
    own_preset, overridden = None, False
    for token in command.split():
        key, sep, value = token.partition("=")
        if not sep or not key.startswith("loka."):
            continue
        if key.startswith("loka.mods."):
            overridden = overridden or own_preset is not None
            if own_preset is None and key == "loka.mods.preset":
                own_preset = value
        settings[key] = value
    if not overridden or settings.get("loka.enabled") != "true":
        return ""
    switches = {name: settings.get(f"loka.mods.{name}", "false") == "true" for name in MOD_NAMES}
    enabled = ModsConfig(preset="custom", **switches).enabled if settings.get("loka.mods.preset") == "custom" else (
        ModsConfig(preset=settings.get("loka.mods.preset", "none")).enabled)  # fmt: skip
    if own_preset != "custom" and ModsConfig(preset=own_preset).enabled == enabled:
        return ""
    named = [preset for preset in PRESETS if preset != "custom" and ModsConfig(preset=preset).enabled == enabled]
    return named[0] if named else ",".join(enabled)


_BULKY = ("profile", "host_window", "gpu_window", "peak_memory_rises")
"""Record fields the combined ``<out>.json`` leaves out (they stay in each call's own file)."""


def load_records(paths: Sequence[str], exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The ``runs`` of every file, one per (recipe, run, seed), each tagged with its ``source`` file;
    ``exclude`` lists ``recipe:run`` pairs to leave out. Runs with deterministic kernels
    (``train.deterministic=true``, slower) count as their own recipe, ``<recipe>+deterministic``;
    runs whose Mods a call's override changed (:func:`mods_variant`) as their own run,
    ``<run>+mods=<variant>``.

    Raises:
        ValueError: a file is not an ``e2e_compare.py`` result (it has no ``runs`` list).
    """
    seen = set()
    records: List[Dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
            raise ValueError(f"{path}: not an e2e_compare.py result (expected a 'runs' list)")
        for record in data["runs"]:
            # (a record of a combined file carries its tags already)
            if "train.deterministic=true" in str(record.get("command", "")) and not record["recipe"].endswith("+deterministic"):
                record = {**record, "recipe": record["recipe"] + "+deterministic"}
            variant = mods_variant(str(record.get("command", "")))
            if variant and "+mods=" not in record["run"]:
                record = {**record, "run": f"{record['run']}+mods={variant}"}
            key = (record["recipe"], record["run"], record["seed"])
            if key in seen or record.get("status") != "ok" or f"{record['recipe']}:{record['run']}" in exclude:
                continue
            seen.add(key)
            records.append({**record, "source": os.path.basename(path), "device": data.get("device")})
    return records


def to_markdown(records: List[Dict[str, Any]], rows: List[Dict[str, Any]], command: str, ne_reference: str = "bf16") -> str:
    devices = sorted({str(r.get("device")) for r in records})
    lines = [
        "# Combined end-to-end results",
        "",
        f"- device(s): {', '.join(devices)}",
        f"- command: `{command}`",
        "- one record per recipe, run and seed, from the first file listed that has it; runs from different",
        "  files are different device calls, whose step times are not paired",
        "",
        "| recipe | run | seed | step ms median [p10, p90] | eval NE | eval AUC | peak GiB | FP8 / conversion | source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        fp8 = (r.get("dispatch") or {}).get("summary") or (r.get("baseline") or {}).get("kind") or "-"
        lines.append(
            f"| {r['recipe']} | {r['run']} | {r['seed']} | {_fmt(r.get('median_step_ms'), '.2f')} "
            f"[{_fmt(r.get('p10_step_ms'), '.2f')}, {_fmt(r.get('p90_step_ms'), '.2f')}] | {_fmt(r.get('eval_ne'), '.5f')} "
            f"| {_fmt(r.get('eval_auc'), '.4f')} | {_fmt(r.get('peak_memory_gb'), '.2f')} | {fp8} | `{r['source']}` |"
        )
    lines += ["", "Per recipe and run, means over seeds (speed-ups and NE differences paired by seed):", ""]
    references = {}
    for row in rows:
        references.setdefault(row["recipe"], row["speed_reference"])
    lines += [f"- {recipe}: speed-up reference {reference_words(ref)}" for recipe, ref in references.items()]
    lines += [
        "",
        f"| recipe | run | seeds | step ms | speed-up vs best bf16 compile | vs eager bf16 | NE vs {ne_reference} % [min, max] |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["status"] == "not_run":
            continue
        rng = row.get("ne_vs_bf16_pct_range")
        compiled, eager = (_in_one_call(records, row, row[refs]) for refs in ("speed_reference", "eager_reference"))
        lines.append(
            f"| {row['recipe']} | {row['run']} | {', '.join(map(str, row['seeds_ok']))} | {_fmt(row['median_step_ms'], '.2f')} "
            f"| {_side_by_side(row['speedup_vs_reference'], compiled)} | {_side_by_side(row['speedup_vs_bf16'], eager)} "
            f"| {_fmt(row['ne_vs_bf16_pct'], '+.2f')}"
            + (f" [{rng[0]:+.2f}, {rng[1]:+.2f}]" if rng else "")
            + " |"
        )
    return "\n".join(lines) + "\n"


def _in_one_call(records: List[Dict[str, Any]], row: Dict[str, Any], refs: Dict[int, Dict[str, Any]]) -> bool:
    """Whether each seed of ``row`` ran in the same file (device call) as its reference in ``refs``
    (the row's own, as :func:`aggregate` chose it): only then is a speed-up a side-by-side
    measurement, and the table prints it."""
    mine = [r for r in records if r["recipe"] == row["recipe"] and r["run"] == row["run"] and r["seed"] in refs]
    return bool(mine) and all(refs[r["seed"]]["source"] == r["source"] for r in mine)


def _side_by_side(speedup: Optional[float], in_one_call: bool) -> str:
    return _times(speedup) if speedup is None or in_one_call else "other call"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="e2e_compare.py result files (.json), in order of preference")
    p.add_argument("--out", required=True, help="output path without extension (<out>.md, <out>.png)")
    p.add_argument("--exclude", action="append", default=[], help="recipe:run to leave out (repeatable)")
    p.add_argument("--ne-reference", default=None,
                   help="the run whose eval NE of the same seed the others are compared with "
                        f"(default: the first of {', '.join(NE_REFERENCES)} that completed)")  # fmt: skip
    args = p.parse_args(argv)
    records = load_records(args.files, args.exclude)
    if not records:
        p.error("no successful runs in the given files")
    recipes = list(dict.fromkeys(r["recipe"] for r in records))  # in the order of the files
    runs = list(dict.fromkeys(r["run"] for r in records))
    if args.ne_reference is not None and args.ne_reference not in runs:
        p.error(f"--ne-reference: no successful run named {args.ne_reference!r}; the runs are {', '.join(runs)}")
    ne_references = [args.ne_reference] if args.ne_reference else NE_REFERENCES
    rows = aggregate(records, recipes, runs, ne_references)
    command = " ".join(["python benchmarks/combine_results.py --out", args.out, *[f"--exclude {e}" for e in args.exclude],
                        *([f"--ne-reference {args.ne_reference}"] if args.ne_reference else []), *args.files])  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(records, [r for r in rows if r["seeds_ok"]], command, f"`{args.ne_reference}`" if args.ne_reference else "bf16"))
    with open(args.out + ".json", "w") as f:  # the records, without their profiles: itself an input of this script
        json.dump({"device": ", ".join(sorted({str(r.get("device")) for r in records})), "command": command,
                   "runs": [{k: v for k, v in r.items() if k not in _BULKY} for r in records]}, f, indent=1)  # fmt: skip
    why_not = plot(args.out + ".png", [r for r in rows if r["seeds_ok"]], recipes)
    print(f"wrote {args.out}.md, {args.out}.json" + (f" ({why_not})" if why_not else f", {args.out}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
