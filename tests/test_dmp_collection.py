"""``train.sharding_group_size``: the job under TorchRec's DMPCollection (2D sparse parallelism).

On CPU: the config's validation and the clear errors a user gets from the real entry point
(DMPCollection asserts CUDA, so nothing trains here). On 2+ GPUs: the 2-rank job with sharding
groups of one rank (each rank holds every table; two replicas), synced every step.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from loka_job.training.sharding import SYNC_INTERVAL_ARG, check_sharding_group_size
from loka_job.training.trainer import TrainConfig
from test_train_job import ROOT, SMALL, launch, read_metrics


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_sharding_group_size_must_be_null_or_a_positive_int(value):
    with pytest.raises(ValueError, match="train.sharding_group_size: expected null or an int >= 1"):
        TrainConfig(sharding_group_size=value)


@pytest.mark.parametrize("value", [0, -1, 2.0, None])
def test_sync_every_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match="train.sync_every: expected an int >= 1"):
        TrainConfig(sync_every=value)


def test_defaults_keep_plain_dmp():
    cfg = TrainConfig()
    assert cfg.sharding_group_size is None and cfg.sync_every == 1
    check_sharding_group_size(None, world_size=3, device=torch.device("cpu"))  # nothing to check


def test_group_size_must_divide_world_size():
    with pytest.raises(ValueError, match=r"train.sharding_group_size: must divide the number of ranks \(6\).*got 4"):
        check_sharding_group_size(4, world_size=6, device=torch.device("cuda"))


def test_cpu_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="train.sharding_group_size=2: DMPCollection needs CUDA; TorchRec asserts it"):
        check_sharding_group_size(2, world_size=4, device=torch.device("cpu"))


def test_installed_torchrec_has_the_api_the_job_uses():
    # A device object only (no GPU is touched): passes the CUDA check, then inspects TorchRec's API.
    check_sharding_group_size(2, world_size=4, device=torch.device("cuda"))


def test_torchrec_without_dmp_collection_is_a_clear_error(monkeypatch):
    import torchrec.distributed.model_parallel as model_parallel

    monkeypatch.delattr(model_parallel, "DMPCollection")
    with pytest.raises(ValueError, match="train.sharding_group_size: TorchRec .* has no .*DMPCollection"):
        check_sharding_group_size(1, world_size=2, device=torch.device("cuda"))


def test_pipeline_without_replica_sync_is_a_clear_error(monkeypatch):
    import torchrec.distributed.train_pipeline as train_pipeline

    class OldPipeline:
        def __init__(self, model, optimizer, device, execute_all_batches=True):
            pass

    monkeypatch.setattr(train_pipeline, "TrainPipelineSparseDist", OldPipeline)
    with pytest.raises(ValueError, match=SYNC_INTERVAL_ARG):
        check_sharding_group_size(1, world_size=2, device=torch.device("cuda"))


@pytest.mark.parametrize(
    "overrides, message, field",
    [
        (["train.sharding_group_size=0"], "error: expected null or an int >= 1", "train.sharding_group_size"),
        (["train.sharding_group_size=2"], "error: must divide the number of ranks (1)", "train.sharding_group_size"),
        (["train.sharding_group_size=1"], "DMPCollection needs CUDA; TorchRec asserts it", "train.sharding_group_size"),
        (["train.sharding_group_size=1", "train.sync_every=0"], "error: expected an int >= 1", "train.sync_every"),
    ],
)
def test_bad_sharding_group_size_through_the_entry_point(tmp_path, overrides, message, field):
    env = dict(os.environ, LOKA_RUN_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "loka_job.train", *SMALL, "train.steps=2", "loka.enabled=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # one line, no traceback
    assert message in line and line.endswith(f"({field})") and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _local_shards(value):
    """The local tensors of a state-dict entry: a DTensor (of a LocalShardsWrapper), a ShardedTensor, a tensor."""
    if hasattr(value, "to_local"):
        value = value.to_local()
    if hasattr(value, "local_shards"):
        return [s.tensor if hasattr(s, "tensor") else s for s in value.local_shards()]
    return [value]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_rank_job_under_dmp_collection_keeps_replicas_in_sync(tmp_path):
    run_dir = tmp_path / "run"
    base = [o for o in SMALL if o != "device=cpu"] + ["device=cuda"]
    proc = launch(
        run_dir,
        "train.steps=20",
        "train.checkpoint_every=20",
        "train.sharding_group_size=1",
        "loka.enabled=false",
        base=base,
        torchrun=True,
    )
    assert "2D sharding      DMPCollection" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["world_size"] == 2
    assert summary["sharding_group_size"] == 1 and summary["sync_every"] == 1
    assert math.isfinite(summary["eval_loss"]) and math.isfinite(summary["eval_ne"])
    for rank in (0, 1):
        assert all(math.isfinite(r["loss"]) for r in read_metrics(run_dir, rank) if "loss" in r)
    # Each rank trained on its own batches; the sync after the last step's backward averaged the
    # two replicas, so the step-20 checkpoints hold the same tables on both ranks.
    folder = run_dir / "checkpoints" / "step_000020"
    states = [torch.load(folder / f"rank{r}.pt", map_location="cpu", weights_only=False)["model"] for r in (0, 1)]
    tables = [k for k in states[0] if "embedding_bags" in k and k.endswith(".weight")]
    assert tables
    for key in tables:
        for a, b in zip(_local_shards(states[0][key]), _local_shards(states[1][key]), strict=True):
            assert a.numel() > 0
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{key}: the replicas differ")
