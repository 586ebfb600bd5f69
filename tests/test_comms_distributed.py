"""Two-rank gloo tests of the comm codecs inside real DistributedModelParallel runs.

One spawn runs every scenario (raw all-to-all with the codec, EmbeddingBagCollection with
table-wise, row-wise and column-wise shards, variable batch per rank, EmbeddingCollection
sequence all-to-all, a short training run); each rank writes its measured errors together with
their format-derived bounds, and the tests below assert on them.
"""

from __future__ import annotations

import json
import math
import os
import traceback

import torch
import torch.distributed as dist

E4M3_U = 2.0**-4  # unit roundoff of E4M3 (3 mantissa bits)
E5M2_U = 2.0**-3
BF16_U = 2.0**-8
E4M3_SUB_HALF = 2.0**-10  # half the smallest E4M3 subnormal, in scaled units
E4M3_MAX = 448.0

TABLES = [  # (name, rows, dim, sharding)
    ("t0", 40, 16, "table_wise"),
    ("t1", 30, 48, "table_wise"),
    ("t2", 50, 32, "row_wise"),
    ("t3", 20, 16, "column_wise"),
]
BATCH_PER_RANK = (4, 4)  # gloo's all_gather (row-wise backward) needs equal batches
VAR_BATCH_PER_RANK = (5, 2)  # forward-only check of a variable batch per rank
LR = 0.5


def _kjt(rank: int, seed: int, batch_per_rank=BATCH_PER_RANK):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed * 100 + rank)
    batch = batch_per_rank[rank]
    lengths, values = [], []
    for name, rows, _, _ in TABLES:
        lens = torch.randint(0, 4, (batch,), generator=g)
        lens[0] = 0  # an empty bag on every rank: a pooled zero row
        lengths.append(lens)
        values.append(torch.randint(0, rows, (int(lens.sum()),), generator=g))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{t[0]}" for t in TABLES], values=torch.cat(values), lengths=torch.cat(lengths)
    )


def _ebc():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r, d, _ in TABLES
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():  # embedding rows with very different magnitudes: per-row scales matter
        for i, p in enumerate(ebc.parameters()):
            p.mul_(torch.logspace(-2, 2, p.shape[0])[:, None] * (1 + i))
    return ebc


def _plan(module, sharders, pg, world_size, prefix=""):
    """Table-wise, row-wise and column-wise, forced: TorchRec's planner offers row-wise only on CUDA."""
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    fused = "fused"  # EmbeddingComputeKernel.FUSED: the optimizer runs inside the backward kernel
    generators = {
        "table_wise": lambda i: table_wise(rank=i % world_size, compute_kernel=fused),
        "row_wise": lambda i: row_wise(compute_kernel=fused),
        "column_wise": lambda i: column_wise(ranks=list(range(world_size)), compute_kernel=fused),
    }
    per_param = {name: generators[st](i) for i, (name, _, _, st) in enumerate(TABLES)}
    ebc = module.ebc if prefix else module
    module_plan = construct_module_sharding_plan(
        ebc, per_param, sharder=sharders[0], local_size=world_size, world_size=world_size, device_type="cpu"
    )
    return ShardingPlan({prefix: module_plan})


def _dmp(comms_config, pg, world_size, counters=None):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from loka_torchrec import comms

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    sharders = comms.sharders(comms_config, counters=counters, fused_params=fused)
    module = _ebc()
    plan = _plan(module, sharders, pg, world_size)
    dmp = DistributedModelParallel(module, device=torch.device("cpu"), plan=plan, sharders=sharders)
    _load_full_weights(dmp, _ebc())
    return dmp, sharders


def _local_shards(dmp):
    """[(table, row offset, col offset, shard tensor)] of this rank's embedding shards (views)."""
    out = []
    for key, value in dmp.state_dict().items():
        if not key.endswith(".weight") or not hasattr(value, "local_shards"):
            continue
        for shard in value.local_shards():
            offsets = shard.metadata.shard_offsets
            out.append((key.split(".")[-2], offsets[0], offsets[1], shard.tensor))
    return out


