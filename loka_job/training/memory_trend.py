"""A warning before a training job runs out of GPU memory because memory grows every step.

Steady training holds the same memory from step to step once the first steps have allocated the
optimizer state and the compiled graphs' pools. Memory that keeps growing is a leak, and the job
will run out of memory; the earlier a user hears it, the less GPU time is lost. The trainer feeds
:class:`MemoryTrend` the allocated memory after every step (``torch.cuda.memory_allocated``, a
host-side counter) and logs its warning once.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

__all__ = ["MemoryTrend"]


class MemoryTrend:
    """Notices allocated memory that grew in each of the last ``windows`` intervals between samples.

    Args:
        windows: consecutive growing intervals that make a trend.
        min_gib_per_step: growth per training step below which nothing is said (allocator noise).
        skip: samples at the start of the run that are not compared (warm-up allocations).

    Example::

        >>> trend = MemoryTrend(windows=3, skip=0)
        >>> [trend.observe(step, gib) is not None for step, gib in [(5, 10.0), (10, 14.0), (15, 18.0), (20, 22.0)]]
        [False, False, False, True]
    """

    def __init__(self, windows: int = 10, min_gib_per_step: float = 0.05, skip: int = 5) -> None:
        if windows < 1:
            raise ValueError(f"windows: expected >= 1, got {windows}")
        self.windows = windows
        self.min_gib_per_step = min_gib_per_step
        self.skip = skip
        self._samples: List[Tuple[int, float]] = []
        self._seen = 0
        self.warned = False

    def observe(self, step: int, allocated_gib: float) -> Optional[str]:
        """Record the memory allocated after ``step``; the warning (once), else ``None``."""
        self._seen += 1
        if self.warned or self._seen <= self.skip:
            return None
        self._samples = (self._samples + [(step, allocated_gib)])[-(self.windows + 1) :]
        if len(self._samples) <= self.windows:
            return None
        rates = [(g1 - g0) / (s1 - s0) for (s0, g0), (s1, g1) in zip(self._samples, self._samples[1:]) if s1 > s0]
        if len(rates) < self.windows or min(rates) < self.min_gib_per_step:
            return None
        self.warned = True
        (first, start), (last, end) = self._samples[0], self._samples[-1]
        return (
            f"GPU memory grows every step: {start:.2f} GiB allocated after step {first}, {end:.2f} GiB after "
            f"step {last} (+{(end - start) / (last - first):.2f} GiB a step); the job will run out of memory. "
            f"Under CUDA graphs (train.compile=reduce-overhead or auto) try train.compile=default"
        )
