"""Hard Swish: values and gradients of x * relu6(x + 3) / 6, and what the mod swaps."""

import torch
from torch import nn
from torchrec.modules.activation import SwishLayerNorm

from loka_torchrec.mods import hard_swish, hard_swish_reference


def _grid() -> torch.Tensor:
    dense = torch.linspace(-6, 6, 2401, dtype=torch.float64)
    return torch.cat([dense, torch.tensor([-1e4, -3.0, -2.999, 0.0, 2.999, 3.0, 1e4], dtype=torch.float64)])


def test_values_follow_the_formula_piece_by_piece():
    x = _grid()
    y = nn.Hardswish()(x)
    torch.testing.assert_close(y, hard_swish_reference(x), rtol=1e-15, atol=1e-15)
    assert torch.all(y[x <= -3] == 0)
    torch.testing.assert_close(y[x >= 3], x[x >= 3], rtol=2**-52, atol=0)  # x * 6 / 6: one rounding at most
    mid = (x > -3) & (x < 3)
    torch.testing.assert_close(y[mid], x[mid] * (x[mid] + 3) / 6, rtol=1e-15, atol=1e-15)
    # The largest gap to SiLU, at x = +-3, is 3 * sigmoid(-3) = 0.1423.
    gap = (y - torch.nn.functional.silu(x)).abs().max().item()
    assert abs(gap - 3 * torch.sigmoid(torch.tensor(-3.0, dtype=torch.float64)).item()) < 1e-9


def test_gradients_are_the_piecewise_derivative():
    x = _grid()
    x = x[(x - 3).abs().gt(1e-9) & (x + 3).abs().gt(1e-9)].clone().requires_grad_(True)  # off the kinks
    (grad,) = torch.autograd.grad(nn.Hardswish()(x).sum(), x)
    expected = torch.where(x < -3, torch.zeros_like(x), torch.where(x > 3, torch.ones_like(x), (2 * x + 3) / 6))
    torch.testing.assert_close(grad, expected.detach(), rtol=1e-14, atol=1e-14)
    (ref_grad,) = torch.autograd.grad(hard_swish_reference(x).sum(), x)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-14, atol=1e-14)


def test_mod_swaps_silu_modules_and_the_swish_layer_norm_gate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), SwishLayerNorm(8), nn.Sequential(nn.SiLU(), nn.Sigmoid()))
    result = hard_swish(model)
    assert result.modules == ("1", "3.0", "2.norm.1")
    assert isinstance(model[1], nn.Hardswish) and isinstance(model[3][0], nn.Hardswish)
    assert isinstance(model[3][1], nn.Sigmoid)  # a plain sigmoid is not a swish
    x = torch.randn(16, 8, dtype=torch.float64) * 3
    model[2].double()
    layer_norm = model[2].norm[0]
    expected = x * torch.clamp(layer_norm(x) + 3, 0, 6) / 6
    torch.testing.assert_close(model[2](x), expected, rtol=1e-15, atol=1e-15)
    assert hard_swish(model).modules == ()  # nothing left to swap
