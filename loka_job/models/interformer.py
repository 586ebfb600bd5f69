"""An Interformer-style model, written as its paper describes it and as users write it.

After "InterFormer: Towards Effective Heterogeneous Interaction Learning for Click-Through Rate
Prediction" (arXiv 2411.09852). Two kinds of input are kept apart and learned in interleaved
arches with information flowing both ways:

* the *non-sequence* tokens ``X`` (``(B, n, d)``): ``dense_tokens`` tokens made from the dense
  features by an MLP, the candidate item's embedding and the pooled embedding of every context
  feature;
* the *sequence* ``S`` (``(B, c + L, d)``): ``c`` learned CLS tokens followed by the user's
  history, padded to ``L`` items with the most recent last (a longer history keeps its most
  recent ``L``), plus a learned embedding of each slot's recency (the paper uses rotary
  embeddings inside the attention instead).

Each layer runs three arches on ``(X, S)``:

* **Cross Arch**, summarizing each side for the other: ``X_sum = Gate(Linear(flatten X))``
  (``n_sum`` tokens) and ``S_sum = Gate(flatten [S_cls, PMA(S), S_recent])``: the CLS tokens, a
  pooling by multi-head attention of learned seeds over ``S`` (``p`` tokens) and the ``r`` most
  recent items; ``Gate(z) = z * sigmoid(Linear(z))`` is a self-gating layer;
* **Interaction Arch** (behaviour-aware), ``X' = LayerNorm(X + MLP([dot(Z), cross(Z)]))`` over
  ``Z = [X, S_sum]``: a DHEN-style ensemble of the pairwise dot products of the tokens and a
  low-rank DCN cross layer on the flattened tokens, mapped back to ``n`` tokens;
* **Sequence Arch** (context-aware), ``S' = P + MHA(LayerNorm(P))`` with the personalized FFN
  ``P = S + LayerNorm(S) W(X_sum) / sqrt(d)``: ``W(X_sum)`` is a ``(d, d)`` matrix per sample,
  a linear map of the flattened ``X_sum``; ``MHA`` is self-attention over the CLS and history
  tokens with the padding masked.

The head is an MLP over ``[flatten X, flatten S_sum]`` of the last layer's outputs.

This module is deliberately not written for LoKA (it is a member of the model zoo that checks
LoKA on models it was not designed around): the attention and the PMA are
``nn.MultiheadAttention`` (the PMA is cross-attention: seeds attend over the sequence), the DCN
cross is TorchRec's ``LowRankCrossNet`` (raw ``Parameter`` GEMMs), the MLPs are TorchRec's
``MLP`` with ``SwishLayerNorm``, the personalized FFN and the dot interaction are ``torch.bmm``,
and nothing is marked or grouped for the mods.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from loka_job.models.options import (
    candidate_and_history, config_from_options, int_tuple, pooled_token_tables, positive_int, sequence_collection,
)
from loka_job.training.data_spec import DataSpec

__all__ = [
    "InterformerConfig",
    "right_aligned_history",
    "InterformerLayer",
    "InterformerOverArch",
    "Interformer",
    "build_interformer",
]


@dataclasses.dataclass(frozen=True)
class InterformerConfig:
    """Every size of the Interformer-style model (the history length ``L`` comes from the data).

    Attributes:
        embedding_dim: ``d``, the width of every token (the tables' ``embedding_dim``).
        num_layers: interleaved layers (each a Cross, an Interaction and a Sequence Arch).
        num_heads: heads of the sequence self-attention and of the PMA (must divide ``d``).
        dense_tokens: tokens made from the dense features (0: the dense features are not used).
        dense_hidden: hidden widths of the dense MLP (its output is ``dense_tokens * d``).
        summary_tokens: ``n_sum``, tokens of the non-sequence summary ``X_sum``.
        cls_tokens: ``c``, learned CLS tokens in front of the sequence.
        pma_tokens: ``p``, seeds of the pooling by multi-head attention.
        recent_tokens: ``r``, most recent history items in the sequence summary (at most ``L``).
        cross_rank: rank of the DCN cross layer of the Interaction Arch.
        interaction_hidden: hidden widths of the Interaction Arch's MLP (its output is ``n * d``).
        head_hidden: hidden widths of the prediction MLP.
        candidate_feature: the sequence feature that holds the candidate item (one id per sample).

    Example::

        >>> InterformerConfig.small().summary_tokens, InterformerConfig.large().embedding_dim
        (2, 256)
        >>> InterformerConfig.from_options({"preset": "small", "num_layers": 1}).num_layers
        1
    """

    embedding_dim: int = 16
    num_layers: int = 2
    num_heads: int = 2
    dense_tokens: int = 1
    dense_hidden: Tuple[int, ...] = (32,)
    summary_tokens: int = 2
    cls_tokens: int = 2
    pma_tokens: int = 2
    recent_tokens: int = 2
    cross_rank: int = 8
    interaction_hidden: Tuple[int, ...] = (64,)
    head_hidden: Tuple[int, ...] = (64, 32)
    candidate_feature: str = "cand_item"

    def __post_init__(self) -> None:
        for field in ("embedding_dim", "num_layers", "num_heads", "summary_tokens", "cls_tokens", "pma_tokens",
                      "recent_tokens", "cross_rank"):  # fmt: skip
            positive_int(getattr(self, field), field, "InterformerConfig")
        if isinstance(self.dense_tokens, bool) or not isinstance(self.dense_tokens, int) or self.dense_tokens < 0:
            raise ValueError(f"InterformerConfig.dense_tokens must be an int >= 0, got {self.dense_tokens!r}")
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"InterformerConfig.num_heads ({self.num_heads}) must divide embedding_dim ({self.embedding_dim})"
            )
        for field in ("dense_hidden", "interaction_hidden", "head_hidden"):
            object.__setattr__(self, field, int_tuple(getattr(self, field), field, "InterformerConfig"))
        if not isinstance(self.candidate_feature, str) or not self.candidate_feature:
            raise TypeError(f"InterformerConfig.candidate_feature must be a feature name, got {self.candidate_feature!r}")

    @classmethod
    def small(cls) -> "InterformerConfig":
        """CPU-sized: ``d = 16``, two layers; a step of batch 256 takes milliseconds."""
        return cls()

    @classmethod
    def large(cls) -> "InterformerConfig":
        """GPU-sized, GEMMs a large part of the step: ``d = 256``, three layers, 4 heads; with 30
        context features, the candidate and one dense token, 32 non-sequence tokens (8192 wide)
        and a 16-token sequence summary (4 CLS, 4 PMA, 8 recent): the Interaction Arch works on
        48 tokens (12288 wide, MLP ``13416 -> 2048 -> 8192``), the personalized FFN's weights are
        ``512 -> 65536``."""
        return cls(
            embedding_dim=256, num_layers=3, num_heads=4, dense_tokens=1, dense_hidden=(512,), summary_tokens=2,
            cls_tokens=4, pma_tokens=4, recent_tokens=8, cross_rank=512, interaction_hidden=(2048,),
            head_hidden=(2048, 512),
        )  # fmt: skip

    @classmethod
    def xl(cls) -> "InterformerConfig":
        """The large widths for long histories (``model=interformer_xl``: up to 256 items at batch
        2048): the same dense GEMMs, a quarter of the rows on the non-sequence side, and an
        attention four times as long."""
        return cls.large()

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> "InterformerConfig":
        """From a plain mapping: ``preset`` (``"small"``/``"large"``/``"xl"``, default small) plus overrides."""
        return config_from_options(cls, options, "Interformer")


def right_aligned_history(values: torch.Tensor, lengths: torch.Tensor, max_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Jagged histories ``(T, d)`` (end to end) -> ``(B, L, d)`` with the most recent item in slot
    ``L - 1``, and the ``(B, L)`` mask of the slots that hold an item.

    Padding slots are zeros; a history longer than ``L`` keeps its most recent ``L`` items. Only
    gathers (no host sync, no data-dependent shape), so ``torch.compile`` traces it.

    Example::

        >>> values = torch.arange(1.0, 5.0)[:, None]            # histories [1, 2, 3] and [4]
        >>> padded, valid = right_aligned_history(values, torch.tensor([3, 1]), max_len=2)
        >>> padded[..., 0].tolist(), valid.tolist()
        ([[2.0, 3.0], [0.0, 4.0]], [[True, True], [False, True]])
    """
    slots = torch.arange(max_len, device=lengths.device)
    ends = torch.cumsum(lengths, 0)
    source = ends[:, None] - max_len + slots[None, :]  # (B, L): the item that slot j holds
    valid = slots[None, :] >= (max_len - lengths)[:, None]
    index = torch.where(valid, source, values.shape[0])  # padding reads the zero row appended below
    return nn.functional.pad(values, (0, 0, 0, 1))[index], valid


def _mlp(in_size: int, widths: Sequence[int], device: torch.device) -> nn.Module:
    """TorchRec's ``MLP`` with ``SwishLayerNorm`` between layers and none after the last."""
    from torchrec.modules.mlp import MLP

    return MLP(in_size, list(widths), activation="swish_layernorm", activation_on_last=False, device=device)


class _SelfGate(nn.Module):
    """``z * sigmoid(Linear(z))`` on a flattened summary ``(B, width)``."""

    def __init__(self, width: int, device: torch.device) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width, device=device)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * torch.sigmoid(self.gate(z))


