"""Models written the way outside users write them, not for LoKA: the reach and code-equality tests
run LoKA on them through the README's loop.

* :class:`UserWukong`: a Wukong (arXiv 2403.02545) as a public implementation would have it: an
  ``Embedding`` module holding the sparse ``nn.Embedding`` *and* the dense features' ``nn.Linear``,
  token-mixing GEMMs on raw Parameters (``x.permute(0, 2, 1) @ self.weight``), a ``torch.bmm``
  interaction, MLPs of ``nn.Linear`` + ``nn.BatchNorm1d`` + ReLU, ``nn.LayerNorm``.
* :class:`UserHstuLayer`: an HSTU layer as its production code is written: the projections are
  ``torch.addmm`` calls on Parameters of the layer, made inside free functions and a child
  module's forward that receive the Parameters as arguments.
* :class:`KeywordHstuLayer`: the same layer with its projections in another Python module
  (``outside_hstu_ops``), to which it passes its Parameters by keyword.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import outside_hstu_ops


class Mlp(nn.Sequential):
    def __init__(self, fan_in: int, hidden: int, layers: int, fan_out: int) -> None:
        modules = []
        for _ in range(layers - 1):
            modules += [nn.Linear(fan_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU()]
            fan_in = hidden
        modules.append(nn.Linear(fan_in, fan_out))
        super().__init__(*modules)


class Embedding(nn.Module):
    """Sparse ids and dense features to tokens; named as users name it, with a dense layer inside."""

    def __init__(self, ids: int, dim: int, dense_inputs: int) -> None:
        super().__init__()
        self.dim, self.dense_inputs = dim, dense_inputs
        self.sparse = nn.Embedding(ids, dim)
        self.dense = nn.Linear(dense_inputs, dense_inputs * dim)

    def forward(self, sparse_ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        tokens = self.sparse(sparse_ids)
        return torch.cat([tokens, self.dense(dense).view(-1, self.dense_inputs, self.dim)], dim=1)


class TokenMixer(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        nn.init.kaiming_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.permute(0, 2, 1) @ self.weight).permute(0, 2, 1)


class FactorizationMachine(nn.Module):
    def __init__(self, n_in: int, n_out: int, dim: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.n_in, self.n_out, self.dim, self.rank = n_in, n_out, dim, rank
        self.weight = nn.Parameter(torch.empty(n_in, rank))
        nn.init.kaiming_uniform_(self.weight)
        self.norm = nn.LayerNorm(n_in * rank)
        self.mlp = Mlp(n_in * rank, hidden, 2, n_out * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = x.permute(0, 2, 1) @ self.weight
        interactions = torch.bmm(x, projected).view(-1, self.n_in * self.rank)
        return self.mlp(self.norm(interactions)).view(-1, self.n_out, self.dim)


class Layer(nn.Module):
    def __init__(self, n_in: int, dim: int, n_lcb: int, n_fmb: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.lcb = TokenMixer(n_in, n_lcb)
        self.fmb = FactorizationMachine(n_in, n_fmb, dim, rank, hidden)
        self.norm = nn.LayerNorm(dim)
        self.residual = TokenMixer(n_in, n_lcb + n_fmb) if n_in != n_lcb + n_fmb else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = torch.concat((self.fmb(x), self.lcb(x)), dim=1)
        return self.norm(mixed + self.residual(x))


class UserWukong(nn.Module):
    """``(sparse ids (B, n_sparse), dense (B, n_dense)) -> logits (B, 1)``."""

    def __init__(self, ids=50, sparse=6, dense=2, dim=16, layers=2, n_lcb=4, n_fmb=4, rank=4, hidden=48) -> None:
        super().__init__()
        self.embedding = Embedding(ids, dim, dense)
        n_in = sparse + dense
        stack = []
        for _ in range(layers):
            stack.append(Layer(n_in, dim, n_lcb, n_fmb, rank, hidden))
            n_in = n_lcb + n_fmb
        self.interaction = nn.Sequential(*stack)
        self.head = Mlp(n_in * dim, hidden, 2, 1)
        self.sparse, self.dense, self.ids = sparse, dense, ids

    def forward(self, sparse_ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = self.interaction(self.embedding(sparse_ids, dense))
        return self.head(x.flatten(1))

    def batch(self, rows: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.ids, (rows, self.sparse), generator=g), torch.randn(rows, self.dense, generator=g)


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """A free function, as production HSTU computes its fused projection: norm, then one addmm."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return torch.addmm(bias, normed, weight)


class _OutputProjection(nn.Module):
    """A child module handed its parent's Parameters at call time."""

    def forward(self, attended: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor):
        return torch.addmm(bias, attended * u, weight) + x


class UserHstuLayer(nn.Module):
    """One HSTU layer (jagged sequences padded to ``(B, L, D)``) with its GEMMs in helpers."""

    def __init__(self, dim: int = 32, heads: int = 2, head_dim: int = 16) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self._uvqk_weight = nn.Parameter(torch.randn(dim, 4 * heads * head_dim) * dim**-0.5)
        self._uvqk_bias = nn.Parameter(torch.zeros(4 * heads * head_dim))
        self._output_weight = nn.Parameter(torch.randn(heads * head_dim, dim) * (heads * head_dim) ** -0.5)
        self._output_bias = nn.Parameter(torch.zeros(dim))
        self._output = _OutputProjection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        flat = x.reshape(-1, dim)
        uvqk = F.silu(_project(flat, self._uvqk_weight, self._uvqk_bias, 1e-6))
        u, v, q, k = uvqk.split(self.heads * self.head_dim, dim=-1)
        shape = (batch, length, self.heads, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        scores = F.silu(q @ k.transpose(-1, -2)) / length
        scores = scores * torch.ones(length, length, device=x.device).tril()
        attended = (scores @ v).transpose(1, 2).reshape(-1, self.heads * self.head_dim)
        out = self._output(attended, u, self._output_weight, self._output_bias, flat)
        return out.view(batch, length, dim)


class KeywordHstuLayer(UserHstuLayer):
    """``UserHstuLayer``'s Parameters and math, its projections in ``outside_hstu_ops``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        flat = x.reshape(-1, dim)
        u, v, q, k = outside_hstu_ops.compute_uvqk(
            flat, norm_eps=1e-6, num_heads=self.heads, head_dim=self.head_dim,
            uvqk_weight=self._uvqk_weight, uvqk_bias=self._uvqk_bias,
        )  # fmt: skip
        shape = (batch, length, self.heads, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        scores = F.silu(q @ k.transpose(-1, -2)) / length
        scores = scores * torch.ones(length, length, device=x.device).tril()
        attended = (scores @ v).transpose(1, 2).reshape(-1, self.heads * self.head_dim)
        out = outside_hstu_ops.compute_output(attended, u, x=flat + self._output_bias, output_weight=self._output_weight)
        return out.view(batch, length, dim)


class UserHstu(nn.Module):
    """``(B, L, dim) -> (B, L)`` logits: HSTU layers, then a linear head."""

    def __init__(self, dim: int = 32, layers: int = 2, layer: type = UserHstuLayer) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).squeeze(-1)
