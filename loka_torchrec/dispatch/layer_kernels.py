"""The kernels one layer runs: a :class:`~loka_torchrec.evidence.KernelChoice` per GEMM role."""

from __future__ import annotations

import dataclasses
from typing import Dict

from loka_torchrec.evidence import BF16, GemmRole, KernelChoice

__all__ = ["LayerKernels"]


@dataclasses.dataclass(frozen=True)
class LayerKernels:
    """Backend and recipe for each of a linear layer's three GEMMs.

    Example::

        >>> LayerKernels.uniform(KernelChoice("scaled_mm", "rowwise")).fwd
        KernelChoice(backend='scaled_mm', recipe='rowwise')
    """

    fwd: KernelChoice = BF16
    dgrad: KernelChoice = BF16
    wgrad: KernelChoice = BF16

    @classmethod
    def uniform(cls, choice: KernelChoice) -> "LayerKernels":
        return cls(choice, choice, choice)

    def for_role(self, role: GemmRole) -> KernelChoice:
        return {
            GemmRole.FORWARD: self.fwd,
            GemmRole.GRAD_INPUT: self.dgrad,
            GemmRole.GRAD_WEIGHT: self.wgrad,
        }[GemmRole(role)]

    def replace(self, role: GemmRole, choice: KernelChoice) -> "LayerKernels":
        field = {GemmRole.FORWARD: "fwd", GemmRole.GRAD_INPUT: "dgrad", GemmRole.GRAD_WEIGHT: "wgrad"}[GemmRole(role)]
        return dataclasses.replace(self, **{field: choice})

    @property
    def all_high_precision(self) -> bool:
        return all(c.is_high_precision for c in (self.fwd, self.dgrad, self.wgrad))

    def to_dict(self) -> Dict[str, str]:
        return {"fwd": str(self.fwd), "dgrad": str(self.dgrad), "wgrad": str(self.wgrad)}

    @classmethod
    def from_dict(cls, d: Dict[str, str]) -> "LayerKernels":
        return cls(*(KernelChoice.parse(d[k], field=f"kernels.{k}") for k in ("fwd", "dgrad", "wgrad")))
