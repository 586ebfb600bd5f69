"""Forced FP8 plans under ``torch.compile`` on models written outside the project: do they compile?

For the outside Wukong and HSTU of ``tests/outside_models.py`` (sized for a GPU), each of
``all:scaled_mm:tensorwise``, ``all:scaled_mm:rowwise`` and ``policy`` (the Probe, every 5 steps,
planning at step 9) runs 13 training steps through the README's loop (``loka_torchrec.prepare(...,
compile="default")``, ``with loka.step(step)``) under bf16 autocast, and prints one line per case:
whether it compiled and ran, Dynamo's graph-break count, and the plan (GEMMs in FP8, coverage).

Usage (one GPU; the project importable, e.g. ``scripts/installed_layout.sh``)::

    python benchmarks/forced_fp8_compile.py
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import traceback

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import loka_torchrec  # noqa: E402
from loka_torchrec.probe.config import ProbeConfig  # noqa: E402
from outside_models import UserHstu, UserWukong  # noqa: E402

MODES = ("all:scaled_mm:tensorwise", "all:scaled_mm:rowwise", "policy")


def _model(name: str, device: torch.device) -> torch.nn.Module:
    if name == "wukong":
        return UserWukong(ids=1000, sparse=30, dense=2, dim=128, layers=2, n_lcb=16, n_fmb=16, rank=24, hidden=1024).to(device)
    return UserHstu(dim=256, layers=2).to(device)


def _loss(name: str, model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        if name == "wukong":
            ids = torch.randint(0, 1000, (1024, 30), device=device)
            out = model(ids, torch.randn(1024, 2, device=device)).squeeze(-1)
        else:
            out = model(torch.randn(64, 64, 256, device=device)).mean(-1)
    return torch.nn.functional.binary_cross_entropy_with_logits(out.float(), torch.rand(out.shape[0], device=device))


def run_case(name: str, mode: str, device: torch.device, steps: int = 13) -> str:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _model(name, device)
    probe = ProbeConfig(enabled=mode == "policy", every=5, warmup_steps=10)
    config = loka_torchrec.LokaConfig(enabled=True, probe=probe, dispatch=loka_torchrec.DispatchConfig(mode=mode, min_speedup=0.0))
    start = time.time()
    try:
        loka = loka_torchrec.prepare(model, config, run_dir=tempfile.mkdtemp(), compile="default")
        optimizer = torch.optim.Adam(model.parameters(), 1e-3)
        for step in range(1, steps + 1):
            with loka.step(step):
                _loss(name, model, device).backward()
                optimizer.step()
                optimizer.zero_grad()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        breaks = sum(counters["graph_break"].values())
        return f"[{name} {mode}] OK in {time.time() - start:.0f}s graph_breaks={breaks} | {loka.dispatcher.plan.summary()}"
    except Exception as exc:  # noqa: BLE001 - a case that fails is the finding; the next one runs
        traceback.print_exc(limit=3)
        return f"[{name} {mode}] FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:400]}"


def main() -> int:
    logging.basicConfig(level=logging.ERROR)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in ("wukong", "hstu"):
        for mode in MODES:
            print(run_case(name, mode, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
