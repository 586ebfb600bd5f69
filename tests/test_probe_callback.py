"""ProbeCallback: cadence, layer discovery, evidence to Dispatch, safety valve, logs, and 2 gloo ranks."""

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loka_torchrec.evidence import BF16, CandidateEvidence, EvidenceConsumer, GemmRole, KernelChoice
from loka_torchrec.probe import ProbeCallback, ProbeConfig, canonical_fqn, probe
from loka_torchrec.probe.logs import read_rank_log, read_summary
from multirank import spawn_ranks

SMM_TW = KernelChoice("scaled_mm", "tensorwise")
SMM_RW = KernelChoice("scaled_mm", "rowwise")


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class FakeDispatch(EvidenceConsumer):
    """Records every call the Probe makes."""

    def __init__(self, layers, guarded=None):
        self.layers = layers
        self.guarded = guarded  # None: every layer (the base class's answer)
        self.calls = []
        self.evidence = []

    def guarded_layers(self):
        return super().guarded_layers() if self.guarded is None else list(self.guarded)

    def managed_layers(self):
        return self.layers

    def candidates(self, layer):
        return {role: [BF16, SMM_TW, SMM_RW] for role in GemmRole}

    def replan(self, evidence, *, source, step):
        assert all(isinstance(ev, CandidateEvidence) for ev in evidence)
        self.evidence = list(evidence)
        self.calls.append(("replan", source, step, len(evidence)))

    def fallback(self, layer, reason, *, step):
        self.calls.append(("fallback", layer, step, reason))

    def readmit(self, layer, *, step):
        self.calls.append(("readmit", layer, step))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


CFG = ProbeConfig(enabled=True, every=2, warmup_steps=4, every_after=2, monitor_budget=0.0, samples=3, speed_reps=1, max_rows_per_step=32, readmit_windows=2)


def _train(model, probe, steps, *, data=None, rank=0, start=0):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(start, steps):
        x = torch.randn(32, 16, generator=gen)
        if data is not None:
            x = data(step, x)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        probe.on_step_end(step)


def test_disabled_probe_does_nothing(tmp_path):
    model = _mlp()
    cb = ProbeCallback(model, ProbeConfig(enabled=False), run_dir=str(tmp_path))
    _train(model, cb, 3)
    cb.close()
    assert not cb.enabled and not cb.probing
    assert all(not m._forward_hooks for m in model.modules())
    assert not (tmp_path / "probe").exists()


def test_hooks_exist_only_on_probe_steps(tmp_path):
    model = _mlp()
    cfg = ProbeConfig(enabled=True, every=3, warmup_steps=7, every_after=5, monitor_budget=0.0, samples=2, speed_reps=1, max_rows_per_step=16)
    cb = ProbeCallback(model, cfg, run_dir=str(tmp_path))
    seen = []
    for step in range(20):
        hooked = bool(model[0]._forward_hooks)
        assert hooked == cb.probing
        seen.append(hooked)
        model(torch.randn(8, 16)).sum().backward()
        cb.on_step_end(step)
    cb.close()
    assert [s for s, h in enumerate(seen) if h] == [0, 3, 6, 7, 12, 17]
    assert [s for s in range(20) if cfg.is_probe_step(s)] == [0, 3, 6, 7, 12, 17]


def test_layer_discovery_strips_wrapper_prefixes(tmp_path):
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    class Dmp(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._dmp_wrapped_module = inner

    model = Dmp(Wrapper(_mlp()))
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path))
    assert cb.layer_names == ["0", "2"]
    cb.close()
    assert canonical_fqn("module._orig_mod.net.fc") == "net.fc"
    explicit = ProbeCallback(model, CFG, run_dir=str(tmp_path), layers={"head": model._dmp_wrapped_module.module[2]})
    assert explicit.layer_names == ["head"]
    explicit.close()
    with pytest.raises(TypeError, match=r"layers\['relu'\]: expected an nn.Module with a 2-D weight"):
        ProbeCallback(model, CFG, run_dir=str(tmp_path), layers={"relu": nn.ReLU()})
    with pytest.raises(TypeError, match="config: expected a ProbeConfig"):
        ProbeCallback(model, {"enabled": True}, run_dir=str(tmp_path))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="every: expected a positive int"):
        ProbeConfig(every=0)
    with pytest.raises(ValueError, match="error_basis"):
        ProbeConfig(error_basis="median")
    with pytest.raises(ValueError, match="amax_jump_ratio"):
        ProbeConfig(amax_jump_ratio=1.0)
    with pytest.raises(ValueError, match="samples: a confidence interval needs at least 2"):
        ProbeConfig(samples=1)
    assert ProbeConfig().resolved_samples("cpu") == 8 and ProbeConfig().resolved_samples("cuda") == 8
    assert ProbeConfig(samples=16).resolved_samples("cuda") == 16


