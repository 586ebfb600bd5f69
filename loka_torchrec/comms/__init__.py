"""Compressed embedding comms for TorchRec: FP8 all-to-all with per-row scales.

Configuration:
    :class:`CommsConfig` -- precision per direction (fp32 | bf16 | fp8) and the FP8 wire format.

Top level UX:
    :func:`sharders` -- ``EmbeddingBagCollectionSharder`` and ``EmbeddingCollectionSharder`` with
    the codecs (one scale per embedding row), for ``DistributedModelParallel(sharders=...)``;
    :func:`registry` -- the ``qcomm_codecs_registry`` for any TorchRec sharder;
    :func:`sharding_planner` / :func:`estimators` -- a planner whose comm cost counts the real
    bytes, scales included.

Types:
    :class:`Fp8CommCodec`, :class:`Bf16CommCodec`, :class:`Fp32CommCodec` (TorchRec
    ``QuantizedCommCodec`` implementations), :class:`NonFiniteCounters` (inf/NaN sent and received).

Example::

    >>> from loka_torchrec import comms
    >>> config = comms.CommsConfig(forward="fp8", backward="bf16")
    >>> ebc_sharder, ec_sharder = comms.sharders(config)
"""

from loka_torchrec.comms.config import DEFAULT_BLOCK, CommsConfig

# Everything else imports TorchRec: load it on first use, so that reading a config (and importing
# loka_torchrec on a machine without TorchRec, e.g. for the GEMM kernels alone) stays cheap.
_LAZY = {
    "Bf16CommCodec": "codec",
    "CommCodecContext": "codec",
    "Fp8CommCodec": "codec",
    "Fp32CommCodec": "codec",
    "NonFiniteCounters": "codec",
    "CommsCostEstimator": "planner",
    "bytes_per_value": "planner",
    "estimators": "planner",
    "sharding_planner": "planner",
    "registry": "registry",
    "resolve_block": "registry",
    "LokaEmbeddingBagCollectionSharder": "sharders",
    "LokaEmbeddingCollectionSharder": "sharders",
    "module_embedding_dims": "sharders",
    "sharders": "sharders",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"loka_torchrec.comms.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # configuration
    "CommsConfig",
    "DEFAULT_BLOCK",
    # top level UX
    "sharders",
    "registry",
    "estimators",
    "sharding_planner",
    # types
    "Fp8CommCodec",
    "Bf16CommCodec",
    "Fp32CommCodec",
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
