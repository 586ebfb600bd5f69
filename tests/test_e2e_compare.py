"""``benchmarks/e2e_compare.py``: the end-to-end comparison driver (a CPU smoke run and its parts)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "benchmarks", "e2e_compare.py")


def _driver():
    spec = importlib.util.spec_from_file_location("e2e_compare", DRIVER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_run_overrides_and_window(monkeypatch):
    e2e = _driver()
    monkeypatch.setattr(e2e, "job_has_compile_option", lambda: True)
    args = e2e.parse_args(["--runs", "bf16,loka,torchao_rowwise", "--steps", "600", "--torchao-auto-filter", "--override", "data.batch_size=64"])
    # warm-up 200, then the plan trials: one step-time guard window (5 + 50 steps) for each of 3 candidates and 2
    # for the confirmation, + 25
    assert args.window_start == 200 + 5 * 55 + 25 and args.seeds == [0, 1]
    loka = e2e.run_overrides(args, "hstu_large", e2e.RUNS["loka"], 1)
    assert loka[:2] == ["model=hstu_large", "device=cuda"]
    assert not any(item.startswith("loka.comms.") for item in loka)  # comms at the default: auto
    off = e2e.run_overrides(args, "hstu_large", e2e.RUNS["loka_comms_off"], 0)
    assert "loka.comms.forward=fp32" in off and "loka.comms.backward=fp32" in off
    for item in ("loka.probe.enabled=true", "loka.mods.preset=all_but_no_bias", "loka.probe.warmup_steps=200",
                 "seed=1", "train.steps=600", "train.timing_start=500", "train.autocast=bf16"):
        assert item in loka
    assert loka[-1] == "data.batch_size=64"  # the user's overrides win
    assert "baseline.auto_filter=true" in e2e.run_overrides(args, "dlrm_large", e2e.RUNS["torchao_rowwise"], 0)
    bf16 = e2e.run_overrides(args, "dlrm_large", e2e.RUNS["bf16"], 0)
    assert "loka.dispatch.mode=all-bf16" in bf16 and "loka.mods.preset=all_but_no_bias" in bf16
    assert "train.compile=none" in bf16 and "train.compile=none" in loka  # eager says so: the job's default never decides
    # bf16 kernels with the Probe learning and planning: it plans at the same step as the LoKA runs
    probed = e2e.run_overrides(args, "hstu_large", e2e.RUNS["bf16_probed_compile_cudagraphs"], 0)
    for item in ("loka.dispatch.mode=all-bf16", "loka.probe.enabled=true", "loka.probe.warmup_steps=200",
                 "train.compile=reduce-overhead"):
        assert item in probed
    assert "loka.probe.warmup_steps=200" not in bf16
    with pytest.raises(SystemExit):  # its window must start after its plan, as a LoKA run's
        e2e.parse_args(["--runs", "bf16_probed_compile_cudagraphs", "--steps", "300", "--window-start", "100"])
    # the window starts after the probe's warm-up (the plan) and the plan trials' verdict
    assert e2e.plan_trial_steps() == 5 * (5 + 50)
    assert e2e.parse_args(["--runs", "loka", "--steps", "600"]).window_start == 500
    # the same window without loka runs, so that separate invocations time the same steps
    assert e2e.parse_args(["--runs", "bf16", "--steps", "600"]).window_start == 500
    assert e2e.parse_args(["--runs", "bf16", "--steps", "400", "--probe-warmup", "50"]).window_start == 350
    assert e2e.parse_args(["--runs", "bf16", "--steps", "200"]).window_start == 100  # 500 would not fit
    with pytest.raises(SystemExit):  # a loka run's window would start inside its plan trials
        e2e.parse_args(["--runs", "loka", "--steps", "300"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--runs", "loka", "--steps", "300", "--window-start", "100"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--runs", "bf16,nosuchrun"])


def test_one_seed_runs_come_last_with_the_first_seed():
    e2e = _driver()
    args = e2e.parse_args(["--recipes", "dhen_large", "--runs", "bf16,loka,te,torchao_rowwise", "--seeds", "3,4",
                           "--one-seed-runs", "te,torchao_rowwise"])  # fmt: skip
    assert e2e.run_order(args) == [
        (3, "dhen_large", "bf16"), (3, "dhen_large", "loka"), (4, "dhen_large", "bf16"), (4, "dhen_large", "loka"),
        (3, "dhen_large", "te"), (3, "dhen_large", "torchao_rowwise"),
    ]
    # LoKA variants other than "loka" plan at the same warm-up, and move the timed window past the plan and the guard
    for name in ("loka_comms_off", "loka_dmpc"):
        assert f"loka.probe.warmup_steps={args.probe_warmup}" in e2e.run_overrides(args, "dhen_large", e2e.RUNS[name], 3)
    assert "train.deterministic=true" not in e2e.run_overrides(args, "dhen_large", e2e.RUNS["bf16"], 3)
    det = e2e.parse_args(["--runs", "bf16", "--deterministic"])
    assert "train.deterministic=true" in e2e.run_overrides(det, "hstu_large", e2e.RUNS["bf16"], 0)
    assert e2e.parse_args(["--runs", "bf16,loka_dmpc", "--steps", "500", "--probe-warmup", "100"]).window_start == 400
    with pytest.raises(SystemExit):
        e2e.parse_args(["--runs", "bf16", "--one-seed-runs", "nosuchrun"])


def test_error_reason_picks_the_job_error_not_torchrun_report():
    e2e = _driver()
    log = (
        "Traceback (most recent call last):\n  File x\n"
        "ImportError: baseline.kind=torchao needs torchao (its float8 training): pip install torchao\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert e2e.error_reason(log).startswith("ImportError: baseline.kind=torchao needs torchao")
    assert e2e.error_reason("nothing useful") is None
    log = "error: '/x' does not exist (train.resume)\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    assert e2e.error_reason(log) == "error: '/x' does not exist (train.resume)"  # the job's one-line error


def test_aggregate_pairs_ne_by_seed():
    e2e = _driver()

    def rec(run, seed, ne, ms, status="ok"):
        return {"recipe": "r", "run": run, "seed": seed, "status": status, "eval_ne": ne, "median_step_ms": ms,
                "p10_step_ms": ms - 1, "p90_step_ms": ms + 1, "qps": 1000 / ms, "eval_auc": 0.7, "peak_memory_gb": None}

    records = [rec("bf16", 0, 0.80, 10.0), rec("bf16", 1, 0.82, 12.0), rec("loka", 0, 0.808, 8.0), rec("loka", 1, 0.82, 8.0),
               {"recipe": "r", "run": "te", "seed": 0, "status": "skipped", "reason": "no TE"}]
    rows = {r["run"]: r for r in e2e.aggregate(records, ["r"], ["bf16", "loka", "te"])}
    assert rows["bf16"]["ne_vs_bf16_pct"] == pytest.approx(0.0)
    assert rows["loka"]["ne_vs_bf16_pct"] == pytest.approx(0.5)  # mean of +1 % and 0 %
    assert rows["loka"]["ne_vs_bf16_pct_range"] == pytest.approx([0.0, 1.0])
    assert rows["loka"]["speedup_vs_bf16"] == pytest.approx(11.0 / 8.0)
    assert rows["bf16"]["ne_seed_spread_pct"] == pytest.approx(100 * 0.01414214 / 0.81, rel=1e-4)
    assert rows["te"]["status"] == "skipped" and rows["te"]["reasons"] == ["no TE"] and rows["te"]["eval_ne"] is None
    # Without eager bf16, NE is paired with bf16_compile of the same seed; eager bf16 wins when both ran.
    compiled = [rec("bf16_compile", 0, 0.90, 9.0), rec("bf16_compile", 1, 0.82, 9.0)]
    rows = {r["run"]: r for r in e2e.aggregate(records[2:4] + compiled, ["r"], ["loka"])}
    assert rows["loka"]["ne_vs_bf16_pct_range"] == pytest.approx([-10.222222, 0.0])
    rows = {r["run"]: r for r in e2e.aggregate(records + compiled, ["r"], ["loka"])}
    assert rows["loka"]["ne_vs_bf16_pct_range"] == pytest.approx([0.0, 1.0])


@pytest.mark.slow
def test_cpu_smoke_run_writes_json_md_and_plot(tmp_path):
    """dlrm (small), 2 gloo ranks, a few steps: bf16, bf16_nomods, loka run; te is skipped with the reason."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, DRIVER, "--device", "cpu", "--recipes", "dlrm", "--runs", "bf16,bf16_nomods,loka,te",
        "--seeds", "0", "--nproc", "2", "--steps", "6", "--window-start", "3", "--probe-warmup", "2",
        "--out", str(out), "--name", "smoke", "--run-timeout", "120", "--max-seconds", "300",
        "--profile-start", "5", "--profile-steps", "1",
    ]
    for override in ("data.num_tables=4", "data.num_embeddings=1000", "data.embedding_dim=32", "data.batch_size=128",
                     "data.eval_batches=4", "model.dense_arch_layer_sizes=[64,32]", "model.over_arch_layer_sizes=[64,32,1]",
                     "loka.probe.every=1", "loka.dispatch.min_speedup=0", "loka.dispatch.samples=3",
                     "loka.dispatch.timing_reps=1"):
        cmd += ["--override", override]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = out.glob("*-smoke.json")
    result = json.loads(json_path.read_text())
    md = json_path.with_suffix(".md").read_text()
    assert json_path.with_suffix(".png").stat().st_size > 0 and result["plot"]
    assert result["device"].startswith("CPU") and result["versions"]["torch"]
    runs = {r["run"]: r for r in result["runs"]}
    for name in ("bf16", "bf16_nomods", "loka"):
        r = runs[name]
        assert r["status"] == "ok", (name, r.get("reason"), r.get("log_tail"))
        assert r["timed_window"] == [4, 6] and r["timed_steps"] == 2  # step 5 profiled, not timed
        # The collectives of the profiled step on rank 0: the embedding all-to-all in the forward and
        # the backward (gloo's), DDP's all-reduce of the dense gradients in the backward.
        comms = r["profile"]["comms"]["ms_per_step"]
        assert comms["all_to_all"]["forward"] > 0 and comms["all_to_all"]["backward"] > 0, comms
        assert comms["all_reduce"]["backward"] > 0, comms
        assert r["dense_allreduce"]["ddp"] and r["dense_allreduce"]["comm_hooks"] == []
        assert r["p10_step_ms"] <= r["median_step_ms"] <= r["p90_step_ms"]
        assert 0 < r["eval_ne"] < 2 and 0 <= r["eval_auc"] <= 1 and r["qps"] > 0
        assert r["peak_memory_gb"] is None  # CPU
        assert "model=dlrm device=cpu" in r["command"] and "--nproc_per_node=2" in r["command"]
        assert os.path.isfile(os.path.join(r["run_dir"], "summary.json"))
    # the loka run: Probe -> Dispatch plan (FP8 somewhere, with the speed gate off), by backend
    dispatch = runs["loka"]["dispatch"]
    # planned FP8 (a short CPU run's safety valve may hold layers in bf16: in force can be fewer)
    assert dispatch["fp8_gemms_planned"] > 0 and sum(dispatch["fp8_by_backend"].values()) == dispatch["fp8_gemms_planned"]
    assert dispatch["fp8_gemms"] <= dispatch["fp8_gemms_planned"]
    assert dispatch["planning_peak_rises"] == []  # CPU: no device peak to read
    assert runs["bf16"]["dispatch"]["fp8_gemms"] == 0 and "dispatch" not in runs["bf16_nomods"]
    assert runs["te"]["status"] == "skipped" and "CUDA only" in runs["te"]["reason"]
    rows = {r["run"]: r for r in result["table"]}
    assert rows["bf16"]["ne_vs_bf16_pct"] == 0.0
    expected = 100 * (runs["loka"]["eval_ne"] - runs["bf16"]["eval_ne"]) / runs["bf16"]["eval_ne"]
    assert rows["loka"]["ne_vs_bf16_pct"] == pytest.approx(expected)
    for text in ("## dlrm", "| loka | none | ok |", "| te | none | skipped |", "CUDA only", "## Commands", "LOKA_RUN_DIR=",
                 "Same architecture in bf16: seed 0: `bf16` (", "## What the collectives cost",
                 "| dlrm | bf16_nomods | 0 | fp32 (TorchRec) | fp32 (no hook), 25 MiB |"):
        assert text in md
    # LoKA's comms are "auto": each direction's precision comes from the run's own timing of the
    # all-to-all, so either may win on a CPU; the row says which, and how auto decided.
    assert re.search(r"\| dlrm \| loka \| 0 \| forward (fp32|fp8), backward (fp32|fp8) \(auto, ", md), md
    assert f"| dlrm | loka | 0 | {runs['loka']['comms']} |" in md