def test_replan_at_the_end_of_warmup_with_evidence_for_every_layer_role_and_candidate(tmp_path):
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]})
    cb = probe(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    _train(model, cb, 3)
    assert cb.layer_state("fc1").reservoir.inputs is not None  # warm-up: real rows captured for the evidence
    _train(model, cb, 4, start=3)
    cb.close()
    assert cb.layer_state("fc1").reservoir.inputs is None  # released once the evidence is made
    assert dispatch.calls == [("replan", "probe", 3, 2 * 3 * 3)]
    keys = {(ev.layer, ev.role, ev.candidate) for ev in dispatch.evidence}
    assert keys == {(layer, role, c) for layer in ("fc1", "fc2") for role in GemmRole for c in (BF16, SMM_TW, SMM_RW)}
    for ev in dispatch.evidence:
        assert ev.source == "probe" and ev.error.method == "t95" and ev.time_ms.method == "iqr"
        if not ev.candidate.is_high_precision:
            assert 0 < ev.error.value < 0.5 and math.isfinite(ev.time_ms.value)
    fc1_fwd = next(ev for ev in dispatch.evidence if ev.layer == "fc1" and ev.role == GemmRole.FORWARD)
    assert (fc1_fwd.shape.m, fc1_fwd.shape.k, fc1_fwd.shape.n) == (32, 16, 32)


def test_errors_are_measured_with_the_consumers_forward_scaling(tmp_path):
    """A consumer whose layers scale their input by earlier calls' amax (``forward_scaling``
    "delayed") gets errors measured so: the second probe step's input, 16 times larger than the
    first's, saturates in the tensorwise forward's captured rows; rowwise is not affected."""

    class DelayedDispatch(FakeDispatch):
        forward_scaling = "delayed"

    def grown(step, x):
        return x * 16 if step == 2 else x  # probe steps: 0 and 2

    evidence = {}
    for name, consumer_type in (("current", FakeDispatch), ("delayed", DelayedDispatch)):
        model = _mlp()
        dispatch = consumer_type({"fc1": model[0]})
        cb = probe(model, dataclasses.replace(CFG, error_basis="captured"), run_dir=str(tmp_path / name), consumer=dispatch)
        _train(model, cb, 4, data=grown)
        cb.close()
        evidence[name] = {(ev.role, ev.candidate): ev.error.value for ev in dispatch.evidence}
    fwd_tw, fwd_rw = (GemmRole.FORWARD, SMM_TW), (GemmRole.FORWARD, SMM_RW)
    assert evidence["delayed"][fwd_tw] > 2 * evidence["current"][fwd_tw], evidence
    assert evidence["delayed"][fwd_rw] == evidence["current"][fwd_rw]


def test_a_consumer_that_declares_nothing_of_its_training_gets_the_base_class_defaults(tmp_path):
    """``grad_format``, ``times_in_graphs`` and ``forward_scaling`` are declared on
    ``EvidenceConsumer``: a consumer that does not override them is timed with E4M3 gradients on
    eager layers, and so is a Probe without a consumer."""
    assert (EvidenceConsumer().grad_format, EvidenceConsumer().times_in_graphs) == ("e4m3", False)
    for consumer in (FakeDispatch, None):
        model = _mlp()
        cb = probe(model, CFG, run_dir=str(tmp_path / str(consumer)), consumer=consumer and consumer({"fc1": model[0]}))
        _train(model, cb, 4)
        cb.close()
        cache = cb._evaluator.speed_cache
        assert cb.planned and cache.grad_format == "e4m3" and cache.device_time is False


def _shifted(spike_step, kind):
    def data(step, x):
        if step == spike_step:
            return x * 1e3 if kind == "spike" else x.index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan")))
        return x

    return data


def test_safety_valve_trips_on_a_distribution_shift_and_readmits_after_it_settles(tmp_path, caplog):
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]})
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    with caplog.at_level("WARNING", logger="loka_torchrec.probe"):
        _train(model, cb, 12, data=_shifted(6, "spike"))
    cb.close()
    fallbacks = [c for c in dispatch.calls if c[0] == "fallback"]
    assert {c[1] for c in fallbacks} == {"fc1", "fc2"} and {c[2] for c in fallbacks} == {6}
    assert "act amax_jump" in fallbacks[0][3] and "reference" in fallbacks[0][3]
    assert any("falls back to bf16" in r.message and "amax_jump" in r.message for r in caplog.records)
    # steps 8 and 10 are clean probe steps: re-evaluated and readmitted at step 10
    assert [c for c in dispatch.calls if c[0] == "readmit"] == [("readmit", "fc1", 10), ("readmit", "fc2", 10)]
    records, _ = read_rank_log(tmp_path / "probe" / "rank0.jsonl")
    tripped = [r for r in records if r["event"] == "fallback"]
    assert len(tripped) == 2 and all(t["triggers"][0]["signal"] == "amax_jump" for t in tripped)
    trig = tripped[0]["triggers"][0]
    assert float(trig["value"]) > float(trig["bound"]) == pytest.approx(CFG.amax_jump_ratio * float(trig["reference"]))
    summary, problem = read_summary(tmp_path / "probe" / "summary.json")
    assert problem is None and [e["event"] for e in summary["layers"]["fc1"]["events"]] == ["fallback", "readmit"]


