"""loka-inspect on a run directory written by a real ProbeCallback run, and on broken ones."""

import json
import shutil

import pytest
import torch
from torch import nn

from loka_torchrec.evidence import BF16, EvidenceConsumer, GemmRole, KernelChoice
from loka_torchrec.probe import ProbeCallback, ProbeConfig
from loka_torchrec.probe.inspect import main

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


def _copy(run_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(run_dir, dst)
    return dst


def test_table_shows_layers_candidates_and_decisions(run_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no folding inside cells
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    for text in ("over.fc1", "over.fc2", "32x16->32", "scaled_mm:", "fastest within the gates", "MERE < 0.3", "speedup > 1.1"):
        assert text in out, text


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
    assert fc1["roles"]["fwd"]["decision"] == "bf16 (fallback; planned scaled_mm:rowwise)"
    assert fc1["roles"]["dgrad"]["decision"] == "bf16 (fallback)" and fc1["roles"]["dgrad"]["reason"] == reason
    monkeypatch.setenv("COLUMNS", "400")
    assert main([str(run)]) == 0
    assert "act amax_jump: 2797 (reference 2.977, bound 23.82) (+1 more)" in capsys.readouterr().out


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
