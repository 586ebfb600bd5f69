"""The FP8 all-reduce DDP hook: on 2 gloo ranks, the averaged gradients within the format's bound
of DDP's fp32 average, unbiased, NaN carried, and bad settings named."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loka_torchrec.comms.fp8_allreduce import Fp8AllreduceState, fp8_allreduce_hook
from multirank import process_group, spawn_ranks, write_result

U_E4M3 = 2.0**-4  # unit roundoff of E4M3 (round to nearest)
SUB_E4M3 = 2.0**-9  # its smallest subnormal
FP8_MAX = 448.0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 300), nn.ReLU(), nn.Linear(300, 7))


def _block_bound(values: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the round-trip bound of the wire format: ``u |x| + sub / 2 * amax_block / fp8_max``."""
    flat = values.reshape(-1)
    pad = (-flat.numel()) % block
    amax = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, block).amax(dim=1).repeat_interleave(block)[: flat.numel()]
    return U_E4M3 * flat.abs() + SUB_E4M3 / 2 * amax / FP8_MAX


def _worker(rank, world, init_file, out_dir, nan, backend="gloo"):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)
        x, y = torch.randn(64, 40).to(device), torch.randn(64, 7).to(device)
        grads = {}
        for kind in ("fp32", "fp8"):
            ddp = nn.parallel.DistributedDataParallel(_model().to(device), bucket_cap_mb=0.01)  # several buckets
            if kind == "fp8":
                ddp.register_comm_hook(Fp8AllreduceState(block=128), fp8_allreduce_hook)
            inputs = x.clone()
            if nan and rank == 1:
                inputs[3, 5] = float("nan")
            ((ddp(inputs) - y) ** 2).mean().backward()
            grads[kind] = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).double()
        # every rank's own gradient, for the bound: the model without DDP on this rank's batch
        local = _model().to(device)
        ((local(x) - y) ** 2).mean().backward()
        mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()]).double()
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        result = {"fp8": grads["fp8"].cpu().tolist(), "fp32": grads["fp32"].cpu().tolist(), "local": [g.cpu().tolist() for g in everyone]}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, nan=False, backend="gloo"):
    spawn_ranks(_worker, (2, str(tmp_path / "init"), str(tmp_path), nan, backend), nprocs=2, cuda=backend == "nccl")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]),
])  # fmt: skip
def test_fp8_average_is_within_the_format_bound_of_the_fp32_average(tmp_path, backend):
    """On CUDA the wire format's Triton kernels encode and decode; on the CPU its torch reference."""
    results = _run(tmp_path, backend=backend)
    fp8, fp32 = (torch.tensor(results[0][k], dtype=torch.float64) for k in ("fp8", "fp32"))
    assert torch.equal(fp8, torch.tensor(results[1]["fp8"], dtype=torch.float64))  # every rank has the same average
    local = [torch.tensor(g, dtype=torch.float64) for g in results[0]["local"]]
    torch.testing.assert_close(fp32, (local[0] + local[1]) / 2, rtol=1e-5, atol=1e-7)  # DDP's own average
    # First rounding: each rank's contribution, in its own blocks; second: the average, in its blocks.
    # DDP fills buckets in reverse parameter order, so block boundaries are not the flat order's:
    # bound each element by the largest value of the whole gradient (a looser block amax).
    flat_bound = lambda g: U_E4M3 * g.abs() + SUB_E4M3 / 2 * g.abs().max() / FP8_MAX  # noqa: E731
    first = (flat_bound(local[0]) + flat_bound(local[1])) / 2
    second = U_E4M3 * (fp32.abs() + first) + SUB_E4M3 / 2 * (fp32.abs().max() + first.max()) / FP8_MAX
    err = (fp8 - fp32).abs()
    assert bool((err <= (first + second) * (1 + 1e-6)).all()), float((err / (first + second)).max())
    assert err.max() > 0  # it is FP8: something was rounded
    sqnr_db = 10 * torch.log10(fp32.pow(2).sum() / (fp8 - fp32).pow(2).sum())
    assert sqnr_db > 25, float(sqnr_db)
    # round to nearest: no systematic shift of the average (within 4 standard errors of zero)
    diff = fp8 - fp32
    assert abs(float(diff.mean())) < 4 * float(diff.std()) / diff.numel() ** 0.5


@pytest.mark.slow
def test_a_nan_on_one_rank_reaches_every_ranks_average(tmp_path):
    results = _run(tmp_path, nan=True)
    for r in results:
        assert any(v != v for v in r["fp8"]) and any(v != v for v in r["fp32"])  # NaN, as with fp32


