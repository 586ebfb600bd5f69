"""Sharding a model with TorchRec's planner and DistributedModelParallel, plus its optimizers.

With ``sharding_group_size`` (``train.sharding_group_size``) the model runs under TorchRec's
``DMPCollection`` instead: 2D sparse parallelism, where the embedding tables are sharded over a
*sharding group* of that many ranks and the same sharding is replicated over the
``world_size // sharding_group_size`` groups. Dense parameters stay data parallel over all ranks
(DDP on the global process group); the embedding replicas drift apart between syncs
(``DMPCollection.sync``, which all-reduces, averaging, the table weights and the fused optimizer's
state over each replica group) and ``TrainPipelineSparseDist`` calls that sync every
``dmp_collection_sync_interval_batches`` batches (``train.sync_every``).
"""

from __future__ import annotations

import inspect
from typing import List, Optional

import torch
from torch import nn

__all__ = ["shard_model", "default_sharders", "check_sharding_group_size", "SYNC_INTERVAL_ARG"]

# TrainPipelineSparseDist's argument for how often (in batches) it calls DMPCollection.sync().
SYNC_INTERVAL_ARG = "dmp_collection_sync_interval_batches"
# The DMPCollection arguments shard_model passes (all present since DMPCollection appeared).
_DMP_COLLECTION_ARGS = (
    "module", "device", "plan", "world_size", "sharding_group_size", "global_pg", "node_group_size", "sharders"
)


def default_sharders(qcomm_codecs_registry=None) -> List:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [
        EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
        EmbeddingCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
    ]


def _torchrec_version() -> str:
    try:
        from torchrec import __version__

        return __version__
    except ImportError:
        return "unknown"


def check_sharding_group_size(sharding_group_size: Optional[int], *, world_size: int, device: torch.device) -> None:
    """Refuse a ``train.sharding_group_size`` this job cannot run, before any sharding work.

    ``None`` (plain ``DistributedModelParallel``) always passes. Otherwise the group size must
    divide the number of ranks, the device must be CUDA (``DMPCollection`` asserts it), and the
    installed TorchRec must have ``DMPCollection`` with the arguments :func:`shard_model` passes
    and a ``TrainPipelineSparseDist`` that syncs the replicas (``dmp_collection_sync_interval_batches``).

    Raises:
        ValueError: naming ``train.sharding_group_size`` and what was expected.
    """
    if sharding_group_size is None:
        return
    if sharding_group_size < 1 or world_size % sharding_group_size:
        raise ValueError(
            f"train.sharding_group_size: must divide the number of ranks ({world_size}) so that the "
            f"embedding sharding is replicated over whole groups, got {sharding_group_size}"
        )
    if device.type != "cuda":
        raise ValueError(
            f"train.sharding_group_size={sharding_group_size}: DMPCollection needs CUDA; TorchRec asserts it "
            f"(this job's device is {device.type}); use device=cuda, or train.sharding_group_size=null for "
            f"plain DistributedModelParallel"
        )
    try:
        from torchrec.distributed.model_parallel import DMPCollection
    except ImportError as exc:
        raise ValueError(
            f"train.sharding_group_size: TorchRec {_torchrec_version()} has no "
            f"torchrec.distributed.model_parallel.DMPCollection (2D sparse parallelism); install a TorchRec "
            f"that has it, or set train.sharding_group_size=null"
        ) from exc
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    missing = [a for a in _DMP_COLLECTION_ARGS if a not in inspect.signature(DMPCollection.__init__).parameters]
    if SYNC_INTERVAL_ARG not in inspect.signature(TrainPipelineSparseDist.__init__).parameters:
        missing.append(f"TrainPipelineSparseDist({SYNC_INTERVAL_ARG}=...)")
    if missing:
        raise ValueError(
            f"train.sharding_group_size: TorchRec {_torchrec_version()}'s DMPCollection API lacks {missing}, "
            f"which this job needs; use another TorchRec, or set train.sharding_group_size=null"
        )


def shard_model(
    model: nn.Module,
    *,
    device: torch.device,
    world_size: int,
    local_world_size: int,
    batch_size: int,
    embedding_lr: float,
    sharders: Optional[List] = None,
    sharding_group_size: Optional[int] = None,
):
    """Plan with ``EmbeddingShardingPlanner``, wrap in ``DistributedModelParallel``.

    Embedding parameters get a fused row-wise Adagrad applied in backward (TorchRec's usual
    set-up); dense parameters are left for the caller's optimizer.

    With ``sharding_group_size`` (see the module docstring): the planner plans for one sharding
    group (a ``Topology`` of ``sharding_group_size`` ranks, ``min(local_world_size,
    sharding_group_size)`` of them per node, also passed as ``node_group_size`` so that
    TWRW/grid shardings see the same node size at run time), rank 0's plan is shared by all ranks
    (``collective_plan``), and ``DMPCollection`` remaps it onto each group's ranks. Checked by
    :func:`check_sharding_group_size` first.

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

    check_sharding_group_size(sharding_group_size, world_size=world_size, device=device)
    embedding_params = [
        p for name, p in model.named_parameters() if "embedding_bags" in name or "embeddings." in name
    ]
    if embedding_params:
        apply_optimizer_in_backward(RowWiseAdagrad, embedding_params, {"lr": embedding_lr})
    sharders = sharders if sharders is not None else default_sharders()
    plan_ranks = world_size if sharding_group_size is None else sharding_group_size
    if sharding_group_size is not None:
        local_world_size = min(local_world_size, sharding_group_size)
    topology = Topology(world_size=plan_ranks, local_world_size=local_world_size, compute_device=device.type)
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size)
    try:
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    except Exception as exc:  # the planner's own errors are long; name what the user can change
        raise ValueError(
            f"data: TorchRec's sharding planner found no plan for these tables on {plan_ranks} ranks "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); change data.num_tables / "
            f"data.embedding_dim / data.num_embeddings or the number of processes"
            + ("" if sharding_group_size is None else " / train.sharding_group_size")
        ) from exc
    if sharding_group_size is None:
        dmp = DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)
    else:
        from torchrec.distributed.model_parallel import DMPCollection

        dmp = DMPCollection(
            module=model,
            device=device,
            plan=plan,
            world_size=world_size,
            sharding_group_size=sharding_group_size,
            global_pg=dist.GroupMember.WORLD,
            node_group_size=local_world_size,
            sharders=sharders,
        )
    return dmp, plan
