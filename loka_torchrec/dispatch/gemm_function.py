"""The autograd function of a GEMM site and the GEMM helpers that keep its ``backward`` short.

``y = x W^T + b`` with its three GEMMs (forward, grad-input, grad-weight) each on the kernel its
:class:`~loka_torchrec.dispatch.role_kernels.SitePlan` names. The function is stateless apart
from the eager weight cache it is handed (``None`` when compiled), and takes its plan as an
argument, so ``torch.compile`` traces it whole, into one graph with the site's neighbours.

What the forward keeps for the backward is never a second high-precision copy of ``x`` where
grad-weight runs in FP8: it is the forward's FP8 ``x`` (transposed in the backward, where the
specs allow) or grad-weight's own ``x^T`` operand, quantized in the forward (1 byte per element).
Where grad-input reads the weight with the forward's tensorwise spec, the forward's FP8 weight
is transposed and kept (compiled; eagerly the weight cache serves it).
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Tuple

import torch

from loka_torchrec.dispatch.eager_cache import EagerState
from loka_torchrec.dispatch.operands import OperandKind, crop, pack_operand, pad2d, transpose_fp8, transposed_spec, unpack_operand
from loka_torchrec.dispatch.quantizer import Quantizer
from loka_torchrec.dispatch.role_kernels import RoleKernel, SitePlan, prior_amax_by_operand, reuses_transposed
from loka_torchrec.fp8 import Fp8Tensor, Granularity
from loka_torchrec.fp8.scaling import tensor_amax

__all__ = ["KeptActivation", "LokaLinearFunction", "forward_gemm", "record_grad_amax"]


class KeptActivation(enum.Enum):
    """What the forward keeps of ``x`` for grad-weight."""

    NONE = "none"  # no weight gradient wanted: nothing
    HIGH_PRECISION = "hp"  # x itself (grad-weight runs in high precision)
    FP8_TRANSPOSED = "transpose"  # the forward's FP8 x, transposed in the backward
    OPERAND = "operand"  # grad-weight's B operand x^T, quantized in the forward


def record_grad_amax(history: torch.Tensor, events: torch.Tensor, dy2d: torch.Tensor, prior: Optional[torch.Tensor]) -> None:
    """Push ``dy``'s amax onto a site's ``dy`` history (newest first; a non-finite amax repeats the
    newest entry, so one step's inf sets no later scale) and count the call in ``events``: ``[0]``
    every call, ``[1]`` where ``dy`` went beyond ``prior``, the delayed amax that scaled it (it
    saturated; ``None``: scaled by its own amax), ``[2]`` where ``dy`` held inf or NaN. Both are
    written in place by the backward; compiled, AOTAutograd keeps such writes of forward inputs in
    the backward graph."""
    observed = tensor_amax(dy2d.detach()).to(history.dtype)
    finite = torch.isfinite(observed)
    saturated = (observed > prior) & finite if prior is not None else torch.zeros_like(finite)
    events.copy_(events + torch.stack([torch.ones_like(finite), saturated, ~finite]).to(events.dtype))
    history.copy_(torch.cat([torch.where(finite, observed, history[0]).reshape(1), history[:-1]]))


def _weight_operand(q: Quantizer, weight: torch.Tensor, kernel: RoleKernel, plan: SitePlan, *, transposed: bool) -> Any:
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
        other = cache.get((kernel.choice.backend, transposed_spec(spec), not transposed, shape[::-1]))
        if isinstance(other, Fp8Tensor):
            op = transpose_fp8(other)
    if op is None:
        src = weight.t() if transposed else weight
        if spec is None:
            op = kernel.backend.quantize(src)
        else:
            op = q(kernel, pad2d(src, *shape), spec, "weight^T" if transposed else "weight")
    if cache is not None:
        cache[key] = op
    return op


def forward_gemm(
    q: Quantizer, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: SitePlan,
    xq: Any = None, w_op: Any = None,
) -> Tuple[torch.Tensor, Any]:
    """``y (rows, out) = x W^T + b``; also returns the quantized ``x`` (``None`` in high precision).

    ``xq``: ``x`` already quantized for this kernel (:meth:`Quantizer.paired`), else ``None``;
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
            x_pad = pad2d(x2d, kernel.padded(rows), kernel.padded(plan.in_features))
            xq = q(kernel, x_pad, kernel.recipe.a, "input")
        y = backend.mm(xq, w_op, kernel.recipe, x2d.dtype)
        y = crop(y, rows, plan.out_features)
    if bias is not None:
        y = y + bias.to(y.dtype)  # after the GEMM, in high precision
    return y, xq


def _wgrad_activation(q: Quantizer, x2d: torch.Tensor, xq: Any, plan: SitePlan) -> Tuple[KeptActivation, Any]:
    """What the forward keeps of ``x`` for grad-weight: ``(kind, operand)`` (:class:`KeptActivation`)."""
    wk, fk = plan.wgrad, plan.fwd
    if not wk.fp8:
        return KeptActivation.HIGH_PRECISION, x2d
    shape = (wk.padded(plan.in_features), wk.padded(x2d.shape[0]))  # x^T: (N, K) of grad-weight
    if isinstance(xq, Fp8Tensor) and reuses_transposed(fk, "a", wk, "b"):
        return KeptActivation.FP8_TRANSPOSED, xq
    return KeptActivation.OPERAND, q(wk, pad2d(x2d.t(), *shape), wk.recipe.b, "input^T")


def _grad_input(
    q: Quantizer, dy2d: torch.Tensor, weight: torch.Tensor, plan: SitePlan, out_dtype: torch.dtype, dyq: Any = None,
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
        dy_pad = pad2d(dy2d, kernel.padded(rows), kernel.padded(plan.out_features))
        dyq = q(kernel, dy_pad, kernel.recipe.a, "grad_output")
    dx = backend.mm(dyq, w_op, kernel.recipe, out_dtype)
    return crop(dx, rows, plan.in_features), dyq


def _grad_weight(
    q: Quantizer, dy2d: torch.Tensor, x_kept: KeptActivation, x_op: Any, dyq: Any, plan: SitePlan, out_dtype: torch.dtype,
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
    elif isinstance(dyq, Fp8Tensor) and reuses_transposed(dk, "a", wk, "a"):
        a = transpose_fp8(dyq)
    else:
        a = q(wk, pad2d(dy2d.t(), *shape), wk.recipe.a, "grad_output^T")
    b = transpose_fp8(x_op) if x_kept is KeptActivation.FP8_TRANSPOSED else x_op
    dw = backend.mm(a, b, wk.recipe, out_dtype)
    return crop(dw, plan.out_features, plan.in_features)


class LokaLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with forward, grad-input and grad-weight GEMMs on separate kernels.

    Stateless apart from ``state`` (eager calls only), so ``torch.compile`` traces it whole.
    ``prior_amax``: ``None``, or (compiled) the ``(2,)`` delayed amaxes of the input and the weight
    (:meth:`GemmSite._forward_planned`; used where
    :func:`~loka_torchrec.dispatch.role_kernels.delayed_operands` says).
    ``grad_history``, ``grad_events``: ``None`` (``dy`` scaled by its current amax, nothing recorded),
    or the site's ``dy`` amax history and event counts (:func:`record_grad_amax`); then
    ``grad_delayed`` scales the backward's tensorwise ``dy`` operands by the history's largest amax
    instead of ``dy``'s own, and ``grad_record`` records this call's (compiled training calls; not
    a check of a compiled model's numerics).
    Returns ``(y, nonfinite)``: ``nonfinite`` counts the NaN scales of the forward's operands when
    compiled (``None`` eagerly, where the layer's queue counts them).
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, plan: SitePlan, state: Optional[EagerState], prior_amax,  # type: ignore[override]
                grad_history=None, grad_events=None, grad_delayed: bool = False, grad_record: bool = False):  # fmt: skip
        q = Quantizer(state, None if prior_amax is None else prior_amax_by_operand(plan, prior_amax))
        # x for the forward GEMM and x^T for grad-weight from one read of x, where one backend runs both.
        pair = None
        if ctx.needs_input_grad[1]:
            pair = q.paired(x2d, plan.fwd, "a", plan.wgrad, "b", plan.in_features, "input")
        w_op = w_t = None
        if state is None and ctx.needs_input_grad[0] and reuses_transposed(plan.fwd, "b", plan.dgrad, "b"):
            # Compiled: W^T for grad-input is the forward's FP8 W transposed (the eager path gets
            # the same from its weight cache), one cast of W per step instead of two.
            w_op = _weight_operand(q, weight, plan.fwd, plan, transposed=False)
            if isinstance(w_op, Fp8Tensor):
                w_t = transpose_fp8(w_op)
        y, xq = forward_gemm(q, x2d, weight, bias, plan, xq=None if pair is None else pair[0], w_op=w_op)
        ctx.plan, ctx.state = plan, state
        # Written in place by the backward: kept on ctx, not saved (a saved tensor's version is checked).
        ctx.grad_history, ctx.grad_events = grad_history, grad_events
        ctx.grad_delayed, ctx.grad_record = grad_delayed and grad_history is not None, grad_record and grad_history is not None
        ctx.x_dtype = x2d.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_kept, x_tensors, ctx.x_meta = KeptActivation.NONE, (), (OperandKind.OPAQUE, None)
        if pair is not None:
            ctx.x_kept, x_op = KeptActivation.OPERAND, pair[1]
            x_tensors, ctx.x_meta = pack_operand(x_op)
        elif ctx.needs_input_grad[1]:
            ctx.x_kept, x_op = _wgrad_activation(q, x2d, xq, plan)
            x_tensors, ctx.x_meta = pack_operand(x_op)
        ctx.w_t_meta, w_t_tensors = None, ()
        if w_t is not None:
            w_t_tensors, ctx.w_t_meta = pack_operand(w_t)
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
        # The delayed amax is read once, before this call's is recorded.
        prior = ctx.grad_history.amax() if ctx.grad_delayed else None
        q = Quantizer(ctx.state, None if prior is None else {"grad_output": prior})
        if ctx.grad_record:
            record_grad_amax(ctx.grad_history, ctx.grad_events, dy2d, prior)
        weight, *saved = ctx.saved_tensors
        x_tensors, w_t_tensors = saved[: ctx.n_x_tensors], saved[ctx.n_x_tensors :]
        w_t = None if ctx.w_t_meta is None else unpack_operand(tuple(w_t_tensors), ctx.w_t_meta)
        grad_x = grad_w = grad_b = None
        dyq = None
        # dy for grad-input and dy^T for grad-weight from one read of dy, where one backend runs both.
        pair = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            pair = q.paired(dy2d, plan.dgrad, "a", plan.wgrad, "a", plan.out_features, "grad_output")
        if ctx.needs_input_grad[0]:
            grad_x, dyq = _grad_input(q, dy2d, weight, plan, ctx.x_dtype, dyq=None if pair is None else pair[0], w_op=w_t)
        if ctx.needs_input_grad[1]:
            x_op = unpack_operand(tuple(x_tensors), ctx.x_meta)
            grad_w = _grad_weight(q, dy2d, ctx.x_kept, x_op, dyq, plan, weight.dtype, dytq=None if pair is None else pair[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy2d.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None