def _load_full_weights(dmp, module):
    """DMP initializes its shards afresh: copy the unsharded module's tables into them."""
    full = {n.split(".")[-2]: p.detach() for n, p in module.named_parameters() if "embedding_bags" in n or "embeddings" in n}
    with torch.no_grad():
        for table, r0, c0, t in _local_shards(dmp):
            t.copy_(full[table][r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]])


def _local_weights(dmp):
    return {(table, r0, c0): t.detach().to(torch.float64).clone() for table, r0, c0, t in _local_shards(dmp)}


def _forward_backward(comms_config, pg, rank, world_size, grad_seed):
    dmp, sharders = _dmp(comms_config, pg, world_size)
    with torch.no_grad():
        var_out = dmp(_kjt(rank, seed=2, batch_per_rank=VAR_BATCH_PER_RANK))
        var_values = {k: var_out[k].to(torch.float64) for k in var_out.keys()}
    before = _local_weights(dmp)
    kjt = _kjt(rank, seed=1)
    out = dmp(kjt)
    values = {k: out[k].detach().to(torch.float64) for k in out.keys()}
    g = torch.Generator().manual_seed(grad_seed + rank)
    loss = sum((out[k] * torch.randn(out[k].shape, generator=g)).sum() for k in out.keys())
    loss.backward()
    after = _local_weights(dmp)
    deltas = {key: after[key] - before[key] for key in before}
    return values, var_values, deltas, sharders[0].nonfinite_counters


def _reference(world_size, grad_seed):
    """Unsharded float64 outputs for every rank's batch, and the weight gradient summed over ranks."""
    ebc = _ebc().double()
    var_outs = [{k: v.detach() for k, v in ebc(_kjt(r, seed=2, batch_per_rank=VAR_BATCH_PER_RANK)).to_dict().items()}
                for r in range(world_size)]
    outs, grads = [], {}
    for r in range(world_size):
        kjt = _kjt(r, seed=1)
        kt = ebc(kjt)
        g = torch.Generator().manual_seed(grad_seed + r)
        weights = {k: torch.randn(kt[k].shape, generator=g).double() for k in kt.keys()}
        for key, sign in (("grad", lambda w: w), ("abs_grad", torch.abs)):
            ebc.zero_grad()
            sum((ebc(kjt)[k] * sign(w)).sum() for k, w in weights.items()).backward()
            for n, p in ebc.named_parameters():
                grads.setdefault((key, n), torch.zeros_like(p)).add_(p.grad)
        outs.append({k: kt[k].detach() for k in kt.keys()})
    table_grads = {(key, n.split(".")[-2]): gr for (key, n), gr in grads.items()}
    return outs, var_outs, table_grads


def _forward_excess(values, ref, fmt_u):
    """max over elements of |out - ref| - bound, bound = u|ref| + sub/2 * amax_row / fp8_max (+ fp32 slack)."""
    worst = -math.inf
    for k, out in values.items():
        r = ref[k]
        amax_row = r.abs().amax(dim=1, keepdim=True)
        bound = fmt_u * r.abs() + E4M3_SUB_HALF * amax_row / E4M3_MAX + 1e-6 * r.abs() + 1e-12
        worst = max(worst, float(((out - r).abs() - bound).max()))
    return worst


