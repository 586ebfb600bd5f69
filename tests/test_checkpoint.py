"""Checkpoints: checksums per file, one-line errors for each kind of damage, fallback to the
newest intact checkpoint with every rank agreeing, and no temporaries left by killed writers."""

import json
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from loka_job.training.checkpoint import (
    CheckpointError, CheckpointMismatch, checkpoint_problem, config_mismatch, resume_checkpoint, save_checkpoint, state_mismatch,
)  # fmt: skip
from multirank import spawn_ranks


def _state(step):
    torch.manual_seed(step)
    return {"step": step, "model": {"table": torch.randn(256, 32)}}


def _run(tmp_path, steps=(4, 8)):
    run = tmp_path / "run"
    for step in steps:
        save_checkpoint(str(run), step, _state(step), rank=0, world_size=1)
    return run


def _damage(folder, kind):
    pt, meta = folder / "rank0.pt", folder / "meta.json"
    if kind == "flipped":  # 4 KiB flipped inside the table's bytes
        data = bytearray(pt.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 4096):
            data[i] ^= 0xFF
        pt.write_bytes(bytes(data))
    elif kind == "truncated":
        pt.write_bytes(pt.read_bytes()[:1000])
    elif kind == "empty":
        pt.write_bytes(b"")
    elif kind == "missing":
        pt.unlink()
    elif kind == "garbage_meta":
        meta.write_text("{not json")
    elif kind == "no_meta":
        meta.unlink()


PROBLEMS = {
    "flipped": "rank0.pt does not match its SHA-256",
    "truncated": "rank0.pt has 1000 bytes",
    "empty": "rank0.pt has 0 bytes",
    "missing": "rank0.pt is missing",
    "garbage_meta": "meta.json is unreadable",
    "no_meta": "incomplete: no meta.json",
}


def test_meta_records_size_and_checksum_and_an_intact_checkpoint_loads(tmp_path):
    run = _run(tmp_path)
    meta = json.loads((run / "checkpoints" / "step_000008" / "meta.json").read_text())
    entry = meta["files"]["rank0.pt"]
    assert meta["format"] == 2 and entry["bytes"] == (run / "checkpoints" / "step_000008" / "rank0.pt").stat().st_size
    assert len(entry["sha256"]) == 64
    folder, state, skipped = resume_checkpoint(str(run), rank=0, world_size=1)
    assert folder.endswith("step_000008") and state["step"] == 8 and skipped == []
    assert torch.equal(state["model"]["table"], _state(8)["model"]["table"])


@pytest.mark.parametrize("kind", sorted(PROBLEMS))
def test_each_kind_of_damage_is_named_and_the_run_falls_back(tmp_path, kind):
    run = _run(tmp_path)
    newest = run / "checkpoints" / "step_000008"
    _damage(newest, kind)
    assert PROBLEMS[kind] in checkpoint_problem(str(newest), rank=0, world_size=1)
    folder, state, skipped = resume_checkpoint(str(run), rank=0, world_size=1)
    assert folder.endswith("step_000004") and state["step"] == 4
    (line,) = skipped
    assert "step_000008" in line and PROBLEMS[kind] in line and "\n" not in line
    # the damaged one named directly: a one-line error, no fallback
    with pytest.raises(CheckpointError, match="train.resume: checkpoint .*step_000008") as err:
        resume_checkpoint(str(newest), rank=0, world_size=1)
    assert "\n" not in str(err.value) and PROBLEMS[kind] in str(err.value)


def test_nothing_intact_is_one_line_naming_every_checkpoint(tmp_path):
    run = _run(tmp_path)
    _damage(run / "checkpoints" / "step_000008", "truncated")
    _damage(run / "checkpoints" / "step_000004", "garbage_meta")
    with pytest.raises(CheckpointError) as err:
        resume_checkpoint(str(run), rank=0, world_size=1)
    message = str(err.value)
    assert "\n" not in message and "no intact checkpoint" in message and "step_000004" in message and "step_000008" in message
    with pytest.raises(CheckpointError, match="does not exist"):
        resume_checkpoint(str(tmp_path / "nowhere"), rank=0, world_size=1)
    with pytest.raises(CheckpointMismatch, match="step_000008 was written with world_size=1; this run has world_size=2"):
        resume_checkpoint(str(run / "checkpoints" / "step_000008"), rank=0, world_size=2)


def test_a_file_that_matches_its_checksum_but_does_not_unpickle_is_damaged(tmp_path):
    run = _run(tmp_path, steps=(4,))
    folder = run / "checkpoints" / "step_000004"
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"]  # a format-1 checkpoint: nothing to compare with
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "rank0.pt").write_bytes(b"garbage" * 100)
    with pytest.raises(CheckpointError, match=r"rank0.pt cannot be read \(\w+"):
        resume_checkpoint(str(run), rank=0, world_size=1)


def test_temporaries_and_incomplete_folders_of_killed_writers_are_removed(tmp_path):
    run = _run(tmp_path, steps=(4,))
    killed = run / "checkpoints" / "step_000006"
    killed.mkdir()
    (killed / "rank0.pt").write_bytes(b"x" * 100)  # every rank file but no meta.json
    stale = run / "checkpoints" / "step_000004" / ".rank0.pt.abc123.tmp"
    stale.write_bytes(b"x" * 100)
    # a resume from the run removes the temporaries nobody has touched for a minute
    old = time.time() - 120
    os.utime(stale, (old, old))
    fresh = run / "checkpoints" / "step_000004" / ".rank1.pt.def456.tmp"
    fresh.write_bytes(b"x")
    resume_checkpoint(str(run), rank=0, world_size=1)
    assert not stale.exists() and fresh.exists()  # a fresh one may be a live writer's
    # the next save removes every temporary and the older incomplete folder
    save_checkpoint(str(run), 8, _state(8), rank=0, world_size=1)
    assert not fresh.exists() and not killed.exists()
    leftovers = [n for _, _, files in os.walk(run) for n in files if n.endswith(".tmp")]
    assert leftovers == []


def _two_rank_worker(rank, world, init_file, run_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for step in (4, 8):
            save_checkpoint(run_dir, step, {**_state(step), "rank": rank}, rank=rank, world_size=world)
        dist.barrier()
        if rank == 0:  # only rank 1's file of the newest checkpoint is damaged
            _damage_rank1(os.path.join(run_dir, "checkpoints", "step_000008", "rank1.pt"))
        dist.barrier()
        folder, state, skipped = resume_checkpoint(run_dir, rank=rank, world_size=world)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"folder": folder, "step": state["step"], "rank": state["rank"], "skipped": skipped}, f)
    finally:
        dist.destroy_process_group()


def _damage_rank1(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\0" * 4096)


def test_two_ranks_agree_on_the_older_checkpoint_when_one_file_is_damaged(tmp_path):
    init_file = tempfile.mktemp(dir=tmp_path)
    spawn_ranks(_two_rank_worker, (2, init_file, str(tmp_path / "run"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        assert result["folder"].endswith("step_000004") and result["step"] == 4 and result["rank"] == rank
        (line,) = result["skipped"]
        assert "rank 1: rank1.pt does not match its SHA-256" in line and "rank 0" not in line
