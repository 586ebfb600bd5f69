"""``loka_job.training.profiling``: kernel categories, the Amdahl ceiling, and a profiled training job."""

import glob
import json
import os
import re

import pytest
import torch

from loka_job.training.profiling import (
    CATEGORIES,
    ProfiledEvent,
    StepProfiler,
    amdahl_ceiling,
    classify_cpu_op,
    classify_kernel,
    host_work,
    profile_summary,
    summarize_events,
)
from loka_job.training.trainer import TrainConfig
from multirank import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Names as the H100 printed them (benchmarks/results/H100/2026-11-22-profile-step.txt, cut at 55
# characters by the profiler's table), then names of other libraries' kernels.
@pytest.mark.parametrize(
    "name, category",
    [
        ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_...", "gemm_fp8"),
        ("nvjet_sm90_qqtst_64x128_128x8_2x1_v_bz_algo2_TNN", "gemm_fp8"),
        ("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", "gemm_fp8"),  # e4m3 x e5m2 (TE's backward)
        ("nvjet_sm90_tst_64x64_64x13_1x1_v_bz_TNT", "gemm_bf16"),
        ("_fp8_gemm_kernel", "gemm_fp8"),
        ("_amax_tiles_kernel", "fp8_quantize"),
        ("_quantize_tiles_kernel", "fp8_quantize"),
        ("sm90_xmma_gemm_f64f64_f64f64_f64_nt_n_tilesize64x64x...", "gemm_bf16"),
        ("void at::native::reduce_kernel<512, 1, at::native::R...", "other"),
        ("void at::native::unrolled_elementwise_kernel<at::nat...", "other"),
        ("void at::native::vectorized_elementwise_kernel<4, at...", "other"),
        ("void at::native::elementwise_kernel<128, 4, at::nati...", "other"),
        # cuBLAS / CUTLASS bf16 GEMMs
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm_bf16"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm_bf16"),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "gemm_bf16"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "gemm_bf16"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)", "gemm_bf16"),
        # other libraries' FP8 GEMMs and quantization
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm_fp8"),
        ("cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_bf16_bf16_128x128x128_1x1x1_0_tnn_align16", "gemm_fp8"),
        ("void fbgemm_gpu::f8f8bf16_rowwise_impl<128, 128, 128>(...)", "gemm_fp8"),
        ("_kernel_quantize_fp8_row", "fp8_quantize"),
        ("void transformer_engine::cast_transpose_kernel<8, true, __nv_bfloat16, __nv_fp8_e4m3>(...)", "fp8_quantize"),
        # embeddings (FBGEMM TBE and TorchRec's input distribution)
        ("void split_embedding_codegen_forward_unweighted_kernel<__nv_bfloat16, float, 8, 32>(...)", "embedding"),
        ("void fbgemm_gpu::bounds_check_indices_kernel_v2<long, false>(...)", "embedding"),
        ("void fbgemm_gpu::_block_bucketize_sparse_features_cuda_kernel2<false, int, long>(...)", "embedding"),
        ("void fbgemm_gpu::permute_2D_data_kernel<true, int, float>(...)", "embedding"),
        ("void at::native::embedding_backward_feature_kernel<float, float, long>(...)", "embedding"),
        # communication, copies, attention
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "comms"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWork)", "comms"),
        ("Memcpy HtoD (Pageable -> Device)", "memcpy_memset"),
        ("Memset (Device)", "memcpy_memset"),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(...)", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(...)", "attention"),
        # Inductor's generated kernels (names from a compiled LoKA step on the H100)
        ("triton_poi_fused__scaled_mm__to_copy_add_clamp_clone_mul_sub_t_view_15", "fp8_quantize"),
        ("triton_red_fused__unsafe_view_abs_amax_clone_transpose_view_13", "fp8_quantize"),
        ("triton_poi_fused__to_copy_add_clamp_mul_sub_3", "fp8_quantize"),
        ("triton_red_fused__to_copy_add_div_expand_mul_pow_sum_transpose_view_35", "other"),
        ("triton_poi_fused__unsafe_view_cat_clone_transpose_view_20", "other"),
        ("triton_per_fused_add_gemm_mean_mul_4", "other"),
    ],
)
def test_device_kernel_categories(name, category):
    assert classify_kernel(name) == category


