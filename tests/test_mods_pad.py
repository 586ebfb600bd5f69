"""pad_to_16: zero padding to multiples of 16 keeps outputs and training of the unpadded layer."""

import pytest
import torch
from torch import nn

from loka_torchrec.mods import ModsConfig, PaddedLinear, apply_mods, pad_to_16, round_up

U32 = 2.0**-24  # float32 unit roundoff


def _bound(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """How far two float32 evaluations of ``x W^T + b`` may differ: 2 gamma_{K+1} (|x| |W|^T + |b|)."""
    k = x.shape[-1] + 1
    magnitude = x.abs().double() @ weight.abs().double().T
    if bias is not None:
        magnitude = magnitude + bias.abs().double()
    return 2 * (k * U32 / (1 - k * U32)) * magnitude


@pytest.mark.parametrize("k, n", [(28, 1), (100, 37), (120, 512), (16, 20), (2047, 2049)])
def test_padded_layer_matches_the_unpadded_one(k, n):
    torch.manual_seed(k + n)
    linear = nn.Linear(k, n)
    padded = PaddedLinear.from_linear(linear)
    assert padded.linear.in_features == round_up(k, 16) and padded.linear.out_features == round_up(n, 16)
    assert padded.linear.in_features % 16 == 0 and padded.linear.out_features % 16 == 0
    x = torch.randn(33, k, requires_grad=True)
    y, y_padded = linear(x), padded(x)
    assert y_padded.shape == y.shape
    diff = (y - y_padded).abs().double()
    assert torch.all(diff <= _bound(x.detach(), linear.weight.detach(), linear.bias.detach()))
    # Against the float64 truth, both are within one GEMM's rounding.
    exact = x.detach().double() @ linear.weight.detach().double().T + linear.bias.detach().double()
    half_bound = _bound(x.detach(), linear.weight.detach(), linear.bias.detach()) / 2
    assert torch.all((y_padded.double() - exact).abs() <= half_bound)


def test_padded_weights_get_exactly_zero_gradients_and_stay_zero_under_adam():
    torch.manual_seed(0)
    linear = nn.Linear(28, 20)
    padded = PaddedLinear.from_linear(linear)
    optimizer = torch.optim.Adam(padded.parameters(), lr=0.1, weight_decay=0.01)
    for _ in range(3):
        x = torch.randn(64, 28)
        loss = padded(x).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        grad = padded.linear.weight.grad
        assert torch.all(grad[20:] == 0) and torch.all(grad[:, 28:] == 0)
        assert torch.all(padded.linear.bias.grad[20:] == 0)
        optimizer.step()
    weight = padded.linear.weight.detach()
    assert torch.all(weight[20:] == 0) and torch.all(weight[:, 28:] == 0)
    assert torch.all(padded.linear.bias.detach()[20:] == 0)


def test_weight_grad_of_the_corner_equals_the_unpadded_grad_in_float64():
    torch.manual_seed(1)
    linear = nn.Linear(28, 20).double()
    padded = PaddedLinear.from_linear(linear)
    x = torch.randn(64, 28, dtype=torch.float64)
    linear(x).sin().sum().backward()
    padded(x).sin().sum().backward()
    torch.testing.assert_close(padded.linear.weight.grad[:20, :28], linear.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(padded.linear.bias.grad[:20], linear.bias.grad, rtol=1e-12, atol=1e-12)


def test_mod_pads_every_misaligned_linear_and_keeps_the_model_function():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(28, 64), nn.SiLU(), nn.Linear(64, 100), nn.SiLU(), nn.Linear(100, 1))
    x = torch.randn(16, 28)
    before = model(x).detach()
    result = pad_to_16(model)
    assert result.modules == ("0", "2", "4")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            assert module.in_features % 16 == 0 and module.out_features % 16 == 0
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
    assert pad_to_16(model).modules == ()  # idempotent: the inner GEMMs are aligned


def test_state_dict_round_trip_and_unpadded_checkpoints_load():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(28, 30), nn.SiLU(), nn.Linear(30, 1))
    padded = nn.Sequential(nn.Linear(28, 30), nn.SiLU(), nn.Linear(30, 1))
    apply_mods(padded, ModsConfig.only("pad_to_16"))
    padded.load_state_dict(plain.state_dict())  # unpadded keys and shapes are padded on load
    x = torch.randn(4, 28)
    torch.testing.assert_close(padded(x), plain(x), rtol=1e-5, atol=1e-6)
    assert padded.state_dict()["0.linear.weight"].shape == (32, 32)
    again = nn.Sequential(nn.Linear(28, 30), nn.SiLU(), nn.Linear(30, 1))
    apply_mods(again, ModsConfig.only("pad_to_16"))
    again.load_state_dict(padded.state_dict())
    torch.testing.assert_close(again(x), padded(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"checkpoint 0.weight has shape \(30, 27\), expected \(30, 28\)"):
        again.load_state_dict({"0.weight": torch.zeros(30, 27), "0.bias": torch.zeros(30)}, strict=False)


def test_marker_of_the_prediction_layer_survives_padding():
    from loka_torchrec.mods import mark_prediction_layer, prediction_layer_fqns

    model = nn.Sequential(nn.Linear(28, 32), mark_prediction_layer(nn.Linear(32, 1)), nn.Linear(1, 1))
    pad_to_16(model)
    assert "1.linear" in prediction_layer_fqns(model)


def test_a_plain_checkpoint_loads_after_no_bias_and_padding():
    """The biases no_bias removed are unexpected keys: reported by strict=True, dropped by
    strict=False (it used to raise a self-contradictory error with a trailing dot in the name)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(28, 30), nn.SiLU(), nn.Linear(30, 1))
    modded = nn.Sequential(nn.Linear(28, 30), nn.SiLU(), nn.Linear(30, 1))
    apply_mods(modded, ModsConfig(preset="custom", no_bias=True, pad_to_16=True, keep_prediction_bias=False))
    assert modded[0].linear.bias is None
    result = modded.load_state_dict(plain.state_dict(), strict=False)
    assert "0.bias" in result.unexpected_keys and not result.missing_keys
    assert torch.equal(modded.state_dict()["0.linear.weight"][:30, :28], plain[0].weight)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "0.bias"'):
        modded.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match=r"PaddedLinear '0': checkpoint 0.weight has shape \(30, 27\)"):
        modded.load_state_dict({"0.weight": torch.zeros(30, 27)}, strict=False)
