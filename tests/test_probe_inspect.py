"""loka-inspect on run directories written by a real ProbeCallback run and by a whole LoKA run
(prepare, Dispatcher, valve), on edited copies of them (valve, guard, gradient check) and on broken ones."""

import json
import shutil

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec.evidence import BF16, EvidenceConsumer, GemmRole, KernelChoice
from loka_torchrec.probe import ProbeCallback, ProbeConfig
from loka_torchrec.probe.inspect import main, short_kernel, short_reason

SMM_RW = KernelChoice("scaled_mm", "rowwise")


class _Dispatch(EvidenceConsumer):
    def __init__(self, layers):
        self.layers = layers

    def managed_layers(self):
        return self.layers

    def candidates(self, layer):
        return {role: [BF16, SMM_RW, KernelChoice("scaled_mm", "tensorwise")] for role in GemmRole}

    def replan(self, evidence, *, source, step):
        pass

    def fallback(self, layer, reason, *, step):
        pass

    def readmit(self, layer, *, step):
        pass


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run: 2 layers, warm-up plan at step 3, a spike at step 6 that trips both layers,
    readmitted at step 10 after two clean probe steps."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    cfg = ProbeConfig(enabled=True, every=2, warmup_steps=4, every_after=2, monitor_budget=0.0, samples=3, speed_reps=1, max_rows_per_step=32)
    cb = ProbeCallback(model, cfg, run_dir=str(root), consumer=_Dispatch({"over.fc1": model[0], "over.fc2": model[2]}))
    for step in range(11):
        x = torch.randn(32, 16) * (1e3 if step == 6 else 1.0)
        model(x).pow(2).mean().backward()
        cb.on_step_end(step)
    cb.close()
    plan = {  # the shape of Dispatch's dispatch_plan.json
        "gates": {"max_mere": 0.3, "min_speedup": 1.1},
        "layers": {"over.fc1": {"roles": {"fwd": {"choice": "scaled_mm:rowwise", "reason": "fastest within the gates"}}}},
    }
    (root / "dispatch_plan.json").write_text(json.dumps(plan))
    torch.set_num_threads(saved)
    return root


@pytest.fixture(scope="module")
def loka_run(tmp_path_factory):
    """A whole LoKA run on one process: prepare, a Probe plan at step 3 (speed gate off, so FP8 on the
    CPU), the gradient and layer checks, a spike at step 8 that trips both layers, readmitted at step 12."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("loka_run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    probe = ProbeConfig(warmup_steps=4, every=2, every_after=2, monitor_budget=0.0, samples=3, speed_reps=1, max_rows_per_step=32)
    config = loka_torchrec.LokaConfig(enabled=True, probe=probe, dispatch=loka_torchrec.DispatchConfig(min_speedup=0.0))
    loka = loka_torchrec.prepare(model, config, run_dir=str(root))
    for step in range(1, 13):
        with loka.step(step):
            model(torch.randn(32, 16) * (1e3 if step == 8 else 1.0)).pow(2).mean().backward()
    loka.close()
    torch.set_num_threads(saved)
    return root


def _copy(run_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(run_dir, dst)
    return dst


def _add_events(run, *events):
    with open(run / "dispatch_events.jsonl", "a") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")


def _view(run, capsys, monkeypatch, *args, columns=120):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main([str(run), *args]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= columns, max(out.splitlines(), key=len)
    return out


def _table(out):
    """The table's body lines: after the header's ruler, before a blank line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("----")) + 1
    body = lines[start:]
    return body[: body.index("")] if "" in body else body


def test_table_shows_layers_candidates_and_decisions(run_dir, capsys, monkeypatch):
    out = _view(run_dir, capsys, monkeypatch, columns=400)  # nothing cut
    for text in ("over.fc1", "over.fc2", "32x16->32", "smm:rw", "fastest within the gates", "gates MERE < 0.3, speedup >= 1.1"):
        assert text in out, text