def test_a_layer_that_runs_bf16_has_its_triggers_logged_but_does_not_fall_back(tmp_path):
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]}, guarded=["fc1"])
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    _train(model, cb, 8, data=_shifted(6, "spike"))
    cb.close()
    assert [c[:3] for c in dispatch.calls if c[0] == "fallback"] == [("fallback", "fc1", 6)]
    records, _ = read_rank_log(tmp_path / "probe" / "rank0.jsonl")
    (fc2,) = [r for r in records if r["layer"] == "fc2" and r["step"] == 6]
    assert fc2["event"] == "probe" and fc2["state"] == "planned"
    assert any(t["signal"] == "amax_jump" for t in fc2["triggers"])


class _Gain(nn.Module):
    """Multiplies its input by ``factor`` (set between steps: a shift that only the layers after it see)."""

    factor = 1.0

    def forward(self, x):
        return x * self.factor


def _deep_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), _Gain(), nn.Linear(32, 8))


def _heavy_tailed_batch(step_with_outliers):
    """At ``step_with_outliers``, two rows of the batch carry one large value each: every layer's
    kurtosis jumps while its amax stays within the amax-jump bound (a heavy-tailed batch)."""

    def data(step, x):
        if step == step_with_outliers:
            x[0, 3], x[7, 11] = 30.0, -30.0
        return x

    return data


def _layers(model):
    return {"fc1": model[0], "fc2": model[2], "fc3": model[4], "fc4": model[6]}


