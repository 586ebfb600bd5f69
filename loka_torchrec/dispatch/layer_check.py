"""The layer check: a planned FP8 layer must make the whole layer step faster, or it stays bf16.

Per-GEMM evidence times one GEMM with its quantization, alone. A training step pays more: the
layer's bookkeeping on the host, quantizing the weight after every optimizer step, the
transposed operands of the backward, padding, and the kernel launches of all of it. At LRM sizes
that difference can decide the sign. So after the policy has chosen
kernels per GEMM, every layer with an FP8 GEMM is timed as a training step sees it:

* one forward and one backward of a scratch ``LokaLinear`` of the layer's size, with the planned
  kernels, against the same layer with every GEMM in high precision (``nn.Linear``'s path);
* at the layer's real row count, input dtype and autocast setting (the last forward's);
* the weight is touched in place before each repetition, as an optimizer step would, so the FP8
  weight operands are quantized in every repetition, as in training;
* wall time with the device synchronized around each repetition (host overhead counts), the two
  variants interleaved repetition by repetition so that drift hits both; under
  ``dispatch.compiled``, where the compiled step with CUDA graphs pays no host launch time, the
  device time of each variant's forward + backward replayed as a CUDA graph.

The layer keeps its FP8 kernels only if the speedup's conservative bound (bf16's 25th percentile
over FP8's 75th) reaches ``dispatch.min_speedup``; otherwise all three GEMMs go back to bf16, and
the reason, with both times, is written into the plan. Layers of identical size and kernels are
timed once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Dict, List, Optional, Tuple

import torch

from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.dispatch.plan import DispatchPlan, LayerPlan, RoleDecision
from loka_torchrec.evidence import BF16, GemmRole, Interval
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.gemm.intervals import iqr_interval
from loka_torchrec.gemm.measure import release_generator

__all__ = ["LayerTiming", "time_layer_step", "check_plan_layers"]

SOURCE = "policy/layer_check"


@dataclasses.dataclass(frozen=True)
class LayerTiming:
    """Forward + backward wall time (ms) of one layer size with FP8 kernels and in high precision."""

    fp8_ms: Interval
    bf16_ms: Interval

    @property
    def speedup(self) -> float:
        return self.bf16_ms.value / self.fp8_ms.value if self.fp8_ms.value > 0 else float("inf")

    @property
    def speedup_low(self) -> float:
        """Conservative speedup: bf16's lower bound over FP8's upper bound."""
        return self.bf16_ms.low / self.fp8_ms.high if self.fp8_ms.high > 0 else float("inf")


def time_layer_step(
    in_features: int,
    out_features: int,
    rows: int,
    kernels: LayerKernels,
    *,
    bias: bool,
    device: torch.device,
    weight_dtype: torch.dtype,
    input_dtype: torch.dtype,
    autocast_dtype: Optional[torch.dtype],
    grad_format: Fp8Format,
    reps: int,
    warmup: int = 3,
    seed: int = 0,
    device_time: bool = False,
) -> LayerTiming:
    """Time forward + backward of a ``(rows, in_features) -> (rows, out_features)`` layer, FP8 vs bf16.

    Args:
        kernels: the planned kernels (at least one FP8 GEMM, or both variants are the same).
        bias: whether the layer has a bias.
        weight_dtype: the master weight's dtype (fp32 under autocast).
        input_dtype: the dtype of the layer's input as it arrives.
        autocast_dtype: the forward runs under ``torch.autocast`` with this dtype (``None``: off).
        reps: timed repetitions per variant (interleaved); ``warmup`` untimed ones first.
        device_time: on CUDA, time both variants' forward + backward captured in CUDA graphs
            (device time, no host launch time), as a compiled step with CUDA graphs pays them;
            falls back to wall time if a variant cannot be captured. The FP8 variant's operands
            are quantized by the fused one-pass kernel, as Inductor fuses them in a compiled step
            (there even into the producing op, so the check errs on bf16's side); compiling each
            checked layer instead would cost seconds per shape in the planning step.

    Returns:
        Median and inter-quartile range of both variants' wall time per repetition, in ms.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    # The scratch layers' initialization must not move the training's random streams (only rank 0
    # runs the check; a dropout mask drawn later would otherwise depend on it).
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        variants = {
            name: LokaLinear(
                in_features, out_features, bias=bias, device=device, dtype=weight_dtype,
                kernels=layer_kernels, grad_format=grad_format,  # current scaling: no amax history to keep
            )
            for name, layer_kernels in (("fp8", kernels), ("bf16", LayerKernels()))
        }
    x = torch.randn(rows, in_features, generator=gen, device=device, dtype=torch.float32).to(input_dtype)
    x.requires_grad_(True)
    out_dtype = autocast_dtype or input_dtype
    dy = torch.randn(rows, out_features, generator=gen, device=device, dtype=torch.float32).to(out_dtype)
    cuda = device.type == "cuda"

    def one_step(layer) -> float:
        with torch.no_grad():
            layer.weight.mul_(1.0)  # what an optimizer step does to the cached FP8 weight: invalidates it
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        context = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with context:
            y = layer(x)
        y.backward(dy)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - t0) * 1e3
        x.grad = None
        layer.weight.grad = None
        if layer.bias is not None:
            layer.bias.grad = None
        return elapsed

    for _ in range(warmup):
        for layer in variants.values():
            one_step(layer)
    if device_time and cuda:
        replayed = _replayed_step_times(variants, x, dy, autocast_dtype, reps)
        if replayed is not None:
            return LayerTiming(iqr_interval(replayed["fp8"]), iqr_interval(replayed["bf16"]))
    times: Dict[str, List[float]] = {"fp8": [], "bf16": []}
    for _ in range(reps):
        for name, layer in variants.items():
            times[name].append(one_step(layer))
    return LayerTiming(iqr_interval(times["fp8"]), iqr_interval(times["bf16"]))


