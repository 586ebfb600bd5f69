"""Click-prediction quality (NE, AUC) merged exactly across ranks, and step time / QPS.

NE, the normalized entropy, is the mean log loss divided by the entropy of the empirical
positive rate ``p``: ``NE = mean(BCE) / -(p log p + (1 - p) log(1 - p))``. A model that always
predicts ``p`` scores 1.0; lower is better. Across ranks NE merges exactly from three sums (log
loss, positives, count). AUC does not decompose into sums, so :meth:`BinaryClassificationMetrics.compute`
all-gathers every rank's logits and labels and computes it on the union with torchmetrics.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

__all__ = ["BinaryClassificationMetrics", "StepTimer", "normalized_entropy", "binary_entropy"]


def binary_entropy(positive_rate: float) -> float:
    """``-(p log p + (1 - p) log(1 - p))`` in nats; 0.0 at ``p`` in {0, 1}."""
    p = float(positive_rate)
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1.0 - p) * math.log1p(-p))


def _ne_from_sums(log_loss_sum: float, positives: float, count: float) -> float:
    if count <= 0:
        return math.nan
    entropy = binary_entropy(positives / count)
    return (log_loss_sum / count) / entropy if entropy > 0 else math.nan


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """NE of logits against 0/1 labels, in one pass and in float64.

    Args:
        logits: ``(N,)`` predicted logits (``sigmoid(logits)`` is the click probability).
        labels: ``(N,)`` 0/1 labels.

    Returns:
        mean log loss over the entropy of the labels' positive rate; NaN if all labels agree.

    Example::

        >>> labels = torch.tensor([0.0, 0.0, 0.0, 1.0])
        >>> round(normalized_entropy(torch.full((4,), math.log(1 / 3)), labels), 6)  # predicts p = 0.25
        1.0
    """
    _check_pair(logits, labels)
    logits64, labels64 = logits.detach().reshape(-1).double(), labels.detach().reshape(-1).double()
    loss = F.binary_cross_entropy_with_logits(logits64, labels64, reduction="sum")
    return _ne_from_sums(float(loss), float(labels64.sum()), float(labels64.numel()))


def _check_pair(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(
            f"logits and labels must be tensors, got {type(logits).__name__} and {type(labels).__name__}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() > 1 and not (logits.dim() == 2 and logits.shape[1] == 1):
        raise ValueError(f"logits must have shape (N,) or (N, 1), got {tuple(logits.shape)}")
    if logits.numel() != labels.numel():
        raise ValueError(
            f"logits and labels must have the same number of elements, got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}"
        )


class BinaryClassificationMetrics:
    """NE, AUC, mean log loss and positive rate of a click model, exact across ranks.

    Keeps on ``device``: float64 sums of the log loss, the positives and the count, and (for
    AUC) every logit and label since the last :meth:`reset`. Use one instance per window of
    train steps (call :meth:`reset` after logging) and one for a whole eval pass.

    :meth:`compute` is a collective when ``torch.distributed`` is initialized with more than
    one rank (and ``sync`` is true): every rank of ``process_group`` must call it, at the same
    point, even a rank that saw no samples. It then returns the metrics of the union of all
    ranks' samples, equal to computing them in one process over all of them.

    Args:
        device: where the states live (the device of the logits).
        process_group: the ranks to merge over; ``None`` is the default group.
        validate_labels: check that labels are 0 or 1: on a CPU in :meth:`update`; on a GPU
            the bad labels are counted on the device and :meth:`compute` raises (so that no
            training step waits for the check), on every rank alike.

    Example::

        >>> m = BinaryClassificationMetrics(torch.device("cpu"))
        >>> m.update(torch.tensor([2.0, -1.0, 0.5, -3.0]), torch.tensor([1.0, 0.0, 1.0, 0.0]))
        >>> out = m.compute()
        >>> out["auc"], out["count"], out["positive_rate"]
        (1.0, 4.0, 0.5)
        >>> out["ne"] < 1.0
        True
    """

    def __init__(
        self,
        device: Union[torch.device, str] = "cpu",
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        validate_labels: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.process_group = process_group
        self.validate_labels = validate_labels
        # log loss, positives, count, labels that are neither 0 nor 1
        self._sums: torch.Tensor = torch.zeros(4, dtype=torch.float64, device=self.device)
        self._logits: List[torch.Tensor] = []
        self._labels: List[torch.Tensor] = []

    def reset(self) -> None:
        """Forgets every sample seen so far."""
        self._sums.zero_()
        self._logits.clear()
        self._labels.clear()

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds a batch.

        Args:
            logits: ``(B,)`` or ``(B, 1)`` predicted logits, any float dtype.
            labels: ``(B,)`` labels, 0 or 1 (any dtype).
        """
        _check_pair(logits, labels)
        logits = logits.detach().reshape(-1).to(self.device)
        labels = labels.detach().reshape(-1).to(device=self.device, dtype=torch.float64)
        invalid = labels.new_zeros(())
        if self.validate_labels:
            invalid = ((labels != 0) & (labels != 1)).sum().to(torch.float64)
            if self.device.type == "cpu" and invalid.item():
                raise ValueError("labels must be 0 or 1")
        loss = F.binary_cross_entropy_with_logits(logits.double(), labels, reduction="sum")
        self._sums += torch.stack([loss, labels.sum(), labels.new_tensor(float(labels.numel())), invalid])
        # float32 is enough to rank logits; AUC converts them to float64 probabilities at compute().
        # Always a copy: a model compiled with CUDA graphs returns logits that its next replay overwrites.
        self._logits.append(logits.to(torch.float32, copy=True))
        self._labels.append(labels.to(torch.uint8))

    def _is_distributed(self) -> bool:
        return (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def _comm_device(self) -> torch.device:
        # gloo moves CPU tensors; nccl needs CUDA ones.
        if dist.get_backend(self.process_group) == "gloo":
            return torch.device("cpu")
        return self.device

    def _all_gather_cat(self, local: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's 1-D ``local`` (sizes may differ), in rank order."""
        comm = self._comm_device()
        local = local.to(comm)
        world = dist.get_world_size(self.process_group)
        size = torch.tensor([local.numel()], dtype=torch.int64, device=comm)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=self.process_group)
        counts = [int(s.item()) for s in sizes]
        longest = max(counts)
        padded = torch.zeros(longest, dtype=local.dtype, device=comm)  # all_gather needs equal sizes
        padded[: local.numel()] = local
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.process_group)
        return torch.cat([g[:n] for g, n in zip(gathered, counts)]).to(self.device)

    @torch.no_grad()
    def compute(self, *, sync: bool = True) -> Dict[str, float]:
        """The metrics of all samples since :meth:`reset`, over all ranks when ``sync``.

        Returns:
            ``ne`` (normalized entropy), ``auc`` (area under the ROC curve), ``loss`` (mean log
            loss in nats), ``positive_rate`` and ``count`` (samples). ``ne`` is NaN when all labels
            agree, ``auc`` when a class is missing, everything but ``count`` when there are none.
        """
        sums = self._sums.clone()
        logits = torch.cat(self._logits) if self._logits else torch.zeros(0, device=self.device)
        labels = (
            torch.cat(self._labels) if self._labels else torch.zeros(0, dtype=torch.uint8, device=self.device)
        )
        if sync and self._is_distributed():
            comm_sums = sums.to(self._comm_device())
            dist.all_reduce(comm_sums, op=dist.ReduceOp.SUM, group=self.process_group)
            sums = comm_sums.to(self.device)
            logits = self._all_gather_cat(logits)
            labels = self._all_gather_cat(labels)
        loss_sum, positives, count, invalid = (float(v) for v in sums.tolist())
        if invalid:
            raise ValueError(f"labels must be 0 or 1: {invalid:.0f} label(s) since the last reset were not")
        if count <= 0:
            nan = math.nan
            return {"ne": nan, "auc": nan, "loss": nan, "positive_rate": nan, "count": 0.0}
        if 0 < positives < count:
            # torchmetrics' exact (threshold-free) ROC: integer counts per distinct score, rates and
            # area in float32 (AUC good to about 1e-7). Probabilities in [0, 1], so it applies no
            # sigmoid of its own; float64 keeps large logits from tying at 1.0.
            auc = float(
                binary_auroc(torch.sigmoid(logits.double()), labels.long(), thresholds=None, validate_args=False)
            )
        else:
            auc = math.nan
        return {
            "ne": _ne_from_sums(loss_sum, positives, count),
            "auc": auc,
            "loss": loss_sum / count,
            "positive_rate": positives / count,
            "count": count,
        }


