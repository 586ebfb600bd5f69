"""Where a training job's peak GPU memory was set: the step, evaluation or checkpoint at which it rose.

The run summary's ``peak_memory_gb`` says how high the memory went, not when; a peak that a job's
steady steps never reach (an eager probe step, the planning step's measurements, an evaluation
recording graphs of its own) is what a memory limit has to allow for. The trainer hands
:class:`PeakMemoryTrace` ``torch.cuda.max_memory_allocated`` (a host-side counter: no sync) after
each step, evaluation and checkpoint, with a label saying which; each rise of the peak is kept, the
last one being where the whole run's peak was set. A reset of the device's peak counter (at the
timed window's start) does not lower the trace's peak: later values count only where they pass it.
"""

from __future__ import annotations

from typing import Dict, List, Union

__all__ = ["PeakMemoryTrace"]

GIB = 2**30


class PeakMemoryTrace:
    """The rises of the peak allocated memory, with what the job was doing at each.

    Args:
        min_rise_bytes: a rise smaller than this (and than ``min_rise_share`` of the peak) is
            folded into the next one that is kept, so that allocator noise leaves no entries.
        min_rise_share: the same, as a share of the peak so far.
        most: rises kept; past it the oldest ones are dropped (the last rise is the peak's).

    Example::

        >>> trace = PeakMemoryTrace(min_rise_bytes=0)
        >>> for label, peak in [("step 1", 2 * GIB), ("step 2", 2 * GIB), ("step 10 (eager)", 3 * GIB)]:
        ...     trace.observe(label, peak)
        >>> trace.peak_set_at, trace.rises[-1]["gib"]
        ('step 10 (eager)', 3.0)
    """

    def __init__(self, min_rise_bytes: int = 64 * 2**20, min_rise_share: float = 0.01, most: int = 12) -> None:
        if most < 1:
            raise ValueError(f"most: expected >= 1, got {most}")
        self.min_rise_bytes, self.min_rise_share, self.most = min_rise_bytes, min_rise_share, most
        self.peak = 0
        self._kept = 0  # the peak at the last rise kept
        self.rises: List[Dict[str, Union[str, float]]] = []

    def observe(self, label: str, peak_bytes: int) -> None:
        """The device's peak counter after the work ``label`` names."""
        if peak_bytes <= self.peak:
            return
        self.peak = int(peak_bytes)
        rise = self.peak - self._kept
        if self.rises and rise < max(self.min_rise_bytes, self.min_rise_share * self.peak):
            return
        self._kept = self.peak
        self.rises = (self.rises + [{"at": label, "gib": self.peak / GIB, "rise_gib": rise / GIB}])[-self.most :]

    @property
    def peak_set_at(self) -> "str | None":
        """The label of the work during which the peak was last raised by a kept amount."""
        return self.rises[-1]["at"] if self.rises else None
