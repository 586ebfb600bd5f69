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

**One kernel for the layer.** Per GEMM the policy picks the fastest accurate kernel, and the three
picks may differ (say tensorwise for forward and grad-input, rowwise for grad-weight). A layer
whose GEMMs share one recipe shares their quantizations: a tensorwise ``x`` quantized for the
forward is, transposed, grad-weight's operand too, while a rowwise grad-weight needs ``x^T`` and
``dy^T`` quantized again along the other axis. That saving exists only in the whole layer, so the
check times, beside the policy's choice, up to :data:`MAX_SHARED_ALTERNATIVES` layers that run
one candidate in every role where that candidate passes the accuracy gate (the plan's
``max_mere`` and ``max_grad_noise_ratio``; roles where it does not stay bf16), the candidates
ranked by the GEMM time their evidence says they save. The fastest FP8 variant is the layer's.

The layer keeps FP8 only if that variant's conservative speedup (bf16's 25th percentile over its
75th) reaches ``dispatch.min_speedup``; otherwise all three GEMMs go back to bf16, and the reason,
with the times, is written into the plan. Layers of identical size, kernels and alternatives are
timed once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.dispatch.plan import DispatchPlan, LayerPlan, RoleDecision
from loka_torchrec.dispatch.policy import passes_accuracy_gate, usable
from loka_torchrec.evidence import BF16, CandidateEvidence, GemmRole, Interval, KernelChoice
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.gemm.intervals import iqr_interval
from loka_torchrec.gemm.measure import release_generator

__all__ = ["LayerTiming", "time_layer_variants", "shared_alternatives", "check_plan_layers"]

SOURCE = "policy/layer_check"
MAX_SHARED_ALTERNATIVES = 3
"""How many one-candidate layers the check times beside the policy's per-GEMM choice."""
_ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)


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