def _replayed_step_times(variants, x, dy, autocast_dtype, reps: int) -> Optional[Dict[str, List[float]]]:
    """Forward + backward of each variant captured as one CUDA graph, the replays timed with CUDA
    events, interleaved variant by variant; ``None`` if a variant cannot be captured.

    Each call makes its own detached aliases of the input and the parameters, so that every
    gradient accumulator the captured backward uses is made inside the capture (see
    :func:`loka_torchrec.gemm.measure.graph_replay_ms`)."""
    device = x.device

    def step_of(layer):
        def step() -> None:
            x_leaf = x.detach().requires_grad_(True)
            params = {n: p.detach().requires_grad_(True) for n, p in layer.named_parameters()}
            context = (torch.autocast(device.type, dtype=autocast_dtype, cache_enabled=False)
                       if autocast_dtype else contextlib.nullcontext())  # fmt: skip
            with context:
                y = torch.func.functional_call(layer, params, (x_leaf,))
            torch.autograd.grad(y, [x_leaf, *params.values()], dy)
        return step

    graphs = {}
    try:
        for name, layer in variants.items():
            step = step_of(layer)
            step()  # compiles and allocates outside the capture
            torch.cuda.synchronize(device)
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name], capture_error_mode="thread_local"):
                step()
    except Exception:  # noqa: BLE001 - a variant that cannot be captured: time eagerly instead
        release_generator(device)
        return None
    for graph in graphs.values():
        graph.replay()
    times: Dict[str, List[float]] = {name: [] for name in graphs}
    for _ in range(reps):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return times


def _timing_key(module, layer_plan: LayerPlan, rows: int) -> Tuple:
    return (
        module.in_features, module.out_features, rows, module.bias is not None, layer_plan.kernels,
        module.weight.dtype, getattr(module, "last_input_dtype", None), getattr(module, "last_autocast_dtype", None),
    )


def check_plan_layers(
    plan: DispatchPlan,
    layers: Dict[str, torch.nn.Module],
    *,
    min_speedup: float,
    reps: int,
    grad_format: Fp8Format,
    device_time: bool = False,
) -> Tuple[DispatchPlan, List[dict]]:
    """``plan`` with every FP8 layer that is not faster as a whole sent back to bf16.

    Args:
        plan: the policy's plan.
        layers: FQN -> ``LokaLinear`` (their ``last_rows``, ``last_input_dtype`` and
            ``last_autocast_dtype`` give the shape and precision to time at).
        min_speedup: the gate on the layer's conservative speedup.
        reps: timed repetitions per variant.
        device_time: time CUDA-graph replays (see :func:`time_layer_step`).

    A layer whose FP8 variant cannot run at its shape (an error from a backend or the compiler)
    goes back to bf16 with the error as the reason; planning goes on.

    Returns:
        ``(checked_plan, records)``: one record per checked layer with both times (ms), the
        speedup and whether FP8 was kept.
    """
    cache: Dict[Tuple, LayerTiming] = {}
    records: List[dict] = []
    checked: Dict[str, LayerPlan] = {}
    for name, layer_plan in plan.layers.items():
        module = layers.get(name)
        if module is None or layer_plan.kernels.all_high_precision:
            checked[name] = layer_plan
            continue
        rows = max(int(getattr(module, "last_rows", 0) or 0), 1)
        key = _timing_key(module, layer_plan, rows)
        if key not in cache:
            device = module.weight.device
            input_dtype = getattr(module, "last_input_dtype", None) or module.weight.dtype
            try:
                cache[key] = time_layer_step(
                    module.in_features, module.out_features, rows, layer_plan.kernels,
                    bias=module.bias is not None, device=device, weight_dtype=module.weight.dtype,
                    input_dtype=input_dtype, autocast_dtype=getattr(module, "last_autocast_dtype", None),
                    grad_format=grad_format, reps=reps, device_time=device_time,
                )
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is excluded, not fatal
                cache[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        timing = cache[key]
        if isinstance(timing, str):
            records.append({"layer": name, "rows": rows, "error": timing, "kept_fp8": False})
            checked[name] = _back_to_bf16(layer_plan, f"layer check: the FP8 layer failed to run at {rows} rows: {timing}")
            continue
        keep = timing.speedup_low >= min_speedup
        records.append({
            "layer": name, "rows": rows, "fp8_ms": timing.fp8_ms.value, "bf16_ms": timing.bf16_ms.value,
            "speedup": timing.speedup, "speedup_low": timing.speedup_low, "kept_fp8": keep,
        })  # fmt: skip
        if keep:
            checked[name] = layer_plan
            continue
        k = layer_plan.kernels
        reason = (
            f"layer check: fwd+bwd {timing.fp8_ms.value:.3f} ms with fwd={k.fwd}, dgrad={k.dgrad}, wgrad={k.wgrad} vs "
            f"{timing.bf16_ms.value:.3f} ms in bf16, {timing.speedup:.2f}x (lo {timing.speedup_low:.2f}x < {min_speedup})"
        )
        checked[name] = _back_to_bf16(layer_plan, reason)
    return dataclasses.replace(plan, layers=checked), records


def _back_to_bf16(layer_plan: LayerPlan, reason: str) -> LayerPlan:
    roles = {
        role: RoleDecision(BF16, reason, SOURCE, None, decision.considered)
        for role, decision in layer_plan.roles.items()
    }
    for role in GemmRole:
        roles.setdefault(role, RoleDecision(BF16, reason, SOURCE))
    return dataclasses.replace(layer_plan, roles=roles)
