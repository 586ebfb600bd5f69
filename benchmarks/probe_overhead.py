"""Probe overhead as a percentage of step time, for a model with LRM-sized linears.

What is measured (one process, the current device):

1. ``t_step``: median time of a plain training step (forward, backward, SGD) without the Probe;
2. ``c_idle``: extra time of a step on which the Probe is enabled but not probing (no hooks are
   registered; this is the cost of ``on_step_end``'s bookkeeping);
3. ``c_warm``: extra time of a warm-up probe step (hooks fold every row into float64 mean and
   covariance, cross-rank merge, logs);
4. ``c_eval``: one-time cost of the evaluation at the end of the warm-up window (Gaussian draws,
   every candidate's error, speed benchmarks);
5. ``c_monitor``: extra time of a probe step after the warm-up window (amax, kurtosis and
   fractions only, safety-valve check, logs).

From these, the average overhead of a run of ``L`` steps at the default cadence
(``ProbeConfig()``: every 10 steps in a 200-step warm-up, then monitoring steps every
``monitor_interval(c_monitor, t_step)`` steps, the budget rule of ``loka_torchrec.probe.cadence``) is
``(n_warm (c_warm + c_arm) + c_eval + n_mon (c_monitor + c_arm) + n_idle c_idle) / (L t_step)``,
with ``c_arm`` the cost of registering the hooks at the end of the step before each probe step
and ``t_step`` the step of a run without the Probe. A direct measurement
of ``--direct-steps`` steps at the default cadence (with and without the Probe) checks it.

Usage::

    python benchmarks/probe_overhead.py --out benchmarks/results            # CPU
    python benchmarks/probe_overhead.py --device cuda --batch 8192 --out benchmarks/results

Writes ``probe_overhead_<device>.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch
from torch import nn

from loka_torchrec.probe import ProbeCallback, ProbeConfig
from loka_torchrec.probe.cadence import monitor_interval
from loka_torchrec.probe.evaluate import device_name

# (in, out) of each linear: the K, N of 256..2048 that large recommendation models are made of
LRM_LAYERS = [(512, 1024), (1024, 1024), (1024, 2048), (2048, 512), (512, 512), (512, 256), (256, 1)]


def build_model(device: torch.device, dtype: torch.dtype) -> nn.Module:
    layers: List[nn.Module] = []
    for i, (k, n) in enumerate(LRM_LAYERS):
        layers.append(nn.Linear(k, n))
        if i + 1 < len(LRM_LAYERS):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(model, opt, batches, device, probe=None, start=0, callback_times=None) -> List[float]:
    """Times (ms) of each step, ``probe.on_step_end`` included (its own time also goes to ``callback_times``)."""
    times = []
    for i, x in enumerate(batches):
        step = start + i
        _sync(device)
        t0 = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if probe is not None:
            t1 = time.perf_counter()
            probe.on_step_end(step)
            if callback_times is not None:
                callback_times.append((time.perf_counter() - t1) * 1e3)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def make_batches(n: int, batch: int, device, dtype, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = [torch.randn(batch, LRM_LAYERS[0][0], generator=gen, device=device, dtype=torch.float32).to(dtype) for _ in range(4)]
    return [pool[i % len(pool)] for i in range(n)]


def default_cadence_overhead(t_step: float, c: Dict[str, float], run_steps_: int) -> float:
    cfg = ProbeConfig()
    steps = range(run_steps_)
    n_warm = sum(1 for s in steps if s < cfg.warmup_steps and cfg.is_probe_step(s))
    # Monitoring steps at the interval the budget rule sets for the measured monitoring extra.
    interval = monitor_interval(c["monitor"], t_step, cfg)
    n_mon = len(range(cfg.warmup_steps, run_steps_, interval)) if cfg.every_after else 0
    n_idle = run_steps_ - n_warm - n_mon
    # Every probe step is armed (hooks registered) at the end of the step before it.
    per_probe = c.get("arm", 0.0)
    extra = (
        n_warm * (c["warm"] + per_probe)
        + (c["eval"] if run_steps_ >= cfg.warmup_steps else 0.0)
        + n_mon * (c["monitor"] + per_probe)
        + n_idle * c["idle"]
    )
    return 100.0 * extra / (run_steps_ * t_step)


def idle_callback_ms(model, run_dir: str, reps: int = 200) -> float:
    """Median ms of ``on_step_end`` on a step that neither probes nor arms the next one."""
    cfg = ProbeConfig(enabled=True)
    probe = ProbeCallback(model, cfg, run_dir=run_dir, start_step=1)
    times = []
    step = 1
    while len(times) < reps:
        if not cfg.is_probe_step(step) and not cfg.is_probe_step(step + 1):
            t0 = time.perf_counter()
            probe.on_step_end(step)
            times.append((time.perf_counter() - t0) * 1e3)
        step += 1
        if step >= cfg.warmup_steps - 2:
            step = 1
    probe.close()
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default: 8192 on CUDA, 1024 on CPU)")
    parser.add_argument("--steps", type=int, default=20, help="probe steps timed per phase (as many plain steps interleave)")
    parser.add_argument("--direct-steps", type=int, default=None, help="steps of a direct run at the default cadence (default: 1000 on CUDA, 0 = skip on CPU)")
    parser.add_argument("--run-lengths", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = args.batch or (8192 if device.type == "cuda" else 1024)
    torch.manual_seed(0)
    model = build_model(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    n = args.steps
    run_steps(model, opt, make_batches(5, batch, device, dtype), device)  # warm-up of the device and allocator
    base = run_steps(model, opt, make_batches(n, batch, device, dtype), device)

    with tempfile.TemporaryDirectory() as run_dir:
        # Even steps probe, odd steps do not: every probe step has plain neighbours measured in the
        # same stretch of time, so drifting machine load cancels out. The plan is at the end of
        # the last (odd) warm-up step, 2n - 1.
        cfg = ProbeConfig(enabled=True, every=2, warmup_steps=2 * n, every_after=2, monitor_budget=0.0)
        probe = ProbeCallback(model, cfg, run_dir=run_dir)
        callback_ms: List[float] = []
        times = run_steps(model, opt, make_batches(4 * n, batch, device, dtype), device, probe, callback_times=callback_ms)
        probe.close()
        seconds = dict(probe.seconds)
    plan_step = 2 * n - 1
    med = statistics.median
    plain_warm = med(times[s] for s in range(1, plan_step, 2))
    plain_mon = med(times[s] for s in range(plan_step + 2, 4 * n, 2))
    interleaved_plain = med([times[s] for s in range(1, 4 * n, 2) if s != plan_step])
    c = {
        "warm": med(times[s] for s in range(0, plan_step, 2)) - plain_warm,
        "eval": times[plan_step] - plain_warm,
        "monitor": med(times[s] for s in range(plan_step + 1, 4 * n, 2)) - plain_mon,
        # on_step_end of a step before a probe step: it registers the hooks
        "arm": med(callback_ms[s] for s in range(1, 4 * n, 2) if s != plan_step),
    }
    with tempfile.TemporaryDirectory() as run_dir:
        c["idle"] = idle_callback_ms(model, run_dir)  # neither probing nor arming: most steps of a run
    # The denominator is a step of a run without the Probe: next to probe steps, plain steps ran
    # slower (allocator and caches disturbed), which would flatter the percentages.
    t_step = statistics.median(base)
    predicted = {L: default_cadence_overhead(t_step, c, L) for L in args.run_lengths}

    direct = None
    direct_steps = args.direct_steps if args.direct_steps is not None else (1000 if device.type == "cuda" else 0)
    if direct_steps:
        batches = make_batches(direct_steps, batch, device, dtype, seed=1)
        plain = sum(run_steps(model, opt, batches, device))
        with tempfile.TemporaryDirectory() as run_dir:
            probe = ProbeCallback(model, ProbeConfig(enabled=True), run_dir=run_dir)
            probed = sum(run_steps(model, opt, batches, device, probe))
            probe.close()
        direct = {
            "steps": direct_steps,
            "plain_ms": plain,
            "probed_ms": probed,
            "overhead_pct": 100.0 * (probed - plain) / plain,
            "predicted_pct": default_cadence_overhead(t_step, c, direct_steps),
        }

    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "batch": batch,
        "layers": LRM_LAYERS,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config_default": dataclasses.asdict(ProbeConfig()),
        "t_step_ms": t_step,
        "t_step_between_probe_steps_ms": interleaved_plain,
        "t_step_without_probe_ms": statistics.median(base),
        "extra_ms": c,
        "probe_seconds_breakdown": seconds,
        "predicted_overhead_pct": predicted,
        "direct": direct,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"probe_overhead_{device.type}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# Probe overhead on {result['device']} ({dtype}, batch {batch}, linears {LRM_LAYERS})",
        "",
        f"Command: `{result['command']}`; torch {torch.__version__}.",
        "",
        "| quantity | ms |",
        "|---|---|",
        f"| plain step, a run without the Probe (median; {interleaved_plain:.2f} between probe steps) | {t_step:.2f} |",
        f"| extra, step with Probe enabled but not probing | {c['idle']:.4f} |",
        f"| extra, the step before a probe step (registers the hooks) | {c['arm']:.3f} |",
        f"| extra, warm-up probe step | {c['warm']:.2f} |",
        f"| extra, monitoring probe step | {c['monitor']:.2f} |",
        f"| one-time evaluation at the end of warm-up | {c['eval']:.1f} |",
        "",
        "| run length (steps), default cadence | predicted overhead |",
        "|---|---|",
        *[f"| {L} | {p:.2f}% |" for L, p in predicted.items()],
    ]
    if direct:
        lines += ["", f"Direct run of {direct['steps']} steps at the default cadence: {direct['overhead_pct']:.1f}% measured, {direct['predicted_pct']:.1f}% predicted."]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