def test_profile_flags_and_where_the_step_goes_section():
    e2e = _driver()
    args = e2e.parse_args(["--runs", "bf16", "--steps", "300", "--profile-start", "290", "--profile-steps", "5",
                           "--override", "data.batch_size=64"])  # fmt: skip
    overrides = e2e.run_overrides(args, "dhen_large", e2e.RUNS["bf16"], 0)
    assert overrides[-3:] == ["train.profile_start=290", "train.profile_steps=5", "data.batch_size=64"]
    assert not any("profile" in o for o in e2e.run_overrides(e2e.parse_args(["--runs", "bf16"]), "r", e2e.RUNS["bf16"], 0))
    with pytest.raises(SystemExit):  # steps 298..302 do not fit in 300
        e2e.parse_args(["--runs", "bf16", "--steps", "300", "--profile-start", "298"])

    shares = {"gemm_bf16": 0.30, "gemm_fp8": 0.10, "fp8_quantize": 0.05, "attention": 0.0, "embedding": 0.20,
              "comms": 0.15, "memcpy_memset": 0.02, "other": 0.18}  # fmt: skip
    profile = {"steps": [290, 294], "source": "cuda kernels", "wall_ms_per_step": 40.0, "kernel_ms_per_step": 30.0,
               "idle_share": 0.25, "gemm_share": 0.4, "amdahl_2x_gemm_ceiling": 1.25, "amdahl_2x_gemm_ceiling_wall": 1.176,
               "shares": shares, "host": {"kernel_launches_per_step": 412.0, "graph_launches_per_step": 2.0,
                                          "operators_per_step": 1530.4}}  # fmt: skip
    summary = {"median_step_ms": 35.0, "eval_ne": 0.9, "profile": profile}
    record = {"recipe": "dhen_large", "run": "loka", "seed": 0, "status": "ok", "command": "x",
              **e2e.metrics_from_summary(summary)}  # fmt: skip
    assert record["profile"] == profile
    meta = _report_meta("H100", "2.13", nproc=1, steps=300, window_start=220, recipe="dhen_large")
    md = e2e.to_markdown(meta, e2e.aggregate([record], ["dhen_large"], ["loka"]), [record])
    assert "## Where the step goes" in md and "steps 290..294" in md
    row = next(line for line in md.splitlines() if line.startswith("| dhen_large | loka | 0 |"))
    # wall, kernel ms/step, GEMM (bf16 + fp8), quantize, embedding, comms, other (the rest), idle, ceiling, host
    assert row == ("| dhen_large | loka | 0 | 40.00 | 30.00 | 40.0 (30.0 + 10.0) | 5.0 | 20.0 | 15.0 | 20.0 | 25.0 "
                   "| 1.250x (1.176x) | 412 / 2 / 1530 |")
    older = dict(record, profile={k: v for k, v in profile.items() if k != "host"})  # a profile from before host counts
    md_older = e2e.to_markdown(meta, e2e.aggregate([older], ["dhen_large"], ["loka"]), [older])
    assert next(line for line in md_older.splitlines() if line.startswith("| dhen_large | loka | 0 |")).endswith("| n/a |")
    without = dict(record, profile=None)
    assert "Where the step goes" not in e2e.to_markdown(meta, e2e.aggregate([without], ["dhen_large"], ["loka"]), [without])


def _result_file(path, runs):
    records = [
        {"recipe": recipe, "run": run, "seed": seed, "status": status, "median_step_ms": ms, "p10_step_ms": ms,
         "p90_step_ms": ms, "eval_ne": ne, "eval_auc": 0.7, "peak_memory_gb": 1.0, "command": command}
        for recipe, run, seed, status, ms, ne, command in runs
    ]  # fmt: skip
    path.write_text(json.dumps({"device": "test-gpu", "runs": records}))
    return str(path)


