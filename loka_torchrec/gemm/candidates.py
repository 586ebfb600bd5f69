"""How a candidate kernel runs one GEMM role when it is measured: recipe, availability, padding.

A candidate whose backend needs aligned dims (``torch._scaled_mm`` on CUDA: multiples of 16) runs
the way ``LokaLinear`` runs it in training: both operands zero-padded to the alignment (zeros add
nothing to a dot product and change no amax, so the result is exact), the output cut back to
``(M, N)``. An operand can be scaled by a given amax instead of its own, as a compiled layer with
delayed scaling scales it (:meth:`CandidateRun.gemm`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from loka_torchrec.gemm.backends import get_backend
from loka_torchrec.gemm.recipes import GemmRecipe, recipe_for
from loka_torchrec.evidence import GemmRole, GemmShape, KernelChoice
from loka_torchrec.fp8 import Fp8Format, Granularity, quantize

__all__ = ["CandidateRun", "resolve_candidate"]


@dataclasses.dataclass(frozen=True)
class CandidateRun:
    """A candidate ready to run one role.

    Attributes:
        choice: backend and recipe.
        recipe: operand quantization (``None`` for the high-precision baseline).
        align: ``M``, ``K`` and ``N`` are zero-padded to a multiple of this (1: no padding).
    """

    choice: KernelChoice
    recipe: Optional[GemmRecipe]
    align: int = 1

    def gemm(
        self, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
        amax: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
    ) -> torch.Tensor:  # fmt: skip
        """``A (M, K) @ B (N, K)^T`` through the candidate, quantization (and padding) included.

        ``amax``: for ``A`` and ``B``, ``None`` (scaled by its own amax) or a 0-d amax that scales
        it instead (delayed scaling), where the recipe quantizes that operand tensorwise. Given
        one, both operands are quantized as a compiled ``LokaLinear`` quantizes them
        (:func:`loka_torchrec.fp8.quantize`, with ``amax`` where given), so only backends that run
        compiled take one (``ValueError`` otherwise).
        """
        m, n = a.shape[0], b.shape[0]
        if self.align > 1:
            m_pad, k_pad, n_pad = (-d % self.align for d in (m, a.shape[1], n))
            if m_pad or k_pad or n_pad:
                a = F.pad(a, (0, k_pad, 0, m_pad))
                b = F.pad(b, (0, k_pad, 0, n_pad))
        backend = get_backend(self.choice.backend)
        given = [
            given_amax if self.recipe is not None and getattr(self.recipe, side).granularity == Granularity.TENSORWISE else None
            for side, given_amax in zip("ab", amax)
        ]
        if given == [None, None]:
            out = backend.gemm(a, b, self.recipe, out_dtype)
        else:
            problem = backend.compile_reason(self.choice.recipe)
            if problem is not None:
                raise ValueError(f"{self.choice}: a given amax (delayed scaling) is for kernels that run compiled; {problem}")
            ops = [
                quantize(t, spec.fmt, spec.granularity, block=spec.block, power_of_two=spec.power_of_two, nonfinite="propagate", name=name,
                         amax=given_amax)
                for t, spec, name, given_amax in ((a, self.recipe.a, "A", given[0]), (b, self.recipe.b, "B", given[1]))
            ]  # fmt: skip
            out = backend.mm(ops[0], ops[1], self.recipe, out_dtype)
        return out[:m, :n] if out.shape != (m, n) else out


def resolve_candidate(
    choice: KernelChoice, role: GemmRole, shape: GemmShape, device: "torch.device | str", *, grad_format: "Fp8Format | str" = Fp8Format.E4M3
) -> Union[CandidateRun, str]:
    """A :class:`CandidateRun` for ``choice`` at ``shape`` on ``device``, or the reason it cannot run.

    Example::

        >>> resolve_candidate(KernelChoice("scaled_mm", "blockwise"), GemmRole.FORWARD, GemmShape(8, 8, 8), "cpu")
        "scaled_mm has no recipe 'blockwise' (has: tensorwise, rowwise)"
    """
    try:
        backend = get_backend(choice.backend)
        if choice.is_high_precision:
            available = backend.availability(device)
            return CandidateRun(choice, None) if available.ok else available.reason
        recipe = recipe_for(choice.recipe, role, grad_format=Fp8Format.parse(grad_format, field="grad_format"))
    except ValueError as exc:
        return str(exc)
    problem = backend.check(recipe, shape, device)
    if problem is None:
        return CandidateRun(choice, recipe)
    align = backend.alignment(device, recipe)
    if align > 1 and backend.check_padded(recipe, shape, device) is None:
        return CandidateRun(choice, recipe, align)
    return problem
