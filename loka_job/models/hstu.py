"""An HSTU-style model: STU layers over jagged user histories, scored against a candidate item.

After "Actions Speak Louder than Words: Trillion-Parameter Sequential Transducers for Generative
Recommendations" (HSTU, arXiv 2402.17152). Each STU layer, on the ``T`` tokens of a jagged
batch (``(T, D)``, sequences laid end to end):

* ``normed = LayerNorm(x)``;
* one projection of ``normed`` to ``u, v`` (``H * h`` wide each) and ``q, k`` (``H * a`` each),
  held as a :class:`~loka_torchrec.mods.SiblingLinears` group (``uvqk``: four members, fused by
  the ``fuse_siblings`` mod into the single GEMM of the original design);
* ``u = SiLU(u)``;
* pointwise attention per head, ``A = SiLU(q k^T * alpha) / L`` with ``alpha = a ** -0.5`` and
  ``L`` the maximum sequence length, restricted to the causal, in-sequence pairs: token ``i``
  of a sequence reads token ``j`` only if ``j <= i`` and both belong to that sequence (padding
  and other sequences contribute exactly 0);
* ``y = u * LayerNorm(A v)`` (over the ``H * h`` concatenated heads);
* ``x + Linear(y)`` (output projection ``H * h -> D``, residual).

Inputs: a TorchRec ``EmbeddingCollection`` looks up the history feature(s) (sequence tables of
the :class:`DataSpec`) and the candidate item, which is a *sequence feature of length 1* (one id
per sample; the feature named ``HstuConfig.candidate_feature``). Sequence features that name the
same table share it (one ``EmbeddingConfig`` with several feature names), so the candidate can
be looked up in the history's item table. Several history features (e.g. item and action ids,
with equal lengths per sample) are summed token by token. A learned recency embedding (position
counted from the end of the sequence) is added to the first layer's input.

Prediction: the final state ``s`` (``LayerNorm`` of the last token of each history; zeros for an
empty history) is scored against the candidate embedding ``c`` by an MLP over
``[s * c, s, c, dense]`` (``dense`` = the dense features projected to ``D``), ending in the
prediction layer.

What the mods see: LayerNorms, ``nn.SiLU`` modules (including the attention's pointwise SiLU),
the ``uvqk`` sibling group, and ``nn.Linear`` GEMMs: ``uvqk`` with ``M = T`` (total tokens),
``K = D``, ``N = (2h + 2a) H``, and the output projection with ``M = T``, ``K = H h``, ``N = D``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from loka_torchrec.mods.no_bias import mark_prediction_layer
from loka_torchrec.mods.siblings import SiblingLinears
from loka_job.models.options import candidate_and_history, config_from_options, positive_int, sequence_collection
from loka_job.training.data_spec import DataSpec

__all__ = ["HstuConfig", "JaggedLayout", "padded_token_count", "causal_silu_attention", "StuLayer", "HstuOverArch", "Hstu", "build_hstu"]


@dataclasses.dataclass(frozen=True)
class HstuConfig:
    """Every size of the HSTU-style model (the maximum sequence length comes from the data).

    Attributes:
        embedding_dim: ``D``, the model width and the item tables' width.
        num_layers: STU layers.
        num_heads: ``H``.
        attention_dim: ``a``, per-head width of ``q`` and ``k``.
        linear_dim: ``h``, per-head width of ``u`` and ``v``.
        head_hidden: hidden widths of the prediction MLP.
        candidate_feature: the sequence feature that holds the candidate item (length 1).
        token_bucket: pad each batch's ``T`` history tokens up to a multiple of this (capped at
            ``B * L``), 0 for no padding. The dense layers then see a few fixed row counts
            instead of a new one every batch, so ``torch.compile`` compiles each statically and
            records CUDA graphs for them (a graph with a dynamic row count runs without one, and
            its step is bound by kernel launches on the host). Padding tokens sit in unused slots
            of the padded attention grid: they change no output and no gradient.

    Example::

        >>> cfg = HstuConfig.large()
        >>> cfg.embedding_dim, cfg.num_heads * (2 * cfg.linear_dim + 2 * cfg.attention_dim)
        (512, 2048)
    """

    embedding_dim: int = 32
    num_layers: int = 2
    num_heads: int = 2
    attention_dim: int = 16
    linear_dim: int = 16
    head_hidden: Tuple[int, ...] = (64,)
    candidate_feature: str = "cand_item"
    token_bucket: int = 0

    def __post_init__(self) -> None:
        for field in ("embedding_dim", "num_layers", "num_heads", "attention_dim", "linear_dim"):
            positive_int(getattr(self, field), field, "HstuConfig")
        if isinstance(self.token_bucket, bool) or not isinstance(self.token_bucket, int) or self.token_bucket < 0:
            raise ValueError(f"HstuConfig.token_bucket must be an int >= 0 (0: no padding), got {self.token_bucket!r}")
        if isinstance(self.head_hidden, (str, bytes)) or not isinstance(self.head_hidden, Sequence):
            raise TypeError(f"HstuConfig.head_hidden must be a sequence of ints, got {type(self.head_hidden).__name__}")
        object.__setattr__(self, "head_hidden", tuple(self.head_hidden))
        for i, width in enumerate(self.head_hidden):
            positive_int(width, f"head_hidden[{i}]", "HstuConfig")
        if not isinstance(self.candidate_feature, str) or not self.candidate_feature:
            raise ValueError(f"HstuConfig.candidate_feature must be a feature name, got {self.candidate_feature!r}")

    @classmethod
    def small(cls) -> "HstuConfig":
        """CPU-sized: D = 32, two layers of two heads."""
        return cls()

    @classmethod
    def large(cls) -> "HstuConfig":
        """GPU-sized: D = 512, 4 heads of 128; the ``uvqk`` GEMM is 512 -> 2048, the output 512 -> 512;
        tokens padded to multiples of 2048."""
        return cls(
            embedding_dim=512, num_layers=4, num_heads=4, attention_dim=128, linear_dim=128, head_hidden=(1024, 256),
            token_bucket=2048,
        )

    @classmethod
    def xl(cls) -> "HstuConfig":
        """GPU-sized, wide and long: D = 1024, 8 heads of 128; the ``uvqk`` GEMM is 1024 -> 4096, the
        output 1024 -> 1024, with M = the batch's history tokens (``recipes/model/hstu_xl.yaml``:
        histories of 256..512 items, about 98k tokens per GPU). Its tokens are not padded: its step
        is bound by the GPU, not by kernel launches, so the padding rows cost more than CUDA graphs
        save."""
        return cls(
            embedding_dim=1024, num_layers=4, num_heads=8, attention_dim=128, linear_dim=128, head_hidden=(2048, 512)
        )

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> "HstuConfig":
        """From a plain mapping: ``preset`` (``"small"``/``"large"``/``"xl"``, default small) plus overrides.

        Example::

            >>> HstuConfig.from_options({"preset": "large", "num_layers": 2}).num_layers
            2
        """
        return config_from_options(cls, options, "HSTU")


class JaggedLayout:
    """Where each of the ``T`` tokens of a jagged batch sits in the padded ``(B, L)`` grid.

    Args:
        lengths: ``(B,)`` int64 sequence lengths, each in ``[0, max_len]``.
        max_len: ``L``.
        num_tokens: ``T = sum(lengths)`` if known (saves a host sync).
        bucket: lay out ``T`` rounded up to a multiple of ``bucket`` (at most ``B * L``) rows, 0
            for exactly ``T``. Each padding row gets a distinct unused slot of the grid (a
            position past the end of some sequence), which the attention masks like any other
            padding; its recency is 0. Rows ``T..`` of the model's tokens are the padding.

    Example::

        >>> layout = JaggedLayout(torch.tensor([2, 0, 1]), max_len=3)
        >>> values = torch.tensor([[1.0], [2.0], [3.0]])
        >>> layout.to_padded(values)[..., 0]
        tensor([[1., 2., 0.],
                [0., 0., 0.],
                [3., 0., 0.]])
        >>> layout.recency.tolist()  # position counted from the end of its sequence
        [1, 0, 0]
        >>> padded = JaggedLayout(torch.tensor([2, 0, 1]), max_len=3, bucket=4)
        >>> padded.num_tokens, padded.num_real_tokens
        (4, 3)
    """

    def __init__(self, lengths: torch.Tensor, max_len: int, num_tokens: Optional[int] = None, bucket: int = 0) -> None:
        self.lengths = lengths
        self.max_len = int(max_len)
        self.batch_size = int(lengths.shape[0])
        offsets = torch.zeros(self.batch_size + 1, dtype=torch.int64, device=lengths.device)
        offsets[1:] = torch.cumsum(lengths, dim=0)
        self.offsets = offsets
        total = int(offsets[-1]) if num_tokens is None else int(num_tokens)
        self.num_real_tokens = total
        self.batch_index = torch.repeat_interleave(
            torch.arange(self.batch_size, device=lengths.device), lengths, output_size=total
        )
        self.position = torch.arange(total, device=lengths.device) - offsets[self.batch_index]
        self.flat_index = self.batch_index * self.max_len + self.position
        self.valid = torch.arange(self.max_len, device=lengths.device)[None, :] < lengths[:, None]  # (B, L)
        padding = padded_token_count(total, bucket, self.batch_size * self.max_len) - total
        if padding:
            # The first `padding` unused slots of the grid, in order (a stable sort puts the
            # invalid slots, 0, first) - on the device, no host sync.
            unused = torch.argsort(self.valid.flatten().to(torch.int8), stable=True)[:padding]
            self.flat_index = torch.cat([self.flat_index, unused])
            self.batch_index = torch.cat([self.batch_index, unused // self.max_len])
            self.position = torch.cat([self.position, unused % self.max_len])
        # Padding rows sit past their row's length: their recency would be negative; 0 instead.
        self.recency = (lengths[self.batch_index] - 1 - self.position).clamp_min(0)

    @property
    def num_tokens(self) -> int:
        """Rows of the layout: the real tokens and, with a bucket, the padding rows after them."""
        return int(self.batch_index.shape[0])

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        """``(T, F)`` jagged -> ``(B, L, F)``; zeros in the padding, except the slots that padding
        rows (with a bucket) were written to."""
        padded = values.new_zeros(self.batch_size * self.max_len, values.shape[-1])
        return padded.index_copy(0, self.flat_index, values).view(self.batch_size, self.max_len, -1)

    def to_jagged(self, padded: torch.Tensor) -> torch.Tensor:
        """``(B, L, F)`` padded -> ``(T, F)`` (the padding is dropped)."""
        return padded.reshape(self.batch_size * self.max_len, -1).index_select(0, self.flat_index)

    def last(self, values: torch.Tensor) -> torch.Tensor:
        """The last token of each sequence, ``(B, F)``; zeros for an empty sequence."""
        padded = self.to_padded(values)
        last = padded[torch.arange(self.batch_size, device=values.device), (self.lengths - 1).clamp_min(0)]
        return torch.where((self.lengths > 0)[:, None], last, torch.zeros_like(last))


def padded_token_count(num_tokens: int, bucket: int, capacity: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``bucket`` (0: not rounded), at most ``capacity``.

    Example::

        >>> padded_token_count(37000, 2048, 65536), padded_token_count(37000, 0, 65536), padded_token_count(65000, 2048, 65536)
        (38912, 37000, 65536)
    """
    if not bucket:
        return num_tokens
    return max(num_tokens, min(-(-num_tokens // bucket) * bucket, capacity))


def causal_silu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_len: int,
    activation: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu,
) -> torch.Tensor:
    """HSTU's pointwise attention on padded sequences: ``sum_j [j <= i < n_b] act(q_i k_j * alpha) / L v_j``.

    Entries outside the causal, in-sequence pattern are set to exactly 0 by ``torch.where``
    (not multiplied by a mask), so whatever the padding holds never reaches an output at a
    valid position. Outputs at padded query positions are 0.

    Args:
        q, k: ``(B, L, H, a)``.
        v: ``(B, L, H, h)``.
        lengths: ``(B,)`` valid tokens per sequence.
        max_len: ``L``, also the normalizer.
        activation: the pointwise nonlinearity (SiLU; the model passes its swappable module).

    Returns:
        ``(B, L, H, h)``.

    Example::

        >>> q = k = torch.ones(1, 3, 1, 4); v = torch.arange(3.0).view(1, 3, 1, 1)
        >>> out = causal_silu_attention(q, k, v, torch.tensor([2]), max_len=3)
        >>> [round(x, 4) for x in out.flatten().tolist()]  # token 1 reads tokens 0 and 1; token 2 is padding
        [0.0, 0.5872, 0.0]
    """
    batch, length, heads, attn_dim = q.shape
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * attn_dim**-0.5
    valid = torch.arange(length, device=q.device)[None, :] < lengths[:, None]  # (B, L)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & valid[:, None, :, None] & valid[:, None, None, :]  # (B, 1, L, L)
    weights = torch.where(allowed, activation(scores) / max_len, torch.zeros_like(scores))
    return torch.einsum("bhij,bjhd->bihd", weights, v)


class StuLayer(nn.Module):
    """One STU layer on jagged tokens ``(T, D) -> (T, D)`` (see the module docstring).

    Args:
        dim: ``D``.
        num_heads, attention_dim, linear_dim: ``H``, ``a``, ``h``.
        device: for the parameters.

    Example::

        >>> layer = StuLayer(8, num_heads=2, attention_dim=4, linear_dim=4)
        >>> layout = JaggedLayout(torch.tensor([3, 1]), max_len=4)
        >>> layer(torch.randn(4, 8), layout).shape
        torch.Size([4, 8])
    """

    def __init__(
        self, dim: int, *, num_heads: int, attention_dim: int, linear_dim: int, device: Optional[torch.device] = None
    ) -> None:
        super().__init__()
        self.num_heads, self.attention_dim, self.linear_dim = num_heads, attention_dim, linear_dim
        uv, qk = num_heads * linear_dim, num_heads * attention_dim
        self.norm = nn.LayerNorm(dim, device=device)
        self.uvqk = SiblingLinears(dim, [("u", uv), ("v", uv), ("q", qk), ("k", qk)], device=device)
        self.u_activation = nn.SiLU()
        self.attention_activation = nn.SiLU()
        self.attention_norm = nn.LayerNorm(uv, device=device)
        self.out = nn.Linear(uv, dim, device=device)

    def forward(self, x: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
        """``x``: ``(T, D)`` tokens of ``layout``; returns ``(T, D)``."""
        u, v, q, k = self.uvqk(self.norm(x))
        u = self.u_activation(u)
        b, length, heads = layout.batch_size, layout.max_len, self.num_heads
        attended = causal_silu_attention(
            layout.to_padded(q).view(b, length, heads, self.attention_dim),
            layout.to_padded(k).view(b, length, heads, self.attention_dim),
            layout.to_padded(v).view(b, length, heads, self.linear_dim),
            layout.lengths,
            max_len=length,
            activation=self.attention_activation,
        )
        attended = layout.to_jagged(attended.reshape(b, length, heads * self.linear_dim))
        return x + self.out(u * self.attention_norm(attended))


class HstuOverArch(nn.Module):
    """Everything after the embedding lookup: recency, STU layers, final norm, prediction head.

    ``(dense (B, num_dense), looked-up sequences Dict[str, JaggedTensor]) -> logits (B,)``. It is
    its own module so that the model's top-level ``forward`` is only "look up, then this", which
    TorchRec's train pipelines trace with ``torch.fx`` (a module without sharded tables inside is
    a leaf there, so the jagged bookkeeping here is never traced).

    Args:
        history_features: jagged history features (summed per token; equal lengths).
        candidate_feature: the length-1 candidate feature.
        num_dense: dense features per sample (0: none).
        max_len: ``L``, the longest history.
        config: sizes.
        device: for the parameters.
    """

    def __init__(
        self,
        history_features: Sequence[str],
        candidate_feature: str,
        num_dense: int,
        max_len: int,
        config: HstuConfig,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        d = config.embedding_dim
        self.history_features: Tuple[str, ...] = tuple(history_features)
        self.candidate_feature = candidate_feature
        self.num_dense, self.max_len = num_dense, max_len
        self.token_bucket = config.token_bucket
        self.recency = nn.Embedding(max_len, d, device=device)
        nn.init.normal_(self.recency.weight, std=0.02)
        self.layers = nn.ModuleList(
            [
                StuLayer(
                    d,
                    num_heads=config.num_heads,
                    attention_dim=config.attention_dim,
                    linear_dim=config.linear_dim,
                    device=device,
                )
                for _ in range(config.num_layers)
            ]
        )
        self.final_norm = nn.LayerNorm(d, device=device)
        self.dense_arch = nn.Sequential(nn.Linear(num_dense, d, device=device), nn.SiLU()) if num_dense else None
        head: List[nn.Module] = []
        width = (4 if num_dense else 3) * d
        for hidden in config.head_hidden:
            head += [nn.Linear(width, hidden, device=device), nn.SiLU()]
            width = hidden
        head.append(mark_prediction_layer(nn.Linear(width, 1, device=device)))
        self.head = nn.Sequential(*head)

    def forward(self, dense_features: torch.Tensor, embedded) -> torch.Tensor:
        """``dense_features (B, num_dense)`` and ``feature -> JaggedTensor`` of embeddings -> ``(B,)``."""
        if dense_features.dim() != 2 or dense_features.shape[1] != self.num_dense:
            raise ValueError(f"dense_features must be (B, {self.num_dense}), got {tuple(dense_features.shape)}")
        history = embedded[self.history_features[0]]
        lengths = history.lengths()
        tokens = history.values()
        for name in self.history_features[1:]:
            other = embedded[name]
            if not torch.equal(other.lengths(), lengths):
                raise ValueError(
                    f"sparse_features: history features {self.history_features[0]!r} and {name!r} "
                    f"must have the same length per sample"
                )
            tokens = tokens + other.values()
        candidate = embedded[self.candidate_feature]
        batch = dense_features.shape[0]
        if lengths.shape[0] != batch:
            raise ValueError(f"sparse_features: batch size {lengths.shape[0]} != dense_features batch {batch}")
        # One host sync for both checks: an over-long history would be written into the next
        # sample's padded row, and the candidate must be one id per sample.
        if bool(((lengths > self.max_len).any() | (candidate.lengths() != 1).any()).item()):
            raise ValueError(
                f"sparse_features: every {self.history_features[0]!r} sequence must have at most "
                f"{self.max_len} ids and every {self.candidate_feature!r} exactly one id; got history "
                f"lengths up to {int(lengths.max())} and candidate lengths {sorted(set(candidate.lengths().tolist()))}"
            )
        layout = JaggedLayout(lengths, self.max_len, num_tokens=tokens.shape[0], bucket=self.token_bucket)
        if layout.num_tokens > layout.num_real_tokens:  # zero rows for the bucket's padding
            tokens = nn.functional.pad(tokens, (0, 0, 0, layout.num_tokens - layout.num_real_tokens))
        x = tokens + self.recency(layout.recency)
        for layer in self.layers:
            x = layer(x, layout)
        state = layout.last(self.final_norm(x))  # (B, D)
        item = candidate.values()  # (B, D)
        features = [state * item, state, item]
        if self.dense_arch is not None:
            features.append(self.dense_arch(dense_features))
        return self.head(torch.cat(features, dim=-1)).squeeze(-1)


class Hstu(nn.Module):
    """The HSTU-style click model: ``(dense (B, num_dense), sparse KJT) -> logits (B,)``.

    Args:
        embedding_collection: sequence tables, all ``config.embedding_dim`` wide.
        history_features: jagged history features (summed per token; equal lengths).
        num_dense: dense features per sample (0: none).
        max_len: ``L``, the longest history.
        config: sizes.
        device: for the dense parameters.

    Build it with :func:`build_hstu`.
    """

    def __init__(
        self,
        embedding_collection: nn.Module,
        history_features: Sequence[str],
        num_dense: int,
        max_len: int,
        config: HstuConfig,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.config = config
        # Read by loka_torchrec.compile.compile_dense: with its tokens padded to buckets the dense
        # part sees a few fixed shapes, each compiled statically (and so with CUDA graphs).
        self.compile_static_shapes = config.token_bucket > 0
        self.embedding_collection = embedding_collection
        self.over_arch = HstuOverArch(history_features, config.candidate_feature, num_dense, max_len, config, device)

    @property
    def max_len(self) -> int:
        return self.over_arch.max_len

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        """Click logits.

        Args:
            dense_features: ``(B, num_dense)`` float.
            sparse_features: ``KeyedJaggedTensor`` with the history feature(s) (each sample at
                most ``max_len`` ids) and the candidate feature (exactly one id per sample).

        Returns:
            ``(B,)`` raw logits.
        """
        return self.over_arch(dense_features, self.embedding_collection(sparse_features))


def build_hstu(
    config: HstuConfig,
    spec: DataSpec,
    device: torch.device,
    *,
    embedding_device: Optional[torch.device] = None,
) -> Hstu:
    """Build the HSTU-style model for the sequence features of ``spec``.

    The candidate is the sequence feature ``config.candidate_feature`` (length 1); every other
    sequence feature is history, and the longest ``pooling_factor`` among them (a sequence
    table's maximum length) is ``L``. Pooled features are ignored.

    Args:
        config: sizes.
        spec: the data; every sequence table must be ``config.embedding_dim`` wide.
        device: for the dense part.
        embedding_device: for the tables; default ``meta`` (``DistributedModelParallel``
            materializes them). Pass ``device`` to run unsharded.

    Example::

        >>> from torchrec import KeyedJaggedTensor
        >>> from loka_job.training.data_spec import TableSpec
        >>> spec = DataSpec(num_dense=2, tables=(
        ...     TableSpec("t_item", "hist_item", 50, 32, pooling_factor=6, sequence=True),
        ...     TableSpec("t_item", "cand_item", 50, 32, pooling_factor=1, sequence=True)))
        >>> model = build_hstu(HstuConfig.small(), spec, torch.device("cpu"), embedding_device=torch.device("cpu"))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(  # histories [1, 2, 3] and [4]; candidates 5 and 6
        ...     ["hist_item", "cand_item"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([3, 1, 1, 1]))
        >>> model(torch.randn(2, 2), kjt).shape
        torch.Size([2])
    """
    if not isinstance(config, HstuConfig):
        raise TypeError(f"config must be an HstuConfig, got {type(config).__name__}")
    tables, history = candidate_and_history(spec, config.candidate_feature, "HstuConfig")
    if not history:
        raise ValueError("data: the HSTU model needs at least one history sequence feature besides the candidate")
    ec = sequence_collection(tables, config.embedding_dim, "HstuConfig", embedding_device)
    max_len = max(t.pooling_factor for t in history)
    return Hstu(ec, [t.feature for t in history], spec.num_dense, max_len, config, device)
