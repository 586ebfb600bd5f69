"""``GemmSite``: the base of every module Dispatch manages, and the delayed scaling of its forward.

A site is ``y = x W^T + b`` whose three GEMMs each run on their own kernel. It holds what the
Dispatcher sets (the kernels, resolved for its device into a
:class:`~loka_torchrec.dispatch.role_kernels.SitePlan`) and what the Dispatcher and the Probe read
(``last_rows``, the input dtypes, ``fallback_reasons``, ``nonfinite_events``), runs each call
through :class:`~loka_torchrec.dispatch.gemm_function.LokaLinearFunction`, and keeps the amax
history that delayed scaling reads (:class:`GemmSite`'s docstring).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from loka_torchrec.dispatch.eager_cache import EagerState
from loka_torchrec.dispatch.gemm_function import LokaLinearFunction, forward_gemm
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.quantizer import Quantizer
from loka_torchrec.dispatch.role_kernels import GEMM_ROLES, RoleKernel, SitePlan, delayed_grad_operand, delayed_operands, prior_amax_by_operand
from loka_torchrec.evidence import BF16, GemmRole, GemmShape
from loka_torchrec.fp8 import Fp8Format, tensor_amax
from loka_torchrec.fp8.scaling import check_scaling
from loka_torchrec.gemm.backends import get_backend
from loka_torchrec.gemm.backends.high_precision import high_precision_dtype
from loka_torchrec.gemm.recipes import recipe_for

__all__ = ["AMAX_HISTORY", "GemmSite", "compiled_scaling", "compiling"]

logger = logging.getLogger(__name__)

_PENDING_SCALES = 64  # operands whose scales are counted for nonfinite_events in one batch (eager)
AMAX_HISTORY = 16
"""Calls whose amaxes a ``"delayed"`` layer keeps; the largest of them scales its next call."""


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


def _scaling_setting(name: str, operands: str) -> property:
    """A site's ``"current"`` / ``"delayed"`` setting ``name`` (stored as ``_<name>``), checked when set."""
    slot = f"_{name}"

    def get(self) -> str:
        return getattr(self, slot)

    def set(self, value: str) -> None:
        check_scaling(value, name)
        setattr(self, slot, value)

    return property(get, set, doc=f"``\"current\"`` or ``\"delayed\"``: what scales {operands} (class docstring).")


class _RunMark:
    """What a compiled call of a site marks (``ran``). A plain object, so that the store Dynamo
    replays after each run of the graph is one attribute write; on the site itself it would go
    through ``nn.Module.__setattr__`` at every call."""

    def __init__(self) -> None:
        self.ran = False


