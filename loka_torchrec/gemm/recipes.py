"""Recipes: how each operand of one GEMM is quantized.

A recipe name (``"tensorwise"``, ``"rowwise"``, ``"blockwise"``) plus the GEMM role fix the
format, granularity and tile of both operands (see :mod:`loka_torchrec.evidence` for the
operand layout of each role):

* activations and weights are E4M3;
* gradients (``A`` of ``dgrad`` and ``wgrad``) use ``grad_format`` (E4M3 by default: with
  per-tensor or finer scaling its extra mantissa bit beats E5M2's range; E5M2 is one flag away);
* blockwise uses 1x128 tiles for activations and gradients and 128x128 for weights.

A backend may name a variant of a granularity for a different GEMM kernel (``triton_rowwise``:
FBGEMM's Triton kernel on rowwise operands); :data:`RECIPE_GRANULARITY` maps every name to its
operand granularity.

**Fast accumulation.** Every recipe name has a ``_fast_accum`` twin (``tensorwise_fast_accum``):
the same operands, but the GEMM keeps its partial sums in the tensor cores' own accumulator
instead of promoting them to float32 every few K steps (``use_fast_accum`` of
``torch._scaled_mm`` and FBGEMM, the opposite of Transformer Engine's ``split_accumulator``).
On Hopper GPUs that is the faster GEMM, and its error grows with K; Dispatch measures both and
keeps the fast one only where the Probe's accuracy bar holds. A backend lists the twins it
implements in its ``recipes``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from loka_torchrec.evidence import GemmRole
from loka_torchrec.fp8 import Fp8Format, Granularity

__all__ = [
    "OperandSpec",
    "GemmRecipe",
    "FAST_ACCUM_SUFFIX",
    "FP8_RECIPE_NAMES",
    "RECIPE_GRANULARITY",
    "recipe_for",
    "split_fast_accum",
]

FAST_ACCUM_SUFFIX = "_fast_accum"
"""Appended to a recipe name: the same recipe with fast (unpromoted) accumulation."""

_BASE_GRANULARITY = {
    "tensorwise": Granularity.TENSORWISE,
    "rowwise": Granularity.ROWWISE,
    "blockwise": Granularity.BLOCKWISE,
    "triton_rowwise": Granularity.ROWWISE,
}

RECIPE_GRANULARITY = {
    **_BASE_GRANULARITY,
    **{name + FAST_ACCUM_SUFFIX: granularity for name, granularity in _BASE_GRANULARITY.items()},
}
"""Every FP8 recipe name a backend may declare, and the operand granularity it stands for."""

FP8_RECIPE_NAMES = tuple(RECIPE_GRANULARITY)


def split_fast_accum(name: str) -> Tuple[str, bool]:
    """``("rowwise", True)`` for ``"rowwise_fast_accum"``, ``("rowwise", False)`` for ``"rowwise"``."""
    if name.endswith(FAST_ACCUM_SUFFIX):
        return name[: -len(FAST_ACCUM_SUFFIX)], True
    return name, False


@dataclasses.dataclass(frozen=True)
class OperandSpec:
    """How one GEMM operand of shape ``(rows, K)`` is quantized."""

    fmt: Fp8Format
    granularity: Granularity
    block: Optional[Tuple[int, int]] = None
    power_of_two: bool = False


@dataclasses.dataclass(frozen=True)
class GemmRecipe:
    """The quantization of both operands of ``C = A @ B^T`` and the accumulation mode."""

    name: str
    a: OperandSpec
    b: OperandSpec
    fast_accum: bool = False

    @property
    def base(self) -> str:
        """The recipe name without its fast-accumulation suffix: what selects a backend's kernel."""
        return split_fast_accum(self.name)[0]


def recipe_for(
    name: str,
    role: GemmRole,
    *,
    grad_format: Fp8Format = Fp8Format.E4M3,
    power_of_two: bool = False,
    fast_accum: bool = False,
) -> GemmRecipe:
    """The :class:`GemmRecipe` that recipe ``name`` uses for ``role``.

    A ``_fast_accum`` name (or ``fast_accum=True``) gives the recipe with fast accumulation.
    """
    role = GemmRole(role)
    if name not in FP8_RECIPE_NAMES:
        raise ValueError(f"recipe: unknown FP8 recipe {name!r}; expected one of {', '.join(FP8_RECIPE_NAMES)}")
    granularity = RECIPE_GRANULARITY[name]
    a_fmt = Fp8Format.E4M3 if role == GemmRole.FORWARD else Fp8Format.parse(grad_format, field="grad_format")
    act_block = (1, 128) if granularity == Granularity.BLOCKWISE else None
    # B is the weight in fwd and dgrad, the activation x^T in wgrad.
    b_block = None
    if granularity == Granularity.BLOCKWISE:
        b_block = (1, 128) if role == GemmRole.GRAD_WEIGHT else (128, 128)
    return GemmRecipe(
        name=name,
        a=OperandSpec(a_fmt, granularity, act_block, power_of_two),
        b=OperandSpec(Fp8Format.E4M3, granularity, b_block, power_of_two),
        fast_accum=fast_accum or split_fast_accum(name)[1],
    )
