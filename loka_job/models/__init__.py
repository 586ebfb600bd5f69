"""Model builders by name: ``dlrm`` and ``dcn`` (TorchRec's own), ``dhen``, ``hstu``, ``wukong``,
``interformer`` and ``dcnv2``.

Every model maps ``(dense_features (B, num_dense), sparse_features KeyedJaggedTensor)`` to click
logits of shape ``(B,)``. Builders take the model's section of the recipe (a plain dict), the
:class:`~loka_job.training.data_spec.DataSpec` and the dense device; embedding tables are
built on ``meta`` and materialized by ``DistributedModelParallel``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
from torch import nn

from loka_job.training.data_spec import DataSpec

__all__ = ["MODEL_NAMES", "build_model", "register_model"]

_BUILDERS: Dict[str, Callable[[Dict[str, Any], DataSpec, torch.device], nn.Module]] = {}


def register_model(name: str):
    """Decorator: register a builder ``fn(options: dict, spec: DataSpec, device) -> nn.Module``."""

    def wrap(fn):
        if name in _BUILDERS:
            raise ValueError(f"a model named {name!r} is already registered")
        _BUILDERS[name] = fn
        return fn

    return wrap


def build_model(name: str, options: Dict[str, Any], spec: DataSpec, device: torch.device) -> nn.Module:
    """Build the model ``name``; an unknown name raises a ``ValueError`` listing the known ones."""
    if name not in _BUILDERS:
        raise ValueError(f"model.name: unknown model {name!r}; expected one of {', '.join(sorted(_BUILDERS))}")
    return _BUILDERS[name](dict(options), spec, device)


def MODEL_NAMES() -> List[str]:  # noqa: N802  (reads like a constant at call sites)
    return sorted(_BUILDERS)


def _pooled_ebc(spec: DataSpec):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = spec.pooled_tables
    if not tables:
        raise ValueError("data: this model needs pooled (non-sequence) sparse features")
    dims = {t.embedding_dim for t in tables}
    if len(dims) != 1:
        raise ValueError(f"data.embedding_dim: DLRM-style models need one embedding dim for all tables, got {sorted(dims)}")
    configs = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings, feature_names=[t.feature])
        for t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


class _SqueezeLogits(nn.Module):
    """TorchRec's DLRM returns ``(B, 1)``; the project's models return ``(B,)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        return self.model(dense_features, sparse_features).squeeze(-1)


def _check_over_arch(options: Dict[str, Any]) -> List[int]:
    over = list(options.get("over_arch_layer_sizes", []))
    if len(over) < 2 or over[-1] != 1:
        raise ValueError(f"model.over_arch_layer_sizes: need at least two layers ending in 1, got {over}")
    return over


_DLRM_OPTIONS = ("dense_arch_layer_sizes", "over_arch_layer_sizes")


def _check_options(options: Dict[str, Any], spec: DataSpec, model: str, known) -> None:
    """Unknown ``model.*`` options, or an ``embedding_dim`` other than the tables', are one error
    naming the field (as the DHEN and HSTU configs do), never silently ignored."""
    options = dict(options)
    if "embedding_dim" in options:
        _model_embedding_dim(options, spec.pooled_tables, model, "pooled")
        options.pop("embedding_dim")
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"model: unknown option(s) {unknown} for the {model} model; expected some of {sorted(known)}")


@register_model("dlrm")
def build_dlrm(options: Dict[str, Any], spec: DataSpec, device: torch.device) -> nn.Module:
    """TorchRec's ``DLRM``: ``dense_arch_layer_sizes`` (last = embedding dim), ``over_arch_layer_sizes``."""
    from torchrec.models.dlrm import DLRM

    ebc = _pooled_ebc(spec)
    _check_options(options, spec, "dlrm", _DLRM_OPTIONS)
    dense = list(options.get("dense_arch_layer_sizes", []))
    dim = spec.pooled_tables[0].embedding_dim
    if not dense or dense[-1] != dim:
        raise ValueError(f"model.dense_arch_layer_sizes: the last size must equal the embedding dim {dim}, got {dense}")
    return _SqueezeLogits(DLRM(ebc, spec.num_dense, dense, _check_over_arch(options), dense_device=device))


@register_model("dcn")
def build_dcn(options: Dict[str, Any], spec: DataSpec, device: torch.device) -> nn.Module:
    """TorchRec's ``DLRM_DCN`` (a low-rank DCN v2 interaction): adds ``dcn_num_layers``, ``dcn_low_rank_dim``."""
    from torchrec.models.dlrm import DLRM_DCN

    ebc = _pooled_ebc(spec)
    _check_options(options, spec, "dcn", _DLRM_OPTIONS + ("dcn_num_layers", "dcn_low_rank_dim"))
    dense = list(options.get("dense_arch_layer_sizes", []))
    dim = spec.pooled_tables[0].embedding_dim
    if not dense or dense[-1] != dim:
        raise ValueError(f"model.dense_arch_layer_sizes: the last size must equal the embedding dim {dim}, got {dense}")
    return _SqueezeLogits(
        DLRM_DCN(
            ebc,
            spec.num_dense,
            dense,
            _check_over_arch(options),
            dcn_num_layers=int(options.get("dcn_num_layers", 2)),
            dcn_low_rank_dim=int(options.get("dcn_low_rank_dim", 16)),
            dense_device=device,
        )
    )


def _model_error(exc: Exception, config_name: str) -> ValueError:
    """``DhenConfig.x must ...`` -> ``model.x must ...``: name the recipe field the user typed."""
    return ValueError(str(exc).replace(f"{config_name}.", "model."))


