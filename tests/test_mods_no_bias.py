"""No Bias: which biases go, which stay, what it does to the outputs, checkpoints."""

import pytest
import torch
from torch import nn

from loka_torchrec.mods import ModsConfig, apply_mods, mark_prediction_layer, no_bias, prediction_layer_fqns


def _model(mark: bool = True) -> nn.Module:
    torch.manual_seed(0)
    last = nn.Linear(16, 1)
    hidden = nn.Sequential(nn.Linear(16, 16), nn.SiLU())
    return nn.Sequential(nn.Linear(8, 16), nn.SiLU(), hidden, mark_prediction_layer(last) if mark else last)


def test_removes_every_bias_but_the_prediction_layer_and_equals_zeroing_them():
    model = _model()
    reference = _model()
    with torch.no_grad():
        reference[0].bias.zero_()
        reference[2][0].bias.zero_()
    result = no_bias(model)
    assert result.modules == ("0", "2.0")
    assert model[0].bias is None and model[2][0].bias is None
    assert model[3].bias is not None
    assert "0.bias" not in dict(model.named_parameters())
    x = torch.randn(5, 8)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_changes_the_outputs_of_a_model_with_nonzero_biases():
    model, original = _model(), _model()
    no_bias(model)
    x = torch.randn(5, 8)
    assert not torch.allclose(model(x), original(x))


def test_keep_globs_and_unmarked_models():
    model = _model(mark=False)
    assert prediction_layer_fqns(model) == ("3",)  # the last linear when nothing is marked
    result = no_bias(model, keep_bias=["2.*"])
    assert result.modules == ("0",)
    assert dict(result.skipped) == {"2.0": "matches keep_bias", "3": "final prediction layer"}
    everything = no_bias(_model(), keep_prediction_bias=False)
    assert everything.modules == ("0", "2.0", "3")


def test_state_dict_round_trip():
    model = _model()
    no_bias(model)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 16), nn.SiLU()), nn.Linear(16, 1))
    apply_mods(fresh, ModsConfig(preset="custom", no_bias=True))
    fresh.load_state_dict(model.state_dict())  # strict: the key sets agree
    x = torch.randn(3, 8)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fresh.load_state_dict(_model().state_dict())


def test_mark_prediction_layer_wants_a_linear():
    with pytest.raises(TypeError, match="nn.Linear"):
        mark_prediction_layer(nn.SiLU())