def test_combine_results_keeps_the_first_record_per_run_and_pairs_ne_by_seed(tmp_path):
    spec = importlib.util.spec_from_file_location("combine_results", os.path.join(os.path.dirname(DRIVER), "combine_results.py"))
    combine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(combine)
    first = _result_file(tmp_path / "a.json", [
        ("dhen", "bf16", 0, "ok", 20.0, 0.80, "train.py seed=0"),
        ("dhen", "loka", 0, "ok", 16.0, 0.80, "train.py seed=0"),
        ("dhen", "te", 0, "failed", None, None, "train.py seed=0"),
        ("hstu", "bf16", 0, "ok", 50.0, 0.90, "train.py train.deterministic=true"),
    ])  # fmt: skip
    second = _result_file(tmp_path / "b.json", [
        ("dhen", "bf16", 0, "ok", 99.0, 0.99, "train.py seed=0"),  # the first file's record wins
        ("dhen", "te", 0, "ok", 40.0, 0.84, "train.py seed=0"),
        ("dhen", "torchao", 0, "ok", 80.0, 0.88, "train.py seed=0"),
    ])  # fmt: skip
    records = combine.load_records([first, second], exclude=["dhen:torchao"])
    got = {(r["recipe"], r["run"]): (r["median_step_ms"], r["source"]) for r in records}
    assert got == {
        ("dhen", "bf16"): (20.0, "a.json"), ("dhen", "loka"): (16.0, "a.json"), ("dhen", "te"): (40.0, "b.json"),
        ("hstu+deterministic", "bf16"): (50.0, "a.json"),
    }  # fmt: skip
    out = tmp_path / "combined"
    assert combine.main(["--out", str(out), "--exclude", "dhen:torchao", first, second]) == 0
    text = (out.parent / "combined.md").read_text()
    assert "| dhen | loka | 0 | 16.00 | 1.250x | 1.250x | +0.00 [+0.00, +0.00] |" in text  # no compiled bf16: eager is the reference
    assert "| dhen | te | 0 | 40.00 | other call | other call | +5.00 [+5.00, +5.00] |" in text  # bf16 ran in a.json
    assert "- dhen: speed-up reference seed 0: `bf16` (20.00 ms)" in text
    assert "torchao" not in text.split("command:")[1].split("\n", 1)[1]  # excluded from the tables
    # with a compiled bf16 run in a later file, that one is the reference where it is faster
    third = _result_file(tmp_path / "c.json", [("dhen", "bf16_compile_cudagraphs", 0, "ok", 12.0, 0.80, "train.py seed=0")])
    assert combine.main(["--out", str(out), first, second, third]) == 0
    text = (out.parent / "combined.md").read_text()
    assert "- dhen: speed-up reference seed 0: `bf16_compile_cudagraphs` (12.00 ms)" in text
    assert "| dhen | loka | 0 | 16.00 | other call | 1.250x |" in text  # its compiled reference ran in c.json
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="bad.json: not an e2e_compare.py result"):
        combine.load_records([str(bad)])


def test_combine_results_names_runs_whose_mods_an_override_changed_and_compares_ne_with_a_chosen_run(tmp_path):
    spec = importlib.util.spec_from_file_location("combine_results", os.path.join(os.path.dirname(DRIVER), "combine_results.py"))
    combine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(combine)
    keep = "loka.mods.preset=custom loka.mods.block_norm=true loka.mods.hard_swish=true loka.mods.fuse_siblings=true loka.mods.pad_to_16=true"
    first = _result_file(tmp_path / "a.json", [
        ("dhen", "plain_compile", 0, "ok", 20.0, 0.80, f"train loka.enabled=false seed=0 {keep}"),  # LoKA off: Mods not applied
        ("dhen", "bf16_compile", 0, "ok", 19.0, 0.88, "train loka.enabled=true loka.mods.preset=all seed=0"),
    ])  # fmt: skip
    second = _result_file(tmp_path / "b.json", [
        ("dhen", "bf16_compile", 0, "ok", 19.5, 0.76, f"train loka.enabled=true loka.mods.preset=all seed=0 {keep}"),
        ("dhen", "loka", 0, "ok", 15.0, 0.72, f"train loka.enabled=true loka.mods.preset=all seed=0 loka.mods.preset=custom loka.mods.pad_to_16=true"),
    ])  # fmt: skip
    runs = [r["run"] for r in combine.load_records([first, second])]
    assert runs == ["plain_compile", "bf16_compile", "bf16_compile+mods=all_but_no_bias", "loka+mods=pad_to_16"]
    out = tmp_path / "combined"
    assert combine.main(["--out", str(out), "--ne-reference", "plain_compile", first, second]) == 0
    text = (out.parent / "combined.md").read_text()
    assert "NE vs `plain_compile` %" in text and "--ne-reference plain_compile" in text
    assert "| dhen | bf16_compile | 0 | 19.00 | 1.000x | n/a | +10.00 [+10.00, +10.00] |" in text
    assert "| dhen | bf16_compile+mods=all_but_no_bias | 0 | 19.50 | other call | n/a | -5.00 [-5.00, -5.00] |" in text
    # the combined records are themselves an input: combining them again gives the same runs
    assert [r["run"] for r in combine.load_records([str(out) + ".json"])] == runs
    with pytest.raises(SystemExit):
        combine.main(["--out", str(out), "--ne-reference", "bf16", first])  # no run named bf16
    # LoKA without Mods is judged against its own reference (LoKA's bf16 on the user's model), here in its file
    nomods = _result_file(tmp_path / "c.json", [
        ("dhen", "bf16_nomods_compile_cudagraphs", 0, "ok", 18.0, 0.80, "train loka.enabled=true loka.mods.preset=none"),
        ("dhen", "loka_nomods_compile", 0, "ok", 12.0, 0.80, "train loka.enabled=true loka.mods.preset=none"),
    ])  # fmt: skip
    assert combine.main(["--out", str(out), first, nomods]) == 0
    assert "| dhen | loka_nomods_compile | 0 | 12.00 | 1.500x | n/a |" in (out.parent / "combined.md").read_text()


def test_compiled_runs_and_their_modes(monkeypatch):
    """The compiled comparison is the default list; each compiled run is its eager twin plus
    ``train.compile=<mode>``; torchao's compiled runs always use its size filter."""
    e2e = _driver()
    monkeypatch.setattr(e2e, "job_has_compile_option", lambda: True)
    args = e2e.parse_args([])
    assert args.runs == ["bf16", "bf16_compile", "bf16_compile_cudagraphs", "torchao_tensorwise_compile",
                         "torchao_rowwise_compile", "te", "te_compile", "loka_compile"]  # fmt: skip
    assert args.recipes == ["dlrm_large", "dhen_large", "dhen_xl", "hstu_large", "hstu_xl"]
    for name in ("loka_graphs", "bf16_graphs", "loka_dense_graphs"):  # the hand-written CUDA-graph runs are gone
        assert name not in e2e.RUNS
    with pytest.raises(SystemExit):
        e2e.parse_args(["--runs", "loka_graphs"])
    modes = {name: spec.compile for name, spec in e2e.RUNS.items()}
    assert modes["bf16"] == modes["loka"] == modes["te"] == modes["bf16_nomods"] == "none"
    assert modes["bf16_compile"] == "default" and modes["bf16_compile_cudagraphs"] == "reduce-overhead"
    assert modes["loka_compile"] == modes["torchao_tensorwise_compile"] == modes["torchao_rowwise_compile"] == "reduce-overhead"
    for compiled, eager in (("bf16_compile", "bf16"), ("bf16_compile_cudagraphs", "bf16"), ("loka_compile", "loka")):
        got = e2e.run_overrides(args, "dhen_xl", e2e.RUNS[compiled], 0)
        want = e2e.run_overrides(args, "dhen_xl", e2e.RUNS[eager], 0)
        assert got == [o if o != "train.compile=none" else f"train.compile={modes[compiled]}" for o in want]
    torchao = e2e.run_overrides(args, "dhen_xl", e2e.RUNS["torchao_rowwise_compile"], 0)
    for item in ("loka.enabled=false", "baseline.kind=torchao", "baseline.recipe=rowwise", "baseline.auto_filter=true",
                 "train.compile=reduce-overhead"):
        assert item in torchao
    assert "loka.probe.warmup_steps=200" in e2e.run_overrides(args, "dhen_xl", e2e.RUNS["loka_compile"], 0)
    te_compile = e2e.run_overrides(args, "dhen_xl", e2e.RUNS["te_compile"], 0)
    for item in ("loka.enabled=false", "baseline.kind=te", "baseline.recipe=delayed", "train.compile=default"):
        assert item in te_compile
    assert e2e.preflight(args, e2e.RUNS["loka_compile"]) is None
    with pytest.raises(ValueError, match="RunSpec.compile: expected one of"):
        e2e.RunSpec("x", (), compile="fast")


