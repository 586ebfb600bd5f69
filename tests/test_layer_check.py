"""The layer check: planned FP8 layers that are not faster as a whole (fwd + bwd) go back to bf16."""

import json

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig, LayerKernels
from loka_torchrec.dispatch import layer_check
from loka_torchrec.dispatch.layer_check import LayerTiming, check_plan_layers, time_layer_step
from loka_torchrec.dispatch.plan import DispatchPlan, LayerPlan, RoleDecision
from loka_torchrec.evidence import BF16, GemmRole, Interval, KernelChoice
from loka_torchrec.fp8 import Fp8Format

FP8 = KernelChoice("scaled_mm", "rowwise")


def _interval(ms, spread=0.0):
    return Interval(ms, ms - spread, ms + spread, 5, "iqr")


def _plan(layers):
    """A plan: name -> (in, out, rows, kernel for every role)."""
    plans = {}
    for name, (fan_in, fan_out, rows, choice) in layers.items():
        roles = {role: RoleDecision(choice, "test", "policy/test") for role in GemmRole}
        plans[name] = LayerPlan(name, fan_in, fan_out, rows, roles)
    return DispatchPlan(plans, "policy", 3, "cpu", {"min_speedup": 1.05})


def _model_layers(model):
    loka_torchrec.apply(model, DispatchConfig(mode="all-bf16"))
    return {name: m for name, m in model.named_modules() if hasattr(m, "set_kernels")}


def test_time_layer_step_times_both_variants_on_cpu():
    timing = time_layer_step(
        32, 16, 64, LayerKernels.uniform(FP8), bias=True, device=torch.device("cpu"), weight_dtype=torch.float32,
        input_dtype=torch.float32, autocast_dtype=None, grad_format=Fp8Format.E4M3, reps=3, warmup=1,
    )
    for interval in (timing.fp8_ms, timing.bf16_ms):
        assert interval.n == 3 and 0 < interval.low <= interval.value <= interval.high
    assert timing.speedup == pytest.approx(timing.bf16_ms.value / timing.fp8_ms.value)
    assert timing.speedup_low == pytest.approx(timing.bf16_ms.low / timing.fp8_ms.high)


def test_timing_leaves_the_global_random_stream_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    time_layer_step(
        16, 8, 8, LayerKernels.uniform(FP8), bias=True, device=torch.device("cpu"), weight_dtype=torch.float32,
        input_dtype=torch.float32, autocast_dtype=None, grad_format=Fp8Format.E4M3, reps=1, warmup=1,
    )
    assert torch.equal(torch.rand(4), expected)


def test_time_layer_step_under_bf16_autocast():
    timing = time_layer_step(
        32, 16, 64, LayerKernels.uniform(FP8), bias=False, device=torch.device("cpu"), weight_dtype=torch.float32,
        input_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16, grad_format=Fp8Format.E4M3, reps=2, warmup=1,
    )
    assert timing.fp8_ms.value > 0 and timing.bf16_ms.value > 0


def test_slower_layers_go_back_to_bf16_faster_ones_stay(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 4))
    layers = _model_layers(model)
    model(torch.randn(10, 16))  # records rows and dtypes
    names = list(layers)
    # The first layer is 2x faster in FP8, the second 2x slower; the third is planned bf16.
    fake = {16: LayerTiming(_interval(1.0, 0.05), _interval(2.0, 0.05)), 32: LayerTiming(_interval(2.0), _interval(1.0))}
    calls = []

    def fake_time(in_features, out_features, rows, kernels, **kwargs):
        calls.append((in_features, out_features, rows, kwargs["input_dtype"], kwargs["autocast_dtype"]))
        return fake[in_features]

    monkeypatch.setattr(layer_check, "time_layer_step", fake_time)
    plan = _plan({names[0]: (16, 32, 10, FP8), names[1]: (32, 8, 10, FP8), names[2]: (8, 4, 10, BF16)})
    checked, records = check_plan_layers(plan, layers, min_speedup=1.05, reps=3, grad_format=Fp8Format.E4M3)
    assert sorted(calls) == [(16, 32, 10, torch.float32, None), (32, 8, 10, torch.float32, None)]  # bf16 layer not timed
    assert checked.layers[names[0]] == plan.layers[names[0]]
    demoted = checked.layers[names[1]]
    assert demoted.kernels.all_high_precision
    for decision in demoted.roles.values():
        assert decision.source == "policy/layer_check"
        assert "layer check" in decision.reason and "0.50x" in decision.reason
    assert checked.layers[names[2]] == plan.layers[names[2]]
    assert [(r["layer"], r["kept_fp8"]) for r in records] == [(names[0], True), (names[1], False)]
    assert records[0]["speedup_low"] == pytest.approx(1.95 / 1.05)


