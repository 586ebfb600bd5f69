"""One table and one plot from several committed ``e2e_compare.py`` results.

Each device call writes its own ``<date>-<name>.json``; a comparison across recipes usually needs
runs from several calls. This reads those files, keeps one record per (recipe, run, seed) (the
first file that has it wins, so list the files in order of preference), and writes the per-run
table and the step-time / NE plot with ``e2e_compare``'s own aggregation: speed-ups over the best
bf16 compile mode of the same recipe and seed (``bf16_compile`` or ``bf16_compile_cudagraphs``,
else eager ``bf16``; files from before the compiled runs have only the last), NE vs bf16 of the
same seed (eager ``bf16``, else ``bf16_compile``, else ``bf16_compile_cudagraphs``).
Step times of runs from different calls are not paired: the table names each run's source file,
and the reader should compare within a file where it matters. Usage::

    python benchmarks/combine_results.py --out benchmarks/results/H100/2026-11-25-e2e-latest \\
        benchmarks/results/H100/2026-11-25-e2e-dhen-1gpu-dense.json ...

Writes ``<out>.md`` and ``<out>.png``. Needs no GPU (the numbers come from the files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_compare import _fmt, _times, aggregate, plot, reference_words  # noqa: E402  (the same aggregation as one call's report)


def load_records(paths: Sequence[str], exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The ``runs`` of every file, one per (recipe, run, seed), each tagged with its ``source`` file;
    ``exclude`` lists ``recipe:run`` pairs to leave out. Runs with deterministic kernels
    (``train.deterministic=true``, slower) count as their own recipe, ``<recipe>+deterministic``.

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
            if "train.deterministic=true" in str(record.get("command", "")):
                record = {**record, "recipe": record["recipe"] + "+deterministic"}
            key = (record["recipe"], record["run"], record["seed"])
            if key in seen or record.get("status") != "ok" or f"{record['recipe']}:{record['run']}" in exclude:
                continue
            seen.add(key)
            records.append({**record, "source": os.path.basename(path), "device": data.get("device")})
    return records


def to_markdown(records: List[Dict[str, Any]], rows: List[Dict[str, Any]], command: str) -> str:
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
    lines += ["", "Per recipe and run, means over seeds (speed-ups and NE vs bf16 paired by seed):", ""]
    references = {}
    for row in rows:
        references.setdefault(row["recipe"], row["speed_reference"])
    lines += [f"- {recipe}: speed-up reference {reference_words(ref)}" for recipe, ref in references.items()]
    lines += [
        "",
        "| recipe | run | seeds | step ms | speed-up vs best bf16 compile | vs eager bf16 | NE vs bf16 % [min, max] |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["status"] == "not_run":
            continue
        rng = row.get("ne_vs_bf16_pct_range")
        lines.append(
            f"| {row['recipe']} | {row['run']} | {', '.join(map(str, row['seeds_ok']))} | {_fmt(row['median_step_ms'], '.2f')} "
            f"| {_times(row['speedup_vs_reference'])} | {_times(row['speedup_vs_bf16'])} | {_fmt(row['ne_vs_bf16_pct'], '+.2f')}"
            + (f" [{rng[0]:+.2f}, {rng[1]:+.2f}]" if rng else "")
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="e2e_compare.py result files (.json), in order of preference")
    p.add_argument("--out", required=True, help="output path without extension (<out>.md, <out>.png)")
    p.add_argument("--exclude", action="append", default=[], help="recipe:run to leave out (repeatable)")
    args = p.parse_args(argv)
    records = load_records(args.files, args.exclude)
    if not records:
        p.error("no successful runs in the given files")
    recipes = list(dict.fromkeys(r["recipe"] for r in records))  # in the order of the files
    runs = list(dict.fromkeys(r["run"] for r in records))
    rows = aggregate(records, recipes, runs)
    command = " ".join(["python benchmarks/combine_results.py --out", args.out, *[f"--exclude {e}" for e in args.exclude], *args.files])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(records, [r for r in rows if r["seeds_ok"]], command))
    why_not = plot(args.out + ".png", [r for r in rows if r["seeds_ok"]], recipes)
    print(f"wrote {args.out}.md" + (f" ({why_not})" if why_not else f", {args.out}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
