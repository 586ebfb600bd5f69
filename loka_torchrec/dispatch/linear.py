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
:class:`~loka_torchrec.dispatch.layer_kernels.LayerKernels` names, through an
``autograd.Function``. What it keeps, and why:

* **Weight, quantized once per step.** The quantized weight operand is cached, keyed by the
  weight's ``(_version, data_ptr)`` and by (backend, operand spec, orientation, padded shape), so
  forward, grad-input and any number of micro-batches or eval calls between two optimizer steps
  quantize it once; ``optimizer.step()`` updates the weight in place, which bumps ``_version`` and
  invalidates the cache. For tensorwise scaling (and blockwise with square tiles) the grad-input
  operand ``W^T`` is the forward's FP8 bytes transposed (a copy, no re-scaling: the scales of
  ``W`` and ``W^T`` are the same set). Rowwise cannot do this: the forward scales ``W`` per row
  (output channel) while ``W^T`` needs one scale per *column* of ``W``, so it is quantized a second
  time along the other axis (and cached too). Memory: the cache holds one FP8 copy (1 byte per
  weight element plus scales) per distinct operand until the next weight update. Nothing is
  cached while ``torch.compile`` traces: a compiled graph quantizes the weight in every call.
* **Saved activation in the wgrad kernel's format.** A high-precision wgrad keeps ``x`` as it came
  in (a reference, as ``nn.Linear`` does). An FP8 wgrad keeps only the quantized ``x^T`` operand
  (1 byte per element plus scales), made in the forward, so the backward never re-quantizes
  ``x``; when the forward already quantized ``x`` with the same spec on the same backend
  (tensorwise), that FP8 tensor is kept and transposed in the backward. This saves memory only
  where nothing else holds on to ``x``; it never adds more than 1 byte per element.
* **Non-finite values.** Operands are quantized with ``nonfinite="propagate"``: a group holding inf
  or NaN gets a NaN scale, so every output reading it is NaN, never silently finite; each such
  scaling group (the tensor, a row or a block) adds one to the counter ``nonfinite_events``. The
  scales are counted in batches of up to 64 operands (one concatenation and one reduction on the
  device, no host sync) and whenever the counter is read, so a step pays no per-operand kernels.
* **Shapes a backend cannot take.** Checked with ``backend.check`` once per input shape (inputs
  whose row counts agree modulo the grad-weight backend's alignment count as one shape). Where
  the backend needs ``K`` and ``N`` to be multiples of an alignment (16 for ``torch._scaled_mm``
  on CUDA), the operands are zero-padded: zeros add nothing to a dot product and change no amax,
  so the result is exact. Otherwise that GEMM runs in high precision and the reason is kept in
  ``fallback_reasons``.

When every GEMM runs in high precision and the input already has the high-precision dtype (fp32
on the CPU, bf16 on CUDA) the layer calls ``torch.nn.functional.linear``: it is then ``nn.Linear``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from loka_torchrec.dispatch.backends import GemmBackend, get_backend
from loka_torchrec.dispatch.backends.high_precision import high_precision_dtype
from loka_torchrec.dispatch.layer_graph import LayerGraphs, capturing, compiling as _is_compiling
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.recipes import GemmRecipe, OperandSpec, recipe_for
from loka_torchrec.evidence import BF16, GemmRole, GemmShape, KernelChoice
from loka_torchrec.fp8 import Fp8Format, Fp8Tensor, Granularity

__all__ = ["LokaLinear"]

logger = logging.getLogger(__name__)

_ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)
_MAX_SHAPE_PLANS = 64  # input shapes remembered per layer (jagged inputs vary rows every step)
_PENDING_SCALES = 64  # operands whose scales are counted for nonfinite_events in one batch


# --------------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class _RoleKernel:
    """How one GEMM runs at one input shape.

    Attributes:
        choice: the kernel that runs (``bf16:hp`` where the planned one fell back).
        recipe: operand quantization, ``None`` for high precision.
        align: ``K`` and ``N`` are zero-padded up to a multiple of this (1: no padding).
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

    def padded(self, dim: int) -> int:
        """``dim`` rounded up to this kernel's alignment."""
        return dim if self.align == 1 else _round_up(dim, self.align)


class _ShapePlan(NamedTuple):
    fwd: _RoleKernel
    dgrad: _RoleKernel
    wgrad: _RoleKernel

    @property
    def all_high_precision(self) -> bool:
        return not (self.fwd.fp8 or self.dgrad.fp8 or self.wgrad.fp8)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# --------------------------------------------------------------------------------------- operands
