"""Compressed embedding comms for TorchRec: FP8 all-to-all with per-row scales.

Configuration:
    :class:`CommsConfig` -- precision per direction (auto | fp32 | bf16 | fp8) and the FP8 wire
    format; ``"auto"`` (the default) is decided per run by :func:`decide`.

Top level UX:
    :func:`sharders` -- ``EmbeddingBagCollectionSharder`` and ``EmbeddingCollectionSharder`` with
    the codecs (one scale per embedding row), for ``DistributedModelParallel(sharders=...)``;
    :func:`registry` -- the ``qcomm_codecs_registry`` for any TorchRec sharder;
    :func:`sharding_planner` / :func:`estimators` -- a planner whose comm cost counts the real
    bytes, scales included;
    :func:`decide` -- the precision of the ``"auto"`` directions, from a short timing of the
    run's all-to-all (:class:`CommsChoice`, set on the sharders' :class:`CommsSelection`);
    :func:`fp8_allreduce_hook` -- DDP's dense gradient all-reduce in FP8, a communication hook
    (``ddp.register_comm_hook(Fp8AllreduceState(ddp.process_group), fp8_allreduce_hook)``).

Types:
    :class:`Fp8CommCodec`, :class:`Bf16CommCodec`, :class:`Fp32CommCodec` (TorchRec
    ``QuantizedCommCodec`` implementations), :class:`AutoCommCodec` (follows a
    :class:`CommsSelection`), :class:`NonFiniteCounters` (inf/NaN sent and received).

Example::

    >>> from loka_torchrec import comms
    >>> config = comms.CommsConfig(forward="fp8", backward="bf16")
    >>> ebc_sharder, ec_sharder = comms.sharders(config)
"""

import importlib.util

from loka_torchrec.comms.choice import CommsChoice, CommsSelection
from loka_torchrec.comms.config import DEFAULT_BLOCK, CommsConfig
from loka_torchrec.comms.fp8_allreduce import Fp8AllreduceState, fp8_allreduce_hook

# Everything else imports TorchRec. Where TorchRec is missing (e.g. a GPU machine used only for
# the GEMM kernels), reading a config must still work, so those names are then left out.
if importlib.util.find_spec("torchrec") is not None:
    from loka_torchrec.comms.auto import decide
    from loka_torchrec.comms.codec import (
        AutoCommCodec,
        Bf16CommCodec,
        CommCodecContext,
        Fp8CommCodec,
        Fp32CommCodec,
        NonFiniteCounters,
    )
    from loka_torchrec.comms.planner import CommsCostEstimator, bytes_per_value, estimators, sharding_planner
    from loka_torchrec.comms.registry import registry, resolve_block
    from loka_torchrec.comms.sharders import (
        LokaEmbeddingBagCollectionSharder,
        LokaEmbeddingCollectionSharder,
        module_embedding_dims,
        sharders,
    )

__all__ = [
    # configuration
    "CommsConfig",
    "CommsChoice",
    "CommsSelection",
    "DEFAULT_BLOCK",
    # top level UX
    "sharders",
    "registry",
    "estimators",
    "sharding_planner",
    "decide",
    "fp8_allreduce_hook",
    "Fp8AllreduceState",
    # types
    "Fp8CommCodec",
    "Bf16CommCodec",
    "Fp32CommCodec",
    "AutoCommCodec",
    "CommCodecContext",
    "NonFiniteCounters",
    "CommsCostEstimator",
    "LokaEmbeddingBagCollectionSharder",
    "LokaEmbeddingCollectionSharder",
    # helpers
    "bytes_per_value",
    "module_embedding_dims",
    "resolve_block",
]
