"""Where a training step's time goes: a ``torch.profiler`` window over a few steps, by kernel category.

:class:`StepProfiler` profiles the training steps ``first_step .. first_step + num_steps - 1``
(the loop's 1-based step numbers), then sorts every profiled event into one category by its name
(:data:`DEVICE_KERNEL_RULES`, :data:`CPU_OP_RULES`; the first rule that matches wins) and writes
``<rank dir>/profile.json``:

* per category: total ms, ms per step, share of the summed event time, event count;
* ``kernel_ms_per_step``: the summed event time per step; ``busy_ms_per_step``: the time per step
  when at least one event ran (kernels on several streams that overlap count once);
* ``wall_ms_per_step``: the window's wall time per step (synchronized with the device at both ends);
* ``idle_share``: ``1 - busy / wall`` (at least 0), the share of the window the device sat idle,
  waiting for the host;
* ``gemm_share``: ``(gemm_bf16 + gemm_fp8) / summed event time``, and
  ``amdahl_2x_gemm_ceiling = 1 / (1 - gemm_share + gemm_share / 2)``: the step's speed-up if every
  GEMM ran 2x faster and nothing else changed; ``amdahl_2x_gemm_ceiling_wall`` is the same with the
  GEMMs' share of the wall time (smaller when the device idles: GEMMs cannot shorten idle time);
* ``top_kernels``: the 15 event names with the most total time;
* ``comms``: the collectives' time per step by kind (all-to-all, all-reduce, other) and phase of the
  step (forward, backward, outside), and the part of it no other event overlapped (exposed)
  (:mod:`loka_job.training.comms_timeline`);
* ``host``: the host's side of the window, per step (:func:`host_work`): CUDA kernel launches,
  CUDA graph launches and operators dispatched: where two runs with the same kernels differ in idle
  time, this shows whether both replay CUDA graphs (a replaying step launches few kernels itself).

On CUDA the events are the device's kernels, copies and sets (activities CPU + CUDA). On a CPU
there are none: the operators (``aten::``, ``fbgemm::``, ``c10d::``, ``loka::`` ...) are classified
instead, each by its *self* time, so that the code path runs (and is tested) without a GPU. On a
CPU the GEMMs are fp32, and the quantization of the CPU backends runs as eager torch ops, which
land in ``other``.

Example (what :class:`~loka_job.training.trainer.Trainer` does with
``train.profile_start=100 train.profile_steps=5``)::

    profiler = StepProfiler(100, 5, device=device, out_dir="run/rank0")
    for step in range(1, steps + 1):
        profiler.before_step(step)
        train_one_step()
        profiler.after_step(step)      # True for the profiled steps 100..104
    report = profiler.finish()        # the dict written to run/rank0/profile.json
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Pattern, Sequence, Tuple

import torch
from torch.autograd import DeviceType

from loka_job.training.comms_timeline import PhaseRanges, comms_breakdown
from loka_job.training.host_sampler import HostSampler, format_host_report
from loka_torchrec.atomic_files import write_json_atomic, write_text_atomic

__all__ = [
    "CATEGORIES",
    "CPU_OP_RULES",
    "DEVICE_KERNEL_RULES",
    "GEMM_CATEGORIES",
    "ProfiledEvent",
    "StepProfiler",
    "amdahl_ceiling",
    "classify_cpu_op",
    "classify_kernel",
    "host_work",
    "profile_summary",
    "summarize_events",
]

logger = logging.getLogger("loka_job.train")

CATEGORIES = ("gemm_bf16", "gemm_fp8", "fp8_quantize", "attention", "embedding", "comms", "memcpy_memset", "other")
GEMM_CATEGORIES = ("gemm_bf16", "gemm_fp8")  # the dense GEMMs: what FP8 can make faster
TOP_KERNELS = 15
MAX_NAME_CHARS = 200  # kernel names of C++ templates run to thousands of characters

# This project's Triton kernels that quantize to FP8 (``@triton.jit`` in kernels/*.py; the FP8
# GEMM kernels of kernels/fp8_gemm.py are in gemm_fp8). The all-to-all codec's encode/decode
# quantize embeddings for the wire, so they count here too, not as communication.
PROJECT_QUANTIZE_KERNELS = (
    "_amax_tiles_kernel",
    "_quantize_tiles_kernel",
    "_quantize_rows_kernel",
    "_blocknorm_hardswish_quantize_kernel",
    "_encode_kernel",
    "_decode_kernel",
)
PROJECT_GEMM_KERNELS = ("_fp8_gemm_kernel", "_split_k_epilogue_kernel")


def _rule(category: str, pattern: str) -> Tuple[str, Pattern[str]]:
    return category, re.compile(pattern, re.IGNORECASE)


# Device kernel names -> category, in order: the first match wins (``re.search``, ignoring case).
DEVICE_KERNEL_RULES: Tuple[Tuple[str, Pattern[str]], ...] = (
    # Kineto's names for copies and sets: "Memcpy HtoD (Pageable -> Device)", "Memset (Device)".
    _rule("memcpy_memset", r"^(memcpy|memset)\b"),
    # NCCL: ncclDevKernel_AllToAll..., ncclKernel_AllReduce_RING_LL_Sum_float, ...
    _rule("comms", r"nccl"),
    # This project's quantization kernels, by exact name.
    _rule("fp8_quantize", r"^(" + "|".join(PROJECT_QUANTIZE_KERNELS) + r")\b"),
    # Inductor's generated pointwise and reduction kernels are named after the aten ops fused into
    # them ("triton_poi_fused__scaled_mm__to_copy_add_clamp_..."): never a GEMM, even when an op
    # feeding a GEMM is in the name. FP8 quantization where the name holds an amax, a scaled_mm
    # operand, or a clamp and a dtype cast (the saturating cast); everything else they do is other.
    _rule("fp8_quantize", r"^triton_(poi|red|per)_fused\w*(amax|_scaled_mm|clamp\w*_to_copy|_to_copy\w*clamp)"),
    _rule("other", r"^triton_(poi|red|per)_"),
    # Fused attention: flash_fwd_kernel, fmha_cutlassF_*, efficient_attention, cuDNN SDPA. Before
    # the GEMM rules (the names hold "cutlass"); not a dense GEMM that FP8 layers replace.
    _rule("attention", r"flash|fmha|attention|sdpa"),
    # FP8 GEMMs: cuBLAS nvjet kernels with two 8-bit operands ("nvjet_sm90_qqtst_..." is
    # torch._scaled_mm on the H100 with e4m3 operands; "qrtst" / "rqtst" pair e4m3 with e5m2, as
    # Transformer Engine's backward GEMMs do), cuBLAS/CUTLASS GEMMs on e4m3/e5m2, FBGEMM's f8f8bf16,
    # this project's Triton FP8 GEMM.
    _rule(
        "gemm_fp8",
        r"nvjet_(sm\d+_)?qq|[qr][qr]tst|gemm\w*(e4m3|e5m2)|(e4m3|e5m2)\w*gemm|f8f8|scaled_?mm|"
        + "|".join(PROJECT_GEMM_KERNELS),
    ),
    # Other libraries' FP8 quantization: FBGEMM's quantize_fp8_row / FP8rowwise, Transformer
    # Engine's cast_transpose / amax / compute_scale, MXFP8 casts.
    _rule("fp8_quantize", r"quantiz|cast_transpose|amax|compute_scale|fp8_?rowwise|float_to_fp8|fp8_to_float|hfp8|mxfp8"),
    # Every other GEMM (bf16, fp32, tf32, f64): cuBLAS (nvjet_*, sm90_xmma_gemm_*, ampere_*gemm*,
    # Kernel2, splitKreduce_kernel, gemv), CUTLASS. "fbgemm" is a library name, not a GEMM.
    _rule("gemm_bf16", r"(?<!fb)gemm|gemv|nvjet|xmma|cutlass|\bKernel2\b|cublas|splitKreduce"),
    # Embeddings and their input distribution: FBGEMM's TBE (split_embedding_*, bounds_check_*,
    # batch_index_select_*, linearize_index_*), its sparse-data kernels (fbgemm_gpu::permute_*,
    # jagged, bucketize, cumsum), torch's embedding kernels.
    _rule("embedding", r"embedding|bounds_check|batch_index_select|linearize_index|fbgemm_gpu|jagged|bucketize"),
)

# CPU operator names -> category (no device kernels: a CPU run). Same order and matching.
CPU_OP_RULES: Tuple[Tuple[str, Pattern[str]], ...] = (
    _rule("comms", r"^_?c10d(_functional)?::|^record_param_comms$|^gloo|nccl"),
    _rule("fp8_quantize", r"^loka::\w*quantiz|quantiz|fp8_?rowwise|float_to_fp8|fp8_to_float"),
    _rule("attention", r"scaled_dot_product|flash_attention|efficient_attention"),
    _rule("gemm_fp8", r"^aten::_scaled_(grouped_)?mm\w*$|^loka::fp8_gemm$|^fbgemm::f8f8"),
    _rule("gemm_bf16", r"^aten::(mm|addmm|_addmm_activation|bmm|baddbmm|addbmm|mv|addmv|dot|vdot)$"),
    _rule("embedding", r"^fbgemm::|^aten::_?embedding"),
)

# A CPU event is an operator when its name has a namespace ("aten::mm"), autograd's own events
# aside. Ranges that record_function opens are left out, except the collectives' own records
# (gloo runs its work inside "gloo:all_to_all"-style ranges, torch inside record_param_comms).
_CPU_OPERATOR = re.compile(r"^(?!autograd::|torch::autograd::)[A-Za-z_]\w*::")
_CPU_COMMS_RANGE = re.compile(r"^gloo:|^record_param_comms$")


def _classify(name: str, rules: Sequence[Tuple[str, Pattern[str]]]) -> str:
    for category, pattern in rules:
        if pattern.search(name):
            return category
    return "other"


def classify_kernel(name: str) -> str:
    """The category (one of :data:`CATEGORIES`) of a device kernel name (:data:`DEVICE_KERNEL_RULES`)."""
    return _classify(name, DEVICE_KERNEL_RULES)


def classify_cpu_op(name: str) -> str:
    """The category of a CPU operator name, e.g. ``aten::addmm`` (:data:`CPU_OP_RULES`)."""
    return _classify(name, CPU_OP_RULES)


def amdahl_ceiling(share: float, speedup: float = 2.0) -> float:
    """The whole's speed-up when a part taking ``share`` (0..1) of the time gets ``speedup`` x faster:
    ``1 / (1 - share + share / speedup)`` (Amdahl's law)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share: must be in [0, 1], got {share}")
    if speedup <= 0:
        raise ValueError(f"speedup: must be > 0, got {speedup}")
    return 1.0 / (1.0 - share + share / speedup)


class ProfiledEvent(NamedTuple):
    """One profiled kernel or operator (times in microseconds from the trace's start).

    ``self_us`` is the time the event counts for: a kernel's duration, an operator's self time
    (without the operators it called). ``phase``: the part of the training step that launched it
    (``forward``, ``backward`` or ``outside``; :class:`~loka_job.training.comms_timeline.PhaseRanges`)."""

    name: str
    start_us: float
    end_us: float
    self_us: float
    phase: str = "outside"
    kind: Optional[str] = None  # a collective's kind where its launch says it (comms_timeline.PhaseRanges.kind_of)


def _union_us(events: Iterable[ProfiledEvent]) -> float:
    """Time covered by at least one event (overlapping intervals count once), in microseconds."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted((e.start_us, e.end_us) for e in events):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def summarize_events(
    events: Sequence[ProfiledEvent],
    *,
    classify,
    num_steps: int,
    wall_ms: float,
    top: int = TOP_KERNELS,
) -> Dict[str, Any]:
    """The report of one profiled window (see the module docstring); times in ms.

    Args:
        events: the window's kernels (or CPU operators).
        classify: ``name -> category`` (:func:`classify_kernel` or :func:`classify_cpu_op`).
        num_steps: steps in the window (for the per-step times).
        wall_ms: the window's wall time.
        top: how many kernel names ``top_kernels`` lists.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
    by_category = {c: {"ms": 0.0, "count": 0} for c in CATEGORIES}
    by_name: Dict[str, Dict[str, Any]] = {}
    for event in events:
        category = classify(event.name)
        ms = event.self_us / 1e3
        by_category[category]["ms"] += ms
        by_category[category]["count"] += 1
        row = by_name.setdefault(event.name, {"category": category, "ms": 0.0, "calls": 0})
        row["ms"] += ms
        row["calls"] += 1
    total_ms = sum(c["ms"] for c in by_category.values())
    busy_ms = _union_us(events) / 1e3
    gemm_ms = sum(by_category[c]["ms"] for c in GEMM_CATEGORIES)
    gemm_share = _share(gemm_ms, total_ms)
    gemm_share_of_wall = min(1.0, _share(gemm_ms, wall_ms))
    categories = {
        c: {"ms": v["ms"], "ms_per_step": v["ms"] / num_steps, "share": _share(v["ms"], total_ms), "count": v["count"]}
        for c, v in by_category.items()
    }
    top_kernels = [
        {"name": name[:MAX_NAME_CHARS], "category": row["category"], "ms": row["ms"], "calls": row["calls"],
         "share": _share(row["ms"], total_ms)}
        for name, row in sorted(by_name.items(), key=lambda item: -item[1]["ms"])[:top]
    ]  # fmt: skip
    return {
        "num_steps": num_steps,
        "wall_ms_per_step": wall_ms / num_steps,
        "kernel_ms_per_step": total_ms / num_steps,
        "busy_ms_per_step": busy_ms / num_steps,
        "idle_share": max(0.0, 1.0 - _share(busy_ms, wall_ms)) if wall_ms > 0 else 0.0,
        "categories": categories,
        "gemm_share": gemm_share,
        "gemm_share_of_wall": gemm_share_of_wall,
        "amdahl_2x_gemm_ceiling": amdahl_ceiling(gemm_share),
        "amdahl_2x_gemm_ceiling_wall": amdahl_ceiling(gemm_share_of_wall),
        "top_kernels": top_kernels,
        "comms": comms_breakdown(events, is_collective=lambda name: classify(name) == "comms", num_steps=num_steps),
    }


SUMMARY_TOP_KERNELS = 8
"""How many of the report's ``top_kernels`` the run's summary keeps."""


def profile_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """The few numbers of a :func:`summarize_events` report that go into the run's summary."""
    keys = (
        "steps", "source", "file", "wall_ms_per_step", "kernel_ms_per_step", "busy_ms_per_step", "idle_share",
        "gemm_share", "gemm_share_of_wall", "amdahl_2x_gemm_ceiling", "amdahl_2x_gemm_ceiling_wall", "host", "comms",
    )  # fmt: skip
    out = {k: report[k] for k in keys if k in report}
    out["shares"] = {c: v["share"] for c, v in report["categories"].items()}
    out["top_kernels"] = [  # the largest few, per step, for the comparison tables
        {"name": k["name"], "category": k["category"], "ms_per_step": k["ms"] / report["num_steps"], "share": k["share"]}
        for k in report.get("top_kernels", [])[:SUMMARY_TOP_KERNELS]
    ]
    return out


# ------------------------------------------------------------------------------------ the profiler
def _is_annotation(event) -> bool:
    """A ``record_function`` range (on the GPU timeline too, as "gpu_user_annotation"), not work."""
    return bool(getattr(event, "is_user_annotation", False)) or "annotation" in str(getattr(event, "activity_type", "") or "")


def _phase_ranges(events) -> PhaseRanges:
    """The host-side ranges of a ``torch.profiler`` event list (the pipeline's forward and backward)."""
    return PhaseRanges(
        (e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CPU and _is_annotation(e)
    )


_RUNTIME_CALL = re.compile(r"^(cuda|cu)[A-Z]\w*$")  # cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch, cudaMemcpyAsync ...


def _launch_times(events) -> Tuple[Dict[int, float], Dict[int, float]]:
    """Host start times of the CUDA runtime/driver calls (by their CUPTI correlation id, which the
    kernel they launched shares as its own id) and of every host event (by id, which newer
    PyTorch names in a kernel's ``linked_correlation_id``)."""
    runtime, host = {}, {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        host[e.id] = e.time_range.start
        if _RUNTIME_CALL.match(e.name):
            runtime[e.id] = e.time_range.start
    return runtime, host


def _device_kernels(events) -> List[ProfiledEvent]:
    """The CUDA kernels, copies and sets of a ``torch.profiler`` event list, each with the phase of the
    host call that launched it: the runtime call with the kernel's correlation id, else the host
    event its ``linked_correlation_id`` names (where this PyTorch records it)."""
    phases = _phase_ranges(events)
    runtime, host = _launch_times(events)

    def launched_at(kernel) -> Optional[float]:
        if kernel.id in runtime:
            return runtime[kernel.id]
        return host.get(getattr(kernel, "linked_correlation_id", 0) or -1)

    out = []
    for e in events:
        if e.device_type == DeviceType.CUDA and not _is_annotation(e):
            launch = launched_at(e)
            out.append(ProfiledEvent(e.name, e.time_range.start, e.time_range.end, e.time_range.end - e.time_range.start,
                                     phases.phase_of(launch), phases.kind_of(launch)))  # fmt: skip
    return out


_KERNEL_LAUNCH = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|cudaLaunchCooperativeKernel)$")
_GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)$")


def host_work(names: Iterable[str], num_steps: int) -> Dict[str, float]:
    """Per step: the CUDA kernel launches (runtime and driver API), CUDA graph launches and
    operators (``aten::``, ``fbgemm::`` ...) among the host-side event ``names`` of a window."""
    if num_steps < 1:
        raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
    counts = {"kernel_launches": 0, "graph_launches": 0, "operators": 0}
    for name in names:
        if _KERNEL_LAUNCH.match(name):
            counts["kernel_launches"] += 1
        elif _GRAPH_LAUNCH.match(name):
            counts["graph_launches"] += 1
        elif _CPU_OPERATOR.search(name):
            counts["operators"] += 1
    return {f"{k}_per_step": v / num_steps for k, v in counts.items()}


def _cpu_operators(events) -> List[ProfiledEvent]:
    """The CPU operators of a ``torch.profiler`` event list, each with its self time and phase."""
    phases = _phase_ranges(events)
    return [
        ProfiledEvent(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total, phases.phase_of(e.time_range.start),
                      phases.kind_of(e.time_range.start))  # fmt: skip
        for e in events
        if e.device_type == DeviceType.CPU and not e.is_async and _is_cpu_operator(e)
    ]


def _is_cpu_operator(event) -> bool:
    if _CPU_COMMS_RANGE.search(event.name):
        return True
    return not _is_annotation(event) and bool(_CPU_OPERATOR.search(event.name))


class StepProfiler:
    """Profile training steps ``first_step .. first_step + num_steps - 1`` (1-based, as the loop counts).

    Call :meth:`before_step` with the number of the step about to run and :meth:`after_step`
    with the step that just ran (after the device finished it); the profiler starts before
    ``first_step`` and stops after the last step of the window, then writes
    ``<out_dir>/profile.json`` (and ``<out_dir>/profile_trace.json``, a Chrome trace, with
    ``export_trace``). A loop that starts past ``first_step`` (a resumed run) profiles nothing.

    Args:
        first_step: the first profiled step (>= 1).
        num_steps: how many steps (>= 1).
        device: the training device: CPU + CUDA activities and kernel categories on CUDA, CPU
            operators otherwise.
        out_dir: the rank's folder.
        export_trace: also write the Chrome trace (large: tens of MB per step on a GPU model).
        top: how many kernel names the report's ``top_kernels`` lists.
        host_stacks: also sample the training thread's Python stack over the window
            (:class:`~loka_job.training.host_sampler.HostSampler`): ``<out_dir>/host_stacks.txt``
            and the report's ``host_stacks``, where the host's time per step goes by function.
    """

    def __init__(
        self, first_step: int, num_steps: int, *, device: torch.device, out_dir: str, export_trace: bool = False,
        top: int = TOP_KERNELS, host_stacks: bool = False,
    ) -> None:
        if first_step < 1:
            raise ValueError(f"first_step: must be >= 1, got {first_step}")
        if num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
        self.first_step, self.num_steps = first_step, num_steps
        self.last_step = first_step + num_steps - 1
        self.device = torch.device(device)
        self.out_dir = out_dir
        self.export_trace = export_trace
        self.top = top
        self.report: Optional[Dict[str, Any]] = None
        self._profile = None
        self._sampler: Optional[HostSampler] = HostSampler() if host_stacks else None
        self._t0 = 0.0
        self._steps_done = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def running(self) -> bool:
        return self._profile is not None

    def before_step(self, step: int) -> None:
        """Start profiling if ``step`` (the step about to run) is the window's first."""
        if step != self.first_step or self.running or self.report is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profile = profile(activities=activities)
        self._sync()  # earlier steps' kernels stay out of the window
        self._profile.start()
        if self._sampler is not None:
            self._sampler.start()
        self._t0 = time.perf_counter()

    def covers(self, step: int) -> bool:
        """Whether ``step`` is in the profiled window (and the window has not ended early)."""
        return self.first_step <= step <= self.last_step and (self.running or self.report is None)

    def after_step(self, step: int) -> bool:
        """Note that ``step`` ran; stop after the window's last step. True when ``step`` was profiled."""
        if not self.running or not self.first_step <= step <= self.last_step:
            return False
        self._steps_done += 1
        if step == self.last_step:
            self.finish()
        return True

    def finish(self) -> Optional[Dict[str, Any]]:
        """Stop (if running, e.g. the data ran out inside the window), write and return the report.

        ``None`` when no step was profiled."""
        if not self.running:
            return self.report
        self._sync()
        wall_ms = 1e3 * (time.perf_counter() - self._t0)
        stacks = self._sampler.stop(max(1, self._steps_done)) if self._sampler is not None else None
        self._profile.stop()
        prof, self._profile = self._profile, None
        if self._steps_done == 0:
            return None
        events = prof.events()
        host = host_work((e.name for e in events if e.device_type == DeviceType.CPU), self._steps_done)
        if self.cuda:
            report = summarize_events(_device_kernels(events), classify=classify_kernel, num_steps=self._steps_done, wall_ms=wall_ms,
                                      top=self.top)
            source = "cuda kernels"
        else:
            report = summarize_events(_cpu_operators(events), classify=classify_cpu_op, num_steps=self._steps_done, wall_ms=wall_ms,
                                      top=self.top)
            source = "cpu operators (self time)"
        path = os.path.join(self.out_dir, "profile.json")
        self.report = {
            "steps": [self.first_step, self.first_step + self._steps_done - 1],
            "source": source,
            "device": str(self.device),
            "file": path,
            **report,
            "host": host,
            "rules": {
                "device_kernels": [[c, p.pattern] for c, p in DEVICE_KERNEL_RULES],
                "cpu_operators": [[c, p.pattern] for c, p in CPU_OP_RULES],
            },
        }
        if self.export_trace:
            self.report["trace"] = self._export_trace(prof)
        if stacks is not None:
            stacks_path = os.path.join(self.out_dir, "host_stacks.txt")
            write_text_atomic(stacks_path, format_host_report(stacks))
            self.report["host_stacks"] = {"file": stacks_path, **stacks}
        write_json_atomic(path, self.report)
        logger.info(
            "profile of steps %d..%d: %.2f ms/step of %s in %.2f ms/step wall, GEMMs %.1f%%, idle %.1f%%, "
            "2x-GEMM ceiling %.3fx -> %s",
            *self.report["steps"], report["kernel_ms_per_step"], source, report["wall_ms_per_step"],
            100 * report["gemm_share"], 100 * report["idle_share"], report["amdahl_2x_gemm_ceiling"], path,
        )  # fmt: skip
        return self.report

    def _export_trace(self, prof) -> str:
        """The Chrome trace, written to a temporary name and renamed (a reader never sees half of it)."""
        path = os.path.join(self.out_dir, "profile_trace.json")
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            prof.export_chrome_trace(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