class GemmSite(nn.Module):
    """One GEMM site: ``y = x W^T + b`` whose three GEMMs each run on their own kernel.

    The base of every module Dispatch manages (:class:`~loka_torchrec.dispatch.linear.LokaLinear`, and
    :class:`~loka_torchrec.dispatch.sites.ParameterSite` for GEMMs on a module's own Parameters).
    A subclass provides ``weight`` (``(out_features, in_features)``, possibly a view of a Parameter),
    ``in_features``, ``out_features``, calls :meth:`_init_dispatch` once its weight exists, and runs
    its GEMM through :meth:`_site_forward`. What the Dispatcher and the Probe read
    (``kernels``/``set_kernels``, ``last_rows``, ``last_input_dtype``, ``last_autocast_dtype``,
    ``ran_compiled``, ``grad_format``, ``fallback_reasons``, ``nonfinite_events``) lives here.

    **Forward scaling** (``forward_scaling``). ``"current"``: every FP8 operand is scaled by its own
    amax, which a compiled step must reduce over the whole tensor before the cast can start, so
    an operand is read twice (its amax, then its cast). ``"delayed"``: under ``torch.compile``,
    the forward's tensorwise operands of the input and the weight are scaled by the largest amax
    of the last ``AMAX_HISTORY`` calls (:func:`~loka_torchrec.dispatch.role_kernels.delayed_operands`), so Inductor fuses the cast,
    and the amax recorded for later calls, into one pass, even into the op that produces the
    input. Values beyond that amax saturate to the format's maximum (an operand that grows from
    one step to the next loses its largest values for that step), and a NaN or inf in the
    operand is counted in ``nonfinite_events`` and gives NaN outputs, as with current scaling.
    Eager calls scale by the current amax and record the history (for every layer, FP8 or not,
    so a plan made eagerly starts its compiled steps with a history); compiled calls record it
    for the layers that use it. Eager calls inside :func:`compiled_scaling` (checks of a compiled
    model's numerics) scale as compiled calls do and record nothing. A compiled call that finds
    no history yet scales by the current amax, records it, and the next call compiles once more.

    **Gradient scaling** (``grad_scaling``, opt-in: ``DispatchConfig.grad_scaling``). ``"current"``:
    ``dy`` is scaled by its own amax. ``"delayed"``: compiled, the backward scales its tensorwise
    ``dy`` operands by the largest amax of the last ``AMAX_HISTORY`` backward calls and records its
    own amax, writing the history in place; values beyond it saturate, counted per call with the
    non-finite ones (:meth:`grad_scaling_events`). The histories are run-time state,
    not in ``state_dict``: after a restart the first call records them again. A layer built directly
    is ``"current"`` in both unless told; Dispatch gives its sites ``DispatchConfig.forward_scaling``
    (default ``"delayed"``) and ``DispatchConfig.grad_scaling`` (default ``"current"``) where they run
    compiled (``DispatchConfig.site_forward_scaling``, ``site_grad_scaling``).
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
        self._runtime_buffers(device)
        self._history_seeded = False
        self._grad_history_seeded = False
        self.grad_scaling = "current"
        self._scaled_as_compiled = False  # eager calls scale as compiled ones: compiled_scaling()
        self.forward_scaling = forward_scaling
        self._eager = EagerState()
        self.last_rows = 0
        self._run_mark = _RunMark()
        self.last_input_dtype = None
        self.last_autocast_dtype = None
        self.fallback_reasons = {}
        self._grad_format = Fp8Format.parse(grad_format, field="grad_format")
        self._plan_device: Optional[torch.device] = None
        self.set_kernels(kernels)

    def _runtime_buffers(self, device: torch.device) -> None:
        """(Re)make the run-time buffers on ``device``, zeroed. Non-persistent: run-time state, not
        model state; checkpoints stay ``nn.Linear``'s."""
        self.register_buffer("_nonfinite_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        # Row 0: the input's amax per call, row 1: the weight's; column 0 the newest.
        self.register_buffer("_amax_history", torch.zeros(2, AMAX_HISTORY, dtype=torch.float32, device=device), persistent=False)
        # The backward's dy amaxes, newest first, and its counts (calls recorded, saturated, non-finite): grad_scaling.
        self.register_buffer("_grad_amax_history", torch.zeros(AMAX_HISTORY, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("_grad_events", torch.zeros(3, dtype=torch.int64, device=device), persistent=False)

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

    forward_scaling = _scaling_setting("forward_scaling", "the forward's FP8 operands")
    grad_scaling = _scaling_setting("grad_scaling", "the backward's FP8 ``dy`` operands")

    @property
    def plan(self) -> SitePlan:
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
        for role in GEMM_ROLES:
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
        self._plan = SitePlan(*(self._role_kernel(role, device) for role in GEMM_ROLES), self.in_features, self.out_features)

    def _role_kernel(self, role: GemmRole, device: torch.device) -> RoleKernel:
        choice = self._kernels.for_role(role)
        if choice.is_high_precision or device.type == "meta":
            return RoleKernel(choice, None) if choice.is_high_precision else RoleKernel(BF16, None)
        recipe = recipe_for(choice.recipe, role, grad_format=self._grad_format)
        backend = get_backend(choice.backend)
        align = backend.alignment(device, recipe)
        # Rows enter a GEMM only as M (forward, grad-input) or as grad-weight's K; both are padded
        # to the alignment, so one check at a representative row count holds for every batch.
        shape = GemmShape.for_role(role, align, self.in_features, self.out_features)
        reason = backend.check_padded(recipe, shape, device)
        if reason is None:
            return RoleKernel(choice, recipe, align)
        message = f"{choice} cannot run {role.value} GEMM {shape} on {device}: {reason}"
        self.fallback_reasons[role] = message
        logger.warning("%s(%d, %d): %s; using bf16:hp", type(self).__name__, self.in_features, self.out_features, message)
        return RoleKernel(BF16, None)

    @property
    def ran_compiled(self) -> bool:
        """Whether a compiled call of this site ran since it was made (compiled calls leave
        ``last_rows`` alone): :mod:`~loka_torchrec.dispatch.reach` reads it."""
        return self._run_mark.ran

    def _mark_ran_compiled(self) -> None:
        """Called while Dynamo traces a call of this site: the store is a side effect Dynamo replays
        after each run of the graph, with no guard, no recompile and nothing in the graph."""
        self._run_mark.ran = True

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
        else:
            self._mark_ran_compiled()
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
        self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], lead: torch.Size, rows, plan: SitePlan
    ) -> torch.Tensor:
        if plan.all_high_precision and high_precision_dtype(input) == input.dtype == weight.dtype:
            return F.linear(input, weight, bias)  # exactly nn.Linear
        x2d = input.reshape(rows, self.in_features)
        state = None if compiling() else self._eager
        prior_amax = None
        slots = delayed_operands(plan)
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
            y2d, nonfinite = LokaLinearFunction.apply(x2d, weight, bias, plan, state, prior_amax, *self._grad_scaling_args(plan))
        else:  # no autograd bookkeeping, nothing kept for a backward
            q = Quantizer(state, None if prior_amax is None else prior_amax_by_operand(plan, prior_amax))
            y2d = forward_gemm(q, x2d, weight.detach(), None if bias is None else bias.detach(), plan)[0]
            nonfinite = q.total()
        if nonfinite is not None:
            self._nonfinite_count.add_(nonfinite)
        return y2d.reshape(*lead, self.out_features)

    def _grad_scaling_args(self, plan: SitePlan) -> tuple:
        """The ``dy`` arguments of :class:`LokaLinearFunction` (``grad_scaling``, class docstring):
        none (current scaling), or the history, the event counts, whether to scale by the history
        and whether to record. A compiled call records; the first one scales by ``dy``'s own amax
        and the next compiles once more with the history its backward recorded. An eager call
        judged as a compiled one (:func:`compiled_scaling`) scales as it would and records nothing."""
        if self.grad_scaling != "delayed" or not delayed_grad_operand(plan) or not (compiling() or self._scaled_as_compiled):
            return ()
        record = compiling()
        delayed = self._grad_history_seeded
        if record and not delayed:
            self._grad_history_seeded = True
        return self._grad_amax_history, self._grad_events, delayed, record

    def grad_scaling_events(self) -> Dict[str, int]:
        """Since the layer was made: the backward calls that recorded ``dy``'s amax (``calls``), those
        whose ``dy`` went beyond its delayed amax (``saturated``: its largest values were clipped to
        the format's maximum) and those whose ``dy`` held inf/NaN (``nonfinite``)."""
        calls, saturated, nonfinite = self._grad_events.tolist()
        return {"calls": calls, "saturated": saturated, "nonfinite": nonfinite}

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

