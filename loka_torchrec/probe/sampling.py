"""Draw GEMM operands from the learned Gaussian model: ``x = mu + L z``.

``L`` is the Cholesky factor of the learned covariance. A covariance estimated from fewer rows
than features, or with constant features, is singular: jitter ``eps * mean(diag)`` is added to the
diagonal, growing tenfold from ``1e-10`` until the factorization succeeds; past ``1e-2`` an
eigendecomposition with negative eigenvalues clipped to zero gives a square root instead. The
jitter used is recorded, so a user can see how far the sampled covariance is from the learned one.

Features outside the covariance subset of a capped tensor (see
:func:`~loka_torchrec.probe.statistics.covariance_subset`) are drawn independently with their
own variance.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from loka_torchrec.probe.statistics import TensorStatistics

__all__ = ["GaussianModel", "cholesky_with_jitter", "make_generator"]


def cholesky_with_jitter(cov: torch.Tensor) -> Tuple[torch.Tensor, float, str]:
    """A square root ``L`` with ``L @ L.T ~= cov`` for a symmetric PSD ``cov`` ``(d, d)``.

    Returns:
        ``(L, jitter, method)``: ``jitter`` is the relative diagonal jitter added (0 when
        ``cov`` is positive definite), ``method`` is ``"cholesky"`` or ``"eigh"``.

    Example::

        >>> L, jitter, method = cholesky_with_jitter(torch.ones(2, 2, dtype=torch.float64))
        >>> method, jitter > 0, torch.allclose(L @ L.T, torch.ones(2, 2, dtype=torch.float64), atol=1e-6)
        ('cholesky', True, True)
    """
    if cov.dim() != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"cov: expected a square matrix, got shape {tuple(cov.shape)}")
    cov = 0.5 * (cov + cov.t())
    d = cov.shape[0]
    if d == 0:
        return cov.clone(), 0.0, "cholesky"
    scale = float(cov.diagonal().mean())
    if not scale > 0:
        scale = 1.0
    eye = torch.eye(d, dtype=cov.dtype, device=cov.device)
    for rel in (0.0,) + tuple(10.0**e for e in range(-10, -1)):
        factor, info = torch.linalg.cholesky_ex(cov + (rel * scale) * eye)
        if int(info) == 0 and bool(torch.isfinite(factor).all()):
            return factor, rel, "cholesky"
    evals, evecs = torch.linalg.eigh(cov)
    return evecs * evals.clamp(min=0).sqrt(), 0.0, "eigh"


def make_generator(device: "torch.device | str", seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed) % (2**63))
    return gen


@dataclasses.dataclass
class GaussianModel:
    """``N(mean, cov)`` over ``dim`` features: full covariance on ``cov_index``, independent elsewhere.

    Attributes:
        mean: ``(dim,)``.
        std: ``(dim,)`` standard deviation of every feature (used outside ``cov_index``).
        cov_index: ``(s,)`` features drawn jointly.
        factor: ``(s, s)`` square root of their covariance.
        jitter: relative diagonal jitter that made the factorization succeed.
        method: ``"cholesky"`` or ``"eigh"``.
    """

    mean: torch.Tensor
    std: torch.Tensor
    cov_index: torch.Tensor
    factor: torch.Tensor
    jitter: float
    method: str

    @classmethod
    def from_statistics(cls, stats: TensorStatistics, *, dtype: Optional[torch.dtype] = None) -> "GaussianModel":
        """Fit from :class:`TensorStatistics` (needs at least one row).

        Args:
            stats: the statistics (their device is used).
            dtype: compute dtype of the draws: float64 by default; float32 is the fast choice on GPUs.
        """
        if stats.is_empty:
            raise ValueError("stats: cannot fit a Gaussian model to statistics that saw no rows")
        dtype = dtype or torch.float64
        factor, jitter, method = cholesky_with_jitter(stats.covariance())
        return cls(
            mean=stats.mean.to(dtype),
            std=stats.variance().clamp(min=0).sqrt().to(dtype),
            cov_index=stats.cov_index.to(stats.device),
            factor=factor.to(dtype),
            jitter=jitter,
            method=method,
        )

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def sample(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        """``(rows, dim)`` draws, in the model's dtype and on its device (``generator`` must match)."""
        z = torch.randn(rows, self.dim, generator=generator, dtype=self.mean.dtype, device=self.mean.device)
        if len(self.cov_index) == self.dim:
            return self.mean + z @ self.factor.t()
        x = self.mean + z * self.std
        x[:, self.cov_index] = self.mean[self.cov_index] + z[:, self.cov_index] @ self.factor.t()
        return x
