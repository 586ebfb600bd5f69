"""``inference_modules``: a trained model for serving, with the FP8 layers that training kept in FP8.

After training, each :class:`~loka_torchrec.LokaLinear` runs its forward GEMM on the kernel that is
in force (the plan, less what the safety valve, the step-time guard and the checks returned to
bf16). :func:`inference_modules` turns the model into one that runs that forward alone:

* a layer whose forward GEMM is FP8 with tensorwise or rowwise scaling becomes an
  :class:`Fp8InferenceLinear`: its weight quantized once (E4M3, the plan's granularity, K and N
  zero-padded to multiples of 16 as ``torch._scaled_mm`` on CUDA wants), its input quantized per
  call from its own amax (dynamic scaling), the GEMM ``torch._scaled_mm`` with the plan's
  accumulation (``_fast_accum`` or not) whatever backend trained it (the same operands and
  scales: the codes are the backends' common format);
* every other layer becomes a plain ``nn.Linear`` (bf16 under the caller's autocast), and the
  modules whose own Parameters LoKA reached run their own ``forward`` again
  (:func:`~loka_torchrec.plain_modules`); blockwise FP8 layers and the output projection of an
  ``nn.MultiheadAttention`` (which reads the weight itself) stay high precision here, with the
  reason in the report;
* the mods stay: the model keeps the architecture it trained with.

**Input scales.** ``input_scaling="dynamic"`` (default) scales each call's input by its own amax.
``"static"`` uses what training learned where it is safe: a tensorwise layer whose recorded input amaxes
stayed within ``STABLE_AMAX_RATIO`` of their median gets a fixed scale from the largest of them; its
casts then need no amax pass (a compiled model fuses them into the producer), and a serving input beyond
that amax saturates to the format's maximum. The amaxes are those of the layer's last training calls
where its delayed scaling kept them (``GemmSite._amax_history``, a compiled run), else those of the
Probe's last probe steps (``input_amaxes``, from ``ProbeCallback.input_amaxes``), which a run with
current scaling or without compile has too. Every other layer stays dynamic, and the report says why.

The result holds only torch modules and aten ops in its forward, so ``torch.export`` captures it and
a process without this project loads it (``torch.export.load``): see :func:`export_program`.

With ``serving_rows``, a layer stays FP8 only where its forward, compiled, is faster at that many rows
than in high precision (:mod:`loka_torchrec.inference_timing`). Not yet: the embedding tables (served
by TorchRec's own inference path, e.g. its int8 tables from ``torchrec.inference.modules.quantize_embeddings``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.evidence import GemmRole, Interval
from loka_torchrec.fp8 import Granularity, quantize
from loka_torchrec.gemm.recipes import RECIPE_GRANULARITY, split_fast_accum
from loka_torchrec.inference_timing import ServingTimer, time_serving_forward
from loka_torchrec.plain import plain_modules

__all__ = ["Fp8InferenceLinear", "InferenceReport", "INPUT_SCALINGS", "STABLE_AMAX_RATIO", "export_program", "inference_modules"]

ALIGNMENT = 16
"""K and N of every exported FP8 weight are padded to a multiple of this (``torch._scaled_mm`` on CUDA)."""
STABLE_AMAX_RATIO = 1.5
"""``input_scaling="static"``: a layer's recorded input amaxes must all be within this factor of their median."""
INPUT_SCALINGS = ("dynamic", "static")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Fp8InferenceLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in FP8 (E4M3) and ``x`` quantized per call; forward only.

    Args:
        weight: ``(out_features, in_features)``, quantized here (then no longer needed).
        bias: ``(out_features,)`` or ``None``; kept in float32.
        granularity: ``"tensorwise"`` (one scale per tensor) or ``"rowwise"`` (one per row of the
            input and one per output feature).
        fast_accum: ``torch._scaled_mm``'s ``use_fast_accum``.
        input_amax: tensorwise only: scale every input by this amax (static; values beyond it
            saturate) instead of each input's own (``None``: dynamic).

    Example::

        >>> layer = Fp8InferenceLinear(torch.randn(32, 64), torch.zeros(32), "rowwise")
        >>> layer(torch.randn(4, 64)).shape, layer.weight_fp8.dtype
        (torch.Size([4, 32]), torch.float8_e4m3fn)
    """

    def __init__(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor], granularity: str, fast_accum: bool = False,
        input_amax: Optional[float] = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight: expected (out_features, in_features), got shape {tuple(weight.shape)}")
        if granularity not in ("tensorwise", "rowwise"):
            raise ValueError(f"granularity: expected tensorwise or rowwise, got {granularity!r}")
        if input_amax is not None and (granularity != "tensorwise" or not input_amax > 0 or input_amax == float("inf")):
            raise ValueError(f"input_amax: a finite amax > 0, for tensorwise layers only; got {input_amax!r} ({granularity})")
        self.out_features, self.in_features = weight.shape
        self.granularity = granularity
        self.fast_accum = bool(fast_accum)
        n_pad = _round_up(self.out_features, ALIGNMENT) - self.out_features
        k_pad = _round_up(self.in_features, ALIGNMENT) - self.in_features
        padded = F.pad(weight.detach().float(), (0, k_pad, 0, n_pad))
        q = quantize(padded, "e4m3", granularity, name="weight")
        self.register_buffer("weight_fp8", q.data)
        # (N, 1) per output feature for rowwise: as _scaled_mm's scale_b it is read as (1, N)
        self.register_buffer("weight_scale", q.dequant_scale if granularity == "tensorwise" else q.dequant_scale.t().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        amax = None if input_amax is None else torch.tensor(float(input_amax), dtype=torch.float32, device=weight.device)
        self.register_buffer("input_amax", amax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        k_pad = self.weight_fp8.shape[1] - self.in_features
        if k_pad:
            x2 = F.pad(x2, (0, k_pad))
        # bf16 in, no float32 copy first: the scale is float32 either way, and bf16 * float32 is exact
        q = quantize(x2, "e4m3", self.granularity, nonfinite="propagate", name="input", amax=self.input_amax)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        mm_dtype = torch.bfloat16 if (x.is_cuda and self.granularity == "rowwise") else out_dtype
        out = torch._scaled_mm(
            q.data, self.weight_fp8.t(), scale_a=q.dequant_scale, scale_b=self.weight_scale, out_dtype=mm_dtype,
            use_fast_accum=self.fast_accum,
        )  # fmt: skip
        out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.to(out_dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        accum = ", fast_accum" if self.fast_accum else ""
        scaling = "dynamic" if self.input_amax is None else f"static input amax {float(self.input_amax):.4g}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 {self.granularity}{accum}, {scaling}"


@dataclasses.dataclass(frozen=True)
class InferenceReport:
    """What :func:`inference_modules` made of each converted layer.

    Attributes:
        fp8: ``{layer name: "rowwise" | "tensorwise" (+ "_fast_accum")}``: the layers now FP8.
        high_precision: ``{layer name: why}``: the layers now plain ``nn.Linear``.
        static_inputs: ``{layer name: input amax}``: FP8 layers with a static input scale.
        dynamic_inputs: ``{layer name: why}``: FP8 layers left dynamic under ``input_scaling="static"``.
        timings: ``{layer name: {"rows", "fp8_ms", "high_precision_ms"}}`` where ``serving_rows`` timed it.
    """

    fp8: Dict[str, str]
    high_precision: Dict[str, str]
    static_inputs: Dict[str, float] = dataclasses.field(default_factory=dict)
    dynamic_inputs: Dict[str, str] = dataclasses.field(default_factory=dict)
    timings: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        total = len(self.fp8) + len(self.high_precision)
        text = f"{len(self.fp8)}/{total} linear layers in FP8 for inference, {len(self.high_precision)} in high precision"
        if self.static_inputs:
            text += f"; {len(self.static_inputs)} with static input scales"
        return text


def _fp8_forward(layer: LokaLinear) -> Tuple[Optional[str], bool, str]:
    """``(granularity, fast_accum, why)`` of the layer's forward GEMM in force; granularity ``None``
    where it does not run FP8 here (``why`` says why)."""
    choice = layer.kernels.for_role(GemmRole.FORWARD)
    if choice.is_high_precision:
        return None, False, "its forward GEMM runs in high precision"
    _, fast_accum = split_fast_accum(choice.recipe)
    granularity = RECIPE_GRANULARITY.get(choice.recipe)
    if granularity not in (Granularity.TENSORWISE, Granularity.ROWWISE):
        return None, False, f"{choice}: torch._scaled_mm takes tensorwise or rowwise scales only"
    return granularity.value, fast_accum, str(choice)


def _static_input_amax(layer: LokaLinear, granularity: str, probed: Optional[Sequence[float]]) -> Tuple[Optional[float], str]:
    """``(amax, "")`` for a static input scale from the layer's recorded input amaxes (its delayed
    scaling's history, else the Probe's ``probed`` ones), or ``(None, why not)``."""
    if granularity != "tensorwise":
        return None, "rowwise: each row has its own scale"
    history = getattr(layer, "_amax_history", None)
    if history is not None and getattr(layer, "_history_seeded", False):
        amaxes, source = history[0][history[0] > 0].double(), "calls"
    elif probed:
        amaxes, source = torch.tensor([float(a) for a in probed], dtype=torch.float64), "probe steps"
        amaxes = amaxes[amaxes > 0]
    else:
        return None, "no input amax recorded in training"
    if amaxes.numel() == 0 or not bool(torch.isfinite(amaxes).all()):
        return None, "no finite input amax recorded in training"
    high, median = float(amaxes.max()), float(amaxes.median())
    if high > STABLE_AMAX_RATIO * median:
        return None, f"input amax varied: largest {high:.4g} vs median {median:.4g} over {amaxes.numel()} {source}"
    return high, ""


def inference_modules(
    model: nn.Module,
    *,
    input_scaling: str = "dynamic",
    input_amaxes: Optional[Mapping[str, Sequence[float]]] = None,
    serving_rows: Optional[int] = None,
    min_speedup: float = 1.0,
    timer: Optional[ServingTimer] = None,
) -> InferenceReport:
    """Turn a trained, LoKA-converted ``model`` into its serving form, in place (module docstring).

    Call it after training (after ``loka.close()``), on the unsharded dense modules or the whole
    unwrapped model; the model is put in eval mode. A model without LoKA layers is left as it is.

    Args:
        model: the model :func:`loka_torchrec.prepare` or :func:`loka_torchrec.apply` converted.
        input_scaling: ``"dynamic"`` or ``"static"`` (where training's input amaxes were stable;
            see the module docstring).
        input_amaxes: ``{layer name in model: amaxes}``, the Probe's
            (``loka.probe.input_amaxes(model)``): for ``"static"``, the layers without a delayed-scaling
            history take their scale from these.
        serving_rows: the rows of a serving batch. Given, each FP8 layer's forward is timed against
            its high-precision form at that many rows (:mod:`loka_torchrec.inference_timing`: on CUDA
            both compiled and replayed in a CUDA graph; layers of one shape and kernel are timed
            once) and stays FP8 only where high precision's 25th percentile over FP8's 75th reaches
            ``min_speedup``; the others run in high precision, with both times in the reason.
            ``None``: every layer training runs in FP8 serves in FP8.
        min_speedup: that gate (default 1.0: not slower).
        timer: replaces :func:`~loka_torchrec.inference_timing.time_serving_forward` (tests).

    Returns:
        :class:`InferenceReport`: which layers run FP8 now, and why the others do not.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or is itself one ``LokaLinear`` (convert its parent).
        ValueError: ``input_scaling`` is not one of :data:`INPUT_SCALINGS`.
    """
    if not isinstance(model, nn.Module) or isinstance(model, LokaLinear):
        raise TypeError(f"model: expected the module holding the LoKA layers, got {type(model).__name__}")
    if input_scaling not in INPUT_SCALINGS:
        raise ValueError(f"input_scaling: expected one of {', '.join(INPUT_SCALINGS)}, got {input_scaling!r}")
    if serving_rows is not None and (isinstance(serving_rows, bool) or not isinstance(serving_rows, int) or serving_rows < 1):
        raise ValueError(f"serving_rows: expected the rows of a serving batch, an int >= 1, got {serving_rows!r}")
    timer = timer or time_serving_forward
    timed: Dict[tuple, Tuple[Interval, Interval]] = {}  # one timing per layer shape and kernel
    timings: Dict[str, Dict[str, float]] = {}
    fp8: Dict[str, str] = {}
    high: Dict[str, str] = {}
    static: Dict[str, float] = {}
    dynamic: Dict[str, str] = {}
    made: Dict[int, nn.Module] = {}  # one replacement per layer object: a shared layer stays shared
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(module, LokaLinear):
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if id(module) not in made:
            granularity, fast_accum, why = _fp8_forward(module)
            if isinstance(parent, nn.MultiheadAttention):
                granularity, why = None, "nn.MultiheadAttention reads its weight directly, not through its forward"
            if granularity is None:
                made[id(module)] = module.to_linear()
                high[fqn] = why
            else:
                amax = None
                if input_scaling == "static":
                    amax, why_not = _static_input_amax(module, granularity, (input_amaxes or {}).get(fqn))
                    if amax is None:
                        dynamic[fqn] = why_not
                    else:
                        static[fqn] = amax
                layer = Fp8InferenceLinear(module.weight, module.bias, granularity, fast_accum=fast_accum, input_amax=amax)
                slower = None
                if serving_rows is not None:
                    key = (module.in_features, module.out_features, module.bias is not None, granularity, fast_accum, amax is None)
                    if key not in timed:
                        timed[key] = timer(layer, module, serving_rows)
                    fp8_ms, hp_ms = timed[key]
                    timings[fqn] = {"rows": serving_rows, "fp8_ms": fp8_ms.value, "high_precision_ms": hp_ms.value}
                    speedup_low = hp_ms.low / fp8_ms.high if fp8_ms.high > 0 else float("inf")
                    if speedup_low < min_speedup:
                        slower = (f"not faster at {serving_rows} rows: {fp8_ms.value:.4g} ms in FP8 vs {hp_ms.value:.4g} ms in "
                                  f"high precision (lo {speedup_low:.2f}x < {min_speedup:g})")  # fmt: skip
                if slower is not None:
                    made[id(module)] = module.to_linear()
                    high[fqn] = slower
                    static.pop(fqn, None)
                    dynamic.pop(fqn, None)
                else:
                    made[id(module)] = layer
                    fp8[fqn] = granularity + ("_fast_accum" if fast_accum else "")
        setattr(parent, child, made[id(module)])
    plain_modules(model)  # the reached Parameter GEMMs (scopes): their own forward again
    model.eval()
    return InferenceReport(fp8, high, static, dynamic, timings)


def export_program(model: nn.Module, example_args: Sequence, path: str, *, dynamic_batch: bool = True):
    """``torch.export`` ``model`` (after :func:`inference_modules`) with ``example_args`` and save it
    to ``path``; ``torch.export.load(path).module()`` runs it in a process without this project.

    Args:
        model: the serving model.
        example_args: positional tensors of one call.
        path: where the program goes (``.pt2``).
        dynamic_batch: the first dim of every example tensor may vary (serving batch sizes).

    Returns:
        The ``ExportedProgram``.
    """
    from torch.export import Dim, export, save

    args = tuple(example_args)
    dynamic_shapes = None
    if dynamic_batch:
        batch = Dim("batch", min=1)
        dynamic_shapes = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)
        if _takes_varargs(model):  # forward(*tensors): the specs go in one entry, for the varargs parameter
            dynamic_shapes = (dynamic_shapes,)
    program = export(model.eval(), args, dynamic_shapes=dynamic_shapes)
    save(program, path)
    return program


def _takes_varargs(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes its arguments as ``*args`` (``torch.export`` then wants their
    dynamic shapes nested under that one parameter)."""
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
