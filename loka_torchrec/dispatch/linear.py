"""``LokaLinear``: a drop-in ``nn.Linear`` whose three GEMMs each run on their own kernel.

A linear layer computes three GEMMs per training step (operand layouts as in
:mod:`loka_torchrec.evidence`, ``C = A @ B^T``):

=========  ========================  ===================  ===================
role       GEMM                      A                    B
=========  ========================  ===================  ===================
``fwd``    ``y  = x @ W^T``          ``x`` (rows, in)     ``W`` (out, in)
``dgrad``  ``dx = dy @ W``           ``dy`` (rows, out)   ``W^T`` (in, out)
``wgrad``  ``dW = dy^T @ x``         ``dy^T`` (out, rows) ``x^T`` (in, rows)
=========  ========================  ===================  ===================

:class:`LokaLinear` routes each one to the backend and recipe its
:class:`~loka_torchrec.dispatch.layer_kernels.LayerKernels` names, through a stateless
``autograd.Function`` whose configuration is a frozen :class:`_LayerPlan`.

**Under ``torch.compile``** (the way LoKA runs on a GPU) the layer traces into one graph with
its neighbours (``fullgraph=True``):

* the plan is static module state, fixed when the kernels are set; a new plan is a new constant,
  so a re-plan recompiles once and nothing else does;
* operands are quantized with plain torch ops (amax, scale, saturating cast;
  :func:`loka_torchrec.fp8.quantize`), which Inductor fuses into the op that produced the
  operand (a norm, an activation, the previous GEMM's epilogue) and into the zero padding;
* the GEMM is ``torch._scaled_mm`` or another backend's operator with a fake implementation
  (a backend declares which recipes trace: ``GemmBackend.compile_recipes``);
* the row count never specializes the graph: padding of the rows (grad-weight's reduction dim)
  is symbolic, so a varying batch (HSTU's jagged tokens) compiles once with a dynamic dim;
* where grad-input reads the weight with the forward's tensorwise spec, the forward's FP8 weight
  is transposed and kept for the backward (1 byte per weight element), so the backward reads the
  high-precision weight neither for an amax nor for a second cast;
* nothing Python-side changes per call: no weight cache, no counters on the host.

**Eagerly** (probe steps, CPUs, debugging) the layer keeps what saves work between calls:

* the quantized weight, cached per ``(weight._version, data_ptr)``, the process's count of
  optimizer steps and the operand spec, so forward, grad-input and micro-batches between two
  optimizer steps quantize it once (PyTorch's fused optimizers update a weight in place without
  bumping ``_version``, hence the step count; for tensorwise the
  grad-input ``W^T`` is the forward's FP8 bytes transposed; rowwise needs a second quantization
  along the other axis);
* the operand quantization on CUDA is the project's fused Triton kernel (one pass);
* :attr:`LokaLinear.last_rows` and the input dtypes, read by the Probe and Dispatch.

In both modes the saved activation for an FP8 grad-weight is its FP8 operand (1 byte per element),
never a second high-precision copy.

**Non-finite values.** Operands are quantized with ``nonfinite="propagate"``: a group holding inf
or NaN gets a NaN scale, so every output reading it is NaN, never silently finite; each such
scaling group adds one to ``nonfinite_events``. Eagerly, every FP8 operand is counted (in batches
of up to 64, one reduction on the device, no sync); compiled, the forward's operands are counted
inside the graph (a non-finite gradient still shows as NaN weight gradients, and the Probe's eager
steps count it).

**Shapes a backend cannot take.** Checked once per plan (``GemmBackend.check``). Where the
backend needs dims that are multiples of an alignment (``GemmBackend.alignment``: 16 for
``torch._scaled_mm`` on CUDA, 128 for Transformer Engine's blockwise tiles), the operands are
zero-padded: zeros add nothing to a dot product and change no amax, so the result is exact. A kernel that cannot run even padded runs that GEMM in high precision, with the reason
in :attr:`LokaLinear.fallback_reasons`.

When every GEMM runs in high precision and the input has the high-precision dtype (fp32 on the
CPU, bf16 on CUDA) the layer calls ``torch.nn.functional.linear``: it is then ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from loka_torchrec.gemm.backends import GemmBackend, get_backend
from loka_torchrec.gemm.backends.high_precision import high_precision_dtype
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec, recipe_for
from loka_torchrec.evidence import BF16, GemmRole, GemmShape, KernelChoice
from loka_torchrec.fp8 import Fp8Format, Fp8Tensor, Granularity, quantize, tensor_amax
from loka_torchrec.fp8.scaling import FORWARD_SCALINGS

__all__ = ["AMAX_HISTORY", "GemmSite", "LokaLinear", "compiled_scaling", "compiling"]

logger = logging.getLogger(__name__)

_ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)
_PENDING_SCALES = 64  # operands whose scales are counted for nonfinite_events in one batch (eager)
AMAX_HISTORY = 16
"""Calls whose amaxes a ``"delayed"`` layer keeps; the largest of them scales its next call."""


class _OptimizerSteps:
    """How many ``torch.optim`` optimizer steps this process has taken (a global post-step hook,
    registered with the first layer's eager state): part of the weight cache's stamp."""

    count = 0
    hook = None

    @classmethod
    def watch(cls) -> None:
        if cls.hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            cls.hook = register_optimizer_step_post_hook(cls._stepped)

    @classmethod
    def _stepped(cls, optimizer, args, kwargs) -> None:
        cls.count += 1


def compiling() -> bool:
    """Whether the caller is being traced by ``torch.compile`` (a constant while tracing)."""
    return torch.compiler.is_compiling()


@contextlib.contextmanager
def compiled_scaling(sites: Iterable["GemmSite"]) -> Iterator[None]:
    """Within this context, eager calls of ``sites`` scale their forward operands as their compiled
    calls do, and leave the amax history as it is.

    For checks that run a compiled model's layers eagerly to judge its numerics (the gradient
    check): a ``"delayed"`` site with a history scales its tensorwise input and weight by it (the
    first compiled call of a site without one uses the current amax, and so does this); a
    ``"current"`` site is unchanged. Nothing is recorded, so a check leaves the next training
    step's scales as they were.
    """
    sites = list(sites)
    saved = [site._scaled_as_compiled for site in sites]
    for site in sites:
        site._scaled_as_compiled = True
    try:
        yield
    finally:
        for site, before in zip(sites, saved):
            site._scaled_as_compiled = before


# --------------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class _RoleKernel:
    """How one GEMM runs.

    Attributes:
        choice: the kernel that runs (``bf16:hp`` where the planned one could not).
        recipe: operand quantization, ``None`` for high precision.
        align: every dim of the GEMM is zero-padded up to a multiple of this (1: no padding).
    """

    choice: KernelChoice
    recipe: Optional[GemmRecipe]
    align: int = 1

    @property
    def backend(self) -> GemmBackend:
        # Looked up by name, not held: a deep-copied or pickled layer keeps using the registry's backends.
        return get_backend(self.choice.backend)

    @property
    def fp8(self) -> bool:
        return self.recipe is not None

    def padded(self, dim):
        """``dim`` (an int or a symbolic size) rounded up to this kernel's alignment."""
        return dim if self.align == 1 else -(-dim // self.align) * self.align


class _LayerPlan(NamedTuple):
    """The three GEMMs' kernels and the layer's dims: everything the autograd function needs."""

    fwd: _RoleKernel
    dgrad: _RoleKernel
    wgrad: _RoleKernel
    in_features: int
    out_features: int

    @property
    def all_high_precision(self) -> bool:
        return not (self.fwd.fp8 or self.dgrad.fp8 or self.wgrad.fp8)


# --------------------------------------------------------------------------------------- operands
def _pad2d(t: torch.Tensor, rows, cols) -> torch.Tensor:
    """``t`` zero-padded at the bottom and right to ``(rows, cols)`` (sizes may be symbolic)."""
    pad_rows, pad_cols = rows - t.shape[0], cols - t.shape[1]
    if statically_known_true(pad_rows == 0) and statically_known_true(pad_cols == 0):
        return t
    return F.pad(t, (0, pad_cols, 0, pad_rows))


def _transposed_spec(spec: OperandSpec) -> OperandSpec:
    """The spec whose quantization of ``T^T`` is the transpose of ``spec``'s quantization of ``T``."""
    if spec.block is None:
        return spec
    return dataclasses.replace(spec, block=(spec.block[1], spec.block[0]))


def _transpose_reusable(src: OperandSpec, dst: OperandSpec) -> bool:
    """Whether ``dst``-quantizing ``T^T`` gives exactly the transposed ``src``-quantized ``T``.

    True for tensorwise (one scale) and for blockwise when ``dst``'s tile is ``src``'s tile
    transposed (the 128x128 weight tiles); never for rowwise (rows of ``T^T`` are columns of ``T``).
    """
    if src.granularity == Granularity.ROWWISE:
        return False
    return _transposed_spec(src) == dst


def _transpose_fp8(q: Fp8Tensor) -> Fp8Tensor:
    """The operand of ``T^T`` from that of ``T``: FP8 bytes copied transposed, scales reused."""
    scale = q.dequant_scale if q.granularity == Granularity.TENSORWISE else q.dequant_scale.t().contiguous()
    block = None if q.block is None else (q.block[1], q.block[0])
    # Row-major copy: GEMM kernels (torch._scaled_mm on CUDA) want A row-major and B column-major.
    return Fp8Tensor(q.data.t().contiguous(), scale, q.fmt, q.granularity, block)


def _pack_operand(op: Any) -> Tuple[Tuple[torch.Tensor, ...], Any]:
    """Split an operand into tensors for ``ctx.save_for_backward`` and the metadata to rebuild it."""
    if isinstance(op, Fp8Tensor):
        return (op.data, op.dequant_scale), ("fp8", op.fmt, op.granularity, op.block)
    if isinstance(op, torch.Tensor):
        return (op,), ("tensor",)
    return (), ("opaque", op)  # a backend's own operand type (eager only): kept as is


def _unpack_operand(tensors: Tuple[torch.Tensor, ...], meta: Any) -> Any:
    if meta[0] == "fp8":
        return Fp8Tensor(tensors[0], tensors[1], meta[1], meta[2], meta[3])
    if meta[0] == "tensor":
        return tensors[0]
    return meta[1]


class _EagerState:
    """What a layer keeps between eager calls: the weight-operand cache and the scales to count.

    Never used while ``torch.compile`` traces (the graph must not depend on Python-side state).
    """

    def __init__(self) -> None:
        self.weight_cache: Dict[Tuple, Any] = {}
        self.weight_stamp: Optional[Tuple] = None
        self.pending_scales: List[torch.Tensor] = []  # dequantization scales not yet counted
        _OptimizerSteps.watch()

    def clear(self) -> None:
        self.weight_cache = {}
        self.weight_stamp = None

    def cache_for(self, weight: torch.Tensor) -> Optional[Dict[Tuple, Any]]:
        """The operand cache valid for ``weight``'s current values, or ``None`` (no caching)."""
        if weight.is_inference() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None  # inference tensors have no version; a captured graph re-reads the weight
        try:
            stamp = (weight._version, _OptimizerSteps.count, weight.data_ptr(), weight.dtype, weight.device)
        except RuntimeError:  # a tensor without storage of its own (a wrapper subclass): no caching
            return None
        if stamp != self.weight_stamp:
            self.weight_cache = {}
            self.weight_stamp = stamp
        return self.weight_cache


class _Quantizer:
    """Quantizes operands for one call: through the backend eagerly, with fusable torch ops when compiled.

    ``counts`` collects, while compiling, the number of NaN scales of each operand (scaling groups
    holding inf/NaN); eagerly the scales are queued on the layer's :class:`_EagerState` instead.
    ``prior_amax`` (compiled only): ``"input"`` / ``"weight"`` -> the amax that scales that tensor's
    tensorwise operands (either layout) in place of its own (delayed scaling; see :class:`GemmSite`).
    """

    def __init__(self, state: Optional[_EagerState], prior_amax: Optional[Dict[str, torch.Tensor]] = None) -> None:
        self.state = state
        self.prior_amax = prior_amax or {}
        self.counts: List[torch.Tensor] = []

    def __call__(self, kernel: _RoleKernel, t: torch.Tensor, spec: OperandSpec, name: str) -> Any:
        if self.state is None:
            amax = None
            if spec.granularity == Granularity.TENSORWISE:
                amax = self.prior_amax.get(name.split("^")[0])  # "input^T" is scaled as "input"
            op = quantize(t, spec.fmt, spec.granularity, block=spec.block, power_of_two=spec.power_of_two,
                          nonfinite="propagate", name=name, amax=amax)  # fmt: skip
        else:
            op = kernel.backend.quantize(t, spec, name=name)
        return self.counted(op)

    def counted(self, op: Any) -> Any:
        scale = getattr(op, "dequant_scale", None)
        if isinstance(scale, torch.Tensor):
            if self.state is None:
                self.counts.append(torch.isnan(scale).sum())
            else:
                self.state.pending_scales.append(scale.detach())
        return op

    def paired(self, t: torch.Tensor, first: _RoleKernel, first_spec: str, second: _RoleKernel, second_spec: str,
               cols: int, name: str) -> Optional[Tuple[Any, Any]]:  # fmt: skip
        """``t`` (rows, cols) as an operand of ``first`` and ``t^T`` as one of ``second``, from one read.

        Eager only (compiled, Inductor fuses the two quantizations of one read itself), and only
        where one backend runs both GEMMs with the same tensorwise or rowwise spec, offers
        ``quantize_with_transpose``, and no dim needs padding; else ``None``.
        """
        if self.state is None or not (first.fp8 and second.fp8) or first.choice.backend != second.choice.backend:
            return None
        spec = getattr(first.recipe, first_spec)
        if spec != getattr(second.recipe, second_spec) or spec.granularity == Granularity.BLOCKWISE:
            return None
        rows = t.shape[0]
        if first.padded(rows) != rows or second.padded(rows) != rows or first.padded(cols) != cols:
            return None
        pair = getattr(first.backend, "quantize_with_transpose", None)
        if pair is None:
            return None
        op, op_t = pair(t, spec, name=name)
        return self.counted(op), self.counted(op_t)

    def total(self) -> Optional[torch.Tensor]:
        """The NaN-scale count of this call's compiled operands, or ``None`` (eager, or none quantized)."""
        if not self.counts:
            return None
        return torch.stack(self.counts).sum()


def _delayed_operands(plan: _LayerPlan) -> Tuple[bool, bool]:
    """Whether the forward quantizes the input, and the weight, as FP8 tensorwise operands: the
    operands that delayed scaling serves (``x`` for the forward GEMM or, as ``x^T``, for
    grad-weight; ``W`` for the forward GEMM, whose FP8 bytes grad-input reuses where it can)."""

    def tensorwise(kernel: _RoleKernel, operand: str) -> bool:
        return kernel.fp8 and getattr(kernel.recipe, operand).granularity == Granularity.TENSORWISE

    return tensorwise(plan.fwd, "a") or tensorwise(plan.wgrad, "b"), tensorwise(plan.fwd, "b")


def _prior_by_name(plan: _LayerPlan, prior_amax: torch.Tensor) -> Dict[str, torch.Tensor]:
    input_slot, weight_slot = _delayed_operands(plan)
    return {name: prior_amax[i] for i, (name, used) in enumerate((("input", input_slot), ("weight", weight_slot))) if used}


# --------------------------------------------------------------------------------------- GEMMs
def _weight_operand(q: _Quantizer, weight: torch.Tensor, kernel: _RoleKernel, plan: _LayerPlan, *, transposed: bool) -> Any:
    """``B`` of the forward (``W``) or grad-input (``W^T``, ``transposed``) GEMM; cached per step when eager."""
    spec = kernel.recipe.b if kernel.fp8 else None
    out_f, in_f = kernel.padded(plan.out_features), kernel.padded(plan.in_features)
    shape = (in_f, out_f) if transposed else (out_f, in_f)
    key = (kernel.choice.backend, spec, transposed, shape)
    cache = None if q.state is None else q.state.cache_for(weight)
    if cache is not None and key in cache:
        return cache[key]
    op = None
    if cache is not None and spec is not None and spec.granularity != Granularity.ROWWISE:
        # W^T from W (or W from W^T) when the other orientation is cached with a matching spec.
        other = cache.get((kernel.choice.backend, _transposed_spec(spec), not transposed, shape[::-1]))
        if isinstance(other, Fp8Tensor):
            op = _transpose_fp8(other)
    if op is None:
        src = weight.t() if transposed else weight
        if spec is None:
            op = kernel.backend.quantize(src)
        else:
            op = q(kernel, _pad2d(src, *shape), spec, "weight^T" if transposed else "weight")
    if cache is not None:
        cache[key] = op
    return op


def _forward_gemm(
    q: _Quantizer, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: _LayerPlan,
    xq: Any = None, w_op: Any = None,
) -> Tuple[torch.Tensor, Any]:
    """``y (rows, out) = x W^T + b``; also returns the quantized ``x`` (``None`` in high precision).

    ``xq``: ``x`` already quantized for this kernel (:meth:`_Quantizer.paired`), else ``None``;
    ``w_op``: the weight operand, else it is made here.
    """
    kernel = plan.fwd
    backend = kernel.backend
    if w_op is None:
        w_op = _weight_operand(q, weight, kernel, plan, transposed=False)
    if not kernel.fp8:
        y, xq = backend.mm(backend.quantize(x2d), w_op, None, x2d.dtype), None
    else:
        rows = x2d.shape[0]
        if xq is None:
            x_pad = _pad2d(x2d, kernel.padded(rows), kernel.padded(plan.in_features))
            xq = q(kernel, x_pad, kernel.recipe.a, "input")
        y = backend.mm(xq, w_op, kernel.recipe, x2d.dtype)
        y = _crop(y, rows, plan.out_features)
    if bias is not None:
        y = y + bias.to(y.dtype)  # after the GEMM, in high precision
    return y, xq


def _crop(t: torch.Tensor, rows, cols: int) -> torch.Tensor:
    """The top-left ``(rows, cols)`` of a padded GEMM result."""
    if statically_known_true(t.shape[0] == rows) and t.shape[1] == cols:
        return t
    return t[:rows, :cols]


def _reuses_transposed(src: _RoleKernel, src_operand: str, dst: _RoleKernel, dst_operand: str) -> bool:
    """Whether ``dst``'s ``dst_operand`` (``"a"``/``"b"``) is exactly ``src``'s ``src_operand``
    quantized, transposed: both FP8 on one backend with the same padding, and a transposable spec
    (tensorwise, or tiles that are each other's transpose)."""
    return (
        src.fp8 and dst.fp8 and src.choice.backend == dst.choice.backend and src.align == dst.align
        and _transpose_reusable(getattr(src.recipe, src_operand), getattr(dst.recipe, dst_operand))
    )  # fmt: skip


def _wgrad_activation(q: _Quantizer, x2d: torch.Tensor, xq: Any, plan: _LayerPlan) -> Tuple[str, Any]:
    """What the forward keeps of ``x`` for grad-weight: ``(mode, operand)``.

    ``"hp"``: ``x`` itself; ``"transpose"``: the forward's FP8 ``x``, transposed in the backward;
    ``"operand"``: the grad-weight ``B`` operand ``x^T``, quantized now.
    """
    wk, fk = plan.wgrad, plan.fwd
    if not wk.fp8:
        return "hp", x2d
    shape = (wk.padded(plan.in_features), wk.padded(x2d.shape[0]))  # x^T: (N, K) of grad-weight
    if isinstance(xq, Fp8Tensor) and _reuses_transposed(fk, "a", wk, "b"):
        return "transpose", xq
    return "operand", q(wk, _pad2d(x2d.t(), *shape), wk.recipe.b, "input^T")


def _grad_input(
    q: _Quantizer, dy2d: torch.Tensor, weight: torch.Tensor, plan: _LayerPlan, out_dtype: torch.dtype, dyq: Any = None,
    w_op: Any = None,
) -> Tuple[torch.Tensor, Any]:
    """``dx (rows, in) = dy W``; also returns the quantized ``dy`` (``None`` in high precision).

    ``w_op``: the ``W^T`` operand kept from the forward, else it is made here."""
    kernel = plan.dgrad
    backend = kernel.backend
    if w_op is None:
        w_op = _weight_operand(q, weight, kernel, plan, transposed=True)
    if not kernel.fp8:
        return backend.mm(backend.quantize(dy2d), w_op, None, out_dtype), None
    rows = dy2d.shape[0]
    if dyq is None:
        dy_pad = _pad2d(dy2d, kernel.padded(rows), kernel.padded(plan.out_features))
        dyq = q(kernel, dy_pad, kernel.recipe.a, "grad_output")
    dx = backend.mm(dyq, w_op, kernel.recipe, out_dtype)
    return _crop(dx, rows, plan.in_features), dyq


def _grad_weight(
    q: _Quantizer, dy2d: torch.Tensor, x_mode: str, x_op: Any, dyq: Any, plan: _LayerPlan, out_dtype: torch.dtype,
    dytq: Any = None,
) -> torch.Tensor:
    """``dW (out, in) = dy^T x`` from the kept activation and, where reusable, dgrad's FP8 ``dy``."""
    wk, dk = plan.wgrad, plan.dgrad
    backend = wk.backend
    if not wk.fp8:
        return backend.mm(backend.quantize(dy2d.t()), backend.quantize(x_op.t()), None, out_dtype)
    shape = (wk.padded(plan.out_features), wk.padded(dy2d.shape[0]))  # dy^T: (M, K) of grad-weight
    if dytq is not None:
        a = dytq
    elif isinstance(dyq, Fp8Tensor) and _reuses_transposed(dk, "a", wk, "a"):
        a = _transpose_fp8(dyq)
    else:
        a = q(wk, _pad2d(dy2d.t(), *shape), wk.recipe.a, "grad_output^T")
    b = _transpose_fp8(x_op) if x_mode == "transpose" else x_op
    dw = backend.mm(a, b, wk.recipe, out_dtype)
    return _crop(dw, plan.out_features, plan.in_features)


class _LokaLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with forward, grad-input and grad-weight GEMMs on separate kernels.

    Stateless apart from ``state`` (eager calls only), so ``torch.compile`` traces it whole.
    ``prior_amax``: ``None``, or (compiled) the ``(2,)`` delayed amaxes of the input and the weight
    (:meth:`GemmSite._forward_planned`; used where :func:`_delayed_operands` says).
    Returns ``(y, nonfinite)``: ``nonfinite`` counts the NaN scales of the forward's operands when
    compiled (``None`` eagerly, where the layer's queue counts them).
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, plan: _LayerPlan, state: Optional[_EagerState], prior_amax):  # type: ignore[override]
        q = _Quantizer(state, None if prior_amax is None else _prior_by_name(plan, prior_amax))
        # x for the forward GEMM and x^T for grad-weight from one read of x, where one backend runs both.
        pair = None
        if ctx.needs_input_grad[1]:
            pair = q.paired(x2d, plan.fwd, "a", plan.wgrad, "b", plan.in_features, "input")
        w_op = w_t = None
        if state is None and ctx.needs_input_grad[0] and _reuses_transposed(plan.fwd, "b", plan.dgrad, "b"):
            # Compiled: W^T for grad-input is the forward's FP8 W transposed (the eager path gets
            # the same from its weight cache), one cast of W per step instead of two.
            w_op = _weight_operand(q, weight, plan.fwd, plan, transposed=False)
            if isinstance(w_op, Fp8Tensor):
                w_t = _transpose_fp8(w_op)
        y, xq = _forward_gemm(q, x2d, weight, bias, plan, xq=None if pair is None else pair[0], w_op=w_op)
        ctx.plan, ctx.state = plan, state
        ctx.x_dtype = x2d.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_mode, x_tensors, ctx.x_meta = "none", (), ("opaque", None)
        if pair is not None:
            ctx.x_mode, x_op = "operand", pair[1]
            x_tensors, ctx.x_meta = _pack_operand(x_op)
        elif ctx.needs_input_grad[1]:
            ctx.x_mode, x_op = _wgrad_activation(q, x2d, xq, plan)
            x_tensors, ctx.x_meta = _pack_operand(x_op)
        ctx.w_t_meta, w_t_tensors = None, ()
        if w_t is not None:
            w_t_tensors, ctx.w_t_meta = _pack_operand(w_t)
        ctx.n_x_tensors = len(x_tensors)
        # The weight is saved so that autograd's version check catches an in-place update between
        # forward and backward; it is the Parameter itself, no copy.
        ctx.save_for_backward(weight, *x_tensors, *w_t_tensors)
        nonfinite = q.total()
        if nonfinite is None and state is None:
            # Compiled, the second output is a tensor even where the forward quantized nothing (a
            # bf16 forward with an FP8 backward): torch 2.11's Dynamo calls .contiguous() on the
            # backward's grad of every output, which fails on a None output.
            nonfinite = torch.zeros((), dtype=torch.int64, device=x2d.device)
        if nonfinite is not None:
            ctx.mark_non_differentiable(nonfinite)
        return y, nonfinite

    @staticmethod
    def backward(ctx, dy2d, _nonfinite_grad):  # type: ignore[override]
        plan = ctx.plan
        q = _Quantizer(ctx.state)
        weight, *saved = ctx.saved_tensors
        x_tensors, w_t_tensors = saved[: ctx.n_x_tensors], saved[ctx.n_x_tensors :]
        w_t = None if ctx.w_t_meta is None else _unpack_operand(tuple(w_t_tensors), ctx.w_t_meta)
        grad_x = grad_w = grad_b = None
        dyq = None
        # dy for grad-input and dy^T for grad-weight from one read of dy, where one backend runs both.
        pair = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            pair = q.paired(dy2d, plan.dgrad, "a", plan.wgrad, "a", plan.out_features, "grad_output")
        if ctx.needs_input_grad[0]:
            grad_x, dyq = _grad_input(q, dy2d, weight, plan, ctx.x_dtype, dyq=None if pair is None else pair[0], w_op=w_t)
        if ctx.needs_input_grad[1]:
            x_op = _unpack_operand(tuple(x_tensors), ctx.x_meta)
            grad_w = _grad_weight(q, dy2d, ctx.x_mode, x_op, dyq, plan, weight.dtype, dytq=None if pair is None else pair[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy2d.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


# --------------------------------------------------------------------------------------- module
class GemmSite(nn.Module):
    """One GEMM site: ``y = x W^T + b`` whose three GEMMs each run on their own kernel.

    The base of every module Dispatch manages (:class:`LokaLinear`, and
    :class:`~loka_torchrec.dispatch.sites.ParameterSite` for GEMMs on a module's own Parameters).
    A subclass provides ``weight`` (``(out_features, in_features)``, possibly a view of a Parameter),
    ``in_features``, ``out_features``, calls :meth:`_init_dispatch` once its weight exists, and runs
    its GEMM through :meth:`_site_forward`. What the Dispatcher and the Probe read
    (``kernels``/``set_kernels``, ``last_rows``, ``last_input_dtype``, ``last_autocast_dtype``,
    ``grad_format``, ``fallback_reasons``, ``nonfinite_events``) lives here.

    **Forward scaling** (``forward_scaling``). ``"current"``: every FP8 operand is scaled by its own
    amax, which a compiled step must reduce over the whole tensor before the cast can start, so
    an operand is read twice (its amax, then its cast). ``"delayed"``: under ``torch.compile``,
    the forward's tensorwise operands of the input and the weight are scaled by the largest amax
    of the last ``AMAX_HISTORY`` calls (:func:`_delayed_operands`), so Inductor fuses the cast,
    and the amax recorded for later calls, into one pass, even into the op that produces the
    input. Values beyond that amax saturate to the format's maximum (an operand that grows from
    one step to the next loses its largest values for that step), and a NaN or inf in the
    operand is counted in ``nonfinite_events`` and gives NaN outputs, as with current scaling.
    Eager calls scale by the current amax and record the history (for every layer, FP8 or not,
    so a plan made eagerly starts its compiled steps with a history); compiled calls record it
    for the layers that use it. Eager calls inside :func:`compiled_scaling` (checks of a compiled
    model's numerics) scale as compiled calls do and record nothing. A compiled call that finds
    no history yet scales by the current amax, records it, and the next call compiles once more.
    Gradients (``dy``) are always scaled by their current amax. The history is run-time state,
    not in ``state_dict``: after a restart the first call records it again. A layer built directly
    is ``"current"`` unless told; Dispatch gives its sites ``DispatchConfig.forward_scaling``
    (default ``"delayed"``) where they run compiled (``DispatchConfig.site_forward_scaling``).
    """

    _nonfinite_count: torch.Tensor
    _amax_history: torch.Tensor
    last_rows: int
    last_input_dtype: Optional[torch.dtype]
    last_autocast_dtype: Optional[torch.dtype]
    fallback_reasons: Dict[GemmRole, str]

    def _init_dispatch(
        self, kernels: LayerKernels, grad_format: Fp8Format, device: torch.device, forward_scaling: str = "current"
    ) -> None:
        # Non-persistent: run-time state, not model state; checkpoints stay nn.Linear's.
        self.register_buffer("_nonfinite_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        # Row 0: the input's amax per call, row 1: the weight's; column 0 the newest.
        self.register_buffer("_amax_history", torch.zeros(2, AMAX_HISTORY, dtype=torch.float32, device=device), persistent=False)
        self._history_seeded = False
        self._scaled_as_compiled = False  # eager calls scale as compiled ones: compiled_scaling()
        self.forward_scaling = forward_scaling
        self._eager = _EagerState()
        self.last_rows = 0
        self.last_input_dtype = None
        self.last_autocast_dtype = None
        self.fallback_reasons = {}
        self._grad_format = Fp8Format.parse(grad_format, field="grad_format")
        self._plan_device: Optional[torch.device] = None
        self.set_kernels(kernels)

    # ----------------------------------------------------------------------------- kernels
    @property
    def kernels(self) -> LayerKernels:
        """The planned kernel per role (see :attr:`fallback_reasons` for where one cannot run)."""
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: LayerKernels) -> None:
        self.set_kernels(kernels)

    @property
    def grad_format(self) -> Fp8Format:
        return self._grad_format

    @property
    def forward_scaling(self) -> str:
        """``"current"`` or ``"delayed"``: what scales the forward's FP8 operands (class docstring)."""
        return self._forward_scaling

    @forward_scaling.setter
    def forward_scaling(self, value: str) -> None:
        if value not in FORWARD_SCALINGS:
            raise ValueError(f"forward_scaling: expected one of {', '.join(FORWARD_SCALINGS)}, got {value!r}")
        self._forward_scaling = value

    @property
    def plan(self) -> _LayerPlan:
        """The kernels that run on this layer's device, padding included (static between re-plans)."""
        return self._plan

    def set_kernels(self, kernels: LayerKernels) -> None:
        """Route the three GEMMs to ``kernels``; checked against the registry and this layer's device.

        A kernel that cannot run here even with padded dims runs in high precision, with the
        reason in :attr:`fallback_reasons`. Under ``torch.compile`` the next call recompiles once.

        Raises:
            TypeError: ``kernels`` is not a :class:`LayerKernels`.
            ValueError: an unknown backend, or a recipe the backend does not have.
        """
        if not isinstance(kernels, LayerKernels):
            raise TypeError(f"kernels: expected a LayerKernels, got {type(kernels).__name__}")
        for role in _ROLES:
            choice = kernels.for_role(role)
            field = f"kernels.{role.value}"
            try:
                backend = get_backend(choice.backend)
            except ValueError as exc:
                raise ValueError(f"{field}: {exc}") from None
            if choice.recipe not in backend.recipes:
                raise ValueError(
                    f"{field}: backend {choice.backend!r} has no recipe {choice.recipe!r}; "
                    f"expected one of {', '.join(map(repr, backend.recipes))}"
                )
        self._kernels = kernels
        self._eager.clear()
        self._build_plan(self.weight.device)

    def _build_plan(self, device: torch.device) -> None:
        self.fallback_reasons = {}
        self._plan_device = device
        self._plan = _LayerPlan(*(self._role_kernel(role, device) for role in _ROLES), self.in_features, self.out_features)

    def _role_kernel(self, role: GemmRole, device: torch.device) -> _RoleKernel:
        choice = self._kernels.for_role(role)
        if choice.is_high_precision or device.type == "meta":
            return _RoleKernel(choice, None) if choice.is_high_precision else _RoleKernel(BF16, None)
        recipe = recipe_for(choice.recipe, role, grad_format=self._grad_format)
        backend = get_backend(choice.backend)
        align = backend.alignment(device, recipe)
        # Rows enter a GEMM only as M (forward, grad-input) or as grad-weight's K; both are padded
        # to the alignment, so one check at a representative row count holds for every batch.
        shape = GemmShape.for_role(role, align, self.in_features, self.out_features)
        reason = backend.check_padded(recipe, shape, device)
        if reason is None:
            return _RoleKernel(choice, recipe, align)
        message = f"{choice} cannot run {role.value} GEMM {shape} on {device}: {reason}"
        self.fallback_reasons[role] = message
        logger.warning("%s(%d, %d): %s; using bf16:hp", type(self).__name__, self.in_features, self.out_features, message)
        return _RoleKernel(BF16, None)

    # ----------------------------------------------------------------------------- forward
    def _site_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``y = x W^T + b`` with each GEMM on its planned kernel (``weight`` (out, in), ``bias`` (out,) or ``None``).

        Args:
            input: ``(*, in_features)`` floating point tensor.

        Returns:
            ``(*, out_features)`` tensor of ``input``'s dtype; under ``torch.autocast`` (for
            ``input``'s device type) of the autocast dtype, as ``nn.Linear`` there: the input is cast
            to that dtype, an all-high-precision layer is ``F.linear`` under autocast, and FP8 GEMMs
            quantize the cast input and the fp32 master weight with autocast off inside the layer
            (the high-precision GEMMs of a mixed plan then run in the autocast dtype). Call
            ``backward`` outside the autocast region, as PyTorch recommends.
        """
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"input: expected shape (*, in_features={self.in_features}), got {tuple(input.shape)}"
            )
        lead = input.shape[:-1]
        rows = math.prod(lead)
        device_type = input.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if not compiling():
            if input.device != self._plan_device:
                self._build_plan(input.device)  # the layer was moved since its kernels were set
            if len(self._eager.pending_scales) >= _PENDING_SCALES:
                self._count_pending()
            self.last_rows = rows
            self.last_input_dtype = input.dtype
            self.last_autocast_dtype = torch.get_autocast_dtype(device_type) if autocast else None
        plan = self._plan
        if rows == 0:
            return F.linear(input, weight, bias)  # nothing to quantize
        if self.forward_scaling == "delayed" and not compiling() and not self._scaled_as_compiled:
            self._record_amax(input.reshape(rows, self.in_features), weight, (True, True))
        if autocast:
            if plan.all_high_precision:
                return F.linear(input, weight, bias)  # exactly nn.Linear under autocast
            with torch.autocast(device_type, enabled=False):  # the kernels pick their own precision
                return self._forward_planned(input.to(torch.get_autocast_dtype(device_type)), weight, bias, lead, rows, plan)
        return self._forward_planned(input, weight, bias, lead, rows, plan)

    def _forward_planned(
        self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], lead: torch.Size, rows, plan: _LayerPlan
    ) -> torch.Tensor:
        if plan.all_high_precision and high_precision_dtype(input) == input.dtype == weight.dtype:
            return F.linear(input, weight, bias)  # exactly nn.Linear
        x2d = input.reshape(rows, self.in_features)
        state = None if compiling() else self._eager
        prior_amax = None
        slots = _delayed_operands(plan)
        if self.forward_scaling == "delayed" and any(slots) and (compiling() or self._scaled_as_compiled):
            if self._history_seeded:
                # Eagerly (compiled_scaling) too: the compiled quantization ops with these scales.
                state, prior_amax = None, self._amax_history.amax(dim=1)
            if compiling():  # an eager call judged as the compiled one records nothing
                observed = self._record_amax(x2d, weight, slots)
                if prior_amax is not None:  # the scales are finite: count the inf/NaN the amax saw
                    self._nonfinite_count.add_((~torch.isfinite(observed)).sum())
        needs_grad = torch.is_grad_enabled() and (
            input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if needs_grad:
            y2d, nonfinite = _LokaLinearFunction.apply(x2d, weight, bias, plan, state, prior_amax)
        else:  # no autograd bookkeeping, nothing kept for a backward
            q = _Quantizer(state, None if prior_amax is None else _prior_by_name(plan, prior_amax))
            y2d = _forward_gemm(q, x2d, weight.detach(), None if bias is None else bias.detach(), plan)[0]
            nonfinite = q.total()
        if nonfinite is not None:
            self._nonfinite_count.add_(nonfinite)
        return y2d.reshape(*lead, self.out_features)

    def _record_amax(self, x2d: torch.Tensor, weight: torch.Tensor, slots: Tuple[bool, bool]) -> torch.Tensor:
        """Push this call's amax of the input and the weight (where ``slots`` says; the newest entry
        is repeated elsewhere) onto the history; returns them. A non-finite amax is not recorded
        (the newest entry is repeated): one step's inf must not set the scale of the next ones."""
        history = self._amax_history
        observed = torch.stack([
            tensor_amax(t.detach()).to(history.dtype) if used else history[i, 0]
            for i, (t, used) in enumerate(((x2d, slots[0]), (weight, slots[1])))
        ])  # fmt: skip
        newest = torch.where(torch.isfinite(observed), observed, history[:, 0])
        history.copy_(torch.cat([newest[:, None], history[:, :-1]], dim=1))
        if not self._history_seeded:
            self._history_seeded = True
        return observed

    def _shape_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def extra_repr(self) -> str:
        k = self._kernels
        return (
            f"{self._shape_repr()}, fwd={k.fwd}, dgrad={k.dgrad}, wgrad={k.wgrad}, "
            f"grad_format={self._grad_format.value}"
        )

    # ----------------------------------------------------------------------------- counters
    def _count_pending(self) -> None:
        pending, self._eager.pending_scales = self._eager.pending_scales, []
        if pending:
            device = self._nonfinite_count.device
            flat = torch.cat([s.reshape(-1).to(device) for s in pending])
            self._nonfinite_count.add_(torch.isnan(flat).sum())

    @property
    def nonfinite_events(self) -> torch.Tensor:
        """Scaling groups with inf/NaN so far (int64 scalar on the layer's device; see the class docstring)."""
        self._count_pending()
        return self._nonfinite_count


class LokaLinear(GemmSite, nn.Linear):
    """``nn.Linear`` with a separately chosen kernel for each of its three GEMMs.

    Same parameters and ``state_dict`` keys as ``nn.Linear`` (``weight``, ``bias``), so checkpoints
    move both ways. Compiles with ``torch.compile(fullgraph=True)``; see the module docstring for
    what differs between compiled and eager calls.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        kernels: backend and recipe per GEMM role; default all high precision.
        grad_format: FP8 format of the gradient operand (``A`` of ``dgrad`` and ``wgrad``).
        forward_scaling: ``"current"`` (default) or ``"delayed"`` (compiled): what scales the
            forward's FP8 operands, see :class:`GemmSite`.

    Attributes:
        last_rows: rows (product of the leading dims) of the last eager forward input; a Python int.
        last_input_dtype, last_autocast_dtype: dtype of the last eager forward input, and the
            autocast dtype it ran under (``None``: autocast off); the layer check times the layer so.
        nonfinite_events: int64 scalar tensor on the layer's device (a non-persistent buffer, not
            in ``state_dict``): scaling groups of FP8-quantized operands whose amax was inf or
            NaN. Per rank (TorchRec's DDP wrapper does not broadcast buffers); reading it on the
            host syncs.
        fallback_reasons: role -> why the planned kernel cannot run on this layer's device (that
            GEMM runs in high precision instead). Reset by :meth:`set_kernels`.

    Example::

        >>> from loka_torchrec.evidence import KernelChoice
        >>> layer = LokaLinear(64, 32, kernels=LayerKernels(fwd=KernelChoice("emulated", "rowwise")))
        >>> y = layer(torch.randn(2, 3, 64))
        >>> y.sum().backward()
        >>> tuple(y.shape), layer.last_rows, layer.weight.grad.shape
        ((2, 3, 32), 6, torch.Size([32, 64]))
        >>> layer
        LokaLinear(in_features=64, out_features=32, bias=True, fwd=emulated:rowwise, dgrad=bf16:hp, wgrad=bf16:hp, grad_format=e4m3)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        kernels: LayerKernels = LayerKernels(),
        grad_format: Fp8Format = Fp8Format.E4M3,
        forward_scaling: str = "current",
    ) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_dispatch(kernels, grad_format, self.weight.device, forward_scaling)

    # ----------------------------------------------------------------------------- conversion
    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        kernels: LayerKernels = LayerKernels(),
        grad_format: Fp8Format = Fp8Format.E4M3,
        forward_scaling: str = "current",
    ) -> "LokaLinear":
        """A ``LokaLinear`` that shares ``linear``'s ``Parameter`` objects (no copy).

        Optimizers and wrappers built afterwards, or already holding those parameters, see the
        same tensors. The training/eval mode is kept.

        Args:
            linear: the layer to wrap (any ``nn.Linear``, on any device).
            kernels, grad_format, forward_scaling: as for the constructor.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        if isinstance(linear.weight, nn.parameter.UninitializedParameter):
            raise ValueError("linear: its weight is uninitialized (LazyLinear); run one forward first")
        weight = linear.weight
        # Built on 'meta' so nothing is allocated, then given linear's own parameters.
        new = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", dtype=weight.dtype,
            kernels=kernels, grad_format=grad_format, forward_scaling=forward_scaling,
        )  # fmt: skip
        new.weight = weight
        new.bias = linear.bias
        new._nonfinite_count = torch.zeros((), dtype=torch.int64, device=weight.device)
        new._amax_history = torch.zeros_like(new._amax_history, device=weight.device)
        new.set_kernels(kernels)  # planned for the real device now that the weight is there
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this layer's ``Parameter`` objects, in the same mode."""
        linear = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=self.weight.dtype
        )
        linear.weight = self.weight
        linear.bias = self.bias
        linear.train(self.training)
        return linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``y = x W^T + b`` with each GEMM on its planned kernel (see :meth:`GemmSite._site_forward`).

        Args:
            input: ``(*, in_features)`` floating point tensor.

        Returns:
            ``(*, out_features)`` tensor, as ``nn.Linear`` returns it.
        """
        return self._site_forward(input, self.weight, self.bias)

    def _shape_repr(self) -> str:
        return nn.Linear.extra_repr(self)
