"""The training job through its real entry point: torchrun, 2 gloo ranks, TorchRec DMP.

The command line itself (torchrun, a plain process, argument errors) runs as a user runs it; the
tests of what the job does run the same entry point in ranks forked from the tests' forkserver,
with torchrun's environment (tests/multirank.run_job): 3 s of imports fewer per rank.
"""

import json
import os
import subprocess
import sys

import pytest

from multirank import run_job
from small_job import SMALL_DLRM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

SMALL = [
    *SMALL_DLRM,
    "data.eval_batches=8",
    "train.log_every=10",
    "loka.probe.enabled=false",  # these short runs plan from random evidence at step 2; tests that probe say so
]


def launch(run_dir, *overrides, nproc=2, expect_ok=True, base=SMALL, torchrun=False):
    """The real entry point on ``nproc`` ranks with ``base`` (the small DLRM overrides by default) +
    ``overrides``: through ``torchrun`` itself with ``torchrun=True``, else forked (see the module's docstring)."""
    env = dict(os.environ, LOKA_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = ["-m", "loka_job.train", *base, *overrides]
    os.makedirs(run_dir, exist_ok=True)
    if torchrun:
        # Not from the repository root: there `-m` would import the source tree's loka_torchrec, which
        # lacks the kernels/recipes subpackages that an install (editable here, a copy on a GPU machine) maps in.
        cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *command]
        proc = subprocess.run(cmd, cwd=str(run_dir), env=env, capture_output=True, text=True, timeout=420)
    else:
        proc = run_job(command, env=env, cwd=run_dir, nproc=nproc, timeout=420)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def assert_fp8_planned_and_in_force_said(loka_summary):
    """FP8 was planned, and what runs is said: GEMMs in force are the planned ones less those of the
    layers the safety valve or the step-time guard holds in bf16 (short CPU runs with a 10-step warm-up
    often trip the valve at the first monitoring step)."""
    assert loka_summary["fp8_gemms_planned"] > 0
    held = loka_summary["held_in_bf16"]
    assert loka_summary["fp8_gemms"] == loka_summary["fp8_gemms_planned"] or held, loka_summary["plan"]
    assert ("in force" in loka_summary["plan"]) and (not held or "holds" in loka_summary["plan"] or "guard" in loka_summary["plan"])