def _group_worker(rank, world, init_file, out_dir):
    with process_group(rank, world, init_file):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, in order
        group = groups[rank // 2]
        torch.manual_seed(100 + rank)
        x, y = torch.randn(16, 40), torch.randn(16, 7)
        ddp = nn.parallel.DistributedDataParallel(_model(), process_group=group)
        ddp.register_comm_hook(Fp8AllreduceState(process_group=ddp.process_group), fp8_allreduce_hook)
        ((ddp(x) - y) ** 2).mean().backward()
        local = _model()
        ((local(x) - y) ** 2).mean().backward()
        write_result(out_dir, rank, {"fp8": torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).tolist(),
                                     "local": torch.cat([p.grad.reshape(-1) for p in local.parameters()]).tolist()})  # fmt: skip


@pytest.mark.slow
def test_the_average_is_over_the_ddp_modules_own_group(tmp_path):
    """A DDP module over a subgroup of the ranks averages over that group: so does the hook given its group."""
    spawn_ranks(_group_worker, (4, str(tmp_path / "init"), str(tmp_path)), nprocs=4)
    r = [{k: torch.tensor(v, dtype=torch.float64) for k, v in json.loads((tmp_path / f"rank{i}.json").read_text()).items()} for i in range(4)]
    for a, b in ((0, 1), (2, 3)):
        group_mean = (r[a]["local"] + r[b]["local"]) / 2
        assert torch.equal(r[a]["fp8"], r[b]["fp8"])
        sqnr = 10 * torch.log10(group_mean.pow(2).sum() / (r[a]["fp8"] - group_mean).pow(2).sum())
        assert sqnr > 25, float(sqnr)
    world_mean = sum(x["local"] for x in r) / 4
    assert float(10 * torch.log10(world_mean.pow(2).sum() / (r[0]["fp8"] - world_mean).pow(2).sum())) < 10  # not the world's


def _profiled_worker(rank, world, init_file, out_dir):
    from loka_job.training.profiling import _cpu_operators, classify_cpu_op, summarize_events

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ddp = nn.parallel.DistributedDataParallel(_model())
        ddp.register_comm_hook(Fp8AllreduceState(process_group=ddp.process_group), fp8_allreduce_hook)
        x = torch.randn(16, 40)
        ddp(x).sum().backward()  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ddp(x).sum().backward()
        if rank == 0:
            events = _cpu_operators(prof.events())
            comms = summarize_events(events, classify=classify_cpu_op, num_steps=1, wall_ms=1.0)["comms"]
            comms["kinds"] = {e.name: e.kind for e in events if classify_cpu_op(e.name) == "comms"}
            with open(os.path.join(out_dir, "comms.json"), "w") as f:
                json.dump(comms, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_profile_counts_the_hooks_collectives_as_the_dense_all_reduce(tmp_path):
    """The hook's all-to-all and all-gather run inside its profiler range: the job's comms report
    counts them as the dense all-reduce, not as the embeddings' all-to-all (the model has none)."""
    spawn_ranks(_profiled_worker, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    report = json.loads((tmp_path / "comms.json").read_text())
    comms, kinds = report["ms_per_step"], report["kinds"]
    hooks = {name: kind for name, kind in kinds.items() if "broadcast" not in name}  # DDP broadcasts buffers itself
    assert any("alltoall" in n for n in hooks) and any("allgather" in n for n in hooks), kinds
    assert set(hooks.values()) == {"all_reduce"}, kinds
    assert sum(comms["all_reduce"].values()) > 0 and sum(comms["all_to_all"].values()) == 0, comms


def test_the_block_bound_helper_holds_for_one_round_trip():
    """The bound the test above uses, checked on one encode/decode of the wire format."""
    from loka_torchrec.kernels import fp8_comm_codec as wire

    x = torch.randn(1024, dtype=torch.float64) * torch.logspace(-3, 2, 1024, dtype=torch.float64)
    back = wire.decode(wire.encode(x.float(), block=128), block=128).double()
    assert bool(((back - x).abs() <= _block_bound(x, 128) * (1 + 1e-6) + 1e-12).all())


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="Fp8AllreduceState.block: expected a multiple of 16, got 100"):
        Fp8AllreduceState(block=100)
    with pytest.raises(ValueError, match="Fp8AllreduceState.fmt: unknown FP8 format 'e3m4'"):
        Fp8AllreduceState(fmt="e3m4")
