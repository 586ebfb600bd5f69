"""Intervals around measured numbers: Student-t for means of errors, IQR for times.

* :func:`t_interval`: the 95% confidence interval of a mean, ``mean +- t_{0.975, n-1} * sd / sqrt(n)``,
  method ``"t95"``. It assumes the per-draw values are independent (they are: each Gaussian draw
  uses fresh random numbers) and leans on the central limit theorem for the mean of a skewed
  error distribution, which is accurate for the tens to hundreds of draws the Probe takes.
* :func:`iqr_interval`: the median with the 25th and 75th percentiles, method ``"iqr"``; the
  spread of repeated timings, not a confidence interval.

The t quantiles (and the t interval itself) are the ones Dispatch's random-input evidence uses
(:mod:`loka_torchrec.dispatch.measure`), so evidence from either provider reads the same way.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from loka_torchrec.dispatch.measure import mean_interval, t_quantile_975
from loka_torchrec.evidence import Interval

__all__ = ["t_interval", "iqr_interval", "t_quantile_975"]


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