def test_a_kurtosis_spike_that_the_bf16_layers_show_too_is_a_batch_event_and_trips_nothing(tmp_path, caplog, capsys):
    model = _deep_mlp()
    dispatch = FakeDispatch(_layers(model), guarded=["fc1"])  # fc2..fc4 run bf16 by plan
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    with caplog.at_level("WARNING", logger="loka_torchrec.probe"):
        _train(model, cb, 8, data=_heavy_tailed_batch(6))
    cb.close()
    assert [c for c in dispatch.calls if c[0] == "fallback"] == []
    records, _ = read_rank_log(tmp_path / "probe" / "rank0.jsonl")
    (fc1,) = [r for r in records if r["layer"] == "fc1" and r["step"] == 6]
    spikes = [t for t in fc1["triggers"] if t["signal"] == "kurtosis_spike"]
    assert spikes and all("layers that run bf16" in t["batch_event"] for t in spikes)
    assert not [t for t in fc1["triggers"] if not t["batch_event"]]  # nothing else fired: the spike alone was the trip
    assert fc1["state"] == "planned"
    summary, _ = read_summary(tmp_path / "probe" / "summary.json")
    (event,) = [e for e in summary["events"] if e["event"] == "batch_event" and e["reason"].startswith("act")]
    assert event["layer"] is None and "fc1" in event["layers"] and "no layer trips" in event["reason"]
    assert any("the batch's, not FP8's" in r.message for r in caplog.records)
    from loka_torchrec.probe.inspect import main as inspect_main

    capsys.readouterr()
    assert inspect_main([str(tmp_path)]) == 0  # loka-inspect's safety valve line counts them
    out = " ".join(capsys.readouterr().out.split())  # the header lines wrap at the terminal's width
    assert "2 batch event(s), spikes the bf16 layers shared, tripped nothing (step 6)" in out


def test_the_same_spike_trips_when_the_valve_is_told_that_every_spike_trips(tmp_path):
    model = _deep_mlp()
    dispatch = FakeDispatch(_layers(model), guarded=["fc1"])
    cb = ProbeCallback(model, dataclasses.replace(CFG, batch_event_share=None), run_dir=str(tmp_path), consumer=dispatch)
    _train(model, cb, 8, data=_heavy_tailed_batch(6))
    cb.close()
    (fallback,) = [c for c in dispatch.calls if c[0] == "fallback"]
    assert fallback[1:3] == ("fc1", 6) and "kurtosis_spike" in fallback[3] and "batch event" not in fallback[3]


def test_a_spike_that_only_the_fp8_layer_shows_still_trips_it(tmp_path):
    model = _deep_mlp()
    dispatch = FakeDispatch(_layers(model), guarded=["fc4"])  # the only layer after the gain

    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000)
    for step in range(8):
        x = torch.randn(32, 16, generator=gen)
        if step == 6:  # a heavy tail in fc4's input alone: the gain multiplies a few of its entries
            mask = torch.ones(32, 32)
            mask[0, 3] = mask[7, 11] = 12.0
            model[5].factor = mask
        else:
            model[5].factor = 1.0
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        cb.on_step_end(step)
    cb.close()
    (fallback,) = [c for c in dispatch.calls if c[0] == "fallback"]
    assert fallback[1:3] == ("fc4", 6) and "act kurtosis_spike" in fallback[3] and "batch event" not in fallback[3]
    summary, _ = read_summary(tmp_path / "probe" / "summary.json")
    assert not [e for e in summary["events"] if e["event"] == "batch_event" and e["reason"].startswith("act")]


def test_batch_event_share_is_checked():
    with pytest.raises(ValueError, match="batch_event_share: expected a share in"):
        ProbeConfig(batch_event_share=1.5)


def test_with_no_layer_to_guard_monitoring_steps_are_skipped_until_one_is(tmp_path):
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]}, guarded=[])  # a plan without FP8 GEMMs
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    armed = []
    for step in range(17):
        if step == 12:
            dispatch.guarded = ["fc1"]  # a re-plan put fc1 in FP8: the step after next (14) monitors again
        armed.append(cb.probing)
        assert cb.probing == bool(model[0]._forward_hooks)
        model(torch.randn(32, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        cb.on_step_end(step)
        if step == 11:
            assert cb.monitoring_paused and not cb.is_probe_step(12)
    cb.close()
    assert [s for s, a in enumerate(armed) if a] == [0, 2, 14, 16]  # warm-up every 2 steps, then 4..12 skipped
    assert cb.monitoring_steps == [14, 16] and cb.skipped_monitoring_steps == 5
    assert not cb.monitoring_paused
    summary, _ = read_summary(tmp_path / "probe" / "summary.json")
    assert summary["skipped_monitoring_steps"] == 5


def test_safety_valve_trips_on_nan(tmp_path):
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0]})
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    _train(model, cb, 7, data=_shifted(6, "nan"))
    cb.close()
    (fallback,) = [c for c in dispatch.calls if c[0] == "fallback"]
    assert fallback[1:3] == ("fc1", 6) and "act nonfinite" in fallback[3]
    assert "not FP8-scaled" not in fallback[3] and "scales" not in fallback[3]  # a plain nn.Linear has no kernels to name


