"""Dispatch configuration, selection policy, plan (JSON, digest, table) and measurement statistics."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os

import numpy as np
import pytest
import torch
from scipy import stats

from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.gemm.intervals import mean_interval, t_quantile_975
from loka_torchrec.gemm.measure import time_ms
from loka_torchrec.dispatch.plan import PLAN_FORMAT_VERSION, DispatchPlan, LayerPlan, RoleDecision
from loka_torchrec.dispatch.policy import decide, decide_role, share_quantizations
from loka_torchrec.evidence import BF16, CandidateEvidence, GemmRole, GemmShape, Interval, KernelChoice

FWD, DGRAD, WGRAD = GemmRole.FORWARD, GemmRole.GRAD_INPUT, GemmRole.GRAD_WEIGHT
ROWWISE = KernelChoice("scaled_mm", "rowwise")
TENSORWISE = KernelChoice("scaled_mm", "tensorwise")
TENSORWISE_FAST = KernelChoice("scaled_mm", "tensorwise_fast_accum")
BLOCKWISE = KernelChoice("emulated", "blockwise")
GATES = dict(max_mere=0.2, min_speedup=1.05)


def evidence(
    kernel: KernelChoice = ROWWISE,
    *,
    layer: str = "dense.0",
    role: GemmRole = FWD,
    error=(0.05, 0.04, 0.06),
    time=(1.0, 0.9, 1.1),
    baseline=(2.0, 1.9, 2.1),
    size=(64, 32, 16),
) -> CandidateEvidence:
    """Evidence for one candidate: ``error`` and ``time`` are ``(value, low, high)``."""
    return CandidateEvidence(
        layer=layer,
        role=role,
        candidate=kernel,
        shape=GemmShape.for_role(role, *size),
        error=Interval(*error, 8, "t95"),
        time_ms=Interval(*time, 5, "iqr"),
        baseline_time_ms=Interval(*baseline, 5, "iqr"),
        source="random",
        sqnr_db=Interval(28.0, 27.5, 28.5, 8, "t95"),
        device="cpu",
        note="test",
    )


# ------------------------------------------------------------------------------------- DispatchConfig
def test_config_defaults_and_coercion():
    config = DispatchConfig(candidates=["scaled_mm:rowwise", "emulated:blockwise"], include=["dense.*"], exclude=[])
    assert config.candidates == ("scaled_mm:rowwise", "emulated:blockwise")
    assert config.include == ("dense.*",) and config.exclude == ()
    assert (config.max_mere, config.min_speedup) == (0.2, 1.05)
    assert DispatchConfig(mode="pinned", plan_path="plan.json").plan_path == "plan.json"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "all-bf16"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mode="fastest"), "mode"),
        (dict(mode="all:scaled_mm"), "mode"),
        (dict(mode="all:"), "mode"),
        (dict(mode="pinned"), "plan_path"),
        (dict(mode="pinned", plan_path=""), "plan_path"),
        (dict(candidates=("scaled_mm",)), "candidates"),
        (dict(candidates=("auto", "rowwise")), "candidates"),
        (dict(max_mere=0.0), "max_mere"),
        (dict(max_mere=-0.1), "max_mere"),
        (dict(max_mere=math.nan), "max_mere"),
        (dict(min_speedup=-0.5), "min_speedup"),
        (dict(min_speedup=math.nan), "min_speedup"),
        (dict(evidence="oracle"), "evidence"),
        (dict(plan_at_step=0), "plan_at_step"),
        (dict(samples=1), "samples"),
        (dict(timing_reps=0), "timing_reps"),
        (dict(min_features=0), "min_features"),
        (dict(grad_format="e3m4"), "grad_format"),
        (dict(fallback="ignore"), "fallback"),
        (dict(min_grad_sqnr_db=math.nan), "min_grad_sqnr_db"),
        (dict(max_grad_noise_ratio=-0.1), "max_grad_noise_ratio"),
        (dict(max_grad_noise_ratio=math.inf), "max_grad_noise_ratio"),
    ],
)
def test_config_rejects_each_bad_field_by_name(kwargs, field):
    with pytest.raises(ValueError, match=rf"^dispatch\.{field}\b"):
        DispatchConfig(**kwargs)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("all-bf16", BF16),
        ("all:scaled_mm:rowwise", ROWWISE),
        ("all:emulated:blockwise", BLOCKWISE),
        ("policy", None),
    ],
)
def test_config_static_choice(mode, expected):
    assert DispatchConfig(mode=mode).static_choice == expected
    assert DispatchConfig(mode="pinned", plan_path="p.json").static_choice is None


# ------------------------------------------------------------------------------------- policy
def test_decide_role_picks_the_fastest_admissible_candidate():
    too_inaccurate = evidence(TENSORWISE, error=(0.1, 0.05, 0.5), time=(0.5, 0.45, 0.55))  # fastest, error hi 0.5
    fast = evidence(ROWWISE, time=(1.0, 0.9, 1.1))  # 2.0x
    slower = evidence(BLOCKWISE, time=(1.5, 1.4, 1.6))  # 1.33x
    pool = [slower, too_inaccurate, fast, evidence(BF16, time=(2.0, 1.9, 2.1))]
    decision = decide_role(pool, source="policy/random", **GATES)
    assert decision.choice == ROWWISE
    assert decision.evidence == fast
    assert decision.considered == tuple(pool)
    assert decision.source == "policy/random"
    assert decision.reason.startswith("fastest accurate of 3")  # bf16 is not a candidate


def test_decide_role_gates_on_the_mere_upper_bound_not_the_mean():
    # The mean 0.1 passes max_mere=0.2, the upper bound 0.25 does not.
    wide = evidence(ROWWISE, error=(0.1, 0.0, 0.25))
    decision = decide_role([wide], source="s", **GATES)
    assert decision.choice == BF16
    assert decision.evidence is None
    assert "none accurate enough" in decision.reason
    assert str(ROWWISE) in decision.reason and "MERE hi 0.2500" in decision.reason and "0.2" in decision.reason
    # An upper bound just under the threshold passes, one equal to it does not ("below").
    assert decide_role([evidence(error=(0.19, 0.18, 0.199))], source="s", **GATES).choice == ROWWISE
    assert decide_role([evidence(error=(0.15, 0.1, 0.2))], source="s", **GATES).choice == BF16


def test_decide_role_gates_on_the_speedup_lower_bound():
    # Point speedup 2.0x, but baseline.low / time.high = 1.9 / 1.9 = 1.0x < 1.05.
    noisy = evidence(ROWWISE, time=(1.0, 0.5, 1.9), baseline=(2.0, 1.9, 2.1))
    assert noisy.speedup == pytest.approx(2.0) and noisy.speedup_low == pytest.approx(1.0)
    decision = decide_role([noisy], source="s", **GATES)
    assert decision.choice == BF16
    assert "none fast enough" in decision.reason
    assert str(ROWWISE) in decision.reason and "lo 1.00x < 1.05" in decision.reason
    # Exactly at min_speedup is enough ("at least"): 5 / 4 = 1.25.
    exact = evidence(time=(3.0, 2.0, 4.0), baseline=(6.0, 5.0, 7.0))
    assert decide_role([exact], max_mere=0.2, min_speedup=1.25, source="s").choice == ROWWISE


def test_decide_role_reason_names_the_best_rejected_candidate():
    slow_a = evidence(ROWWISE, time=(1.9, 1.85, 1.95))  # 1.05x point, lo 0.97x
    slow_b = evidence(TENSORWISE, time=(1.95, 1.9, 2.0))
    decision = decide_role([slow_b, slow_a], source="s", **GATES)
    assert decision.choice == BF16 and f"best {ROWWISE} 1.05x" in decision.reason  # the faster of the two

    bad_a = evidence(ROWWISE, error=(0.3, 0.2, 0.4))
    bad_b = evidence(TENSORWISE, error=(0.25, 0.2, 0.3))
    decision = decide_role([bad_a, bad_b], source="s", **GATES)
    assert decision.choice == BF16 and f"best {TENSORWISE} MERE hi 0.3000" in decision.reason  # the more accurate

    # One accurate but slow, one fast but inaccurate: the accurate one is named with its speed gate.
    decision = decide_role([bad_a, slow_a], source="s", **GATES)
    assert decision.choice == BF16 and "none fast enough" in decision.reason and str(ROWWISE) in decision.reason


def test_decide_role_without_fp8_candidates_stays_bf16():
    for pool in ([], [evidence(BF16)]):
        decision = decide_role(pool, source="s", **GATES)
        assert decision.choice == BF16
        assert decision.reason == "no FP8 candidate could run here"


def test_decide_role_ties_go_to_the_more_accurate_candidate():
    a = evidence(ROWWISE, error=(0.08, 0.07, 0.09))
    b = evidence(TENSORWISE, error=(0.05, 0.04, 0.06))
    assert decide_role([a, b], source="s", **GATES).choice == TENSORWISE
    assert decide_role([b, a], source="s", **GATES).choice == TENSORWISE


@pytest.mark.parametrize("fast_time, fast_error, expected", [
    ((1.02, 0.98, 1.06), (0.05, 0.04, 0.06), "scaled_mm:tensorwise_fast_accum"),  # slower by the point, inside the spread
    ((0.98, 0.95, 1.0), (0.05, 0.04, 0.06), "scaled_mm:tensorwise_fast_accum"),  # faster anyway
    ((1.2, 1.11, 1.3), (0.05, 0.04, 0.06), "scaled_mm:tensorwise"),  # clearly slower: low 1.11 > high 1.1
    ((1.02, 0.98, 1.06), (0.3, 0.25, 0.35), "scaled_mm:tensorwise"),  # inaccurate: never chosen
])  # fmt: skip
def test_decide_role_takes_fast_accumulation_unless_the_promoted_twin_is_clearly_faster(fast_time, fast_error, expected):
    promoted = evidence(TENSORWISE, time=(1.0, 0.9, 1.1))
    fast = evidence(TENSORWISE_FAST, time=fast_time, error=fast_error)
    for pool in ([promoted, fast], [fast, promoted]):
        decision = decide_role(pool, source="s", **GATES)
        assert str(decision.choice) == expected
        assert decision.evidence.candidate == decision.choice
    chose_twin_over_faster_point = expected.endswith("fast_accum") and fast_time[0] > 1.0
    assert ("not clearly faster: fast accumulation" in decision.reason) == chose_twin_over_faster_point


def test_fast_accumulation_preference_stays_within_one_backend_and_granularity():
    rowwise_fast = evidence(KernelChoice("scaled_mm", "rowwise_fast_accum"), time=(1.02, 0.98, 1.06))
    other_backend = evidence(KernelChoice("fbgemm", "tensorwise_fast_accum"), time=(1.02, 0.98, 1.06))
    assert decide_role([evidence(TENSORWISE), rowwise_fast, other_backend], source="s", **GATES).choice == TENSORWISE


def test_decide_makes_each_role_of_each_layer_independently():
    layers = {"dense.0": (64, 32, 16), "dense.1": (64, 16, 8), "over": (64, 8, 1)}
    pool = [
        # dense.0: fwd -> tensorwise (fastest), dgrad -> rowwise (tensorwise inaccurate there), wgrad too slow
        evidence(ROWWISE, role=FWD, time=(1.0, 0.9, 1.1)),
        evidence(TENSORWISE, role=FWD, time=(0.8, 0.7, 0.9)),
        evidence(ROWWISE, role=DGRAD, time=(1.0, 0.9, 1.1)),
        evidence(TENSORWISE, role=DGRAD, time=(0.8, 0.7, 0.9), error=(0.3, 0.25, 0.35)),
        evidence(ROWWISE, role=WGRAD, time=(2.0, 1.9, 2.1)),
        # dense.1: forward only
        evidence(BLOCKWISE, layer="dense.1", role=FWD, size=(64, 16, 8)),
        # a layer that is not managed is ignored
        evidence(ROWWISE, layer="ghost", role=FWD),
    ]
    plan = decide(pool, layers, source="policy/probe", mode="policy", step=7, device="cpu", **GATES)
    assert set(plan.layers) == set(layers)
    assert (plan.mode, plan.step, plan.device, plan.gates) == ("policy", 7, "cpu", {**GATES, "max_grad_noise_ratio": 0.0})
    d0 = plan.layers["dense.0"]
    assert (d0.rows, d0.in_features, d0.out_features) == (64, 32, 16)
    assert d0.kernels == LayerKernels(TENSORWISE, ROWWISE, BF16)
    assert "none fast enough" in d0.roles[WGRAD].reason
    assert plan.layers["dense.1"].kernels == LayerKernels(BLOCKWISE, BF16, BF16)
    for role in (DGRAD, WGRAD):
        assert plan.layers["dense.1"].roles[role].reason == "no evidence"
    for role in GemmRole:
        assert plan.layers["over"].roles[role] == RoleDecision(BF16, "no evidence", "policy/probe")
        assert plan.layers["dense.0"].roles[role].source == "policy/probe"
    # Each role's decision is what decide_role makes from that role's evidence alone.
    for role in GemmRole:
        alone = [e for e in pool if e.layer == "dense.0" and e.role == role]
        assert d0.roles[role] == decide_role(alone, source="policy/probe", **GATES)


FBGEMM_ROWWISE = KernelChoice("fbgemm", "rowwise")


def _mixed_pool(**wgrad_tensorwise):
    """fwd and dgrad pick scaled_mm tensorwise, wgrad picks FBGEMM rowwise (faster alone)."""
    return [
        evidence(TENSORWISE, role=FWD, time=(0.8, 0.7, 0.9)),
        evidence(TENSORWISE, role=DGRAD, time=(0.8, 0.7, 0.9)),
        evidence(FBGEMM_ROWWISE, role=WGRAD, time=(0.9, 0.85, 0.95)),
        evidence(TENSORWISE, role=WGRAD, **{"time": (1.2, 1.1, 1.3), **wgrad_tensorwise}),
    ]


def test_share_quantizations_puts_backward_gemms_on_the_forwards_tensorwise_backend():
    plan = decide(_mixed_pool(), {"dense.0": (64, 32, 16)}, source="policy/probe", **GATES)
    assert plan.layers["dense.0"].kernels == LayerKernels(TENSORWISE, TENSORWISE, FBGEMM_ROWWISE)
    shared = share_quantizations(plan, **GATES).layers["dense.0"]
    assert shared.kernels == LayerKernels.uniform(TENSORWISE)
    wgrad = shared.roles[WGRAD]
    assert wgrad.evidence.candidate == TENSORWISE and wgrad.considered == plan.layers["dense.0"].roles[WGRAD].considered
    assert wgrad.reason.startswith("shares the forward's tensorwise quantization (compiled)")
    assert "alone fbgemm:rowwise was 2.22x" in wgrad.reason and wgrad.source == "policy/probe"
    assert shared.roles[FWD] == plan.layers["dense.0"].roles[FWD]  # untouched


def test_share_quantizations_takes_the_fastest_admissible_accumulation_twin():
    pool = _mixed_pool() + [evidence(TENSORWISE_FAST, role=WGRAD, time=(1.0, 0.95, 1.05))]
    plan = share_quantizations(decide(pool, {"dense.0": (64, 32, 16)}, source="policy/probe", **GATES), **GATES)
    assert plan.layers["dense.0"].roles[WGRAD].choice == TENSORWISE_FAST  # same operands: shares too


@pytest.mark.parametrize("wgrad_tensorwise, max_noise_ratio", [
    ({"error": (0.3, 0.25, 0.35)}, 0.0),  # inaccurate
    ({"time": (1.95, 1.9, 2.0)}, 0.0),  # not 1.05x faster than bf16
    ({}, 0.1),  # over the noise-ratio bound (below)
])  # fmt: skip
def test_share_quantizations_keeps_the_own_pick_when_the_shared_kernel_fails_a_gate(wgrad_tensorwise, max_noise_ratio):
    pool = _mixed_pool(**wgrad_tensorwise)
    if max_noise_ratio:
        pool[-1] = dataclasses.replace(pool[-1], noise_ratio=Interval(0.2, 0.15, 0.3, 6, "t95"))
    gates = dict(GATES, max_noise_ratio=max_noise_ratio)
    plan = decide(pool, {"dense.0": (64, 32, 16)}, source="policy/probe", **gates)
    assert share_quantizations(plan, **gates) == plan


def test_share_quantizations_needs_a_tensorwise_forward_and_leaves_bf16_roles():
    rowwise_fwd = [
        evidence(ROWWISE, role=FWD, time=(0.8, 0.7, 0.9)),
        evidence(TENSORWISE, role=FWD, time=(0.9, 0.85, 0.95)),
        evidence(FBGEMM_ROWWISE, role=WGRAD, time=(0.9, 0.85, 0.95)),
        evidence(TENSORWISE, role=WGRAD, time=(1.2, 1.1, 1.3)),
    ]
    plan = decide(rowwise_fwd, {"dense.0": (64, 32, 16)}, source="policy/probe", **GATES)
    assert share_quantizations(plan, **GATES) == plan  # forward rowwise: nothing to share
    other_backend = [evidence(TENSORWISE, role=FWD), evidence(FBGEMM_ROWWISE, role=WGRAD),
                     evidence(KernelChoice("fbgemm", "tensorwise"), role=WGRAD, time=(1.2, 1.1, 1.3))]  # fmt: skip
    plan = decide(other_backend, {"dense.0": (64, 32, 16)}, source="policy/probe", **GATES)
    assert share_quantizations(plan, **GATES) == plan  # another backend's tensorwise shares nothing
    # dgrad has no evidence: it stays bf16
    assert share_quantizations(plan, **GATES).layers["dense.0"].roles[DGRAD].choice == BF16


@pytest.mark.parametrize("compiled", [False, True])
def test_compiled_dispatch_shares_quantizations(compiled, monkeypatch):
    import loka_torchrec
    import loka_torchrec.dispatch.dispatcher as dispatcher_module
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 16))
    cfg = DispatchConfig(mode="policy", plan_at_step=1, samples=2, timing_reps=1, layer_check_reps=2, compiled=compiled)
    report = loka_torchrec.apply(model, cfg)
    name = next(iter(report.dispatcher.plan.layers))
    pool = [dataclasses.replace(e, layer=name) for e in _mixed_pool()]
    real_decide = dispatcher_module.decide
    monkeypatch.setattr(dispatcher_module, "decide", lambda evidence, sizes, **kw: real_decide(pool, sizes, **kw))
    checked = []  # the layer check sees the per-GEMM picks; the sharing comes after it (compiled)
    monkeypatch.setattr(report.dispatcher, "_check_layers", lambda plan, step: (checked.append(plan), (plan, []))[1])
    model(torch.randn(64, 32)).sum().backward()
    report.dispatcher.on_step_end(1)
    per_gemm = LayerKernels(TENSORWISE, TENSORWISE, FBGEMM_ROWWISE)
    assert [p.layers[name].kernels for p in checked] == [per_gemm]
    expected = LayerKernels.uniform(TENSORWISE) if compiled else per_gemm
    assert report.dispatcher.plan.layers[name].kernels == expected


# ------------------------------------------------------------------------------------- DispatchPlan
def _plan() -> DispatchPlan:
    """A plan with policy decisions (with evidence), bf16 rejections and a static decision."""
    layers = {"dense.0": (64, 32, 16), "dense.1": (64, 16, 8)}
    pool = [
        evidence(ROWWISE, role=FWD),
        evidence(TENSORWISE, role=FWD, error=(0.3, 0.2, 0.4)),
        evidence(TENSORWISE, role=DGRAD, time=(0.5, 0.4, 0.6)),
        evidence(ROWWISE, role=WGRAD, time=(1.95, 1.9, 2.0)),
        evidence(ROWWISE, layer="dense.1", role=DGRAD, size=(64, 16, 8), time=(1.0, 0.9, math.inf)),
    ]
    plan = decide(pool, layers, source="policy/random", step=3, device="cpu", **GATES)
    static = LayerPlan("over.linear", 8, 1, 0, {role: RoleDecision(BLOCKWISE, "static", "static") for role in GemmRole})
    return dataclasses.replace(plan, layers={**plan.layers, "over.linear": static})


def _with_choice(plan: DispatchPlan, layer: str, role: GemmRole, choice: KernelChoice, reason=None) -> DispatchPlan:
    old = plan.layers[layer].roles[role]
    new_role = dataclasses.replace(old, choice=choice, reason=old.reason if reason is None else reason)
    new_layer = dataclasses.replace(plan.layers[layer], roles={**plan.layers[layer].roles, role: new_role})
    return dataclasses.replace(plan, layers={**plan.layers, layer: new_layer})



def test_grad_weight_real_rows_are_gated_by_their_noise_ratio_not_only_by_mere():
    quiet = dataclasses.replace(evidence(ROWWISE, role=WGRAD), noise_ratio=Interval(0.01, 0.005, 0.02, 6, "t95"))
    loud = dataclasses.replace(evidence(TENSORWISE, role=WGRAD, time=(0.8, 0.7, 0.9)), noise_ratio=Interval(0.1, 0.0, 0.3, 6, "t95"))
    # The faster candidate adds up to 0.3 of the gradient's batch noise: over the bound of 0.1.
    d = decide_role([quiet, loud], source="policy/probe", max_noise_ratio=0.1, **GATES)
    assert d.choice == ROWWISE
    assert "noise ratio 0.01 (hi 0.02 <= 0.1)" in d.reason
    alone = decide_role([loud], source="policy/probe", max_noise_ratio=0.1, **GATES)
    assert alone.choice == BF16 and alone.reason == "none accurate enough: best scaled_mm:tensorwise noise ratio hi 0.3 > 0.1"
    # 0: the noise ratio gates nothing; the MERE gate still does.
    assert decide_role([loud], source="policy/probe", max_noise_ratio=0.0, **GATES).choice == TENSORWISE
    high_mere = dataclasses.replace(quiet, error=Interval(0.3, 0.25, 0.35, 8, "t95"))
    assert decide_role([high_mere], source="policy/probe", max_noise_ratio=0.1, **GATES).reason.endswith("MERE hi 0.3500 >= 0.2")
    # The ratio travels with the evidence through JSON.
    assert CandidateEvidence.from_dict(json.loads(json.dumps(quiet.to_dict()))) == quiet
    assert CandidateEvidence.from_dict({**evidence().to_dict(), "noise_ratio": None}).noise_ratio is None

def test_plan_json_round_trip_preserves_everything():
    plan = _plan()
    restored = DispatchPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert restored == plan
    for name, layer in plan.layers.items():
        for role, decision in layer.roles.items():
            got = restored.layers[name].roles[role]
            assert (got.choice, got.reason, got.source) == (decision.choice, decision.reason, decision.source)
            assert got.evidence == decision.evidence and got.considered == decision.considered
    assert restored.layers["dense.0"].roles[FWD].evidence.sqnr_db == Interval(28.0, 27.5, 28.5, 8, "t95")
    d = plan.to_dict()
    assert d["format_version"] == PLAN_FORMAT_VERSION and d["digest"] == plan.digest()


def test_plan_save_load_round_trip(tmp_path):
    plan = _plan()
    path = tmp_path / "run" / "nested" / "plan.json"  # folders are created
    plan.save(str(path))
    assert DispatchPlan.load(str(path)) == plan


def test_plan_digest_is_stable_and_covers_choices_only():
    plan = _plan()
    digest = plan.digest()
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert _plan().digest() == digest
    assert DispatchPlan.from_dict(plan.to_dict()).digest() == digest
    reordered = dataclasses.replace(plan, layers=dict(reversed(list(plan.layers.items()))))
    assert reordered.digest() == digest
    assert _with_choice(plan, "dense.1", WGRAD, ROWWISE).digest() != digest
    assert _with_choice(plan, "dense.0", FWD, TENSORWISE).digest() != digest
    # Reasons, evidence and metadata do not change behaviour, so not the digest.
    assert _with_choice(plan, "dense.0", FWD, ROWWISE, reason="edited").digest() == digest
    assert dataclasses.replace(plan, step=99, device="cuda", mode="pinned").digest() == digest


def test_plan_from_dict_rejects_a_tampered_digest():
    d = _plan().to_dict()
    d["digest"] = "0" * 64
    with pytest.raises(ValueError, match="'digest' does not match"):
        DispatchPlan.from_dict(d)
    # A choice edited by hand, with the old digest left in place.
    d = _plan().to_dict()
    d["layers"]["dense.1"]["roles"]["wgrad"]["choice"] = "scaled_mm:rowwise"
    with pytest.raises(ValueError, match="'digest' does not match"):
        DispatchPlan.from_dict(d)
    # Without a digest field there is nothing to check.
    del d["digest"]
    assert DispatchPlan.from_dict(d).layers["dense.1"].kernels.wgrad == ROWWISE


def test_plan_from_dict_rejects_other_format_versions_and_shapes():
    d = _plan().to_dict()
    d["format_version"] = PLAN_FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=f"format_version {PLAN_FORMAT_VERSION + 1} is not supported"):
        DispatchPlan.from_dict(d)
    for bad in ([], {"mode": "pinned"}):
        with pytest.raises(ValueError, match="'layers' field"):
            DispatchPlan.from_dict(bad)


def test_plan_load_errors(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=r"dispatch\.plan_path: no plan file at .*nope\.json"):
        DispatchPlan.load(str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text('{"layers": {')
    with pytest.raises(ValueError, match=r"dispatch\.plan_path: .*broken\.json.* is not valid JSON"):
        DispatchPlan.load(str(broken))
    tampered = tmp_path / "tampered.json"
    d = _plan().to_dict()
    d["layers"]["dense.0"]["roles"]["fwd"]["choice"] = "bf16:hp"
    tampered.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="digest"):
        DispatchPlan.load(str(tampered))


def test_plan_table_lists_every_layer_role_and_kernel():
    plan = _plan()
    table = plan.table()
    for name, layer in plan.layers.items():
        assert name in table
        # rows 0 means "not known when planned" and shows as "?"
        assert f"{layer.rows or '?'} x {layer.in_features} -> {layer.out_features}" in table
        for role, decision in layer.roles.items():
            assert str(decision.choice) in table
    for role in GemmRole:
        assert role.value in table
    assert "no evidence" in table and "none fast enough" in table
    # The chosen candidate's MERE and its upper bound are shown.
    assert "0.0500 (0.0600)" in table
    assert table.rstrip().endswith(plan.summary())


def test_plan_counts_summary_and_kernels():
    plan = _plan()
    # dense.0: fwd rowwise, dgrad tensorwise, wgrad bf16; dense.1: all bf16; over.linear: 3x blockwise.
    assert plan.counts() == {"bf16:hp": 4, "emulated:blockwise": 3, "scaled_mm:rowwise": 1, "scaled_mm:tensorwise": 1}
    assert plan.fp8_gemm_count() == 5
    assert plan.summary() == "5/9 GEMMs planned in FP8 (bf16:hp x4, emulated:blockwise x3, scaled_mm:rowwise x1, scaled_mm:tensorwise x1)"
    assert plan.kernels() == {
        "dense.0": LayerKernels(ROWWISE, TENSORWISE, BF16),
        "dense.1": LayerKernels(BF16, BF16, BF16),
        "over.linear": LayerKernels.uniform(BLOCKWISE),
    }
    partial = LayerPlan("x", 4, 4, 0, {FWD: RoleDecision(ROWWISE, "r", "static")})
    assert partial.kernels == LayerKernels(ROWWISE, BF16, BF16)  # a missing role runs bf16


def test_plan_save_replaces_atomically_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "plan.json"
    first = _plan()
    first.save(str(path))
    assert os.listdir(tmp_path) == ["plan.json"]
    second = _with_choice(first, "dense.1", FWD, TENSORWISE)
    second.save(str(path))
    assert os.listdir(tmp_path) == ["plan.json"]
    assert DispatchPlan.load(str(path)) == second


def test_plan_save_failure_keeps_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    plan = _plan()
    plan.save(str(path))
    before = path.read_bytes()

    def fail_halfway(obj, f, **kwargs):
        f.write('{"layers": {')
        raise OSError("disk full")

    plan_module = importlib.import_module("loka_torchrec.dispatch.plan")
    monkeypatch.setattr(plan_module.json, "dump", fail_halfway)
    with pytest.raises(OSError, match="disk full"):
        _with_choice(plan, "dense.1", FWD, TENSORWISE).save(str(path))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["plan.json"]
    assert DispatchPlan.load(str(path)) == plan


# ------------------------------------------------------------------------------------- measure
def test_mean_interval_covers_the_true_mean_about_95_percent():
    rng = np.random.default_rng(1234)
    mu, trials, n = 3.7, 400, 8
    covered = 0
    for _ in range(trials):
        interval = mean_interval(rng.normal(mu, 1.0, size=n).tolist())
        covered += interval.low <= mu <= interval.high
    # Binomial(400, 0.95) has a standard deviation of 1.1%: [0.92, 0.98] is about +-2.7 sigma.
    assert 0.92 <= covered / trials <= 0.98


def test_mean_interval_is_the_student_t_interval():
    values = [1.0, 2.0, 4.0, 7.0, 3.5]
    interval = mean_interval(values)
    mean, sd = np.mean(values), np.std(values, ddof=1)
    half = stats.t.ppf(0.975, len(values) - 1) * sd / math.sqrt(len(values))
    assert (interval.n, interval.method) == (5, "t95")
    assert interval.value == pytest.approx(mean, rel=1e-12)
    assert interval.low == pytest.approx(mean - half, rel=1e-3)
    assert interval.high == pytest.approx(mean + half, rel=1e-3)
    assert mean_interval([2.5]) == Interval(2.5, 2.5, 2.5, 1, "none")
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])


def test_t_quantile_975_matches_the_t_distribution():
    for df in range(1, 31):  # the table: three decimals
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4)
    assert t_quantile_975(0) == math.inf
    assert t_quantile_975(1) == 12.706 and t_quantile_975(30) == 2.042


def test_t_quantile_975_beyond_the_table_is_within_the_documented_2_percent():
    # The docstring promises "error < 2%" beyond 30 degrees of freedom.
    for df in range(31, 400):
        exact = stats.t.ppf(0.975, df)
        assert abs(t_quantile_975(df) / exact - 1) < 0.02, f"df={df}: {t_quantile_975(df)} vs {exact:.4f}"


@pytest.mark.parametrize("reps", [1, 2, 7])
def test_time_ms_returns_an_ordered_interval(reps):
    calls = []
    x = torch.randn(32, 32)

    def fn():
        calls.append(1)
        return x @ x

    interval = time_ms(fn, reps=reps, device=torch.device("cpu"), warmup=2)
    assert len(calls) == reps + 2
    assert isinstance(interval, Interval)
    assert (interval.n, interval.method) == (reps, "iqr")
    assert 0 <= interval.low <= interval.value <= interval.high
    assert math.isfinite(interval.high)


def test_non_finite_evidence_never_passes_a_gate():
    """lr=1e30 made MERE 0.0000 (hi 0.0000) from inf/NaN statistics and the plan chose FP8."""
    from loka_torchrec.dispatch.policy import decide_role

    nan = float("nan")
    zero_from_garbage = dataclasses.replace(evidence(error=(0.0, 0.0, 0.0)), note="unavailable: non-finite statistics: dense.0: the weight holds inf/NaN")
    for bad in (zero_from_garbage, evidence(error=(nan, nan, nan)), evidence(time=(nan, nan, nan))):
        decision = decide_role([bad], **GATES, source="test")
        assert decision.choice == BF16 and "non-finite evidence" in decision.reason
    # a finite candidate beside a non-finite one still wins on its own evidence
    good = evidence(TENSORWISE)
    assert decide_role([zero_from_garbage, good], **GATES, source="test").choice == TENSORWISE
