"""``train.dense_allreduce`` / ``train.ddp_bucket_cap_mb``: DDP's gradient all-reduce, as configured and as in force."""

import json
import os

import pytest
import torch

from loka_job.training.trainer import TrainConfig
from multirank import run_job
from small_job import SMALL_DLRM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_config_checks_the_dense_allreduce_settings():
    assert TrainConfig().dense_allreduce == "fp32" and TrainConfig().ddp_bucket_cap_mb == 25
    assert TrainConfig(dense_allreduce="bf16", ddp_bucket_cap_mb=4).dense_allreduce == "bf16"
    assert TrainConfig(dense_allreduce="auto", dense_allreduce_check_steps=3).dense_allreduce_check_steps == 3
    with pytest.raises(ValueError, match="train.dense_allreduce: expected one of fp32, bf16, fp16, fp8, auto, got 'int8'"):
        TrainConfig(dense_allreduce="int8")
    with pytest.raises(ValueError, match="train.dense_allreduce_check_steps: expected an int >= 1"):
        TrainConfig(dense_allreduce_check_steps=0)
    for bad in (0, 2.5, "25"):
        with pytest.raises(ValueError, match="train.ddp_bucket_cap_mb: expected an int >= 1"):
            TrainConfig(ddp_bucket_cap_mb=bad)


def _job(tmp_path, *overrides):
    run_dir = tmp_path / "run"
    env = dict(os.environ, LOKA_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = ["-m", "loka_job.train", *SMALL_DLRM, "data.eval_batches=2", "train.steps=4", *overrides]
    return run_dir, run_job(command, env=env, cwd=ROOT, nproc=2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("precision, bucket_mb, hook", [("fp16", 1, "fp16_compress_hook"), ("fp8", 25, "fp8_allreduce_hook")])
def test_the_compression_hook_and_bucket_size_in_force_are_read_from_ddp(tmp_path, precision, bucket_mb, hook):
    """2 gloo ranks with PyTorch's fp16 hook (gloo has no bf16 hook) and 1 MiB buckets, or LoKA's FP8
    hook (``loka_torchrec.comms.fp8_allreduce``): the summary reads them back from the DDP module TorchRec
    built, the run summary prints them, and the job trains (every rank gets the same FP8 average:
    ``tests/test_fp8_allreduce.py``)."""
    run_dir, proc = _job(tmp_path, f"train.dense_allreduce={precision}", f"train.ddp_bucket_cap_mb={bucket_mb}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dense_allreduce"] == {
        "precision": precision, "bucket_cap_mb": float(bucket_mb), "ddp": True, "comm_hooks": [hook]
    }  # fmt: skip
    assert f"dense all-reduce DDP ({hook}), buckets of {bucket_mb} MiB" in proc.stdout
    assert 0 < summary["eval_ne"] < 2 and summary["nonfinite_steps"] == []  # no step skipped


def test_bf16_on_a_cpu_is_refused_naming_the_field():
    """PyTorch's bf16 hook needs NCCL: refused before any sharding work, with the field and the way out."""
    import torch

    from loka_job.training.sharding import shard_model

    with pytest.raises(ValueError, match="train.dense_allreduce: bf16 needs CUDA and NCCL .* on cpu use fp16 or fp32"):
        shard_model(torch.nn.Linear(2, 2), device=torch.device("cpu"), world_size=1, local_world_size=1, batch_size=8,
                    embedding_lr=0.1, dense_allreduce="bf16")  # fmt: skip


def test_dmp_collection_gets_the_ddp_wrapper_only_where_the_job_sets_it():
    from loka_job.training.sharding import _dmp_collection_wrapper

    class WithWrapper:
        def __init__(self, module, data_parallel_wrapper=None):
            pass

    class WithoutWrapper:
        def __init__(self, module):
            pass

    wrapper = object()
    assert _dmp_collection_wrapper(WithoutWrapper, wrapper, "fp32", 25) == {}  # the default: nothing to pass
    assert _dmp_collection_wrapper(WithWrapper, wrapper, "bf16", 25) == {"data_parallel_wrapper": wrapper}
    assert _dmp_collection_wrapper(WithWrapper, wrapper, "fp32", 4) == {"data_parallel_wrapper": wrapper}
    with pytest.raises(ValueError, match="train.dense_allreduce / train.ddp_bucket_cap_mb: TorchRec .* takes no data_parallel_wrapper"):
        _dmp_collection_wrapper(WithoutWrapper, wrapper, "bf16", 25)


class _FakeDdp:
    def __init__(self):
        self.hooks = []

    def register_comm_hook(self, state, hook):
        self.hooks.append((state, hook))


def test_auto_starts_in_fp32_waits_for_loka_and_keeps_the_faster_precision():
    from loka_job.training.dense_allreduce import DenseAllreduceCheck, compressed_candidate, install

    ddp = _FakeDdp()
    switch = install(ddp, "fp16")
    (state, hook), = ddp.hooks
    assert state is None and hook.__qualname__.endswith("switchable_allreduce_hook") and switch.precision == "fp32"
    check = DenseAllreduceCheck(switch, block=2)
    check.observe(1, 10.0, ready=False)  # LoKA still needs step times: nothing starts
    assert not check.started and switch.precision == "fp32"
    check.observe(2, None, ready=True)  # an untimed step does not start it either
    check.observe(3, 10.0, ready=True)
    assert check.started and switch.precision == "fp16"  # the first block: the candidate
    seen, step = [], 3
    while check.verdict is None:
        step += 1
        seen.append(switch.precision)
        check.observe(step, 9.0 if switch.precision == "fp16" else 10.0, ready=True)
    assert seen == ["fp16"] * 4 + ["fp32"] * 8 + ["fp16"] * 4  # 2 settling + 2 timed steps per block
    assert check.verdict.keep_chosen and switch.precision == "fp16"
    assert check.summary() == {"candidate": "fp16", "in_force": "fp16", "started": True,
                               "verdict": {"step": step, "chosen_ms": 9.0, "fp32_ms": 10.0, "keep_chosen": True, "steps_per_arm": 4}}
    resumed = DenseAllreduceCheck(install(_FakeDdp(), "fp16"), block=2)
    resumed.load_state_dict(check.state_dict())
    assert resumed.switch.precision == "fp16" and resumed.check.done
    assert compressed_candidate(torch.device("cpu")) == "fp16"
    with pytest.raises(ValueError, match="compressed: expected one of bf16, fp16"):
        install(_FakeDdp(), "fp8")


@pytest.mark.slow
def test_auto_in_a_two_rank_job_checks_both_precisions_and_reports_the_one_in_force(tmp_path):
    """LoKA off (nothing else needs step times): from the first timed step, 4 blocks of 2 settling + 2
    timed steps, fp16 (gloo) against fp32, then the faster; both hooks really ran (training went on)."""
    run_dir, proc = _job(tmp_path, "loka.enabled=false", "train.dense_allreduce=auto", "train.dense_allreduce_check_steps=2",
                         "train.steps=22")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    dense = summary["dense_allreduce"]
    assert dense["precision"] == "auto" and dense["comm_hooks"] == ["switchable_allreduce_hook"]
    auto = dense["auto"]
    verdict = auto["verdict"]
    assert verdict is not None and verdict["steps_per_arm"] == 4
    assert auto["in_force"] == ("fp16" if verdict["chosen_ms"] <= 0.99 * verdict["fp32_ms"] else "fp32")
    assert f"dense all-reduce DDP (switchable_allreduce_hook: auto, {auto['in_force']} in force (fp16 step" in proc.stdout
