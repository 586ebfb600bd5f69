"""FP8 formats: the four OCP / AMD variants and their numeric limits.

The names follow the OCP 8-bit floating point specification:

=========  ===========================  =======  ==================  ====================
name       torch dtype                  max      smallest normal      smallest subnormal
=========  ===========================  =======  ==================  ====================
e4m3       ``torch.float8_e4m3fn``      448      2**-6                2**-9
e5m2       ``torch.float8_e5m2``        57344    2**-14               2**-16
e4m3fnuz   ``torch.float8_e4m3fnuz``    240      2**-7                2**-10
e5m2fnuz   ``torch.float8_e5m2fnuz``    57344    2**-15               2**-17
=========  ===========================  =======  ==================  ====================

E4M3 (3 mantissa bits, relative rounding error at most 2**-4) is the usual choice for weights and
activations; E5M2 (2 mantissa bits, 2**-3) trades precision for range and is the classic choice
for gradients. The ``fnuz`` variants are the ones AMD MI300 GPUs compute with.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Fp8Format"]


class Fp8Format(str, enum.Enum):
    """An FP8 format, by its OCP name (``Fp8Format("e4m3")``)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    E4M3FNUZ = "e4m3fnuz"
    E5M2FNUZ = "e5m2fnuz"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self]

    @property
    def max(self) -> float:
        """Largest finite magnitude."""
        return float(torch.finfo(self.dtype).max)

    @property
    def smallest_normal(self) -> float:
        return float(torch.finfo(self.dtype).smallest_normal)

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive value; anything below half of it rounds to zero."""
        return self.smallest_normal * 2.0 ** -self.mantissa_bits

    @property
    def mantissa_bits(self) -> int:
        return 3 if self in (Fp8Format.E4M3, Fp8Format.E4M3FNUZ) else 2

    @property
    def unit_roundoff(self) -> float:
        """Largest relative error of round-to-nearest on a value in the normal range."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @classmethod
    def parse(cls, value: "str | Fp8Format", *, field: str = "format") -> "Fp8Format":
        """``Fp8Format`` from its name, with an error that names ``field`` and the choices."""
        if isinstance(value, Fp8Format):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(f.value for f in cls)
            raise ValueError(f"{field}: unknown FP8 format {value!r}; expected one of {choices}") from None


_DTYPES = {
    Fp8Format.E4M3: torch.float8_e4m3fn,
    Fp8Format.E5M2: torch.float8_e5m2,
    Fp8Format.E4M3FNUZ: torch.float8_e4m3fnuz,
    Fp8Format.E5M2FNUZ: torch.float8_e5m2fnuz,
}
