"""``train.export_serving``: the job's dense modules as ``torch.export`` programs, FP8 where LoKA runs it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from loka_job.training.trainer import TrainConfig
from blocked_imports import blocking_folder
from multirank import run_job
from small_job import SMALL_DLRM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_serving_settings_are_checked():
    assert TrainConfig(export_serving=True, serving_input_scaling="static").export_serving
    with pytest.raises(ValueError, match="train.serving_input_scaling: expected one of dynamic, static, got 'delayed'"):
        TrainConfig(serving_input_scaling="delayed")
    with pytest.raises(ValueError, match="train.export_serving: expected true or false"):
        TrainConfig(export_serving="yes")


def test_a_module_that_specializes_on_its_batch_is_exported_at_the_evaluation_batch(tmp_path):
    """``torch.export`` refuses a free batch dim for a model that bakes its batch into a reshape: the
    program is then exported at the evaluation batch, checked, and ``serving.json`` says why."""
    import torch
    from torch import nn

    from loka_job.training.serving_export import export_serving
    from loka_torchrec.inference import InferenceReport

    class FixedBatch(nn.Module):
        def forward(self, x):
            return (x.reshape(8, 2, 3) * 2).sum(dim=1)  # 8 rows, written in

    class AnyBatch(nn.Module):
        def forward(self, x):
            return x.sum(dim=1, keepdim=True)

    empty = InferenceReport({}, {})
    x = torch.randn(8, 6)
    entries = export_serving({"fixed": (FixedBatch(), empty), "free": (AnyBatch(), empty)}, {"fixed": (x,), "free": (x,)}, str(tmp_path))
    fixed, free = entries["fixed"], entries["free"]
    assert fixed["exported"] and fixed["verified"] and fixed["batch"] == 8 and fixed["checked_batches"] == [8]
    assert fixed["batch_fixed_because"].split(":")[0].endswith("Error"), fixed
    assert free["batch"] == "dynamic" and free["checked_batches"] == [8, 4] and "batch_fixed_because" not in free
    assert json.loads((tmp_path / "serving" / "serving.json").read_text())["fixed"]["batch"] == 8
    program = torch.export.load(fixed["file"]).module()
    assert torch.equal(program(x), FixedBatch()(x))


@pytest.mark.slow
def test_a_two_rank_job_exports_its_dense_modules_and_they_run_without_this_project(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, LOKA_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = ["-m", "loka_job.train", *SMALL_DLRM, "data.eval_batches=2", "train.steps=6", "loka.probe.enabled=false",
               "loka.dispatch.mode=all:scaled_mm:rowwise", "train.export_serving=true"]  # fmt: skip
    proc = run_job(command, env=env, cwd=ROOT, nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    serving = json.loads((run_dir / "serving" / "serving.json").read_text())
    assert set(serving) == {"model.dense_arch", "model.over_arch"}  # the dense modules; the tables stay TorchRec's
    for name, entry in serving.items():
        assert entry["exported"] and entry["verified"] and entry["batch"] == "dynamic" and entry["checked_batches"] == [128, 64]
        assert entry["fp8"] and all(k.startswith(name + ".") and v == "rowwise" for k, v in entry["fp8"].items())
        assert entry["timings"] == {}  # train.serving_rows=0: every layer training runs in FP8 serves in FP8
        assert f"serving          {entry['file']}: {entry['summary']}; checked: the program gives the served model's output at 128 and 64 rows (any batch size)" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["serving"] == serving
    # The whole model evaluated with the served modules swapped in: the same FP8 forward as the trained
    # model's (dynamic scales, the in-force kernels), hence its NE; and with high-precision copies.
    quality = serving["model.over_arch"]["eval"]
    assert quality["served"]["ne"] == pytest.approx(quality["trained"]["ne"], rel=1e-6)
    assert quality["served"]["count"] == quality["served_high_precision"]["count"] == quality["trained"]["count"] > 0
    assert 0 < quality["served_high_precision"]["ne"] < 2
    assert "serving eval NE  " in proc.stdout and "in high precision vs" in proc.stdout
    _runs_with_torch_alone(tmp_path, run_dir / "serving", ["model.dense_arch", "model.over_arch"])


def _runs_with_torch_alone(tmp_path, folder, names):
    """A process in which this project, and TorchRec, cannot be imported loads each program and
    reproduces its output on the kept inputs."""
    blocker = blocking_folder(tmp_path, ("loka_torchrec", "loka_job", "torchrec", "fbgemm_gpu"))
    script = textwrap.dedent(f"""
        import sys, torch
        for name in {list(names)!r}:
            program = torch.export.load(f"{folder}/{{name}}.pt2").module()
            inputs = torch.load(f"{folder}/{{name}}.inputs.pt")
            assert all(isinstance(t, torch.Tensor) for t in inputs)
            expected = torch.load(f"{folder}/{{name}}.expected.pt")
            assert torch.equal(program(*inputs), expected), name
            # Any batch size: the first 5 rows give the whole batch's first 5 rows up to FP8 noise (a tensorwise
            # scale from the call's own amax changes with the rows; the job checks exact equality at half the batch).
            few, ref = program(*[t[:5] for t in inputs]).double(), expected[:5].double()
            sqnr_db = 10 * torch.log10(ref.pow(2).sum() / (few - ref).pow(2).sum().clamp_min(1e-30))
            assert few.shape == ref.shape and sqnr_db > 20, (name, float(sqnr_db))
        assert not [m for m in sys.modules if m.startswith(("loka_torchrec", "loka_job", "torchrec", "fbgemm_gpu"))]
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(blocker), OMP_NUM_THREADS="1")
    check = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.strip() == "ok", check.stderr[-3000:]


