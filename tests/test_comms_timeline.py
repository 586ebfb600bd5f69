"""``loka_job.training.comms_timeline`` and the profiler's collectives: kind, phase, exposed time."""

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from loka_job.training.comms_timeline import KINDS, PHASES, PhaseRanges, collective_kind, comms_breakdown
from loka_job.training.profiling import ProfiledEvent, _cpu_operators, _device_kernels, classify_kernel


@pytest.mark.parametrize(
    "name, kind",
    [
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all_to_all"),  # NCCL's all_to_all
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "other"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(...)", "other"),
        ("gloo:all_to_all", "all_to_all"),
        ("c10d::alltoall_base_", "all_to_all"),
        ("c10d::allreduce_", "all_reduce"),
        ("gloo:all_reduce", "all_reduce"),
    ],
)
def test_collective_kind(name, kind):
    assert collective_kind(name) == kind


def test_phase_ranges_take_the_pipelines_forward_and_backward():
    ranges = PhaseRanges([
        ("## forward 3 ##", 0.0, 10.0), ("## backward 3 ##", 20.0, 30.0), ("## optimizer 3 ##", 30.5, 40.0),
        ("## forward ##", 50.0, 60.0), ("## start_sparse_data_dist 4 ##", 12.0, 18.0), ("ProfilerStep#3", 0.0, 70.0),
    ])  # fmt: skip
    assert ranges
    assert [ranges.phase_of(t) for t in (5.0, 10.0, 15.0, 25.0, 35.0, 55.0, 65.0, None)] == [
        "forward", "forward", "outside", "backward", "outside", "forward", "outside", "outside"
    ]  # fmt: skip
    assert not PhaseRanges([("## optimizer ##", 0.0, 1.0)])  # no step ranges: everything is outside


def _ev(name, start, end, phase="outside"):
    return ProfiledEvent(name, start, end, end - start, phase)


def test_comms_breakdown_splits_by_kind_and_phase_and_counts_only_uncovered_time_as_exposed():
    events = [
        _ev("gemm", 0.0, 10.0),
        _ev("ncclDevKernel_SendRecv", 5.0, 15.0, "forward"),  # 5 us beside the GEMM, 5 alone
        _ev("ncclDevKernel_AllReduce_Sum_f32", 20.0, 30.0, "backward"),
        _ev("elementwise", 22.0, 25.0),  # covers 3 us of the all-reduce
        _ev("ncclDevKernel_SendRecv", 28.0, 32.0, "outside"),  # overlaps the all-reduce: counted once in "all"
        _ev("ncclDevKernel_AllGather", 40.0, 41.0, "backward"),
    ]
    out = comms_breakdown(events, is_collective=lambda n: classify_kernel(n) == "comms", num_steps=2)
    per = out["ms_per_step"]
    assert set(per) == set(KINDS) and all(set(v) == set(PHASES) for v in per.values())
    assert per["all_to_all"] == pytest.approx({"forward": 0.005, "backward": 0.0, "outside": 0.002})
    assert per["all_reduce"] == pytest.approx({"forward": 0.0, "backward": 0.005, "outside": 0.0})
    assert per["other"]["backward"] == pytest.approx(0.0005)
    assert out["total_ms_per_step"] == pytest.approx((10 + 10 + 4 + 1) / 2 / 1e3)
    exposed = out["exposed_ms_per_step"]
    assert exposed["all_to_all"] == pytest.approx((5 + 4) / 2 / 1e3)  # [10, 15] and [28, 32]
    assert exposed["all_reduce"] == pytest.approx(7 / 2 / 1e3)  # [20, 30] less [22, 25]
    assert exposed["other"] == pytest.approx(0.5 / 1e3)
    assert exposed["all"] == pytest.approx((5 + 9 + 1) / 2 / 1e3)  # [10, 15], [20, 32] less [22, 25], [40, 41]
    with pytest.raises(ValueError, match="num_steps"):
        comms_breakdown(events, is_collective=lambda n: True, num_steps=0)


def _event(name, device, start, end, *, id=0, linked=0, annotation=False, activity="kernel"):
    return SimpleNamespace(name=name, device_type=device, activity_type=activity, is_user_annotation=annotation, id=id,
                           linked_correlation_id=linked, is_async=False, time_range=SimpleNamespace(start=start, end=end),
                           self_cpu_time_total=end - start)  # fmt: skip


def test_a_kernel_takes_the_phase_of_the_host_call_that_launched_it():
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        _event("## forward 7 ##", cpu, 0.0, 100.0, id=1, annotation=True, activity="user_annotation"),
        _event("## backward 7 ##", cpu, 200.0, 300.0, id=2, annotation=True, activity="user_annotation"),
        # the runtime call shares its CUPTI correlation id with the kernel it launched
        _event("cuLaunchKernelEx", cpu, 50.0, 51.0, id=901, activity="cuda_driver"),
        _event("ncclDevKernel_SendRecv", cuda, 400.0, 410.0, id=901),  # runs late; launched in the forward
        _event("cudaLaunchKernel", cpu, 250.0, 251.0, id=902, activity="cuda_runtime"),
        _event("ncclDevKernel_AllReduce_Sum_f32", cuda, 420.0, 430.0, id=902),
        # where PyTorch links a kernel to the host event that launched it instead
        _event("c10d::alltoall_base_", cpu, 210.0, 215.0, id=55, activity="cpu_op"),
        _event("ncclDevKernel_SendRecv", cuda, 440.0, 445.0, id=903, linked=55),
        _event("ncclDevKernel_SendRecv", cuda, 450.0, 455.0, id=904),  # nothing names its launch
    ]
    phases = [k.phase for k in _device_kernels(events)]
    assert phases == ["forward", "backward", "backward", "outside"]
    ops = _cpu_operators(events)  # on a CPU run an operator's own start decides
    assert [(o.name, o.phase) for o in ops] == [("c10d::alltoall_base_", "backward")]