def _pad2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` zero-padded at the bottom and right to ``(rows, cols)``."""
    if t.shape[0] == rows and t.shape[1] == cols:
        return t
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


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
    return (), ("opaque", op)  # a backend's own operand type: kept as is


def _unpack_operand(tensors: Tuple[torch.Tensor, ...], meta: Any) -> Any:
    if meta[0] == "fp8":
        return Fp8Tensor(tensors[0], tensors[1], meta[1], meta[2], meta[3])
    if meta[0] == "tensor":
        return tensors[0]
    return meta[1]


# --------------------------------------------------------------------------------------- module
class LokaLinear(nn.Linear):
    """``nn.Linear`` with a separately chosen kernel for each of its three GEMMs.

    Same parameters and ``state_dict`` keys as ``nn.Linear`` (``weight``, ``bias``), so checkpoints
    move both ways. See the module docstring for what is cached and saved.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        kernels: backend and recipe per GEMM role; default all high precision.
        grad_format: FP8 format of the gradient operand (``A`` of ``dgrad`` and ``wgrad``).
        cuda_graphs: on CUDA, capture the forward and backward of a layer with an FP8 GEMM as CUDA
            graphs, one pair per recurring input shape, and replay them (cuts the host time of the
            layer's dozen launches to two; see :mod:`loka_torchrec.dispatch.layer_graph` for what
            a caller must know). Ignored on the CPU and for all-high-precision layers.

    Attributes:
        last_rows: rows (product of the leading dims) of the last forward input; a Python int.
        last_input_dtype, last_autocast_dtype: dtype of the last forward input, and the autocast
            dtype it ran under (``None``: autocast off); the layer check times the layer so.
        nonfinite_events: int64 scalar tensor on the layer's device (a non-persistent buffer, not
            in ``state_dict``): scaling groups of FP8-quantized operands whose amax was inf or
            NaN. Per rank (TorchRec's DDP wrapper does not broadcast buffers); reading it on the
            host syncs.
        fallback_reasons: role -> why the planned kernel could not run at some shape (that GEMM
            ran in high precision instead). Cleared by :meth:`set_kernels`.
        cuda_graphs: as the argument; may be changed at any time.
        graphs: the captured shapes (:class:`~loka_torchrec.dispatch.layer_graph.LayerGraphs`:
            ``captures``, ``replays``, ``failure``); cleared by :meth:`set_kernels`.

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

    _nonfinite_count: torch.Tensor
    last_rows: int
    last_input_dtype: Optional[torch.dtype]
    last_autocast_dtype: Optional[torch.dtype]
    fallback_reasons: Dict[GemmRole, str]

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
        cuda_graphs: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_dispatch(kernels, grad_format, self.weight.device, cuda_graphs)

    def _init_dispatch(
        self, kernels: LayerKernels, grad_format: Fp8Format, device: torch.device, cuda_graphs: bool = False
    ) -> None:
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs: expected a bool, got {type(cuda_graphs).__name__}")
        self.cuda_graphs = cuda_graphs
        self._graphs = LayerGraphs()
        # Non-persistent: a run-time counter, not model state; checkpoints stay nn.Linear's.
        self.register_buffer("_nonfinite_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self._pending_scales: list = []  # dequantization scales not yet counted (see nonfinite_events)
        self.last_rows = 0
        self.last_input_dtype = None
        self.last_autocast_dtype = None
        self.fallback_reasons = {}
        self._grad_format = Fp8Format.parse(grad_format, field="grad_format")
        self._weight_cache: Dict[Tuple, Any] = {}
        self._weight_stamp: Optional[Tuple] = None
        self._shape_plans: "collections.OrderedDict[Tuple, _ShapePlan]" = collections.OrderedDict()
        self.set_kernels(kernels)

    # ----------------------------------------------------------------------------- conversion
    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        kernels: LayerKernels = LayerKernels(),
        grad_format: Fp8Format = Fp8Format.E4M3,
        cuda_graphs: bool = False,
    ) -> "LokaLinear":
        """A ``LokaLinear`` that shares ``linear``'s ``Parameter`` objects (no copy).

        Optimizers and wrappers built afterwards, or already holding those parameters, see the
        same tensors. The training/eval mode is kept.

        Args:
            linear: the layer to wrap (any ``nn.Linear``, on any device).
            kernels, grad_format, cuda_graphs: as for the constructor.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        if isinstance(linear.weight, nn.parameter.UninitializedParameter):
            raise ValueError("linear: its weight is uninitialized (LazyLinear); run one forward first")
        weight = linear.weight
        # Built on 'meta' so nothing is allocated, then given linear's own parameters.
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            dtype=weight.dtype,
            kernels=kernels,
            grad_format=grad_format,
            cuda_graphs=cuda_graphs,
        )
        new.weight = weight
        new.bias = linear.bias
        new._nonfinite_count = torch.zeros((), dtype=torch.int64, device=weight.device)
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

    # ----------------------------------------------------------------------------- kernels
    @property
    def kernels(self) -> LayerKernels:
        """The planned kernel per role (see :attr:`fallback_reasons` for where one could not run)."""
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: LayerKernels) -> None:
        self.set_kernels(kernels)

    @property
    def graphs(self) -> LayerGraphs:
        return self._graphs

    @property
    def grad_format(self) -> Fp8Format:
        return self._grad_format

    def set_kernels(self, kernels: LayerKernels) -> None:
        """Route the three GEMMs to ``kernels``; names are checked against the backend registry.

        Whether a backend runs on this machine, and at which shapes, is checked at the first
        forward of each input shape (see :attr:`fallback_reasons`).

        Raises:
            TypeError: ``kernels`` is not a :class:`LayerKernels`.
            ValueError: an unknown backend, or a recipe the backend does not have.
        """
        if not isinstance(kernels, LayerKernels):
            raise TypeError(f"kernels: expected a LayerKernels, got {type(kernels).__name__}")
        resolved = {}
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
            recipe = None if choice.is_high_precision else recipe_for(choice.recipe, role, grad_format=self._grad_format)
            resolved[role] = (choice, recipe)
        self._kernels = kernels
        self._resolved = resolved
        self._shape_plans.clear()
        self._graphs.clear()
        self.fallback_reasons = {}

    def _plan(self, rows: int, device: torch.device) -> _ShapePlan:
        """The kernels for an input of ``rows`` rows on ``device``, checked once per shape class.

        ``rows`` is only the reduction dim of grad-weight, and ``GemmBackend.check`` reads it only
        through its alignment; so inputs whose ``rows`` agree modulo the grad-weight backend's
        alignment share one plan. Under ``torch.compile`` this keeps a varying batch size from
        specializing the graph on it.
        """
        period = get_backend(self._resolved[GemmRole.GRAD_WEIGHT][0].backend).alignment(device)
        key = (rows % period, str(device))
        plan = self._shape_plans.get(key)
        if plan is None:
            plan = self._build_plan(key, rows, device)
        return plan

    # Run eagerly even under torch.compile: backend.check may probe the device with a tiny GEMM,
    # which must not become part of a traced graph (a graph break here is taken once per shape).
    @torch.compiler.disable
    def _build_plan(self, key: Tuple, rows: int, device: torch.device) -> _ShapePlan:
        plan = _ShapePlan(*(self._role_kernel(role, rows, device) for role in _ROLES))
        if len(self._shape_plans) >= _MAX_SHAPE_PLANS:
            self._shape_plans.popitem(last=False)
        self._shape_plans[key] = plan
        return plan

    def _role_kernel(self, role: GemmRole, rows: int, device: torch.device) -> _RoleKernel:
        choice, recipe = self._resolved[role]
        shape = GemmShape.for_role(role, rows, self.in_features, self.out_features)
        if recipe is None:
            return _RoleKernel(choice, None)
        backend = get_backend(choice.backend)
        reason = backend.check(recipe, shape, device)
        if reason is None:
            return _RoleKernel(choice, recipe)
        align = backend.alignment(device)
        if align > 1:
            padded = GemmShape(shape.m, _round_up(shape.k, align), _round_up(shape.n, align))
            if padded != shape and backend.check(recipe, padded, device) is None:
                return _RoleKernel(choice, recipe, align)  # exact: zeros add nothing
        message = f"{choice} cannot run {role.value} GEMM {shape} on {device}: {reason}"
        self.fallback_reasons[role] = message
        logger.warning("LokaLinear(%d, %d): %s; using bf16:hp", self.in_features, self.out_features, message)
        return _RoleKernel(BF16, None)

    # ----------------------------------------------------------------------------- forward
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``y = x W^T + b`` with each GEMM on its planned kernel.

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
        self.last_rows = rows
        weight, bias = self.weight, self.bias
        if rows == 0:
            return F.linear(input, weight, bias)  # nothing to quantize
        plan = self._plan(rows, input.device)
        device_type = input.device.type
        self.last_input_dtype = input.dtype
        if torch.is_autocast_enabled(device_type):
            self.last_autocast_dtype = torch.get_autocast_dtype(device_type)
            if plan.all_high_precision:
                return F.linear(input, weight, bias)  # exactly nn.Linear under autocast
            with torch.autocast(device_type, enabled=False):  # the kernels pick their own precision
                return self._forward_planned(input.to(torch.get_autocast_dtype(device_type)), lead, rows, plan)
        self.last_autocast_dtype = None
        return self._forward_planned(input, lead, rows, plan)

    def _forward_planned(self, input: torch.Tensor, lead: torch.Size, rows: int, plan: _ShapePlan) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if plan.all_high_precision and high_precision_dtype(input) == input.dtype == weight.dtype:
            return F.linear(input, weight, bias)  # exactly nn.Linear
        x2d = input.reshape(rows, self.in_features)
        needs_grad = torch.is_grad_enabled() and (
            input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if needs_grad:
            y2d = None
            if self.cuda_graphs and x2d.is_cuda and not plan.all_high_precision and not _is_compiling():
                y2d = self._graphs.run(self, plan, x2d, weight, bias)  # None: run eagerly this time
            if y2d is None:
                y2d = _LokaLinearFunction.apply(x2d, weight, bias, self, plan)
        else:  # no autograd bookkeeping, nothing kept for a backward
            y2d = self._forward_gemm(x2d, weight.detach(), None if bias is None else bias.detach(), plan.fwd)[0]
        return y2d.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        k = self._kernels
        return (
            f"{super().extra_repr()}, fwd={k.fwd}, dgrad={k.dgrad}, wgrad={k.wgrad}, "
            f"grad_format={self._grad_format.value}" + (", cuda_graphs=True" if self.cuda_graphs else "")
        )

    # ----------------------------------------------------------------------------- GEMMs
    def _quantize(self, kernel: _RoleKernel, t: torch.Tensor, spec: OperandSpec, name: str) -> Any:
        return self._counted(kernel.backend.quantize(t, spec, name=name))

    def _counted(self, op: Any) -> Any:
        """``op``, its scales queued for :attr:`nonfinite_events` (a NaN scale marks inf/NaN in its group)."""
        scale = getattr(op, "dequant_scale", None)
        if isinstance(scale, torch.Tensor):
            if _is_compiling() or capturing():
                self._nonfinite_count.add_(torch.isnan(scale).sum())  # traced or captured: no Python-side queue
            else:
                self._pending_scales.append(scale.detach())
                if len(self._pending_scales) >= _PENDING_SCALES:
                    self._count_pending()
        return op

    def _count_pending(self) -> None:
        pending, self._pending_scales = self._pending_scales, []
        if pending:
            device = self._nonfinite_count.device
            flat = torch.cat([s.reshape(-1).to(device) for s in pending])
            self._nonfinite_count.add_(torch.isnan(flat).sum())

    @property
    def nonfinite_events(self) -> torch.Tensor:
        """Scaling groups with inf/NaN so far (int64 scalar on the layer's device; see the class docstring)."""
        self._count_pending()
        return self._nonfinite_count

    def _paired(
        self, t: torch.Tensor, first: _RoleKernel, first_spec: str, second: _RoleKernel, second_spec: str,
        cols: int, name: str,
    ) -> Optional[Tuple[Any, Any]]:
        """``t`` (rows, cols) as an operand of ``first`` and ``t^T`` as one of ``second``, from one read.

        ``first_spec`` / ``second_spec`` name the operand (``"a"`` or ``"b"``) of each recipe. Only
        where one backend runs both GEMMs with the same tensorwise or rowwise spec, offers
        ``quantize_with_transpose``, and neither operand needs padding beyond ``cols``; else ``None``
        (the caller quantizes each operand on its own).
        """
        if not (first.fp8 and second.fp8) or first.choice.backend != second.choice.backend:
            return None
        spec = getattr(first.recipe, first_spec)
        if spec != getattr(second.recipe, second_spec) or spec.granularity == Granularity.BLOCKWISE:
            return None
        rows = t.shape[0]
        if second.padded(rows) != rows or second.padded(cols) != first.padded(cols) or first.padded(cols) != cols:
            return None
        pair = getattr(first.backend, "quantize_with_transpose", None)
        if pair is None:
            return None
        op, op_t = pair(t, spec, name=name)
        return self._counted(op), self._counted(op_t)

    def _weight_cache_for(self, weight: torch.Tensor) -> Optional[Dict[Tuple, Any]]:
        """The operand cache valid for ``weight``'s current values, or ``None`` when not caching."""
        if _is_compiling() or capturing() or weight.is_inference():
            # Traced and captured graphs must not depend on Python-side state (a CUDA graph re-reads
            # the weight on every replay); inference tensors have no version.
            return None
        try:
            stamp = (weight._version, weight.data_ptr(), weight.dtype, weight.device)
        except RuntimeError:  # a tensor without storage of its own (e.g. a wrapper subclass): no caching
            return None
        if stamp != self._weight_stamp:
            self._weight_cache = {}
            self._weight_stamp = stamp
        return self._weight_cache

    def _weight_operand(self, weight: torch.Tensor, kernel: _RoleKernel, *, transposed: bool) -> Any:
        """``B`` of the forward (``W``) or grad-input (``W^T``, ``transposed``) GEMM, cached per step."""
        spec = kernel.recipe.b if kernel.fp8 else None
        out_f, in_f = kernel.padded(self.out_features), kernel.padded(self.in_features)
        shape = (in_f, out_f) if transposed else (out_f, in_f)
        key = (kernel.choice.backend, spec, transposed, shape)
        cache = self._weight_cache_for(weight)
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
                op = self._quantize(kernel, _pad2d(src, *shape), spec, "weight^T" if transposed else "weight")
        if cache is not None:
            cache[key] = op
        return op

    def _forward_gemm(
        self, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kernel: _RoleKernel,
        xq: Any = None,
    ) -> Tuple[torch.Tensor, Any]:
        """``y (rows, out) = x W^T + b``; also returns the quantized ``x`` (``None`` in high precision).

        ``xq``: ``x`` already quantized for this kernel (by :meth:`_paired`), else ``None``.
        """
        backend = kernel.backend
        w_op = self._weight_operand(weight, kernel, transposed=False)
        if not kernel.fp8:
            y, xq = backend.mm(backend.quantize(x2d), w_op, None, x2d.dtype), None
        else:
            if xq is None:
                x_pad = _pad2d(x2d, x2d.shape[0], kernel.padded(self.in_features))
                xq = self._quantize(kernel, x_pad, kernel.recipe.a, "input")
            y = backend.mm(xq, w_op, kernel.recipe, x2d.dtype)
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
        if bias is not None:
            y = y + bias.to(y.dtype)  # after the GEMM, in high precision
        return y, xq

    def _wgrad_activation(self, x2d: torch.Tensor, xq: Any, plan: _ShapePlan) -> Tuple[str, Any]:
        """What the forward keeps of ``x`` for grad-weight: ``(mode, operand)``.

        ``"hp"``: ``x`` itself; ``"transpose"``: the forward's FP8 ``x``, transposed in the backward;
        ``"operand"``: the grad-weight ``B`` operand ``x^T``, quantized now.
        """
        wk, fk = plan.wgrad, plan.fwd
        if not wk.fp8:
            return "hp", x2d
        shape = (wk.padded(self.in_features), wk.padded(x2d.shape[0]))  # x^T: (N, K) of grad-weight
        if (
            isinstance(xq, Fp8Tensor)
            and fk.choice.backend == wk.choice.backend
            and _transpose_reusable(fk.recipe.a, wk.recipe.b)
            and tuple(xq.shape) == shape[::-1]
        ):
            return "transpose", xq
        return "operand", self._quantize(wk, _pad2d(x2d.t(), *shape), wk.recipe.b, "input^T")

    def _grad_input(
        self, dy2d: torch.Tensor, weight: torch.Tensor, kernel: _RoleKernel, out_dtype: torch.dtype, dyq: Any = None
    ) -> Tuple[torch.Tensor, Any]:
        """``dx (rows, in) = dy W``; also returns the quantized ``dy`` (``None`` in high precision).

        ``dyq``: ``dy`` already quantized for this kernel (by :meth:`_paired`), else ``None``.
        """
        backend = kernel.backend
        w_op = self._weight_operand(weight, kernel, transposed=True)
        if not kernel.fp8:
            return backend.mm(backend.quantize(dy2d), w_op, None, out_dtype), None
        if dyq is None:
            dy_pad = _pad2d(dy2d, dy2d.shape[0], kernel.padded(self.out_features))
            dyq = self._quantize(kernel, dy_pad, kernel.recipe.a, "grad_output")
        dx = backend.mm(dyq, w_op, kernel.recipe, out_dtype)
        if dx.shape[1] != self.in_features:
            dx = dx[:, : self.in_features]
        return dx, dyq

    def _grad_weight(
        self, dy2d: torch.Tensor, x_mode: str, x_op: Any, dyq: Any, plan: _ShapePlan, out_dtype: torch.dtype,
        dytq: Any = None,
    ) -> torch.Tensor:
        """``dW (out, in) = dy^T x`` from the kept activation and, where reusable, dgrad's FP8 ``dy``.

        ``dytq``: the operand ``dy^T`` already quantized for this kernel (by :meth:`_paired`), else ``None``.
        """
        wk, dk = plan.wgrad, plan.dgrad
        backend = wk.backend
        if not wk.fp8:
            return backend.mm(backend.quantize(dy2d.t()), backend.quantize(x_op.t()), None, out_dtype)
        shape = (self.out_features, wk.padded(dy2d.shape[0]))  # dy^T: (M, K) of grad-weight; M is not padded
        if dytq is not None:
            a = dytq
        elif (
            isinstance(dyq, Fp8Tensor)
            and dk.choice.backend == wk.choice.backend
            and _transpose_reusable(dk.recipe.a, wk.recipe.a)
            and tuple(dyq.shape) == shape[::-1]
        ):
            a = _transpose_fp8(dyq)
        else:
            a = self._quantize(wk, _pad2d(dy2d.t(), *shape), wk.recipe.a, "grad_output^T")
        b = _transpose_fp8(x_op) if x_mode == "transpose" else x_op
        dw = backend.mm(a, b, wk.recipe, out_dtype)
        if dw.shape[1] != self.in_features:
            dw = dw[:, : self.in_features]
        return dw


class _LokaLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with forward, grad-input and grad-weight GEMMs on separate kernels."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, layer: LokaLinear, plan: _ShapePlan):  # type: ignore[override]
        # x for the forward GEMM and x^T for grad-weight from one read of x, where one backend runs both.
        pair = None
        if ctx.needs_input_grad[1]:
            pair = layer._paired(x2d, plan.fwd, "a", plan.wgrad, "b", layer.in_features, "input")
        y, xq = layer._forward_gemm(x2d, weight, bias, plan.fwd, xq=None if pair is None else pair[0])
        ctx.layer, ctx.plan = layer, plan
        ctx.x_dtype = x2d.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_mode, x_tensors, ctx.x_meta = "none", (), ("opaque", None)
        if pair is not None:
            ctx.x_mode, x_op = "operand", pair[1]
            x_tensors, ctx.x_meta = _pack_operand(x_op)
        elif ctx.needs_input_grad[1]:
            ctx.x_mode, x_op = layer._wgrad_activation(x2d, xq, plan)
            x_tensors, ctx.x_meta = _pack_operand(x_op)
        # The weight is saved so that autograd's version check catches an in-place update between
        # forward and backward; it is the Parameter itself, no copy.
        ctx.save_for_backward(weight, *x_tensors)
        return y

    @staticmethod
    def backward(ctx, dy2d):  # type: ignore[override]
        layer, plan = ctx.layer, ctx.plan
        weight, *x_tensors = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        dyq = None
        # dy for grad-input and dy^T for grad-weight from one read of dy, where one backend runs both.
        pair = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            pair = layer._paired(dy2d, plan.dgrad, "a", plan.wgrad, "a", layer.out_features, "grad_output")
        if ctx.needs_input_grad[0]:
            grad_x, dyq = layer._grad_input(dy2d, weight, plan.dgrad, ctx.x_dtype, dyq=None if pair is None else pair[0])
        if ctx.needs_input_grad[1]:
            x_op = _unpack_operand(tuple(x_tensors), ctx.x_meta)
            grad_w = layer._grad_weight(
                dy2d, ctx.x_mode, x_op, dyq, plan, weight.dtype, dytq=None if pair is None else pair[1]
            )
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = dy2d.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None