@pytest.mark.slow
def test_a_dhen_job_exports_its_over_arch_taking_the_pooled_embeddings_as_one_tensor(tmp_path):
    """DHEN's dense part takes the pooled embeddings (a KeyedTensor): the program takes its values tensor."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, LOKA_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = ["-m", "loka_job.train", "device=cpu", "model=dhen", "data.batch_size=64", "data.eval_batches=1", "train.steps=4",
               "train.progress_bar=false", "loka.probe.every=1", "loka.probe.warmup_steps=4", "loka.probe.samples=2",
               "loka.dispatch.mode=all:scaled_mm:tensorwise", "train.export_serving=true", "train.serving_input_scaling=static",
               "train.serving_rows=32"]  # fmt: skip
    proc = run_job(command, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    entry = json.loads((run_dir / "serving" / "serving.json").read_text())["over_arch"]
    assert entry["exported"] and entry["verified"]
    # train.serving_rows=32: every layer training ran in FP8 timed forward at 32 rows; FP8 where faster
    assert set(entry["timings"]) == set(entry["fp8"]) | set(entry["high_precision"]) and len(entry["timings"]) == 25
    assert all(t["rows"] == 32 and t["fp8_ms"] > 0 for t in entry["timings"].values())
    assert all(why.startswith("not faster at 32 rows") for why in entry["high_precision"].values())
    assert entry["summary"].startswith(f"{len(entry['fp8'])}/25 linear layers in FP8")
    # Eager CPU training keeps no delayed-scaling history: the static scales come from the Probe's input
    # amaxes of its 4 probe steps, where they stayed within 1.5x; every other FP8 layer says why it is dynamic.
    assert set(entry["static_inputs"]) | set(entry["dynamic_inputs"]) == set(entry["fp8"])
    assert all(k.startswith("over_arch.") for k in entry["timings"])
    assert all(why.startswith("input amax varied") and why.endswith("probe steps") for why in entry["dynamic_inputs"].values())
    _runs_with_torch_alone(tmp_path, run_dir / "serving", ["over_arch"])


@pytest.mark.slow
def test_a_finished_run_is_exported_by_resuming_its_last_checkpoint(tmp_path):
    """The documented export of a trained run: the same recipe resumed at its last step with
    ``train.export_serving=true`` runs no step, evaluates the restored model as the run did, exports."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    recipe = ["-m", "loka_job.train", *SMALL_DLRM, "data.eval_batches=2", "train.steps=4", "loka.probe.enabled=false",
              "loka.dispatch.mode=all:scaled_mm:rowwise"]  # fmt: skip
    trained = run_job([*recipe, "train.checkpoint_every=4"], env=dict(env, LOKA_RUN_DIR=str(tmp_path / "run")), cwd=ROOT, timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    served = run_job([*recipe, f"train.resume={tmp_path / 'run'}", "train.export_serving=true"],
                     env=dict(env, LOKA_RUN_DIR=str(tmp_path / "serve")), cwd=ROOT, timeout=300)  # fmt: skip
    assert served.returncode == 0, served.stdout[-3000:] + served.stderr[-3000:]
    assert "no step ran (resumed at the last step" in served.stdout
    before = json.loads((tmp_path / "run" / "summary.json").read_text())
    after = json.loads((tmp_path / "serve" / "summary.json").read_text())
    assert after["eval_ne"] == before["eval_ne"] and after["eval_auc"] == before["eval_auc"]  # the same model, evaluated again
    serving = json.loads((tmp_path / "serve" / "serving" / "serving.json").read_text())
    assert all(entry["exported"] and entry["verified"] for entry in serving.values())
    assert serving["model.over_arch"]["eval"]["trained"]["ne"] == pytest.approx(before["eval_ne"], rel=1e-6)
    _runs_with_torch_alone(tmp_path, tmp_path / "serve" / "serving", ["model.dense_arch", "model.over_arch"])


def _replay_worker(rank, world, init_file, out_dir):
    from loka_job.training import serving_export
    from loka_torchrec import inference_timing
    from loka_torchrec.evidence import Interval
    from multirank import process_group, write_result

    with process_group(rank, world, init_file):
        # each rank's own "timing" differs: rank 0 finds FP8 faster, rank 1 slower
        own = Interval(1.0, 1.0, 1.0, 1, "iqr") if rank == 0 else Interval(9.0, 9.0, 9.0, 1, "iqr")
        inference_timing.time_serving_forward = lambda fp8, layer, rows: (own, Interval(2.0, 2.0, 2.0, 1, "iqr"))
        timer = serving_export._rank0_timer()
        write_result(out_dir, rank, [timer(None, None, 8)[0].value for _ in range(3)])


@pytest.mark.slow
def test_every_rank_takes_rank_zeros_serving_timings(tmp_path):
    """The serving copies are evaluated on every rank: their FP8 choices must be rank 0's everywhere."""
    from multirank import spawn_ranks

    spawn_ranks(_replay_worker, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [[1.0] * 3, [1.0] * 3]