def test_gate_uses_the_conservative_bound(monkeypatch):
    # Point speedup 1.1x, but the quartiles overlap: bf16 lo 1.0 / fp8 hi 1.0 = 1.0x < 1.05.
    monkeypatch.setattr(layer_check, "time_layer_step", lambda *a, **k: LayerTiming(_interval(1.0, 0.0), Interval(1.1, 1.0, 1.2, 5, "iqr")))
    model = nn.Sequential(nn.Linear(16, 8))
    layers = _model_layers(model)
    model(torch.randn(4, 16))
    name = next(iter(layers))
    checked, records = check_plan_layers(_plan({name: (16, 8, 4, FP8)}), layers, min_speedup=1.05, reps=3, grad_format=Fp8Format.E4M3)
    assert checked.layers[name].kernels.all_high_precision and records[0]["kept_fp8"] is False
    checked, records = check_plan_layers(_plan({name: (16, 8, 4, FP8)}), layers, min_speedup=1.0, reps=3, grad_format=Fp8Format.E4M3)
    assert not checked.layers[name].kernels.all_high_precision and records[0]["kept_fp8"] is True


def test_layers_of_one_size_are_timed_once(monkeypatch):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    layers = _model_layers(model)
    model(torch.randn(6, 16))
    calls = []
    monkeypatch.setattr(layer_check, "time_layer_step", lambda *a, **k: calls.append(a) or LayerTiming(_interval(1.0), _interval(3.0)))
    plan = _plan({name: (16, 16, 6, FP8) for name in layers})
    checked, records = check_plan_layers(plan, layers, min_speedup=1.05, reps=3, grad_format=Fp8Format.E4M3)
    assert len(calls) == 1 and len(records) == 3 and checked.fp8_gemm_count() == 9


@pytest.mark.parametrize("min_speedup, expect_fp8", [(0.0, True), (1e9, False)])
def test_dispatcher_runs_the_check_after_planning(tmp_path, min_speedup, expect_fp8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    cfg = DispatchConfig(mode="policy", plan_at_step=1, min_speedup=min_speedup, samples=2, timing_reps=1,
                         candidates=("scaled_mm:rowwise",), layer_check_reps=2)  # fmt: skip
    report = loka_torchrec.apply(model, cfg, run_dir=str(tmp_path))
    model(torch.randn(64, 32)).sum().backward()
    if not expect_fp8:
        # The per-GEMM gate would reject too at 1e9; let the per-GEMM policy pass everything so the layer check decides.
        import loka_torchrec.dispatch.dispatcher as dispatcher_module

        real_decide = dispatcher_module.decide
        dispatcher_module.decide = lambda evidence, sizes, **kw: real_decide(evidence, sizes, **{**kw, "min_speedup": 0.0})
        try:
            report.dispatcher.on_step_end(1)
        finally:
            dispatcher_module.decide = real_decide
    else:
        report.dispatcher.on_step_end(1)
    plan = report.dispatcher.plan
    events = [json.loads(line) for line in (tmp_path / "dispatch_events.jsonl").read_text().splitlines()]
    checks = [e for e in events if e["event"] == "layer_check"]
    assert len(checks) == 2 and all(e["fp8_ms"] > 0 and e["bf16_ms"] > 0 for e in checks)
    assert all(e["kept_fp8"] is expect_fp8 for e in checks)
    assert (plan.fp8_gemm_count() > 0) is expect_fp8
    saved = json.loads((tmp_path / "dispatch_plan.json").read_text())
    if not expect_fp8:
        reasons = {d["reason"].split(":")[0] for lp in saved["layers"].values() for d in lp["roles"].values()}
        assert reasons == {"layer check"}


def test_check_off_and_bad_reps():
    model = nn.Sequential(nn.Linear(8, 8))
    report = loka_torchrec.apply(model, DispatchConfig(mode="policy", plan_at_step=1, min_speedup=0.0, samples=2,
                                                       timing_reps=1, layer_check_reps=0))  # fmt: skip
    model(torch.randn(4, 8)).sum().backward()
    report.dispatcher.on_step_end(1)
    assert not [e for e in report.dispatcher.events if e["event"] == "layer_check"]
    with pytest.raises(ValueError, match="dispatch.layer_check_reps"):
        DispatchConfig(layer_check_reps=-1)
    with pytest.raises(TypeError, match="dispatch.layer_check_reps: expected an int, got True"):
        DispatchConfig(layer_check_reps=True)


def test_layer_records_input_and_autocast_dtype():
    layer = loka_torchrec.dispatch.linear.LokaLinear(8, 4)
    layer(torch.randn(3, 8))
    assert layer.last_input_dtype == torch.float32 and layer.last_autocast_dtype is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(3, 8))
    assert layer.last_autocast_dtype == torch.bfloat16
