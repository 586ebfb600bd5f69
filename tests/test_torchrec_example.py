"""The TorchRec example job (the README's integration, scripts/torchrec_dlrm_example.py) on 2 gloo ranks,
and loka-inspect on the run directory it leaves."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def run_example(*flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node=2", "scripts/torchrec_dlrm_example.py", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def inspect(*args):
    proc = subprocess.run([os.path.join(BIN, "loka-inspect"), *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="120"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_example_probes_plans_checkpoints_and_loka_inspect_reads_it_in_120_columns(tmp_path):
    """The README's integration lines on a TorchRec job the project did not write: the Probe's
    evidence makes the plan, the comms precisions are decided, each rank saves LoKA's state, and
    loka-inspect shows every GEMM on one line of a 120-column terminal."""
    run_dir = tmp_path / "run"
    assert f"24 steps; LoKA's plan and logs: {run_dir}" in run_example("--steps", "24", "--run_dir", str(run_dir), "--probe_warmup", "10")
    plan = json.loads((run_dir / "dispatch_plan.json").read_text())
    assert 0 < plan["step"] <= 10 and plan["mode"] == "policy"  # planned within the warm-up...
    sources = {d["source"] for layer in plan["layers"].values() for d in layer["roles"].values()}
    assert sources <= {"policy/probe", "layer_check"}, sources  # ...from the Probe's evidence
    for rank in (0, 1):
        assert (run_dir / "probe" / f"rank{rank}.jsonl").stat().st_size > 0
        state = torch.load(run_dir / f"checkpoint_rank{rank}.pt", weights_only=False)["loka"]
        assert state["dispatch"]["plan"]["digest"] == plan["digest"]
    comms = json.loads((run_dir / "comms_plan.json").read_text())
    assert comms["choice"]["world_size"] == 2 and {comms["forward"], comms["backward"]} <= {"fp8", "fp32", "bf16"}

    text = inspect(str(run_dir))
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    assert f"comms: forward {comms['forward']}, backward {comms['backward']}" in text
    assert "FP8 GEMMs:" in text and "gradient check" in text and "safety valve" in text and "step-time guard" in text
    layers = sorted(plan["layers"])
    assert len(layers) == 5
    for name in layers:  # every layer, each GEMM on its own line
        assert sum(line.startswith(name + " ") or line == name for line in lines) == 1, name
    assert sum(f"  {role}  " in line for line in lines for role in ("fwd", "dgrad", "wgrad")) == 15
    why = inspect(str(run_dir), "--why", layers[0])
    assert max(map(len, why.splitlines())) <= 120
    assert f"layer {layers[0]}:" in why and "candidates" in why and why.count("why: ") == 3
