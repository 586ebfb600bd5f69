"""The device machine's driver scripts, run here on jobs that need no GPU: what comes back, and the
refusals a user hits (a malformed jobs line, a stage started too late in the call)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, env=None):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})  # fmt: skip


def test_jobs_run_side_by_side_each_pinned_and_packed(tmp_path):
    jobs = tmp_path / "a.jobs"
    jobs.write_text("# two jobs\n\n0 first echo $CUDA_VISIBLE_DEVICES > $OUT/gpus.txt\n"
                    "2,3 second X=7 bash -c 'echo x=$X; exit 3'\n")  # fmt: skip
    out = tmp_path / "out"
    proc = _run("device_per_gpu.sh", str(jobs), env={"OUT": str(out)})
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "=== first: rc=0" in summary and "=== second: rc=3" in summary and "x=7" in summary
    with tarfile.open(out / "first.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["first", "first/gpus.txt", "first/job.log"]
        assert tar.extractfile("first/gpus.txt").read().decode().strip() == "0"
    assert sorted(p.name for p in out.iterdir()) == ["first.tar.gz", "second.tar.gz", "summary.txt"]


def test_a_jobs_line_without_a_command_is_refused(tmp_path):
    jobs = tmp_path / "bad.jobs"
    jobs.write_text("0 lonely\n")
    proc = _run("device_per_gpu.sh", str(jobs), env={"OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and "line '0 lonely' has no command (expected GPUS NAME COMMAND...)" in proc.stderr


def test_a_stage_with_too_little_of_the_call_left_is_skipped_with_a_line(tmp_path):
    proc = _run("device_benchmarks.sh", "gpu_tests", env={"OUT": str(tmp_path), "CALL_T0": str(int(time.time()) - 600)})
    assert proc.returncode == 3 and proc.stdout.startswith("=== gpu_tests: skipped,") and "before the call's deadline" in proc.stdout


def test_a_job_past_the_deadline_is_stopped_with_its_children_and_everything_comes_back(tmp_path):
    """A job that would outlive the call is stopped at the deadline, its processes with it, and the
    summary and every job's folder are still written: a late job must not lose the others' results."""
    jobs = tmp_path / "late.jobs"
    jobs.write_text("0 quick echo done > $OUT/result.txt\n"
                    "1 late echo started > $OUT/partial.txt; bash -c 'sleep 300' & sleep 300\n")  # fmt: skip
    out = tmp_path / "out"
    start = time.time()
    proc = _run("device_per_gpu.sh", str(jobs), env={"OUT": str(out), "CALL_T0": str(int(start)), "STAGE_DEADLINE_S": "4"})
    assert proc.returncode == 0, proc.stderr
    assert time.time() - start < 30
    summary = (out / "summary.txt").read_text()
    assert "=== quick: rc=0" in summary
    assert "=== late: stopped at the call's deadline (CALL_T0 + STAGE_DEADLINE_S = 4 s)" in summary
    with tarfile.open(out / "late.tar.gz") as tar:
        assert tar.extractfile("late/partial.txt").read().decode().strip() == "started"
    with tarfile.open(out / "quick.tar.gz") as tar:
        assert tar.extractfile("quick/result.txt").read().decode().strip() == "done"
    leftover = subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"processes of the stopped job still running: {leftover}"


def test_an_e2e_stage_stopped_at_the_deadline_returns_its_log_and_run_folders(tmp_path):
    """The per-GPU deadline stops an e2e stage mid-run (the stage itself believes it has ten minutes):
    the driver's log and the unfinished run's folder still come back in the job's tarball."""
    jobs = tmp_path / "cut.jobs"
    jobs.write_text("0 e2e-cut STAGE_DEADLINE_S=600 E2E_DEVICE=cpu E2E_STEPS=50000 E2E_PROBE_WARMUP=3 "
                    "bash scripts/device_benchmarks.sh e2e cut dlrm 0 bf16\n")  # fmt: skip
    out = tmp_path / "out"
    env = {"OUT": str(out), "CALL_T0": str(int(time.time())), "STAGE_DEADLINE_S": "20",
           "PATH": os.path.dirname(os.path.abspath(sys.executable)) + os.pathsep + os.environ["PATH"]}  # fmt: skip
    proc = _run("device_per_gpu.sh", str(jobs), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "=== e2e-cut: stopped at the call's deadline" in (out / "summary.txt").read_text()
    with tarfile.open(out / "e2e-cut.tar.gz") as job:
        assert "=== e2e cut: stopped" in job.extractfile("e2e-cut/job.log").read().decode()
        job.extract("e2e-cut/cut-runs.tar.gz", tmp_path, filter="data")
    with tarfile.open(tmp_path / "e2e-cut" / "cut-runs.tar.gz") as runs:
        names = runs.getnames()
        assert "[e2e] dlrm / bf16 / seed 0 ..." in runs.extractfile("cut.log").read().decode()
    assert "runs/dlrm/bf16/seed0/.hydra/config.yaml" in names
    leftover = subprocess.run(["pgrep", "-f", "e2e_compare.py.*--name cut "], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"processes of the stopped stage still running: {leftover}"