class _Kernels:
    """What Dispatch's LayerKernels offers the Probe: the kernel per GEMM role."""

    def __init__(self, **by_role):
        self.by_role = by_role

    def for_role(self, role):
        return self.by_role[GemmRole(role).value]


def test_safety_valve_names_the_recipe_that_spread_a_nan(tmp_path):
    model = _mlp()
    model[0].kernels = _Kernels(fwd=SMM_TW, dgrad=BF16, wgrad=SMM_RW)
    dispatch = FakeDispatch({"fc1": model[0]})
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    _train(model, cb, 7, data=_shifted(6, "nan"))
    cb.close()
    (fallback,) = [c for c in dispatch.calls if c[0] == "fallback"]
    reason = fallback[3]
    assert "act nonfinite: 1 inf/NaN element(s) (fwd scaled_mm:tensorwise: one scale for the whole operand, so the whole output turns NaN" in reason
    assert "wgrad scaled_mm:rowwise: rowwise scales, so NaN stays within the weight gradient entries" in reason
    # The NaN reached the output gradients too: dgrad ran bf16, which does not scale.
    assert "grad nonfinite" in reason and "dgrad bf16:hp: not FP8-scaled" in reason
    records, _ = read_rank_log(tmp_path / "probe" / "rank0.jsonl")
    (tripped,) = [r for r in records if r["event"] == "fallback"]
    act = next(t for t in tripped["triggers"] if t["tensor"] == "act")
    assert act["spread"].startswith("fwd scaled_mm:tensorwise")
    summary, _ = read_summary(tmp_path / "probe" / "summary.json")
    assert "fwd scaled_mm:tensorwise" in summary["layers"]["fc1"]["events"][0]["reason"]


def test_safety_valve_trips_on_inputs_below_the_fp8_scaling_floor(tmp_path):
    # At step 6 the inputs shrink to ~1e-15: below the 1e-12 amax floor, where FP8 flushes or
    # coarsens them and nn.Linear keeps them. amax only falls, so no other signal fires for fc1.
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0]})
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), consumer=dispatch)
    _train(model, cb, 7, data=lambda step, x: x * 1e-15 if step == 6 else x)
    cb.close()
    (fallback,) = [c for c in dispatch.calls if c[0] == "fallback"]
    assert fallback[1:3] == ("fc1", 6)
    assert "act.rowwise below_floor: 1 of the elements" in fallback[3] and "scaling floor 1e-12" in fallback[3]
    assert "act.tensorwise below_floor: 1" in fallback[3]
    records, _ = read_rank_log(tmp_path / "probe" / "rank0.jsonl")
    (tripped,) = [r for r in records if r["event"] == "fallback"]
    assert {t["signal"] for t in tripped["triggers"]} == {"below_floor"}
    probes = {r["step"]: r["stats"]["act"]["local"] for r in records if r["event"] in ("probe", "fallback")}
    assert probes[6]["below_floor"] == {"tensorwise": 1.0, "rowwise": 1.0}  # the per-rank log shows it
    assert probes[4]["below_floor"] == {"tensorwise": 0.0, "rowwise": 0.0}


