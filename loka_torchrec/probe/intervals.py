"""Intervals around measured numbers: Student-t for means of errors, IQR for times.

* :func:`t_interval`: the 95% confidence interval of a mean, ``mean +- t_{0.975, n-1} * sd / sqrt(n)``,
  method ``"t95"``. It assumes the per-draw values are independent (they are: each Gaussian draw
  uses fresh random numbers) and leans on the central limit theorem for the mean of a skewed
  error distribution, which is accurate for the tens to hundreds of draws the Probe takes.
* :func:`iqr_interval`: the median with the 25th and 75th percentiles, method ``"iqr"``; the
  spread of repeated timings, not a confidence interval.

The t quantiles need no SciPy: exact values for up to 30 degrees of freedom, and the
Cornish-Fisher expansion of the t quantile around the normal one beyond that (error below 1e-6).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from loka_torchrec.evidence import Interval

__all__ = ["t_interval", "iqr_interval", "t_quantile_975"]

_T975 = (
    12.706204736, 4.302652730, 3.182446305, 2.776445105, 2.570581836, 2.446911851, 2.364624252,
    2.306004135, 2.262157163, 2.228138852, 2.200985160, 2.178812830, 2.160368656, 2.144786688,
    2.131449546, 2.119905299, 2.109815578, 2.100922040, 2.093024054, 2.085963447, 2.079613845,
    2.073873068, 2.068657610, 2.063898562, 2.059538553, 2.055529439, 2.051830516, 2.048407142,
    2.045229642, 2.042272456,
)  # Student-t 0.975 quantiles for 1..30 degrees of freedom
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom.

    Example::

        >>> round(t_quantile_975(9), 4), round(t_quantile_975(1000), 4)
        (2.2622, 1.9623)
    """
    if df < 1:
        raise ValueError(f"df: expected >= 1 degrees of freedom, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = _Z975, float(df)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4)
    )


def t_interval(values: Sequence[float]) -> Interval:
    """Mean of ``values`` with its Student-t 95% confidence interval (method ``"t95"``).

    A single value gives a degenerate interval (method ``"none"``); any non-finite value makes the
    whole interval that value (an ``inf`` error stays ``inf``).

    Example::

        >>> iv = t_interval([1.0, 2.0, 3.0])
        >>> iv.value, round(iv.low, 3), round(iv.high, 3), iv.method
        (2.0, -0.484, 4.484, 't95')
    """
    vals = torch.as_tensor([float(v) for v in values], dtype=torch.float64)
    n = vals.numel()
    if n == 0:
        raise ValueError("values: expected at least one value for an interval")
    if not bool(torch.isfinite(vals).all()):
        bad = float(vals[~torch.isfinite(vals)][0])
        return Interval(bad, bad, bad, n, "t95")
    mean = float(vals.mean())
    if n == 1:
        return Interval(mean, mean, mean, 1, "none")
    half = t_quantile_975(n - 1) * float(vals.std(unbiased=True)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t95")


def iqr_interval(values: Sequence[float]) -> Interval:
    """Median of ``values`` with the 25th..75th percentiles (method ``"iqr"``).

    Example::

        >>> iqr_interval([1.0, 2.0, 3.0, 4.0, 100.0])
        Interval(value=3.0, low=2.0, high=4.0, n=5, method='iqr')
    """
    vals = torch.as_tensor([float(v) for v in values], dtype=torch.float64)
    if vals.numel() == 0:
        raise ValueError("values: expected at least one timing")
    q = torch.quantile(vals, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return Interval(q[1], q[0], q[2], vals.numel(), "iqr")
