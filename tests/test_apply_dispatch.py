"""loka_torchrec.apply and the Dispatcher: conversion, static and policy plans, ranks agreeing."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig, DispatchPlan, LayerKernels
from loka_torchrec.gemm.backends import Availability, GemmBackend, register_backend
from loka_torchrec.gemm.backends.base import BackendUnavailableError
from loka_torchrec.dispatch.dispatcher import PlanMismatchError
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.evidence import BF16, KernelChoice
from multirank import spawn_ranks


@register_backend
class _OfflineBackend(GemmBackend):
    """A backend that is never available: stands in for a GPU library on this machine."""

    name = "test_offline"
    recipes = ("rowwise",)
    devices = ("cpu", "cuda")

    def _probe(self, device):
        return Availability(False, "test library not installed")

    def quantize(self, t, spec, *, name="operand"):
        raise AssertionError("never called")

    def mm(self, a, b, recipe, out_dtype):
        raise AssertionError("never called")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 1))


def test_apply_converts_shares_parameters_and_keeps_state_dict_keys():
    model = mlp()
    keys = set(model.state_dict())
    weight = model[0].weight
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:rowwise"))
    assert [n for n, _, _ in report.converted] == ["0", "2", "4"]
    assert isinstance(model[0], LokaLinear) and model[0].weight is weight
    assert set(model.state_dict()) == keys
    assert model[0].kernels == LayerKernels.uniform(KernelChoice("scaled_mm", "rowwise"))
    assert report.dispatcher.plan.fp8_gemm_count() == 9


def test_apply_include_exclude_and_min_features():
    model = mlp()
    report = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16", exclude=("4",), min_features=40))
    assert [n for n, _, _ in report.converted] == ["2"]
    reasons = dict(report.skipped)
    assert "dispatch.exclude" in reasons["4"] and "min_features" in reasons["0"]


def test_apply_on_torchrec_dlrm_and_dcn_reaches_raw_matmul_modules():
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10, feature_names=[f"f{i}"]) for i in range(2)]
    dlrm = DLRM(EmbeddingBagCollection(tables=tables), 4, [16, 8], [16, 1])
    report = loka_torchrec.apply(dlrm, DispatchConfig(mode="all-bf16"))
    assert len(report.converted) == 4 and not any("Embedding" in n for n, _, _ in report.converted)
    dcn = DLRM_DCN(EmbeddingBagCollection(tables=tables), 4, [16, 8], [16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    report = loka_torchrec.apply(dcn, DispatchConfig(mode="all-bf16"))
    converted = {n for n, _, _ in report.converted}
    # LowRankCrossNet calls F.linear on its ParameterList entries: each is a Parameter site
    assert {"inter_arch.crossnet.V_kernels.0", "inter_arch.crossnet.W_kernels.1"} <= converted, converted
    crossnet = dcn.inter_arch.crossnet
    crossnet(torch.randn(3, crossnet.V_kernels[0].shape[1])).sum().backward()
    assert report.dispatcher.managed_layers()["inter_arch.crossnet.V_kernels.0"].last_rows == 3


def test_unknown_and_unavailable_backends():
    with pytest.raises(ValueError, match="nosuch"):
        loka_torchrec.apply(mlp(), DispatchConfig(mode="all:nosuch:rowwise"))
    with pytest.raises(BackendUnavailableError, match="test_offline.*test library not installed.*fallback=bf16"):
        loka_torchrec.apply(mlp(), DispatchConfig(mode="all:test_offline:rowwise"))
    model = mlp()
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:test_offline:rowwise", fallback="bf16"))
    assert report.dispatcher.plan.fp8_gemm_count() == 0 and model[0].kernels == LayerKernels()
    if not torch.cuda.is_available():  # the GPU-only backends, forced on a CPU: refused before anything runs
        for backend, recipe in (("fbgemm", "rowwise"), ("te", "tensorwise"), ("triton", "rowwise")):
            with pytest.raises(BackendUnavailableError, match=f"backend '{backend}' is unavailable on cpu.*fallback=bf16"):
                loka_torchrec.apply(mlp(), DispatchConfig(mode=f"all:{backend}:{recipe}"))


def test_policy_plans_after_plan_at_step_and_pinned_plan_round_trip(tmp_path):
    model = mlp()
    cfg = DispatchConfig(mode="policy", plan_at_step=1, min_speedup=0.0, samples=3, timing_reps=1)
    report = loka_torchrec.apply(model, cfg, run_dir=str(tmp_path))
    assert report.dispatcher.plan.fp8_gemm_count() == 0  # bf16 until evidence arrives
    model(torch.randn(64, 32)).sum().backward()
    report.dispatcher.on_step_end(1)
    plan = report.dispatcher.plan
    assert plan.step == 1 and plan.fp8_gemm_count() > 0
    assert all(e.source == "random" for lp in plan.layers.values() for d in lp.roles.values() for e in d.considered)
    saved = json.loads((tmp_path / "dispatch_plan.json").read_text())
    assert saved["digest"] == plan.digest()
    # pinned: a fresh model runs exactly the saved kernels
    fresh = mlp()
    pinned = loka_torchrec.apply(fresh, DispatchConfig(mode="pinned", plan_path=str(tmp_path / "dispatch_plan.json")))
    assert pinned.dispatcher.running_digest() == report.dispatcher.running_digest()
    # a plan for another model is refused
    with pytest.raises(ValueError, match="does not match the model"):
        loka_torchrec.apply(nn.Sequential(nn.Linear(4, 4)), DispatchConfig(mode="pinned", plan_path=str(tmp_path / "dispatch_plan.json")))


def test_safety_valve_fallback_and_readmit():
    model = mlp()
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:rowwise"))
    d = report.dispatcher
    d.fallback("2", "amax jumped 40x", step=7)
    assert model[2].kernels == LayerKernels() and d.fallen_back == {"2": "amax jumped 40x"}
    d.readmit("2", step=9)
    assert model[2].kernels.fwd == KernelChoice("scaled_mm", "rowwise") and not d.fallen_back
    assert [e["event"] for e in d.events] == ["fallback", "readmit"]


def test_the_valve_guards_the_layers_that_run_fp8_or_wait_to():
    fp8 = loka_torchrec.apply(mlp(), DispatchConfig(mode="all:scaled_mm:rowwise")).dispatcher
    assert fp8.guarded_layers() == ["0", "2", "4"]
    fp8.fallback("2", "amax jumped", step=7)
    assert fp8.guarded_layers() == ["0", "2", "4"]  # "2" runs bf16 and waits to be readmitted
    bf16 = loka_torchrec.apply(mlp(), DispatchConfig(mode="all-bf16")).dispatcher
    assert bf16.guarded_layers() == []
    bf16.fallback("2", "amax jumped", step=7)
    assert bf16.guarded_layers() == []  # nothing in its plan to return to


def _worker(rank, world, init_file, tamper, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = mlp()
        cfg = DispatchConfig(mode="policy", plan_at_step=1, min_speedup=0.0, samples=3, timing_reps=1)
        report = loka_torchrec.apply(model, cfg)
        model(torch.randn(16, 32)).sum().backward()
        result = {}
        try:
            if tamper and rank == 1:
                # rank 1 silently diverges from the broadcast plan: the check must catch it
                original = report.dispatcher._apply

                def diverge(plan):
                    original(plan)
                    model[0].set_kernels(LayerKernels.uniform(KernelChoice("emulated", "tensorwise")))

                report.dispatcher._apply = diverge
            report.dispatcher.on_step_end(1)
            result["digest"] = report.dispatcher.running_digest()
        except PlanMismatchError as exc:
            result["error"] = str(exc)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tamper", [False, True])
def test_two_ranks_run_the_identical_plan_or_fail_loudly(tmp_path, tamper):
    spawn_ranks(_worker, (2, str(tmp_path / "init"), tamper, str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if tamper:
        assert all("ranks run different dispatch plans" in r.get("error", "") for r in results), results
    else:
        assert results[0]["digest"] == results[1]["digest"]


def test_gradient_format_reaches_layers_and_the_probe(tmp_path):
    """``dispatch.grad_format`` is public on the Dispatcher, set on every layer, and measured by the Probe."""
    from loka_torchrec.fp8 import Fp8Format
    from loka_torchrec.probe import ProbeCallback, ProbeConfig

    model = mlp()
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise", grad_format="e5m2"))
    dispatcher = report.dispatcher
    assert dispatcher.grad_format == Fp8Format.E5M2
    assert all(layer.grad_format == Fp8Format.E5M2 for layer in dispatcher.managed_layers().values())
    probe_cfg = ProbeConfig(enabled=True, every=1, warmup_steps=1, every_after=1, monitor_budget=0.0, samples=2, speed_reps=1)
    callback = ProbeCallback(model, probe_cfg, run_dir=str(tmp_path), consumer=dispatcher)
    model(torch.randn(8, model[0].in_features)).sum().backward()
    callback.on_step_end(0)
    callback.close()
    assert callback._evaluator.speed_cache is not None and Fp8Format.parse(callback._evaluator.speed_cache.grad_format) == Fp8Format.E5M2


@register_backend
class _CountingBackend(GemmBackend):
    """Counts its availability checks (an import of a GPU library, in a real backend)."""

    name = "test_counting"
    recipes = ("rowwise",)
    devices = ("cpu", "cuda")
    checks = 0

    def _probe(self, device):
        type(self).checks += 1
        return Availability(False, "not here")

    def quantize(self, t, spec, *, name="operand"):
        raise AssertionError("never called")

    def mm(self, a, b, recipe, out_dtype):
        raise AssertionError("never called")


def test_start_checks_the_candidate_backends_before_training(monkeypatch):
    # The check imports each library: at start, not in the planning step.
    from loka_torchrec.gemm.backends import get_backend

    monkeypatch.setattr(get_backend("test_counting"), "_availability", {})  # other tests may have checked it
    monkeypatch.setattr(_CountingBackend, "checks", 0)
    report = loka_torchrec.apply(mlp(), DispatchConfig(mode="policy", candidates=("test_counting:rowwise",), fallback="bf16"))
    assert _CountingBackend.checks == 0  # apply() does not import backends
    report.dispatcher.start()
    assert _CountingBackend.checks == 1
    report.dispatcher.candidates("0")  # the plan's question: answered from the cached check
    assert _CountingBackend.checks == 1
    # a named candidate that cannot run fails at start (fallback=error), naming the backend
    strict = loka_torchrec.apply(mlp(), DispatchConfig(mode="policy", candidates=("test_offline:rowwise",)))
    with pytest.raises(BackendUnavailableError, match="test_offline"):
        strict.dispatcher.start()
