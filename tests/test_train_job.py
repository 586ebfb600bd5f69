"""The training job through its real entry point: torchrun, 2 gloo ranks, TorchRec DMP."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

SMALL = [
    "device=cpu",
    "data.num_tables=4",
    "data.num_embeddings=1000",
    "data.embedding_dim=32",
    "model.dense_arch_layer_sizes=[64,32]",
    "model.over_arch_layer_sizes=[64,32,1]",
    "data.batch_size=128",
    "data.eval_batches=8",
    "train.progress_bar=false",
    "train.log_every=10",
]


def launch(run_dir, *overrides, nproc=2, expect_ok=True):
    env = dict(os.environ, LOKA_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m", "loka_torchrec.train", *SMALL, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_metrics(run_dir, rank=0):
    with open(os.path.join(run_dir, f"rank{rank}", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_rank_training_with_loka_learns_and_logs(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "train.steps=60", "loka.dispatch.min_speedup=0", "loka.dispatch.samples=3", "loka.dispatch.timing_reps=1")
    assert "loka-torchrec run summary" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["world_size"] == 2
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


@pytest.mark.slow
def test_resume_continues_step_counter_and_metrics(tmp_path):
    run_dir = tmp_path / "run"
    launch(run_dir, "train.steps=20", "train.checkpoint_every=10", "loka.dispatch.mode=all:scaled_mm:rowwise")
    assert (run_dir / "checkpoints" / "step_000020" / "meta.json").is_file()
    resumed = tmp_path / "resumed"
    proc = launch(resumed, "train.steps=30", f"train.resume={run_dir}", "loka.dispatch.mode=all:scaled_mm:rowwise")
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"] == 20 and summary["steps"] == 30 and summary["steps_this_run"] == 10
    steps = [r["step"] for r in read_metrics(resumed) if "train/ne" in r]
    assert steps[0] == 30  # the step counter continued from 20 (logging every 10)
    assert "resumed" in (resumed / "rank0" / "train.log").read_text()


@pytest.mark.slow
def test_single_process_without_torchrun(tmp_path):
    env = dict(os.environ, LOKA_RUN_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("MASTER_ADDR", None)
    cmd = [sys.executable, "-m", "loka_torchrec.train", *SMALL, "train.steps=10", "loka.enabled=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoKA             off" in proc.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        ("model=nosuchmodel", "model"),
        ("loka.dispatch.mode=all:nosuchbackend:rowwise", "nosuchbackend"),
        ("train.resume=/nonexistent/run", "train.resume"),
        ("loka.dispatch.max_mere=-1", "dispatch.max_mere"),
        ("loka.dispatch.bogus=1", "bogus"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, override, message):
    env = dict(os.environ, LOKA_RUN_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "loka_torchrec.train", *SMALL, "train.steps=2", override]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
