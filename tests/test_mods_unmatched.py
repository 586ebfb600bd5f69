"""Mods that match no module say why: the norm classes and functional calls they do not rewrite."""

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


def test_mods_that_match_no_module_name_the_calls_and_classes_they_cannot_rewrite():
    model = nn.Sequential(FunctionalBlock(32), FunctionalBlock(32), nn.Linear(32, 1))
    before = [p.detach().clone() for p in model.parameters()]
    report = apply_mods(model, ModsConfig(preset="custom", block_norm=True, hard_swish=True))
    block, swish = report["block_norm"], report["hard_swish"]
    assert block.modules == () and swish.modules == ()
    # F.layer_norm, F.silu and u * sigmoid(u) are rewritten at the function level (test_mods_functional.py)
    assert block.unmatched == (
        "no nn.LayerNorm modules; OwnRMSNorm modules (0.out_norm, 1.out_norm), which block_norm does not rewrite"
    )
    assert block.functions == ("F.layer_norm -> block_rms_norm in FunctionalBlock.forward (0, 1): 1 call(s) each",)
    assert swish.unmatched == "no nn.SiLU modules" and len(swish.functions) == 2
    assert "block_norm: 0 module(s) (no nn.LayerNorm modules; OwnRMSNorm modules" in str(report)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no Parameter was changed


def test_norm_calls_without_a_rewrite_are_named():
    class RmsBlock(nn.Module):
        def forward(self, x):
            return F.rms_norm(x, x.shape[-1:])

    report = apply_mods(nn.Sequential(RmsBlock()), ModsConfig(preset="custom", block_norm=True))
    assert report["block_norm"].functions == ()
    assert report["block_norm"].unmatched == (
        "no nn.LayerNorm modules; this model calls F.rms_norm in RmsBlock.forward (0), which block_norm does not rewrite"
    )


def test_a_mod_that_matched_says_nothing_more_and_a_plain_model_says_no_modules():
    matched = apply_mods(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), ModsConfig(preset="custom", block_norm=True))
    assert matched["block_norm"].modules == ("1",) and matched["block_norm"].unmatched == ""
    plain = apply_mods(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), ModsConfig(preset="custom", block_norm=True, hard_swish=True))
    assert plain["block_norm"].unmatched == "no nn.LayerNorm modules"
    assert plain["hard_swish"].unmatched == "no nn.SiLU modules"
    builtin = apply_mods(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), ModsConfig(preset="custom", block_norm=True))
    assert builtin["block_norm"].unmatched == "no nn.LayerNorm modules; nn.BatchNorm1d modules (1), which block_norm does not rewrite"