def test_compiled_runs_are_skipped_where_the_job_has_no_compile_option(monkeypatch):
    e2e = _driver()
    monkeypatch.setattr(e2e, "job_has_compile_option", lambda: False)
    args = e2e.parse_args(["--device", "cpu", "--runs", "bf16,bf16_compile"])
    assert not any(o.startswith("train.compile=") for o in e2e.run_overrides(args, "dlrm", e2e.RUNS["bf16"], 0))
    assert e2e.preflight(args, e2e.RUNS["bf16"]) is None
    reason = e2e.preflight(args, e2e.RUNS["bf16_compile"])
    assert reason.startswith("train.compile=default: the installed loka_torchrec has no train.compile option")
    assert e2e.preflight(args, e2e.RUNS["loka_dmpc"]) == "loka_dmpc runs on CUDA only (--device cpu)"


def test_job_has_compile_option_reads_the_installed_config():
    """True exactly when the job's recipes/config.yaml has ``train.compile`` (what a ``train.compile=``
    override needs)."""
    from omegaconf import OmegaConf

    import loka_job.recipes

    e2e = _driver()
    config = OmegaConf.load(os.path.join(os.path.dirname(loka_job.recipes.__file__), "config.yaml"))
    assert e2e.job_has_compile_option() == ("compile" in config.train)


def _report_meta(device, torch_version, nproc, steps, window_start, recipe):
    """The header a report of one seed of ``recipe`` is rendered with."""
    settings = {"nproc": nproc, "device": "cuda", "steps": steps, "window_start": window_start, "autocast": "bf16",
                "seeds": [0], "recipes": [recipe]}  # fmt: skip
    return {"date": "d", "device": device, "versions": {"torch": torch_version}, "command": "c", "seconds": 1.0, "settings": settings}


def _rec(run, seed, ms, ne=0.8, status="ok", profile=None, mean_ms=None):
    return {"recipe": "r", "run": run, "seed": seed, "status": status, "eval_ne": ne, "median_step_ms": ms,
            "p10_step_ms": ms, "p90_step_ms": ms, "mean_step_ms": mean_ms or ms, "qps": 1000 / ms if ms else None, "eval_auc": 0.7,
            "peak_memory_gb": None, "profile": profile}  # fmt: skip


def test_aggregate_measures_speedups_against_the_best_bf16_compile_mode_per_seed():
    """Seed 0: CUDA graphs win (8 ms < 9 ms); seed 1: the default mode wins (9 ms < 10 ms), so the
    reference differs by seed. NE stays paired with eager bf16 of the same seed."""
    e2e = _driver()
    records = [
        _rec("bf16", 0, 14.0, 0.80), _rec("bf16", 1, 16.0, 0.82),
        _rec("bf16_compile", 0, 9.0, 0.80), _rec("bf16_compile", 1, 9.0, 0.82),
        _rec("bf16_compile_cudagraphs", 0, 8.0, 0.80), _rec("bf16_compile_cudagraphs", 1, 10.0, 0.82),
        _rec("loka_compile", 0, 6.0, 0.808), _rec("loka_compile", 1, 6.0, 0.82),
        _rec("torchao_rowwise_compile", 0, 5.0), _rec("torchao_rowwise_compile", 1, None, status="failed"),
    ]  # fmt: skip
    runs = ["bf16", "bf16_compile", "bf16_compile_cudagraphs", "loka_compile", "torchao_rowwise_compile"]
    rows = {r["run"]: r for r in e2e.aggregate(records, ["r"], runs)}
    reference = rows["loka_compile"]["speed_reference"]
    assert reference == {0: {"run": "bf16_compile_cudagraphs", "median_step_ms": 8.0},
                         1: {"run": "bf16_compile", "median_step_ms": 9.0}}  # fmt: skip
    assert all(r["speed_reference"] == reference for r in rows.values())
    assert rows["loka_compile"]["speedup_vs_reference"] == pytest.approx((8.0 + 9.0) / 2 / 6.0)
    assert rows["loka_compile"]["speedup_vs_bf16"] == pytest.approx(15.0 / 6.0)
    assert rows["bf16_compile"]["speedup_vs_reference"] == pytest.approx(8.5 / 9.0)
    assert rows["bf16_compile_cudagraphs"]["speedup_vs_reference"] == pytest.approx(8.5 / 9.0)
    assert rows["torchao_rowwise_compile"]["speedup_vs_reference"] == pytest.approx(8.0 / 5.0)  # paired: seed 0 only
    assert rows["torchao_rowwise_compile"]["status"] == "partial"
    assert rows["loka_compile"]["ne_vs_bf16_pct"] == pytest.approx(0.5)  # vs eager bf16: +1 % and 0 %
    assert rows["bf16_compile_cudagraphs"]["compile"] == "reduce-overhead" and rows["bf16"]["compile"] == "none"
    assert e2e.reference_words(reference) == (
        "seed 0: `bf16_compile_cudagraphs` (8.00 ms); seed 1: `bf16_compile` (9.00 ms)"
    )

    # Without compiled bf16 runs the reference is eager bf16; without any bf16 there is none.
    eager_only = [r for r in records if r["run"] in ("bf16", "loka_compile")]
    rows = {r["run"]: r for r in e2e.aggregate(eager_only, ["r"], ["bf16", "loka_compile"])}
    assert {s: ref["run"] for s, ref in rows["loka_compile"]["speed_reference"].items()} == {0: "bf16", 1: "bf16"}
    assert rows["loka_compile"]["speedup_vs_reference"] == pytest.approx(15.0 / 6.0)
    alone = e2e.aggregate([_rec("loka_compile", 0, 6.0)], ["r"], ["loka_compile"])[0]
    assert alone["speed_reference"] == {} and alone["speedup_vs_reference"] is None
    assert e2e.reference_words({}).startswith("none (not run, or did not complete)")


def test_the_users_unchanged_job_is_a_reference_of_its_own():
    """The plain model (LoKA off, no Mods) + compile, the faster mode per seed, is the user's job: LoKA's
    speed-up over it is reported beside the one over the same architecture in bf16, and NE falls back to
    the plain model where no bf16 run of LoKA's architecture ran."""
    e2e = _driver()
    records = [
        _rec("plain_compile", 0, 12.0, 0.80), _rec("plain_compile_cudagraphs", 0, 11.0, 0.80),
        _rec("bf16_compile", 0, 10.0, 0.81),
        _rec("loka_nomods_compile_default", 0, 8.0, 0.804),
    ]  # fmt: skip
    runs = ["plain_compile", "plain_compile_cudagraphs", "bf16_compile", "loka_nomods_compile_default"]
    rows = {r["run"]: r for r in e2e.aggregate(records, ["r"], runs)}
    loka = rows["loka_nomods_compile_default"]
    assert loka["user_job_reference"] == {0: {"run": "plain_compile_cudagraphs", "median_step_ms": 11.0}}
    assert loka["speedup_vs_user_job"] == pytest.approx(11.0 / 8.0)
    assert loka["speedup_vs_reference"] == pytest.approx(10.0 / 8.0)  # the same architecture in bf16
    assert loka["ne_vs_bf16_pct"] == pytest.approx(100 * (0.804 - 0.81) / 0.81)  # bf16_compile comes first
    rows = {r["run"]: r for r in e2e.aggregate([r for r in records if r["run"] != "bf16_compile"], ["r"], runs)}
    loka = rows["loka_nomods_compile_default"]
    assert loka["speedup_vs_reference"] is None and loka["ne_vs_bf16_pct"] == pytest.approx(0.5)  # vs plain_compile
    assert e2e.run_spec("plain_compile").overrides == ("loka.enabled=false",)
    assert "loka.mods.preset=none" in e2e.run_spec("loka_nomods_compile_default").overrides


