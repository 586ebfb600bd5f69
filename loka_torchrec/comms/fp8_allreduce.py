"""FP8 all-reduce of DDP's dense gradients: a DDP communication hook.

DDP's own all-reduce sends the fp32 gradient buckets; PyTorch's compression hooks send bf16 or fp16
(half the bytes). :func:`fp8_allreduce_hook` sends a quarter: each bucket is cut into one shard per
rank and travels in the FP8 wire format of the embedding comms (:mod:`loka_torchrec.kernels.fp8_comm_codec`:
records of ``block`` FP8 values and their fp32 scale) in two collectives:

1. reduce-scatter as an all-to-all: every rank sends shard ``r`` of its encoded bucket to rank ``r``,
   which decodes the ``N`` copies of its shard and sums them in float32, divided by ``N`` (DDP's
   average);
2. all-gather: every rank encodes its averaged shard and gathers all of them, decoded into the bucket.

A rank sends ``2 (N - 1) / N`` of the bucket's elements at about one byte each (plus 4 bytes per
``block`` values of scale), against four for fp32: where the all-reduce is exposed (between nodes)
that is what the step waits for. The cost is precision: every gradient value is rounded to FP8
twice (before the sum, relative error at most ``2**-4`` in E4M3 plus a subnormal term of at most
``2**-10 / 448`` of its block's largest value; and the sum again), which is noise a training run must
tolerate, so nothing switches this on by itself: a user or the job's ``train.dense_allreduce=fp8``
asks for it. A NaN or inf in a gradient reaches every rank's averaged gradient as NaN, as with fp32.

Example (a DDP module, any process group; gloo on CPUs, NCCL on GPUs)::

    ddp.register_comm_hook(Fp8AllreduceState(process_group=ddp.process_group), fp8_allreduce_hook)  # doctest: +SKIP
"""

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.kernels import fp8_comm_codec as wire

__all__ = ["PROFILER_RANGE", "Fp8AllreduceState", "fp8_allreduce_hook"]

PROFILER_RANGE = "## loka fp8 all-reduce ##"
"""The ``record_function`` range around the hook's collectives: a profile can tell its all-to-all
and all-gather (the dense all-reduce) from the embeddings' all-to-all, whose kernels look the same."""


@dataclasses.dataclass
class Fp8AllreduceState:
    """What :func:`fp8_allreduce_hook` needs besides the bucket.

    Attributes:
        process_group: the ranks that average the gradients: the DDP module's own
            (``ddp.process_group``; a hook is not told it); ``None``: the world.
        block: values per FP8 scale (a multiple of 16; smaller is more accurate, more scale bytes).
        fmt: ``"e4m3"`` (default: 3 mantissa bits, the range comes from the block scales) or ``"e5m2"``.
    """

    process_group: Optional[Any] = None
    block: int = 256
    fmt: str = "e4m3"

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 16 or self.block % 16:
            raise ValueError(f"Fp8AllreduceState.block: expected a multiple of 16, got {self.block!r}")
        if Fp8Format.parse(self.fmt, field="Fp8AllreduceState.fmt") not in wire.SUPPORTED_FORMATS:
            raise ValueError(f"Fp8AllreduceState.fmt: expected e4m3 or e5m2, got {self.fmt!r}")


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group: Any) -> Any:
    """``all_gather_into_tensor`` (``all_gather_single`` where torch has renamed it), asynchronous."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, group=group, async_op=True)


def fp8_allreduce_hook(state: Fp8AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over the ranks, sent in FP8 (module
    docstring). Register with ``ddp.register_comm_hook(Fp8AllreduceState(...), fp8_allreduce_hook)``.

    Both collectives are issued here, on the thread DDP calls the hook on, inside
    :data:`PROFILER_RANGE`: waiting for the all-to-all orders the sum after it on the device (NCCL:
    no host wait) before the all-gather is issued; only the final decode runs when the all-gather
    completes. The annotations are real objects (this module does not postpone them): DDP checks
    that they are ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    n = buffer.numel()
    shard = -(-n // (world * state.block)) * state.block  # values per rank, whole blocks
    values = F.pad(buffer.detach().float(), (0, shard * world - n))
    payload = wire.encode(values, block=state.block, fmt=state.fmt)
    received = torch.empty_like(payload)
    with record_function(PROFILER_RANGE):
        dist.all_to_all_single(received, payload, group=group, async_op=True).wait()
    copies = wire.decode(received, block=state.block, fmt=state.fmt).view(world, shard)
    mine = wire.encode(copies.sum(dim=0).div_(world), block=state.block, fmt=state.fmt)
    gathered = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    with record_function(PROFILER_RANGE):
        gathering = _all_gather(gathered, mine, group).get_future()

    def decode_into_bucket(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        buffer.copy_(wire.decode(gathered, block=state.block, fmt=state.fmt)[:n].view_as(buffer))
        return buffer

    return gathering.then(decode_into_bucket)
