"""Running statistics of a GEMM operand (activations or output gradients), batch rows as samples.

:class:`TensorStatistics` keeps *sufficient statistics* of every row it has seen, accumulated
in float64:

* ``count`` rows, ``mean`` ``(d,)`` and the scatter (sum of centred outer products) ``m2_cov``
  ``(s, s)`` over ``cov_index`` (all ``d`` features, or a fixed random subset of ``s`` of them
  when ``d > max_cov_dim``), plus the per-feature scatter ``m2_diag`` ``(d,)``;
* ``sum_sq`` and ``sum_4th``: sums of ``x**2`` and ``x**4`` over elements, for the uncentred
  kurtosis ``mean(x^4) / mean(x^2)^2`` (3 for a zero-mean Gaussian, large for outlier-heavy data);
* ``sum_row_ms_sq``: sum over rows of the squared row mean-square (the noise of ``mean(x^2)``,
  used to compare ranks);
* ``amax`` of the finite elements and the count of non-finite ones;
* per FP8 format and scaling granularity, the count of nonzero elements that would underflow to
  zero when the scale comes from the current amax (of the whole call for tensorwise, of the row
  for rowwise); and the count of elements that a *delayed* tensorwise scale (from the amax
  history of earlier probe steps) would saturate. A scale from the current amax never
  saturates, and ``fp8_max / amax`` saturates the same elements in every format, so saturation
  is one number.
* per scaling granularity, the count of nonzero elements in groups whose amax is below the
  scaling floor :data:`~loka_torchrec.fp8.scaling.AMAX_EPS` (1e-12): the quantizer clamps such
  an amax up to the floor, so the group does not fill the FP8 range and its values keep only a
  few bits, or flush to zero (below about 2e-18 in E4M3), where ``nn.Linear`` keeps them. The
  underflow counts above use the clamped amax, so they include those flushes.

Rows are folded in with the batched Welford update of Chan, Golub and LeVeque: a batch's own mean
and scatter are computed around the batch mean and combined with the running ones through the
difference of the means, so no large raw second moment is ever formed (no cancellation). Two
instances merge the same way (:meth:`TensorStatistics.merge`), which is also how ranks merge
(:mod:`loka_torchrec.probe.merge`).

``update(x, moments=False)`` skips the mean and covariance (the costly part, ``rows * d^2``) and
keeps everything else: monitoring after the warm-up window needs amax, kurtosis and the
fractions only. Such rows count in ``light_rows``, not in ``count``.

Non-finite elements are counted and replaced by zero before the moments are updated: a window
that holds any is untrusted (the safety valve trips on it), but the running moments stay finite.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.fp8.scaling import AMAX_EPS

__all__ = ["HOST", "TensorStatistics", "PROBE_FORMATS", "PROBE_GRANULARITIES", "covariance_subset"]

PROBE_FORMATS: Tuple[Fp8Format, ...] = (Fp8Format.E4M3, Fp8Format.E5M2)
"""Formats whose underflow fractions are tracked."""

PROBE_GRANULARITIES: Tuple[str, ...] = ("tensorwise", "rowwise")
"""Scaling granularities whose underflow fractions are tracked."""

HOST = torch.device("cpu")
"""Where the statistics that accumulate over probe steps live (a layer's reference and recovery
statistics, and its weight model's factors): on the host, not on the accelerator. A probe step's window statistics are updated on
the layer's device (the ``rows x features`` products); what is kept across steps is read only at the
end of a probe step (the safety valve's summaries) and when evidence is made (copied to the layer's
device for that, :mod:`~loka_torchrec.probe.evidence_rounds`), so it need not hold two full-covariance
matrices per layer of accelerator memory for the whole run, the eager probe steps' peak included."""

_UNDERFLOW_CHUNK = 1 << 28  # booleans of one batched underflow comparison (256 MiB)
_CHUNK_ELEMENTS = 1 << 22  # float64 rows are processed in chunks of at most this many elements (32 MiB)
_PASS_ELEMENTS = 1 << 26  # update() works on row blocks of at most this many elements (64 Mi: its temporaries stay < 1 GiB)


def covariance_subset(dim: int, max_cov_dim: int, key: str, seed: int = 0) -> torch.Tensor:
    """The sorted feature indices that keep full covariance: all of them, or a fixed random subset.

    The subset depends only on ``(dim, max_cov_dim, key, seed)``, so every rank picks the same one.

    Example::

        >>> covariance_subset(4, 8, "layer").tolist()
        [0, 1, 2, 3]
        >>> len(covariance_subset(4096, 256, "layer"))
        256
    """
    if dim <= max_cov_dim:
        return torch.arange(dim)
    gen = torch.Generator().manual_seed((zlib.crc32(key.encode()) + 7919 * seed) % (2**63))
    return torch.randperm(dim, generator=gen)[:max_cov_dim].sort().values


class TensorStatistics:
    """Sufficient statistics of the rows of a ``(rows, dim)`` operand (see the module docstring).

    Args:
        dim: feature dimension ``d`` (the GEMM's ``K`` for activations in the forward pass).
        max_cov_dim: keep full covariance for at most this many features.
        key: a stable name (the layer FQN and tensor) that seeds the covariance subset.
        seed: extra seed for the covariance subset.

    Example::

        >>> s = TensorStatistics(3)
        >>> s.update(torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, -2.0]]))
        >>> s.count, s.mean.tolist()
        (2, [2.0, 0.0, 0.0])
        >>> s.covariance().diagonal().tolist()
        [2.0, 0.0, 8.0]
    """

    def __init__(self, dim: int, *, max_cov_dim: int = 1024, key: str = "", seed: int = 0) -> None:
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim: expected a positive int, got {dim!r}")
        self.dim = dim
        self.cov_index: torch.Tensor = covariance_subset(dim, max_cov_dim, key, seed)
        self.count: int = 0  # rows folded into mean and covariance: known on the host without a device sync
        self.light_rows: int = 0  # rows seen with moments=False (power sums and fractions only)
        self.numel: int = 0  # elements
        self.max_rows: int = 0  # most rows in one call (the GEMM's M)
        self.sat_numel: int = 0  # elements checked for delayed-scaling saturation
        self._device = torch.device("cpu")
        self._alloc(self._device)

    # ------------------------------------------------------------------------------ storage
    def _alloc(self, device: torch.device) -> None:
        f64 = dict(dtype=torch.float64, device=device)
        self.mean = torch.zeros(self.dim, **f64)
        self.m2_diag = torch.zeros(self.dim, **f64)
        self.m2_cov: Optional[torch.Tensor] = None  # allocated by the first moment update: monitoring windows never pay for it
        self.sum_sq = torch.zeros((), **f64)
        self.sum_4th = torch.zeros((), **f64)
        self.sum_row_ms_sq = torch.zeros((), **f64)
        self.amax = torch.zeros((), **f64)
        self.nonfinite = torch.zeros((), **f64)
        self.underflow = torch.zeros(len(PROBE_FORMATS), len(PROBE_GRANULARITIES), **f64)
        self.saturation = torch.zeros((), **f64)
        self.below_floor = torch.zeros(len(PROBE_GRANULARITIES), **f64)

    _TENSORS = (
        "mean", "m2_diag", "m2_cov", "sum_sq", "sum_4th", "sum_row_ms_sq", "amax", "nonfinite", "underflow", "saturation",
        "below_floor",
    )  # fmt: skip

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "below_floor" not in state:  # statistics pickled before the floor was counted
            self.below_floor = torch.zeros(len(PROBE_GRANULARITIES), dtype=torch.float64, device=self._device)
    _COUNTS = ("count", "light_rows", "numel", "max_rows", "sat_numel")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_full_covariance(self) -> bool:
        return len(self.cov_index) == self.dim

    @property
    def is_empty(self) -> bool:
        """No row has been folded into the mean and covariance."""
        return self.count == 0

    @property
    def rows(self) -> int:
        """Every row seen, with or without moments."""
        return self.count + self.light_rows

    def to(self, device: "torch.device | str") -> "TensorStatistics":
        """Move the tensors to ``device`` (in place); returns ``self``."""
        device = torch.device(device)
        for name in self._TENSORS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        self._device = device
        return self

    def empty_like(self, device: "torch.device | str | None" = None) -> "TensorStatistics":
        """A fresh, empty instance with the same dim and covariance subset, on ``device`` (default: this one's)."""
        out = TensorStatistics.__new__(TensorStatistics)
        out.dim, out.cov_index = self.dim, self.cov_index
        out.count = out.light_rows = out.numel = out.max_rows = out.sat_numel = 0
        out._device = self._device if device is None else torch.device(device)
        out._alloc(out._device)
        return out

    def clone(self, device: "torch.device | str | None" = None) -> "TensorStatistics":
        """A copy, on ``device`` (default: this one's); copied there directly, with no second copy here."""
        out = self.empty_like(device)
        for name in self._TENSORS:
            value = getattr(self, name)
            setattr(out, name, value.to(out._device, copy=True) if value is not None else None)
        for name in self._COUNTS:
            setattr(out, name, getattr(self, name))
        return out

    # ------------------------------------------------------------------------------ updates
    @torch.no_grad()
    def update(self, x: torch.Tensor, *, delayed_amax: Optional[float] = None, moments: bool = True) -> None:
        """Fold the rows of ``x`` in.

        Args:
            x: ``(..., dim)`` tensor; all leading dims are rows. Any float dtype, any device.
            delayed_amax: amax that a delayed tensorwise scale would use for this call (e.g.
                the largest amax of earlier probe steps); when given, the elements beyond
                ``fp8_max`` under that scale are counted as saturated.
            moments: fold the rows into the mean and covariance (``False``: amax, power sums
                and fractions only).
        """
        if not torch.is_tensor(x) or not x.is_floating_point():
            raise TypeError(f"x: expected a floating point tensor, got {type(x).__name__ if not torch.is_tensor(x) else x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected a (..., {self.dim}) tensor, got shape {tuple(x.shape)}")
        x = x.detach().reshape(-1, self.dim)
        rows = x.shape[0]
        if rows == 0:
            return
        if x.device != self._device:
            self.to(x.device)
        # Two passes over row blocks of at most _PASS_ELEMENTS: the temporaries (|x|, masks,
        # float32 copies) of a whole (rows, dim) activation would be several times its size, and
        # at LRM shapes (hundreds of millions of elements) that is gigabytes next to training.
        block = max(1, _PASS_ELEMENTS // self.dim)
        blocks = [x[start : start + block] for start in range(0, rows, block)]
        # Pass 1: the amax over the finite values (the tensorwise scale every block's counts use).
        amax_call = torch.stack([self._finite(b, count=True).abs().amax() for b in blocks]).amax().double()
        self.amax = torch.maximum(self.amax, amax_call)
        # Pass 2: counts, power sums and moments, block by block.
        for b in blocks:
            b = self._finite(b, count=False)
            absx = b.abs()
            self._count_underflow(absx, amax_call)
            if delayed_amax is not None and delayed_amax > 0:
                # |x| * (fp8_max / delayed_amax) > fp8_max  <=>  |x| > delayed_amax, for every format.
                self.saturation += torch.count_nonzero(absx > delayed_amax)
            self._update_power_sums(b)
            if moments:
                chunk = max(1, _CHUNK_ELEMENTS // self.dim)
                for start in range(0, b.shape[0], chunk):
                    self._update_moments(b[start : start + chunk].double())
        if delayed_amax is not None and delayed_amax > 0:
            self.sat_numel += x.numel()
        self.max_rows = max(self.max_rows, rows)
        if not moments:
            self.light_rows += rows

    def _finite(self, x: torch.Tensor, *, count: bool) -> torch.Tensor:
        """``x`` with inf/NaN set to 0 (counted into ``nonfinite`` when ``count``). On accelerators
        always masked, without a host sync; on the CPU only when the block holds any."""
        if x.device.type == "cpu" and bool(torch.isfinite(x.abs().amax())):
            return x
        finite = torch.isfinite(x)
        if count:
            self.nonfinite += finite.numel() - torch.count_nonzero(finite)
        return torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def _count_underflow(self, absx: torch.Tensor, amax_call: torch.Tensor) -> None:
        if absx.dtype not in (torch.float32, torch.float64):
            absx = absx.float()  # float32 holds every threshold below (amax * 2**-27 at the least)
        # With scale fp8_max / amax, |x| rounds to zero when |x| * scale <= smallest_subnormal / 2,
        # i.e. when |x| <= amax * smallest_subnormal / (2 * fp8_max); exact zeros do not count.
        # All (format, granularity) pairs in one comparison and one reduction: a probe step runs
        # this for every tensor of every layer, and launches, not bytes, are what it costs.
        rows = absx.shape[0]
        amax_by_gran = {
            "tensorwise": amax_call.to(absx.dtype).expand(rows, 1),
            "rowwise": absx.amax(dim=1, keepdim=True),
        }
        # Groups with 0 < amax < AMAX_EPS: the quantizer clamps their amax up to the floor. Count
        # their nonzero elements (all on the device, no host sync) and use the clamped amax below.
        nonzero_per_row = (absx > 0).sum(dim=1, dtype=torch.float64)
        self.below_floor += torch.stack(
            [(nonzero_per_row * ((amax_by_gran[gran][:, 0] > 0) & (amax_by_gran[gran][:, 0] < AMAX_EPS))).sum() for gran in PROBE_GRANULARITIES]
        )
        amax_by_gran = {gran: amax.clamp(min=AMAX_EPS) for gran, amax in amax_by_gran.items()}
        thresholds = torch.stack(
            [amax_by_gran[gran] * (fmt.smallest_subnormal / (2.0 * fmt.max)) for fmt in PROBE_FORMATS for gran in PROBE_GRANULARITIES]
        )  # (formats * granularities, rows, 1)
        # The comparison materializes (pairs, rows, cols) booleans: at most _UNDERFLOW_CHUNK of them at once.
        step = max(1, _UNDERFLOW_CHUNK // (thresholds.shape[0] * max(absx.shape[1], 1)))
        below = sum(
            torch.count_nonzero(absx[r : r + step].unsqueeze(0) <= thresholds[:, r : r + step], dim=(1, 2))
            for r in range(0, rows, step)
        )
        zeros = torch.count_nonzero(absx == 0)
        self.underflow += (below - zeros).reshape(self.underflow.shape)

    def _update_power_sums(self, x: torch.Tensor) -> None:
        # Elementwise in float32 (float64 inputs stay float64), accumulated in float64: each
        # x^4 term carries a relative error of at most 2**-22, far below any signal of interest.
        xp = x if x.dtype == torch.float64 else x.float()
        sq = xp * xp
        self.sum_sq += sq.sum(dtype=torch.float64)
        self.sum_4th += (sq * sq).sum(dtype=torch.float64)
        self.sum_row_ms_sq += (sq.mean(dim=1, dtype=torch.float64) ** 2).sum()
        self.numel += x.numel()

    def _update_moments(self, xb: torch.Tensor) -> None:
        nb = xb.shape[0]
        mean_b = xb.mean(dim=0)
        xc = xb - mean_b
        m2_diag_b = (xc * xc).sum(dim=0)
        xs = xc if self.is_full_covariance else xc[:, self.cov_index.to(xc.device)]
        m2_cov_b = xs.t() @ xs
        self._combine(nb, mean_b, m2_diag_b, m2_cov_b)

    def _combine(self, nb: int, mean_b: torch.Tensor, m2_diag_b: torch.Tensor, m2_cov_b: torch.Tensor) -> None:
        """Chan et al.: merge a group of ``nb`` rows with mean ``mean_b`` and scatter ``m2_*_b``."""
        na = self.count
        n = na + nb
        if nb == 0:
            return
        delta = mean_b - self.mean
        weight = na * nb / n
        self.mean = self.mean + delta * (nb / n)
        self.m2_diag = self.m2_diag + m2_diag_b + delta * delta * weight
        ds = delta if self.is_full_covariance else delta[self.cov_index.to(delta.device)]
        if self.m2_cov is None:
            self.m2_cov = m2_cov_b.clone()  # na == 0: nothing to combine with
        else:
            self.m2_cov = self.m2_cov + m2_cov_b + torch.outer(ds, ds) * weight
        self.count = n

    def merge(self, other: "TensorStatistics") -> "TensorStatistics":
        """Fold ``other`` (same dim and covariance subset) into ``self``, exactly; returns ``self``."""
        if other.dim != self.dim or not torch.equal(other.cov_index, self.cov_index):
            raise ValueError(
                f"other: expected statistics of dim {self.dim} with the same covariance subset, got dim {other.dim}"
            )
        if other.device != self.device:
            other = other.clone(self.device)
        self._combine(other.count, other.mean, other.m2_diag, other.m2_cov)
        for name in ("sum_sq", "sum_4th", "sum_row_ms_sq", "nonfinite", "underflow", "saturation", "below_floor"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.amax = torch.maximum(self.amax, other.amax)
        self.numel += other.numel
        self.light_rows += other.light_rows
        self.sat_numel += other.sat_numel
        self.max_rows = max(self.max_rows, other.max_rows)
        return self

    # ------------------------------------------------------------------------------ estimates
    def scatter_matrix(self) -> torch.Tensor:
        """The scatter ``sum (x - mean)(x - mean)^T`` ``(s, s)`` over :attr:`cov_index` (zeros when empty)."""
        if self.m2_cov is None:
            s = len(self.cov_index)
            return torch.zeros(s, s, dtype=torch.float64, device=self._device)
        return self.m2_cov

    def covariance(self) -> torch.Tensor:
        """Unbiased covariance ``(s, s)`` over :attr:`cov_index` (all features when not capped)."""
        return self.scatter_matrix() / max(self.count - 1, 1)

    def variance(self) -> torch.Tensor:
        """Unbiased per-feature variance ``(dim,)``."""
        return self.m2_diag / max(self.count - 1, 1)

    def mean_square(self) -> float:
        """``mean(x^2)`` over all elements."""
        return float(self.sum_sq) / self.numel if self.numel else math.nan

    def kurtosis(self) -> float:
        """Uncentred kurtosis ``mean(x^4) / mean(x^2)^2`` over all elements (NaN when empty or all zero)."""
        if not self.numel:
            return math.nan
        m2 = float(self.sum_sq) / self.numel
        m4 = float(self.sum_4th) / self.numel
        return m4 / (m2 * m2) if m2 > 0 else math.nan

    def row_mean_square_variance(self) -> float:
        """Unbiased variance across rows of the row mean-square ``mean_j x_ij^2``."""
        n = self.rows
        if n < 2:
            return math.nan
        mean_ms = float(self.sum_sq) / self.numel
        return max(float(self.sum_row_ms_sq) - n * mean_ms * mean_ms, 0.0) / (n - 1)

    def underflow_fraction(self, fmt: "Fp8Format | str", granularity: str) -> float:
        i = PROBE_FORMATS.index(Fp8Format.parse(fmt))
        j = PROBE_GRANULARITIES.index(granularity)
        return float(self.underflow[i, j]) / self.numel if self.numel else math.nan

    def below_floor_fraction(self, granularity: str) -> float:
        """Fraction of elements in ``granularity`` groups whose amax is below the scaling floor (1e-12)."""
        j = PROBE_GRANULARITIES.index(granularity)
        return float(self.below_floor[j]) / self.numel if self.numel else math.nan

    def saturation_fraction(self) -> float:
        """Fraction of elements beyond the delayed amax: what a delayed tensorwise scale clamps (any format)."""
        return float(self.saturation) / self.sat_numel if self.sat_numel else 0.0

    def summary(self) -> Dict[str, Any]:
        """A JSON-ready digest for logs: counts, amax, kurtosis, fractions, covariance shape.

        Every device value comes to the host in one copy (one sync on an accelerator).
        """
        scalars = [self.amax, self.sum_sq, self.sum_4th, self.nonfinite, self.saturation]
        if self.count:
            scalars += [self.mean.norm(), self.variance().clamp(min=0).sqrt().mean()]
        host = torch.cat([torch.stack(scalars).to(torch.float64), self.underflow.reshape(-1), self.below_floor]).tolist()
        amax, sum_sq, sum_4th, nonfinite, saturation = host[:5]
        mean_norm, std_mean = (host[5], host[6]) if self.count else (math.nan, math.nan)
        floor = host[len(host) - self.below_floor.numel() :]
        under = host[len(host) - self.below_floor.numel() - self.underflow.numel() : len(host) - self.below_floor.numel()]
        n = self.numel
        m2, m4 = (sum_sq / n, sum_4th / n) if n else (math.nan, math.nan)
        g = len(PROBE_GRANULARITIES)
        return {
            "rows": self.rows,
            "moment_rows": self.count,
            "max_rows": self.max_rows,
            "numel": n,
            "amax": amax if self.rows else math.nan,
            "kurtosis": m4 / (m2 * m2) if n and m2 > 0 else math.nan,
            "mean_sq": m2,
            "mean_norm": mean_norm,
            "std_mean": std_mean if self.count > 1 else math.nan,
            "nonfinite": int(nonfinite),
            "cov_mode": "full" if self.is_full_covariance else "subset",
            "cov_dim": len(self.cov_index),
            "underflow": {
                fmt.value: {gran: (under[i * g + j] / n if n else math.nan) for j, gran in enumerate(PROBE_GRANULARITIES)}
                for i, fmt in enumerate(PROBE_FORMATS)
            },
            "saturation": saturation / self.sat_numel if self.sat_numel else 0.0,
            # elements in groups whose amax is below the FP8 scaling floor (1e-12), per granularity
            "below_floor": {gran: (floor[j] / n if n else math.nan) for j, gran in enumerate(PROBE_GRANULARITIES)},
        }

    def __repr__(self) -> str:
        return f"TensorStatistics(dim={self.dim}, count={self.count}, cov_dim={len(self.cov_index)})"

