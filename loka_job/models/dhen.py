"""A DHEN-style model: a stack of ensembles of feature-interaction modules over pooled embeddings.

Each layer maps the stack ``X`` of ``m`` feature embeddings (``(B, m, d)``) to
``Y = Norm(Ensemble_i Interaction_i(X) + X)``, after "DHEN: A Deep and Hierarchical Ensemble
Network for Large-Scale Click-Through Rate Prediction" (arXiv 2203.11014). The ``m`` tokens are
the pooled embedding of every sparse feature (a TorchRec ``EmbeddingBagCollection``) plus the
dense features projected to ``d`` by an MLP, as one more token (first). An MLP head over the
flattened last ``Y`` gives the logit.

Interaction modules (each maps ``(B, m, d)`` to ``l`` tokens, ``(B, l, d)``):

* ``"dot"``: DLRM's pairwise dot products ``<x_i, x_j>`` (``i < j``), then an MLP to ``l * d``;
* ``"self_attention"``: multi-head softmax attention among the ``m`` tokens, then a linear map of
  the flattened result to ``l * d``;
* ``"cross"``: a low-rank DCN-v2 cross ``x_1 = x_0 * (U (V x_0)) + x_0`` on the flattened stack
  ``x_0`` (width ``m * d``), then a linear map to ``l * d``;
* ``"linear"``: a linear map of the flattened stack to ``l * d``.

Ensembles: ``"sum"`` (every module gives ``l = m`` tokens; their outputs are added) or
``"concat"`` (the ``m`` output tokens are split among the modules, as evenly as possible, and
concatenated). Either way the layer keeps ``m`` tokens, so the shortcut is the identity and
``Norm`` is a per-token ``LayerNorm(d)``.

What the mods see: the linear maps that read the flattened stack first (``cross``'s ``V`` and
``linear``'s map) are one :class:`~loka_torchrec.mods.SiblingLinears` per layer (``entry``), and
self-attention's ``q, k, v`` another; the norms are ``nn.LayerNorm`` (the head's are inside
TorchRec's ``SwishLayerNorm``); activations are ``nn.SiLU`` modules; the last layer is marked as
the prediction layer. Every GEMM is an ``nn.Linear``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from loka_torchrec.mods.no_bias import mark_prediction_layer
from loka_torchrec.mods.siblings import SiblingLinears
from loka_job.models.options import config_from_options, int_tuple, pooled_token_tables, positive_int
from loka_job.training.data_spec import DataSpec

__all__ = ["INTERACTIONS", "ENSEMBLES", "DhenConfig", "DhenLayer", "DhenOverArch", "Dhen", "build_dhen", "token_split"]

INTERACTIONS: Tuple[str, ...] = ("dot", "self_attention", "cross", "linear")
ENSEMBLES: Tuple[str, ...] = ("concat", "sum")


@dataclasses.dataclass(frozen=True)
class DhenConfig:
    """Every size of the DHEN-style model.

    Attributes:
        embedding_dim: ``d``, width of every feature embedding (must equal the tables'
            ``embedding_dim`` in the :class:`DataSpec`).
        num_layers: stacked DHEN layers.
        interactions: the ensemble's modules, a subset of :data:`INTERACTIONS` in any order.
        ensemble: ``"concat"`` or ``"sum"``.
        dense_hidden: hidden widths of the dense MLP (its output is ``d``).
        dot_hidden: hidden width of the MLP after the dot products.
        attention_heads: heads of self-attention (must divide ``d``).
        cross_rank: rank of the low-rank cross.
        head_hidden: hidden widths of the prediction MLP (each followed by ``SwishLayerNorm``).

    Example::

        >>> DhenConfig.small().embedding_dim, DhenConfig.large().embedding_dim, DhenConfig.xl().cross_rank
        (32, 256, 1024)
        >>> DhenConfig.from_options({"preset": "small", "num_layers": 3}).num_layers
        3
    """

    embedding_dim: int = 32
    num_layers: int = 2
    interactions: Tuple[str, ...] = INTERACTIONS
    ensemble: str = "concat"
    dense_hidden: Tuple[int, ...] = (64,)
    dot_hidden: int = 64
    attention_heads: int = 2
    cross_rank: int = 32
    head_hidden: Tuple[int, ...] = (128, 32)

    def __post_init__(self) -> None:
        for field in ("embedding_dim", "num_layers", "dot_hidden", "attention_heads", "cross_rank"):
            positive_int(getattr(self, field), field, "DhenConfig")
        object.__setattr__(self, "dense_hidden", int_tuple(self.dense_hidden, "dense_hidden", "DhenConfig"))
        object.__setattr__(self, "head_hidden", int_tuple(self.head_hidden, "head_hidden", "DhenConfig"))
        if isinstance(self.interactions, str):
            raise TypeError("DhenConfig.interactions must be a sequence of names, got a string")
        interactions = tuple(self.interactions)
        unknown = [i for i in interactions if i not in INTERACTIONS]
        if not interactions or unknown or len(set(interactions)) != len(interactions):
            raise ValueError(
                f"DhenConfig.interactions must be distinct names from {INTERACTIONS}, got {interactions}"
            )
        object.__setattr__(self, "interactions", interactions)
        if self.ensemble not in ENSEMBLES:
            raise ValueError(f"DhenConfig.ensemble must be one of {ENSEMBLES}, got {self.ensemble!r}")
        if self.embedding_dim % self.attention_heads:
            raise ValueError(
                f"DhenConfig.attention_heads ({self.attention_heads}) must divide embedding_dim ({self.embedding_dim})"
            )

    @classmethod
    def small(cls) -> "DhenConfig":
        """CPU-sized: d = 32, two layers; a few dozen steps of batch 256 take seconds."""
        return cls()

    @classmethod
    def large(cls) -> "DhenConfig":
        """GPU-sized, LRM-shaped GEMMs: d = 256; with 7 pooled features (m = 8 tokens) the stack is
        2048 wide, so the GEMMs have K, N in {256, 512, 768, 1024, 2048}."""
        return cls(
            embedding_dim=256,
            num_layers=3,
            dense_hidden=(512,),
            dot_hidden=512,
            attention_heads=4,
            cross_rank=512,
            head_hidden=(1024, 256),
        )

    @classmethod
    def xl(cls) -> "DhenConfig":
        """GPU-sized, dense GEMMs dominating the step: d = 256; with 63 pooled features plus the dense
        token (m = 64 tokens) the stack is 16384 wide. Each layer's widest GEMMs read or write the
        whole stack (the fused ``entry`` 16384 -> 1024 + 4096, the cross's 1024 -> 16384, the
        attention and cross outputs 16384 -> 4096), the head is 16384 -> 4096 -> 1024, the dot MLP
        2016 -> 1024 -> 4096. About 0.8 B dense parameters (``recipes/model/dhen_xl.yaml`` sizes
        its memory on one GPU)."""
        return cls(
            embedding_dim=256,
            num_layers=3,
            dense_hidden=(512,),
            dot_hidden=1024,
            attention_heads=4,
            cross_rank=1024,
            head_hidden=(4096, 1024),
        )

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> "DhenConfig":
        """From a plain mapping: ``preset`` (``"small"``/``"large"``/``"xl"``, default small) plus overrides."""
        return config_from_options(cls, options, "DHEN")


def token_split(num_tokens: int, parts: int) -> Tuple[int, ...]:
    """Split ``num_tokens`` output tokens among ``parts`` modules as evenly as possible (first ones get more).

    Example::

        >>> token_split(5, 4)
        (2, 1, 1, 1)
    """
    if parts > num_tokens:
        raise ValueError(
            f"DhenConfig.ensemble='concat' needs at least one output token per interaction module: "
            f"{parts} modules but only {num_tokens} tokens (features + dense); use ensemble='sum' "
            f"or fewer interactions"
        )
    base, extra = divmod(num_tokens, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


class _DotInteraction(nn.Module):
    """``<x_i, x_j>`` for ``i < j`` -> MLP -> ``(B, l, d)``."""

    entry_width: Optional[int] = None

    def __init__(self, num_tokens: int, dim: int, hidden: int, out_tokens: int, device: torch.device) -> None:
        super().__init__()
        if num_tokens < 2:
            raise ValueError(f"the 'dot' interaction needs at least 2 tokens, got {num_tokens}")
        rows, cols = torch.triu_indices(num_tokens, num_tokens, offset=1)
        self.register_buffer("pair_rows", rows.to(device), persistent=False)
        self.register_buffer("pair_cols", cols.to(device), persistent=False)
        self.out_tokens, self.dim = out_tokens, dim
        pairs = num_tokens * (num_tokens - 1) // 2
        self.mlp = nn.Sequential(
            nn.Linear(pairs, hidden, device=device), nn.SiLU(), nn.Linear(hidden, out_tokens * dim, device=device)
        )

    def forward(self, x: torch.Tensor, entry: Optional[torch.Tensor]) -> torch.Tensor:
        gram = torch.bmm(x, x.transpose(1, 2))  # (B, m, m)
        pairs = gram[:, self.pair_rows, self.pair_cols]  # (B, m (m - 1) / 2)
        return self.mlp(pairs).view(x.shape[0], self.out_tokens, self.dim)


class _SelfAttentionInteraction(nn.Module):
    """Multi-head softmax attention among the tokens, then a linear map of the flattened result."""

    entry_width: Optional[int] = None

    def __init__(self, num_tokens: int, dim: int, heads: int, out_tokens: int, device: torch.device) -> None:
        super().__init__()
        self.heads, self.dim, self.out_tokens = heads, dim, out_tokens
        self.qkv = SiblingLinears(dim, [("q", dim), ("k", dim), ("v", dim)], device=device)
        self.out = nn.Linear(num_tokens * dim, out_tokens * dim, device=device)

    def forward(self, x: torch.Tensor, entry: Optional[torch.Tensor]) -> torch.Tensor:
        batch, tokens, dim = x.shape
        head_dim = dim // self.heads
        q, k, v = (t.reshape(batch, tokens, self.heads, head_dim).transpose(1, 2) for t in self.qkv(x))
        weights = torch.softmax(q @ k.transpose(-1, -2) * head_dim**-0.5, dim=-1)  # (B, H, m, m)
        mixed = (weights @ v).transpose(1, 2).reshape(batch, tokens * dim)
        return self.out(mixed).view(batch, self.out_tokens, self.dim)


class _CrossInteraction(nn.Module):
    """Low-rank DCN-v2 cross on the flattened stack: ``x0 * U(V x0) + x0``, then a linear map."""

    def __init__(self, num_tokens: int, dim: int, rank: int, out_tokens: int, device: torch.device) -> None:
        super().__init__()
        self.entry_width = rank  # V x0, computed by the layer's `entry` sibling group
        self.dim, self.out_tokens = dim, out_tokens
        self.up = nn.Linear(rank, num_tokens * dim, device=device)
        self.out = nn.Linear(num_tokens * dim, out_tokens * dim, device=device)

    def forward(self, x: torch.Tensor, entry: Optional[torch.Tensor]) -> torch.Tensor:
        x0 = x.reshape(x.shape[0], -1)
        crossed = x0 * self.up(entry) + x0
        return self.out(crossed).view(x.shape[0], self.out_tokens, self.dim)


class _LinearInteraction(nn.Module):
    """A linear map of the flattened stack (the map itself lives in the layer's `entry` group)."""

    def __init__(self, num_tokens: int, dim: int, out_tokens: int) -> None:
        super().__init__()
        self.entry_width = out_tokens * dim
        self.dim, self.out_tokens = dim, out_tokens

    def forward(self, x: torch.Tensor, entry: Optional[torch.Tensor]) -> torch.Tensor:
        return entry.view(x.shape[0], self.out_tokens, self.dim)


class DhenLayer(nn.Module):
    """One DHEN layer ``(B, m, d) -> (B, m, d)``: ``LayerNorm(Ensemble_i Interaction_i(X) + X)``.

    The modules' first linear maps of the flattened stack (``cross``'s ``V``, ``linear``'s map)
    are held here, in the sibling group ``entry`` (members named after the modules), so that
    ``fuse_siblings`` can run them as one GEMM.

    Args:
        num_tokens: ``m``.
        config: sizes.
        device: for the parameters.

    Example::

        >>> layer = DhenLayer(5, DhenConfig.small())
        >>> layer(torch.randn(3, 5, 32)).shape
        torch.Size([3, 5, 32])
    """

    def __init__(self, num_tokens: int, config: DhenConfig, device: Optional[torch.device] = None) -> None:
        super().__init__()
        device = torch.device("cpu") if device is None else device
        d, n = config.embedding_dim, len(config.interactions)
        out_tokens = token_split(num_tokens, n) if config.ensemble == "concat" else (num_tokens,) * n
        self.ensemble = config.ensemble
        modules: Dict[str, nn.Module] = {}
        for name, tokens in zip(config.interactions, out_tokens):
            if name == "dot":
                modules[name] = _DotInteraction(num_tokens, d, config.dot_hidden, tokens, device)
            elif name == "self_attention":
                modules[name] = _SelfAttentionInteraction(num_tokens, d, config.attention_heads, tokens, device)
            elif name == "cross":
                modules[name] = _CrossInteraction(num_tokens, d, config.cross_rank, tokens, device)
            else:
                modules[name] = _LinearInteraction(num_tokens, d, tokens)
        self.interactions = nn.ModuleDict(modules)
        entry = [(name, m.entry_width) for name, m in modules.items() if m.entry_width is not None]
        self.entry = SiblingLinears(num_tokens * d, entry, device=device) if entry else None
        self.norm = nn.LayerNorm(d, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, m, d)`` -> ``(B, m, d)``."""
        entries: Dict[str, torch.Tensor] = {}
        if self.entry is not None:
            entries = dict(zip(self.entry.names, self.entry(x.reshape(x.shape[0], -1))))
        outputs = [module(x, entries.get(name)) for name, module in self.interactions.items()]
        if self.ensemble == "concat":
            mixed = torch.cat(outputs, dim=1)
        else:
            mixed = torch.stack(outputs, dim=0).sum(dim=0)
        return self.norm(mixed + x)


def _mlp(widths: Sequence[int], device: torch.device) -> List[nn.Module]:
    layers: List[nn.Module] = []
    for i, (k, n) in enumerate(zip(widths[:-1], widths[1:])):
        if i:
            layers.append(nn.SiLU())
        layers.append(nn.Linear(k, n, device=device))
    return layers


class DhenOverArch(nn.Module):
    """Everything after the embedding lookup: dense MLP, DHEN layers, head.

    ``(dense (B, num_dense), pooled KeyedTensor) -> logits (B,)``. It is its own module so that
    the model's top-level ``forward`` is only "look up, then this", which TorchRec's train
    pipelines trace with ``torch.fx`` (a module without sharded tables inside is a leaf there).

    Args:
        feature_names: the pooled features, in token order.
        num_dense: dense features per sample (0: no dense token).
        config: sizes.
        device: for the parameters.
    """

    def __init__(
        self,
        feature_names: Sequence[str],
        num_dense: int,
        config: DhenConfig,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        from torchrec.modules.activation import SwishLayerNorm

        device = torch.device("cpu") if device is None else device
        d = config.embedding_dim
        self.num_dense = num_dense
        self.feature_names: Tuple[str, ...] = tuple(feature_names)
        self.dense_arch = (
            nn.Sequential(*_mlp((num_dense,) + config.dense_hidden + (d,), device)) if num_dense else None
        )
        self.num_tokens = len(self.feature_names) + (1 if num_dense else 0)
        self.layers = nn.ModuleList([DhenLayer(self.num_tokens, config, device) for _ in range(config.num_layers)])
        head: List[nn.Module] = []
        width = self.num_tokens * d
        for hidden in config.head_hidden:
            head += [nn.Linear(width, hidden, device=device), SwishLayerNorm(hidden, device=device)]
            width = hidden
        head.append(mark_prediction_layer(nn.Linear(width, 1, device=device)))
        self.head = nn.Sequential(*head)

    def forward(self, dense_features: torch.Tensor, pooled) -> torch.Tensor:
        """``dense_features (B, num_dense)`` and the ``KeyedTensor`` of pooled embeddings -> ``(B,)``."""
        if dense_features.dim() != 2 or dense_features.shape[1] != self.num_dense:
            raise ValueError(f"dense_features must be (B, {self.num_dense}), got {tuple(dense_features.shape)}")
        embeddings = pooled.to_dict()
        tokens = [embeddings[name] for name in self.feature_names]
        if self.dense_arch is not None:
            tokens.insert(0, self.dense_arch(dense_features))
        x = torch.stack(tokens, dim=1)  # (B, m, d)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.reshape(x.shape[0], -1)).squeeze(-1)


class Dhen(nn.Module):
    """The DHEN-style click model: ``(dense (B, num_dense), sparse KJT) -> logits (B,)``.

    Args:
        embedding_bag_collection: pooled tables, all ``config.embedding_dim`` wide.
        feature_names: the pooled features, in token order.
        num_dense: dense features per sample (0: no dense token).
        config: sizes.
        device: for the dense parameters.

    Build it with :func:`build_dhen`.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        feature_names: Sequence[str],
        num_dense: int,
        config: DhenConfig,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embedding_bag_collection = embedding_bag_collection
        self.over_arch = DhenOverArch(feature_names, num_dense, config, device)

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        """Click logits.

        Args:
            dense_features: ``(B, num_dense)`` float.
            sparse_features: ``KeyedJaggedTensor`` with (at least) the pooled features.

        Returns:
            ``(B,)`` raw logits.
        """
        return self.over_arch(dense_features, self.embedding_bag_collection(sparse_features))


def build_dhen(
    config: DhenConfig,
    spec: DataSpec,
    device: torch.device,
    *,
    embedding_device: Optional[torch.device] = None,
) -> Dhen:
    """Build the DHEN-style model for the pooled features of ``spec``.

    Args:
        config: sizes.
        spec: the data; every pooled table must be ``config.embedding_dim`` wide. Sequence
            features are ignored.
        device: for the dense part.
        embedding_device: for the tables; default ``meta`` (``DistributedModelParallel``
            materializes them, as in TorchRec's DLRM examples). Pass ``device`` to run unsharded.

    Example::

        >>> from torchrec import KeyedJaggedTensor
        >>> from loka_job.training.data_spec import TableSpec
        >>> spec = DataSpec(num_dense=3, tables=tuple(TableSpec(f"t{i}", f"f{i}", 10, 32) for i in range(3)))
        >>> model = build_dhen(DhenConfig.small(), spec, torch.device("cpu"), embedding_device=torch.device("cpu"))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(  # f0: [1], [2];  f1: [3], [];  f2: [], [4, 5]
        ...     ["f0", "f1", "f2"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 1, 1, 0, 0, 2]))
        >>> model(torch.randn(2, 3), kjt).shape
        torch.Size([2])
    """
    if not isinstance(config, DhenConfig):
        raise TypeError(f"config must be a DhenConfig, got {type(config).__name__}")
    tables = spec.pooled_tables
    if tables and len(tables) + (1 if spec.num_dense else 0) < 2:
        raise ValueError("data: DHEN needs at least two tokens (pooled features plus the dense token)")
    ebc = pooled_token_tables(spec, config.embedding_dim, "DhenConfig", "DHEN", embedding_device)
    return Dhen(ebc, [t.feature for t in tables], spec.num_dense, config, device)
