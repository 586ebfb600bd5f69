"""``loka_torchrec.inference``: the serving form of a trained model, its numerics, and its export."""

import copy
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec import DispatchConfig
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.evidence import BF16, KernelChoice
from loka_torchrec.fp8.error_metrics import sqnr_db
from loka_torchrec.inference import Fp8InferenceLinear, export_program, inference_modules
from blocked_imports import blocking_folder
from test_plain_modules import Tower


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", [(48, 64), (10, 37)])  # aligned, and K, N padded to 16
def test_an_fp8_layer_against_float64_within_the_formats_error(granularity, shape):
    torch.manual_seed(0)
    out_features, in_features = shape
    weight, bias, x = torch.randn(out_features, in_features), torch.randn(out_features), torch.randn(3, 5, in_features)
    layer = Fp8InferenceLinear(weight, bias, granularity)
    assert layer.weight_fp8.shape == (-(-out_features // 16) * 16, -(-in_features // 16) * 16)
    y = layer(x)
    ref = x.double() @ weight.double().t() + bias.double()
    assert y.shape == (3, 5, out_features) and y.dtype == torch.float32
    # both operands E4M3 (3 mantissa bits: relative rounding up to 2^-4 each): about 30 dB; 25 dB is the bound
    assert sqnr_db(y.double() - bias.double(), ref - bias.double()) >= 25.0
    with pytest.raises(ValueError, match="granularity: expected tensorwise or rowwise"):
        Fp8InferenceLinear(weight, bias, "blockwise")


def test_a_nonfinite_input_row_gives_nan_never_a_finite_value():
    layer = Fp8InferenceLinear(torch.randn(16, 16), None, "rowwise")
    x = torch.randn(2, 16)
    x[1, 3] = float("inf")
    y = layer(x)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


def _trained_tower(plan_mode="all:scaled_mm:rowwise"):
    torch.manual_seed(0)
    model = Tower()
    loka_torchrec.apply(model, DispatchConfig(mode=plan_mode))
    return model


def test_an_fp8_layer_quantizes_as_the_trained_layer_did():
    """The same codes and scales as the trained LokaLinear's forward (current scaling), so the same output."""
    model = _trained_tower()
    layer, h = model.mlp[0], torch.randn(20, 16)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(Fp8InferenceLinear(layer.weight, layer.bias, "rowwise")(h), layer(h), rtol=0, atol=1e-6)


def test_the_serving_model_runs_what_training_ran_in_fp8_and_the_rest_plain():
    model = _trained_tower()
    model.mlp[2].set_kernels(LayerKernels.uniform(BF16))  # e.g. sent back to bf16 by the safety valve
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    report = inference_modules(model)
    assert report.fp8 == {"mlp.0": "rowwise"}
    assert set(report.high_precision) == {"mlp.2", "attn.out_proj"}
    assert "runs in high precision" in report.high_precision["mlp.2"]
    assert "reads its weight directly" in report.high_precision["attn.out_proj"]
    assert report.summary() == "1/3 linear layers in FP8 for inference, 2 in high precision"
    assert isinstance(model.mlp[0], Fp8InferenceLinear) and type(model.mlp[2]) is nn.Linear and not model.training
    # The serving model is the plain model (its raw-Parameter GEMMs and attention run their own forward,
    # in the caller's precision) with mlp.0 in FP8: built that way by hand, it computes the same.
    expected = Tower().eval()
    expected.load_state_dict(params)
    expected.mlp[0] = Fp8InferenceLinear(expected.mlp[0].weight, expected.mlp[0].bias, "rowwise")
    x = torch.randn(4, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected(x), rtol=0, atol=0)


def test_blockwise_layers_stay_high_precision_with_the_reason_and_bad_input_is_refused():
    model = _trained_tower()
    model.mlp[0].set_kernels(LayerKernels.uniform(KernelChoice("emulated", "blockwise")))
    report = inference_modules(model)
    assert "torch._scaled_mm takes tensorwise or rowwise scales only" in report.high_precision["mlp.0"]
    with pytest.raises(TypeError, match="model: expected the module holding the LoKA layers, got int"):
        inference_modules(3)
    with pytest.raises(TypeError, match="got LokaLinear"):
        inference_modules(_trained_tower().mlp[0])
    with pytest.raises(ValueError, match="weight: expected \\(out_features, in_features\\)"):
        Fp8InferenceLinear(torch.randn(4), None, "rowwise")


def test_the_exported_program_loads_and_runs_where_this_project_cannot_be_imported(tmp_path):
    """torch.export of the serving model, loaded by a process in which importing loka_torchrec or
    loka_job fails; its output equals the serving model's for another batch size."""
    model = _trained_tower("all:scaled_mm:tensorwise")
    inference_modules(model)
    path = str(tmp_path / "tower.pt2")
    export_program(model, (torch.randn(4, 5, 8),), path)
    x = torch.randn(7, 5, 8)
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        torch.save(model(x), tmp_path / "y.pt")
    blocker = blocking_folder(tmp_path, ("loka_torchrec", "loka_job"))
    script = textwrap.dedent(f"""
        import sys, torch
        program = torch.export.load({path!r})
        y = program.module()(torch.load({str(tmp_path / "x.pt")!r}))
        assert torch.equal(y, torch.load({str(tmp_path / "y.pt")!r})), (y - torch.load({str(tmp_path / "y.pt")!r})).abs().max()
        assert not [m for m in sys.modules if m.startswith(("loka_torchrec", "loka_job"))]
        print("ok", tuple(y.shape))
    """)
    env = dict(os.environ, PYTHONPATH=str(blocker), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok (7, 5)"


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_on_cuda_in_bf16_within_the_formats_error_and_exported(granularity, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 300, device="cuda"), torch.randn(200, device="cuda")
    layer = Fp8InferenceLinear(weight, bias, granularity, fast_accum=True)
    x = torch.randn(512, 300, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = x.double() @ weight.double().t()
    assert sqnr_db((y.double() - bias.double()), ref) >= 25.0
    program = export_program(layer, (x,), str(tmp_path / "layer.pt2"))
    torch.testing.assert_close(program.module()(x[:100]), layer(x[:100]), rtol=0, atol=0)


@pytest.mark.gpu
def test_on_cuda_serving_rows_time_the_compiled_forms_in_a_cuda_graph(monkeypatch):
    """The serving timer on CUDA: both forms compiled and replayed in a CUDA graph (never the eager
    fallback, whose separate cast passes would decide against FP8 at every size)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from loka_torchrec import inference_timing

    eager = []
    monkeypatch.setattr(inference_timing, "call_times_ms", lambda *a, **k: eager.append(1) or [1.0])
    torch.manual_seed(0)
    layer = nn.Linear(1024, 1024, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8InferenceLinear(layer.weight.detach(), layer.bias.detach(), "tensorwise", fast_accum=True)
    fp8_ms, hp_ms = inference_timing.time_serving_forward(fp8, layer, 4096, reps=5)
    assert not eager and 0 < fp8_ms.value < 100 and 0 < hp_ms.value < 100
    assert not isinstance(fp8, torch._dynamo.eval_frame.OptimizedModule)  # the layer itself is left as it is


def test_the_inference_benchmark_runs_on_a_cpu_and_skips_what_needs_a_gpu(tmp_path):
    """benchmarks/inference_throughput.py, DHEN small: eager bf16 and LoKA's serving form (every GEMM
    forced to FP8) at two batch sizes; torchao's float8 inference is skipped with its reason."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "inference"
    cmd = [sys.executable, os.path.join(root, "benchmarks", "inference_throughput.py"), "--preset", "small", "--batch-sizes", "8,32",
           "--runs", "bf16,torchao_rowwise_compile,loka_export", "--mode", "all:scaled_mm:rowwise", "--device", "cpu",
           "--reps", "2", "--warmup", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "inference.json").read_text())
    rows = {(r["run"], r.get("batch")): r for r in result["rows"]}
    assert rows[("torchao_rowwise_compile", None)]["status"] == "skipped" and "CUDA" in rows[("torchao_rowwise_compile", None)]["reason"]
    for batch in (8, 32):
        assert rows[("bf16", batch)]["sqnr_vs_bf16_db"] == "inf"  # the reference itself
        loka = rows[("loka_export", batch)]
        assert loka["fp8"].startswith("19/19 linear layers in FP8") and loka["median_ms"] > 0 and loka["rows_per_s"] > 0
        assert 15.0 <= loka["sqnr_vs_bf16_db"] < 60.0  # FP8 noise through the whole network: present, and bounded
    assert result["unfinished"] == [] and "not finished" not in (tmp_path / "inference.md").read_text()
    assert "| loka_export | 32 |" in (tmp_path / "inference.md").read_text()
    bad = subprocess.run([sys.executable, cmd[1], "--runs", "loka_export", "--out", str(out)], cwd=root, capture_output=True, text=True)
    assert bad.returncode == 2 and "need --plan" in bad.stderr
    # --choose-at-batch: one serving form per batch size, each layer in FP8 only where faster there
    chosen = subprocess.run([sys.executable, cmd[1], "--preset", "small", "--batch-sizes", "16", "--runs", "loka_export", "--mode",
                             "all:scaled_mm:rowwise", "--device", "cpu", "--choose-at-batch", "--reps", "2", "--warmup", "1", "--out",
                             str(tmp_path / "chosen")], cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    (row,) = json.loads((tmp_path / "chosen.json").read_text())["rows"]
    assert row["batch"] == 16 and re.fullmatch(r"\d+/19 linear layers in FP8 for inference, \d+ in high precision.*", row["fp8"])
    timings = row["serving_timings"]  # what the choice was made from, per layer, in the JSON and the report
    assert len(timings) == 19 and all(t["rows"] == 16 and t["fp8_ms"] > 0 and t["high_precision_ms"] > 0 for t in timings.values())
    assert "## What `serving_rows` timed" in (tmp_path / "chosen.md").read_text()


def test_the_inference_benchmark_leaves_the_finished_runs_when_it_is_cut_short(tmp_path):
    """The results are written before each run: a process killed by a deadline in a later run leaves
    the runs it finished, and the report names the ones it did not."""
    import importlib.util
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("inference_throughput", os.path.join(root, "benchmarks", "inference_throughput.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    meta = {"date": "2026-11-28", "device": "CPU", "versions": {}, "command": "x", "preset": "small",
            "unfinished": ["torchao_tensorwise_compile"]}  # fmt: skip
    rows = [{"run": "bf16", "status": "ok", "batch": 8, "median_ms": 2.0, "p99_ms": 2.5, "rows_per_s": 4000.0,
             "sqnr_vs_bf16_db": float("inf")}]  # fmt: skip
    bench.write_results(str(tmp_path / "cut"), meta, rows)
    assert json.loads((tmp_path / "cut.json").read_text())["unfinished"] == ["torchao_tensorwise_compile"]
    text = (tmp_path / "cut.md").read_text()
    assert "- not finished (the process ended first): torchao_tensorwise_compile" in text and "| bf16 | 8 | 2.000 |" in text


def test_the_inference_benchmark_compiles_every_run_with_static_shapes(monkeypatch):
    """Each batch size gets a graph of its own in every compiled run, as LoKA's forms chosen per batch
    do: with Dynamo's automatic dynamic shapes the baselines would run kernels compiled for any size."""
    import argparse
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("inference_throughput", os.path.join(root, "benchmarks", "inference_throughput.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = []
    monkeypatch.setattr(bench.torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
    args = argparse.Namespace(model="dhen", preset="small", plan=None, mode="all:scaled_mm:rowwise")
    for run in ("bf16_compile", "bf16_compile_cudagraphs", "loka_export_compile", "loka_export_compile_cudagraphs"):
        bench.make(run, args, torch.device("cpu"), torch.float32)
    assert [c["mode"] for c in calls] == ["default", "reduce-overhead", "default", "reduce-overhead"]
    assert all(c["dynamic"] is False for c in calls)


def test_the_inference_benchmark_serves_the_zoo_models_at_their_recipes_sizes(tmp_path):
    """``--model wukong|dcnv2``: the over arch of the user's model (no Mods) with its recipe's pooled
    tables, bf16 against LoKA's serving form; the DHEN xl layers keep the 63 features its plan has."""
    import importlib.util
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("inference_throughput", os.path.join(root, "benchmarks", "inference_throughput.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert [bench.pooled_tables(m, p) for m, p in (("dhen", "xl"), ("wukong", "large"), ("wukong", "xl"), ("dcnv2", "small"))] == [63, 31, 63, 8]
    out = tmp_path / "wukong"
    assert bench.main(["--model", "wukong", "--preset", "small", "--batch-sizes", "8", "--runs", "bf16,loka_export",
                       "--mode", "all:scaled_mm:rowwise", "--device", "cpu", "--reps", "2", "--warmup", "1", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads((tmp_path / "wukong.json").read_text())
    assert result["model"] == "wukong" and result["unfinished"] == []
    loka = next(r for r in result["rows"] if r["run"] == "loka_export")
    assert re.fullmatch(r"(\d+)/\1 linear layers in FP8 for inference, 0 in high precision.*", loka["fp8"])
    assert 15.0 <= loka["sqnr_vs_bf16_db"] < 60.0
    assert (tmp_path / "wukong.md").read_text().startswith("# Inference of the `wukong` `small` dense part")
    def kinds(model):
        return {type(m).__name__ for m in model.modules()}

    mods = {"BlockNorm", "PaddedLinear", "SiblingLinears"}  # what the Mods put in
    assert mods <= kinds(bench.build("dhen", "small", torch.device("cpu"), torch.float32))  # DHEN: as LoKA's runs train it
    model = bench.build("dcnv2", "small", torch.device("cpu"), torch.float32)
    assert not mods & kinds(model)  # a zoo model: the user's, unchanged
    assert model(*bench.inputs("dcnv2", "small", 4, torch.device("cpu"), torch.float32)).shape == (4,)


def test_at_the_serving_rows_a_layer_stays_fp8_only_where_its_forward_is_faster():
    """``serving_rows``: each FP8 layer timed against its high-precision form at those rows (once per
    shape); slower ones serve in high precision with both times; a real timing runs on the CPU too."""
    from loka_torchrec.evidence import Interval

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise"))
    calls = []

    def timer(fp8_layer, layer, rows):  # 32 -> 32 layers gain, the others lose
        calls.append((layer.in_features, layer.out_features, rows))
        assert isinstance(fp8_layer, Fp8InferenceLinear) and rows == 256
        fast = (layer.in_features, layer.out_features) == (32, 32)
        fp8 = Interval(1.0, 0.9, 1.1, 5, "iqr") if fast else Interval(2.0, 1.9, 2.1, 5, "iqr")
        return fp8, Interval(1.5, 1.4, 1.6, 5, "iqr")

    report = inference_modules(model, serving_rows=256, timer=timer)
    assert set(report.fp8) == {"2", "4"} and set(report.high_precision) == {"0", "6"}
    assert report.high_precision["0"] == "not faster at 256 rows: 2 ms in FP8 vs 1.5 ms in high precision (lo 0.67x < 1)"
    assert sorted(calls) == [(16, 32, 256), (32, 8, 256), (32, 32, 256)]  # the two 32 -> 32 layers timed once
    assert report.timings["4"] == {"rows": 256, "fp8_ms": 1.0, "high_precision_ms": 1.5}
    assert isinstance(model[0], nn.Linear) and isinstance(model[2], Fp8InferenceLinear)
    with pytest.raises(ValueError, match="serving_rows: expected the rows of a serving batch, an int >= 1, got 0"):
        inference_modules(nn.Sequential(nn.Linear(4, 4)), serving_rows=0)
    # the real timer, on this CPU: both forms timed, the decision follows the rule from those times
    real = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    loka_torchrec.apply(real, DispatchConfig(mode="all:scaled_mm:tensorwise"))
    timed = inference_modules(real, serving_rows=64)
    assert set(timed.timings) == {"0", "2"} and all(t["fp8_ms"] > 0 and t["high_precision_ms"] > 0 for t in timed.timings.values())
    assert set(timed.fp8) | set(timed.high_precision) == {"0", "2"}
    assert all(why.startswith("not faster at 64 rows") for why in timed.high_precision.values())


def test_an_eager_run_gets_static_scales_from_the_probes_amaxes(tmp_path):
    """Without compile no delayed-scaling history exists: the README loop's Probe recorded each layer's
    input amax at its probe steps, and those give the static scales (named in the copy's terms)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    config = loka_torchrec.LokaConfig.from_dict({
        "enabled": True, "probe": {"every": 1, "warmup_steps": 3, "samples": 2, "speed_reps": 1},
        "dispatch": {"mode": "all:scaled_mm:tensorwise", "layer_check_reps": 0, "grad_check": False},
    })  # fmt: skip
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), device="cpu")
    for step in range(1, 7):
        with loka.step(step):
            x = torch.randn(64, 16)
            model(x / x.abs().max()).square().mean().backward()
    amaxes = loka.probe.input_amaxes(model)
    loka.close()
    assert set(amaxes) == {"0", "2"} and all(len(v) >= 3 for v in amaxes.values())
    served = copy.deepcopy(model)
    report = inference_modules(served, input_scaling="static", input_amaxes=amaxes)
    assert report.static_inputs["0"] == pytest.approx(max(amaxes["0"]))  # inputs scaled to amax 1: stable
    assert report.static_inputs.keys() | report.dynamic_inputs.keys() == {"0", "2"}
    assert inference_modules(copy.deepcopy(model), input_scaling="static").dynamic_inputs["0"] == "no input amax recorded in training"


def test_static_input_scales_where_training_saw_a_stable_input_amax():
    """Tensorwise layers whose recorded input amaxes stayed within 1.5x of their median get a fixed
    scale from the largest; a varying one, a rowwise one and one never run stay dynamic, each with why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    # compiled=True: the sites scale their forward by the amax history (delayed), so every call records it
    loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise", compiled=True))
    model[4].set_kernels(LayerKernels.uniform(KernelChoice("scaled_mm", "rowwise")))
    for scale in (1.0, 1.1, 1.2, 0.9):  # training calls: the first layer's input amax barely moves
        x = torch.randn(64, 16)
        model(x / x.abs().max() * scale)
    history0 = model[0]._amax_history[0]
    expected_amax = float(history0[history0 > 0].max())
    model[2]._amax_history[0, 0] = 100.0  # the second layer once saw a much larger input
    report = inference_modules(model, input_scaling="static")
    assert report.static_inputs == {"0": pytest.approx(expected_amax)}
    assert report.dynamic_inputs["2"].startswith("input amax varied: largest 100")
    assert report.dynamic_inputs["4"] == "rowwise: each row has its own scale"
    assert report.summary().endswith("; 1 with static input scales")
    layer = model[0]
    assert float(layer.input_amax) == pytest.approx(expected_amax) and "static input amax" in repr(layer)
    # within the learned range: the same as a dynamic layer given that amax; beyond it: saturated, finite
    weight = torch.randn(32, 16)
    dynamic = Fp8InferenceLinear(weight, None, "tensorwise")
    static = Fp8InferenceLinear(weight, None, "tensorwise", input_amax=2.0)
    x = torch.rand(8, 16) * 2.0
    x[0, 0] = 2.0  # this batch's own amax is the static one: identical codes
    with torch.no_grad():
        torch.testing.assert_close(static(x), dynamic(x), rtol=0, atol=0)
        big = static(x * 10)
    assert torch.isfinite(big).all()
    fresh = nn.Sequential(nn.Linear(4, 4))
    loka_torchrec.apply(fresh, DispatchConfig(mode="all:scaled_mm:tensorwise", compiled=True))
    assert inference_modules(fresh, input_scaling="static").dynamic_inputs == {"0": "no input amax recorded in training"}
    with pytest.raises(ValueError, match="input_scaling: expected one of dynamic, static"):
        inference_modules(fresh, input_scaling="delayed")
    for amaxes, static, dynamic in (([2.0, 2.5], {"0": 2.5}, {}),  # the Probe's amaxes, where no history was kept
                                    ([1.0, 4.0, 1.1], {}, {"0": "input amax varied: largest 4 vs median 1.1 over 3 probe steps"})):
        unrun = nn.Sequential(nn.Linear(4, 4))
        loka_torchrec.apply(unrun, DispatchConfig(mode="all:scaled_mm:tensorwise", compiled=True))
        probed = inference_modules(unrun, input_scaling="static", input_amaxes={"0": amaxes})
        assert (probed.static_inputs, probed.dynamic_inputs) == (static, dynamic)  # fmt: skip
    with pytest.raises(ValueError, match="input_amax: a finite amax > 0, for tensorwise layers only"):
        Fp8InferenceLinear(torch.randn(4, 4), None, "rowwise", input_amax=1.0)


def test_the_inference_benchmark_serves_with_static_input_scales_from_calibration_batches(tmp_path):
    """``loka_export_static``: every tensorwise FP8 layer scales its input by the largest amax it saw
    in the calibration batches (seeded apart from the timed ones); the output stays within FP8's
    error of bf16, and the report says how many layers are static."""
    import importlib.util
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("inference_throughput", os.path.join(root, "benchmarks", "inference_throughput.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--preset", "small", "--mode", "all:scaled_mm:tensorwise", "--device", "cpu", "--out", "x",
                             "--calibration-batches", "3"])  # fmt: skip
    model = bench.build("dhen", "small", torch.device("cpu"), torch.float32)
    loka_torchrec.apply(model, loka_torchrec.DispatchConfig(mode="all:scaled_mm:tensorwise"))
    amaxes = bench.calibrated_input_amaxes(model, args, torch.device("cpu"), torch.float32, rows=16)
    layers = [n for n, m in model.named_modules() if isinstance(m, loka_torchrec.LokaLinear)]
    assert sorted(amaxes) == sorted(layers) and all(len(a) == 3 and min(a) > 0 for a in amaxes.values())
    assert all(not m._forward_pre_hooks for m in model.modules())  # the calibration's hooks are gone
    out = tmp_path / "static"
    assert bench.main(["--preset", "small", "--batch-sizes", "16", "--runs", "bf16,loka_export,loka_export_static",
                       "--mode", "all:scaled_mm:tensorwise", "--device", "cpu", "--reps", "2", "--warmup", "1",
                       "--calibration-batches", "4", "--out", str(out)]) == 0  # fmt: skip
    rows = {r["run"]: r for r in json.loads((tmp_path / "static.json").read_text())["rows"]}
    static, dynamic = rows["loka_export_static"], rows["loka_export"]
    assert re.fullmatch(r"19/19 linear layers in FP8 for inference, 0 in high precision; \d+ with static input scales", static["fp8"])
    assert 15.0 <= static["sqnr_vs_bf16_db"] < 60.0 and static["sqnr_vs_bf16_db"] > dynamic["sqnr_vs_bf16_db"] - 6.0
    with pytest.raises(SystemExit):
        bench.parse_args(["--calibration-batches", "0", "--out", "x"])
