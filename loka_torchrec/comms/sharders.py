"""TorchRec sharders whose comm codecs follow each module's embedding rows."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder, QuantizedCommCodecs
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from loka_torchrec.comms.choice import CommsSelection
from loka_torchrec.comms.codec import NonFiniteCounters
from loka_torchrec.comms.config import CommsConfig
from loka_torchrec.comms.registry import registry

__all__ = ["sharders", "module_embedding_dims", "model_embedding_dims", "LokaEmbeddingBagCollectionSharder", "LokaEmbeddingCollectionSharder"]


def module_embedding_dims(module: nn.Module, params: Optional[Dict[str, Any]] = None) -> List[int]:
    """Embedding dims of an ``EmbeddingBagCollection`` / ``EmbeddingCollection`` and the widths of its column shards.

    Args:
        module: the unsharded module.
        params: its ``{table name: ParameterSharding}`` from the plan (column-wise shards are
            narrower than the table).
    """
    configs = []
    for getter in ("embedding_bag_configs", "embedding_configs"):
        if hasattr(module, getter):
            configs = list(getattr(module, getter)())
            break
    dims = [int(cfg.embedding_dim) for cfg in configs]
    for sharding in (params or {}).values():
        spec = getattr(sharding, "sharding_spec", None)
        for shard in getattr(spec, "shards", None) or []:
            if len(shard.shard_sizes) == 2:
                dims.append(int(shard.shard_sizes[1]))
    return dims


def model_embedding_dims(model: nn.Module) -> List[int]:
    """The embedding dim of every table of every ``EmbeddingBagCollection`` / ``EmbeddingCollection`` in ``model``.

    Read from the unsharded model (before ``DistributedModelParallel`` replaces these modules);
    ``"auto"`` comms time an all-to-all of their sum's per-rank share.
    """
    return [d for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)) for d in module_embedding_dims(m)]


class _RowBoundCodecs:
    """Mixin: while ``shard()`` runs, ``qcomm_codecs_registry`` is built for that module's dims.

    The registries built so are kept in ``bound_registries`` (by module fqn) for inspection. With
    an ``"auto"`` direction all of them follow ``comms_selection`` (see
    :class:`~loka_torchrec.comms.codec.AutoCommCodec`).
    """

    _comms_config: CommsConfig
    nonfinite_counters: NonFiniteCounters
    comms_selection: Optional[CommsSelection]
    _bound_registry: Optional[Dict[str, QuantizedCommCodecs]] = None

    def __init__(
        self,
        config: CommsConfig,
        *,
        counters: Optional[NonFiniteCounters] = None,
        selection: Optional[CommsSelection] = None,
        **kwargs: Any,
    ) -> None:
        self._comms_config = config
        self.nonfinite_counters = counters if counters is not None else NonFiniteCounters()
        if config.auto and selection is None:
            selection = CommsSelection()
        self.comms_selection = selection if config.auto else None
        self._bound_registry = None
        self.bound_registries: Dict[str, Dict[str, QuantizedCommCodecs]] = {}
        super().__init__(
            qcomm_codecs_registry=registry(config, counters=self.nonfinite_counters, selection=self.comms_selection),
            **kwargs,
        )

    @property
    def qcomm_codecs_registry(self) -> Optional[Dict[str, QuantizedCommCodecs]]:
        if self._bound_registry is not None:
            return self._bound_registry
        return self._qcomm_codecs_registry  # the dims-agnostic registry (what the planner reads)

    def shard(self, module: nn.Module, params: Dict[str, Any], *args: Any, **kwargs: Any):
        dims = module_embedding_dims(module, params)
        self._bound_registry = registry(
            self._comms_config, embedding_dims=dims or None, counters=self.nonfinite_counters, selection=self.comms_selection
        )
        if self._bound_registry is not None:
            self.bound_registries[str(kwargs.get("module_fqn") or len(self.bound_registries))] = self._bound_registry
        try:
            return super().shard(module, params, *args, **kwargs)
        finally:
            self._bound_registry = None


class LokaEmbeddingBagCollectionSharder(_RowBoundCodecs, EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` with loka comm codecs (one scale per embedding row).

    Args:
        config: comm precisions.
        counters: shared non-finite counters (``self.nonfinite_counters``).
        selection: the choice of the ``"auto"`` directions (``self.comms_selection``); a new one
            when ``None``.
        **kwargs: passed to ``EmbeddingBagCollectionSharder`` (e.g. ``fused_params``).
    """


