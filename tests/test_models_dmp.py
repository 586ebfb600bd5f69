"""DHEN and HSTU under real 2-rank gloo DistributedModelParallel, baseline and with every mod: loss falls.

Training runs through TorchRec's ``TrainPipelineSparseDist`` (which traces the model with
``torch.fx`` to pipeline the embedding lookups), as the training job does.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from multirank import spawn_ranks

WORLD_SIZE = 2
STEPS = 30
BATCH = 256


def _data(model_name: str, rank: int):
    if model_name == "dhen":
        from loka_job.training.synthetic import SyntheticConfig, SyntheticRecDataset, make_data_spec

        cfg = SyntheticConfig(num_dense=8, num_tables=5, num_embeddings=500, embedding_dim=32, batch_size=BATCH,
                              train_batches=STEPS, eval_batches=4, seed=3)
        return (make_data_spec(cfg), SyntheticRecDataset(cfg, rank=rank, world_size=WORLD_SIZE),
                SyntheticRecDataset(cfg, rank=rank, world_size=WORLD_SIZE, split="eval"))
    from loka_job.training.synthetic_sequences import (
        SyntheticSequenceConfig, SyntheticSequenceDataset, make_sequence_data_spec)

    cfg = SyntheticSequenceConfig(num_items=500, max_seq_len=12, batch_size=BATCH, train_batches=STEPS,
                                  eval_batches=4, seed=3)
    return (make_sequence_data_spec(cfg), SyntheticSequenceDataset(cfg, rank=rank, world_size=WORLD_SIZE),
            SyntheticSequenceDataset(cfg, rank=rank, world_size=WORLD_SIZE, split="eval"))


def _build(model_name: str, spec, preset: str):
    from loka_torchrec.mods import ModsConfig, apply_mods

    torch.manual_seed(0)  # same dense init on every rank (DDP also broadcasts it)
    cpu = torch.device("cpu")
    if model_name == "dhen":
        from loka_job.models.dhen import DhenConfig, build_dhen

        model = build_dhen(DhenConfig.small(), spec, cpu)  # tables on meta: DMP materializes them
        tables = model.embedding_bag_collection
    else:
        from loka_job.models.hstu import HstuConfig, build_hstu

        model = build_hstu(HstuConfig.small(), spec, cpu)
        tables = model.embedding_collection
    report = apply_mods(model, ModsConfig(preset=preset))
    return model, tables, report


def _shard(model, tables):
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    try:
        from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    except ImportError:
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    apply_optimizer_in_backward(RowWiseAdagrad, list(tables.parameters()), {"lr": 0.05})
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=WORLD_SIZE, compute_device="cpu"), batch_size=BATCH)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adam(params, lr=3e-3)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


class _ClickLoss(nn.Module):
    """``batch -> (loss, (loss, logits))``: what TorchRec's train pipelines expect."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch):
        logits = self.model(batch.dense_features, batch.sparse_features)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def _eval_loss(dmp, eval_data) -> float:
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in eval_data:
            _, (loss, _) = dmp(batch)
            total += torch.tensor([loss.item() * batch.labels.numel(), batch.labels.numel()], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def _rank_main(rank: int, model_name: str, preset: str, store: str, out_dir: str) -> None:
    """One rank of one training job (one model, one mods preset), as the training job runs it:
    one DistributedModelParallel per process."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE)
    try:
        spec, train_data, eval_data = _data(model_name, rank)
        model, tables, report = _build(model_name, spec, preset)
        dmp, optimizer = _shard(_ClickLoss(model), tables)
        before = _eval_loss(dmp, eval_data)
        pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"), execute_all_batches=True)
        batches = iter(train_data)
        train_losses = []
        while True:
            try:
                loss, _ = pipeline.progress(batches)  # the pipeline returns the output part
            except StopIteration:
                break
            train_losses.append(loss.item())
        pipeline.detach()  # restore the sharded modules' own forward for evaluation
        after = _eval_loss(dmp, eval_data)
        # DDP keeps the dense weights identical on every rank: compare a checksum.
        checksum = torch.tensor(
            [sum(float(p.detach().double().sum()) for n, p in dmp.named_parameters() if "embedding" not in n)],
            dtype=torch.float64,
        )
        gathered = [torch.zeros_like(checksum) for _ in range(WORLD_SIZE)]
        dist.all_gather(gathered, checksum)
        result = {
            "before": before,
            "after": after,
            "train_losses": train_losses,
            "checksums": [float(c) for c in gathered],
            "mods": report.to_dict()["mods"],
            "sharding": sorted({type(m).__name__ for m in dmp.modules() if "Sharded" in type(m).__name__}),
        }
        with open(os.path.join(out_dir, f"rank{rank}-{preset}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["dhen", "hstu"])
def test_trains_under_two_rank_dmp_with_and_without_mods(model_name, tmp_path):
    for preset in ("none", "all"):
        spawn_ranks(_rank_main, (model_name, preset, str(tmp_path / f"store-{preset}"), str(tmp_path)), WORLD_SIZE)
    ranks = [
        {preset: json.loads((tmp_path / f"rank{r}-{preset}.json").read_text()) for preset in ("none", "all")}
        for r in range(WORLD_SIZE)
    ]
    sharded = "ShardedEmbeddingBagCollection" if model_name == "dhen" else "ShardedEmbeddingCollection"
    for preset in ("none", "all"):
        result = ranks[0][preset]
        assert ranks[1][preset]["after"] == result["after"]  # all-reduced
        assert sharded in result["sharding"]
        assert all(torch.isfinite(torch.tensor(r[preset]["train_losses"])).all() for r in ranks)
        # Held-out loss falls clearly within a few dozen steps (from about log 2 towards the teacher's).
        assert result["after"] < 0.93 * result["before"], (preset, result["before"], result["after"])
        first, last = result["train_losses"][:5], result["train_losses"][-5:]
        assert len(result["train_losses"]) == STEPS and sum(last) < sum(first)
        assert result["checksums"][0] == pytest.approx(result["checksums"][1], rel=1e-9, abs=1e-9)
    mods = ranks[0]["all"]["mods"]
    assert mods["block_norm"]["modules"] and mods["hard_swish"]["modules"] and mods["fuse_siblings"]["modules"]
    assert ranks[0]["none"]["mods"] == {}
