"""Planner cost of compressed comms: real bytes per embedding value, scales included.

What TorchRec's planner reads (torchrec 1.6 to 1.9): for each comm op present in the sharder's
``qcomm_codecs_registry``, ``torch.tensor([], dtype=codec.quantized_dtype).element_size()`` for
the forward and the backward codec, nothing else. In 1.8+ this happens once per sharder in
``planner/utils.py::build_sharder_data`` (into ``SharderData.qcomm_dtype_sizes``, a float pair per
op), earlier inside ``shard_estimators.py::_extract_comm_data_type_size`` per option. An FP8
payload with per-block scales is therefore costed at 1 byte per value where it really costs
``1 + scale_bytes / block`` (1.03 for fp32 scales on 128-dim rows).

:class:`CommsCostEstimator` wraps TorchRec's perf estimator and gives it the real number:

* with ``estimate(sharding_options, sharder_data_map)`` (1.8+), it hands the inner estimator a
  copy of the sharder data whose ``qcomm_dtype_sizes`` hold the real bytes per value for each
  option's embedding width: exact within TorchRec's perf model;
* with ``estimate(sharding_options, sharder_map)`` (older), it runs the inner estimator and
  scales each shard's ``fwd_comms`` / ``bwd_comms`` of all-to-all options by real / nominal
  bytes (the compute terms that also read the comm dtype stay at the nominal size).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from functools import reduce
from typing import Any, Dict, List, Optional, Tuple

from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ShardEstimator, ShardingOption, Topology
from torchrec.distributed.types import CommOp, ShardingType

from loka_torchrec.comms.config import CommsConfig
from loka_torchrec.comms.registry import resolve_block
from loka_torchrec.kernels.fp8_comm_codec import record_bytes

__all__ = ["bytes_per_value", "CommsCostEstimator", "estimators", "sharding_planner"]

_A2A_OPS = (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name, CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name)
_RS_OP = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name
# Pooled options of these types send their forward output through a reduce-scatter.
_REDUCE_SCATTER_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


def bytes_per_value(config: CommsConfig, direction: str, embedding_dim: int, *, comm_op: str = _A2A_OPS[0]) -> float:
    """Bytes on the wire per embedding value for one direction of one comm op, scales included.

    Args:
        config: comm precisions.
        direction: ``"forward"`` or ``"backward"``.
        embedding_dim: the embedding width that sets the block when ``block_size == 0``.
        comm_op: a ``CommOp`` name; the reduce-scatter steps fp8 down to bf16.

    An ``"auto"`` direction counts as fp32: the planner runs before the run measures its
    all-to-all, and until then the codecs send fp32.

    Example::

        >>> bytes_per_value(CommsConfig(forward="fp8"), "forward", 128)
        1.03125
        >>> bytes_per_value(CommsConfig(forward="fp8", scale_format="e8m0"), "forward", 128)
        1.0078125
    """
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction: expected 'forward' or 'backward', got {direction!r}")
    precision = getattr(config, direction)
    if precision == "fp8" and comm_op == _RS_OP:
        precision = "bf16"
    if precision in ("fp32", "auto"):
        return 4.0
    if precision == "bf16":
        return 2.0
    block, _ = resolve_block(config, [embedding_dim])
    return record_bytes(block, config.scale_format) / block


def _option_width(option: ShardingOption) -> int:
    """gcd of the option's shard widths (its embedding dim unless sharded column-wise)."""
    widths = [int(shard.size[1]) for shard in option.shards if len(shard.size) == 2] or [int(option.tensor.shape[1])]
    return reduce(math.gcd, widths)


