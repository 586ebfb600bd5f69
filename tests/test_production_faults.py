"""Production faults of the training job on 2 gloo ranks, through its real entry point: a SIGTERM
(preemption), a peer stopped with SIGSTOP, two jobs in one run dir, checkpoints without checksums,
a resume with another model or other tables, feature ids outside their tables.

Each case asserts what a user sees: the exit status, the one line on stderr, and what is on disk.
Waits are on conditions (a step logged, a process ended), generous and bounded; nothing asserts a
time. The ranks are forked from the tests' forkserver with torchrun's environment
(:func:`multirank.start_job`), so that a test can signal one rank while the job runs.
"""

import json
import os
import shutil
import signal
import socket
import time

import pytest

from multirank import run_job, start_job
from small_job import SMALL_DLRM

HERE = os.path.dirname(os.path.abspath(__file__))

SMALL = [
    *SMALL_DLRM,
    "data.eval_batches=4",
    "train.log_every=1",  # every rank logs every step: the tests wait on these lines
    "loka.probe.enabled=false",
    # plans at step 2 from random evidence, timed quickly: a decision the resume must restore
    "loka.dispatch.min_speedup=0",
    "loka.dispatch.samples=3",
    "loka.dispatch.timing_reps=1",
]
FOREVER = "train.steps=100000"  # a run that only a signal or a fault ends
EXIT_PREEMPTED = 75


def _env(run_dir, fault=""):
    env = dict(os.environ, LOKA_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOKA_FAULT=fault)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "HYDRA_FULL_ERROR"):
        env.pop(key, None)
    return env


def _command(overrides, fault):
    entry = [os.path.join(HERE, "fault_job.py")] if fault else ["-m", "loka_job.train"]
    return [*entry, *SMALL, *overrides]


def start(run_dir, *overrides, fault="", nproc=2):
    os.makedirs(run_dir, exist_ok=True)
    return start_job(_command(overrides, fault), env=_env(run_dir, fault), cwd=run_dir, nproc=nproc)