def test_logs_survive_a_killed_run(tmp_path):
    model = _mlp()
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path))
    _train(model, cb, 7)
    # no close(): the process "dies"; then its last line is cut mid-write
    log = tmp_path / "probe" / "rank0.jsonl"
    lines = log.read_text().splitlines()
    complete, _ = read_rank_log(log)
    # 2 layers x (probe steps 0, 2, 4, 6 + the plan at the end of step 3)
    assert len(complete) == len(lines) == 2 * 5
    with open(log, "r+") as f:
        f.truncate(log.stat().st_size - len(lines[-1]) // 2)
    with pytest.warns(UserWarning, match="line 10: skipped an unreadable record"):
        records, problems = read_rank_log(log)
    assert len(records) == 9 and len(problems) == 1
    assert all(r["v"] == 1 and r["layer"] in ("0", "2") for r in records)
    assert [(r["step"], r["event"]) for r in records if r["layer"] == "0"] == [(0, "probe"), (2, "probe"), (3, "plan"), (4, "probe"), (6, "probe")]
    summary, problem = read_summary(tmp_path / "probe" / "summary.json")  # written atomically at every report
    assert problem is None and summary["planned"] and set(summary["layers"]) == {"0", "2"}
    json.loads((tmp_path / "probe" / "summary.json").read_text())


# ------------------------------------------------------------------------------ two gloo ranks
def _rank_worker(rank: int, init_file: str, run_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = _mlp(seed=0)  # same initial weights on both ranks, as under DDP
        dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]})
        cb = ProbeCallback(model, CFG, run_dir=run_dir, consumer=dispatch)

        def data(step, x):  # only rank 1 sees the spike; both ranks must react alike
            return x * 1e3 if (rank == 1 and step == 6) else x

        _train(model, cb, 8, data=data, rank=rank)
        cb.close()
        evidence = [ev.to_dict() for ev in dispatch.evidence]
        with open(os.path.join(run_dir, f"calls{rank}.json"), "w") as f:
            json.dump({"calls": dispatch.calls, "evidence": evidence, "rows": cb.layer_state("fc1").reference_act.count}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_decide_identically(tmp_path):
    run_dir = str(tmp_path)
    spawn_ranks(_rank_worker, (str(tmp_path / "store"), run_dir), nprocs=2)
    out = [json.loads((tmp_path / f"calls{r}.json").read_text()) for r in range(2)]
    assert out[0]["calls"] == out[1]["calls"]
    assert out[0]["evidence"] == out[1]["evidence"]  # the same evidence list on every rank
    calls = out[0]["calls"]
    assert calls[0][:3] == ["replan", "probe", 3]
    assert {(c[0], c[1], c[2]) for c in calls[1:]} == {("fallback", "fc1", 6), ("fallback", "fc2", 6)}
    assert out[0]["rows"] == 2 * 2 * 32  # reference = both ranks' rows of probe steps 0 and 2
    for r in range(2):
        records, problems = read_rank_log(tmp_path / "probe" / f"rank{r}.jsonl")
        assert not problems and {rec["rank"] for rec in records} == {r}
        spike = [rec for rec in records if rec["step"] == 6 and rec["layer"] == "fc1"][0]
        assert spike["event"] == "fallback"
        local_amax = spike["stats"]["act"]["local"]["amax"]
        assert spike["stats"]["act"]["merged"]["amax"] >= local_amax
    assert (tmp_path / "probe" / "summary.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_probe_on_cuda_measures_on_the_gpu(tmp_path):
    model = _mlp().cuda().to(torch.bfloat16)
    dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]})
    cfg = ProbeConfig(enabled=True, every=1, warmup_steps=2, samples=4, speed_reps=5)
    cb = ProbeCallback(model, cfg, run_dir=str(tmp_path), consumer=dispatch)
    for step in range(3):
        model(torch.randn(256, 16, device="cuda", dtype=torch.bfloat16)).float().pow(2).mean().backward()
        cb.on_step_end(step)
    cb.close()
    state = cb.layer_state("fc1")
    # What accumulates over probe steps is kept on the host; a step's window is updated on the GPU.
    assert state.reference_act.device.type == "cpu" and state.reference_grad.device.type == "cpu"
    assert state.reference_act.count == 2 * 256 and state.window_act.device.type == "cuda"
    assert state.weight.row_factor.device.type == "cpu" and state.weight._roots is None  # sampled from a device copy
    fwd = [ev for ev in dispatch.evidence if ev.layer == "fc1" and ev.role == GemmRole.FORWARD]
    assert fwd and all(ev.device == torch.cuda.get_device_name() for ev in fwd)
    bf16 = next(ev for ev in fwd if ev.candidate == BF16)
    assert 0 < bf16.error.value < 2**-7 and bf16.time_ms.value > 0  # bf16 against the fp32 (no TF32) reference
    for ev in fwd:
        if ev.candidate != BF16 and not ev.note.startswith("unavailable"):
            assert bf16.error.value < ev.error.value < 0.5


