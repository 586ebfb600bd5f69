"""The plain-TorchRec example job runs with and without its --loka flag (2 gloo ranks)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def run_example(*flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "scripts/torchrec_dlrm_example.py", "--steps", "12", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_example_without_loka():
    out = run_example()
    assert "step 10 loss" in out
    assert "LoKA" not in out


@pytest.mark.slow
def test_example_with_loka_probes_plans_and_compresses_comms(tmp_path):
    """The README's integration lines on a TorchRec job the project did not write: the Probe's
    evidence makes the plan, the all-to-all runs through the FP8 codecs, and loka-inspect reads it."""
    run_dir = tmp_path / "run"
    out = run_example("--loka", "--steps", "24", "--run_dir", str(run_dir), "--probe_warmup", "10")
    assert "LoKA made 5 GEMM site(s)" in out and "comms: forward fp8, backward bf16" in out
    assert "step 20 loss" in out
    plan = json.loads((run_dir / "dispatch_plan.json").read_text())
    assert 0 < plan["step"] <= 10 and plan["mode"] == "policy"  # planned within the warm-up...
    sources = {d["source"] for layer in plan["layers"].values() for d in layer["roles"].values()}
    assert sources <= {"policy/probe", "layer_check"}, sources  # ...from the Probe's evidence
    for rank in (0, 1):
        assert (run_dir / "probe" / f"rank{rank}.jsonl").stat().st_size > 0
    inspect = subprocess.run([os.path.join(os.path.dirname(sys.executable), "loka-inspect"), str(run_dir)],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="300"))  # fmt: skip
    assert inspect.returncode == 0, inspect.stderr[-2000:]
    assert "model.dense_arch." in inspect.stdout and "wgrad" in inspect.stdout  # every layer, every role
    assert "comms: forward fp8, backward bf16" in inspect.stdout  # set explicitly: no timing, no reason
    assert json.loads((run_dir / "comms_plan.json").read_text())["choice"] is None
