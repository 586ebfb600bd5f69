"""The step-time guard: FP8 stays on only if the whole training step got faster.

Dispatch decides per GEMM from evidence measured on each GEMM alone. A training step can still
get slower: the layer adds host work (quantization launches, bookkeeping) that a GEMM timed alone
hides, and a step that was bound by the GPU becomes bound by the host. The guard checks the
promise that matters to the user, the step time:

1. while no GEMM runs in FP8 it keeps the last ``window`` step times as the baseline;
2. when a plan turns FP8 on, it skips ``settle`` steps (allocator, first calls), then collects
   ``window`` step times;
3. it compares the medians: FP8 stays when ``median_fp8 <= median_bf16 * (1 + tolerance)``,
   otherwise the verdict is to go back to bf16. The verdict is taken once per plan.

Step times are in milliseconds, measured by the training loop: the interval between two step
ends on the host clock, which in steady state is the loop's throughput (or, with
``train.step_sync``, each step synchronized with the device). :class:`StepTimeGuard` is pure bookkeeping; the
:class:`~loka_torchrec.dispatch.dispatcher.Dispatcher` makes ranks agree and acts on a verdict.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Deque, List, Optional

__all__ = ["GuardVerdict", "StepTimeGuard"]


@dataclasses.dataclass(frozen=True)
class GuardVerdict:
    """The comparison at the end of a trial window.

    Attributes:
        step: the step whose time completed the trial window.
        bf16_ms: median step time before FP8 (ms).
        fp8_ms: median step time with the FP8 plan (ms).
        keep_fp8: whether FP8 stays on.
    """

    step: int
    bf16_ms: float
    fp8_ms: float
    keep_fp8: bool

    @property
    def ratio(self) -> float:
        """FP8 step time over bf16 step time (< 1 is faster)."""
        return self.fp8_ms / self.bf16_ms

    def describe(self) -> str:
        verb = "keeps FP8" if self.keep_fp8 else "returns to bf16"
        return f"step-time guard {verb}: median step {self.fp8_ms:.2f} ms with FP8 vs {self.bf16_ms:.2f} ms in bf16 ({self.ratio:.3f}x)"


class StepTimeGuard:
    """Collects step times and says when a trial window is complete (see the module docstring).

    Args:
        window: step times per median (the baseline keeps the last ``window``; the trial
            collects ``window``); 0 disables the guard.
        tolerance: relative slowdown FP8 may show before the verdict is bf16 (noise margin).
        settle: steps skipped after FP8 turns on, before the trial collects.

    Example::

        >>> guard = StepTimeGuard(window=3, tolerance=0.0, settle=1)
        >>> for step, ms in enumerate([10.0, 10.0, 10.0]):
        ...     guard.observe(step, ms, fp8_active=False)
        >>> [guard.observe(step, ms, fp8_active=True) for step, ms in [(3, 50.0), (4, 12.0), (5, 12.0), (6, 12.0)]][-1].keep_fp8
        False
    """

    def __init__(self, window: int = 50, tolerance: float = 0.02, settle: int = 5) -> None:
        if window < 0:
            raise ValueError(f"dispatch.step_guard_window: must be >= 0, got {window}")
        if tolerance < 0:
            raise ValueError(f"dispatch.step_guard_tolerance: must be >= 0, got {tolerance}")
        if settle < 0:
            raise ValueError(f"settle: must be >= 0, got {settle}")
        self.window, self.tolerance, self.settle = window, tolerance, settle
        self._baseline: Deque[float] = collections.deque(maxlen=max(window, 1))
        self._trial: List[float] = []
        self._skipped = 0
        self._decided = False

    @property
    def enabled(self) -> bool:
        return self.window > 0

    @property
    def collecting(self) -> bool:
        """Whether a trial is under way: FP8 turned on with a baseline to compare against, no verdict yet
        (the caller knows whether FP8 is on; this says the rest)."""
        return self.enabled and not self._decided and len(self._baseline) >= max(1, self.window // 2)

    @property
    def decided(self) -> bool:
        """Whether the last trial has its verdict (until :meth:`restart` opens a new one)."""
        return self.enabled and self._decided

    def restart(self) -> None:
        """A new plan: the next FP8 steps form a new trial (the bf16 baseline is kept)."""
        self._trial, self._skipped, self._decided = [], 0, False

    def state_dict(self) -> dict:
        """The baseline and trial collected so far (a checkpoint carries it: a resumed trial goes on)."""
        return {"baseline": list(self._baseline), "trial": list(self._trial), "skipped": self._skipped, "decided": self._decided}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        self._baseline.clear()
        self._baseline.extend(float(v) for v in state.get("baseline", []))
        self._trial = [float(v) for v in state.get("trial", [])]
        self._skipped = int(state.get("skipped", 0))
        self._decided = bool(state.get("decided", False))

    def observe(self, step: int, step_ms: float, *, fp8_active: bool) -> Optional[GuardVerdict]:
        """Record one step; returns the verdict at the step that completes a trial, else ``None``.

        A trial needs a baseline of at least ``window // 2`` bf16 steps; without it there is no
        verdict (FP8 stays, and nothing is claimed).
        """
        if not self.enabled or step_ms != step_ms or step_ms < 0:  # NaN or negative: not a time
            return None
        if not fp8_active:
            self._baseline.append(float(step_ms))
            self.restart()
            return None
        if self._decided or len(self._baseline) < max(1, self.window // 2):
            return None
        if self._skipped < self.settle:
            self._skipped += 1
            return None
        self._trial.append(float(step_ms))
        if len(self._trial) < self.window:
            return None
        self._decided = True
        bf16_ms, fp8_ms = statistics.median(self._baseline), statistics.median(self._trial)
        return GuardVerdict(step, bf16_ms, fp8_ms, keep_fp8=fp8_ms <= bf16_ms * (1.0 + self.tolerance))
