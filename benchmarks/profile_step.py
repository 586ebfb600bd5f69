"""Where the time of a ``LokaLinear`` training step and of the Probe goes, on the current device.

Prints, for each case, the host time per call (``perf_counter``, the device synchronized once at
the end), the device time per call (CUDA events), the torch profiler's top operators by self CPU
and self device time, and ``cProfile``'s top Python functions. Cases:

* ``linear``: ``LokaLinear`` forward + backward (``torch.autograd.grad``) per backend and recipe,
  against ``nn.Linear``, at one LRM shape (``--graphs``: each also replaying CUDA graphs);
* ``probe``: a warm-up probe step, a monitoring probe step and the evaluation at the end of the
  warm-up window, on a small MLP of LRM-sized linears.

Usage::

    python benchmarks/profile_step.py --cases linear,probe --shape 8192x1024x1024 [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from typing import Callable, List

import torch
from torch import nn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_and_device_ms(fn: Callable[[], object], device: torch.device, reps: int) -> "tuple[float, float]":
    """(host ms per call with one sync at the end, device ms per call from events around the loop)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        end.record()
    _sync(device)
    host = (time.perf_counter() - t0) * 1e3 / reps
    dev = start.elapsed_time(end) / reps if device.type == "cuda" else float("nan")
    return host, dev


def profile_tables(fn: Callable[[], object], device: torch.device, reps: int, rows: int = 22) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn()
        _sync(device)
    averages = prof.key_averages()
    out = [averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if device.type == "cuda":
        out.append(averages.table(sort_by="self_cuda_time_total", row_limit=12))
    return "\n".join(out)


def python_profile(fn: Callable[[], object], reps: int, rows: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(rows)
    return stream.getvalue()


def case_linear(device: torch.device, shape, choices: List[str], reps: int, graphs: bool = False) -> None:
    from loka_torchrec.gemm.backends import get_backend
    from loka_torchrec.dispatch.layer_kernels import LayerKernels
    from loka_torchrec.dispatch.linear import LokaLinear
    from loka_torchrec.evidence import KernelChoice

    for module in ("fbgemm", "transformer_engine", "triton"):
        __import__(f"loka_torchrec.gemm.backends.{module}")
    m, k, n = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    linear = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype) * 1e-3

    def step(layer):
        def run():
            with torch.no_grad():
                layer.weight.mul_(1.0)
            return torch.autograd.grad(layer(x), (x, layer.weight), dy)

        return run

    layers = [("nn.Linear", linear)]
    for text in choices:
        choice = KernelChoice.parse(text)
        if choice.backend != "bf16" and not get_backend(choice.backend).availability(device).ok:
            print(f"--- {text}: unavailable: {get_backend(choice.backend).availability(device).reason}")
            continue
        layers.append((text, LokaLinear.from_linear(linear, kernels=LayerKernels.uniform(choice))))
        if graphs:  # the layer as a compiled step runs it: Inductor, CUDA graphs on a GPU
            compiled = torch.compile(LokaLinear.from_linear(linear, kernels=LayerKernels.uniform(choice)), mode="reduce-overhead")
            layers.append((f"{text}+compile", compiled))
    for label, layer in layers:
        run = step(layer)
        host, dev = host_and_device_ms(run, device, reps)
        print(f"\n=== linear {m}x{k}x{n} {label}: host {host:.3f} ms/step, device {dev:.3f} ms/step", flush=True)
        if label != "nn.Linear":
            print(profile_tables(run, device, 10))
            print(python_profile(run, 20))


def case_probe(device: torch.device, batch: int) -> None:
    from loka_torchrec.probe import ProbeCallback, ProbeConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 512, device=device, dtype=dtype)

    def train_step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain_host, plain_dev = host_and_device_ms(train_step, device, 20)
    print(f"\n=== probe: plain step host {plain_host:.3f} ms, device {plain_dev:.3f} ms", flush=True)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = ProbeConfig(enabled=True, every=1, warmup_steps=6, every_after=1, monitor_budget=0.0)
        probe = ProbeCallback(model, cfg, run_dir=run_dir)
        step = [0]

        def probed_step():
            train_step()
            probe.on_step_end(step[0])
            step[0] += 1

        def time_and_profile(label: str) -> None:
            """One probe step timed, then one more under each profiler (every step probes: every=1)."""
            _sync(device)
            t0 = time.perf_counter()
            probed_step()
            _sync(device)
            print(f"=== probe: {label} {1e3 * (time.perf_counter() - t0):.2f} ms (plain {plain_host:.2f})")
            print(profile_tables(probed_step, device, 1))
            print(python_profile(probed_step, 1))

        probed_step()  # first probe step: allocation
        time_and_profile("warm-up probe step")
        while step[0] < cfg.warmup_steps - 1:
            probed_step()
        _sync(device)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        probed_step()  # the evaluation at the end of the warm-up window
        _sync(device)
        prof.disable()
        print(f"=== probe: evaluation step {time.perf_counter() - t0:.2f} s; probe.seconds {dict(probe.seconds)}")
        stream = io.StringIO()
        pstats.Stats(prof, stream=stream).sort_stats("cumulative").print_stats(40)
        print(stream.getvalue())
        time_and_profile("monitoring probe step")
        probe.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", default="linear,probe")
    parser.add_argument("--shape", default="8192x1024x1024")
    parser.add_argument("--choices", default="scaled_mm:rowwise,scaled_mm:tensorwise,te:tensorwise,triton:rowwise")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--graphs", action="store_true", help="linear: also each choice compiled (torch.compile, reduce-overhead)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = tuple(int(v) for v in args.shape.split("x"))
    cases = set(args.cases.split(","))
    if "linear" in cases:
        case_linear(device, shape, [c for c in args.choices.split(",") if c], args.reps, graphs=args.graphs)
    if "probe" in cases:
        case_probe(device, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
