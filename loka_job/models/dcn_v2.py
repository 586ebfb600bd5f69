"""DCN-V2 as its paper describes it, written as users write it with TorchRec's modules.

After "DCN V2: Improved Deep & Cross Network and Practical Lessons for Web-scale Learning to Rank
Systems" (arXiv 2008.13535). The input ``x_0`` is the concatenation of the pooled embedding of
every sparse feature and of the dense features projected to one more ``d``-wide embedding (as
TorchRec's ``DLRM_DCN`` does, so the width is ``(num_sparse + 1) * d``). A cross network of
``cross_layers`` layers, each

    x_{l+1} = x_0 * (W_l x_l + b_l) + x_l                                    (``cross: full``)
    x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l                              (``cross: low_rank``)
    x_{l+1} = sum_i softmax(g(x_l))_i x_0 * (U_li a(C_li a(V_li x_l)) + b_l) + x_l   (``cross: mixture``)

and a deep network (an MLP with ReLU) are combined in the paper's two structures:

* ``stacked``: ``logit = w^T deep(cross(x_0))``;
* ``parallel``: ``logit = w^T [cross(x_0), deep(x_0)]``.

This module is deliberately not written for LoKA (it is a member of the model zoo that checks
LoKA on models it was not designed around): the cross networks are TorchRec's ``CrossNet``
(``torch.matmul(W_l, x_l)`` on raw ``(N, N)`` Parameters), ``LowRankCrossNet`` (``F.linear`` on
raw Parameters) and ``LowRankMixtureCrossNet`` (per-expert slices of 3-D Parameters), the deep
network is TorchRec's ``MLP``, and nothing is marked or grouped for the mods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from loka_job.models.options import config_from_options, int_tuple, pooled_token_tables, positive_int
from loka_job.models.click_model import TablesThenOverArch
from loka_job.training.data_spec import DataSpec

__all__ = ["CROSS_KINDS", "STRUCTURES", "DcnV2Config", "DcnV2OverArch", "DcnV2", "build_dcn_v2"]

CROSS_KINDS = ("full", "low_rank", "mixture")
STRUCTURES = ("stacked", "parallel")


@dataclasses.dataclass(frozen=True)
class DcnV2Config:
    """Every size of the DCN-V2 model.

    Attributes:
        embedding_dim: ``d``, the width of every embedding (the tables' ``embedding_dim``).
        dense_hidden: hidden widths of the MLP that projects the dense features to ``d``.
        cross: ``"full"`` (``CrossNet``), ``"low_rank"`` (``LowRankCrossNet``) or
            ``"mixture"`` (``LowRankMixtureCrossNet``).
        cross_layers: layers of the cross network.
        low_rank: ``r``, the rank of ``low_rank`` and of each ``mixture`` expert.
        num_experts: experts per ``mixture`` layer.
        structure: ``"stacked"`` (deep after cross) or ``"parallel"`` (side by side).
        deep_hidden: widths of the deep network's layers (empty: no deep network, and in
            ``stacked`` the logit reads the cross network's output).

    Example::

        >>> DcnV2Config.small().cross, DcnV2Config.xl().deep_hidden
        ('full', (4096, 4096))
        >>> DcnV2Config.from_options({"preset": "small", "cross": "mixture"}).num_experts
        4
    """

    embedding_dim: int = 16
    dense_hidden: Tuple[int, ...] = (32,)
    cross: str = "full"
    cross_layers: int = 2
    low_rank: int = 16
    num_experts: int = 4
    structure: str = "stacked"
    deep_hidden: Tuple[int, ...] = (64, 32)

    def __post_init__(self) -> None:
        for field in ("embedding_dim", "cross_layers", "low_rank", "num_experts"):
            positive_int(getattr(self, field), field, "DcnV2Config")
        if self.cross not in CROSS_KINDS:
            raise ValueError(f"DcnV2Config.cross must be one of {CROSS_KINDS}, got {self.cross!r}")
        if self.structure not in STRUCTURES:
            raise ValueError(f"DcnV2Config.structure must be one of {STRUCTURES}, got {self.structure!r}")
        for field in ("dense_hidden", "deep_hidden"):
            object.__setattr__(self, field, int_tuple(getattr(self, field), field, "DcnV2Config"))

    @classmethod
    def small(cls) -> "DcnV2Config":
        """CPU-sized: ``d = 16``, two full-rank cross layers, stacked on a deep ``64 -> 32``."""
        return cls()

    @classmethod
    def large(cls) -> "DcnV2Config":
        """GPU-sized: ``d = 128``; with 31 sparse features and the dense embedding, a 4096-wide
        ``x_0``: three full-rank cross layers ``4096 x 4096``, stacked on a deep ``4096 -> 2048``."""
        return cls(embedding_dim=128, dense_hidden=(512,), cross_layers=3, deep_hidden=(4096, 2048))

    @classmethod
    def xl(cls) -> "DcnV2Config":
        """GPU-sized: ``d = 128``; with 63 sparse features and the dense embedding, an 8192-wide
        ``x_0``: three full-rank cross layers ``8192 x 8192``, stacked on a deep ``8192 -> 4096 -> 4096``."""
        return cls(embedding_dim=128, dense_hidden=(512,), cross_layers=3, deep_hidden=(4096, 4096))

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> "DcnV2Config":
        """From a plain mapping: ``preset`` (``"small"``/``"large"``/``"xl"``, default small) plus overrides."""
        return config_from_options(cls, options, "DCNv2")


def _cross_network(width: int, config: DcnV2Config) -> nn.Module:
    from torchrec.modules.crossnet import CrossNet, LowRankCrossNet, LowRankMixtureCrossNet

    if config.cross == "full":
        return CrossNet(width, config.cross_layers)
    if config.cross == "low_rank":
        return LowRankCrossNet(width, config.cross_layers, low_rank=config.low_rank)
    return LowRankMixtureCrossNet(width, config.cross_layers, num_experts=config.num_experts, low_rank=config.low_rank)


class DcnV2OverArch(nn.Module):
    """Everything after the embedding lookup: dense projection, cross and deep networks, logit.

    ``(dense (B, num_dense), pooled KeyedTensor) -> logits (B,)``; its own module, as in the other
    models of the reference job, so that TorchRec's pipelines see "look up, then this".

    Example::

        >>> from torchrec import KeyedTensor
        >>> arch = DcnV2OverArch(["f0", "f1"], 3, DcnV2Config.small())
        >>> pooled = KeyedTensor.from_tensor_list(["f0", "f1"], [torch.randn(4, 16), torch.randn(4, 16)])
        >>> arch(torch.randn(4, 3), pooled).shape
        torch.Size([4])
    """

    def __init__(self, feature_names: Sequence[str], num_dense: int, config: DcnV2Config,
                 device: Optional[torch.device] = None) -> None:  # fmt: skip
        super().__init__()
        from torchrec.modules.mlp import MLP

        device = torch.device("cpu") if device is None else device
        d = config.embedding_dim
        self.feature_names: Tuple[str, ...] = tuple(feature_names)
        self.num_dense, self.structure = num_dense, config.structure
        self.dense_arch = MLP(num_dense, [*config.dense_hidden, d], device=device) if num_dense else None
        self.width = (len(self.feature_names) + (1 if num_dense else 0)) * d
        with torch.device(device):  # TorchRec's cross networks take no device argument
            self.cross = _cross_network(self.width, config)
        self.deep = MLP(self.width, list(config.deep_hidden), device=device)
        deep_out = config.deep_hidden[-1] if config.deep_hidden else self.width
        self.logit = nn.Linear(deep_out + (self.width if config.structure == "parallel" else 0), 1, device=device)

    def forward(self, dense_features: torch.Tensor, pooled) -> torch.Tensor:
        """``dense_features (B, num_dense)`` and the ``KeyedTensor`` of pooled embeddings -> ``(B,)``."""
        if dense_features.dim() != 2 or dense_features.shape[1] != self.num_dense:
            raise ValueError(f"dense_features must be (B, {self.num_dense}), got {tuple(dense_features.shape)}")
        embeddings = pooled.to_dict()
        parts = [embeddings[name] for name in self.feature_names]
        if self.dense_arch is not None:
            parts.insert(0, self.dense_arch(dense_features))
        x0 = torch.cat(parts, dim=1)  # (B, width)
        if self.structure == "stacked":
            return self.logit(self.deep(self.cross(x0))).squeeze(-1)
        return self.logit(torch.cat([self.cross(x0), self.deep(x0)], dim=1)).squeeze(-1)


class DcnV2(TablesThenOverArch):
    """The DCN-V2 click model: ``(dense (B, num_dense), sparse KJT) -> logits (B,)``.

    Build it with :func:`build_dcn_v2`.
    """


def build_dcn_v2(
    config: DcnV2Config, spec: DataSpec, device: torch.device, *, embedding_device: Optional[torch.device] = None
) -> DcnV2:
    """Build DCN-V2 for the pooled features of ``spec``.

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
        >>> model = build_dcn_v2(DcnV2Config.small(), spec, torch.device("cpu"), embedding_device=torch.device("cpu"))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     ["f0", "f1", "f2"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 1, 1, 0, 0, 2]))
        >>> model(torch.randn(2, 3), kjt).shape, model.over_arch.width
        (torch.Size([2]), 64)
    """
    if not isinstance(config, DcnV2Config):
        raise TypeError(f"config must be a DcnV2Config, got {type(config).__name__}")
    ebc = pooled_token_tables(spec, config.embedding_dim, "DcnV2Config", "DCNv2", embedding_device)
    return DcnV2(ebc, DcnV2OverArch([t.feature for t in spec.pooled_tables], spec.num_dense, config, device), config)