def _scenario_dmp(rank, world_size, pg, results):
    from loka_torchrec import comms

    grad_seed = 7
    ref_outs, ref_var_outs, ref_grads = _reference(world_size, grad_seed)
    ref = ref_outs[rank]
    fp32_cfg = comms.CommsConfig(forward="fp32", backward="fp32")
    fp32_vals, fp32_var, fp32_deltas, _ = _forward_backward(fp32_cfg, pg, rank, world_size, grad_seed)
    fp8_cfg = comms.CommsConfig(forward="fp8", backward="fp8")
    fp8_vals, fp8_var, fp8_deltas, counters = _forward_backward(fp8_cfg, pg, rank, world_size, grad_seed)

    tw = [f"f_{n}" for n, _, _, st in TABLES if st != "row_wise"]  # through the all-to-all
    rw = [f"f_{n}" for n, _, _, st in TABLES if st == "row_wise"]
    results["fp32_forward_max_abs_err"] = max(float((fp32_vals[k] - ref[k]).abs().max()) for k in ref)
    results["fp8_tw_forward_excess"] = _forward_excess({k: fp8_vals[k] for k in tw}, ref, E4M3_U)
    # Row-wise tables: per-rank partial sums rounded to bf16 and summed in bf16 by the reduce-scatter.
    results["fp8_rw_forward_excess"] = max(
        float(((fp8_vals[k] - ref[k]).abs() - 3 * BF16_U * ref[k].abs().amax(dim=1, keepdim=True) - 1e-9).max()) for k in rw
    )
    var_ref = ref_var_outs[rank]
    results["fp32_var_batch_max_abs_err"] = max(float((fp32_var[k] - var_ref[k]).abs().max()) for k in var_ref)
    results["fp8_var_batch_forward_excess"] = _forward_excess({k: fp8_var[k] for k in tw}, var_ref, E4M3_U)
    results["fp8_tw_forward_rel_frobenius"] = max(
        float((fp8_vals[k] - ref[k]).norm() / ref[k].norm()) for k in tw
    )

    # Gradients: the fused SGD applied -lr * grad to this rank's shards (grad divided by world size
    # when TorchRec's gradient division is on).
    from torchrec.distributed.comm_ops import get_gradient_division

    div = world_size if get_gradient_division() else 1
    grad_rel = {}
    for (table, r0, c0), d8 in fp8_deltas.items():
        d32 = fp32_deltas[(table, r0, c0)]
        rows, cols = slice(r0, r0 + d32.shape[0]), slice(c0, c0 + d32.shape[1])
        expected = -LR * ref_grads[("grad", table)][rows, cols] / div
        # Each pooled gradient value carries at most u |g| of error (E5M2 all-to-all, bf16 for the
        # reduce-scatter's all-gather); a weight row sums them over its bags: u * sum |g|.
        u = BF16_U if dict((n, st) for n, _, _, st in TABLES)[table] == "row_wise" else E5M2_U
        bound = LR / div * (u * ref_grads[("abs_grad", table)][rows, cols]) * (1 + 1e-3) + 1e-6
        grad_rel[table] = {
            "fp32_max_abs_err": float((d32 - expected).abs().max()),
            "fp8_excess": float(((d8 - expected).abs() - bound).max()),
            "fp8_rel_frobenius": float((d8 - expected).norm() / expected.norm()),
            "expected_norm": float(expected.norm()),
        }
    results["grads"] = grad_rel
    results["nonfinite_counts"] = counters.as_dict()


def _scenario_sync_collectives(rank, world_size, pg, results):
    """TorchRec's sync collectives (``set_use_sync_collectives(True)``) with fp8 codecs both ways.

    That path sends the payload's gradient back in the payload's dtype: the FP8 codec carries bf16
    while gradients are needed and FP8 bytes under ``torch.no_grad()``.
    """
    from torchrec.distributed.comm_ops import get_use_sync_collectives, set_use_sync_collectives

    from loka_torchrec import comms

    grad_seed = 7
    ref_outs, ref_var_outs, ref_grads = _reference(world_size, grad_seed)
    previous = get_use_sync_collectives()
    set_use_sync_collectives(True)
    try:
        config = comms.CommsConfig(forward="fp8", backward="fp8")
        vals, var_vals, deltas, counters = _forward_backward(config, pg, rank, world_size, grad_seed)
    finally:
        set_use_sync_collectives(previous)
    ref, var_ref = ref_outs[rank], ref_var_outs[rank]
    tw = [f"f_{n}" for n, _, _, st in TABLES if st != "row_wise"]
    results["sync_forward_excess"] = max(  # with autograd on: one bf16 rounding per value
        float(((vals[k] - ref[k]).abs() - BF16_U * ref[k].abs() * (1 + 1e-3) - 1e-9).max()) for k in tw
    )
    results["sync_no_grad_forward_excess"] = _forward_excess({k: var_vals[k] for k in tw}, var_ref, E4M3_U)
    results["sync_no_grad_rel_frobenius"] = max(float((var_vals[k] - var_ref[k]).norm() / var_ref[k].norm()) for k in tw)
    from torchrec.distributed.comm_ops import get_gradient_division

    div = world_size if get_gradient_division() else 1
    grads = {}
    for (table, r0, c0), d in deltas.items():
        rows, cols = slice(r0, r0 + d.shape[0]), slice(c0, c0 + d.shape[1])
        expected = -LR * ref_grads[("grad", table)][rows, cols] / div
        bound = LR / div * (BF16_U * ref_grads[("abs_grad", table)][rows, cols]) * (1 + 1e-3) + 1e-6
        grads[table] = {"excess": float(((d - expected).abs() - bound).max()), "expected_norm": float(expected.norm())}
    results["sync_grads"] = grads
    results["sync_counts"] = counters.as_dict()


