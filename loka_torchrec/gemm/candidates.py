"""How a candidate kernel runs one GEMM role when it is measured: recipe, availability, padding.

A candidate whose backend needs aligned dims (``torch._scaled_mm`` on CUDA: multiples of 16) runs
the way ``LokaLinear`` runs it in training: both operands zero-padded to the alignment (zeros add
nothing to a dot product and change no amax, so the result is exact), the output cut back to
``(M, N)``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.nn.functional as F

from loka_torchrec.gemm.backends import get_backend
from loka_torchrec.gemm.recipes import GemmRecipe, recipe_for
from loka_torchrec.evidence import GemmRole, GemmShape, KernelChoice
from loka_torchrec.fp8 import Fp8Format

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

    def gemm(self, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``A (M, K) @ B (N, K)^T`` through the candidate, quantization (and padding) included."""
        m, n = a.shape[0], b.shape[0]
        if self.align > 1:
            m_pad, k_pad, n_pad = (-d % self.align for d in (m, a.shape[1], n))
            if m_pad or k_pad or n_pad:
                a = F.pad(a, (0, k_pad, 0, m_pad))
                b = F.pad(b, (0, k_pad, 0, n_pad))
        out = get_backend(self.choice.backend).gemm(a, b, self.recipe, out_dtype)
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
    align = backend.alignment(device)
    if align > 1 and backend.check_padded(recipe, shape, device) is None:
        return CandidateRun(choice, recipe, align)
    return problem
