"""Whether a serving layer's FP8 forward is faster than its high-precision one, at the serving rows.

Training chose each GEMM's kernel at training's row count, forward and backward together. Serving
runs the forward alone, often at far fewer rows (a request batch of a few hundred), where the casts
of an FP8 layer can cost more than its GEMM saves. :func:`time_serving_forward` times both forms of
one layer at the serving rows, on the layer's device and in the dtype serving feeds it (bf16 on CUDA,
float32 elsewhere):

* CUDA: each form's forward compiled (``torch.compile``, static shapes) and captured in a CUDA graph
  and replayed: device time, as a compiled model with CUDA graphs pays it. Compiled, Inductor makes
  the FP8 input's amax and cast one or two kernels. Eagerly the cast alone is half a dozen passes
  over a float32 copy of the input, which at thousands of rows costs more than the FP8 GEMM saves,
  so an eager timing would send every layer back to high precision. Where capture fails: CUDA
  events around each call;
* elsewhere: wall time around each call, the two forms interleaved call by call so that drift hits
  both (a CPU is a test bed, not a target);
* the median with its quartiles.

:func:`loka_torchrec.inference_modules` keeps a layer in FP8 at ``serving_rows`` only where the
conservative speedup (high precision's 25th percentile over FP8's 75th) reaches ``min_speedup``.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from loka_torchrec.compile import compiled_call
from loka_torchrec.evidence import Interval
from loka_torchrec.gemm.intervals import iqr_interval
from loka_torchrec.gemm.measure import call_times_ms, graph_replay_ms

__all__ = ["ServingTimer", "time_serving_forward"]

ServingTimer = Callable[[nn.Module, nn.Module, int], Tuple[Interval, Interval]]
"""``(fp8_layer, high_precision_layer, rows) -> (fp8_ms, high_precision_ms)``."""


@torch.no_grad()
def time_serving_forward(fp8: nn.Module, high_precision: nn.Module, rows: int, *, reps: int = 20) -> Tuple[Interval, Interval]:
    """Forward time (ms) of the two forms of one ``(in_features -> out_features)`` layer at ``rows``.

    Args:
        fp8: the FP8 serving layer (``Fp8InferenceLinear``).
        high_precision: the same layer as ``nn.Linear``.
        rows: the serving batch's rows.
        reps: timed calls of each form.

    Returns:
        ``(fp8_ms, high_precision_ms)``: median and quartiles of each.
    """
    if rows < 1:
        raise ValueError(f"rows: expected the serving batch's rows, >= 1, got {rows!r}")
    weight = high_precision.weight
    device = weight.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(rows, high_precision.in_features, device=device, dtype=torch.float32).to(dtype)
    plain = nn.Linear(high_precision.in_features, high_precision.out_features, bias=high_precision.bias is not None,
                      device=device, dtype=dtype)  # fmt: skip
    plain.weight.copy_(weight)
    if plain.bias is not None:
        plain.bias.copy_(high_precision.bias)
    modules = {"fp8": fp8, "hp": plain}
    if device.type == "cuda":  # as the compiled serving model runs them
        modules = {name: compiled_call(module, dynamic=False) for name, module in modules.items()}
    forms = {name: functools.partial(module, x) for name, module in modules.items()}
    times: Dict[str, List[float]] = {name: [] for name in forms}
    if device.type == "cuda":
        for name, call in forms.items():
            call()  # workspaces, first-call set-up: outside the capture
            replayed = graph_replay_ms([call], reps=reps, device=device)
            times[name] = replayed if replayed is not None else call_times_ms(call, reps=reps, device=device)
    else:
        for call in forms.values():
            call()
        for _ in range(reps):
            for name, call in forms.items():
                times[name] += call_times_ms(call, reps=1, device=device, warmup=0)
    return iqr_interval(times["fp8"]), iqr_interval(times["hp"])
