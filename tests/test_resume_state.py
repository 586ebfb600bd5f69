"""LoKA's checkpoint state: it loads with torch.load's default weights_only=True, restores every
decision, refuses another model's state, and a resume says what of its new configuration wins."""

import io
import json
import logging

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.probe import ProbeConfig


def seq(*sizes):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _saved_and_loaded(state):
    buffer = io.BytesIO()
    torch.save({"model": {}, "loka": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer)["loka"]  # the default: weights_only=True


def _probe_config(**dispatch):
    return loka_torchrec.LokaConfig(
        enabled=True, probe=ProbeConfig(warmup_steps=3, every=1, every_after=2, readmit_every=2),
        dispatch=DispatchConfig(candidates=("emulated:rowwise",), min_speedup=0.0, step_guard_window=2, **dispatch),
    )  # fmt: skip


def _run(tmp_path, name, steps, config):
    model = seq(32, 64, 8)
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path / name), batch_size=16)
    torch.manual_seed(1)
    x = torch.randn(64, 32)
    for step in steps:
        with loka.step(step):
            model.zero_grad()
            model(x).square().mean().backward()
    return model, loka


def test_a_checkpoint_with_loka_state_loads_weights_only_and_restores_every_decision(tmp_path):
    _, first = _run(tmp_path, "a", range(1, 7), _probe_config())
    first.dispatcher.fallback("2", "amax jumped 40x", step=6)
    assert first.probe.planned and first.dispatcher.plan.fp8_gemm_count() > 0 and first.comms_choice is not None
    state = _saved_and_loaded(first.state_dict())

    model, resumed = _run(tmp_path, "b", [], _probe_config())
    resumed.start()
    resumed.load_state_dict(state, step=6)
    d, r = first.dispatcher, resumed.dispatcher
    assert r.plan.digest() == d.plan.digest() and r.plan.step == d.plan.step
    assert r.fallen_back == {"2": "amax jumped 40x"} and r.in_force().fp8_gemm_count() == d.in_force().fp8_gemm_count()
    assert r.step_guard_reason == d.step_guard_reason and r.state_dict()["guard"] == d.state_dict()["guard"]
    assert r.events == d.events
    assert resumed.comms_choice == first.comms_choice
    assert resumed.probe.planned and resumed.probe.monitoring_steps == first.probe.monitoring_steps
    for name in ("0", "2"):
        a, b = first.probe.layer_state(name), resumed.probe.layer_state(name)
        assert b.state == a.state and b.evidence == a.evidence and list(b.act_amax) == list(a.act_amax)
        assert torch.equal(b.reference_act.mean, a.reference_act.mean) and b.reference_act.count == a.reference_act.count
        # after the plan the captured rows are released (LayerState.reset_reservoir), and stay so
        assert a.reservoir.inputs is None and b.reservoir.inputs is None and b.reservoir.seen == a.reservoir.seen == 0
        assert torch.equal(b.reservoir._gen.get_state(), a.reservoir._gen.get_state())
    with pytest.raises(ValueError, match="has already ended"):
        resumed.step_end(6)  # the next step is 7
    x = torch.randn(64, 32)
    with resumed.step(7):
        model(x).square().mean().backward()


def test_loading_another_models_state_is_refused_naming_what_differs(tmp_path):
    config = loka_torchrec.LokaConfig(enabled=True, probe=ProbeConfig(enabled=False), dispatch=DispatchConfig(mode="all:emulated:rowwise"))
    big = loka_torchrec.prepare(seq(64, 128, 64), config)
    state = _saved_and_loaded(big.state_dict())
    small = loka_torchrec.prepare(seq(32, 16, 8), config)
    with pytest.raises(ValueError, match=r"dispatch state: the checkpoint is of another model \(2 layer\(s\) of another shape: "
                                         r"0 \(plan 64 -> 128, model 32 -> 16\), 2 \(plan 128 -> 64, model 16 -> 8\)\)"):
        small.load_state_dict(state, step=10)
    deeper = loka_torchrec.prepare(seq(64, 128, 64, 64), config)
    with pytest.raises(ValueError, match=r"layers missing from the plan \['4'\]"):
        deeper.dispatcher.load_state_dict(state["dispatch"])
    assert small.dispatcher.plan.layers["0"].in_features == 32  # nothing of the other model taken


