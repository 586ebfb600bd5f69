"""The codec registry a TorchRec sharder takes: ``qcomm_codecs_registry=registry(config)``."""

from __future__ import annotations

import functools
import logging
import math
from functools import reduce
from typing import Dict, Iterable, Optional, Tuple

import torch
from torchrec.distributed.types import CommOp, QuantizedCommCodecs

from loka_torchrec.comms.choice import DIRECTIONS, CommsSelection
from loka_torchrec.comms.codec import AutoCommCodec, Bf16CommCodec, Fp8CommCodec, Fp32CommCodec, NonFiniteCounters
from loka_torchrec.comms.config import DEFAULT_BLOCK, CommsConfig

__all__ = ["registry", "resolve_block", "COMM_OPS"]

logger = logging.getLogger(__name__)

COMM_OPS = (
    CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
    CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
)
# A reduce-scatter sums the payload on the wire: FP8 bytes with per-block scales cannot be
# summed, so this op steps down to bf16.
_SUMMED_ON_WIRE = (CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,)
_warned = set()  # (op, direction): the step-down is logged once per process, not per module


def resolve_block(config: CommsConfig, embedding_dims: Optional[Iterable[int]] = None) -> Tuple[int, str]:
    """Values per scale, and how it was chosen: ``"fixed"``, ``"row"`` or ``"default"``.

    ``block_size > 0`` is used as given. ``block_size == 0`` takes the gcd of ``embedding_dims``
    (one scale per embedding row when all dims are equal), or :data:`DEFAULT_BLOCK` when the
    dims are not known.

    Example::

        >>> resolve_block(CommsConfig(forward="fp8"), [64, 128])
        (64, 'row')
    """
    if config.block_size > 0:
        if embedding_dims is not None:
            bad = sorted({d for d in embedding_dims if d % config.block_size})
            if bad:
                raise ValueError(
                    f"CommsConfig.block_size={config.block_size} does not divide the embedding dims {bad}; "
                    "use a divisor of every dim, or block_size=0 for one scale per embedding row"
                )
        return config.block_size, "fixed"
    if embedding_dims is not None:
        dims = [int(d) for d in embedding_dims]
        if any(d <= 0 for d in dims):
            raise ValueError(f"embedding_dims: expected positive dims, got {dims}")
        if dims:
            return reduce(math.gcd, dims), "row"
    return DEFAULT_BLOCK, "default"


def registry(
    config: CommsConfig,
    *,
    embedding_dims: Optional[Iterable[int]] = None,
    counters: Optional[NonFiniteCounters] = None,
    selection: Optional[CommsSelection] = None,
) -> Optional[Dict[str, QuantizedCommCodecs]]:
    """Codecs for TorchRec's embedding collectives, keyed by ``CommOp`` name; ``None`` when both directions are fp32.

    Covers ``POOLED_EMBEDDINGS_ALL_TO_ALL`` and ``SEQUENCE_EMBEDDINGS_ALL_TO_ALL`` at the
    configured precisions, and ``POOLED_EMBEDDINGS_REDUCE_SCATTER`` with fp8 stepped down to bf16
    (logged as a warning). With an ``"auto"`` direction every codec is an
    :class:`~loka_torchrec.comms.codec.AutoCommCodec` reading ``selection``: fp32 until a choice
    is set on it, then the codecs of ``config`` with the chosen precisions.

    Args:
        config: precisions and FP8 wire format.
        embedding_dims: the embedding dims (or column-shard widths) that travel through these
            codecs; with ``block_size=0`` the block is their gcd. Without them the block is
            :data:`DEFAULT_BLOCK` values (logged); :func:`loka_torchrec.comms.sharders` fills them
            per module at sharding time.
        counters: shared counters of non-finite values; a new one when ``None`` (reachable as
            ``codec.counters`` on the bf16 and fp8 codecs).
        selection: the choice the ``"auto"`` codecs follow (share one per run); a new one when
            ``None`` (reachable as ``codec.selection``).

    Example::

        >>> reg = registry(CommsConfig(forward="fp8", backward="bf16"), embedding_dims=[128])
        >>> reg["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward
        Fp8CommCodec(pooled_embeddings_all_to_all/forward: e4m3, block=128 (row), scale=fp32, 1.0312 bytes/value, kernel=...)
        >>> registry(CommsConfig(forward="fp32", backward="fp32")) is None
        True
        >>> registry(CommsConfig())["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward  # "auto": fp32 until decided
        AutoCommCodec(pooled_embeddings_all_to_all/forward, undecided: Fp32CommCodec(pooled_embeddings_all_to_all/forward))
    """
    if not isinstance(config, CommsConfig):
        raise TypeError(f"config: expected a CommsConfig, got {type(config).__name__}")
    if not config.enabled:
        return None
    block, source = resolve_block(config, embedding_dims)
    if source == "default" and "fp8" in (config.forward, config.backward):
        logger.info(
            "loka comms: embedding dims unknown, FP8 uses one scale per %d values; pass embedding_dims= "
            "or use loka_torchrec.comms.sharders() for one scale per embedding row",
            block,
        )
    counters = counters if counters is not None else NonFiniteCounters()
    if config.auto and selection is None:
        selection = CommsSelection()
    out: Dict[str, QuantizedCommCodecs] = {}
    for op in COMM_OPS:
        codecs = {}
        for direction in DIRECTIONS:
            build = functools.partial(_codec, op, direction, block=block, source=source, counters=counters)
            if config.auto:
                codecs[direction] = AutoCommCodec(
                    name=f"{op.value}/{direction}", config=config, selection=selection, build=build
                )
            else:
                codecs[direction] = build(config)
        out[op.name] = QuantizedCommCodecs(forward=codecs["forward"], backward=codecs["backward"])
    return out


def _codec(op: CommOp, direction: str, config: CommsConfig, *, block: int, source: str, counters: NonFiniteCounters):
    """The codec of ``op``'s ``direction`` for a config with fixed precisions."""
    precision = getattr(config, direction)
    name = f"{op.value}/{direction}"
    if precision == "fp8" and op in _SUMMED_ON_WIRE:
        if (op, direction) not in _warned:
            _warned.add((op, direction))
            logger.warning(
                "loka comms: %s sums its payload on the wire, which FP8 with per-block scales cannot do; "
                "its %s pass uses bf16 instead of fp8",
                op.name,
                direction,
            )
        precision = "bf16"
    if precision == "fp8":
        # TorchRec's sync collectives send the gradient back in the forward payload's dtype: at
        # least as precise as the backward precision.
        sync_carrier = torch.float32 if config.backward == "fp32" else torch.bfloat16
        fmt = config.forward_format if direction == "forward" else config.backward_format
        return Fp8CommCodec(
            fmt, block=block, scale_format=config.scale_format, kernel=config.kernel,
            name=name, counters=counters, block_source=source, sync_carrier=sync_carrier,
        )  # fmt: skip
    if precision == "bf16":
        return Bf16CommCodec(name=name, counters=counters)
    return Fp32CommCodec(name=name)
