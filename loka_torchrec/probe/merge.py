"""Exact cross-rank merge of :class:`TensorStatistics` with ``torch.distributed``.

Ranks exchange sufficient statistics, never averages of per-rank means, in three collectives for
any number of tensors (everything is packed into one float64 buffer per collective):

1. ``SUM`` of counts, element counts, ``count * mean`` (the sum of rows), the power sums, the
   non-finite, underflow and saturation counts. Every rank now knows the global mean ``mu``.
2. ``MAX`` of amax and of the rows per call.
3. ``SUM`` of each rank's scatter taken around the *global* mean,
   ``M2_r + n_r (mean_r - mu)(mean_r - mu)^T``, which adds up to the scatter of the union of
   the data (the parallel-axis theorem; the same identity as Chan's pairwise merge).

The buffer travels on the device the process group wants (CUDA for NCCL, CPU for gloo) and the
merged statistics come back on the device of the inputs. Without an initialized process group
(or with one rank) the merge is a copy.

Ranks must pass statistics of the same dims in the same order (the callback sorts layers by name).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from loka_torchrec.probe.statistics import TensorStatistics

__all__ = ["Ranks", "all_reduce_statistics", "rank_deviation", "is_distributed", "comm_device"]


def is_distributed(group: Optional[Any] = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The ranks the Probe works with: its process group (``None``: the world), this rank and their number."""

    group: Optional[Any] = None
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, group: Optional[Any] = None) -> "Ranks":
        """``group``'s ranks (one rank of one where no process group is initialized)."""
        if not is_distributed(group):
            return cls(group)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a collective; any picklable object)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def comm_device(group: Optional[Any] = None) -> torch.device:
    """The device a collective's tensors must live on for ``group``'s backend."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_statistics(stats: Sequence[TensorStatistics], group: Optional[Any] = None) -> List[TensorStatistics]:
    """Merged copies of ``stats``: each the statistics of the union of all ranks' rows.

    Args:
        stats: this rank's statistics; every rank passes the same dims in the same order.
        group: process group (default: the world).

    Returns:
        New :class:`TensorStatistics`, identical on every rank, on the inputs' devices.

    Example::

        >>> s = TensorStatistics(2); s.update(torch.ones(3, 2))
        >>> all_reduce_statistics([s])[0].count  # one process: a copy
        3
    """
    if not stats or not is_distributed(group):
        return [s.clone() for s in stats]
    device = comm_device(group)
    f64 = dict(dtype=torch.float64, device=device)

    # 1. sums: counts, row sums, power sums, event counts
    parts: List[torch.Tensor] = []
    for s in stats:
        parts += [
            torch.tensor([s.count, s.numel, s.sat_numel, s.light_rows], **f64),
            (s.mean * s.count).to(device),
            torch.stack([s.sum_sq, s.sum_4th, s.sum_row_ms_sq, s.nonfinite, s.saturation]).to(device),
            s.underflow.reshape(-1).to(device),
            s.below_floor.to(device),
        ]
    sums = _all_reduce(torch.cat(parts), dist.ReduceOp.SUM, group).cpu()  # one device-to-host copy

    # 2. maxima
    maxima = torch.stack([torch.stack([s.amax.to(device), torch.tensor(float(s.max_rows), **f64)]) for s in stats])
    maxima = _all_reduce(maxima, dist.ReduceOp.MAX, group).cpu()

    # 3. scatter around the global mean (tensors that no rank folded moments into are skipped:
    #    every rank sees the same global counts, so every rank skips the same ones)
    merged: List[TensorStatistics] = []
    scatter_parts: List[torch.Tensor] = []
    offset = 0
    for i, s in enumerate(stats):
        out = s.empty_like()
        out.count, out.numel, out.sat_numel, out.light_rows = (int(round(v)) for v in sums[offset : offset + 4].tolist())
        offset += 4
        row_sum = sums[offset : offset + s.dim].to(s.device)
        offset += s.dim
        out.sum_sq, out.sum_4th, out.sum_row_ms_sq, out.nonfinite, out.saturation = sums[offset : offset + 5].to(s.device)
        offset += 5
        out.underflow = sums[offset : offset + s.underflow.numel()].reshape(s.underflow.shape).to(s.device)
        offset += s.underflow.numel()
        out.below_floor = sums[offset : offset + s.below_floor.numel()].to(s.device)
        offset += s.below_floor.numel()
        out.amax = maxima[i, 0].to(s.device)
        out.max_rows = int(maxima[i, 1])
        if out.count:
            out.mean = row_sum / out.count
            delta = s.mean - out.mean
            ds = delta if s.is_full_covariance else delta[s.cov_index.to(delta.device)]
            scatter_parts += [
                (s.m2_diag + s.count * delta * delta).to(device),
                (s.scatter_matrix() + s.count * torch.outer(ds, ds)).reshape(-1).to(device),
            ]
        merged.append(out)
    if scatter_parts:
        scatter = _all_reduce(torch.cat(scatter_parts), dist.ReduceOp.SUM, group)
        offset = 0
        for out in merged:
            if not out.count:
                continue
            k = len(out.cov_index)
            out.m2_diag = scatter[offset : offset + out.dim].to(out.device)
            offset += out.dim
            out.m2_cov = scatter[offset : offset + k * k].reshape(k, k).to(out.device)
            offset += k * k
    return merged


def _all_reduce(t: torch.Tensor, op: Any, group: Optional[Any]) -> torch.Tensor:
    t = t.contiguous()
    dist.all_reduce(t, op=op, group=group)
    return t


def rank_deviation(local: TensorStatistics, merged: TensorStatistics) -> Dict[str, float]:
    """How far this rank's rows sit from the union of all ranks', in standard errors.

    Rows are treated as independent samples. For a rank holding ``n`` of ``N`` rows, the standard
    error of the difference between its mean and the global mean is ``sd * sqrt(1/n - 1/N)``.

    Returns:
        ``mean_z_max``: the largest per-feature ``|z|`` of the mean; ``mean_z_crit``: the
        Bonferroni threshold for it at family-wise level 1e-3 over ``dim`` features;
        ``mean_sq_z``: ``z`` of this rank's ``mean(x^2)`` against the global one.
    """
    out = {"mean_z_max": math.nan, "mean_z_crit": _bonferroni_z(local.dim), "mean_sq_z": math.nan}
    n, total = local.count, merged.count  # rows behind the means
    if 0 < n < total and total >= 3:
        factor = 1.0 / n - 1.0 / total
        var = merged.variance().to(local.device)
        se = (var * factor).clamp(min=0).sqrt()
        diff = (local.mean - merged.mean.to(local.device)).abs()
        z = torch.where(se > 0, diff / se.clamp(min=1e-300), torch.where(diff > 0, math.inf, 0.0))
        out["mean_z_max"] = float(z.max())
    n, total = local.rows, merged.rows  # rows behind mean(x^2), with or without moments
    var_ms = merged.row_mean_square_variance()
    if 0 < n < total and total >= 3 and var_ms > 0:
        out["mean_sq_z"] = (local.mean_square() - merged.mean_square()) / math.sqrt(var_ms * (1.0 / n - 1.0 / total))
    return out


def _bonferroni_z(dim: int, alpha: float = 1e-3) -> float:
    return float(torch.special.ndtri(torch.tensor(1.0 - alpha / (2.0 * dim), dtype=torch.float64)))