def time_layer_variants(
    in_features: int,
    out_features: int,
    rows: int,
    variants: Dict[str, LayerKernels],
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
) -> Dict[str, Interval]:
    """Time forward + backward of a ``(rows, in_features) -> (rows, out_features)`` layer under each
    of ``variants`` and in high precision, interleaved repetition by repetition.

    Args:
        variants: name -> kernels; the result adds ``"bf16"``, every GEMM in high precision
            (``nn.Linear``'s path).
        bias: whether the layer has a bias.
        weight_dtype: the master weight's dtype (fp32 under autocast).
        input_dtype: the dtype of the layer's input as it arrives.
        autocast_dtype: the forward runs under ``torch.autocast`` with this dtype (``None``: off).
        reps: timed repetitions per variant (interleaved); ``warmup`` untimed ones first.
        device_time: on CUDA, time each variant's forward + backward captured in a CUDA graph
            (device time, no host launch time), as a compiled step with CUDA graphs pays them;
            falls back to wall time if a variant cannot be captured. The FP8 variants' operands
            are quantized by the fused one-pass kernel, as Inductor fuses them in a compiled step
            (there even into the producing op, so the check errs on bf16's side); compiling each
            checked layer instead would cost seconds per shape in the planning step.

    Returns:
        Median and inter-quartile range of each variant's time per repetition (ms), by name.
    """
    if "bf16" in variants:
        raise ValueError("variants: the name 'bf16' is the high-precision reference's")
    gen = torch.Generator(device=device).manual_seed(seed)
    # The scratch layers' initialization must not move the training's random streams (only rank 0
    # runs the check; a dropout mask drawn later would otherwise depend on it).
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        layers = {
            name: LokaLinear(
                in_features, out_features, bias=bias, device=device, dtype=weight_dtype,
                kernels=layer_kernels, grad_format=grad_format,
            )
            for name, layer_kernels in (*variants.items(), ("bf16", LayerKernels()))
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
        for layer in layers.values():
            one_step(layer)
    times = _replayed_step_times(layers, x, dy, autocast_dtype, reps) if device_time and cuda else None
    if times is None:
        times = {name: [] for name in layers}
        for _ in range(reps):
            for name, layer in layers.items():
                times[name].append(one_step(layer))
    return {name: iqr_interval(t) for name, t in times.items()}


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


def shared_alternatives(layer_plan: LayerPlan, *, max_mere: float, max_noise_ratio: float = 0.0,
                        limit: int = MAX_SHARED_ALTERNATIVES) -> List[LayerKernels]:  # fmt: skip
    """Layers that run one FP8 candidate in every role where it passes the accuracy gate.

    From the evidence each role's decision considered: per candidate, the roles where it is usable
    and accurate (:func:`~loka_torchrec.dispatch.policy.passes_accuracy_gate`); those roles on it,
    the others bf16. Variants equal to the plan's own kernels are left out; at most ``limit``,
    ranked by the GEMM time their evidence says they save over bf16 (most first).
    """
    accurate: Dict[KernelChoice, Dict[GemmRole, CandidateEvidence]] = {}
    for role, decision in layer_plan.roles.items():
        for e in decision.considered:
            if usable(e) and passes_accuracy_gate(e, max_mere=max_mere, max_noise_ratio=max_noise_ratio):
                accurate.setdefault(KernelChoice(e.candidate.backend, e.candidate.recipe), {})[role] = e
    ranked = []
    for choice, by_role in accurate.items():
        kernels = LayerKernels(*(choice if role in by_role else BF16 for role in _ROLES))
        if kernels == layer_plan.kernels:
            continue
        saved_ms = sum(e.baseline_time_ms.value - e.time_ms.value for e in by_role.values())
        ranked.append((-saved_ms, str(choice), kernels))
    return [kernels for _, _, kernels in sorted(ranked)[:limit]]


def _timing_key(module, kernels: Tuple[LayerKernels, ...], rows: int) -> Tuple:
    return (
        module.in_features, module.out_features, rows, module.bias is not None, kernels,
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
    """``plan`` with each FP8 layer on its fastest variant, or back in bf16 where none is faster as a whole.

    Args:
        plan: the policy's plan (its ``gates`` give the accuracy bar of the shared-kernel alternatives;
            a plan without ``max_mere`` gets none).
        layers: FQN -> ``LokaLinear`` (their ``last_rows``, ``last_input_dtype`` and
            ``last_autocast_dtype`` give the shape and precision to time at).
        min_speedup: the gate on the layer's conservative speedup.
        reps: timed repetitions per variant.
        device_time: time CUDA-graph replays (see :func:`time_layer_variants`).

    A layer whose variants cannot run at its shape (an error from a backend or the compiler) goes
    back to bf16 with the error as the reason; planning goes on.

    Returns:
        ``(checked_plan, records)``: one record per checked layer with the chosen variant's and
        bf16's times (ms), the speedup, every timed variant, and whether FP8 was kept.
    """
    max_mere = plan.gates.get("max_mere")
    max_noise_ratio = plan.gates.get("max_grad_noise_ratio", 0.0) or 0.0
    cache: Dict[Tuple, Any] = {}
    records: List[dict] = []
    checked: Dict[str, LayerPlan] = {}
    for name, layer_plan in plan.layers.items():
        module = layers.get(name)
        if module is None or layer_plan.kernels.all_high_precision:
            checked[name] = layer_plan
            continue
        rows = max(int(getattr(module, "last_rows", 0) or 0), 1)
        alternatives = [] if max_mere is None else shared_alternatives(layer_plan, max_mere=max_mere, max_noise_ratio=max_noise_ratio)
        variants = {"planned": layer_plan.kernels, **{f"shared {i}": k for i, k in enumerate(alternatives)}}
        key = _timing_key(module, tuple(variants.values()), rows)
        if key not in cache:
            input_dtype = getattr(module, "last_input_dtype", None) or module.weight.dtype
            try:
                cache[key] = time_layer_variants(
                    module.in_features, module.out_features, rows, variants,
                    bias=module.bias is not None, device=module.weight.device, weight_dtype=module.weight.dtype,
                    input_dtype=input_dtype, autocast_dtype=getattr(module, "last_autocast_dtype", None),
                    grad_format=grad_format, reps=reps, device_time=device_time,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is excluded, not fatal
                cache[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        times = cache[key]
        if isinstance(times, str):
            records.append({"layer": name, "rows": rows, "error": times, "kept_fp8": False})
            checked[name] = _back_to_bf16(layer_plan, f"layer check: the FP8 layer failed to run at {rows} rows: {times}")
            continue
        best = min(variants, key=lambda v: times[v].value)
        timing = LayerTiming(times[best], times["bf16"])
        keep = timing.speedup_low >= min_speedup
        records.append({
            "layer": name, "rows": rows, "fp8_ms": timing.fp8_ms.value, "bf16_ms": timing.bf16_ms.value,
            "speedup": timing.speedup, "speedup_low": timing.speedup_low, "kept_fp8": keep,
            "kernels": variants[best].to_dict(), "shared": best != "planned",
            "variants": [{"kernels": k.to_dict(), "ms": times[v].value} for v, k in variants.items()],
        })  # fmt: skip
        if keep:
            checked[name] = layer_plan if best == "planned" else _on_shared(layer_plan, variants[best], times, best)
            continue
        k = variants[best]
        reason = (
            f"layer check: fwd+bwd {timing.fp8_ms.value:.3f} ms with fwd={k.fwd}, dgrad={k.dgrad}, wgrad={k.wgrad} vs "
            f"{timing.bf16_ms.value:.3f} ms in bf16, {timing.speedup:.2f}x (lo {timing.speedup_low:.2f}x < {min_speedup})"
        )
        checked[name] = _back_to_bf16(layer_plan, reason)
    return dataclasses.replace(plan, layers=checked), records


def _on_shared(layer_plan: LayerPlan, kernels: LayerKernels, times: Dict[str, Interval], best: str) -> LayerPlan:
    """``layer_plan`` with its roles on the shared-kernel variant ``kernels``, each decision keeping
    its considered evidence and the chosen candidate's own evidence."""
    reason = (
        f"layer check: one kernel for the layer, fwd+bwd {times[best].value:.3f} ms against "
        f"{times['planned'].value:.3f} ms with the per-GEMM choice and {times['bf16'].value:.3f} ms in bf16"
    )
    roles = {}
    for role in _ROLES:
        choice = kernels.for_role(role)
        decision = layer_plan.roles.get(role)
        considered = decision.considered if decision is not None else ()
        evidence = next((e for e in considered if str(e.candidate) == str(choice)), None)
        roles[role] = RoleDecision(choice, reason, SOURCE, None if choice.is_high_precision else evidence, considered)
    return dataclasses.replace(layer_plan, roles=roles)


def _back_to_bf16(layer_plan: LayerPlan, reason: str) -> LayerPlan:
    roles = {
        role: RoleDecision(BF16, reason, SOURCE, None, decision.considered)
        for role, decision in layer_plan.roles.items()
    }
    for role in GemmRole:
        roles.setdefault(role, RoleDecision(BF16, reason, SOURCE))
    return dataclasses.replace(layer_plan, roles=roles)
