"""A Wukong-style model, written as its paper describes it and as users write it.

After "Wukong: Towards a Scaling Law for Large-Scale Recommendation" (arXiv 2403.02545). The
``n`` tokens are the pooled embedding of every sparse feature plus ``dense_tokens`` tokens made
from the dense features by an MLP. A stack of Wukong layers maps ``X_i`` (``(B, n_i, d)``) to

    X_{i+1} = LayerNorm(concat(FMB(X_i), LCB(X_i)) + residual(X_i))

* **FMB**, the factorization machine block: the pairwise interactions ``X X^T``, kept low-rank by
  a projection ``Y`` (``(n, k)``) as ``X (X^T Y)``, flattened to ``n * k``, normed and sent
  through an MLP to ``n_F * d``, reshaped to ``n_F`` tokens;
* **LCB**, the linear compress block: ``n_L`` new tokens as linear combinations of the old
  ones, ``W^T X`` with ``W`` of shape ``(n, n_L)``;
* the residual is ``X`` itself when ``n_F + n_L == n``, else ``X`` recombined to
  ``n_F + n_L`` tokens by a projection of the same form as the LCB.

An MLP head over the flattened last stack gives the logit.

This module is deliberately not written for LoKA (it is a member of the model zoo that checks
LoKA on models it was not designed around): the token-mixing GEMMs multiply raw ``Parameter``
objects (``x.transpose(1, 2) @ self.weight``), the interaction is a ``torch.bmm``, the MLPs are
``nn.Linear`` + ``nn.BatchNorm1d`` + ReLU, the norms ``nn.LayerNorm``, and nothing is marked or
grouped for the mods.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from loka_job.models.options import config_from_options, int_tuple, pooled_token_tables, positive_int
from loka_job.models.click_model import TablesThenOverArch
from loka_job.training.data_spec import DataSpec

__all__ = ["WukongConfig", "WukongLayer", "WukongOverArch", "Wukong", "build_wukong"]


@dataclasses.dataclass(frozen=True)
class WukongConfig:
    """Every size of the Wukong-style model.

    Attributes:
        embedding_dim: ``d``, the width of every token (the tables' ``embedding_dim``).
        num_layers: stacked Wukong layers.
        fmb_rank: ``k``, the rank of the FMB's projection of the interaction matrix.
        fmb_hidden: hidden widths of the FMB's MLP (its input is ``n * k``, its output ``n_F * d``).
        fmb_tokens: ``n_F``, tokens each FMB emits.
        lcb_tokens: ``n_L``, tokens each LCB emits.
        dense_tokens: tokens made from the dense features (0: the dense features are not used).
        dense_hidden: hidden widths of the dense MLP (its output is ``dense_tokens * d``).
        head_hidden: hidden widths of the prediction MLP.

    Example::

        >>> WukongConfig.small().fmb_tokens, WukongConfig.xl().fmb_hidden
        (4, (4096, 4096))
        >>> WukongConfig.from_options({"preset": "small", "num_layers": 1}).num_layers
        1
    """

    embedding_dim: int = 16
    num_layers: int = 2
    fmb_rank: int = 4
    fmb_hidden: Tuple[int, ...] = (64,)
    fmb_tokens: int = 4
    lcb_tokens: int = 4
    dense_tokens: int = 1
    dense_hidden: Tuple[int, ...] = (32,)
    head_hidden: Tuple[int, ...] = (64, 32)

    def __post_init__(self) -> None:
        for field in ("embedding_dim", "num_layers", "fmb_rank", "fmb_tokens", "lcb_tokens"):
            positive_int(getattr(self, field), field, "WukongConfig")
        if isinstance(self.dense_tokens, bool) or not isinstance(self.dense_tokens, int) or self.dense_tokens < 0:
            raise ValueError(f"WukongConfig.dense_tokens must be an int >= 0, got {self.dense_tokens!r}")
        for field in ("fmb_hidden", "dense_hidden", "head_hidden"):
            object.__setattr__(self, field, int_tuple(getattr(self, field), field, "WukongConfig"))

    @classmethod
    def small(cls) -> "WukongConfig":
        """CPU-sized: ``d = 16``, two layers of 4 + 4 tokens; a step of batch 256 takes milliseconds."""
        return cls()

    @classmethod
    def large(cls) -> "WukongConfig":
        """GPU-sized at the paper's per-layer widths: ``d = 128``, 16 + 16 tokens, the FMB's MLP
        ``n * k -> 2048 -> 2048``, the head ``4096 -> 2048 -> 1024``: GEMMs 1024 to 4096 wide."""
        return cls(
            embedding_dim=128, num_layers=6, fmb_rank=24, fmb_hidden=(2048,), fmb_tokens=16, lcb_tokens=16,
            dense_tokens=1, dense_hidden=(512,), head_hidden=(2048, 1024),
        )  # fmt: skip

    @classmethod
    def xl(cls) -> "WukongConfig":
        """GPU-sized, GEMMs about half the step: ``d = 128``, 32 + 32 tokens (with 63 sparse
        features and one dense token, 64 tokens: 8192 wide), rank 24, the FMB's MLP
        ``1536 -> 4096 -> 4096 -> 4096``, the head ``8192 -> 4096 -> 4096``; six layers."""
        return cls(
            embedding_dim=128, num_layers=6, fmb_rank=24, fmb_hidden=(4096, 4096), fmb_tokens=32, lcb_tokens=32,
            dense_tokens=1, dense_hidden=(512,), head_hidden=(4096, 4096),
        )  # fmt: skip

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> "WukongConfig":
        """From a plain mapping: ``preset`` (``"small"``/``"large"``/``"xl"``, default small) plus overrides."""
        return config_from_options(cls, options, "Wukong")


def _mlp(widths: Sequence[int], device: torch.device, *, last_plain: bool) -> nn.Sequential:
    """``Linear -> BatchNorm1d -> ReLU`` per layer; the last layer is a bare ``Linear`` when ``last_plain``."""
    layers: List[nn.Module] = []
    pairs = list(zip(widths[:-1], widths[1:]))
    for i, (fan_in, fan_out) in enumerate(pairs):
        layers.append(nn.Linear(fan_in, fan_out, device=device))
        if not (last_plain and i == len(pairs) - 1):
            layers += [nn.BatchNorm1d(fan_out, device=device), nn.ReLU()]
    return nn.Sequential(*layers)


class _TokenMix(nn.Module):
    """``n_out`` tokens as linear combinations of ``n_in`` tokens: ``(B, n_in, d) -> (B, n_out, d)``.

    The weight is a raw ``(n_in, n_out)`` Parameter applied to the token axis (the LCB, and the
    residual projection where the token count changes)."""

    def __init__(self, n_in: int, n_out: int, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out, device=device))
        nn.init.uniform_(self.weight, -1 / math.sqrt(n_in), 1 / math.sqrt(n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.transpose(1, 2) @ self.weight).transpose(1, 2)


class _FactorizationMachineBlock(nn.Module):
    """``(B, n, d) -> (B, n_F, d)``: ``MLP(LayerNorm(flatten(X (X^T Y))))``."""

    def __init__(self, n: int, config: WukongConfig, device: torch.device) -> None:
        super().__init__()
        d, k = config.embedding_dim, config.fmb_rank
        self.out_tokens, self.dim = config.fmb_tokens, d
        self.projection = nn.Parameter(torch.empty(n, k, device=device))
        nn.init.xavier_uniform_(self.projection)
        self.norm = nn.LayerNorm(n * k, device=device)
        self.mlp = _mlp((n * k, *config.fmb_hidden, config.fmb_tokens * d), device, last_plain=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = x.transpose(1, 2) @ self.projection  # (B, d, k)
        interactions = torch.bmm(x, projected)  # (B, n, k): X X^T Y
        flat = self.norm(interactions.flatten(1))
        return self.mlp(flat).view(x.shape[0], self.out_tokens, self.dim)


class WukongLayer(nn.Module):
    """One Wukong layer ``(B, n, d) -> (B, n_F + n_L, d)``.

    Example::

        >>> layer = WukongLayer(6, WukongConfig.small())
        >>> layer(torch.randn(3, 6, 16)).shape
        torch.Size([3, 8, 16])
    """

    def __init__(self, num_tokens: int, config: WukongConfig, device: Optional[torch.device] = None) -> None:
        super().__init__()
        device = torch.device("cpu") if device is None else device
        out_tokens = config.fmb_tokens + config.lcb_tokens
        self.fmb = _FactorizationMachineBlock(num_tokens, config, device)
        self.lcb = _TokenMix(num_tokens, config.lcb_tokens, device)
        self.residual = None if out_tokens == num_tokens else _TokenMix(num_tokens, out_tokens, device)
        self.norm = nn.LayerNorm(config.embedding_dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = torch.cat([self.fmb(x), self.lcb(x)], dim=1)
        shortcut = x if self.residual is None else self.residual(x)
        return self.norm(mixed + shortcut)


class WukongOverArch(nn.Module):
    """Everything after the embedding lookup: dense MLP, Wukong layers, head.

    ``(dense (B, num_dense), pooled KeyedTensor) -> logits (B,)``; its own module, as in the
    other models of the reference job, so that TorchRec's pipelines see "look up, then this".
    """

    def __init__(self, feature_names: Sequence[str], num_dense: int, config: WukongConfig,
                 device: Optional[torch.device] = None) -> None:  # fmt: skip
        super().__init__()
        device = torch.device("cpu") if device is None else device
        d = config.embedding_dim
        self.feature_names: Tuple[str, ...] = tuple(feature_names)
        self.num_dense = num_dense
        self.dense_tokens = config.dense_tokens if num_dense else 0
        self.dim = d
        self.dense_arch = (
            _mlp((num_dense, *config.dense_hidden, self.dense_tokens * d), device, last_plain=True)
            if self.dense_tokens else None
        )  # fmt: skip
        tokens = len(self.feature_names) + self.dense_tokens
        layers = []
        for _ in range(config.num_layers):
            layers.append(WukongLayer(tokens, config, device))
            tokens = config.fmb_tokens + config.lcb_tokens
        self.layers = nn.ModuleList(layers)
        self.head = _mlp((tokens * d, *config.head_hidden, 1), device, last_plain=True)

    def forward(self, dense_features: torch.Tensor, pooled) -> torch.Tensor:
        """``dense_features (B, num_dense)`` and the ``KeyedTensor`` of pooled embeddings -> ``(B,)``."""
        if dense_features.dim() != 2 or dense_features.shape[1] != self.num_dense:
            raise ValueError(f"dense_features must be (B, {self.num_dense}), got {tuple(dense_features.shape)}")
        embeddings = pooled.to_dict()
        x = torch.stack([embeddings[name] for name in self.feature_names], dim=1)  # (B, n_sparse, d)
        if self.dense_arch is not None:
            dense = self.dense_arch(dense_features).view(x.shape[0], self.dense_tokens, self.dim)
            x = torch.cat([dense, x], dim=1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.flatten(1)).squeeze(-1)


class Wukong(TablesThenOverArch):
    """The Wukong-style click model: ``(dense (B, num_dense), sparse KJT) -> logits (B,)``.

    Build it with :func:`build_wukong`.
    """


def build_wukong(
    config: WukongConfig, spec: DataSpec, device: torch.device, *, embedding_device: Optional[torch.device] = None
) -> Wukong:
    """Build the Wukong-style model for the pooled features of ``spec``.

    Args:
        config: sizes.
        spec: the data; every pooled table must be ``config.embedding_dim`` wide.
        device: for the dense part.
        embedding_device: for the tables; default ``meta`` (``DistributedModelParallel``
            materializes them). Pass ``device`` to run unsharded.

    Example::

        >>> from torchrec import KeyedJaggedTensor
        >>> from loka_job.training.data_spec import TableSpec
        >>> spec = DataSpec(num_dense=3, tables=tuple(TableSpec(f"t{i}", f"f{i}", 10, 16) for i in range(3)))
        >>> model = build_wukong(WukongConfig.small(), spec, torch.device("cpu"), embedding_device=torch.device("cpu"))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     ["f0", "f1", "f2"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 1, 1, 0, 0, 2]))
        >>> model(torch.randn(2, 3), kjt).shape
        torch.Size([2])
    """
    if not isinstance(config, WukongConfig):
        raise TypeError(f"config must be a WukongConfig, got {type(config).__name__}")
    ebc = pooled_token_tables(spec, config.embedding_dim, "WukongConfig", "Wukong", embedding_device)
    return Wukong(ebc, WukongOverArch([t.feature for t in spec.pooled_tables], spec.num_dense, config, device), config)