def launch(run_dir, *overrides, fault="", nproc=2, expect_ok=True):
    os.makedirs(run_dir, exist_ok=True)
    proc = run_job(_command(overrides, fault), env=_env(run_dir, fault), cwd=run_dir, nproc=nproc, timeout=420)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def last_step(run_dir, rank):
    """The last training step rank ``rank`` logged (0 before any); a line being written is skipped."""
    path = os.path.join(run_dir, f"rank{rank}", "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    steps = [0]
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "loss" in record:
                steps.append(record["step"])
    return steps[-1]


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


# --------------------------------------------------------------------------------------- preemption
@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_with_a_verified_checkpoint(tmp_path):
    """SIGTERM to rank 1 alone: both ranks stop after the same step, a final checkpoint (not due by
    train.checkpoint_every) is written and verified, the summary says preempted, rank 0 logs one
    line, both exit 75; the resume goes on at the next step with the checkpoint's dispatch plan."""
    run = tmp_path / "run"
    with start(run, FOREVER, "train.checkpoint_every=1000") as job:
        job.wait_until(lambda: min(last_step(run, 0), last_step(run, 1)) >= 4, "step 4 on both ranks (the plan is made at 2)")
        os.kill(job.processes[1].pid, signal.SIGTERM)
        proc = job.wait(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-5000:]
    got = summary(run)
    stopped = got["preempted"]["step"]
    assert got["steps"] == stopped >= 4 and got["eval_ne"] is None  # no final evaluation: the time left is short
    assert last_step(run, 0) == last_step(run, 1) == stopped  # the same last step on both ranks
    folder = run / "checkpoints" / f"step_{stopped:06d}"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["step"] == stopped and sorted(meta["files"]) == ["rank0.pt", "rank1.pt"]
    assert got["preempted"]["checkpoint"] == str(folder) and got["preempted"]["checkpoint_problems"] == []
    line = f"stopped after step {stopped} of 100000; checkpoint {folder} written and verified; resume with train.resume={run}"
    assert proc.stderr.count("stopped after step") == 1 and line in proc.stderr  # one line, rank 0's
    assert f"train: SIGTERM: stopped after step {stopped}" in (run / "rank1" / "train.log").read_text()  # the rank that got it
    assert not (run / "job.lock").exists()  # a job that stopped cleanly releases its run dir

    resumed = tmp_path / "resumed"
    launch(resumed, f"train.steps={stopped + 2}", f"train.resume={run}")
    again = summary(resumed)
    assert again["resumed_from"] == stopped and again["steps"] == stopped + 2 and again["preempted"] is None
    with open(resumed / "rank0" / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if '"loss"' in line]
    assert steps == [stopped + 1, stopped + 2]
    # every decision comes back from the checkpoint: the same plan (its timings included), comms restored
    assert json.loads((resumed / "dispatch_plan.json").read_text()) == json.loads((run / "dispatch_plan.json").read_text())
    assert json.loads((resumed / "comms_plan.json").read_text())["restored"]


# --------------------------------------------------------------------------------------- hung peer
@pytest.mark.slow
def test_a_stopped_peer_is_named_by_the_watchdog_within_its_bound(tmp_path):
    """SIGSTOP to rank 1: rank 0 ends with one line naming rank 1 and exit status 1 after
    train.peer_timeout_s, not after the process group's 600 s."""
    run = tmp_path / "run"
    with start(run, FOREVER, "train.peer_timeout_s=6") as job:
        job.wait_until(lambda: min(last_step(run, 0), last_step(run, 1)) >= 3, "step 3 on both ranks")
        # A rank publishes its step once per watchdog poll (0.6 s at this timeout): three polls later
        # rank 1's published step is one it finished, not the set-up it may still show right after step 3.
        time.sleep(3 * min(1.0, 6 / 10))
        os.kill(job.processes[1].pid, signal.SIGSTOP)
        job.wait_until(lambda: job.processes[0].exitcode is not None, "rank 0's end", timeout=180)
        assert job.processes[0].exitcode == 1
        (line,) = error_lines(job.output())
    assert line.startswith("error: rank(s) 1 did not arrive within train.peer_timeout_s=6 (rank 1: no sign of life, last seen after step ")
    assert line.endswith("(train.peer_timeout_s)") and "this rank (0) waited" in line
    assert line in (run / "rank0" / "train.log").read_text()


# --------------------------------------------------------------------------------------- run dir lock
@pytest.mark.slow
def test_a_second_job_in_a_run_dir_in_use_is_refused_and_a_dead_jobs_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    host = socket.gethostname()
    with start(run, FOREVER) as first:
        first.wait_until(lambda: last_step(run, 0) >= 2, "the first job's step 2")
        second = launch(run, "train.steps=2", expect_ok=False)
        assert second.returncode == 1
        (line,) = error_lines(second.stderr)
        pid = first.processes[0].pid
        assert line.startswith(f"error: run dir {run} is in use by another job (pid {pid} on {host}, running, started ")
        assert line.endswith("(hydra.run.dir)") and "Traceback" not in second.stderr
        assert all(p.is_alive() for p in first.processes)  # the first job runs on, alone in its run dir
        logged = [json.loads(line)["step"] for line in (run / "rank0" / "metrics.jsonl").read_text().splitlines()]
        assert logged == sorted(set(logged))  # its metrics only: nothing interleaved
        for process in first.processes:
            process.kill()  # killed: no release, the lock file stays with its pid
            process.join()
    assert json.loads((run / "job.lock").read_text())["pid"] == pid
    third = launch(run, "train.steps=2")
    assert f"took over the lock of a job that ended without releasing it (pid {pid} on {host}, not running" in third.stderr
    assert not (run / "job.lock").exists()


# --------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """8 steps on 2 ranks with checkpoints at steps 4 and 8, FP8 pinned (no planning time)."""
    run = tmp_path_factory.mktemp("production_faults") / "checkpointed"
    launch(run, "train.steps=8", "train.checkpoint_every=4", "loka.dispatch.mode=all:scaled_mm:rowwise")
    return run


def _format_1_copy(source, target):
    """A copy of ``source`` whose checkpoints' meta.json record no sizes or checksums (format 1)."""
    shutil.copytree(source, target)
    for meta_path in (target / "checkpoints").glob("step_*/meta.json"):
        meta = json.loads(meta_path.read_text())
        del meta["files"], meta["config"]
        meta["format"] = 1
        meta_path.write_text(json.dumps(meta))
    return target


def _flip_4_kib(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 4096):  # inside the tensors' bytes
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_an_unverified_checkpoint_is_named_its_damage_found_and_it_can_be_refused(checkpointed, tmp_path):
    source = _format_1_copy(checkpointed, tmp_path / "source")
    _flip_4_kib(source / "checkpoints" / "step_000008" / "rank0.pt")
    resumed = tmp_path / "resumed"
    proc = launch(resumed, "train.steps=10", f"train.resume={source}", "loka.dispatch.mode=all:scaled_mm:rowwise")
    # the flip is found by the zip's CRC-32s (torch.load does not check them): the resume falls back
    assert "step_000008 is unusable: rank 0: rank0.pt: its record" in proc.stderr and "does not match its CRC-32" in proc.stderr
    assert summary(resumed)["resumed_from"] == 4
    # the checkpoint loaded is named as unverified
    assert f"train.resume: {source}/checkpoints/step_000004/rank0.pt is unverified: its meta.json (format 1)" in proc.stderr
    # ... and refused when only verified checkpoints may load: one line naming each file
    strict = launch(tmp_path / "strict", "train.steps=10", f"train.resume={source}", "train.require_verified_checkpoints=true",
                    "loka.dispatch.mode=all:scaled_mm:rowwise", expect_ok=False)  # fmt: skip
    assert strict.returncode == 1
    (line,) = error_lines(strict.stderr)
    assert line.startswith(f"error: no intact checkpoint under '{source}' (2 tried): ") and line.endswith("(train.resume)")
    assert line.count("rank0.pt is unverified: meta.json records no size or SHA-256 (train.require_verified_checkpoints=true)") == 2


@pytest.mark.slow
def test_a_resume_with_another_model_other_tables_or_world_size_is_one_line_naming_the_field(checkpointed, tmp_path):
    pinned = "loka.dispatch.mode=all:scaled_mm:rowwise"
    cases = [
        ("model.over_arch_layer_sizes=[128,32,1]", 2, "model.over_arch_layer_sizes=[64, 32, 1]; this run has model.over_arch_layer_sizes=[128, 32, 1]"),
        ("data.num_embeddings=2000", 2, "tables.t_cat_0.rows=1000; this run has tables.t_cat_0.rows=2000"),
        ("train.log_every=1", 1, "world_size=2; this run has world_size=1"),
    ]  # fmt: skip
    for index, (override, nproc, difference) in enumerate(cases):
        proc = launch(tmp_path / f"resumed{index}", "train.steps=10", f"train.resume={checkpointed}", pinned, override,
                      nproc=nproc, expect_ok=False)  # fmt: skip
        assert proc.returncode == 1, proc.stderr[-3000:]
        (line,) = error_lines(proc.stderr)
        field = difference.split("=")[0]
        assert line == (
            f"error: checkpoint {checkpointed}/checkpoints/step_000008 was written with {difference} "
            f"(a resume needs {'the same world size (each rank reloads its own shards)' if field == 'world_size' else 'the same model and tables'}) "
            f"({field})"
        ), line
        assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------- feature ids
@pytest.mark.slow
def test_an_id_past_its_table_is_one_line_naming_the_feature_the_table_and_the_value(tmp_path):
    """Rank 1's batch 3 holds an id equal to its table's row count: FBGEMM's CPU lookup would print
    a bounds message and train on; the job stops with one line from rank 1 instead."""
    run = tmp_path / "run"
    proc = launch(run, "train.steps=8", "train.peer_timeout_s=10", fault="id_past_end:3:1", expect_ok=False)
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert "error: id 1000 of feature cat_0 is past the end of table t_cat_0 (1000 rows: ids 0 to 999), in train batch 3 of rank 1 (feature cat_0)" in lines, proc.stderr[-5000:]
    assert not (run / "summary.json").exists()


# --------------------------------------------------------------------------------------- entry point
@pytest.mark.slow
def test_an_unexpected_error_keeps_its_traceback_on_stderr_and_in_the_log(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, "train.steps=6", fault="raise:2", nproc=1, expect_ok=False)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RuntimeError: injected fault" in proc.stderr and not error_lines(proc.stderr)
    log = (run / "rank0" / "train.log").read_text()
    assert "Traceback" in log and "RuntimeError: injected fault" in log
