"""Plan trials: where the layers run compiled, the step judges the layer-checked and the accuracy-gated
plans, and the fastest is kept (or bf16)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch import dispatcher as dispatcher_module
from loka_torchrec.dispatch.plan import DispatchPlan, LayerPlan, RoleDecision
from loka_torchrec.dispatch.plan_trials import ACCURACY_GATED, BF16_CHOSEN, LAYER_CHECKED, PlanTrials, candidate_plans, ranked_plans
from loka_torchrec.evidence import BF16, GemmRole, KernelChoice

TW = KernelChoice("emulated", "tensorwise")


def _plan(fp8_layers, step=1, names=("a", "b", "c")):
    layers = {}
    for name in names:
        choice = TW if name in fp8_layers else BF16
        layers[name] = LayerPlan(name, 8, 8, 16, {role: RoleDecision(choice, "r", "policy/probe") for role in GemmRole})
    return DispatchPlan(layers, "policy", step)


def test_the_fastest_candidate_is_kept_and_bf16_when_none_is_faster():
    trials = PlanTrials.of(candidate_plans((LAYER_CHECKED, _plan({"a"})), (ACCURACY_GATED, _plan({"a", "b"}))))
    assert trials.labels == [LAYER_CHECKED, ACCURACY_GATED] and trials.current().fp8_gemm_count() == 3
    trials.record(10.0, 9.8, tolerance=0.02)
    assert not trials.done and trials.current().fp8_gemm_count() == 6  # the next candidate is on trial
    trials.record(10.0, 9.0, tolerance=0.02)
    assert trials.chosen == 1 and trials.current().fp8_gemm_count() == 6
    assert "kept the accuracy-gated plan: median step 9.00 ms against 10.00 ms in bf16 (layer-checked 9.80 ms)" in trials.describe()
    slower = PlanTrials.of(candidate_plans((LAYER_CHECKED, _plan({"a"})), (ACCURACY_GATED, _plan({"a", "b"}))))
    slower.record(10.0, 10.3, tolerance=0.02)
    slower.record(10.0, 10.5, tolerance=0.02)
    assert slower.chosen == BF16_CHOSEN and "returned to bf16" in slower.describe()
    # Within the tolerance a candidate ties with bf16, faster or slower, and bf16 wins the tie.
    within = PlanTrials.of(candidate_plans((LAYER_CHECKED, _plan({"a"})), (ACCURACY_GATED, _plan({"a", "b"}))))
    within.record(10.0, 9.85, tolerance=0.02)  # 1.5% faster: a tie
    within.record(10.0, 10.15, tolerance=0.02)
    assert within.chosen == BF16_CHOSEN
    assert "no candidate plan beat 10.00 ms in bf16 by more than 2% (layer-checked 9.85 ms, accuracy-gated 10.15 ms)" in within.describe()
    with pytest.raises(RuntimeError, match="every candidate was tried"):
        within.record(10.0, 9.0, tolerance=0.02)
    beyond = PlanTrials.of(candidate_plans((LAYER_CHECKED, _plan({"a"})), (ACCURACY_GATED, _plan({"a", "b"}))))
    beyond.record(10.0, 9.75, tolerance=0.02)  # 2.5% faster: beyond the tolerance
    beyond.record(10.0, 9.9, tolerance=0.02)
    assert beyond.chosen == 0
    resumed = PlanTrials.from_dict(within.to_dict())
    assert resumed.tolerance == 0.02 and resumed.describe() == within.describe()


def test_candidates_without_fp8_or_repeated_are_dropped():
    assert [label for label, _ in candidate_plans((LAYER_CHECKED, _plan(set())), (ACCURACY_GATED, _plan({"a"})))] == [ACCURACY_GATED]
    assert [label for label, _ in candidate_plans((LAYER_CHECKED, _plan({"a"})), (ACCURACY_GATED, _plan({"a"})))] == [LAYER_CHECKED]
    assert candidate_plans((LAYER_CHECKED, _plan(set())), (ACCURACY_GATED, _plan(set()))) == []
    with pytest.raises(ValueError, match="at least one candidate"):
        PlanTrials.of([])


def test_ranked_plans_add_the_layer_check_rejects_back_best_first():
    names = ["a", "b", "c", "d", "e", "f"]
    gated = _plan(set(names), names=names)
    checked = _plan({"a"}, names=names)  # the layer check kept a, sent b..f back
    records = [
        {"layer": "a", "rows": 16, "speedup": 1.2, "kept_fp8": True},
        {"layer": "b", "rows": 16, "speedup": 0.6, "kept_fp8": False},
        {"layer": "c", "rows": 16, "speedup": 0.95, "kept_fp8": False},
        {"layer": "d", "rows": 16, "speedup": 0.8, "kept_fp8": False},
        {"layer": "e", "rows": 16, "error": "RuntimeError: no kernel", "kept_fp8": False},  # never added back
        {"layer": "f", "rows": 16, "speedup": 0.9, "kept_fp8": False},
    ]
    fp8 = lambda plan: sorted(n for n, lp in plan.layers.items() if not lp.kernels.all_high_precision)  # noqa: E731
    (half,) = ranked_plans(checked, gated, records, parts=1)
    assert half[0] == "layer-ranked 2/4" and fp8(half[1]) == ["a", "c", "f"]  # 0.95 and 0.9 first
    thirds = ranked_plans(checked, gated, records, parts=2)
    assert [(label, fp8(p)) for label, p in thirds] == [("layer-ranked 2/4", ["a", "c", "f"]), ("layer-ranked 3/4", ["a", "c", "d", "f"])]
    quarters = ranked_plans(checked, gated, records, parts=3)
    assert [label for label, _ in quarters] == ["layer-ranked 1/4", "layer-ranked 2/4", "layer-ranked 3/4"]
    assert ranked_plans(checked, gated, records, parts=0) == []
    assert ranked_plans(checked, gated, [], parts=1) == []  # no records: nothing ranks a layer
    # Ties in speedup go to the layer with more multiply-adds (rows), then to the name.
    tied = [dict(r, speedup=0.9) for r in records[1:4]]
    tied[2]["rows"] = 64  # d
    (tie,) = ranked_plans(checked, gated, tied, parts=2)[:1]
    assert fp8(tie[1]) == ["a", "d"]  # 1 of 3 (ceil(3 / 3)): d has the most rows
    # In order of trial: layer-checked, the ranked ones, accuracy-gated; all are plans with FP8.
    labels = [label for label, _ in candidate_plans((LAYER_CHECKED, checked), *thirds, (ACCURACY_GATED, gated))]
    assert labels == [LAYER_CHECKED, "layer-ranked 2/4", "layer-ranked 3/4", ACCURACY_GATED]
    # Where the layer check kept nothing, the ranked plan is the conservative first candidate.
    nothing = _plan(set(), names=names)
    records_none = [dict(r, kept_fp8=False) for r in records]
    labels = [label for label, _ in candidate_plans((LAYER_CHECKED, nothing), *ranked_plans(nothing, gated, records_none, 1),
                                                    (ACCURACY_GATED, gated))]  # fmt: skip
    assert labels == ["layer-ranked 3/5", ACCURACY_GATED]


def test_what_the_gradient_check_demotes_in_the_broadest_plan_is_demoted_in_every_candidate():
    trials = PlanTrials.of(candidate_plans((LAYER_CHECKED, _plan({"a"})), (ACCURACY_GATED, _plan({"a", "b"}))))
    broadest = trials.broadest()
    assert broadest.fp8_gemm_count() == 6
    checked_layers = dict(broadest.layers)
    demoted = RoleDecision(BF16, "gradient check: hurts b's weight gradient", "policy/grad_check")
    roles = dict(checked_layers["a"].roles)
    roles[GemmRole.FORWARD] = demoted
    checked_layers["a"] = dataclasses.replace(checked_layers["a"], roles=roles)
    trials.demote_like(broadest, dataclasses.replace(broadest, layers=checked_layers))
    for plan in trials.candidates:
        decision = plan.layers["a"].roles[GemmRole.FORWARD]
        assert decision.choice == BF16 and decision.reason.startswith("gradient check")
    assert [p.fp8_gemm_count() for p in trials.candidates] == [2, 5]


def test_trials_round_trip_through_their_dict():
    trials = PlanTrials.of(candidate_plans((LAYER_CHECKED, _plan({"a"})), (ACCURACY_GATED, _plan({"a", "b"}))))
    trials.record(10.0, 9.5, tolerance=0.02)
    back = PlanTrials.from_dict(json.loads(json.dumps(trials.to_dict())))
    assert back.index == 1 and back.medians == [(10.0, 9.5), None] and back.chosen is None
    assert [p.digest() for p in back.candidates] == [p.digest() for p in trials.candidates]


# ------------------------------------------------------------------ through the dispatcher
def _compiled_dispatcher(tmp_path, monkeypatch, window=3, confirm=False):
    """A dispatcher of a 3-layer model planning from random evidence as a compiled job does, whose
    layer check keeps only the first layer in FP8 (so the accuracy-gated plan differs from it);
    ``confirm``: ``dispatch.confirm_trials`` (off: the trials alone)."""
    def layer_check_keeping_the_first(plan, layers, **kwargs):
        first = sorted(plan.layers)[0]
        checked = {name: (lp if name == first else dataclasses.replace(lp, roles={
            role: RoleDecision(BF16, "layer check: slower alone", "policy/layer_check") for role in lp.roles}))
            for name, lp in plan.layers.items()}  # fmt: skip
        return dataclasses.replace(plan, layers=checked), []

    monkeypatch.setattr(dispatcher_module, "check_plan_layers", layer_check_keeping_the_first)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 16))
    cfg = DispatchConfig(mode="policy", plan_at_step=1, min_speedup=0.0, samples=3, timing_reps=1, step_guard_window=window,
                         layer_check_reps=1, candidates=("scaled_mm:tensorwise",), compiled=True, confirm_trials=confirm)  # fmt: skip
    report = loka_torchrec.apply(model, cfg, run_dir=str(tmp_path))
    model(torch.randn(64, 32)).sum().backward()
    return model, report.dispatcher


def _run_window(d, first_step, ms, window=3, settle=5):
    return [d.observe_step_time(step, ms) for step in range(first_step, first_step + settle + window)]


@pytest.mark.parametrize("checked_ms, gated_ms, kept", [(9.5, 8.0, ACCURACY_GATED), (8.0, 9.5, LAYER_CHECKED), (10.6, 10.4, None)])
def test_the_dispatcher_tries_both_plans_and_keeps_the_fastest(tmp_path, monkeypatch, checked_ms, gated_ms, kept):
    model, d = _compiled_dispatcher(tmp_path, monkeypatch)
    for step in range(1, 4):
        d.observe_step_time(step, 10.0)  # bf16 before the plan
    d.on_step_end(1)
    trials = d.trials
    assert trials is not None and trials.labels == [LAYER_CHECKED, ACCURACY_GATED]
    checked, gated = (p.fp8_gemm_count() for p in trials.candidates)
    assert 0 < checked < gated
    assert d.plan.fp8_gemm_count() == checked and d.in_force().fp8_gemm_count() == checked  # the layer-checked plan first
    assert d.plan_to_check.fp8_gemm_count() == gated  # the gradient check must see the broadest
    _run_window(d, 4, checked_ms)
    assert d.plan.fp8_gemm_count() == gated and d.in_force().fp8_gemm_count() == gated  # then the accuracy-gated one
    _run_window(d, 12, gated_ms)
    assert trials.done
    if kept is None:
        assert d.in_force().fp8_gemm_count() == 0 and "returned to bf16" in d.step_guard_reason
    else:
        assert d.step_guard_reason is None and trials.labels[trials.chosen] == kept
        assert d.in_force().fp8_gemm_count() == (gated if kept == ACCURACY_GATED else checked)
    model(torch.randn(8, 32)).sum().backward()  # the kept kernels run
    events = [json.loads(line) for line in (tmp_path / "dispatch_events.jsonl").read_text().splitlines()]
    assert [e["candidate"] for e in events if e["event"] == "plan_trial"] == [LAYER_CHECKED, ACCURACY_GATED]
    (selected,) = [e for e in events if e["event"] == "plan_selected"]
    assert selected["chosen"] == kept
    in_force = d.in_force().fp8_gemm_count()
    assert all(v is None for v in _run_window(d, 20, 50.0))  # no verdict after the trials: the choice stands
    assert d.in_force().fp8_gemm_count() == in_force


def _ranked_dispatcher(tmp_path, monkeypatch, window=3):
    """A compiled dispatcher of a 4-layer model whose layer check keeps the first layer and ranks
    the others, with times, as the real check records them."""
    speedups = {"2": 0.9, "4": 0.6, "6": 0.8}

    def layer_check_with_records(plan, layers, **kwargs):
        checked, records = {}, []
        for name, lp in plan.layers.items():
            keep = name == "0"
            records.append({"layer": name, "rows": 64, "fp8_ms": 1.0, "bf16_ms": speedups.get(name, 1.2),
                            "speedup": speedups.get(name, 1.2), "speedup_low": speedups.get(name, 1.2), "kept_fp8": keep})  # fmt: skip
            checked[name] = lp if keep else dataclasses.replace(lp, roles={
                role: RoleDecision(BF16, "layer check: slower alone", "policy/layer_check") for role in lp.roles})  # fmt: skip
        return dataclasses.replace(plan, layers=checked), records

    monkeypatch.setattr(dispatcher_module, "check_plan_layers", layer_check_with_records)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    cfg = DispatchConfig(mode="policy", plan_at_step=1, min_speedup=0.0, samples=3, timing_reps=1, step_guard_window=window,
                         layer_check_reps=1, candidates=("scaled_mm:tensorwise",), compiled=True, ranked_trials=1,
                         confirm_trials=False)  # fmt: skip
    report = loka_torchrec.apply(model, cfg, run_dir=str(tmp_path))
    model(torch.randn(64, 32)).sum().backward()
    return model, report.dispatcher


def test_the_dispatcher_tries_the_best_ranked_rejects_between_the_two_ends(tmp_path, monkeypatch):
    model, d = _ranked_dispatcher(tmp_path, monkeypatch)
    for step in range(1, 4):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    trials = d.trials
    assert trials.labels == [LAYER_CHECKED, "layer-ranked 2/3", ACCURACY_GATED]
    fp8_layers = [sorted(n for n, lp in p.layers.items() if not lp.kernels.all_high_precision) for p in trials.candidates]
    assert fp8_layers == [["0"], ["0", "2", "6"], ["0", "2", "4", "6"]]  # 2 (0.9x alone) and 6 (0.8x), not 4 (0.6x)
    _run_window(d, 4, 9.8)
    assert trials.index == 1 and sorted(n for n, k in d.in_force().kernels.items() if not k.all_high_precision) == ["0", "2", "6"]
    _run_window(d, 12, 9.0)  # the ranked plan: the fastest
    _run_window(d, 20, 9.5)
    assert trials.done and trials.labels[trials.chosen] == "layer-ranked 2/3"
    assert "kept the layer-ranked 2/3 plan: median step 9.00 ms against 10.00 ms in bf16" in trials.describe()
    assert d.in_force().fp8_gemm_count() == 9
    model(torch.randn(8, 32)).sum().backward()  # the kept kernels run
    events = [json.loads(line) for line in (tmp_path / "dispatch_events.jsonl").read_text().splitlines()]
    assert [e["candidate"] for e in events if e["event"] == "plan_trial"] == [LAYER_CHECKED, "layer-ranked 2/3", ACCURACY_GATED]
    # Off: only the two ends are tried.
    model, d = _ranked_dispatcher(tmp_path / "off", monkeypatch)
    d.config = dataclasses.replace(d.config, ranked_trials=0)
    for step in range(1, 4):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    assert d.trials.labels == [LAYER_CHECKED, ACCURACY_GATED]
    with pytest.raises(ValueError, match="dispatch.ranked_trials: must be an int >= 0, got -1"):
        DispatchConfig(ranked_trials=-1)


def _ranked_worker(rank, world, init_file, out_dir):
    from multirank import process_group, write_result

    with process_group(rank, world, init_file):
        mp = pytest.MonkeyPatch()
        model, d = _ranked_dispatcher(Path(out_dir) / f"run{rank}", mp)
        for step in range(1, 4):
            d.observe_step_time(step, 10.0)
        d.on_step_end(1)
        write_result(out_dir, rank, {"labels": d.trials.labels, "digests": [p.digest() for p in d.trials.candidates]})
        mp.undo()


@pytest.mark.slow
def test_two_ranks_try_the_same_labelled_candidates(tmp_path):
    from multirank import spawn_ranks

    spawn_ranks(_ranked_worker, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1] and results[0]["labels"] == [LAYER_CHECKED, "layer-ranked 2/3", ACCURACY_GATED]


def test_a_checkpoint_in_the_middle_of_the_trials_resumes_them(tmp_path, monkeypatch):
    model, d = _compiled_dispatcher(tmp_path / "a", monkeypatch)
    for step in range(1, 4):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    _run_window(d, 4, 9.0)  # the layer-checked plan is judged; the accuracy-gated one is on trial
    state = json.loads(json.dumps(d.state_dict()))
    model2, d2 = _compiled_dispatcher(tmp_path / "b", monkeypatch)
    d2.load_state_dict(state)
    assert d2.trials.index == 1 and d2.plan.digest() == d.plan.digest()
    _run_window(d2, 12, 8.5)
    assert d2.trials.labels[d2.trials.chosen] == ACCURACY_GATED


@pytest.mark.parametrize("fresh_bf16_ms, again_ms, kept", [(10.0, 8.0, True), (8.0, 8.0, False)])
def test_the_fastest_candidate_is_confirmed_next_to_bf16(tmp_path, monkeypatch, fresh_bf16_ms, again_ms, kept):
    """The accuracy-gated plan wins its trial against bf16 measured before the plan (8.0 against
    10.0 ms); then every GEMM runs bf16 for a window and the candidate for another. Where the fresh
    bf16 window is as fast as the candidate (the step drifted, not FP8), bf16 is kept."""
    model, d = _compiled_dispatcher(tmp_path, monkeypatch, confirm=True)
    for step in range(1, 4):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    trials = d.trials
    gated = trials.candidates[1].fp8_gemm_count()
    _run_window(d, 4, 9.5)
    _run_window(d, 12, 8.0)
    assert not trials.done and trials.pending == 1 and trials.confirming == "bf16"
    assert d.in_force().fp8_gemm_count() == 0 and d.judging_step_times  # the fresh bf16 window
    assert "confirming it next to bf16: running in bf16 for one window" in trials.describe()
    assert all(v is None for v in _run_window(d, 20, fresh_bf16_ms))  # settle + window steps in bf16
    assert trials.confirming == "fp8" and d.in_force().fp8_gemm_count() == gated  # the candidate again
    model(torch.randn(8, 32)).sum().backward()  # its kernels run
    verdicts = _run_window(d, 28, again_ms)
    assert verdicts[-1] is not None and trials.done and trials.confirm_medians == (fresh_bf16_ms, again_ms)
    events = [json.loads(line) for line in (tmp_path / "dispatch_events.jsonl").read_text().splitlines()]
    (confirmation,) = [e for e in events if e["event"] == "plan_confirmation"]
    assert confirmation["candidate"] == ACCURACY_GATED and confirmation["kept"] is kept
    (selected,) = [e for e in events if e["event"] == "plan_selected"]
    if kept:
        assert trials.labels[trials.chosen] == ACCURACY_GATED and d.step_guard_reason is None
        assert d.in_force().fp8_gemm_count() == gated
        assert "confirmed against bf16 run next to it: 8.00 ms against 10.00 ms" in selected["summary"]
    else:
        assert trials.chosen == BF16_CHOSEN and d.in_force().fp8_gemm_count() == 0
        assert "but not faster by more than 2% when run again next to bf16 (8.00 ms against 8.00 ms)" in d.step_guard_reason
    assert all(v is None for v in _run_window(d, 36, 50.0))  # the choice stands


def test_no_confirmation_where_no_candidate_beat_bf16(tmp_path, monkeypatch):
    model, d = _compiled_dispatcher(tmp_path, monkeypatch, confirm=True)
    for step in range(1, 4):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    _run_window(d, 4, 10.5)
    _run_window(d, 12, 10.1)
    assert d.trials.done and d.trials.chosen == BF16_CHOSEN and d.trials.pending is None
    assert d.in_force().fp8_gemm_count() == 0


def test_a_checkpoint_in_a_confirmations_bf16_window_resumes_it(tmp_path, monkeypatch):
    model, d = _compiled_dispatcher(tmp_path / "a", monkeypatch, confirm=True)
    for step in range(1, 4):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    _run_window(d, 4, 9.5)
    _run_window(d, 12, 8.0)
    for step in range(20, 24):  # 4 of the bf16 window's 5 + 3 steps
        d.observe_step_time(step, 10.0)
    state = json.loads(json.dumps(d.state_dict()))
    model2, d2 = _compiled_dispatcher(tmp_path / "b", monkeypatch, confirm=True)
    d2.load_state_dict(state)
    assert d2.trials.confirming == "bf16" and d2.trials.confirm_steps == 4 and d2.in_force().fp8_gemm_count() == 0
    for step in range(24, 28):
        d2.observe_step_time(step, 10.0)
    assert d2.trials.confirming == "fp8" and d2.in_force().fp8_gemm_count() == d2.trials.candidates[1].fp8_gemm_count()
    _run_window(d2, 28, 8.0)
    assert d2.trials.labels[d2.trials.chosen] == ACCURACY_GATED


def test_confirmation_bookkeeping_refuses_steps_out_of_order():
    trials = PlanTrials.of(candidate_plans((LAYER_CHECKED, _plan({"a"})), (ACCURACY_GATED, _plan({"a", "b"}))), confirm=True)
    with pytest.raises(RuntimeError, match="no bf16 confirmation window under way"):
        trials.bf16_step(3)
    trials.record(10.0, 9.0, tolerance=0.02)
    trials.record(10.0, 9.5, tolerance=0.02)
    assert trials.pending == 0 and trials.chosen is None and trials.current().digest() == trials.candidates[0].digest()
    with pytest.raises(RuntimeError, match="no candidate window to confirm"):
        trials.record_confirmation(10.0, 9.0, tolerance=0.02)
    assert [trials.bf16_step(2), trials.bf16_step(2)] == [False, True]
    back = PlanTrials.from_dict(json.loads(json.dumps(trials.to_dict())))
    assert (back.confirm, back.pending, back.confirming, back.confirm_steps) == (True, 0, "fp8", 2)
    back.record_confirmation(10.0, 9.0, tolerance=0.02)
    assert back.chosen == 0 and back.confirm_medians == (10.0, 9.0)
    with pytest.raises(ValueError, match="confirming must be null, 'bf16' or 'fp8'"):
        PlanTrials.from_dict(dict(trials.to_dict(), confirming="maybe"))


def test_eager_jobs_keep_one_plan(tmp_path, monkeypatch):
    """Eagerly the layer check timed the layers as the step runs them: no trials."""
    model, d = _compiled_dispatcher(tmp_path, monkeypatch)
    d.config = dataclasses.replace(d.config, compiled=False)
    for step in range(1, 4):
        d.observe_step_time(step, 10.0)
    d.on_step_end(1)
    assert d.trials is None and d.plan.fp8_gemm_count() == 3


def test_a_compiled_jobs_eager_probe_steps_are_not_the_guards_bf16_baseline(tmp_path):
    """Every warm-up step of a cadence-1 Probe runs eagerly: none of their times may stand for the
    compiled bf16 step the FP8 plan is compared with (the baseline fills from compiled steps only)."""
    import outside_models

    torch._dynamo.reset()
    model = outside_models.UserWukong()
    config = loka_torchrec.LokaConfig.from_dict({
        "enabled": True, "probe": {"every": 1, "warmup_steps": 100},
        "dispatch": {"min_speedup": 0.0, "layer_check_reps": 0, "grad_check": False, "step_guard_window": 4},
    })  # fmt: skip
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), compile="default", device="cpu")
    for step in range(1, 5):
        with loka.step(step):
            model(*model.batch(16, seed=step)).sum().backward()
    assert loka.dispatcher.state_dict()["guard"]["baseline"] == []
    loka.close()
    torch._dynamo.reset()


def test_the_gradient_check_is_not_data_for_the_probe(tmp_path):
    """The gradient check runs after the plan, while the Probe's hooks are already armed for the next
    (monitoring) step: its passes on its own loss must not enter that step's statistics, where their
    larger gradients tripped the safety valve on every layer."""
    import outside_models

    model = outside_models.UserWukong()
    config = loka_torchrec.LokaConfig.from_dict({
        "enabled": True, "probe": {"every": 1, "warmup_steps": 4},  # the plan at the end of step 3
        "dispatch": {"min_speedup": 0.0, "layer_check_reps": 0, "grad_check": True},
    })  # fmt: skip
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), device="cpu")
    for step in (1, 2):
        with loka.step(step):
            model(*model.batch(16, seed=step)).sum().backward()
    assert loka.dense_inputs is not None
    with loka.step(3):  # the planning step: the plan, then the gradient check
        model(*model.batch(16, seed=3)).sum().backward()
    assert loka.dispatcher.plan.step == 3 and loka.dispatcher.plan.fp8_gemm_count() > 0
    assert any(e["event"] == "grad_check" for e in loka.dispatcher.events)  # the check ran its passes
    assert loka.probe.probing  # armed for step 4 already
    for name in loka.probe.layer_names:
        state = loka.probe.layer_state(name)
        assert state.window_act.rows == 0 and state.window_grad.rows == 0, name
    loka.close()