def _scenario_raw_a2a(rank, world_size, pg, results):
    """The codec over a raw gloo all_to_all_single: uneven and empty splits, inf/NaN, fp16 input."""
    from loka_torchrec.comms import Fp8CommCodec, NonFiniteCounters

    counters = NonFiniteCounters()
    codec = Fp8CommCodec("e4m3", block=8, name="raw", counters=counters, kernel="torch")
    # rank 0 sends 3 rows to rank 0 and 0 rows to rank 1; rank 1 sends 2 rows to 0 and 4 to 1.
    rows_to = {0: [3, 0], 1: [2, 4]}[rank]
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(sum(rows_to), 8, generator=g) * 10).to(torch.float16)
    if rank == 1:
        x[0, 1] = float("inf")  # goes to rank 0
        x[5, 2] = float("nan")  # stays on rank 1
    ctx = codec.create_context()
    payload = codec.encode(x, ctx)
    in_splits = [codec.calc_quantized_size(n * 8, ctx) for n in rows_to]
    rows_from = [{0: [3, 0], 1: [2, 4]}[src][rank] for src in range(world_size)]
    out_splits = [codec.calc_quantized_size(n * 8, ctx) for n in rows_from]
    received = torch.empty(sum(out_splits), dtype=codec.quantized_dtype)
    dist.all_to_all_single(received, payload, out_splits, in_splits, group=pg)
    decoded = codec.decode(received, ctx).view(-1, 8)
    # What this rank should have received, rebuilt from every sender's seed.
    expected = []
    for src in range(world_size):
        gs = torch.Generator().manual_seed(src)
        src_rows = {0: [3, 0], 1: [2, 4]}[src]
        xs = (torch.randn(sum(src_rows), 8, generator=gs) * 10).to(torch.float16)
        if src == 1:
            xs[0, 1] = float("inf")
            xs[5, 2] = float("nan")
        start = sum(src_rows[:rank])
        expected.append(xs[start : start + src_rows[rank]])
    expected = torch.cat(expected).to(torch.float32)
    finite = torch.isfinite(expected)
    results["raw_dtype"] = str(decoded.dtype)
    results["raw_shape_ok"] = list(decoded.shape) == list(expected.shape)
    results["raw_nonfinite_positions_ok"] = bool(torch.equal(~torch.isfinite(decoded.float()), ~finite))
    dec = decoded.float()
    amax = torch.where(finite, expected.abs(), torch.zeros_like(expected)).amax(dim=1, keepdim=True)
    bound = (E4M3_U * expected.abs() + E4M3_SUB_HALF * amax / E4M3_MAX) * (1 + 1e-3) + 2.0**-10 * expected.abs()
    results["raw_excess"] = float(((dec - expected).abs() - bound)[finite].max()) if finite.any() else -1.0
    results["raw_counts"] = counters.as_dict()