def test_lokas_runs_without_mods_are_judged_against_lokas_bf16_on_the_users_model():
    """Where ``bf16_nomods_compile_cudagraphs`` ran, LoKA's runs without Mods have it as their same
    architecture in bf16 (the Mods' bf16_compile* stays the reference of the runs with Mods); the report
    names both, and the gain split walks user's job -> LoKA in bf16 -> LoKA for those runs."""
    e2e = _driver()
    assert e2e.without_mods("loka_nomods_compile") and e2e.without_mods("bf16_nomods_compile_cudagraphs")
    assert not e2e.without_mods("loka_compile") and not e2e.without_mods("plain_compile") and not e2e.without_mods("nope")
    records = [
        _rec("plain_compile_cudagraphs", 0, 11.0, 0.80), _rec("bf16_compile_cudagraphs", 0, 10.0, 0.80),
        _rec("bf16_nomods_compile_cudagraphs", 0, 12.5, 0.80), _rec("loka_nomods_compile", 0, 12.0, 0.80),
        _rec("loka_compile", 0, 8.0, 0.80),
    ]  # fmt: skip
    runs = [r["run"] for r in records]
    rows = {r["run"]: r for r in e2e.aggregate(records, ["r"], runs)}
    assert rows["loka_nomods_compile"]["speedup_vs_reference"] == pytest.approx(12.5 / 12.0)
    assert rows["loka_nomods_compile"]["speed_reference"] == {0: {"run": "bf16_nomods_compile_cudagraphs", "median_step_ms": 12.5}}
    assert rows["loka_compile"]["speedup_vs_reference"] == pytest.approx(10.0 / 8.0)
    assert rows["plain_compile_cudagraphs"]["speedup_vs_reference"] == pytest.approx(10.0 / 11.0)
    meta = _report_meta("H200", "2.11", nproc=1, steps=400, window_start=255, recipe="r")
    md = e2e.to_markdown(meta, e2e.aggregate(records, ["r"], runs), records)
    assert ("Same architecture in bf16: seed 0: `bf16_compile_cudagraphs` (10.00 ms). For LoKA's runs without Mods "
            "(the user's model): seed 0: `bf16_nomods_compile_cudagraphs` (12.50 ms).") in md
    lines = e2e.gain_split_section(records, ["r"])
    row = next(line for line in lines if line.startswith("| loka_nomods_compile | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["11.00 (`plain_compile_cudagraphs`)", "12.50 (`bf16_nomods_compile_cudagraphs`)", "12.00"]
    assert [float(c.rstrip("x")) for c in cells[5:8]] == pytest.approx([11 / 12.5, 12.5 / 12, 11 / 12], abs=1e-3)
    assert any(line.startswith("| loka_compile | 0 |") for line in lines)  # the run with Mods keeps its three moves
    # Without LoKA's bf16 run, the runs without Mods fall back to the one reference, as before.
    rows = {r["run"]: r for r in e2e.aggregate([r for r in records if r["run"] != "bf16_nomods_compile_cudagraphs"], ["r"], runs)}
    assert rows["loka_nomods_compile"]["speedup_vs_reference"] == pytest.approx(10.0 / 12.0)


def test_runs_under_dmpcollection_are_judged_against_the_same_architecture_under_dmpcollection():
    """LoKA under DMPCollection is against ``bf16_dmpc2_compile`` (both carry the groups' extra
    all-reduce), the runs under plain DMP keep ``bf16_compile*``, and the repeated pairs pair each
    LoKA run only with the references of its own sharding."""
    e2e = _driver()
    assert e2e.under_dmpc("loka_dmpc2_compile_default_replay") and e2e.under_dmpc("bf16_dmpc2_compile")
    assert not e2e.under_dmpc("loka_compile_default_replay") and not e2e.under_dmpc("nope")
    records = [
        _rec("bf16_dmpc2_compile", 0, 118.0), _rec("loka_dmpc2_compile_default_replay", 0, 97.0),
        _rec("bf16_dmpc2_compile@2", 0, 116.0), _rec("bf16_compile", 0, 109.0), _rec("loka_compile_default_replay", 0, 84.0),
    ]  # fmt: skip
    runs = [r["run"] for r in records]
    rows = {r["run"]: r for r in e2e.aggregate(records, ["r"], runs)}
    dmpc = rows["loka_dmpc2_compile_default_replay"]
    assert dmpc["speed_reference"] == {0: {"run": "bf16_dmpc2_compile", "median_step_ms": 118.0}}
    assert dmpc["speed_reference_kind"] == "dmpc" and dmpc["speedup_vs_reference"] == pytest.approx(118.0 / 97.0)
    assert rows["loka_compile_default_replay"]["speedup_vs_reference"] == pytest.approx(109.0 / 84.0)
    meta = _report_meta("H200", "2.11", nproc=4, steps=200, window_start=100, recipe="r")
    md = e2e.to_markdown(meta, e2e.aggregate(records, ["r"], runs), records)
    assert ("Same architecture in bf16: seed 0: `bf16_compile` (109.00 ms). For the runs under DMPCollection "
            "(groups of two ranks): seed 0: `bf16_dmpc2_compile` (118.00 ms).") in md
    pairs = [line for line in md.splitlines() if line.startswith("| r | 0 | loka_")]
    assert pairs == ["| r | 0 | loka_dmpc2_compile_default_replay (1) | bf16_dmpc2_compile (2) | 1.206x | 1.196x - 1.216x |"]


def test_markdown_names_the_reference_and_shows_plan_gemm_share_and_ceiling():
    e2e = _driver()
    profile = {"steps": [290, 294], "source": "cuda kernels", "wall_ms_per_step": 9.0, "kernel_ms_per_step": 8.0,
               "idle_share": 0.1, "gemm_share": 0.8, "amdahl_2x_gemm_ceiling": 1.667, "amdahl_2x_gemm_ceiling_wall": 1.5,
               "shares": {"gemm_bf16": 0.5, "gemm_fp8": 0.3, "fp8_quantize": 0.05, "attention": 0.0, "embedding": 0.05,
                          "comms": 0.0, "memcpy_memset": 0.0, "other": 0.1}}  # fmt: skip
    loka = dict(_rec("loka_compile", 0, 6.0, 0.81, profile=profile, mean_ms=6.5), command="x",
                dispatch={"summary": "10/35 GEMMs in FP8 (scaled_mm:rowwise x10, bf16 x25)", "fp8_by_backend": {"scaled_mm": 10},
                          "fp8_gemms": 10, "gemms": 35}, peak_memory_gb=4.5, peak_memory_window_gb=2.25)  # fmt: skip
    records = [_rec("bf16", 0, 14.0), _rec("bf16_compile_cudagraphs", 0, 8.0), loka]
    meta = _report_meta("H100", "2.13", nproc=1, steps=300, window_start=180, recipe="r")
    runs = ["bf16", "bf16_compile_cudagraphs", "loka_compile"]
    md = e2e.to_markdown(meta, e2e.aggregate(records, ["r"], runs), records)
    assert "Same architecture in bf16: seed 0: `bf16_compile_cudagraphs` (8.00 ms)." in md
    assert "User's job: none (not run, or did not complete)" in md
    row = next(line for line in md.splitlines() if line.startswith("| loka_compile |"))
    assert row.startswith("| loka_compile | reduce-overhead | ok | 6.00 [6.00, 6.00], 6.50 | n/a | 1.333x | 2.333x |")
    assert row.endswith("| 10/35 GEMMs in FP8 (scaled_mm:rowwise x10, bf16 x25) | n/a | 80.0 | 1.667x |")
    assert "| bf16 | none | ok | 14.00 [14.00, 14.00], 14.00 | n/a | 0.571x | 1.000x |" in md
    assert "| 4.50 (2.25) |" in row  # the whole run's peak memory, and the timed window's
    assert "## Where the step goes" in md


def test_gpu_window_takes_the_samples_inside_the_timed_steps(tmp_path):
    import datetime

    e2e = _driver()
    path = tmp_path / "gpu_samples.csv"
    t0 = 1_800_000_000.0
    rows = [
        f"{datetime.datetime.fromtimestamp(t0 + i).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {1980 - 10 * i}, {500 + i}, {50 + i}"
        for i in range(10)
    ]
    path.write_text("\n".join(rows + ["2026/11/26 06:00:00.000, [N/A], 500, 60", "not a sample"]) + "\n")
    window = e2e.gpu_window(str(path), [t0 + 2, t0 + 5])  # samples 2..5
    assert window == {"sm_clock_mhz": 1945.0, "power_w": 503.5, "temperature_c_max": 55.0, "samples": 4}
    assert e2e.gpu_window(str(path), None) is None and e2e.gpu_window(str(tmp_path / "none.csv"), [t0, t0 + 9]) is None
    lines = e2e.gpu_section([{"recipe": "dhen_xl", "run": "loka_compile", "seed": 0, "gpu_window": window}])
    assert "| dhen_xl | loka_compile | 0 | 1945 | 504 | 55 | 4 |" in lines


def test_host_section_shows_the_window_counters_and_the_cuda_graphs():
    e2e = _driver()
    window = {"data_wait_ms": 0.0123, "thread_cpu_ms": 9.5, "process_cpu_ms": 12.25, "thread_switches_voluntary_per_step": 3.0,
              "thread_switches_involuntary_per_step": 0.125, "threads": 41.0, "gc0_per_step": 2.5, "gc1_per_step": 0.25, "gc2_per_step": 0.0,
              "cuda_mallocs_per_step": 0.0, "cuda_frees_per_step": 0.0, "alloc_retries_per_step": 0.0}  # fmt: skip
    graphs = {"functions": 12, "graphs": 8, "new_paths": 1, "rerecords": 0, "skips": 0}
    records = [
        {"recipe": "dhen_large", "run": "loka_compile", "seed": 0, "status": "ok", "host_window": window,
         "compile": {"cuda_graphs": graphs}},
        {"recipe": "dhen_large", "run": "bf16", "seed": 0, "status": "ok", "host_window": window, "compile": {"cuda_graphs": None}},
        {"recipe": "dhen_large", "run": "te", "seed": 0, "status": "failed"},
    ]  # fmt: skip
    lines = e2e.host_section(records)
    assert "| dhen_large | loka_compile | 0 | 0.012 | 9.50 / 12.25 | 3.0 / 0.12 | 41 | 2.50 / 0.25 / 0.00 | 0.00 / 0.00 | 0.00 | 8 / 1 / 0 / 0 |" in lines
    assert any(line.startswith("| dhen_large | bf16 | 0 |") and line.endswith("| none |") for line in lines)
    assert not any("| te |" in line for line in lines) and e2e.host_section(records[2:]) == []


def test_a_repeat_runs_the_same_configuration_and_shows_the_run_to_run_spread(capsys):
    e2e = _driver()
    args = e2e.parse_args(["--runs", "bf16_compile_cudagraphs,loka_compile,loka_compile@2,bf16_compile_cudagraphs@2"])
    assert [name for _, _, name in e2e.run_order(args)][:4] == args.runs  # A B B A, as listed
    repeat = e2e.run_spec("loka_compile@2")
    assert repeat.name == "loka_compile@2" and repeat.overrides == e2e.RUNS["loka_compile"].overrides
    assert repeat.compile == "reduce-overhead"
    for bad in ("loka_compile@1", "loka_compile@x", "nope@2", "loka_compile@"):
        with pytest.raises(KeyError):
            e2e.run_spec(bad)
        with pytest.raises(SystemExit):
            e2e.parse_args(["--runs", bad])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--runs", "bf16,bf16"])
    assert "listed twice; name a repeat" in capsys.readouterr().err
    # The repeat's speed-up is against the first bf16 run: 8 / 8.4 is the spread of one configuration.
    records = [_rec("bf16_compile_cudagraphs", 0, 8.0), _rec("loka_compile", 0, 7.5), _rec("loka_compile@2", 0, 7.7),
               _rec("bf16_compile_cudagraphs@2", 0, 8.4)]  # fmt: skip
    rows = {r["run"]: r for r in e2e.aggregate(records, ["r"], args.runs)}
    assert rows["bf16_compile_cudagraphs@2"]["speedup_vs_reference"] == pytest.approx(8.0 / 8.4)
    assert rows["loka_compile@2"]["speedup_vs_reference"] == pytest.approx(8.0 / 7.7)
    assert rows["loka_compile@2"]["compile"] == "reduce-overhead"


def test_gain_split_walks_from_the_users_job_to_lokas_run_in_three_moves():
    """The Mods (user's job -> same-architecture bf16 with fp32 comms), LoKA's comms (-> the same with
    `auto` comms), the FP8 GEMMs (-> LoKA); each the faster compile mode of its runs; the moves multiply."""
    e2e = _driver()
    assert set(e2e._FP32_COMMS) <= set(e2e.run_spec("bf16_compile").overrides)
    assert set(e2e._FP32_COMMS) <= set(e2e.run_spec("bf16_probed_compile_cudagraphs").overrides)
    assert not any("loka.comms" in o for o in e2e.run_spec("bf16_auto_comms_compile").overrides)
    assert "train.dense_allreduce=bf16" in e2e.run_spec("loka_compile_default_bf16_allreduce").overrides
    records = [
        _rec("plain_compile", 0, 180.0), _rec("plain_compile_cudagraphs", 0, 170.0),
        _rec("bf16_compile", 0, 160.0), _rec("bf16_auto_comms_compile", 0, 64.0),
        _rec("loka_compile_default", 0, 60.0), _rec("loka_compile_default", 1, 61.0),  # seed 1 has no user's job
    ]  # fmt: skip
    lines = e2e.gain_split_section(records, ["r"])
    row = next(line for line in lines if line.startswith("| loka_compile_default | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:6] == ["170.00 (`plain_compile_cudagraphs`)", "160.00 (`bf16_compile`)",
                          "64.00 (`bf16_auto_comms_compile`)", "60.00"]  # fmt: skip
    moves = [float(c.rstrip("x")) for c in cells[6:10]]
    assert moves == pytest.approx([170 / 160, 160 / 64, 64 / 60, 170 / 60], abs=1e-3)
    assert not any(line.startswith("| loka_compile_default | 1 |") for line in lines)
    # A missing middle run leaves its moves n/a; the whole is still against the user's job.
    partial = e2e.gain_split_section([r for r in records if r["run"] != "bf16_auto_comms_compile"], ["r"])
    row = next(line for line in partial if line.startswith("| loka_compile_default | 0 |"))
    assert "| 1.062x | n/a | n/a | 2.833x |" in row
    assert e2e.gain_split_section([_rec("loka_compile_default", 0, 60.0)], ["r"]) == []


def test_the_strongest_baselines_section_takes_the_faster_of_each_and_names_what_did_not_run():
    """LoKA against the faster compile mode of the user's job and the faster torchao run, with the
    peak memory ratio; a baseline missing from the call is named, a LoKA run without any is "not run"."""
    e2e = _driver()
    loka = dict(_rec("loka_nomods_compile", 0, 12.0), peak_memory_gb=6.0, peak_memory_window_gb=2.0)
    records = [
        dict(_rec("plain_compile", 0, 15.0), peak_memory_gb=4.0, peak_memory_window_gb=2.5),
        dict(_rec("plain_compile_cudagraphs", 0, 13.0), peak_memory_gb=5.0, peak_memory_window_gb=2.5),
        _rec("torchao_rowwise_compile", 0, 12.5), _rec("torchao_tensorwise_compile", 0, 14.0, status="failed"),
        loka, _rec("loka_nomods_compile", 1, 11.0),  # seed 1 has no baseline
    ]  # fmt: skip
    lines = e2e.strongest_baselines_section(records, ["r"])
    row = next(line for line in lines if line.startswith("| loka_nomods_compile | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:4] == ["12.00", "13.00 (`plain_compile_cudagraphs`)"]
    assert float(cells[4].rstrip("x")) == pytest.approx(13 / 12, abs=1e-3)
    assert cells[5] == "12.50 (`torchao_rowwise_compile`); not run: `torchao_tensorwise_compile`"  # it failed
    assert float(cells[6].rstrip("x")) == pytest.approx(12.5 / 12, abs=1e-3)
    assert cells[7:9] == ["not run", "n/a"]  # no TE in this call
    assert cells[9] == "1.200x (0.800x)"  # 6.0 / 5.0 over the run, 2.0 / 2.5 in the window
    row1 = next(line for line in lines if line.startswith("| loka_nomods_compile | 1 |"))
    assert "| not run | n/a | not run | n/a | not run | n/a |" in row1
    with_te = e2e.strongest_baselines_section(records + [_rec("te", 0, 15.0)], ["r"])
    cells = [c.strip() for c in next(line for line in with_te if line.startswith("| loka_nomods_compile | 0 |")).strip("|").split("|")]
    assert cells[7] == "15.00 (`te`); not run: `te_compile`" and float(cells[8].rstrip("x")) == pytest.approx(15 / 12, abs=1e-3)
    only_graphs = [r for r in records if r["run"] != "plain_compile"]
    row = next(line for line in e2e.strongest_baselines_section(only_graphs, ["r"]) if line.startswith("| loka_nomods_compile | 0 |"))
    assert "13.00 (`plain_compile_cudagraphs`); not run: `plain_compile`" in row
    assert e2e.strongest_baselines_section([_rec("plain_compile", 0, 15.0)], ["r"]) == []


def test_the_peak_memory_section_names_the_work_that_set_each_runs_peak():
    e2e = _driver()
    rises = [{"at": "step 1", "gib": 3.0, "rise_gib": 3.0}, {"at": "step 30 (compiled modules eager: a probe step)", "gib": 5.15,
                                                             "rise_gib": 2.15}]  # fmt: skip
    records = [dict(_rec("loka_compile", 0, 10.0), peak_memory_rises=rises), _rec("bf16", 0, 12.0),
               dict(_rec("plain_compile", 0, 11.0), peak_memory_rises=rises[:1])]  # fmt: skip
    lines = e2e.peak_memory_section(records)
    assert "| r | loka_compile | 0 | step 30 (compiled modules eager: a probe step) | 5.15 | step 1 3.00 | n/a |" in lines
    assert "| r | plain_compile | 0 | step 1 | 3.00 | - | n/a |" in lines
    assert not any("| bf16 |" in line for line in lines)  # no trace (a CPU run, an older summary)
    assert e2e.peak_memory_section([_rec("bf16", 0, 12.0)]) == []
    assert e2e.metrics_from_summary({"peak_memory_rises": rises})["peak_memory_rises"] == rises


def test_the_peak_memory_section_names_the_planning_work_that_raised_the_peak():
    e2e = _driver()
    planning = [{"phase": f"probe: evaluating layer{i}", "rise_gib": 0.1 * (i + 1), "gib": 3.0 + i} for i in range(5)]
    planning.insert(2, {"phase": "dispatch: layer check at step 39", "rise_gib": 2.5, "gib": 9.0})
    summary = {"peak_memory_rises": [{"at": "step 39 (a plan made at its end)", "gib": 9.0, "rise_gib": 6.0}],
               "loka": {"planning_peak_rises": planning}}  # fmt: skip
    record = dict(_rec("loka_compile", 0, 10.0), **e2e.metrics_from_summary(summary))
    row = next(line for line in e2e.peak_memory_section([record]) if "| loka_compile |" in line)
    cell = row.strip("|").split("|")[-1].strip()
    # the check in full and in order; of the five evaluations the three largest rises, the two others summed
    assert cell == (
        "dispatch: layer check at step 39 +2.50 to 9.00; probe: evaluating layer2 +0.30 to 5.00; "
        "probe: evaluating layer3 +0.40 to 6.00; probe: evaluating layer4 +0.50 to 7.00; "
        "2 smaller evaluation rise(s), +0.30 in all"
    )
    summary["loka"]["planning_peak_rises"] = []
    record = dict(_rec("loka_compile", 0, 10.0), **e2e.metrics_from_summary(summary))
    assert next(line for line in e2e.peak_memory_section([record]) if "| loka_compile |" in line).endswith("| - |")


def test_a_run_stopped_after_its_last_step_counts_and_says_so(tmp_path):
    """A run killed by the timeout during its final evaluation has written every step's time: its
    summary counts, with the reason; a run stopped earlier, or without a summary, does not."""
    e2e = _driver()
    run = tmp_path / "r" / "loka_compile" / "seed0"
    run.mkdir(parents=True)
    assert e2e.read_run(str(run), "timeout", "timed out after 284 s", 330) == {"status": "timeout", "reason": "timed out after 284 s"}
    assert e2e.read_run(str(run), "ok", None, 330)["status"] == "failed"  # exit 0 without a summary
    (run / "summary.json").write_text(json.dumps({"steps": 200, "median_step_ms": 86.0}))
    assert e2e.read_run(str(run), "timeout", "timed out after 284 s", 330)["status"] == "timeout"
    (run / "summary.json").write_text(json.dumps({"steps": 330, "median_step_ms": 86.0}))
    late = e2e.read_run(str(run), "timeout", "timed out after 284 s", 330)
    assert late["status"] == "ok" and late["median_step_ms"] == 86.0
    assert late["reason"] == "timed out after 284 s, after its last training step (330); its summary is complete"
    assert e2e.read_run(str(run), "ok", None, 330)["reason"] is None


def test_reread_rebuilds_an_earlier_report_from_the_runs_folders(tmp_path):
    e2e = _driver()
    runs = tmp_path / "runs"
    records = []
    for name, ms, status in (("bf16_compile", 110.0, "ok"), ("loka_compile_default", None, "timeout")):
        folder = runs / "r" / name / "seed0"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"steps": 30, "median_step_ms": ms or 86.0, "eval_ne": 0.8}))
        rec = dict(_rec(name, 0, ms), status=status, run_dir=f"/elsewhere/{name}")
        if status != "ok":
            rec.update(reason="timed out after 284 s", median_step_ms=None)
        records.append(rec)
    settings = {"recipes": ["r"], "runs": ["bf16_compile", "loka_compile_default"], "seeds": [0], "steps": 30,
                "window_start": 15, "probe_warmup": 5, "nproc": 1, "device": "cpu", "autocast": "bf16", "override": []}  # fmt: skip
    earlier = {"date": "2026-11-28", "device": "cpu", "command": "e2e_compare.py", "versions": {}, "settings": settings,
               "runs_dir": "/elsewhere", "seconds": 5.0, "table": [], "runs": records}  # fmt: skip
    path = tmp_path / "call.json"
    path.write_text(json.dumps(earlier))
    assert e2e.main(["--reread", str(path), "--runs-dir", str(runs)]) == 0
    again = json.loads(path.read_text())
    loka = next(r for r in again["runs"] if r["run"] == "loka_compile_default")
    assert loka["status"] == "ok" and loka["median_step_ms"] == 86.0 and "its summary is complete" in loka["reason"]
    row = next(r for r in again["table"] if r["run"] == "loka_compile_default")
    assert row["median_step_ms"] == 86.0
    assert "`--reread`" in (tmp_path / "call.md").read_text()
    with pytest.raises(SystemExit, match="lacks settings, runs"):
        (tmp_path / "other.json").write_text(json.dumps({"date": "2026-11-28"}))
        e2e.main(["--reread", str(tmp_path / "other.json")])
    with pytest.raises(SystemExit):  # argparse: no such file
        e2e.parse_args(["--reread", str(tmp_path / "nothing.json")])


def test_comms_section_shows_the_collectives_of_multi_rank_runs_only():
    e2e = _driver()
    comms = {"ms_per_step": {"all_to_all": {"forward": 1.0, "backward": 2.0, "outside": 3.0},
                             "all_reduce": {"forward": 0.0, "backward": 20.0, "outside": 0.0},
                             "other": {"forward": 0.0, "backward": 0.0, "outside": 0.0}},
             "total_ms_per_step": 26.0, "exposed_ms_per_step": {"all_to_all": 2.5, "all_reduce": 1.5, "other": 0.0, "all": 4.0}}  # fmt: skip
    profile = {"wall_ms_per_step": 80.0, "comms": comms}
    multi = dict(_rec("plain_compile", 0, 80.0, profile=profile), world_size=4,
                 dense_allreduce={"precision": "bf16", "bucket_cap_mb": 25.0, "ddp": True, "comm_hooks": ["bf16_compress_hook"]})
    single = dict(_rec("bf16_compile", 0, 70.0, profile=profile), world_size=1)
    lines = e2e.comms_section([multi, single])
    assert lines[0] == "## What the collectives cost"
    assert "| r | plain_compile | 0 | fp32 (TorchRec) | bf16_compress_hook, 25 MiB | 1.00 / 2.00 / 3.00 | 20.00 | 0.00 | 2.50 / 1.50 / 4.00 | 5.0 |" in lines
    assert not any("| bf16_compile |" in line for line in lines)
    assert e2e.comms_section([single]) == []


def test_the_default_window_waits_for_the_step_checks_of_several_ranks():
    e2e = _driver()
    check = e2e.comms_check_steps()
    assert check == 4 * (2 + 10)  # 4 blocks of 2 settling + 10 timed steps at CommsConfig's default
    window = lambda nproc, runs: e2e.parse_args(["--nproc", str(nproc), "--steps", "500", "--probe-warmup", "100",
                                                 "--runs", runs]).window_start  # fmt: skip
    plan = 100 + e2e.plan_trial_steps() + 25
    assert window(1, "loka_compile") == plan  # one rank: no comms check
    assert window(4, "loka_compile") == plan + check
    assert window(4, "loka_compile,plain_compile_auto_allreduce") == plan + 2 * check


def test_serving_section_shows_each_exported_module_and_the_eval_ne_served():
    e2e = _driver()
    assert "train.export_serving=true" in e2e.run_spec("loka_compile_default_export").overrides
    quality = {"trained": {"ne": 0.80}, "served": {"ne": 0.80}, "served_high_precision": {"ne": 0.79}}
    serving = {"over_arch": {"exported": True, "verified": True, "summary": "25/25 linear layers in FP8 for inference", "eval": quality},
               "dense_arch": {"exported": False, "reason": "not called in the evaluation batch"}}  # fmt: skip
    lines = e2e.serving_section([dict(_rec("loka_compile_default_export", 0, 6.0), serving=serving), _rec("bf16", 0, 7.0, ne=0.78)])
    assert lines[0] == "## Serving what training ran"
    assert ("| r | loka_compile_default_export | 0 | over_arch | 25/25 linear layers in FP8 for inference | yes | 0.80000 | 0.80000 "
            "| 0.79000 | +1.266 | +2.564 (`bf16`) |") in lines  # against the model trained without LoKA  # fmt: skip
    alone = e2e.serving_section([dict(_rec("loka_compile_default_export", 0, 6.0), serving=serving)])
    assert any(line.endswith("| +1.266 | n/a |") for line in alone)  # no bf16 run in the call
    assert any("dense_arch | not exported: not called in the evaluation batch" in line for line in lines)
    assert e2e.serving_section([_rec("bf16", 0, 7.0)]) == []


def test_a_replay_run_pins_the_plan_it_is_given_and_refuses_to_run_without_one(tmp_path, capsys):
    e2e = _driver()
    plan = tmp_path / "dispatch_plan.json"
    plan.write_text("{}")
    args = e2e.parse_args(["--recipes", "dhen_xl", "--runs", "plain_compile,loka_compile_default_replay,loka_compile_default_replay@2",
                           "--steps", "200", "--replay-plan", str(plan)])  # fmt: skip
    replay = e2e.run_overrides(args, "dhen_xl", e2e.run_spec("loka_compile_default_replay@2"), 0)
    for item in ("loka.dispatch.mode=pinned", f"loka.dispatch.plan_path={plan}", "loka.probe.enabled=false", "loka.mods.preset=all_but_no_bias"):
        assert item in replay
    assert not any(item.startswith("loka.dispatch.plan_path") for item in e2e.run_overrides(args, "dhen_xl", e2e.RUNS["plain_compile"], 0))
    dmpc = e2e.run_overrides(args, "dhen_xl", e2e.run_spec("loka_dmpc2_compile_default_replay"), 0)  # under DMPCollection
    assert f"loka.dispatch.plan_path={plan}" in dmpc and "train.sharding_group_size=2" in dmpc
    assert args.window_start == 100  # no run plans: the second half is timed
    for bad, expected in (
        (["--runs", "loka_compile_default_replay"], "--replay-plan: required by loka_compile_default_replay"),
        (["--runs", "loka_compile_default_replay,loka_compile_default", "--steps", "600"], "unless loka_compile_default comes before"),
        (["--runs", "loka_compile_default_replay", "--replay-plan", str(tmp_path / "none.json")], "no such file"),
        (["--recipes", "dhen_xl,dcnv2_large", "--runs", "loka_compile_default_replay", "--replay-plan", str(plan)], "one plan fits one model"),
    ):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)
        assert expected in capsys.readouterr().err


def test_the_repeated_runs_section_gives_each_configurations_spread_and_mean_ratios():
    e2e = _driver()
    records = [_rec("plain_compile", 0, 113.53), _rec("loka_compile_default_replay", 0, 85.37),
               _rec("loka_compile_default_replay@2", 0, 83.89), _rec("plain_compile@2", 0, 112.97),
               _rec("bf16_compile", 0, 107.83), _rec("torchao_rowwise_compile", 0, 90.0),
               _rec("torchao_rowwise_compile@2", 0, 91.0, status="timeout")]  # fmt: skip
    text = "\n".join(e2e.repeats_section(records, ["r"]))
    assert "| r | 0 | plain_compile | 113.53 / 112.97 | 113.25 | 0.5% |" in text
    assert "| r | 0 | loka_compile_default_replay | 85.37 / 83.89 | 84.63 | 1.8% |" in text
    assert "torchao_rowwise_compile |" not in text  # its repeat did not complete: nothing to compare
    # mean over mean 113.25 / 84.63; every pair from 112.97 / 85.37 to 113.53 / 83.89
    assert "| r | 0 | loka_compile_default_replay (2) | plain_compile (2) | 1.338x | 1.323x - 1.353x |" in text
    assert "| r | 0 | loka_compile_default_replay (2) | bf16_compile (1) | 1.274x | 1.263x - 1.285x |" in text
    assert e2e.repeats_section([_rec("plain_compile", 0, 1.0), _rec("loka_compile", 0, 1.0)], ["r"]) == []


def test_without_a_plan_file_a_replay_pins_the_plan_of_this_calls_loka_run(tmp_path, monkeypatch, capsys):
    """One command for the pairs: the call's ``loka_compile_default`` run plans, and the replays after
    it pin the plan it wrote (per recipe and seed); a replay whose plan is missing is skipped, with why."""
    e2e = _driver()
    monkeypatch.setattr(e2e, "job_has_compile_option", lambda: True)
    reports = []
    monkeypatch.setattr(e2e, "write_report", lambda base, meta, records, recipes, runs: reports.append(list(records)))
    launched = []

    def fake_launch(args, recipe, spec, seed, run_dir, timeout):
        overrides = e2e.run_overrides(args, recipe, spec, seed)
        launched.append((recipe, spec.name, [o for o in overrides if o.startswith("loka.dispatch.plan_path=")]))
        if spec.name == "loka_compile_default" and recipe == "dhen_xl":  # only this one writes a plan
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "dispatch_plan.json"), "w") as f:
                f.write("{}")
        return {"recipe": recipe, "run": spec.name, "seed": seed, "status": "ok", "run_dir": run_dir}

    monkeypatch.setattr(e2e, "launch", fake_launch)
    runs = "loka_compile_default,plain_compile,loka_compile_default_replay,loka_compile_default_replay@2,plain_compile@2"
    assert e2e.main(["--recipes", "dhen_xl,dcnv2_large", "--runs", runs, "--seeds", "0", "--steps", "600",
                     "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]) == 0  # fmt: skip
    plan = str(tmp_path / "runs" / "dhen_xl" / "loka_compile_default" / "seed0" / "dispatch_plan.json")
    replays = [(recipe, name, paths) for recipe, name, paths in launched if "replay" in name]
    assert replays == [("dhen_xl", "loka_compile_default_replay", [f"loka.dispatch.plan_path={plan}"]),
                       ("dhen_xl", "loka_compile_default_replay@2", [f"loka.dispatch.plan_path={plan}"])]  # fmt: skip
    assert [name for recipe, name, _ in launched if recipe == "dcnv2_large"] == ["loka_compile_default", "plain_compile", "plain_compile@2"]
    out = capsys.readouterr().out
    assert ("dcnv2_large / loka_compile_default_replay / seed 0: skipped (no plan to replay: this call's "
            "loka_compile_default run of dcnv2_large, seed 0, wrote none)") in out  # fmt: skip
    # the report names the plan each replay pinned
    records = reports[-1]
    assert {r["replay_plan"] for r in records if r["recipe"] == "dhen_xl" and "replay" in r["run"]} == {plan}
    meta = {"date": "d", "device": "cpu", "command": "c", "versions": {}, "seconds": 1.0,
            "settings": {"recipes": ["dhen_xl"], "runs": runs.split(","), "seeds": [0], "steps": 600, "window_start": 500,
                         "probe_warmup": 200, "nproc": 1, "device": "cpu", "autocast": "bf16", "override": []}}  # fmt: skip
    for r in records:
        r.setdefault("median_step_ms", 10.0)
    text = e2e.to_markdown(meta, e2e.aggregate(records, ["dhen_xl"], runs.split(",")), records)
    assert f"The replay runs of seed 0 pinned `{plan}`." in text
