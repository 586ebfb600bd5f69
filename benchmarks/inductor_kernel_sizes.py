"""The Triton kernels Inductor wrote into a cache directory, with their sizes and operand dtypes.

A profile names Inductor's kernels (``triton_poi_fused__to_copy_..._38``) but not the tensors they
read and write. Run a compiled program with ``TORCHINDUCTOR_CACHE_DIR`` set to an empty directory,
then this script on that directory: one line per kernel with its loop sizes (``xnumel``,
``ynumel``, ``r0_numel``), its pointer arguments' dtypes and its loads and stores, so that a profiled kernel's time gives its
effective bandwidth.

Example::

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind python benchmarks/dense_part_step.py ... --top-kernels 400
    python benchmarks/inductor_kernel_sizes.py /tmp/ind --out kernels.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from typing import Dict, List

_DEF = re.compile(r"^def (triton_\w+)\(", re.M)
_NUMEL = re.compile(r"^\s+(\w*numel) = (\d+)\s*$", re.M)
_SIGNATURE = re.compile(r"'signature': (\{[^}]*\})")


def kernels_in(directory: str) -> List[Dict]:
    """Every distinct Triton kernel source under ``directory`` (Inductor's cache layout)."""
    found: Dict[str, Dict] = {}
    for root, _, files in os.walk(directory):
        for name in files:
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(root, name), errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            if "@triton.jit" not in text:
                continue
            for match in _DEF.finditer(text):
                found.setdefault(match.group(1), _kernel_record(text, match))
    return sorted(found.values(), key=lambda k: k["kernel"])


def _kernel_record(text: str, match: "re.Match") -> Dict:
    """One kernel: its name, the sizes it assigns (``xnumel = ...``), the dtypes of its pointer
    arguments (from the decorator's signature just above it) and its load/store lines."""
    body = text[match.start():]
    end = _DEF.search(body, 1)
    body = body[: end.start()] if end else body
    signatures = _SIGNATURE.findall(text[max(0, match.start() - 3000): match.start()])
    pointers: Dict[str, str] = {}
    if signatures:
        try:
            pointers = {k: v for k, v in ast.literal_eval(signatures[-1]).items() if str(v).startswith("*")}
        except (ValueError, SyntaxError):
            pointers = {}
    return {
        "kernel": match.group(1),
        "numels": {k: int(v) for k, v in _NUMEL.findall(body)},
        "pointers": pointers,
        "accesses": [line.strip()[:200] for line in body.splitlines() if "tl.load(" in line or "tl.store(" in line],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache_dir")
    p.add_argument("--out", required=True, help="a .json file")
    args = p.parse_args(argv)
    kernels = kernels_in(args.cache_dir)
    with open(args.out, "w") as f:
        json.dump(kernels, f, indent=1)
    print(f"{len(kernels)} Triton kernels from {args.cache_dir} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