class LokaEmbeddingCollectionSharder(_RowBoundCodecs, EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` with loka comm codecs (one scale per embedding row); arguments as
    :class:`LokaEmbeddingBagCollectionSharder`."""


_TORCHREC_SHARDERS = {EmbeddingBagCollection: EmbeddingBagCollectionSharder, EmbeddingCollection: EmbeddingCollectionSharder}
"""TorchRec's own sharder of each module type that LoKA's sharders cover."""


def sharders(
    config: CommsConfig,
    *,
    counters: Optional[NonFiniteCounters] = None,
    fused_params: Optional[Dict[str, Any]] = None,
    selection: Optional[CommsSelection] = None,
    extra: Optional[Sequence[ModuleSharder[nn.Module]]] = None,
) -> List[ModuleSharder[nn.Module]]:
    """``[EmbeddingBagCollectionSharder, EmbeddingCollectionSharder]`` with loka comm codecs, then
    the job's other sharders (``extra``).

    At sharding time each module's codecs get the gcd of its embedding dims (and column-shard
    widths) as block when ``config.block_size == 0``: one scale per embedding row. All codecs
    share one :class:`NonFiniteCounters` (``sharder.nonfinite_counters``) and, with an ``"auto"``
    direction, one :class:`~loka_torchrec.comms.choice.CommsSelection` (``sharder.comms_selection``):
    setting a choice on it switches every codec, after ``DistributedModelParallel`` too.

    Args:
        config: comm precisions (all-fp32 gives plain sharders with no codecs).
        counters: the shared counters; a new one when ``None``.
        fused_params: passed to both sharders (TBE options such as the fused optimizer).
        selection: the shared choice of the ``"auto"`` directions; a new one when ``None``.
        extra: the sharders the job gives ``DistributedModelParallel`` otherwise (e.g. TorchRec's
            ``get_default_sharders()``, or its own). Those of other module types are kept, after
            LoKA's. TorchRec's own ``EmbeddingBagCollectionSharder`` / ``EmbeddingCollectionSharder``
            are replaced by LoKA's, which take their ``fused_params`` (unless ``fused_params`` is
            given). Another sharder of those module types (a subclass) cannot carry LoKA's codecs:
            it is refused while a direction is compressed or ``"auto"``, and kept in place of
            LoKA's when both directions are fp32.

    Raises:
        TypeError: ``config`` or an entry of ``extra`` of the wrong type.
        ValueError: an entry of ``extra`` that LoKA's sharder cannot take the place of (named).

    Example::

        >>> ebc_sharder, ec_sharder = sharders(CommsConfig(forward="fp8", backward="bf16"))
        >>> ebc_sharder.nonfinite_counters is ec_sharder.nonfinite_counters
        True
        >>> mine = EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
        >>> [s.fused_params for s in sharders(CommsConfig(forward="fp8"), extra=[mine])]
        [{'learning_rate': 0.1}, None]
    """
    if not isinstance(config, CommsConfig):
        raise TypeError(f"config: expected a CommsConfig, got {type(config).__name__}")
    counters = counters if counters is not None else NonFiniteCounters()
    if config.auto and selection is None:
        selection = CommsSelection()
    kept, replaced = _split_extra(config, list(extra or []))
    own = []
    for cls, module_type in ((LokaEmbeddingBagCollectionSharder, EmbeddingBagCollection), (LokaEmbeddingCollectionSharder, EmbeddingCollection)):
        if any(s.module_type is module_type for s in kept):
            continue  # the job's own sharder of this type stays (both directions fp32)
        params = fused_params if fused_params is not None else getattr(replaced.get(module_type), "fused_params", None)
        kwargs = {"fused_params": params} if params is not None else {}
        own.append(cls(config, counters=counters, selection=selection, **kwargs))
    return own + kept


def _split_extra(
    config: CommsConfig, extra: List[ModuleSharder[nn.Module]]
) -> Tuple[List[ModuleSharder[nn.Module]], Dict[type, ModuleSharder[nn.Module]]]:
    """The job's sharders that stay, and those (by module type) that LoKA's take the place of."""
    kept: List[ModuleSharder[nn.Module]] = []
    replaced: Dict[type, ModuleSharder[nn.Module]] = {}
    for i, sharder in enumerate(extra):
        if not isinstance(sharder, ModuleSharder):
            raise TypeError(f"sharders[{i}]: expected a TorchRec ModuleSharder, got {type(sharder).__name__}")
        module_type = sharder.module_type
        torchrec_cls = _TORCHREC_SHARDERS.get(module_type)
        if torchrec_cls is None:
            kept.append(sharder)
        elif type(sharder) is torchrec_cls or isinstance(sharder, _RowBoundCodecs):
            replaced[module_type] = sharder
        elif config.enabled:
            raise ValueError(
                f"sharders[{i}]: {type(sharder).__name__} shards {module_type.__name__}, whose LoKA sharder carries the "
                f"comm codecs; pass its fused_params as fused_params=... instead, or set comms forward and backward to fp32 to keep it"
            )
        else:
            kept.append(sharder)
    return kept, replaced
