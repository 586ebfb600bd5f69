"""Mods that match nothing say why: functional calls and norm classes a module swap cannot see."""

import torch
import torch.nn.functional as F
from torch import nn

from loka_torchrec.mods import ModsConfig, apply_mods


class OwnRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class FunctionalBlock(nn.Module):
    """An HSTU-style block as users write it: norms and activations called as functions."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.out_norm = OwnRMSNorm(dim)

    def forward(self, x):
        u = F.silu(self.proj(F.layer_norm(x, x.shape[-1:])))
        return self.out_norm(x + u * torch.sigmoid(u))


def test_mods_that_match_nothing_name_the_calls_and_classes_they_cannot_rewrite():
    model = nn.Sequential(FunctionalBlock(32), FunctionalBlock(32), nn.Linear(32, 1))
    before = [p.detach().clone() for p in model.parameters()]
    report = apply_mods(model, ModsConfig(preset="custom", block_norm=True, hard_swish=True))
    block, swish = report["block_norm"], report["hard_swish"]
    assert block.modules == () and swish.modules == ()
    assert block.unmatched == (
        "no nn.LayerNorm modules; this model calls F.layer_norm in FunctionalBlock.forward (0, 1); "
        "OwnRMSNorm modules (0.out_norm, 1.out_norm), which block_norm does not rewrite"
    )
    assert swish.unmatched.startswith("no nn.SiLU modules; this model calls F.silu in FunctionalBlock.forward (0, 1)")
    assert "x * sigmoid(x) in FunctionalBlock.forward" in swish.unmatched
    assert "block_norm: 0 module(s) (no nn.LayerNorm modules; this model calls F.layer_norm" in str(report)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was changed


def test_a_mod_that_matched_says_nothing_more_and_a_plain_model_says_no_modules():
    matched = apply_mods(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), ModsConfig(preset="custom", block_norm=True))
    assert matched["block_norm"].modules == ("1",) and matched["block_norm"].unmatched == ""
    plain = apply_mods(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), ModsConfig(preset="custom", block_norm=True, hard_swish=True))
    assert plain["block_norm"].unmatched == "no nn.LayerNorm modules"
    assert plain["hard_swish"].unmatched == "no nn.SiLU modules"
    builtin = apply_mods(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), ModsConfig(preset="custom", block_norm=True))
    assert builtin["block_norm"].unmatched == "no nn.LayerNorm modules; nn.BatchNorm1d modules (1), which block_norm does not rewrite"