@pytest.mark.parametrize("fixture", ["run_dir", "loka_run"])
def test_the_default_view_fits_120_columns_with_one_line_per_gemm(fixture, request, capsys, monkeypatch):
    run = request.getfixturevalue(fixture)
    out = _view(run, capsys, monkeypatch)
    body = _table(out)
    layers = json.loads((run / "probe" / "summary.json").read_text())["layers"]
    assert len(body) == 3 * len(layers)  # no cell wraps
    assert [line.split()[0] for line in body[::3]] == sorted(layers)
    assert [line.split()[2 if i % 3 == 0 else 0] for i, line in enumerate(body)] == ["fwd", "dgrad", "wgrad"] * len(layers)


def test_header_of_a_whole_run(loka_run, capsys, monkeypatch):
    out = _view(loka_run, capsys, monkeypatch)
    plan = json.loads((loka_run / "dispatch_plan.json").read_text())
    assert f"plan policy at step {plan['step']} on cpu" in out
    assert "FP8 GEMMs: 6/6 planned, 6/6 in force; coverage 100.0% of the linear multiply-adds per row (768/768)" in out
    assert "gradient check (step 3): passed, worst weight gradient" in out
    assert "safety valve: holds no layer (2 trip(s) so far)" in out  # tripped at step 8, readmitted at 12
    assert "step-time guard: no verdict yet" in out
    assert "comms: forward fp32, backward fp32 (auto" in out
    kernels = {line.split()[3 if i % 3 == 0 else 1] for i, line in enumerate(_table(out))}
    assert kernels <= {"smm:rw", "smm:tw"}, kernels


