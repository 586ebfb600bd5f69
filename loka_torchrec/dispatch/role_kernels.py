"""How one site's three GEMMs run on its device: the kernel, recipe and padding of each role.

A :class:`~loka_torchrec.dispatch.layer_kernels.LayerKernels` names a backend and recipe per role;
a :class:`SitePlan` is what that becomes on a device: the recipe resolved for the role, the
alignment the backend needs there, or high precision where the kernel cannot run. It is frozen
and holds no tensors, so under ``torch.compile`` it is a constant of the graph: a new plan is a
new constant, and a re-plan recompiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from loka_torchrec.dispatch.operands import transpose_reusable
from loka_torchrec.evidence import GemmRole, KernelChoice
from loka_torchrec.fp8 import Granularity
from loka_torchrec.gemm.backends import GemmBackend, get_backend
from loka_torchrec.gemm.recipes import GemmRecipe

__all__ = ["GEMM_ROLES", "SitePlan", "RoleKernel", "delayed_grad_operand", "delayed_operands", "prior_amax_by_operand", "reuses_transposed"]

GEMM_ROLES = (GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT)


@dataclasses.dataclass(frozen=True)
class RoleKernel:
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


class SitePlan(NamedTuple):
    """The three GEMMs' kernels and the layer's dims: everything the autograd function needs."""

    fwd: RoleKernel
    dgrad: RoleKernel
    wgrad: RoleKernel
    in_features: int
    out_features: int

    @property
    def all_high_precision(self) -> bool:
        return not (self.fwd.fp8 or self.dgrad.fp8 or self.wgrad.fp8)


def reuses_transposed(src: RoleKernel, src_operand: str, dst: RoleKernel, dst_operand: str) -> bool:
    """Whether ``dst``'s ``dst_operand`` (``"a"``/``"b"``) is exactly ``src``'s ``src_operand``
    quantized, transposed: both FP8 on one backend with the same padding, and a transposable spec
    (tensorwise, or tiles that are each other's transpose)."""
    return (
        src.fp8 and dst.fp8 and src.choice.backend == dst.choice.backend and src.align == dst.align
        and transpose_reusable(getattr(src.recipe, src_operand), getattr(dst.recipe, dst_operand))
    )  # fmt: skip


def delayed_operands(plan: SitePlan) -> Tuple[bool, bool]:
    """Whether the forward quantizes the input, and the weight, as FP8 tensorwise operands: the
    operands that delayed scaling serves (``x`` for the forward GEMM or, as ``x^T``, for
    grad-weight; ``W`` for the forward GEMM, whose FP8 bytes grad-input reuses where it can)."""

    def tensorwise(kernel: RoleKernel, operand: str) -> bool:
        return kernel.fp8 and getattr(kernel.recipe, operand).granularity == Granularity.TENSORWISE

    return tensorwise(plan.fwd, "a") or tensorwise(plan.wgrad, "b"), tensorwise(plan.fwd, "b")


def delayed_grad_operand(plan: SitePlan) -> bool:
    """Whether the backward quantizes ``dy`` as an FP8 tensorwise operand (grad-input's ``dy`` or
    grad-weight's ``dy^T``): the operand that delayed gradient scaling serves."""
    return any(k.fp8 and k.recipe.a.granularity == Granularity.TENSORWISE for k in (plan.dgrad, plan.wgrad))


def prior_amax_by_operand(plan: SitePlan, prior_amax: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``"input"`` / ``"weight"`` -> its entry of ``prior_amax`` (``(2,)``: the delayed amaxes of the
    input and the weight), for the operands that :func:`delayed_operands` says delayed scaling serves."""
    input_slot, weight_slot = delayed_operands(plan)
    return {name: prior_amax[i] for i, (name, used) in enumerate((("input", input_slot), ("weight", weight_slot))) if used}
