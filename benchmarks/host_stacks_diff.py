"""Which Python functions make one run's host step longer than another's.

Reads the ``host_stacks`` of two runs' ``rank<r>/profile.json`` (the reference job with
``train.profile_start=N train.profile_host_stacks=true``) and prints the functions whose time
on the training thread's stack (inclusive) or on top of it (self) differs most, in ms per step::

    python benchmarks/host_stacks_diff.py RUNS/plain_compile_cudagraphs/seed0/rank0/profile.json \\
        RUNS/bf16_nomods_compile_cudagraphs/seed0/rank0/profile.json

A function in only one of the two top lists counts as 0 ms in the other (the lists hold each run's
top functions only, so a small difference near the bottom of a list may be that cut).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Tuple


def load_stacks(path: str) -> Dict:
    """The ``host_stacks`` section of a ``profile.json``; ``ValueError`` naming the file if it has none."""
    with open(path) as f:
        report = json.load(f)
    stacks = report.get("host_stacks")
    if not stacks:
        raise ValueError(f"{path}: no host_stacks (run the job with train.profile_host_stacks=true and train.profile_start)")
    return stacks


def differences(a: Dict, b: Dict, kind: str, top: int = 20) -> List[Tuple[str, float, float]]:
    """``(function, ms/step in a, ms/step in b)`` of ``kind`` (``"inclusive"`` or ``"self"``), largest ``|b - a|`` first."""
    ms_a = {r["function"]: r["ms_per_step"] for r in a[kind]}
    ms_b = {r["function"]: r["ms_per_step"] for r in b[kind]}
    rows = [(name, ms_a.get(name, 0.0), ms_b.get(name, 0.0)) for name in set(ms_a) | set(ms_b)]
    rows.sort(key=lambda r: -abs(r[2] - r[1]))
    return rows[:top]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="the reference run's profile.json")
    parser.add_argument("b", help="the other run's profile.json")
    parser.add_argument("--top", type=int, default=20, help="rows per list (default 20)")
    args = parser.parse_args(argv)
    try:
        a, b = load_stacks(args.a), load_stacks(args.b)
    except (OSError, ValueError) as exc:
        print(f"host_stacks_diff: {exc}", file=sys.stderr)
        return 2
    print(f"wall ms/step: a {a['wall_ms_per_step']:.2f}, b {b['wall_ms_per_step']:.2f} (sampled steps)")
    for kind in ("inclusive", "self"):
        print(f"\n{kind}: a ms/step, b ms/step, b - a")
        for name, ms_a, ms_b in differences(a, b, kind, args.top):
            print(f"{ms_a:8.3f} {ms_b:8.3f} {ms_b - ms_a:+8.3f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