class _NonSequenceSummary(nn.Module):
    """Cross Arch, non-sequence side: ``(B, n, d) -> (B, n_sum, d)``, ``Gate(Linear(flatten X))``."""

    def __init__(self, num_tokens: int, config: InterformerConfig, device: torch.device) -> None:
        super().__init__()
        d, tokens = config.embedding_dim, config.summary_tokens
        self.dim, self.tokens = d, tokens
        self.compress = nn.Linear(num_tokens * d, tokens * d, device=device)
        self.gate = _SelfGate(tokens * d, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.compress(x.flatten(1))).view(x.shape[0], self.tokens, self.dim)


class _SequenceSummary(nn.Module):
    """Cross Arch, sequence side: ``(B, c + L, d) -> (B, c + p + r, d)``,
    ``Gate(flatten [S_cls, PMA(S), S_recent])`` (padding slots among the recent ones are zeros)."""

    def __init__(self, config: InterformerConfig, device: torch.device) -> None:
        super().__init__()
        d = config.embedding_dim
        self.dim, self.cls_tokens, self.recent_tokens = d, config.cls_tokens, config.recent_tokens
        self.seeds = nn.Parameter(torch.empty(config.pma_tokens, d, device=device))
        nn.init.normal_(self.seeds, std=d**-0.5)
        self.pma = nn.MultiheadAttention(d, config.num_heads, batch_first=True, device=device)
        self.gate = _SelfGate((config.cls_tokens + config.pma_tokens + config.recent_tokens) * d, device)

    def forward(self, s: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        batch = s.shape[0]
        seeds = self.seeds.expand(batch, -1, -1)
        pooled = self.pma(seeds, s, s, key_padding_mask=padding, need_weights=False)[0]
        recent = s[:, -self.recent_tokens :].masked_fill(padding[:, -self.recent_tokens :, None], 0.0)
        summary = torch.cat([s[:, : self.cls_tokens], pooled, recent], dim=1)
        return self.gate(summary.flatten(1)).view(batch, -1, self.dim)


class _InteractionArch(nn.Module):
    """``(X (B, n, d), S_sum (B, k, d)) -> (B, n, d)``: ``LayerNorm(X + MLP([dot(Z), cross(Z)]))``."""

    def __init__(self, num_tokens: int, summary_tokens: int, config: InterformerConfig, device: torch.device) -> None:
        super().__init__()
        from torchrec.modules.crossnet import LowRankCrossNet

        d, m = config.embedding_dim, num_tokens + summary_tokens
        self.num_tokens, self.dim = num_tokens, d
        rows, cols = torch.triu_indices(m, m, offset=1, device=device)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        with torch.device(device):  # LowRankCrossNet takes no device argument
            self.cross = LowRankCrossNet(m * d, num_layers=1, low_rank=config.cross_rank)
        self.mlp = _mlp(rows.numel() + m * d, (*config.interaction_hidden, num_tokens * d), device)
        self.norm = nn.LayerNorm(d, device=device)

    def forward(self, x: torch.Tensor, s_summary: torch.Tensor) -> torch.Tensor:
        z = torch.cat([x, s_summary], dim=1)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pair_rows, self.pair_cols]  # (B, m (m - 1) / 2)
        crossed = self.cross(z.flatten(1))  # (B, m d)
        out = self.mlp(torch.cat([dots, crossed], dim=1)).view(x.shape[0], self.num_tokens, self.dim)
        return self.norm(x + out)


