"""A TorchRec training job, written the way TorchRec's own DLRM example is, with LoKA in it.

``train`` below, from its imports to its return, is the README's "LoKA in your TorchRec job"
(``tests/test_readme.py`` checks that the two are the same text); the lines LoKA adds are marked
``# LoKA``. The Probe learns each GEMM's statistics, Dispatch plans a kernel per GEMM from them,
and the embedding all-to-all runs in the precision a timing before the first step chose.

    torchrun --standalone --nproc_per_node=2 scripts/torchrec_dlrm_example.py --steps 50
    loka-inspect runs/example                                                  # what it did
"""

import argparse

from loka_job.training.distributed import exit_process, pipeline_in_flight, shutdown_distributed

# README: begin
import os

import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import loka_torchrec
from loka_torchrec.probe import ProbeConfig


def train(steps: int = 50, run_dir: str = "runs/example", warmup_steps: int = 10) -> TrainPipelineSparseDist:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    features = ["f0", "f1", "f2", "f3"]
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=32, num_embeddings=1000, feature_names=[f])
              for f in features]
    model = DLRMTrain(DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13, dense_arch_layer_sizes=[64, 32], over_arch_layer_sizes=[64, 32, 1],
        dense_device=device,
    ))
    config = loka_torchrec.LokaConfig(enabled=True, probe=ProbeConfig(warmup_steps=warmup_steps, every=2))  # LoKA
    loka = loka_torchrec.prepare(model, config, run_dir=run_dir)  # LoKA: before DMP
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    model = DistributedModelParallel(model, device=device, sharders=loka.sharders())  # LoKA: its sharders
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=0.05))
    pipeline = TrainPipelineSparseDist(model, CombinedOptimizer([model.fused_optimizer, dense]), device)
    batches = iter(RandomRecDataset(keys=features, batch_size=128, hash_size=1000, ids_per_feature=3,
                                    num_dense=13, num_batches=steps + 4))
    for step in range(1, steps + 1):
        with loka.step(step):  # LoKA: probe steps, plans, the step-time guard
            pipeline.progress(batches)
    checkpoint = {"loka": loka.state_dict()}  # LoKA: every decision, beside your model's state
    torch.save(checkpoint, os.path.join(run_dir, f"checkpoint_rank{dist.get_rank()}.pt"))
    loka.close()  # LoKA: flush the logs that loka-inspect reads
    return pipeline
# README: end


def main() -> None:
    parser = argparse.ArgumentParser(description="TorchRec DLRM on random data, with LoKA")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--run_dir", default="runs/example", help="LoKA's plan and per-rank logs")
    parser.add_argument("--probe_warmup", type=int, default=10, help="steps of statistics before the first plan")
    args = parser.parse_args()
    pipeline = train(args.steps, args.run_dir, args.probe_warmup)
    if dist.get_rank() == 0:
        print(f"{args.steps} steps; LoKA's plan and logs: {args.run_dir} (loka-inspect {args.run_dir})")
    # The prefetched batches' input all-to-alls, a barrier, the group; then the process ends
    # without interpreter teardown, where gloo's worker threads could abort it (loka_job/training/distributed.py).
    shutdown_distributed(pending=pipeline_in_flight(pipeline))


if __name__ == "__main__":
    main()
    exit_process(0)
