"""Intervals around measured numbers: Student-t for means of errors, IQR for times.

* :func:`t_interval`: the 95% confidence interval of a mean, ``mean +- t_{0.975, n-1} * sd / sqrt(n)``,
  method ``"t95"``. It assumes the per-draw values are independent (they are: each Gaussian draw
  uses fresh random numbers) and leans on the central limit theorem for the mean of a skewed
  error distribution, which is accurate for the tens to hundreds of draws the Probe takes.
* :func:`iqr_interval`: the median with the 25th and 75th percentiles, method ``"iqr"``; the
  spread of repeated timings, not a confidence interval.

Both evidence providers (the Probe's and Dispatch's random-input one) and the layer check use
these, so evidence from either reads the same way.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

import torch

from loka_torchrec.evidence import Interval

__all__ = ["t_interval", "iqr_interval", "mean_interval", "t_quantile_975"]

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30 (standard tables).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)


def t_quantile_975(df: int) -> float:
    """``t_{0.975, df}``: the table up to 30 degrees of freedom, a Cornish-Fisher series beyond."""
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054  # the normal quantile; the series corrects it by powers of 1/df
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean with a Student-t 95% confidence interval (method ``"t95"``)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, mean, mean, 1, "none")
    half = t_quantile_975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t95")




def t_interval(values: Sequence[float]) -> Interval:
    """Mean of ``values`` with its Student-t 95% confidence interval (method ``"t95"``).

    A single value gives a degenerate interval (method ``"none"``); any non-finite value makes the
    whole interval that value (an ``inf`` error stays ``inf``).

    Example::

        >>> iv = t_interval([1.0, 2.0, 3.0])
        >>> iv.value, round(iv.low, 3), round(iv.high, 3), iv.method
        (2.0, -0.484, 4.484, 't95')
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("values: expected at least one value for an interval")
    bad = [v for v in vals if not math.isfinite(v)]
    if bad:
        return Interval(bad[0], bad[0], bad[0], len(vals), "t95")
    return mean_interval(vals)


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
