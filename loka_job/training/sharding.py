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
from typing import Any, Dict, List, Optional

import torch
from torch import nn

__all__ = ["shard_model", "default_sharders", "check_sharding_group_size", "dense_allreduce_in_force", "SYNC_INTERVAL_ARG"]

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
    dense_allreduce: str = "fp32",
    ddp_bucket_cap_mb: int = 25,
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

    The dense modules are wrapped in DDP by TorchRec's ``DefaultDataParallelWrapper`` with
    ``ddp_bucket_cap_mb`` and, for ``dense_allreduce`` ``bf16`` / ``fp16``, PyTorch's compression
    hook of that precision on the gradients' all-reduce (``fp32``: none).

    Returns:
        ``(dmp_model, sharding_plan)``.
    """
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    try:
        from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    except ImportError:  # moved in some releases
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    check_sharding_group_size(sharding_group_size, world_size=world_size, device=device)
    if dense_allreduce == "bf16" and device.type != "cuda":
        raise ValueError(
            f"train.dense_allreduce: bf16 needs CUDA and NCCL (PyTorch's bf16 compression hook); on {device.type} use fp16 or fp32"
        )
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
    data_parallel = DefaultDataParallelWrapper(
        bucket_cap_mb=ddp_bucket_cap_mb, allreduce_comm_precision=None if dense_allreduce == "fp32" else dense_allreduce
    )
    if sharding_group_size is None:
        dmp = DistributedModelParallel(
            module=model, device=device, plan=plan, sharders=sharders, data_parallel_wrapper=data_parallel
        )
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
            **_dmp_collection_wrapper(DMPCollection, data_parallel, dense_allreduce, ddp_bucket_cap_mb),
        )
    return dmp, plan


def _dmp_collection_wrapper(dmp_collection, data_parallel, dense_allreduce: str, bucket_cap_mb: int) -> Dict[str, Any]:
    """``DMPCollection``'s ``data_parallel_wrapper`` argument where the job sets DDP's all-reduce; a
    TorchRec whose ``DMPCollection`` takes none runs its default (fp32, 25 MiB) only."""
    if (dense_allreduce, bucket_cap_mb) == ("fp32", 25):
        return {}
    if "data_parallel_wrapper" not in inspect.signature(dmp_collection.__init__).parameters:
        raise ValueError(
            f"train.dense_allreduce / train.ddp_bucket_cap_mb: TorchRec {_torchrec_version()}'s DMPCollection takes no "
            f"data_parallel_wrapper; leave them at fp32 / 25, or set train.sharding_group_size=null"
        )
    return {"data_parallel_wrapper": data_parallel}


def dense_allreduce_in_force(dmp) -> Dict[str, Any]:
    """What DDP does with the dense gradients of ``dmp``, read from its DDP module (not from the
    config): ``ddp`` (whether TorchRec wrapped the dense part in DDP; a single rank or a model
    without dense parameters has none), the communication hooks registered (their function names,
    e.g. ``bf16_compress_hook``; none: fp32 gradients on the wire) and the bucket size in MiB."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(dmp, "_dmp_wrapped_module", None)
    if not isinstance(ddp, DistributedDataParallel):
        return {"ddp": False, "comm_hooks": [], "bucket_cap_mb": None}
    hooks = [getattr(hook, "__name__", type(hook).__name__) for hook, _ in getattr(ddp, "_comm_hooks", [])]
    return {"ddp": True, "comm_hooks": hooks, "bucket_cap_mb": ddp.bucket_bytes_cap / 2**20}