def test_a_pinned_plan_of_other_layer_shapes_is_refused(tmp_path):
    report = loka_torchrec.apply(seq(64, 128, 64), DispatchConfig(mode="all:emulated:rowwise"), run_dir=str(tmp_path))
    report.dispatcher.start()
    pinned = DispatchConfig(mode="pinned", plan_path=str(tmp_path / "dispatch_plan.json"))
    with pytest.raises(ValueError, match=r"dispatch.plan_path: plan .* does not match the model: 2 layer\(s\) of another shape: 0 \(plan 64 -> 128, model 32 -> 16\)"):
        loka_torchrec.apply(seq(32, 16, 8), pinned)
    assert loka_torchrec.apply(seq(64, 128, 64), pinned).dispatcher.plan.fp8_gemm_count() == 6


def _policy_dispatcher(run_dir, **overrides):
    model = seq(32, 48, 16)
    cfg = dict(mode="policy", plan_at_step=1, min_speedup=0.0, samples=2, timing_reps=1, candidates=("emulated:rowwise",), layer_check_reps=0)
    cfg.update(overrides)
    return model, loka_torchrec.apply(model, DispatchConfig(**cfg), run_dir=str(run_dir)).dispatcher


def _planned_state(tmp_path):
    model, d = _policy_dispatcher(tmp_path / "a")
    model(torch.randn(16, 32)).sum().backward()
    d.on_step_end(1)
    d.fallback("2", "amax jumped", step=3)
    assert d.plan.fp8_gemm_count() == 6
    return _saved_and_loaded(d.state_dict())


def test_a_resume_under_a_static_mode_runs_this_runs_plan_and_says_so(tmp_path, caplog):
    state = _planned_state(tmp_path)
    caplog.set_level(logging.WARNING, logger="loka_torchrec.dispatch")
    _, bf16 = _policy_dispatcher(tmp_path / "b", mode="all-bf16")
    bf16.start()
    bf16.load_state_dict(state)
    assert bf16.plan.fp8_gemm_count() == 0 and bf16.in_force().fp8_gemm_count() == 0 and bf16.fallen_back == {}
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dispatch.mode")]
    assert "the checkpoint ran policy (6 FP8 GEMM(s) planned), this run has all-bf16: this run's plan runs" in line
    assert [e["event"] for e in bf16.events][-1] == "resume_override"
    assert json.loads((tmp_path / "b" / "dispatch_plan.json").read_text())["mode"] == "all-bf16"


def test_a_static_resume_of_the_same_plan_restores_the_valve(tmp_path):
    _, d = _policy_dispatcher(tmp_path / "a", mode="all:emulated:rowwise")
    d.fallback("2", "amax jumped", step=3)
    _, again = _policy_dispatcher(tmp_path / "b", mode="all:emulated:rowwise")
    again.load_state_dict(_saved_and_loaded(d.state_dict()))
    assert again.fallen_back == {"2": "amax jumped"} and again.in_force().fp8_gemm_count() == 3


def test_a_policy_resume_keeps_the_checkpoints_plan_and_names_the_gates_that_differ(tmp_path, caplog):
    state = _planned_state(tmp_path)
    caplog.set_level(logging.WARNING, logger="loka_torchrec.dispatch")
    _, stricter = _policy_dispatcher(tmp_path / "b", min_speedup=1.1, max_mere=0.1)
    stricter.load_state_dict(state)
    assert stricter.plan.fp8_gemm_count() == 6 and stricter.fallen_back == {"2": "amax jumped"}
    (line,) = [r.getMessage() for r in caplog.records if "differ from the checkpoint's" in r.getMessage()]
    assert "max_mere=0.1 (checkpoint: 0.2), min_speedup=1.1 (checkpoint: 0.0)" in line
    assert "its plan (made at step 1) runs on, and they apply from the next plan" in line