def _model_embedding_dim(options: Dict[str, Any], tables, model: str, kind: str) -> None:
    """Fill ``options["embedding_dim"]`` from the data, or check that the two agree.

    The model stacks (DHEN) or sums and scores (HSTU) the embeddings, so its width must be the
    tables' width. The recipes set ``model.embedding_dim: ${data.embedding_dim}``; a user who
    overrides only one of the two gets this error rather than a shape mismatch in the forward.
    """
    dims = sorted({t.embedding_dim for t in tables})
    if len(dims) != 1:
        raise ValueError(f"data.embedding_dim: the {model} model needs one embedding dim for all {kind} tables, got {dims}")
    dim = options.setdefault("embedding_dim", dims[0])
    if isinstance(dim, bool) or not isinstance(dim, int) or dim != dims[0]:
        raise ValueError(
            f"model.embedding_dim: {dim!r} disagrees with data.embedding_dim ({dims[0]}); the {model} model's width "
            f"is its tables' width: set `data.embedding_dim={dim}` instead (the recipes make model.embedding_dim "
            f"follow it)"
        )


@register_model("dhen")
def build_dhen_model(options: Dict[str, Any], spec: DataSpec, device: torch.device) -> nn.Module:
    """The DHEN-style model (:mod:`loka_job.models.dhen`) on pooled data.

    ``options`` are :class:`~loka_job.models.dhen.DhenConfig` fields (plus an optional
    ``preset``: ``small``/``large``/``xl`` for the fields not given); ``embedding_dim`` defaults to, and
    must equal, ``data.embedding_dim``. Needs ``data.kind=pooled``.
    """
    from loka_job.models.dhen import DhenConfig, build_dhen

    return _build_from_config(options, spec, device, "dhen", "pooled", "pooled sparse features", DhenConfig, build_dhen)


@register_model("hstu")
def build_hstu_model(options: Dict[str, Any], spec: DataSpec, device: torch.device) -> nn.Module:
    """The HSTU-style model (:mod:`loka_job.models.hstu`) on sequence data.

    ``options`` are :class:`~loka_job.models.hstu.HstuConfig` fields (plus an optional
    ``preset``); ``embedding_dim`` defaults to, and must equal, ``data.embedding_dim``. Needs
    ``data.kind=sequence``; the longest history (``data.max_seq_len``) sets the attention length.
    """
    from loka_job.models.hstu import HstuConfig, build_hstu

    return _build_from_config(options, spec, device, "hstu", "sequence", "sequence data", HstuConfig, build_hstu)


@register_model("wukong")
def build_wukong_model(options: Dict[str, Any], spec: DataSpec, device: torch.device) -> nn.Module:
    """The Wukong-style model (:mod:`loka_job.models.wukong`) on pooled data.

    ``options`` are :class:`~loka_job.models.wukong.WukongConfig` fields (plus an optional
    ``preset``: ``small``/``large``/``xl``); ``embedding_dim`` defaults to, and must equal,
    ``data.embedding_dim``. Needs ``data.kind=pooled``.
    """
    from loka_job.models.wukong import WukongConfig, build_wukong

    return _build_from_config(options, spec, device, "wukong", "pooled", "pooled sparse features", WukongConfig, build_wukong)


@register_model("interformer")
def build_interformer_model(options: Dict[str, Any], spec: DataSpec, device: torch.device) -> nn.Module:
    """The Interformer-style model (:mod:`loka_job.models.interformer`) on sequence data.

    ``options`` are :class:`~loka_job.models.interformer.InterformerConfig` fields (plus an
    optional ``preset``); ``embedding_dim`` defaults to, and must equal, ``data.embedding_dim``.
    Needs ``data.kind=sequence``; its pooled context features (``data.num_context_features``)
    are non-sequence tokens beside the candidate and the dense features.
    """
    from loka_job.models.interformer import InterformerConfig, build_interformer

    return _build_from_config(
        options, spec, device, "interformer", "sequence", "sequence data", InterformerConfig, build_interformer
    )


@register_model("dcnv2")
def build_dcn_v2_model(options: Dict[str, Any], spec: DataSpec, device: torch.device) -> nn.Module:
    """DCN-V2 (:mod:`loka_job.models.dcn_v2`) on pooled data.

    ``options`` are :class:`~loka_job.models.dcn_v2.DcnV2Config` fields (plus an optional
    ``preset``: ``small``/``large``/``xl``); ``embedding_dim`` defaults to, and must equal,
    ``data.embedding_dim``. Needs ``data.kind=pooled``.
    """
    from loka_job.models.dcn_v2 import DcnV2Config, build_dcn_v2

    return _build_from_config(options, spec, device, "dcnv2", "pooled", "pooled sparse features", DcnV2Config, build_dcn_v2)


def _build_from_config(options, spec, device, model: str, kind: str, needs: str, config_cls, build) -> nn.Module:
    """``build(config_cls.from_options(options), spec, device)`` for a model of ``kind`` data
    (``"pooled"`` or ``"sequence"``; ``needs`` says it in words), errors named after the recipe's fields."""
    tables = spec.pooled_tables if kind == "pooled" else spec.sequence_tables
    if not tables:
        other = "sequence" if kind == "pooled" else "pooled"
        raise ValueError(
            f"model.name: the {model} model needs {needs} (data.kind={kind}; select it with `data={kind}`), "
            f"but the data has only {other} features"
        )
    _model_embedding_dim(options, tables, model, kind)
    try:
        return build(config_cls.from_options(options), spec, device)
    except (TypeError, ValueError) as exc:
        raise _model_error(exc, config_cls.__name__) from exc