def test_valve_fractions_need_a_rise_beyond_sampling_noise():
    from loka_torchrec.probe.valve import check_shift

    ref = {"rows": 64, "numel": 64, "amax": 1.0, "kurtosis": 3.0, "saturation": 0.0, "underflow": {"e4m3": {"rowwise": 0.0}}}
    few = dict(ref, saturation=2 / 64, underflow={"e4m3": {"rowwise": 3 / 64}})
    assert check_shift("grad", ref, few, CFG) == []  # 2 of 64 elements: noise
    many = dict(few, numel=2**20, rows=2**14, below_floor={"tensorwise": 0.07})
    signals = sorted(t.signal for t in check_shift("grad", ref, many, CFG))
    assert signals == ["below_floor"]  # 7% of a million elements is real; 4.7% underflow is below 0.05
    # A stale (delayed) scale would clamp 3% of the elements, but every recipe scales by the
    # operand's current amax: saturation alone trips nothing, however many elements it counts.
    assert check_shift("grad", ref, dict(many, below_floor={}), CFG) == []
    assert [t.detail for t in check_shift("act", ref, dict(many, underflow={"e4m3": {"rowwise": 0.2}}), CFG) if t.signal == "underflow_rise"] == ["e4m3.rowwise"]


def test_summary_is_rewritten_only_when_it_has_news(tmp_path, monkeypatch):
    """summary.json: at the first report, the plan, a valve event, once the last rewrite is
    ``SUMMARY_INTERVAL_S`` old, and at close; not on every report."""
    import loka_torchrec.probe.reports as reports_module

    writes = []
    original = reports_module.write_json_atomic
    monkeypatch.setattr(reports_module, "write_json_atomic", lambda path, obj: (writes.append(obj["step"]), original(path, obj)))
    clock = [1000.0]  # the callback's clock, moved by hand: one second per report
    monkeypatch.setattr(reports_module.time, "perf_counter", lambda: clock[0])
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]})
    cfg = ProbeConfig(enabled=True, every=1, warmup_steps=2, every_after=1, monitor_budget=0.0, samples=2, speed_reps=1, max_rows_per_step=32)
    cb = probe(model, cfg, run_dir=str(tmp_path), consumer=dispatch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(12):  # 12 reports: the first at step 0, the plan at step 1, then quiet monitoring
        model(torch.randn(32, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        cb.on_step_end(step)
        clock[0] += 1.0
        if step == 8:
            clock[0] += reports_module.SUMMARY_INTERVAL_S  # the summary is now stale
    assert writes == [0, 1, 9]
    cb.close()
    assert writes == [0, 1, 9, 11] and read_summary(tmp_path / "probe" / "summary.json")[0]["planned"]


def test_state_dict_round_trip_resumes_a_planned_probe_without_replanning(tmp_path):
    """A resumed run keeps the plan's statistics, histories and layer states, and does not re-plan."""
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]})
    cb = probe(model, CFG, run_dir=str(tmp_path / "a"), consumer=dispatch)
    _train(model, cb, 6)  # plans at step 3, then monitors
    state = cb.state_dict()
    cb.close()
    path = tmp_path / "probe.pt"
    torch.save(state, path)

    resumed_dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]})
    resumed = ProbeCallback(model, CFG, run_dir=str(tmp_path / "b"), consumer=resumed_dispatch, start_step=6)
    resumed.load_state_dict(torch.load(path, weights_only=False))
    assert resumed.planned
    for name in ("fc1", "fc2"):
        before, after = cb.layer_state(name), resumed.layer_state(name)
        assert after.state == before.state and list(after.act_amax) == list(before.act_amax)
        assert torch.equal(after.reference_act.mean, before.reference_act.mean)
        assert after.evidence_step == before.evidence_step == 3
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(6, 12):
        model(torch.randn(32, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        resumed.on_step_end(step)
    resumed.close()
    assert not [c for c in resumed_dispatch.calls if c[0] == "replan"]  # the plan stands

    other = probe(nn.Sequential(nn.Linear(16, 8)), CFG, run_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="layers differ"):
        other.load_state_dict(state)
    other.close()


def test_layer_status_is_an_enum_inside_and_a_string_in_checkpoints_and_logs(tmp_path):
    """The layer's status is a :class:`LayerStatus`; its checkpoint and its log records hold the
    plain string, and a checkpoint's string (any earlier one's too) loads back as the enum."""
    from loka_torchrec.probe.layer_state import LayerStatus

    model = _mlp()
    cb = probe(model, CFG, run_dir=str(tmp_path / "a"), consumer=FakeDispatch({"fc1": model[0], "fc2": model[2]}))
    _train(model, cb, 6)
    cb.close()
    assert cb.layer_state("fc1").state is LayerStatus.PLANNED
    state = cb.state_dict()
    assert type(state["layers"]["fc1"]["state"]) is str and state["layers"]["fc1"]["state"] == "planned"
    records, _ = read_rank_log(tmp_path / "a" / "probe" / "rank0.jsonl")
    assert {type(rec["state"]) for rec in records} == {str} and records[0]["state"] == "warmup"
    resumed = probe(model, CFG, run_dir=str(tmp_path / "b"), consumer=FakeDispatch({"fc1": model[0], "fc2": model[2]}))
    resumed.load_state_dict(state)
    assert resumed.layer_state("fc1").state is LayerStatus.PLANNED
    state["layers"]["fc2"]["state"] = "tripped"
    with pytest.raises(ValueError, match="layer 'fc2' has state 'tripped'; expected one of warmup, planned, fallback"):
        resumed.load_state_dict(state)
    resumed.close()


def test_a_model_without_convertible_layers_warns_once_and_runs_to_the_end(tmp_path, caplog):
    """It used to die with a bare StopIteration at the end of warm-up, leaving rank0.jsonl open."""
    model = nn.Sequential(nn.ReLU(), nn.Tanh())
    cb = ProbeCallback(model, CFG, run_dir=str(tmp_path), start_step=1)
    for step in range(1, 12):
        model(torch.randn(8, 4)).sum()
        cb.on_step_end(step)
    cb.close()
    assert "no layers to probe" in caplog.text
    assert cb._log._file is None or cb._log._file.closed
    assert (tmp_path / "probe" / "summary.json").is_file()


@pytest.mark.parametrize("readmit_every, monitored, readmitted", [(2, [4, 6, 8, 14], 8), (0, [4, 10, 16], 16)])
def test_a_tripped_layer_is_monitored_again_soon_and_the_cadence_returns_after_readmission(tmp_path, readmit_every, monitored, readmitted):
    # Monitoring every 6 steps after a warm-up of 4; the spike at step 4 trips both layers. With
    # readmit_every=2 the two clean windows come at steps 6 and 8, then every 6 steps again; with
    # 0 (the usual cadence) at 10 and 16.
    config = dataclasses.replace(CFG, every_after=6, readmit_every=readmit_every)
    model = _mlp()
    dispatch = FakeDispatch({"fc1": model[0], "fc2": model[2]})
    cb = ProbeCallback(model, config, run_dir=str(tmp_path), consumer=dispatch)
    _train(model, cb, 17, data=_shifted(4, "spike"))
    cb.close()
    assert {c[2] for c in dispatch.calls if c[0] == "fallback"} == {4}
    assert [c for c in dispatch.calls if c[0] == "readmit"] == [("readmit", "fc1", readmitted), ("readmit", "fc2", readmitted)]
    assert cb.monitoring_steps == monitored


def test_readmit_every_must_be_a_nonnegative_int():
    with pytest.raises(ValueError, match="readmit_every: expected an int >= 0"):
        ProbeConfig(readmit_every=-1)
