"""An existing TorchRec training job, written the way TorchRec's own DLRM example is, plus LoKA.

Everything LoKA adds is marked ``# LoKA``: the lines a user adds to their own job (the README
shows them). With ``--loka`` the Probe learns each GEMM's statistics, Dispatch plans a kernel per
GEMM from them, and the embedding all-to-all runs in FP8 (forward) and bf16 (backward).

    torchrun --standalone --nproc_per_node=2 scripts/torchrec_dlrm_example.py            # plain
    torchrun --standalone --nproc_per_node=2 scripts/torchrec_dlrm_example.py --loka     # with LoKA
    loka-inspect runs/example                                                            # what it did
"""

import argparse
import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.datasets.random import RandomRecDataset
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from loka_job.training.distributed import exit_process, pipeline_in_flight, shutdown_distributed


def parse_args():
    parser = argparse.ArgumentParser(description="TorchRec DLRM on random data")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_embeddings", type=int, default=1000)
    parser.add_argument("--embedding_dim", type=int, default=32)
    parser.add_argument("--num_tables", type=int, default=4)
    parser.add_argument("--loka", action="store_true", help="turn on LoKA (FP8 where it is safe and fast)")
    parser.add_argument("--run_dir", default="runs/example", help="LoKA's plan and per-rank logs")
    parser.add_argument("--probe_warmup", type=int, default=10, help="steps of statistics before the first plan")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")

    features = [f"f{i}" for i in range(args.num_tables)]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.embedding_dim, num_embeddings=args.num_embeddings, feature_names=[f])
        for i, f in enumerate(features)
    ]
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=13,
            dense_arch_layer_sizes=[64, args.embedding_dim],
            over_arch_layer_sizes=[64, 32, 1],
            dense_device=device,
        )
    )
    sharders = [EmbeddingBagCollectionSharder()]
    loka = None
    if args.loka:
        import loka_torchrec  # LoKA
        from loka_torchrec import comms, probe  # LoKA

        config = loka_torchrec.LokaConfig(  # LoKA
            enabled=True,
            probe=probe.ProbeConfig(warmup_steps=args.probe_warmup, every=2, every_after=10),
            comms=comms.CommsConfig(forward="fp8", backward="bf16"),
        )
        loka = loka_torchrec.prepare(model, config, run_dir=args.run_dir)  # LoKA
        sharders = loka.sharders()  # LoKA
        if dist.get_rank() == 0:
            print(loka)

    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=dist.get_world_size(), compute_device=device.type))
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.Adagrad(params, lr=0.05)
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_optimizer])
    pipeline = TrainPipelineSparseDist(model, optimizer, device)

    dataset = RandomRecDataset(
        keys=features,
        batch_size=args.batch_size,
        hash_size=args.num_embeddings,
        ids_per_feature=3,
        num_dense=13,
        num_batches=args.steps + 4,
    )
    batches: Iterator[Batch] = iter(dataset)
    for step in range(1, args.steps + 1):
        with loka.step(step) if loka else contextlib.nullcontext():  # LoKA
            loss, _, _ = pipeline.progress(batches)
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step} loss {float(loss):.4f}")
    if loka:
        loka.close()  # LoKA
        if dist.get_rank() == 0:
            print(loka.dispatcher.plan.table())
    # The prefetched batches' input all-to-alls, a barrier, the group; then the process ends
    # without interpreter teardown, where gloo's worker threads could abort it (loka_job/training/distributed.py).
    shutdown_distributed(pending=pipeline_in_flight(pipeline))


if __name__ == "__main__":
    main()
    exit_process(0)