def test_valve_and_guard_take_fp8_back_in_force_not_in_plan(loka_run, tmp_path, capsys, monkeypatch):
    run = _copy(loka_run, tmp_path)
    plan = json.loads((run / "dispatch_plan.json").read_text())
    plan.pop("in_force", None)  # a plan file without the in-force count the dispatcher writes: the events decide
    (run / "dispatch_plan.json").write_text(json.dumps(plan))
    _add_events(run, {"event": "fallback", "step": 20, "layer": "2", "reason": "act amax_jump: 99 (reference 1, bound 8)"})
    out = _view(run, capsys, monkeypatch)
    assert "FP8 GEMMs: 6/6 planned, 3/6 in force" in out and "safety valve: holds 1 layer(s) in bf16: 2 (step 20)" in out
    body = _table(out)
    assert all("bf16 (valve)" in line for line in body[3:]) and not any("valve" in line for line in body[:3])
    assert "act amax_jump: 99" in body[3]
    # a verdict on a layer the valve readmitted sends back that layer alone, held by the guard
    _add_events(run, {"event": "readmit", "step": 40, "layer": "2"},
                {"event": "step_guard", "step": 60, "bf16_ms": 10.0, "fp8_ms": 11.0, "keep_fp8": False, "readmitted": ["2"]},
                {"event": "fallback", "step": 60, "layer": "2", "reason": "step-time guard: readmitting made the step slower"})
    out = _view(run, capsys, monkeypatch)
    assert "FP8 GEMMs: 6/6 planned, 3/6 in force" in out
    assert "step-time guard (step 60): sent the 1 layer(s) the safety valve readmitted back to bf16" in out
    valve = next(line for line in out.splitlines() if "safety valve:" in line)
    assert "safety valve: holds no layer" in valve and "the step-time guard holds 1 readmitted layer(s): 2" in valve, valve
    assert all("bf16 (guard)" in line for line in _table(out)[3:])
    _add_events(run, {"event": "step_guard", "step": 70, "bf16_ms": 10.0, "fp8_ms": 12.5, "keep_fp8": False})
    out = _view(run, capsys, monkeypatch)
    assert "FP8 GEMMs: 6/6 planned, 0/6 in force" in out
    assert "step-time guard (step 70): returned every GEMM to bf16, median step 12.5 ms with FP8 vs 10 ms in bf16" in out
    assert all("bf16 (guard)" in line for line in _table(out))
    assert main([str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"]["fp8_gemms"] == {"total": 6, "planned": 6, "in_force": 0}
    fwd = report["layers"][0]["roles"]["fwd"]
    assert fwd["in_force"] == "bf16:hp" and fwd["held_by"] == "step-time guard" and fwd["planned"].startswith("scaled_mm:")


def _trial(step, candidate, fp8_ms, keep):
    """A plan-trial window as the dispatcher logs it: the guard's verdict, then the trial's record."""
    return ({"event": "step_guard", "step": step, "bf16_ms": 10.0, "fp8_ms": fp8_ms, "keep_fp8": keep},
            {"event": "plan_trial", "step": step, "candidate": candidate, "bf16_ms": 10.0, "fp8_ms": fp8_ms, "fp8_gemms": 6})


@pytest.mark.parametrize("kept", ["layer-ranked 1/2", None])
def test_a_candidate_slower_than_bf16_in_plan_trials_turns_nothing_off(loka_run, tmp_path, capsys, monkeypatch, kept):
    """Compiled, plan trials judge each candidate in a guard window: the layer-checked plan's window
    may say "slower" while the trials keep another plan. Only the trials' choice turns FP8 off."""
    run = _copy(loka_run, tmp_path)
    plan = json.loads((run / "dispatch_plan.json").read_text())
    plan.pop("in_force", None)  # the events decide what is in force
    (run / "dispatch_plan.json").write_text(json.dumps(plan))
    _add_events(run, *_trial(40, "layer-checked", 10.5, False), *_trial(50, "layer-ranked 1/2", 9.0, True))
    out = _view(run, capsys, monkeypatch)
    assert "plan trials: under way (layer-checked 10.5 ms, layer-ranked 1/2 9 ms; bf16 10 ms)" in out
    assert "FP8 GEMMs: 6/6 planned, 6/6 in force" in out and not any("guard" in line for line in _table(out))
    summary = ("plan trials kept the layer-ranked 1/2 plan: median step 9.00 ms against 10.00 ms in bf16" if kept
               else "plan trials returned to bf16: no candidate plan beat 10.00 ms in bf16 by more than")
    _add_events(run, *_trial(60, "accuracy-gated", 9.5 if kept else 10.4, bool(kept)),
                {"event": "plan_selected", "step": 60, "chosen": kept, "summary": summary})  # fmt: skip
    out = _view(run, capsys, monkeypatch)
    assert f"plan trials (step 60): {summary}" in out
    if kept:
        assert "FP8 GEMMs: 6/6 planned, 6/6 in force" in out and not any("guard" in line for line in _table(out))
    else:
        assert "FP8 GEMMs: 6/6 planned, 0/6 in force" in out and all("bf16 (guard)" in line for line in _table(out))
    assert main([str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [t["candidate"] for t in report["status"]["plan_trials"]["candidates"]] == ["layer-checked", "layer-ranked 1/2", "accuracy-gated"]
    assert report["status"]["step_guard"]["verdicts"] == []  # the windows were the trials'
    fwd = report["layers"][0]["roles"]["fwd"]
    assert (fwd["held_by"] == "") if kept else (fwd["held_by"] == "step-time guard" and fwd["reason"] == f"at step 60: {summary}")
    why = _view(run, capsys, monkeypatch, "--why", "0")
    assert f"step 60: {summary}" in " ".join(why.split())  # the trials' choice among the layer's events


def test_the_window_that_confirms_a_trials_winner_is_the_trials_not_a_guard_verdict(loka_run, tmp_path, capsys, monkeypatch):
    """The confirmation's window (bf16 again, then the winner) is logged as a guard verdict and a
    ``plan_confirmation``: it belongs to the trials, and their ``plan_selected`` says what stands."""
    run = _copy(loka_run, tmp_path)
    plan = json.loads((run / "dispatch_plan.json").read_text())
    plan.pop("in_force", None)
    (run / "dispatch_plan.json").write_text(json.dumps(plan))
    summary = ("plan trials returned to bf16: the layer-ranked 1/2 plan ran 9.00 ms against 10.00 ms in bf16, but not "
               "faster by more than 2% when run again next to bf16 (9.00 ms against 9.00 ms)")
    _add_events(run, *_trial(40, "layer-checked", 10.5, False), *_trial(50, "layer-ranked 1/2", 9.0, True),
                {"event": "step_guard", "step": 110, "bf16_ms": 9.0, "fp8_ms": 9.0, "keep_fp8": True},
                {"event": "plan_confirmation", "step": 110, "candidate": "layer-ranked 1/2", "bf16_ms": 9.0, "fp8_ms": 9.0,
                 "kept": False},
                {"event": "plan_selected", "step": 110, "chosen": None, "summary": summary})  # fmt: skip
    out = _view(run, capsys, monkeypatch)
    assert f"plan trials (step 110): {summary}" in " ".join(out.split()) and "FP8 GEMMs: 6/6 planned, 0/6 in force" in out
    assert main([str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"]["step_guard"]["verdicts"] == []  # the confirmation's window too


def test_an_in_force_count_recorded_in_the_plan_file_is_shown(loka_run, tmp_path, capsys, monkeypatch):
    run = _copy(loka_run, tmp_path)
    plan = json.loads((run / "dispatch_plan.json").read_text())
    plan["in_force"] = {"fp8_gemms": 2}
    (run / "dispatch_plan.json").write_text(json.dumps(plan))
    assert "FP8 GEMMs: 6/6 planned, 2/6 in force" in _view(run, capsys, monkeypatch)


def test_gradient_check_demotions_and_the_noise_rule_in_the_header_and_why(loka_run, tmp_path, capsys, monkeypatch):
    run = _copy(loka_run, tmp_path)
    _add_events(
        run,
        {"event": "grad_check", "step": 30, "kind": "plan", "worst_db": 8.0, "site": "2", "fp8_roles": 6, "failing": ["2"],
         "under_floor": {"0": {"db": 9.5, "noise_ratio": 0.05, "systematic_db": 20.0}, "2": {"db": 8.0}}},
        {"event": "grad_check", "step": 30, "kind": "demote", "layer": "2", "role": "fwd", "choice": "scaled_mm:rowwise",
         "alone_db": 8.0, "damaged": "2", "worst_db_after": 9.5, "site": "0", "failing_after": []},
    )  # fmt: skip
    out = _view(run, capsys, monkeypatch)
    assert ("gradient check (step 30): passed, worst weight gradient 9.5 dB at 0; sent 1 FP8 GEMM(s) back to bf16; "
            "under the floor but passed by the noise rule: 0 9.5 dB") in " ".join(out.split())  # fmt: skip
    why = _view(run, capsys, monkeypatch, "--why", "2")
    assert "step 30: gradient check: fwd scaled_mm:rowwise back to bf16 (alone it put 2's weight gradient at 8.0 dB)" in " ".join(why.split())


def test_why_tells_everything_about_one_layer(loka_run, capsys, monkeypatch):
    why = _view(loka_run, capsys, monkeypatch, "--why", "0")
    assert "layer 0: 32 rows x 16 in -> 32 out" in why
    for text in ("statistics at the latest probe step", "input ", "output grad ", "weight ", "E4M3 underflow"):
        assert text in why, text
    for role in ("fwd", "dgrad", "wgrad"):
        assert f"\n{role}: runs scaled_mm:" in why and "planned scaled_mm:" in why
    assert why.count("  why: fastest accurate of 2") == 3 and why.count("candidates (as the decision weighed them)") == 3
    assert why.count("scaled_mm:rowwise ") >= 3 and why.count("scaled_mm:tensorwise ") >= 3
    assert "step 3: layer check: fwd+bwd" in why and "step 3: gradient check: this layer had the plan's worst weight gradient" in why
    assert "step 8: safety valve: to bf16: act amax_jump" in why and "step 12: readmitted to its planned kernels: statistics settled" in why


def test_why_names_a_missing_or_ambiguous_layer(loka_run, run_dir, capsys):
    assert main([str(loka_run), "--why", "7"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no layer '7' in this run (did you mean" in err
    assert main([str(loka_run), "--why", "*"]) == 1
    assert "--why '*' matches 2 layers (0, 2); name one" in capsys.readouterr().err
    assert main([str(run_dir), "--why", "fc2"]) == 0  # a dotted suffix that names one layer
    assert "layer over.fc2:" in capsys.readouterr().out


def test_help_explains_the_header_columns_and_abbreviations(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for term in ("FP8 GEMMs", "in force", "coverage", "gradient check", "safety valve", "step-time guard", "comms",
                 "rows x in -> out", "role", "kernel", "MERE", "speedup", "why", "--why LAYER",
                 "smm = torch._scaled_mm", "+fa = fast accumulation"):  # fmt: skip
        assert term in text, term


def test_kernel_abbreviations():
    assert short_kernel("scaled_mm:tensorwise_fast_accum") == "smm:tw+fa"
    assert short_kernel("fbgemm:triton_rowwise") == "fbg:trw" and short_kernel("te:blockwise") == "te:bw"
    assert short_kernel("bf16:hp") == "bf16" and short_kernel("other:recipe") == "other:recipe"
    assert short_reason("none fast enough: best scaled_mm:rowwise 0.9x; note: bf16:hp") == "none fast enough: best smm:rw 0.9x; note: bf16"


def test_json_report(run_dir, capsys):
    assert main([str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "summary.json" and report["gates"] == {"max_error": 0.3, "min_speedup": 1.1}
    layers = {layer["layer"]: layer for layer in report["layers"]}
    assert set(layers) == {"over.fc1", "over.fc2"}
    fc1 = layers["over.fc1"]
    assert fc1["state"] == "planned"
    assert fc1["roles"]["fwd"]["decision"] == "scaled_mm:rowwise"
    assert fc1["roles"]["fwd"]["reason"] == "fastest within the gates"
    assert fc1["roles"]["dgrad"]["decision"] == "-" and fc1["roles"]["dgrad"]["reason"] == "not in dispatch_plan.json"
    best = fc1["roles"]["fwd"]["best"]
    assert best["candidate"].startswith("scaled_mm:") and 0 < float(best["mere"]["value"]) < 0.3
    assert best["mere_captured"] is not None  # the captured-rows measurement travels along
    assert float(fc1["act_amax"]) < 100  # the latest probe step is after the spike
    assert [(e["step"], e["event"]) for e in fc1["events"]] == [(6, "fallback"), (10, "readmit")]


def test_a_layer_in_fallback_shows_bf16_over_its_plan(run_dir, tmp_path, capsys, monkeypatch):
    run = _copy(run_dir, tmp_path)
    summary = json.loads((run / "probe" / "summary.json").read_text())
    reason = "act amax_jump: 2797 (reference 2.977, bound 23.82); grad amax_jump: 2.3 (reference 0.003, bound 0.025)"
    summary["layers"]["over.fc1"].update(state="fallback", reason=reason)
    (run / "probe" / "summary.json").write_text(json.dumps(summary))
    assert main([str(run), "--json"]) == 0
    fc1 = {layer["layer"]: layer for layer in json.loads(capsys.readouterr().out)["layers"]}["over.fc1"]
    assert fc1["roles"]["fwd"]["decision"] == "bf16:hp (safety valve; planned scaled_mm:rowwise)"
    assert fc1["roles"]["dgrad"]["decision"] == "bf16:hp (safety valve)" and fc1["roles"]["dgrad"]["reason"] == reason
    out = _view(run, capsys, monkeypatch, columns=400)
    assert "safety valve: holds 1 layer(s) in bf16: over.fc1" in out  # no events file: the Probe's state
    assert "bf16 (valve)" in out and reason in out


def test_rank_view_layer_glob_and_plot(run_dir, tmp_path, capsys):
    assert main([str(run_dir), "--rank", "0", "--json", "--layer", "*fc2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "rank0.jsonl" and [layer["layer"] for layer in report["layers"]] == ["over.fc2"]
    png = tmp_path / "probe.png"
    assert main([str(run_dir), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(run_dir), "--layer", "nomatch*"]) == 1
    assert "no layer matches --layer 'nomatch*'" in capsys.readouterr().err


def test_rank_comparison_flags_a_disagreeing_rank(run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path)
    lines = (run / "probe" / "rank0.jsonl").read_text().splitlines()
    rank1 = []
    for line in lines:
        rec = json.loads(line)
        rec["rank"] = 1
        if rec.get("layer") == "over.fc2" and "stats" in rec:
            rec["stats"]["act"]["rank_deviation"]["mean_sq_z"] = 42.0  # far beyond noise
        rank1.append(json.dumps(rec))
    (run / "probe" / "rank1.jsonl").write_text("\n".join(rank1) + "\n")
    assert main([str(run), "--json"]) == 0
    ranks = {row["rank"]: row for row in json.loads(capsys.readouterr().out)["ranks"]}
    assert ranks[0]["flagged_layers"] == {}
    assert set(ranks[1]["flagged_layers"]) == {"over.fc2"} and ranks[1]["worst_ratio"] > 8
    assert main([str(run)]) == 0
    assert "over.fc2 (" in capsys.readouterr().out


def test_partial_and_corrupted_run_dirs(run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path)
    (run / "probe" / "summary.json").write_text('{"layers": {"over.fc1": ')  # killed mid-write (no atomic replace)
    log = run / "probe" / "rank0.jsonl"
    log.write_text(log.read_text()[:-40])  # truncated last line
    assert main([str(run), "--json"]) == 0
    captured = capsys.readouterr()
    assert "summary.json is unreadable" in captured.err and "skipped an unreadable record" in captured.err
    assert json.loads(captured.out)["source"] == "rank0.jsonl"
    log.write_text("not json\n{also not\n")
    assert main([str(run)]) == 1
    assert "no readable probe record" in capsys.readouterr().err
    assert main([str(run), "--rank", "5"]) == 1
    assert "no log for rank 5" in capsys.readouterr().err


def test_missing_and_empty_run_dirs(tmp_path, capsys):
    assert main([str(tmp_path / "absent")]) == 1
    assert "no such run directory" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 1
    assert "has no probe/ directory" in capsys.readouterr().err
    (tmp_path / "probe").mkdir()
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "is empty" in err and err.count("\n") == 1  # one line
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--rank", "-1"])
    assert exc.value.code == 2


def _ev(candidate, role, err, err_hi, t, t_hi, base=1.0):
    return {
        "candidate": candidate,
        "role": role,
        "error": {"value": err, "low": err / 2, "high": err_hi, "n": 8, "method": "t95"},
        "time_ms": {"value": t, "low": t * 0.9, "high": t_hi, "n": 5, "method": "iqr"},
        "baseline_time_ms": {"value": base, "low": base, "high": base, "n": 5, "method": "iqr"},
    }


def test_best_candidate_follows_the_dispatch_rule_on_interval_bounds():
    from loka_torchrec.probe.run_view import best_candidate

    evidence = [
        _ev("bf16:hp", "fwd", 0.001, 0.001, 1.0, 1.0),
        _ev("a:fast_but_noisy_error", "fwd", 0.05, 0.25, 0.5, 0.55),  # upper bound fails 0.2
        _ev("b:accurate_fast", "fwd", 0.05, 0.06, 0.8, 0.9),  # 1.25x, lower bound 1.11x
        _ev("c:accurate_faster_point", "fwd", 0.05, 0.06, 0.7, 1.0),  # 1.43x, lower bound 1.0x fails 1.05
    ]
    best = best_candidate(evidence, "fwd", 0.2, 1.05)
    assert best["candidate"] == "b:accurate_fast" and best["passes"] and best["speedup_low"] == pytest.approx(1 / 0.9)
    slow = best_candidate(evidence, "fwd", 0.2, 2.0)  # nothing fast enough: the fastest accurate one
    assert slow["candidate"] == "c:accurate_faster_point" and not slow["passes"]
    strict = best_candidate(evidence, "fwd", 0.01, 1.05)  # nothing accurate enough: the lowest upper bound
    assert strict["candidate"] in ("b:accurate_fast", "c:accurate_faster_point") and not strict["passes"]
    assert best_candidate(evidence, "dgrad", 0.2, 1.05) is None
    # A grad-weight candidate over the plan's noise-ratio gate does not pass; with the gate off it does.
    loud = {**_ev("b:accurate_fast", "wgrad", 0.05, 0.06, 0.8, 0.9), "noise_ratio": {"value": 0.2, "low": 0.1, "high": 0.3, "n": 6, "method": "t95"}}
    assert not best_candidate([loud], "wgrad", 0.2, 1.05, max_noise_ratio=0.1)["passes"]
    assert best_candidate([loud], "wgrad", 0.2, 1.05)["passes"]