def _scenario_sequence(rank, world_size, pg, results):
    """EmbeddingCollection (sequence all-to-all), table-wise, fp8 forward."""
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from loka_torchrec import comms

    def build():
        torch.manual_seed(3)
        cfgs = [EmbeddingConfig(name=f"s{i}", embedding_dim=24, num_embeddings=30, feature_names=[f"g{i}"]) for i in range(2)]
        return EmbeddingCollection(tables=cfgs, device=torch.device("cpu"))

    def batch(r):
        g = torch.Generator().manual_seed(50 + r)
        lengths = torch.randint(0, 4, (2 * BATCH_PER_RANK[r],), generator=g)
        return KeyedJaggedTensor.from_lengths_sync(
            keys=["g0", "g1"], values=torch.randint(0, 30, (int(lengths.sum()),), generator=g), lengths=lengths
        )

    config = comms.CommsConfig(forward="fp8", backward="bf16")
    sharders = comms.sharders(config)
    module = build()
    constraints = {f"s{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(2)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(module, sharders, pg)
    dmp = DistributedModelParallel(module, device=torch.device("cpu"), plan=plan, sharders=sharders)
    _load_full_weights(dmp, build())
    out = dmp(batch(rank))
    ref = build().double()(batch(rank))
    worst = -math.inf
    for k in ["g0", "g1"]:
        o, r = out[k].values().double(), ref[k].values().detach()
        amax_row = r.abs().amax(dim=1, keepdim=True) if r.numel() else r
        bound = E4M3_U * r.abs() + E4M3_SUB_HALF * amax_row / E4M3_MAX + 1e-6 * r.abs() + 1e-12
        if r.numel():
            worst = max(worst, float(((o - r).abs() - bound).max()))
    results["seq_forward_excess"] = worst
    loss = sum(out[k].values().sum() for k in ["g0", "g1"])
    loss.backward()  # bf16 backward through the sequence all-to-all
    results["seq_backward_ok"] = True


def _scenario_training(rank, world_size, pg, results, steps=8):
    """A short training run: EBC + MLP, BCE loss; fp32 comms vs fp8 forward / e5m2 backward."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from loka_torchrec import comms

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = _ebc()
            width = sum(d for _, _, d, _ in TABLES)
            torch.manual_seed(11)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def forward(self, kjt):
            return self.mlp(self.ebc(kjt).values()).squeeze(1)

    def run(config):
        fused = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05}
        sharders = comms.sharders(config, fused_params=fused)
        model = Model()
        plan = _plan(model, sharders, pg, world_size, prefix="ebc")
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
        _load_full_weights(dmp, _ebc())
        opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "mlp" in n], lr=0.05)
        losses = []
        for step in range(steps):
            kjt = _kjt(rank, seed=100 + step)
            g = torch.Generator().manual_seed(1000 + step * 7 + rank)
            labels = (torch.rand(BATCH_PER_RANK[rank], generator=g) > 0.5).float()
            logits = dmp(kjt)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits / 100.0, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return losses

    l32 = run(comms.CommsConfig(forward="fp32", backward="fp32"))
    l8 = run(comms.CommsConfig(forward="fp8", backward="fp8"))
    results["train_losses_fp32"] = l32
    results["train_losses_fp8"] = l8


# Per rank and label, the seconds the injected timer reports: alone, rank 0 would keep fp32 in
# both directions and rank 1 would take fp8 in both; the MAX over ranks takes fp8 forward
# (3.0 vs 2.5 ms) and fp32 backward (4.0 vs 5.0 ms).
AUTO_TIMES_MS = {
    0: {"forward/fp32": 1.0, "forward/fp8": 2.0, "backward/fp32": 1.0, "backward/fp8": 5.0},
    1: {"forward/fp32": 3.0, "forward/fp8": 2.5, "backward/fp32": 4.0, "backward/fp8": 1.0},
}


def _scenario_auto(rank, world_size, pg, results):
    """"auto" comms: every rank takes the same decision, and setting it after DMP changes what is sent."""
    from loka_torchrec import comms

    calls = []

    def timer(label, run):
        run()  # the real collectives run, so the ranks stay in step
        calls.append(label)
        return AUTO_TIMES_MS[rank][label] / 1e3

    config = comms.CommsConfig()  # auto, auto
    choice = comms.decide(config, process_group=pg, embedding_dims=[t[2] for t in TABLES], batch_size=4, timer=timer)
    results["auto_choice"] = choice.to_dict()
    results["auto_timer_calls"] = len(calls)
    # A decision taken with the real clock: it decides, every rank alike, on the payload it was given.
    results["auto_real_clock_choice"] = comms.decide(config, process_group=pg, embedding_dims=[16, 48], batch_size=4).to_dict()

    ref_vals, _, _, _ = _forward_backward(comms.CommsConfig(forward="fp32", backward="fp32"), pg, rank, world_size, 7)
    dmp, sharders = _dmp(config, pg, world_size)
    selection = sharders[0].comms_selection
    a2a = next(iter(sharders[0].bound_registries.values()))["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    kjt = _kjt(rank, seed=1)
    tw = [f"f_{n}" for n, _, _, st in TABLES if st != "row_wise"]

    def forward_error():
        with torch.no_grad():
            out = dmp(kjt)
        return max(float((out[k].to(torch.float64) - ref_vals[k]).abs().max()) for k in tw)

    results["auto_undecided_dtype"] = str(a2a.forward.quantized_dtype)
    results["auto_undecided_err"] = forward_error()
    results["auto_undecided_counts"] = sharders[0].nonfinite_counters.as_dict()
    selection.set(choice)  # after DMP exists: no re-sharding
    results["auto_decided_fwd_dtype"] = str(a2a.forward.quantized_dtype)
    results["auto_decided_bwd_dtype"] = str(a2a.backward.quantized_dtype)
    results["auto_decided_err"] = forward_error()
    results["auto_decided_counts"] = sharders[0].nonfinite_counters.as_dict()


def worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    results = {}
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        pg = dist.group.WORLD
        for scenario in (
            _scenario_raw_a2a, _scenario_dmp, _scenario_sync_collectives, _scenario_sequence, _scenario_training, _scenario_auto
        ):
            scenario(rank, world_size, pg, results)
    except Exception:  # reported to the test process, which fails with the traceback
        results["error"] = traceback.format_exc()
    finally:
        tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from multirank import spawn_ranks

    out_dir = tmp_path_factory.mktemp("comms_dmp")
    spawn_ranks(worker, (2, str(out_dir / "store"), str(out_dir)), nprocs=2)
    results = [json.load(open(out_dir / f"rank{r}.json")) for r in range(2)]
    for r, res in enumerate(results):
        if "error" in res:
            pytest.fail(f"rank {r} failed:\n{res['error']}")
    return results


@pytest.mark.slow
def test_raw_all_to_all_uneven_empty_splits_and_nonfinite(ranks):
    for res in ranks:
        assert res["raw_dtype"] == "torch.float16"  # decode returns the sender's input dtype
        assert res["raw_shape_ok"]
        assert res["raw_nonfinite_positions_ok"]  # inf/NaN arrive non-finite, exactly where sent
        assert res["raw_excess"] <= 0.0
    assert ranks[1]["raw_counts"]["raw/sent"] == 2
    assert ranks[0]["raw_counts"]["raw/received"] == 1  # the inf sent to rank 0 (as NaN: E4M3)
    assert ranks[1]["raw_counts"]["raw/received"] == 1  # the NaN rank 1 kept


@pytest.mark.slow
def test_dmp_forward_matches_fp32_within_format_bound(ranks):
    for res in ranks:
        assert res["fp32_forward_max_abs_err"] < 1e-4  # the fp32 DMP run reproduces the unsharded module
        assert res["fp8_tw_forward_excess"] <= 0.0  # table-wise and column-wise: E4M3 all-to-all
        assert res["fp8_rw_forward_excess"] <= 0.0  # row-wise: bf16 reduce-scatter
        assert 0.0 < res["fp8_tw_forward_rel_frobenius"] < E4M3_U  # compressed, and within E4M3
        counts = res["nonfinite_counts"]
        assert "pooled_embeddings_all_to_all/forward/sent" in counts  # the loka codec carried it
        assert sum(counts.values()) == 0


@pytest.mark.slow
def test_dmp_variable_batch_per_rank(ranks):
    for res in ranks:
        assert res["fp32_var_batch_max_abs_err"] < 1e-4
        assert res["fp8_var_batch_forward_excess"] <= 0.0


@pytest.mark.slow
def test_dmp_gradients_flow_within_bound(ranks):
    for res in ranks:
        assert res["grads"], "no local embedding shard was updated"
        for table, g in res["grads"].items():
            assert g["expected_norm"] > 0
            assert g["fp32_max_abs_err"] < 1e-4, table
            assert g["fp8_excess"] <= 0.0, table
            assert 0.0 < g["fp8_rel_frobenius"] < E5M2_U, table


@pytest.mark.slow
def test_sequence_all_to_all(ranks):
    for res in ranks:
        assert res["seq_forward_excess"] <= 0.0
        assert res["seq_backward_ok"]


@pytest.mark.slow
def test_short_training_run_tracks_fp32_loss(ranks):
    for res in ranks:
        l32, l8 = res["train_losses_fp32"], res["train_losses_fp8"]
        assert len(l32) == len(l8) > 0
        rel = [abs(a - b) / abs(a) for a, b in zip(l32, l8)]
        # The logit error from E4M3 embeddings (2**-4 relative per value, averaging out over the
        # MLP) moves a BCE loss near log(2) far less than a quarter of E4M3's unit roundoff.
        assert max(rel) < E4M3_U / 4, rel
        assert l8 != l32  # the FP8 path really ran


@pytest.mark.slow
def test_sync_collectives_train_embeddings_through_fp8_codecs(ranks):
    # TorchRec's sync path used to cut the gradient at the FP8 payload ("element 0 of tensors does
    # not require grad"); now the values travel as bf16 while gradients are needed.
    for res in ranks:
        assert res["sync_forward_excess"] <= 0.0
        assert res["sync_grads"], "no local embedding shard was updated"
        for table, g in res["sync_grads"].items():
            assert g["expected_norm"] > 0
            assert g["excess"] <= 0.0, table
        # Under torch.no_grad() the same codec still sends FP8 bytes: E4M3 error, well above bf16's.
        assert res["sync_no_grad_forward_excess"] <= 0.0
        assert res["sync_no_grad_rel_frobenius"] > BF16_U
        assert "pooled_embeddings_all_to_all/forward/sent" in res["sync_counts"]


@pytest.mark.slow
def test_auto_comms_every_rank_takes_the_max_decision(ranks):
    choices = [res["auto_choice"] for res in ranks]
    assert choices[0] == {**choices[1], "seconds": choices[0]["seconds"]}  # the same decision and timings
    choice = choices[0]
    # Alone, rank 0 keeps fp32 both ways and rank 1 takes fp8 both ways: the MAX gives fp8 / fp32.
    assert (choice["forward"], choice["backward"]) == ("fp8", "fp32")
    assert choice["times_ms"]["forward"] == pytest.approx({"fp32": 3.0, "fp8": 2.5})
    assert choice["times_ms"]["backward"] == pytest.approx({"fp32": 4.0, "fp8": 5.0})
    assert choice["world_size"] == 2 and choice["decided"] == ["forward", "backward"]
    assert "faster" in choice["reasons"]["forward"] and "not faster" in choice["reasons"]["backward"]
    assert choice["payload"]["rows_per_rank"] == 4 and choice["payload"]["width"] % choice["payload"]["block"] == 0
    for res in ranks:
        assert res["auto_timer_calls"] == 4 * (2 + 5)  # 4 candidates, 2 warm-up + 5 timed runs each
    # With the real clock: both directions decided on every rank alike (the slowest rank's medians),
    # from 2 warm-up and 5 timed runs of the small payload asked for (4 rows of (16 + 48) / 2 dims).
    real = [{k: v for k, v in res["auto_real_clock_choice"].items() if k != "seconds"} for res in ranks]
    assert real[0] == real[1] and real[0]["decided"] == ["forward", "backward"]
    assert all(t > 0 for times in real[0]["times_ms"].values() for t in times.values())
    payload = real[0]["payload"]
    assert (payload["rows_per_rank"], payload["reps"], payload["warmup"]) == (4, 5, 2)
    assert (payload["width"], payload["block"], payload["values_per_rank"]) == (32, 16, 4 * 32 * 2)


@pytest.mark.slow
def test_auto_comms_choice_switches_the_installed_codecs(ranks):
    for res in ranks:
        # Undecided: the installed codecs send fp32 unchanged (exactly TorchRec's fp32 result).
        assert res["auto_undecided_dtype"] == "torch.float32"
        assert res["auto_undecided_err"] == 0.0
        assert not any(k.startswith("pooled_embeddings_all_to_all") for k in res["auto_undecided_counts"])
        # fp8 forward chosen: FP8 bytes on the wire (E4M3 error), the backward stays fp32.
        assert res["auto_decided_fwd_dtype"] == "torch.uint8" and res["auto_decided_bwd_dtype"] == "torch.float32"
        assert res["auto_decided_err"] > 0.0
        assert "pooled_embeddings_all_to_all/forward/sent" in res["auto_decided_counts"]
