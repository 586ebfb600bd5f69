"""HSTU's fused projections as free functions of their own Python module, as production HSTU code
has them (``hstu_compute_uqvk``, ``hstu_compute_output``): the layer passes its Parameters by
keyword, and the GEMM is a project-level ``addmm`` wrapper around ``torch.addmm``."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """The project's GEMM entry point (a kernel switch in production; torch here)."""
    return torch.addmm(input, mat1, mat2)


def compute_uvqk(
    x: torch.Tensor, norm_eps: float, num_heads: int, head_dim: int, uvqk_weight: torch.Tensor, uvqk_bias: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(N, D) -> u, v, q, k``, each ``(N, num_heads * head_dim)``, through a SiLU."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=norm_eps)
    uvqk = F.silu(addmm(uvqk_bias, normed, uvqk_weight))
    u, v, q, k = torch.split(uvqk, num_heads * head_dim, dim=1)
    return u, v, q, k


def compute_output(attended: torch.Tensor, u: torch.Tensor, x: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
    """``x + (attended * u) @ output_weight``: the residual is the GEMM's added term."""
    return torch.addmm(x, attended * u, output_weight)