def read_metrics(run_dir, rank=0):
    with open(os.path.join(run_dir, f"rank{rank}", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_rank_training_with_loka_learns_and_logs(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["train.steps=60", "train.timing_start=40", "loka.dispatch.min_speedup=0", "loka.dispatch.samples=3",
                 "loka.dispatch.timing_reps=1"]  # fmt: skip
    proc = launch(run_dir, *overrides, torchrun=True)  # the launch a user types
    assert "loka-torchrec run summary" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["world_size"] == 2
    assert "ms waiting for batches, " in proc.stdout and "ms CPU on the training thread" in proc.stdout
    host = summary["host_window"]  # steps 41..60: batches made in the loop, on the CPU
    assert host["data_wait_ms"] > 0 and "gc0_per_step" in host and "cuda_mallocs_per_step" not in host
    assert 0 < host["thread_cpu_ms"] <= host["process_cpu_ms"]
    assert summary["compile"]["cuda_graphs"] is None
    assert summary["eval_ne"] < 1.0
    # loss falls: the first logged window's NE is above the last one's
    train = [r for r in read_metrics(run_dir) if "train/ne" in r]
    assert train[-1]["train/ne"] < train[0]["train/ne"]
    for rank in (0, 1):
        assert (run_dir / f"rank{rank}" / "metrics.jsonl").is_file()
        assert (run_dir / f"rank{rank}" / "train.log").stat().st_size > 0
    plan = json.loads((run_dir / "dispatch_plan.json").read_text())
    assert plan["step"] == 2 and plan["layers"]
    # with the speed gate off, accurate FP8 kernels run (real torch._scaled_mm on the CPU)
    assert summary["loka"]["fp8_gemms"] > 0
    assert "LoKA dispatch plan" in proc.stdout
    # comms at the default: decided by timing the all-to-all on both ranks, before the first step
    comms = json.loads((run_dir / "comms_plan.json").read_text())
    choice = comms["choice"]
    assert choice["world_size"] == 2 and choice["decided"] == ["forward", "backward"] and not comms["restored"]
    # The timing's choice; where it chose fp8, the step check (run once the plan is judged, 48 steps)
    # keeps it only if the training step was faster with it, and says so.
    verdict = (choice.get("step_check") or {}).get("verdict")
    for direction in ("forward", "backward"):
        times = choice["times_ms"][direction]
        assert set(times) == {"fp32", "fp8"} and all(t > 0 for t in times.values())
        timed = "fp8" if times["fp8"] < times["fp32"] else "fp32"
        if verdict is not None and timed == "fp8":
            assert choice["step_check"]["chosen"][direction] == "fp8"
            timed = "fp8" if verdict["keep_chosen"] else "fp32"
        assert comms[direction] == timed
    payload = choice["payload"]  # the job's batch size, 2 warm-up and 5 timed runs per candidate
    assert (payload["rows_per_rank"], payload["warmup"], payload["reps"]) == (128, 2, 5)
    assert payload["values_per_rank"] == 128 * payload["width"] * 2
    assert summary["loka"]["comms_choice"] == choice
    assert "embedding comms  forward" in proc.stdout


@pytest.mark.slow
def test_resume_continues_step_counter_and_metrics(tmp_path):
    run_dir = tmp_path / "run"
    launch(run_dir, "train.steps=20", "train.checkpoint_every=10", "loka.dispatch.mode=all:scaled_mm:rowwise")
    assert (run_dir / "checkpoints" / "step_000020" / "meta.json").is_file()
    resumed = tmp_path / "resumed"
    proc = launch(resumed, "train.steps=30", f"train.resume={run_dir}", "loka.dispatch.mode=all:scaled_mm:rowwise")
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"] == 20 and summary["steps"] == 30 and summary["steps_this_run"] == 10
    # the default window skips min(5, 10 // 4) warm-up steps of this run; the host's counters cover it too
    assert summary["timed_window"] == [23, 30] and summary["host_window"]["thread_cpu_ms"] > 0
    steps = [r["step"] for r in read_metrics(resumed) if "train/ne" in r]
    assert steps[0] == 30  # the step counter continued from 20 (logging every 10)
    assert "resumed" in (resumed / "rank0" / "train.log").read_text()
    # the comms decision comes back from the checkpoint, not from a new timing
    first, again = (json.loads((d / "comms_plan.json").read_text()) for d in (run_dir, resumed))
    assert not first["restored"] and again["restored"]
    assert again["choice"] == first["choice"]  # same timings and decision time: nothing was re-timed
    assert "restored from the checkpoint" in (resumed / "rank0" / "train.log").read_text()


@pytest.mark.slow
def test_single_process_without_torchrun(tmp_path):
    env = dict(os.environ, LOKA_RUN_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("MASTER_ADDR", None)
    cmd = [sys.executable, "-m", "loka_job.train", *SMALL, "train.steps=10", "loka.enabled=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoKA             off" in proc.stdout


# The DHEN and HSTU recipes (recipes/model/{dhen,hstu}.yaml) as they are, made faster: fewer,
# smaller batches and a cheap dispatch plan (the CPU speed gate off, as scripts/run.sh does).
FAST_RECIPE = [
    "device=cpu",
    "loka.probe.enabled=false",  # as SMALL; the probe case turns it on
    "train.steps=30",
    "train.log_every=10",
    "train.progress_bar=false",
    "data.batch_size=128",
    "data.eval_batches=4",
    "loka.dispatch.min_speedup=0",
    "loka.dispatch.samples=3",
    "loka.dispatch.timing_reps=1",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, mods, dispatch, probe",
    [
        # The policy's timed plan costs seconds on 2 cores: two runs plan from the probe's evidence
        # (and check the plan's gradients, as the recipe does), two pin FP8 everywhere (same
        # LokaLinear path, no timing). Planning from random evidence: the DLRM runs above.
        ("dhen", "none", "all:scaled_mm:rowwise", False),
        ("dhen", "all", "policy", True),
        ("hstu", "none", "policy", True),
        ("hstu", "all", "all:scaled_mm:rowwise", False),
    ],
)
def test_dhen_and_hstu_recipes_train_through_the_entry_point(tmp_path, model, mods, dispatch, probe):
    run_dir = tmp_path / "run"
    extra = [f"model={model}", f"loka.mods.preset={mods}", f"loka.dispatch.mode={dispatch}"]
    if probe:  # a short warm-up so that the probe's evidence reaches the dispatcher within the run
        extra += ["loka.probe.enabled=true", "loka.probe.warmup_steps=10", "loka.probe.every=5"]
    compiled = dispatch.startswith("all:")  # FP8 everywhere, compiled by CPU inductor through DMP and the pipeline
    extra.append(f"train.compile={'default' if compiled else 'none'}")
    if compiled:  # one interaction/attention layer: half the graph for CPU inductor to build; the layer stack is the uncompiled cases'
        extra.append("model.num_layers=1")
    if compiled and model == "hstu":  # tokens padded to buckets of 512 (~1350 tokens a batch): static shapes
        extra.append("model.token_bucket=512")
    proc = launch(run_dir, *extra, base=FAST_RECIPE)
    assert "loka-torchrec run summary" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    if compiled:
        info = summary["compile"]  # DHEN: over_arch; HSTU: the table-free parts of its over_arch
        assert info["mode"] == "default" and info["graph_breaks"] == 0, info
        names = info["modules"]
        assert names == ["over_arch"] if model == "dhen" else "over_arch.layers.0" in names and "over_arch.head" in names
        # Static shapes (DHEN): one graph per module for training, one for eval. HSTU's tokens padded
        # to buckets: one graph per bucket seen (a batch here has 1150-1540 tokens: one bucket).
        assert 0 < info["graphs"] <= 3 * len(names), info
        assert "torch.compile    mode default" in proc.stdout
        if model == "hstu":  # a graph per bucket, and no dim made dynamic
            assert info["shapes"] == "static" and "torch.compile    mode default, static shapes:" in proc.stdout
    else:
        assert summary["compile"]["mode"] == "none" and summary["compile"]["modules"] == []
    assert summary["steps"] == 30 and summary["world_size"] == 2
    assert summary["eval_ne"] < 1.0
    assert_fp8_planned_and_in_force_said(summary["loka"])
    train = [r for r in read_metrics(run_dir) if "train/ne" in r]
    assert len(train) == 3 and train[-1]["train/ne"] < train[0]["train/ne"]  # loss falls
    hydra_cfg = (run_dir / ".hydra" / "config.yaml").read_text()
    assert f"name: {model}" in hydra_cfg
    assert ("kind: sequence" if model == "hstu" else "kind: pooled") in hydra_cfg
    log = (run_dir / "rank0" / "train.log").read_text()
    if mods == "all":
        assert "mods (preset=all)" in log
        for mod in ("no_bias", "block_norm", "hard_swish", "fuse_siblings", "pad_to_16"):
            assert f"  {mod}: " in log
    else:
        assert "mods (preset=" not in log
    if probe:
        for rank in (0, 1):
            assert (run_dir / "probe" / f"rank{rank}.jsonl").stat().st_size > 0
        plan = json.loads((run_dir / "dispatch_plan.json").read_text())
        assert any(
            role["source"] == "policy/probe" for layer in plan["layers"].values() for role in layer["roles"].values()
        )
        # loka.dispatch.grad_check (on in the recipe): right after the Probe's plan every rank runs the
        # gradient check on the dense modules' recorded inputs (no collective inside, one broadcast)
        # and the run goes on; the check is in the events at the planning step.
        events = [json.loads(line) for line in (run_dir / "dispatch_events.jsonl").read_text().splitlines()]
        checks = [e for e in events if e["event"] == "grad_check"]
        assert checks and {e["step"] for e in checks} == {plan["step"]}, checks
        assert checks[0]["kind"] == "plan" and checks[0]["worst_db"] > 0


@pytest.mark.parametrize(
    "override, message, field",
    [
        ("model=nosuchmodel", "Could not find 'model/nosuchmodel'; the options are dcn, ", "model"),
        ("train.steps=[", "cannot parse the override 'train.steps=['", "train.steps"),
        ("loka.dispatch.mode=all:nosuchbackend:rowwise", "unknown GEMM backend 'nosuchbackend'", "backend"),
        ("train.resume=/nonexistent/run", "'/nonexistent/run' does not exist", "train.resume"),
        ("loka.dispatch.max_mere=-1", "must be > 0, got -1", "dispatch.max_mere"),
        ("loka.dispatch.bogus=1", "Could not override 'loka.dispatch.bogus'", "loka.dispatch.bogus"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, override, message, field):
    """Hydra's errors (a missing config, an override it cannot parse or place) and the job's own
    configuration errors: one line ``error: <what> (<field>)`` and exit status 1, no traceback."""
    env = dict(os.environ, LOKA_RUN_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, "-m", "loka_job.train", *SMALL, "train.steps=2", override]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert message in proc.stderr and proc.stderr.rstrip().endswith(f"({field})"), proc.stderr


@pytest.mark.slow
def test_a_config_error_on_two_ranks_is_one_line_from_rank_0(tmp_path):
    proc = launch(tmp_path / "run", "train.resume=/nonexistent/run", "train.steps=2", expect_ok=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: '/nonexistent/run' does not exist (train.resume)", proc.stderr[-3000:]


def test_deterministic_runs_repeat_exactly_and_say_so(tmp_path):
    """train.deterministic=true: the flag reaches the summary, and two runs of one seed agree
    exactly; so does a third whose batches come from two loader workers (train.data_workers)."""
    summaries = []
    for name, extra in (("a", []), ("b", []), ("workers", ["train.data_workers=2"])):
        launch(tmp_path / name, "train.steps=12", "train.deterministic=true", "loka.enabled=false", *extra, nproc=1)
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    assert all(s["deterministic"] is True for s in summaries)
    for other in summaries[1:]:
        assert other["eval_ne"] == summaries[0]["eval_ne"] and other["train_ne"] == summaries[0]["train_ne"]
    with pytest.raises(ValueError, match="train.deterministic"):
        from loka_job.training.trainer import TrainConfig

        TrainConfig(deterministic="yes")


@pytest.mark.slow
def test_wukong_compiled_with_the_probe_reaches_every_gemm_through_the_job(tmp_path):
    """The reference job drives LoKA through ``Loka.step`` (the README's loop): under compile, with a
    probe cadence longer than a step (steps 1-4 run compiled), the plan manages every GEMM of the
    Wukong model, raw-Parameter token mixing included, and the step compiles without graph breaks."""
    run_dir = tmp_path / "run"
    extra = ["model=wukong", "model.num_layers=1", "loka.probe.enabled=true", "loka.probe.warmup_steps=10",
             "loka.probe.every=5", "train.compile=default"]  # fmt: skip
    proc = launch(run_dir, *extra, base=FAST_RECIPE)
    assert "loka-torchrec run summary" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compile"]["mode"] == "default" and summary["compile"]["graph_breaks"] == 0, summary["compile"]
    plan = json.loads((run_dir / "dispatch_plan.json").read_text())
    assert plan["never_ran"] == {} and plan["coverage"]["share"] == 1.0 and plan["coverage"]["ran_checked"]
    assert {"over_arch.layers.0.fmb.projection", "over_arch.layers.0.lcb.weight"} <= set(plan["layers"])
    assert summary["loka"]["fp8_gemms"] > 0


# The zoo's Probe runs (as the Wukong one): under compile, a probe cadence longer than a step.
ZOO_PROBE = ["loka.probe.enabled=true", "loka.probe.warmup_steps=10", "loka.probe.every=5", "train.compile=default", "train.steps=14"]


@pytest.mark.slow
def test_interformer_compiled_with_the_probe_reaches_every_gemm_but_the_pma_through_the_job(tmp_path):
    """The Interformer-style model under compile with the Probe: the step compiles without graph
    breaks and the plan manages every GEMM except the PMA's. The PMA is ``nn.MultiheadAttention``
    used as cross-attention (learned seeds attend over the sequence), which LoKA runs in high
    precision and reports: its in- and out-projections are the plan's never-ran sites and its
    coverage's unreached GEMMs, the in-projection with the reason."""
    run_dir = tmp_path / "run"
    # Histories of one length: one jagged token count, so no dynamic-shape recompile on 2 CPU cores.
    extra = ["model=interformer", "model.num_layers=1", "data.min_seq_len=8", "data.max_seq_len=8", *ZOO_PROBE]
    proc = launch(run_dir, *extra, base=FAST_RECIPE)
    assert "loka-torchrec run summary" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compile"]["mode"] == "default" and summary["compile"]["graph_breaks"] == 0, summary["compile"]
    assert summary["eval_ne"] < 1.0
    plan = json.loads((run_dir / "dispatch_plan.json").read_text())
    pma = {f"over_arch.{layer}sequence_summary.pma.{gemm}" for layer in ("layers.0.", "") for gemm in ("in_proj_weight", "out_proj")}
    assert set(plan["never_ran"]) == pma and plan["coverage"]["ran_checked"]
    for name in pma:
        if name.endswith("in_proj_weight"):
            assert "cross-attention (query is not key and value)" in plan["never_ran"][name]
    coverage = plan["coverage"]
    assert set(coverage["unreached"]) == pma and 0.9 < coverage["share"] < 1.0
    assert coverage["managed_macs_per_row"] + sum(coverage["unreached"].values()) == coverage["total_macs_per_row"]
    # reached: the self-attention, TorchRec's LowRankCrossNet (raw Parameters), the personalized FFN's weights
    assert {"over_arch.layers.0.sequence.attention.in_proj_weight", "over_arch.layers.0.sequence.attention.out_proj",
            "over_arch.layers.0.interaction.cross.V_kernels.0", "over_arch.layers.0.interaction.cross.W_kernels.0",
            "over_arch.layers.0.sequence.personalize"} <= set(plan["layers"]) - pma  # fmt: skip
    assert_fp8_planned_and_in_force_said(summary["loka"])


@pytest.fixture(scope="module")
def dcnv2_run(tmp_path_factory):
    """DCN-V2's recipe (full-rank TorchRec CrossNet) through the job under compile with the Probe, once."""
    run_dir = tmp_path_factory.mktemp("dcnv2") / "run"
    proc = launch(run_dir, "model=dcnv2", *ZOO_PROBE, base=FAST_RECIPE)
    return run_dir, proc


@pytest.mark.slow
def test_dcnv2_compiled_with_the_probe_reaches_every_gemm_crossnet_included(dcnv2_run):
    """Every GEMM of DCN-V2 is a site the plan manages, and the step compiles without graph breaks:
    TorchRec's MLPs and the logit (``nn.Linear``), and the full-rank ``CrossNet``'s kernels, which it
    multiplies as ``torch.matmul(W_l, x_l.unsqueeze(2))`` (the ``(N, N)`` Parameter on the left of a
    batched right operand)."""
    run_dir, proc = dcnv2_run
    assert "loka-torchrec run summary" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compile"]["mode"] == "default" and summary["compile"]["graph_breaks"] == 0, summary["compile"]
    assert summary["eval_ne"] < 1.0
    plan = json.loads((run_dir / "dispatch_plan.json").read_text())
    assert plan["never_ran"] == {} and plan["coverage"]["ran_checked"]
    assert plan["coverage"]["share"] == 1.0 and plan["coverage"]["unreached"] == {}
    assert set(plan["layers"]) == {"over_arch.dense_arch._mlp.0._linear", "over_arch.dense_arch._mlp.1._linear",
                                   "over_arch.deep._mlp.0._linear", "over_arch.deep._mlp.1._linear", "over_arch.logit",
                                   "over_arch.cross.kernels.0", "over_arch.cross.kernels.1"}  # fmt: skip
    assert_fp8_planned_and_in_force_said(summary["loka"])
