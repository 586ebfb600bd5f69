"""Where the training thread's host time goes, by Python function, over a few steps.

A step bound by the host (the GPU idles between kernels) gets slower with any Python work added
to it, and ``torch.profiler`` shows operators, not the Python code between them. This sampler
reads the training thread's stack from another thread every ``interval`` seconds
(``sys._current_frames``) and counts, per function, the samples it was on the stack
(inclusive) and on top of it (self). Time in C++ (a CUDA graph replay, a wait for the device)
counts for the Python function that called it.

A sampler does not change what it measures the way a tracing profiler does: ``cProfile`` and
``sys.setprofile`` hook every call, which also changes how ``torch.compile``'d code runs.
Only the training thread is sampled: autograd's backward thread is not. The sampler needs the
GIL to read a stack, and a thread running Python gives it up only every ``sys.getswitchinterval()``
(5 ms by default): while sampling, the switch interval is lowered to ``interval`` (restored at
:meth:`HostSampler.stop`), which makes the sampled steps somewhat slower; they are profiled steps,
which the job does not time anyway.

Example::

    >>> import time
    >>> sampler = HostSampler(interval=0.001)
    >>> sampler.start()
    >>> end = time.perf_counter() + 0.05
    >>> while time.perf_counter() < end:
    ...     pass
    >>> report = sampler.stop(num_steps=1)
    >>> report["samples"] > 0
    True
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any, Counter, Dict, List, Optional

__all__ = ["HostSampler", "format_host_report"]

TOP = 60


def _where(code) -> str:
    """``path:first line function``; the path from site-packages or the project's packages on,
    and Inductor's generated modules (a hashed path per run) under one name."""
    path = code.co_filename
    if "torchinductor" in path:
        return f"<inductor-generated code> {code.co_name}"
    for marker in ("site-packages" + os.sep, "loka_torchrec" + os.sep, "loka_job" + os.sep):
        if marker in path:
            path = path[path.index(marker):]
            break
    return f"{path}:{code.co_firstlineno} {code.co_name}"


class HostSampler:
    """Samples one thread's Python stack until :meth:`stop`.

    Args:
        interval: seconds between samples (> 0).
        thread_id: the thread to sample (default: the one that calls :meth:`start`).
    """

    def __init__(self, interval: float = 0.0005, thread_id: Optional[int] = None) -> None:
        if not interval > 0:
            raise ValueError(f"interval: expected seconds > 0, got {interval!r}")
        self.interval = interval
        self.thread_id = thread_id
        self._inclusive: Counter[str] = collections.Counter()
        self._self: Counter[str] = collections.Counter()
        self._samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._switch_interval = 0.0
        self._t0 = 0.0

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self.running:
            raise RuntimeError("HostSampler.start: already running")
        if self.thread_id is None:
            self.thread_id = threading.get_ident()
        self._stop.clear()
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, self.interval))
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="loka-host-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            self._samples += 1
            self._self[_where(frame.f_code)] += 1
            seen = set()
            while frame is not None:
                key = _where(frame.f_code)
                if key not in seen:  # a recursive function counts once per sample
                    seen.add(key)
                    self._inclusive[key] += 1
                frame = frame.f_back

    def stop(self, num_steps: int, top: int = TOP) -> Dict[str, Any]:
        """Stop and report: per function, milliseconds per step on the stack and on top of it
        (samples x the wall time per sample, over ``num_steps`` steps), the ``top`` of each."""
        if not self.running:
            raise RuntimeError("HostSampler.stop: not running")
        if num_steps < 1:
            raise ValueError(f"num_steps: expected >= 1, got {num_steps}")
        self._stop.set()
        self._thread.join()
        self._thread = None
        sys.setswitchinterval(self._switch_interval)
        wall_ms = 1e3 * (time.perf_counter() - self._t0)
        per_sample = wall_ms / self._samples if self._samples else 0.0

        def rows(counter: Counter[str]) -> List[Dict[str, Any]]:
            return [{"function": k, "ms_per_step": n * per_sample / num_steps, "share": n / self._samples}
                    for k, n in counter.most_common(top)]  # fmt: skip

        return {
            "samples": self._samples,
            "interval_ms": 1e3 * self.interval,
            "wall_ms_per_step": wall_ms / num_steps,
            "num_steps": num_steps,
            "inclusive": rows(self._inclusive),
            "self": rows(self._self),
        }


def format_host_report(report: Dict[str, Any]) -> str:
    """The report as text: the functions by time on the stack, then by time on top of it."""
    lines = [
        f"host stack samples of the training thread: {report['samples']} over {report['num_steps']} step(s), "
        f"{report['wall_ms_per_step']:.2f} ms/step wall, a sample every {report['interval_ms']:.2f} ms",
    ]
    for kind, title in (("inclusive", "on the stack (inclusive)"), ("self", "on top of the stack (self)")):
        lines += ["", f"ms/step  share  {title}"]
        lines += [f"{r['ms_per_step']:7.3f}  {100 * r['share']:5.1f}%  {r['function']}" for r in report[kind]]
    return "\n".join(lines) + "\n"
