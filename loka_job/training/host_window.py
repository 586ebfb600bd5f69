"""What the host did over the timed window, per step: waiting for batches, CPU time of the
training thread and of the whole process, the training thread's context switches, Python's
garbage collections, and the CUDA allocator going to the driver.

Only the training steps count: the stretches the window leaves out (profiled steps with the
profiler's own work after them, evaluations, checkpoints) are subtracted (:class:`HostWindow`).
A thread's CPU time also counts its waits on the GPU where CUDA spins for them (its default
with fewer busy contexts than cores), so on a GPU that column is close to the wall time of a
step whose host waits for its kernels; compare it between runs, not with the step time.

A step whose GPU idles (the large presets) is set by the host's training thread, and two runs
that launch the same kernels can still differ in step time. These counters say where such a
difference comes from without a profiler (which slows the host itself): the loop waiting on the
loader, more Python work on the training thread (its CPU time), other threads of the process
taking CPU (process minus thread CPU time; the thread count at the window's end) or the thread
being preempted (involuntary context switches), collections of a larger Python heap, or
``cudaMalloc``/``cudaFree`` calls and allocation retries of a fragmented cache (each one
synchronizes the device).

Example::

    >>> batches = TimedBatches(iter(range(3)))
    >>> start = host_counters(batches, "cpu")
    >>> next(batches), next(batches)
    (0, 1)
    >>> per_step(start, host_counters(batches, "cpu"), steps=2)["data_wait_ms"] >= 0
    True
"""

from __future__ import annotations

import gc
import os
import resource
import threading
import time
from typing import Any, Dict, Iterator

import torch

__all__ = ["HostWindow", "TimedBatches", "host_counters", "per_step"]


class TimedBatches:
    """``batches`` with the time spent inside ``next`` (waiting for the loader) added up."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self.wait_seconds = 0.0

    def __iter__(self) -> "TimedBatches":
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self._batches)
        finally:
            self.wait_seconds += time.perf_counter() - start


def host_counters(batches: TimedBatches, device: "torch.device | str") -> Dict[str, float]:
    """The running totals that :func:`per_step` turns into per-step numbers (call it on the
    training thread: the thread counters are the caller's)."""
    counters = {"data_wait_s": batches.wait_seconds, "thread_cpu_s": time.thread_time(), "process_cpu_s": time.process_time()}
    if hasattr(resource, "RUSAGE_THREAD"):  # Linux
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        counters["thread_switches_voluntary"] = float(usage.ru_nvcsw)
        counters["thread_switches_involuntary"] = float(usage.ru_nivcsw)
    for generation, stats in enumerate(gc.get_stats()):
        counters[f"gc{generation}"] = float(stats["collections"])
    device = torch.device(device)
    if device.type == "cuda":
        memory = torch.cuda.memory_stats(device)
        counters["cuda_mallocs"] = float(memory.get("num_device_alloc", 0))
        counters["cuda_frees"] = float(memory.get("num_device_free", 0))
        counters["alloc_retries"] = float(memory.get("num_alloc_retries", 0))
    return counters


def per_step(start: Dict[str, float], end: Dict[str, float], *, steps: int) -> Dict[str, float]:
    """The counters' growth from ``start`` to ``end`` per step: times (``*_s`` totals) as
    ``*_ms``, counts as ``*_per_step``; and ``threads``, the process's threads at ``end``."""
    steps = max(1, steps)
    out: Dict[str, float] = {}
    for key in end:
        if key.endswith("_s"):
            out[f"{key[:-2]}_ms"] = 1e3 * (end[key] - start[key]) / steps
        else:
            out[f"{key}_per_step"] = (end[key] - start[key]) / steps
    out["threads"] = float(_thread_count())
    return out


class HostWindow:
    """The host counters over a window of training steps, less the stretches left out of it.

    ``open()`` at the window's start, ``leave_out()`` ... ``take_back(steps)`` around work that is
    not a training step (``steps``: the training steps inside that stretch, e.g. the profiled
    ones), ``close(steps)`` at its end with the window's step count. :attr:`per_step` is then the
    counters' growth per training step that was not left out (``None`` before ``close``).
    """

    def __init__(self, batches: TimedBatches, device: "torch.device | str") -> None:
        self._batches, self._device = batches, device
        self._start: "Dict[str, float] | None" = None
        self._left_at: "Dict[str, float] | None" = None
        self._left_out: Dict[str, float] = {}
        self._steps_left_out = 0
        self.per_step: "Dict[str, float] | None" = None

    @property
    def is_open(self) -> bool:
        return self._start is not None and self.per_step is None

    def open(self) -> None:
        self._start = host_counters(self._batches, self._device)

    def leave_out(self) -> None:
        """From here to :meth:`take_back` is not counted (nothing happens if the window is not open)."""
        if self.is_open and self._left_at is None:
            self._left_at = host_counters(self._batches, self._device)

    def take_back(self, steps: int = 0) -> None:
        """Counting resumes; the stretch since :meth:`leave_out` held ``steps`` training steps."""
        if self._left_at is None:
            return
        now = host_counters(self._batches, self._device)
        for key, value in now.items():
            self._left_out[key] = self._left_out.get(key, 0.0) + value - self._left_at.get(key, value)
        self._steps_left_out += steps
        self._left_at = None

    def close(self, steps: int) -> None:
        """The window ends after ``steps`` training steps (those left out included)."""
        if not self.is_open:
            return
        self.take_back()  # a stretch still open at the end (the data ran out while profiling)
        end = host_counters(self._batches, self._device)
        counted = {key: value - self._left_out.get(key, 0.0) for key, value in end.items()}
        self.per_step = per_step(self._start, counted, steps=steps - self._steps_left_out)


def _thread_count() -> int:
    """OS threads of this process (Linux: ``/proc/self/task``; elsewhere Python's threads)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
