"""What the host did over the timed window, per step: waiting for batches, CPU time of the
training thread and of the whole process, the training thread's context switches, Python's
garbage collections, and the CUDA allocator going to the driver.

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

__all__ = ["TimedBatches", "host_counters", "per_step"]


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


def _thread_count() -> int:
    """OS threads of this process (Linux: ``/proc/self/task``; elsewhere Python's threads)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