class CommsCostEstimator(ShardEstimator):
    """TorchRec's perf estimator with the comm bytes of a :class:`CommsConfig` (see the module docstring).

    Args:
        config: the comm precisions the sharders use (``loka_torchrec.comms.sharders(config)``).
        topology: the planner's topology.
        constraints: the planner's parameter constraints.
        inner: the estimator to correct; ``EmbeddingPerfEstimator(topology, constraints)`` by default.
    """

    def __init__(
        self,
        config: CommsConfig,
        topology: Topology,
        constraints: Optional[Dict[str, Any]] = None,
        *,
        inner: Optional[ShardEstimator] = None,
    ) -> None:
        self._config = config
        self._topology = topology
        self._constraints = constraints
        self._inner = inner if inner is not None else EmbeddingPerfEstimator(topology=topology, constraints=constraints)

    def _sizes(self, width: int) -> Dict[str, Tuple[float, float]]:
        out = {}
        for op in _A2A_OPS + (_RS_OP,):
            out[op] = (
                bytes_per_value(self._config, "forward", width, comm_op=op),
                bytes_per_value(self._config, "backward", width, comm_op=op),
            )
        return out

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map=None, sharder_map=None, **kwargs: Any) -> None:
        data_map = sharder_data_map if sharder_data_map is not None else sharder_map
        if data_map and all(hasattr(v, "qcomm_dtype_sizes") for v in data_map.values()):
            self._estimate_with_sharder_data(sharding_options, data_map, **kwargs)
        else:
            self._estimate_legacy(sharding_options, data_map, **kwargs)

    def _estimate_with_sharder_data(self, sharding_options, data_map, **kwargs) -> None:
        groups: Dict[Tuple[str, int], List[ShardingOption]] = defaultdict(list)
        for option in sharding_options:
            groups[(option.module_type_key, _option_width(option))].append(option)
        for (key, width), options in groups.items():
            data = data_map.get(key)
            if data is None or not data.qcomm_dtype_sizes:
                self._inner.estimate(options, sharder_data_map=data_map, **kwargs)
                continue
            sizes = {op: size for op, size in self._sizes(width).items() if op in data.qcomm_dtype_sizes}
            corrected = dict(data_map)
            corrected[key] = dataclasses.replace(data, qcomm_dtype_sizes={**data.qcomm_dtype_sizes, **sizes})
            self._inner.estimate(options, sharder_data_map=corrected, **kwargs)

    def _estimate_legacy(self, sharding_options, sharder_map, **kwargs) -> None:
        self._inner.estimate(sharding_options, sharder_map, **kwargs)
        for option in sharding_options:
            sharder = (sharder_map or {}).get(_sharder_key(option))
            if sharder is None or not getattr(sharder, "qcomm_codecs_registry", None):
                continue  # a sharder without codecs sends fp32 as the planner assumes
            if option.is_pooled and option.sharding_type in _REDUCE_SCATTER_TYPES:
                continue  # bf16 on the wire: the nominal dtype size is already right
            op = _A2A_OPS[0] if option.is_pooled else _A2A_OPS[1]
            width = _option_width(option)
            fwd_ratio = bytes_per_value(self._config, "forward", width, comm_op=op) / _nominal(self._config.forward)
            bwd_ratio = bytes_per_value(self._config, "backward", width, comm_op=op) / _nominal(self._config.backward)
            for shard in option.shards:
                if shard.perf is not None:
                    shard.perf = dataclasses.replace(
                        shard.perf, fwd_comms=shard.perf.fwd_comms * fwd_ratio, bwd_comms=shard.perf.bwd_comms * bwd_ratio
                    )


def _sharder_key(option: ShardingOption) -> str:
    key = getattr(option, "module_type_key", None)
    if key:
        return key
    module_type = type(option.module[1])
    return module_type.__module__ + "." + module_type.__name__


def _nominal(precision: str) -> float:
    """Bytes per value the stock planner assumes from ``quantized_dtype`` (uint8 for FP8)."""
    return {"auto": 4.0, "fp32": 4.0, "bf16": 2.0, "fp8": 1.0}[precision]


def estimators(
    config: CommsConfig, topology: Topology, constraints: Optional[Dict[str, Any]] = None
) -> List[ShardEstimator]:
    """``[CommsCostEstimator, EmbeddingStorageEstimator]``, for ``EmbeddingEnumerator(estimator=...)``."""
    return [
        CommsCostEstimator(config, topology, constraints),
        EmbeddingStorageEstimator(topology=topology, constraints=constraints),
    ]


def sharding_planner(
    config: CommsConfig,
    topology: Topology,
    *,
    batch_size: int,
    constraints: Optional[Dict[str, Any]] = None,
    **planner_kwargs: Any,
) -> EmbeddingShardingPlanner:
    """An ``EmbeddingShardingPlanner`` whose perf estimate counts the comm bytes of ``config``.

    Args:
        config: the comm precisions (use the same for ``sharders(config)``).
        topology: the planner's topology.
        batch_size: per-rank batch size.
        constraints: ``{table name: ParameterConstraints}``.
        **planner_kwargs: passed to ``EmbeddingShardingPlanner`` (``proposer``, ``storage_reservation``...).

    Example::

        >>> from torchrec.distributed.planner import Topology
        >>> planner = sharding_planner(
        ...     CommsConfig(forward="fp8"), Topology(world_size=2, compute_device="cpu"), batch_size=64)
    """
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        estimator=estimators(config, topology, constraints),
    )
    return EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size, enumerator=enumerator, constraints=constraints, **planner_kwargs
    )
