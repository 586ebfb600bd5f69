"""Weight statistics: amax, kurtosis, and a Kronecker-factored (matrix-normal) weight model.

The model is ``W ~ MN(0, U, V)``: ``vec(W)`` is Gaussian with covariance ``U (x) V``, ``U``
``(out, out)`` the row covariance and ``V`` ``(in, in)`` the column covariance. With one weight
matrix per step, the maximum-likelihood flip-flop iteration has no unique fixed point, so the
Probe uses its first step from the identity, which matches the *uncentred* second moments:

* row factor ``R = W W^T / in`` and column factor ``C = W^T W / out``;
* a draw ``W_s = chol(R) Z chol(C)^T / sqrt(sigma2)`` with ``Z`` standard normal and
  ``sigma2 = mean(W^2)`` satisfies ``E[W_s W_s^T] = W W^T`` and ``E[W_s^T W_s] = W^T W``:
  sampled weights have the real weight's row norms, column norms and their correlations, but
  not its individual entries (nor its mean);
* ``R``, ``C`` and ``sigma2`` are smoothed over probe steps with an EMA (decay ``ema``);
* beyond ``max_cov_dim`` a factor keeps only its diagonal (row or column mean squares).

The factors are products of the weight, computed where the weight is, but kept on the host: up to
two ``max_cov_dim``-square float64 matrices a layer, which are read only when evidence is made.
:meth:`WeightStatistics.on` gives a copy on the layer's device for that, whose square roots are
factorized there and go with the copy.

The error that Dispatch sees is measured with the *actual* weights; draws from this model are a
second measurement, logged beside it, that shows how sensitive a layer is to its weight structure.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Any, Deque, Dict, Optional

import torch

from loka_torchrec.probe.sampling import cholesky_with_jitter
from loka_torchrec.probe.statistics import HOST

__all__ = ["WeightStatistics"]


class WeightStatistics:
    """EMA-smoothed Kronecker factors of a ``(out_features, in_features)`` weight, with amax and kurtosis.

    Args:
        out_features, in_features: the weight's shape.
        max_cov_dim: a factor wider than this keeps only its diagonal.
        ema: decay of the EMA over updates (0 keeps only the latest weight).
        amax_history: number of updates whose amax is remembered.

    Example::

        >>> w = WeightStatistics(2, 3)
        >>> w.update(torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))
        >>> w.amax, round(w.kurtosis, 3)
        (2.0, 4.08)
        >>> w.sample(torch.Generator().manual_seed(0)).shape
        torch.Size([2, 3])
    """

    def __init__(self, out_features: int, in_features: int, *, max_cov_dim: int = 1024, ema: float = 0.9, amax_history: int = 16) -> None:
        if out_features <= 0 or in_features <= 0:
            raise ValueError(f"weight shape: expected positive (out_features, in_features), got {(out_features, in_features)}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema: expected a decay in [0, 1), got {ema!r}")
        self.out_features, self.in_features = out_features, in_features
        self.max_cov_dim, self.ema = max_cov_dim, ema
        self.row_factor: Optional[torch.Tensor] = None  # (out, out), or (out,) diagonal when capped
        self.col_factor: Optional[torch.Tensor] = None  # (in, in), or (in,) diagonal when capped
        self.sigma2 = math.nan
        self.amax = math.nan
        self.kurtosis = math.nan
        self.nonfinite = 0
        self.updates = 0
        self._roots: Optional[tuple] = None  # square roots of the factors, cached until the next update
        self.amax_history: Deque[float] = deque(maxlen=amax_history)

    @torch.no_grad()
    def update(self, weight: torch.Tensor, *, factors: bool = True) -> None:
        """Fold in the current weight ``(out_features, in_features)`` (any float dtype, any device).

        Args:
            weight: the weight.
            factors: also update the Kronecker factors (``out^2 * in + in^2 * out`` flops);
                ``False`` updates amax, kurtosis and the non-finite count only.
        """
        if not torch.is_tensor(weight) or weight.shape != (self.out_features, self.in_features):
            got = tuple(weight.shape) if torch.is_tensor(weight) else type(weight).__name__
            raise ValueError(f"weight: expected shape {(self.out_features, self.in_features)}, got {got}")
        w = weight.detach()
        w = w if w.dtype == torch.float64 else w.float()
        amax = w.abs().amax()
        if w.device.type != "cpu" or not bool(torch.isfinite(amax)):
            # Mask inf/NaN without a host sync on accelerators; on the CPU only when present.
            finite = torch.isfinite(w)
            self.nonfinite = int(finite.numel() - torch.count_nonzero(finite))
            w = torch.where(finite, w, torch.zeros((), dtype=w.dtype, device=w.device))
            amax = w.abs().amax()
        else:
            self.nonfinite = 0
        sq = w * w
        mean_sq = float(sq.sum(dtype=torch.float64)) / w.numel()
        self.amax = float(amax)
        self.amax_history.append(self.amax)
        self.kurtosis = float((sq * sq).sum(dtype=torch.float64)) / w.numel() / (mean_sq * mean_sq) if mean_sq > 0 else math.nan
        if not factors:
            return
        # The factors are a model, not an exact statistic: float32 products (float64 inputs stay
        # float64), made on the weight's device and kept on the host (module docstring).
        row = self._factor(w, rows=True).double().to(HOST)
        col = self._factor(w, rows=False).double().to(HOST)
        if self.updates == 0:
            self.row_factor, self.col_factor, self.sigma2 = row, col, mean_sq
        else:
            b = self.ema
            self.row_factor = b * self.row_factor.to(HOST) + (1 - b) * row
            self.col_factor = b * self.col_factor.to(HOST) + (1 - b) * col
            self.sigma2 = b * self.sigma2 + (1 - b) * mean_sq
        self.updates += 1
        self._roots = None

    def _factor(self, w: torch.Tensor, *, rows: bool) -> torch.Tensor:
        dim, other = (self.out_features, self.in_features) if rows else (self.in_features, self.out_features)
        if dim > self.max_cov_dim:
            return (w * w).mean(dim=1 if rows else 0)  # diagonal only
        return (w @ w.t() if rows else w.t() @ w) / other

    def on(self, device: "torch.device | str") -> "WeightStatistics":
        """A copy whose factors are on ``device`` (where the draws are made); its square roots are
        factorized there when first needed, and go with the copy. ``self`` is unchanged."""
        out = copy.copy(self)
        out.amax_history = deque(self.amax_history, maxlen=self.amax_history.maxlen)
        if self.row_factor is not None:
            out.row_factor, out.col_factor = self.row_factor.to(device), self.col_factor.to(device)
        out._roots = None
        return out

    @torch.no_grad()
    def sample(self, generator: torch.Generator, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """One draw ``(out_features, in_features)`` from the model, computed in ``dtype`` on the factors' device."""
        if self.updates == 0:
            raise ValueError("WeightStatistics.sample: no weight has been seen yet (call update first)")
        if self._roots is None:
            self._roots = (_square_root(self.row_factor), _square_root(self.col_factor))
        row_root, col_root = (r.to(dtype) for r in self._roots)
        device = self.row_factor.device
        z = torch.randn(self.out_features, self.in_features, generator=generator, dtype=dtype, device=device)
        z = _apply_left(row_root, z)
        z = _apply_left(col_root, z.t()).t()
        return z / math.sqrt(self.sigma2) if self.sigma2 > 0 else z

    def summary(self) -> Dict[str, Any]:
        return {
            "amax": self.amax,
            "kurtosis": self.kurtosis,
            "mean_sq": self.sigma2,
            "nonfinite": self.nonfinite,
            "row_factor": "full" if self.row_factor is not None and self.row_factor.dim() == 2 else "diagonal",
            "col_factor": "full" if self.col_factor is not None and self.col_factor.dim() == 2 else "diagonal",
            "updates": self.updates,
        }


def _square_root(factor: torch.Tensor) -> torch.Tensor:
    """Cholesky factor of a full PSD factor, or the elementwise root of a diagonal one."""
    if factor.dim() == 1:
        return factor.clamp(min=0).sqrt()
    return cholesky_with_jitter(factor)[0]


def _apply_left(root: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``root @ z`` for a full square root, ``diag(root) @ z`` for a diagonal one."""
    return root.unsqueeze(1) * z if root.dim() == 1 else root @ z
