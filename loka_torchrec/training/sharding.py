"""Sharding a model with TorchRec's planner and DistributedModelParallel, plus its optimizers."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

__all__ = ["shard_model", "default_sharders"]


def default_sharders(qcomm_codecs_registry=None) -> List:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [
        EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
        EmbeddingCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
    ]


def shard_model(
    model: nn.Module,
    *,
    device: torch.device,
    world_size: int,
    local_world_size: int,
    batch_size: int,
    embedding_lr: float,
    sharders: Optional[List] = None,
):
    """Plan with ``EmbeddingShardingPlanner``, wrap in ``DistributedModelParallel``.

    Embedding parameters get a fused row-wise Adagrad applied in backward (TorchRec's usual
    set-up); dense parameters are left for the caller's optimizer.

    Returns:
        ``(dmp_model, sharding_plan)``.
    """
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    try:
        from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    except ImportError:  # moved in some releases
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    embedding_params = [
        p for name, p in model.named_parameters() if "embedding_bags" in name or "embeddings." in name
    ]
    if embedding_params:
        apply_optimizer_in_backward(RowWiseAdagrad, embedding_params, {"lr": embedding_lr})
    sharders = sharders if sharders is not None else default_sharders()
    topology = Topology(world_size=world_size, local_world_size=local_world_size, compute_device=device.type)
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size)
    try:
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    except Exception as exc:  # the planner's own errors are long; name what the user can change
        raise ValueError(
            f"data: TorchRec's sharding planner found no plan for these tables on {world_size} ranks "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); change data.num_tables / "
            f"data.embedding_dim / data.num_embeddings or the number of processes"
        ) from exc
    dmp = DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)
    return dmp, plan