def _project_triton_kernels():
    """``(module, name)`` of every ``@triton.jit`` function in kernels/*.py named ``*_kernel``."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "kernels", "*.py"))):
        text = open(path).read()
        for name in re.findall(r"@triton\.jit\s*\n\s*def (\w+_kernel)\(", text):
            found.append((os.path.basename(path), name))
    return found


def test_every_project_triton_kernel_has_its_category():
    kernels = _project_triton_kernels()
    assert len(kernels) >= 7  # fp8_quantize x3, blocknorm, fp8_gemm x2, comm codec x2
    for module, name in kernels:
        expected = "gemm_fp8" if module == "fp8_gemm.py" else "fp8_quantize"
        assert classify_kernel(name) == expected, (module, name)


@pytest.mark.parametrize(
    "name, category",
    [
        ("aten::mm", "gemm_bf16"),
        ("aten::addmm", "gemm_bf16"),
        ("aten::bmm", "gemm_bf16"),
        ("aten::_scaled_mm", "gemm_fp8"),
        ("loka::fp8_gemm", "gemm_fp8"),
        ("loka::fp8_quantize", "fp8_quantize"),
        ("loka::blocknorm_hardswish_quantize", "fp8_quantize"),
        ("fbgemm::split_embedding_codegen_lookup_rowwise_adagrad_function_cpu", "embedding"),
        ("fbgemm::permute_2D_sparse_data", "embedding"),
        ("aten::embedding_bag", "embedding"),
        ("c10d::alltoall_base_", "comms"),
        ("record_param_comms", "comms"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::linear", "other"),  # composite: its addmm child is the GEMM
        ("aten::copy_", "other"),
        ("aten::amax", "other"),
    ],
)
def test_cpu_operator_categories(name, category):
    assert classify_cpu_op(name) == category


def test_amdahl_ceiling():
    assert amdahl_ceiling(0.0) == 1.0
    assert amdahl_ceiling(1.0) == 2.0
    assert amdahl_ceiling(0.5) == pytest.approx(1 / 0.75)
    assert amdahl_ceiling(0.3, speedup=4.0) == pytest.approx(1 / (0.7 + 0.075))
    with pytest.raises(ValueError, match="share"):
        amdahl_ceiling(1.5)


def test_summarize_events_shares_busy_time_and_ceiling():
    # two steps in 10 ms of wall time; a comms kernel overlaps the first GEMM by 1 ms
    events = [
        ProfiledEvent("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 0, 2000, 2000),
        ProfiledEvent("ncclDevKernel_SendRecv", 1000, 2000, 1000),
        ProfiledEvent("nvjet_sm90_qqtst_64x128_128x8_2x1_v_bz_algo2_TNN", 3000, 4000, 1000),
        ProfiledEvent("_amax_tiles_kernel", 4000, 4500, 500),
        ProfiledEvent("split_embedding_codegen_forward_unweighted_kernel", 5000, 5500, 500),
        ProfiledEvent("void at::native::vectorized_elementwise_kernel<4>", 6000, 7000, 1000),
    ]
    report = summarize_events(events, classify=classify_kernel, num_steps=2, wall_ms=10.0)
    cats = report["categories"]
    assert set(cats) == set(CATEGORIES)
    assert cats["gemm_bf16"]["ms"] == 2.0 and cats["gemm_fp8"]["ms"] == 1.0 and cats["comms"]["ms"] == 1.0
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(report["kernel_ms_per_step"] * 2) == 6.0
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert report["busy_ms_per_step"] == pytest.approx(2.5)  # 5 ms covered: the overlap counts once
    assert report["wall_ms_per_step"] == 5.0 and report["idle_share"] == pytest.approx(0.5)
    assert report["gemm_share"] == pytest.approx(0.5)
    assert report["amdahl_2x_gemm_ceiling"] == pytest.approx(1 / 0.75)
    assert report["gemm_share_of_wall"] == pytest.approx(0.3)
    assert report["amdahl_2x_gemm_ceiling_wall"] == pytest.approx(1 / 0.85)
    top = report["top_kernels"]
    assert top[0]["name"].startswith("nvjet_tst") and top[0]["ms"] == 2.0 and top[0]["calls"] == 1
    assert [t["ms"] for t in top] == sorted((t["ms"] for t in top), reverse=True)
    # no events: zero shares, ceiling 1, all idle
    empty = summarize_events([], classify=classify_kernel, num_steps=1, wall_ms=3.0)
    assert empty["gemm_share"] == 0.0 and empty["amdahl_2x_gemm_ceiling"] == 1.0 and empty["idle_share"] == 1.0


def test_event_filters_keep_work_and_drop_annotations():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from loka_job.training.profiling import _cpu_operators, _device_kernels

    def event(name, device, activity, annotation=False, start=0.0, end=10.0, self_us=4.0):
        return SimpleNamespace(name=name, device_type=device, activity_type=activity, is_user_annotation=annotation, id=0,
                               is_async=False, time_range=SimpleNamespace(start=start, end=end), self_cpu_time_total=self_us)  # fmt: skip

    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [
        event("nvjet_sm90_qqtst_64x128", cuda, "kernel", start=2.0, end=5.0),
        event("Memcpy HtoD (Pageable -> Device)", cuda, "gpu_memcpy"),
        event("## forward ##", cuda, "gpu_user_annotation", annotation=True),  # a range, not work
        event("aten::mm", cpu, "cpu_op"),
        event("autograd::engine::evaluate_function: MmBackward0", cpu, "cpu_op"),
        event("## sdd_input_dist ##", cpu, "user_annotation", annotation=True),
        event("gloo:all_to_all", cpu, "user_annotation", annotation=True),  # the collective's work
        event("cudaLaunchKernel", cpu, "cuda_runtime"),
    ]
    kernels = _device_kernels(events)
    assert [k.name for k in kernels] == ["nvjet_sm90_qqtst_64x128", "Memcpy HtoD (Pageable -> Device)"]
    assert kernels[0].self_us == 3.0  # a kernel counts its duration
    ops = _cpu_operators(events)
    assert [o.name for o in ops] == ["aten::mm", "gloo:all_to_all"] and ops[0].self_us == 4.0
    assert classify_cpu_op("gloo:all_to_all") == "comms"


def test_step_profiler_profiles_exactly_its_window_on_cpu(tmp_path):
    layer = torch.nn.Linear(32, 32)
    profiler = StepProfiler(3, 2, device=torch.device("cpu"), out_dir=str(tmp_path), export_trace=True)
    profiled = []
    for step in range(1, 7):
        profiler.before_step(step)
        layer(torch.randn(16, 32)).sum().backward()
        profiled.append(profiler.after_step(step))
    assert profiled == [False, False, True, True, False, False]
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["steps"] == [3, 4] and report["num_steps"] == 2 and report["source"].startswith("cpu")
    assert report["categories"]["gemm_bf16"]["count"] >= 2  # the forward addmm of each step, at least
    total = sum(c["ms"] for c in report["categories"].values())
    assert total == pytest.approx(report["kernel_ms_per_step"] * 2)
    assert 0.0 <= report["idle_share"] <= 1.0 and 1.0 <= report["amdahl_2x_gemm_ceiling"] <= 2.0
    assert (tmp_path / "profile_trace.json").stat().st_size > 0 and report["trace"].endswith("profile_trace.json")
    assert profiler.finish() is profiler.report  # finishing again changes nothing
    # The host's side: on a CPU no launches, and per step at least the forward's addmm and the backward's mm.
    host = report["host"]
    assert host["kernel_launches_per_step"] == 0 and host["graph_launches_per_step"] == 0
    assert host["operators_per_step"] >= 2
    summary = profile_summary(report)
    assert set(summary["shares"]) == set(CATEGORIES) and summary["file"].endswith("profile.json")
    top = summary["top_kernels"]
    assert 0 < len(top) <= 8 and top[0]["name"] == report["top_kernels"][0]["name"]
    assert top[0]["ms_per_step"] == pytest.approx(report["top_kernels"][0]["ms"] / report["num_steps"])


def test_host_work_counts_launches_graph_replays_and_operators_per_step():
    names = ["cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch", "aten::mm", "aten::add_", "fbgemm::jagged",
             "cudaMemcpyAsync", "autograd::engine::evaluate_function: MmBackward0", "ProfilerStep#3"]  # fmt: skip
    assert host_work(names * 2, 2) == {"kernel_launches_per_step": 2.0, "graph_launches_per_step": 1.0, "operators_per_step": 3.0}
    with pytest.raises(ValueError, match="num_steps"):
        host_work(names, 0)


def test_step_profiler_window_cut_short_and_never_reached(tmp_path):
    cut = StepProfiler(2, 5, device=torch.device("cpu"), out_dir=str(tmp_path / "cut"))
    for step in (1, 2, 3):  # the data runs out after step 3
        cut.before_step(step)
        torch.randn(8, 8) @ torch.randn(8, 8)
        cut.after_step(step)
    assert cut.finish()["steps"] == [2, 3]
    late = StepProfiler(2, 2, device=torch.device("cpu"), out_dir=str(tmp_path / "late"))
    for step in (5, 6):  # a resumed run that starts past the window
        late.before_step(step)
        late.after_step(step)
    assert late.finish() is None and not (tmp_path / "late").exists()


def test_train_config_validates_the_profile_window():
    assert TrainConfig(steps=10, profile_start=6, profile_steps=5).profile_start == 6  # steps 6..10
    with pytest.raises(ValueError, match="train.profile_start"):
        TrainConfig(steps=10, profile_start=-1)
    with pytest.raises(ValueError, match="train.profile_steps"):
        TrainConfig(steps=10, profile_start=2, profile_steps=0)
    with pytest.raises(ValueError, match="train.profile_start \\+ train.profile_steps"):
        TrainConfig(steps=10, profile_start=7, profile_steps=5)
    assert TrainConfig(steps=3).profile_start == 0  # off: the default window does not have to fit


@pytest.mark.slow
def test_training_job_writes_its_profile(tmp_path):
    """One process on the CPU (forked from the tests' forkserver: tests/multirank.run_job), 6 steps
    with every GEMM in FP8; steps 3 and 4 profiled, not timed."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, LOKA_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        env.pop(var, None)
    command = [
        "-m", "loka_job.train", "device=cpu", "data.num_tables=4", "data.num_embeddings=1000",
        "data.embedding_dim=32", "model.dense_arch_layer_sizes=[64,32]", "model.over_arch_layer_sizes=[64,32,1]",
        "data.batch_size=128", "data.eval_batches=2", "train.progress_bar=false", "train.log_every=2",
        "train.steps=6", "train.profile_start=3", "train.profile_steps=2", "loka.dispatch.mode=all:scaled_mm:rowwise",
    ]  # fmt: skip
    proc = run_job(command, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "rank0" / "profile.json").read_text())
    assert report["steps"] == [3, 4]
    total = sum(c["ms"] for c in report["categories"].values())
    assert total == pytest.approx(report["kernel_ms_per_step"] * report["num_steps"])
    assert report["categories"]["gemm_fp8"]["ms"] > 0 and report["categories"]["embedding"]["ms"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    profile = summary["profile"]
    assert profile["steps"] == [3, 4] and sum(profile["shares"].values()) == pytest.approx(1.0)
    assert profile["amdahl_2x_gemm_ceiling"] == pytest.approx(amdahl_ceiling(profile["gemm_share"]))
    assert summary["timed_steps"] == 3  # steps 1..6 without the profiled 3, 4 and the warm-up step 1
    assert "profile          steps 3..4" in proc.stdout