class _SequenceArch(nn.Module):
    """``(S (B, c + L, d), padding, X_sum) -> (B, c + L, d)``: the personalized FFN, then self-attention."""

    def __init__(self, config: InterformerConfig, device: torch.device) -> None:
        super().__init__()
        d = config.embedding_dim
        self.dim = d
        self.personalize = nn.Linear(config.summary_tokens * d, d * d, device=device)
        self.ffn_norm = nn.LayerNorm(d, device=device)
        self.attention_norm = nn.LayerNorm(d, device=device)
        self.attention = nn.MultiheadAttention(d, config.num_heads, batch_first=True, device=device)

    def forward(self, s: torch.Tensor, padding: torch.Tensor, x_summary: torch.Tensor) -> torch.Tensor:
        # The (d, d) map is scaled by d^-1/2 so that it starts near unit gain, as attention scores are.
        weight = self.personalize(x_summary.flatten(1)).view(s.shape[0], self.dim, self.dim)
        s = s + torch.bmm(self.ffn_norm(s), weight) / math.sqrt(self.dim)
        normed = self.attention_norm(s)
        return s + self.attention(normed, normed, normed, key_padding_mask=padding, need_weights=False)[0]


class InterformerLayer(nn.Module):
    """One interleaved layer ``(X (B, n, d), S (B, c + L, d), padding (B, c + L)) -> (X', S')``.

    ``padding`` is true where ``S`` holds no item.

    Example::

        >>> layer = InterformerLayer(5, InterformerConfig.small())
        >>> padding = torch.zeros(3, 9, dtype=torch.bool)
        >>> x, s = layer(torch.randn(3, 5, 16), torch.randn(3, 9, 16), padding)
        >>> x.shape, s.shape
        (torch.Size([3, 5, 16]), torch.Size([3, 9, 16]))
    """

    def __init__(self, num_tokens: int, config: InterformerConfig, device: Optional[torch.device] = None) -> None:
        super().__init__()
        device = torch.device("cpu") if device is None else device
        summary_tokens = config.cls_tokens + config.pma_tokens + config.recent_tokens
        self.non_sequence_summary = _NonSequenceSummary(num_tokens, config, device)
        self.sequence_summary = _SequenceSummary(config, device)
        self.interaction = _InteractionArch(num_tokens, summary_tokens, config, device)
        self.sequence = _SequenceArch(config, device)

    def forward(self, x: torch.Tensor, s: torch.Tensor, padding: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x_summary = self.non_sequence_summary(x)
        s_summary = self.sequence_summary(s, padding)
        return self.interaction(x, s_summary), self.sequence(s, padding, x_summary)


class InterformerOverArch(nn.Module):
    """Everything after the embedding lookups: input tokens, interleaved layers, head.

    ``(dense (B, num_dense), sequences Dict[str, JaggedTensor], context KeyedTensor or None) ->
    logits (B,)``; its own module, as in the other models of the reference job, so that
    TorchRec's pipelines see "look up, then this".

    Args:
        history_feature: the jagged history feature.
        candidate_feature: the candidate feature (one id per sample).
        context_features: the pooled context features (each one token).
        num_dense: dense features per sample (0: none).
        max_len: ``L``, the history slots.
        config: sizes.
        device: for the parameters.
    """

    def __init__(self, history_feature: str, candidate_feature: str, context_features: Sequence[str], num_dense: int,
                 max_len: int, config: InterformerConfig, device: Optional[torch.device] = None) -> None:  # fmt: skip
        super().__init__()
        device = torch.device("cpu") if device is None else device
        d = config.embedding_dim
        self.history_feature, self.candidate_feature = history_feature, candidate_feature
        self.context_features: Tuple[str, ...] = tuple(context_features)
        self.num_dense, self.max_len, self.dim = num_dense, max_len, d
        self.dense_tokens = config.dense_tokens if num_dense else 0
        self.dense_arch = _mlp(num_dense, (*config.dense_hidden, self.dense_tokens * d), device) if self.dense_tokens else None
        self.num_tokens = self.dense_tokens + 1 + len(self.context_features)
        self.cls = nn.Parameter(torch.empty(config.cls_tokens, d, device=device))
        self.recency = nn.Parameter(torch.empty(max_len, d, device=device))  # slot j holds the item L - 1 - j steps back
        nn.init.normal_(self.cls, std=d**-0.5)
        nn.init.normal_(self.recency, std=0.02)
        self.layers = nn.ModuleList([InterformerLayer(self.num_tokens, config, device) for _ in range(config.num_layers)])
        self.sequence_summary = _SequenceSummary(config, device)
        summary_tokens = config.cls_tokens + config.pma_tokens + config.recent_tokens
        head_in = (self.num_tokens + summary_tokens) * d
        self.head = nn.Sequential(
            _mlp(head_in, config.head_hidden, device),
            nn.Linear(config.head_hidden[-1] if config.head_hidden else head_in, 1, device=device),
        )

    def forward(self, dense_features: torch.Tensor, sequences: Dict[str, Any], context=None) -> torch.Tensor:
        """``dense_features (B, num_dense)``, ``feature -> JaggedTensor`` of sequence embeddings and
        the ``KeyedTensor`` of context embeddings (``None`` without context features) -> ``(B,)``."""
        if dense_features.dim() != 2 or dense_features.shape[1] != self.num_dense:
            raise ValueError(f"dense_features must be (B, {self.num_dense}), got {tuple(dense_features.shape)}")
        batch = dense_features.shape[0]
        history = sequences[self.history_feature]
        candidate = sequences[self.candidate_feature].values()
        if candidate.shape[0] != batch:
            raise ValueError(
                f"sparse_features: {self.candidate_feature!r} must hold one id per sample ({batch}), got {candidate.shape[0]} ids"
            )
        items, valid = right_aligned_history(history.values(), history.lengths(), self.max_len)
        s = torch.cat([self.cls.expand(batch, -1, -1), items + self.recency], dim=1)
        padding = torch.cat([valid.new_zeros(batch, self.cls.shape[0]), ~valid], dim=1)
        tokens: List[torch.Tensor] = [candidate.unsqueeze(1)]
        if self.dense_arch is not None:
            tokens.insert(0, self.dense_arch(dense_features).view(batch, self.dense_tokens, self.dim))
        if self.context_features:
            embeddings = context.to_dict()
            tokens.append(torch.stack([embeddings[name] for name in self.context_features], dim=1))
        x = torch.cat(tokens, dim=1)
        for layer in self.layers:
            x, s = layer(x, s, padding)
        summary = self.sequence_summary(s, padding)
        return self.head(torch.cat([x.flatten(1), summary.flatten(1)], dim=1)).squeeze(-1)


class Interformer(nn.Module):
    """The Interformer-style click model: ``(dense (B, num_dense), sparse KJT) -> logits (B,)``.

    Build it with :func:`build_interformer`.
    """

    def __init__(self, embedding_collection: nn.Module, embedding_bag_collection: Optional[nn.Module],
                 over_arch: InterformerOverArch, config: InterformerConfig) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.embedding_collection = embedding_collection
        self.embedding_bag_collection = embedding_bag_collection
        self.over_arch = over_arch

    @property
    def max_len(self) -> int:
        return self.over_arch.max_len

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        """Click logits ``(B,)`` from ``dense_features (B, num_dense)`` and the sparse
        ``KeyedJaggedTensor`` (the history, the candidate and any context features)."""
        context = None if self.embedding_bag_collection is None else self.embedding_bag_collection(sparse_features)
        return self.over_arch(dense_features, self.embedding_collection(sparse_features), context)


def build_interformer(
    config: InterformerConfig, spec: DataSpec, device: torch.device, *, embedding_device: Optional[torch.device] = None
) -> Interformer:
    """Build the Interformer-style model for ``spec``: its sequence features (one history and the
    candidate ``config.candidate_feature``, in one ``EmbeddingCollection``; features naming the
    same table share it) and its pooled features (context tokens, in an ``EmbeddingBagCollection``).

    Args:
        config: sizes.
        spec: the data; every table must be ``config.embedding_dim`` wide; the history's
            ``pooling_factor`` (its longest length) is ``L``.
        device: for the dense part.
        embedding_device: for the tables; default ``meta`` (``DistributedModelParallel``
            materializes them). Pass ``device`` to run unsharded.

    Example::

        >>> from torchrec import KeyedJaggedTensor
        >>> from loka_job.training.data_spec import TableSpec
        >>> spec = DataSpec(num_dense=2, tables=(
        ...     TableSpec("t_item", "hist_item", 50, 16, pooling_factor=6, sequence=True),
        ...     TableSpec("t_item", "cand_item", 50, 16, sequence=True), TableSpec("t_ctx_0", "ctx_0", 10, 16)))
        >>> model = build_interformer(InterformerConfig.small(), spec, torch.device("cpu"), embedding_device=torch.device("cpu"))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(  # histories [1, 2, 3] and [4]; candidates 5, 6; contexts 7, 8
        ...     ["hist_item", "cand_item", "ctx_0"], torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.tensor([3, 1, 1, 1, 1, 1]))
        >>> model(torch.randn(2, 2), kjt).shape
        torch.Size([2])
    """
    if not isinstance(config, InterformerConfig):
        raise TypeError(f"config must be an InterformerConfig, got {type(config).__name__}")
    tables, history = candidate_and_history(spec, config.candidate_feature, "InterformerConfig")
    if len(history) != 1:
        raise ValueError(
            f"data: the Interformer model reads one history sequence feature besides the candidate, got "
            f"{[t.feature for t in history]}"
        )
    ec = sequence_collection(tables, config.embedding_dim, "InterformerConfig", embedding_device)
    max_len = history[0].pooling_factor
    if config.recent_tokens > max_len:
        raise ValueError(
            f"InterformerConfig.recent_tokens ({config.recent_tokens}) must be <= the longest history "
            f"(data.max_seq_len = {max_len})"
        )
    context = [t.feature for t in spec.pooled_tables]
    ebc = (
        pooled_token_tables(spec, config.embedding_dim, "InterformerConfig", "Interformer", embedding_device)
        if context else None
    )  # fmt: skip
    over_arch = InterformerOverArch(
        history[0].feature, config.candidate_feature, context, spec.num_dense, max_len, config, device
    )
    return Interformer(ec, ebc, over_arch, config)
