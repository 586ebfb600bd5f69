"""Re-run the command a committed report records, into a results folder of your choice.

Git keeps the curated results: the reports (markdown), plots, ``RESULTS.md`` and the plans that
other commands read. The raw output of a run (its run folders with logs, metrics and profiles, the
JSON a report is rendered from, driver logs) is not committed. Every report records the command
that made it (``- driver:``, ``- command:`` or ``Command:`` followed by the command in backticks);
this script finds it, points the command's outputs at ``--out`` and runs it from the repository
root, so the raw files come back on the kind of machine the report names (most need a GPU)::

    python benchmarks/regenerate.py benchmarks/results/H100/2026-11-27-e2e-dhen-xl-te-compile-seed0.md --out /tmp/regen
    python benchmarks/regenerate.py REPORT.md --dry-run        # print the commands only
    python benchmarks/regenerate.py REPORT.md --set plan=PATH  # replace an option's value

What lands in ``--out``: what the command writes (``e2e_compare.py``: ``<date>-<name>.json/.md/.png``
and the run folders in ``<date>-<name>-runs/``, as the removed ``-runs.tar.gz`` archives held them;
a command given an output path: ``<report>.*``, the report's own name), and ``<report>.log`` with
the command's output.
A combined report (``combine_results.py``) reads other reports' JSON: each missing one is
regenerated first, into the same folder. The command runs as recorded apart from its outputs,
deadlines included (``--max-seconds`` was the device call's limit; ``--dry-run`` shows the
command to adjust by hand). Reports that record no ``benchmarks/`` command (hand-written analyses;
their text gives the steps) are refused with a one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
RECORDED = re.compile(r"(?:driver|command|Command):?\s*`([^`]+)`")
DATED = re.compile(r"^\d{4}-\d{2}-\d{2}-")
# Scripts whose --out is a folder (they name their files <date>-<name>.*); every other script's
# --out is a path whose last part names its output, given the report's own name here.
OUT_IS_FOLDER = {"e2e_compare.py", "gemm_bench.py", "probe_overhead.py"}
DROPPED = {"--runs-dir"}  # e2e_compare.py then writes the run folders to <out>/<date>-<name>-runs


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A report's command, split: ``env`` (leading ``VAR=value``), ``launcher`` (``torchrun`` and
    its options, or nothing), ``script`` (``benchmarks/<name>.py``) and its ``args``."""

    report: Path
    env: Dict[str, str]
    launcher: List[str]
    script: str
    args: List[str]

    @property
    def name(self) -> str:
        """The ``--name`` its files are dated with (a report renamed afterwards keeps the command's)."""
        groups = [g for g in _options(self.args) if g[0] == "--name" and len(g) > 1]
        return groups[0][1] if groups else DATED.sub("", self.report.stem)


def recorded_command(report: Path) -> Recorded:
    """The first ``benchmarks/*.py`` command that ``report`` records.

    Raises:
        ValueError: the report records none (naming the report).
    """
    for match in RECORDED.finditer(report.read_text()):
        words = shlex.split(match.group(1))
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        scripts = [i for i, w in enumerate(words) if w.startswith("benchmarks/") and w.endswith(".py")]
        if not scripts:
            continue
        head, script, args = words[: scripts[0]], words[scripts[0]], words[scripts[0] + 1 :]
        launcher = head[1:] if head and os.path.basename(head[0]) == "torchrun" else []
        return Recorded(report, env, launcher, script, args)
    raise ValueError(f"{report}: records no benchmarks/*.py command (a hand-written report: its text gives the steps)")


def _options(args: Sequence[str]) -> List[List[str]]:
    """``args`` grouped as ``[option, value...]`` (a positional argument is a group of its own)."""
    groups: List[List[str]] = []
    for word in args:
        if word.startswith("--") or not groups or not groups[-1][0].startswith("--"):
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def command_into(recorded: Recorded, out: Path, overrides: Dict[str, str], inputs: Dict[str, Path]) -> List[str]:
    """The argv that re-runs ``recorded`` with its outputs in ``out``.

    Args:
        overrides: option name (without ``--``) -> value, replacing the recorded value.
        inputs: a recorded input path -> the path to read instead (a regenerated source).

    Raises:
        ValueError: a recorded input path that does not exist here (naming the option; pass
            ``--set`` to give another).
    """
    argv: List[str] = []
    for group in _options(recorded.args):
        option = group[0] if group[0].startswith("--") else None
        values = group[1:] if option else group
        if option in DROPPED:
            continue
        if option and option[2:] in overrides:
            values = [overrides[option[2:]], *values[1:]]
        elif option == "--out":
            folder = os.path.basename(recorded.script) in OUT_IS_FOLDER
            values = [str(out if folder else out / recorded.report.stem), *values[1:]]
        elif any(v in inputs for v in values):
            values = [str(inputs.get(v, v)) for v in values]
        else:
            missing = [v for v in values if v.startswith(("/", "benchmarks/results/")) and not (ROOT / v).exists()]
            if missing:
                raise ValueError(
                    f"{recorded.report}: {option or 'an argument'} reads {missing[0]}, which is not here (a file of "
                    f"the device call?); give one with --set {(option or '--OPTION')[2:]}=PATH"
                )
        argv += ([option] if option else []) + values
    launcher = [sys.executable, "-m", "torch.distributed.run", *recorded.launcher] if recorded.launcher else [sys.executable]
    return [*launcher, recorded.script, *argv]


def written_json(recorded: Recorded, out: Path) -> Path:
    """Where the regenerated command writes its JSON: ``<out>/<today>-<name>.json`` for a script that
    dates its files, else ``<out>/<stem>.json``."""
    if os.path.basename(recorded.script) in OUT_IS_FOLDER:
        return out / f"{datetime.date.today().isoformat()}-{recorded.name}.json"
    return out / f"{recorded.report.stem}.json"


def regenerate(report: Path, out: Path, *, overrides: Dict[str, str], dry_run: bool) -> Path:
    """Re-run ``report``'s command into ``out`` (its missing JSON sources first); returns its JSON path."""
    recorded = recorded_command(report)
    inputs: Dict[str, Path] = {}
    for word in recorded.args:  # a combined report's sources: other reports' JSON
        source = ROOT / word
        if word.endswith(".json") and not source.exists() and source.with_suffix(".md").exists():
            inputs[word] = regenerate(source.with_suffix(".md"), out, overrides={}, dry_run=dry_run)
    argv = command_into(recorded, out, overrides, inputs)
    env_words = [f"{k}={v}" for k, v in recorded.env.items()]
    print(f"{report.name}: {shlex.join(env_words + argv)}", flush=True)
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{report.stem}.log", "w") as log:
            proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, **recorded.env}, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise RuntimeError(f"{report.name}: the command exited with {proc.returncode}; see {out / (report.stem + '.log')}")
    return written_json(recorded, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path, help="a report under benchmarks/results/ (.md)")
    p.add_argument("--out", type=Path, default=Path("regenerated"), help="folder for the outputs (default: ./regenerated)")
    p.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE", help="replace a recorded option's value")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.set:
        if "=" not in item:
            p.error(f"--set: expected OPTION=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.lstrip("-")] = value
    try:
        regenerate(args.report.resolve(), args.out.resolve(), overrides=overrides, dry_run=args.dry_run)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"regenerate: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
