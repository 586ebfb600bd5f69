"""benchmarks/comms_step_time.py on 2 gloo ranks: the table, and where each variant's step goes."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def test_tiny_cpu_run_writes_times_and_profiles(tmp_path):
    out = tmp_path / "comms"
    cmd = [
        TORCHRUN, "--standalone", "--nproc_per_node=2", os.path.join(ROOT, "benchmarks", "comms_step_time.py"),
        "--device", "cpu", "--num-tables", "4", "--rows", "1000", "--dim", "16", "--batch", "64",
        "--dense-arch", "32,16", "--over-arch", "32,1", "--steps", "10", "--first-step", "4",
        "--comms", "fp32,loka_fp8", "--profile-steps", "2", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())["results"]
    assert [r["variant"] for r in results] == ["fp32", "loka_fp8"]
    for r in results:
        assert r["median_ms"] > 0 and r["steps_timed"] == 6
        profile = r["profile"]
        assert profile["steps"] == [1, 2] and profile["wall_ms_per_step"] > 0
        assert sum(profile["shares"].values()) == pytest.approx(1.0)
        assert (out / f"profile-{r['variant']}-rank0" / "profile.json").exists()
    assert "Fp8CommCodec" in results[1]["codec_forward"]
    table = (out / "results.md").read_text()
    assert "Where a step goes" in table and "| loka_fp8 |" in table
