"""The plain-TorchRec example job runs with and without its --loka flag (2 gloo ranks)."""

import os
import sys

import pytest

from multirank import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def run_example(*flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "scripts/torchrec_dlrm_example.py", "--steps", "12", *flags]
    proc = run_job(cmd, cwd=ROOT, env=env, timeout=300)  # once more after the known gloo abort
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_example_without_loka():
    out = run_example()
    assert "step 10 loss" in out
    assert "LoKA" not in out


@pytest.mark.slow
def test_example_with_loka_runs_fp8():
    out = run_example("--loka", "--loka_mode", "all:scaled_mm:rowwise")
    assert "LoKA made 5 GEMM site(s)" in out
    assert "15/15 GEMMs in FP8" in out
    assert "step 10 loss" in out