class StepTimer:
    """Step time (median, p90) and throughput over the last ``window`` steps.

    Call :meth:`tick` once at the end of every training step; the first tick only starts the
    clock. Call :meth:`restart` after anything that is not a training step (eval, a
    checkpoint), so that its time is not counted as a step.

    Args:
        global_batch_size: samples per step over all ranks (QPS counts these).
        window: steps the statistics cover.
        cuda_sync: call ``torch.cuda.synchronize()`` before reading the clock (exact step times
            on a GPU, at the cost of one synchronization per step).

    Example::

        >>> timer = StepTimer(global_batch_size=512, window=10)
        >>> for _ in range(4):
        ...     timer.tick()
        >>> stats = timer.stats()
        >>> sorted(stats)
        ['qps', 'step_time_ms_median', 'step_time_ms_p90', 'steps']
        >>> stats["steps"]
        3.0
    """

    def __init__(self, global_batch_size: int, *, window: int = 100, cuda_sync: bool = False) -> None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ValueError(f"global_batch_size must be an int >= 1, got {global_batch_size!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.global_batch_size = global_batch_size
        self.cuda_sync = cuda_sync
        self._durations: Deque[float] = deque(maxlen=window)
        self._last: Optional[float] = None

    def _now(self) -> float:
        if self.cuda_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def tick(self) -> None:
        """Marks the end of a step (and the start of the next)."""
        now = self._now()
        if self._last is not None:
            self._durations.append(now - self._last)
        self._last = now

    def restart(self) -> None:
        """Starts the clock afresh: the time since the last tick is not a step."""
        self._last = self._now()

    def stats(self) -> Dict[str, float]:
        """``step_time_ms_median``, ``step_time_ms_p90``, ``qps`` (global samples per second of step
        time in the window) and ``steps`` (in the window); NaN before two ticks."""
        durations = list(self._durations)
        if not durations:
            nan = math.nan
            return {"step_time_ms_median": nan, "step_time_ms_p90": nan, "qps": nan, "steps": 0.0}
        ordered = sorted(durations)
        p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]  # nearest-rank percentile
        total = sum(durations)
        return {
            "step_time_ms_median": 1e3 * statistics.median(ordered),
            "step_time_ms_p90": 1e3 * p90,
            "qps": self.global_batch_size * len(durations) / total if total > 0 else math.inf,
            "steps": float(len(durations)),
        }
