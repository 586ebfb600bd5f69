"""The fault matrix: kills (between steps and inside a checkpoint write), damaged checkpoint
files, and inf/NaN in a batch, a weight and a gradient, through the real entry point.

Each case asserts what a user relies on: the logs stay readable, nothing silently wrong comes
out (a skipped step is counted, a run that cannot go on stops with a non-zero exit and a message
naming the step and the last good checkpoint), and a resumed deterministic run ends exactly as
the uninterrupted one. Faults are injected by ``tests/fault_job.py`` (``LOKA_FAULT``), whose
processes are forked from the tests' forkserver (tests/multirank.run_job): a plain process, or
ranks with torchrun's environment.
"""

import json
import os
import time

import pytest

from multirank import run_job
from small_job import SMALL_DLRM

HERE = os.path.dirname(os.path.abspath(__file__))

SMALL = [
    *SMALL_DLRM,
    "data.eval_batches=4",
    "train.log_every=4",
    "train.deterministic=true",
    "loka.dispatch.mode=all:scaled_mm:rowwise",  # FP8 everywhere from step 1: no planning time
]


def job(run_dir, *overrides, fault="", nproc=1, expect_ok=True):
    env = dict(os.environ, LOKA_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOKA_FAULT=fault)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    os.makedirs(run_dir, exist_ok=True)
    command = [os.path.join(HERE, "fault_job.py"), *SMALL, *overrides]
    proc = run_job(command, env=env, cwd=run_dir, nproc=None if nproc == 1 else nproc, timeout=300)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    _assert_logs_readable(run_dir)
    return proc


def _assert_logs_readable(run_dir):
    """Every JSON-lines log parses line by line, whatever happened to the run."""
    for folder, _, files in os.walk(run_dir):
        for name in files:
            if name.endswith(".jsonl"):
                with open(os.path.join(folder, name)) as f:
                    for line in f:
                        json.loads(line)


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """12 steps with checkpoints every 4: the reference that resumed runs must reproduce."""
    run = tmp_path_factory.mktemp("faults") / "uninterrupted"
    job(run, "train.steps=12", "train.checkpoint_every=4")
    return run


@pytest.mark.slow
def test_a_run_killed_between_steps_resumes_to_the_same_result(uninterrupted, tmp_path):
    killed = tmp_path / "killed"
    proc = job(killed, "train.steps=12", "train.checkpoint_every=4", fault="kill:10", expect_ok=False)
    assert proc.returncode != 0 and not (killed / "summary.json").exists()
    assert (killed / "checkpoints" / "step_000008" / "meta.json").is_file()
    resumed = tmp_path / "resumed"
    job(resumed, "train.steps=12", f"train.resume={killed}")
    ref, got = summary(uninterrupted), summary(resumed)
    assert got["resumed_from"] == 8 and got["steps"] == 12
    assert got["eval_ne"] == ref["eval_ne"] and got["eval_auc"] == ref["eval_auc"]
    # the resumed run's dispatch plan is the checkpoint's, not a fresh "not planned yet" one
    plan = json.loads((resumed / "dispatch_plan.json").read_text())
    assert plan == json.loads((uninterrupted / "dispatch_plan.json").read_text())


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_named_and_the_resume_falls_back(uninterrupted, tmp_path):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(uninterrupted, source)
    pt = source / "checkpoints" / "step_000012" / "rank0.pt"
    data = bytearray(pt.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 4096):  # 4 KiB flipped inside the embedding tables
        data[i] ^= 0xFF
    pt.write_bytes(bytes(data))
    resumed = tmp_path / "resumed"
    proc = job(resumed, "train.steps=12", f"train.resume={source}")
    assert "step_000012 is unusable: rank 0: rank0.pt does not match its SHA-256" in proc.stderr
    got = summary(resumed)
    assert got["resumed_from"] == 8 and got["eval_ne"] == summary(uninterrupted)["eval_ne"]
    # nothing intact: a one-line error naming train.resume, and a non-zero exit
    (source / "checkpoints" / "step_000008" / "meta.json").write_text("{garbage")
    (source / "checkpoints" / "step_000004" / "rank0.pt").write_bytes(b"")
    proc = job(tmp_path / "none", "train.steps=12", f"train.resume={source}", expect_ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: no intact checkpoint under") and line.endswith("(train.resume)")


@pytest.mark.slow
def test_a_kill_inside_a_checkpoint_write_leaves_nothing_loadable_or_stale(tmp_path):
    """2 ranks; rank 1 dies half-way through its second checkpoint file. Both ranks resume from
    the first checkpoint, the temporary is removed, and "resumed from" is logged only after the ranks agreed."""
    run = tmp_path / "run"
    proc = job(run, "train.steps=12", "train.checkpoint_every=4", fault="kill_save:2:1", nproc=2, expect_ok=False)
    assert proc.returncode != 0
    second = run / "checkpoints" / "step_000008"
    assert not (second / "meta.json").exists()
    temporaries = [p for p in second.iterdir() if p.name.endswith(".tmp")]
    assert temporaries  # what the kill left behind
    old = time.time() - 120
    for p in temporaries:
        os.utime(p, (old, old))
    resumed = tmp_path / "resumed"
    proc = job(resumed, "train.steps=12", f"train.resume={run}", nproc=2)
    assert "step_000008 is unusable" in proc.stderr and "incomplete: no meta.json" in proc.stderr
    assert summary(resumed)["resumed_from"] == 4
    assert not [p for p in second.iterdir() if p.name.endswith(".tmp")]
    log = (resumed / "rank0" / "train.log").read_text()
    assert log.index("step_000008 is unusable") < log.index("resumed from")  # agreement first, then the resume


@pytest.mark.slow
def test_a_non_finite_batch_is_skipped_counted_and_training_goes_on(tmp_path):
    """One run, two bad batches: one ``inf`` in batch 5, every feature NaN in batch 9. Each step is
    skipped and counted on its own, and training goes on after both."""
    run = tmp_path / "run"
    proc = job(run, "train.steps=12", fault="batch_inf:5,batch_nan:9")
    got = summary(run)
    assert got["nonfinite_steps"] == [6, 10]  # batch b trains at step b + 1
    assert got["eval_ne"] == got["eval_ne"] and got["eval_ne"] < 1.0  # finite, and still learning
    for step in (6, 10):
        assert f"step {step}: the loss is not finite; the step is skipped" in proc.stderr
    losses = [r["loss"] for r in _metrics(run) if "loss" in r and r["step"] not in (6, 10)]
    assert all(loss == loss for loss in losses)  # no NaN after the skipped steps


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["weight_nan:5", "grad_nan:5"])
def test_a_non_finite_weight_or_gradient_stops_the_run_with_a_pointer_to_the_last_good_checkpoint(tmp_path, fault):
    run = tmp_path / "run"
    proc = job(run, "train.steps=16", "train.checkpoint_every=2", "train.max_nonfinite_steps=3", fault=fault, expect_ok=False)
    assert proc.returncode != 0 and not (run / "summary.json").exists()
    message = proc.stderr
    assert "train: the loss was not finite for 3 consecutive steps" in message
    assert "train.max_nonfinite_steps=3" in message and "first layer the safety valve saw:" in message
    assert "last good checkpoint:" in message and "checkpoints/step_0000" in message
    last_good = message.split("last good checkpoint: ")[1].split()[0]
    # no checkpoint was written during the streak, and the last good one is intact
    written = sorted(os.listdir(run / "checkpoints"))
    assert os.path.basename(last_good) == written[-1]


def _metrics(run_dir, rank=0):
    with open(os.path.join(run_dir, f"rank{rank}", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
