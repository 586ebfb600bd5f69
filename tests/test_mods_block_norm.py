"""BlockNorm: the reference formula, widths off the block grid, gradients, the block size in checkpoints."""

import pytest
import torch
from torch import nn
from torchrec.modules.activation import SwishLayerNorm

from loka_torchrec.mods import BlockNorm, ModsConfig, apply_mods, block_norm, block_rms_norm


def _reference(x: torch.Tensor, block: int, eps: float) -> torch.Tensor:
    """One block at a time, from the definition, in float64."""
    x = x.double()
    out = torch.empty_like(x)
    for start in range(0, x.shape[-1], block):
        part = x[..., start : start + block]
        out[..., start : start + block] = part / torch.sqrt((part * part).mean(-1, keepdim=True) + eps)
    return out


@pytest.mark.parametrize("width, block", [(512, 256), (300, 256), (100, 256), (7, 3), (256, 1)])
def test_matches_the_reference_formula(width, block):
    torch.manual_seed(width)
    x = torch.randn(6, 5, width, dtype=torch.float64) * 3 + 0.5
    y = BlockNorm(width, block_size=block, eps=1e-6)(x)
    torch.testing.assert_close(y, _reference(x, block, 1e-6), rtol=1e-12, atol=1e-12)
    # Each block, the tail block too (over its own size), leaves with RMS sqrt(ms / (ms + eps)).
    for s in range(0, width, block):
        mean_square = x[..., s : s + block].pow(2).mean(-1)
        rms = y[..., s : s + block].pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, (mean_square / (mean_square + 1e-6)).sqrt(), rtol=1e-12, atol=0)


def test_fp32_matches_float64_reference_within_rounding():
    x = torch.randn(64, 384)
    y = block_rms_norm(x, 256, 1e-6)
    # A few float32 roundings per element (square, mean over <= 256 terms, rsqrt, multiply).
    torch.testing.assert_close(y.double(), _reference(x, 256, 1e-6), rtol=2e-6, atol=2e-6)


def test_bfloat16_is_normalized_in_float32():
    x = (torch.randn(8, 300) * 50).to(torch.bfloat16)
    y = block_rms_norm(x, 256)
    assert y.dtype == torch.bfloat16
    expected = _reference(x.float(), 256, 1e-6).to(torch.bfloat16)  # only the final cast rounds
    torch.testing.assert_close(y, expected, rtol=2**-8, atol=0)


def test_gradients_match_finite_differences():
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: block_rms_norm(t, 4, 1e-3), (x,))


def test_has_no_parameters_and_checks_its_input_width():
    norm = BlockNorm(10, block_size=4)
    assert list(norm.parameters()) == []
    with pytest.raises(ValueError, match="width 10"):
        norm(torch.randn(2, 12))
    with pytest.raises(ValueError, match="block_size"):
        BlockNorm(10, block_size=0)


def test_state_dict_round_trip_and_block_size_mismatch():
    norm = BlockNorm(300, block_size=128)
    state = norm.state_dict()
    assert list(state) == ["block_size"] and int(state["block_size"]) == 128
    same = BlockNorm(300, block_size=128)
    same.load_state_dict(state)
    expected = r"checkpoint's block_size is 128 but this model's is 256.*ModsConfig.block_size=128"
    with pytest.raises(ValueError, match=expected):
        BlockNorm(300, block_size=256).load_state_dict(state)


def test_mismatch_is_caught_through_a_whole_model():
    def build(block):
        model = nn.Sequential(nn.Linear(4, 64), nn.LayerNorm(64), nn.Linear(64, 1))
        apply_mods(model, ModsConfig(preset="custom", block_norm=True, block_size=block))
        return model

    trained = build(32)
    build(32).load_state_dict(trained.state_dict())
    with pytest.raises(ValueError, match="key '1.block_size'"):
        build(16).load_state_dict(trained.state_dict())


def test_checkpoint_carries_the_block_size_even_if_the_buffer_was_zero_filled():
    # DistributedModelParallel zero-fills buffers it materializes from "meta".
    norm = BlockNorm(64, block_size=32, device=torch.device("meta"))
    norm._buffers["block_size"] = torch.zeros((), dtype=torch.int64)
    assert int(norm.state_dict()["block_size"]) == 32


def test_mod_replaces_layer_norms_including_the_one_inside_swish_layer_norm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 40), nn.LayerNorm(40), SwishLayerNorm(40), nn.LayerNorm([2, 20]))
    result = block_norm(model, block_size=16)
    assert result.modules == ("1", "2.norm.0")
    assert result.skipped == (("3", "normalizes over 2 dimensions"),)
    assert isinstance(model[1], BlockNorm) and isinstance(model[2].norm[0], BlockNorm)
    x = torch.randn(5, 40, dtype=torch.float64)
    model[2].double()
    expected = x * torch.sigmoid(_reference(x, 16, model[2].norm[0].eps))
    torch.testing.assert_close(model[2](x), expected, rtol=1e-12, atol=1e-12)


def test_module_filter_limits_the_mod():
    model = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))
    result = block_norm(model, block_size=4, module_filter=lambda module, fqn: fqn == "1")
    assert result.modules == ("1",) and isinstance(model[0], nn.LayerNorm)
