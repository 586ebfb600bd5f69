"""Error metrics between a low-precision result and a high-precision reference.

All three compute in float64.

* :func:`mere` -- mean elementwise relative error ``mean(|out - ref| / max(|ref|, floor))``.
  Guard for ``ref`` near zero: the denominator is floored at ``floor_fraction * mean(|ref|)``
  (default 0.1), so elements whose reference is tiny contribute their absolute error relative to
  a tenth of the tensor's typical magnitude instead of dividing by ~0. Without a floor the
  mean of ``1/|ref|`` over a Gaussian output diverges, and the metric would measure how close
  some outputs happen to be to zero rather than the kernel. With this floor, an FP8 E4M3 GEMM on
  Gaussian data has a MERE of about 0.1 (rowwise) where its relative Frobenius error is ~0.036.
* :func:`sqnr_db` -- signal to quantization-noise ratio ``10 log10(|ref|^2 / |out - ref|^2)``;
  ``inf`` when the two are equal.
* :func:`relative_frobenius` -- ``|out - ref|_F / |ref|_F``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["mere", "mere_tensor", "sqnr_db", "noise_and_signal", "sqnr_from_sums", "relative_frobenius"]


def _pair(out: torch.Tensor, ref: torch.Tensor):
    if out.shape != ref.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but ref has shape {tuple(ref.shape)}")
    return out.detach().to(torch.float64), ref.detach().to(torch.float64)


def mere(out: torch.Tensor, ref: torch.Tensor, *, floor_fraction: float = 0.1) -> float:
    """Mean elementwise relative error of ``out`` against ``ref`` (see the module docstring)."""
    return float(mere_tensor(out, ref, floor_fraction=floor_fraction))


def mere_tensor(out: torch.Tensor, ref: torch.Tensor, *, floor_fraction: float = 0.1) -> torch.Tensor:
    """:func:`mere` as a float64 scalar tensor on the inputs' device (no host synchronization)."""
    out, ref = _pair(out, ref)
    if ref.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=ref.device)
    mag = ref.abs()
    denom = mag.clamp(min=floor_fraction * mag.mean()) if floor_fraction > 0 else mag
    err = (out - ref).abs()
    rel = torch.where(denom > 0, err / denom.clamp(min=1e-300), torch.where(err > 0, math.inf, 0.0))
    return rel.mean()


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal to quantization-noise ratio in dB (higher is better)."""
    noise, signal = noise_and_signal(out, ref).tolist()
    return sqnr_from_sums(noise, signal)


def noise_and_signal(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``[sum((out - ref)^2), sum(ref^2)]`` in float64 on the inputs' device (the sums of :func:`sqnr_db`)."""
    out, ref = _pair(out, ref)
    return torch.stack([((out - ref) ** 2).sum(), (ref**2).sum()])


def sqnr_from_sums(noise: float, signal: float) -> float:
    """SQNR in dB from the two sums of :func:`noise_and_signal`."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def relative_frobenius(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref|_F / |ref|_F`` (``inf`` for a zero reference and a nonzero error)."""
    out, ref = _pair(out, ref)
    num = float(torch.linalg.vector_norm(out - ref))
    den = float(torch.linalg.vector_norm(ref))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den
