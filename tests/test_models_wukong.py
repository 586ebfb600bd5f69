"""The Wukong-style model of the zoo: shapes, gradients to every dense parameter, config errors."""

import pytest
import torch

from test_models_dhen import _batch, _spec

from loka_job.models.wukong import WukongConfig, WukongLayer, build_wukong

CPU = torch.device("cpu")


def _model(config=None, spec=None, seed=0):
    torch.manual_seed(seed)
    return build_wukong(config or WukongConfig.small(), spec or _spec(dim=16), CPU, embedding_device=CPU)


@pytest.mark.parametrize("tokens", [(4, 4), (3, 6)])  # n_F + n_L == n_in after layer 1; a residual projection
def test_forward_backward_shapes_and_every_parameter_gets_a_gradient(tokens):
    config = WukongConfig(fmb_tokens=tokens[0], lcb_tokens=tokens[1])
    spec = _spec(dim=16)
    model = _model(config, spec)
    dense, kjt = _batch(spec, batch=8)
    logits = model(dense, kjt)
    assert logits.shape == (8,)
    logits.square().mean().backward()
    for name, p in model.over_arch.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_a_layer_is_the_paper_formula():
    """``LayerNorm(concat(MLP(LN(flatten(X X^T Y))), W^T X) + residual)`` against float64."""
    torch.manual_seed(0)
    layer = WukongLayer(5, WukongConfig(fmb_tokens=2, lcb_tokens=3, fmb_hidden=(8,))).double().eval()
    x = torch.randn(4, 5, 16, dtype=torch.float64)
    fmb = layer.fmb
    interactions = torch.einsum("bnd,bmd,mk->bnk", x, x, fmb.projection).flatten(1)
    fm_tokens = fmb.mlp(fmb.norm(interactions)).view(4, 2, 16)
    lcb_tokens = torch.einsum("bnd,nl->bld", x, layer.lcb.weight)
    expected = layer.norm(torch.cat([fm_tokens, lcb_tokens], 1) + x)  # 2 + 3 == 5 tokens: identity shortcut
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"fmb_rank": 0}, "WukongConfig.fmb_rank must be an int >= 1"),
        ({"dense_tokens": -1}, "WukongConfig.dense_tokens must be an int >= 0"),
        ({"fmb_hidden": 7}, "WukongConfig.fmb_hidden must be a sequence of ints"),
        ({"preset": "huge"}, "model.preset must be one of"),
        ({"bogus": 1}, "model: unknown Wukong option(s) ['bogus']"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        WukongConfig.from_options(options)


def test_tables_must_be_as_wide_as_the_tokens():
    with pytest.raises(ValueError, match="data.embedding_dim: table 't0' is 32 wide but WukongConfig.embedding_dim is 16"):
        _model(spec=_spec(dim=32))


def test_docstring_examples_run():
    import doctest

    from loka_job.models import wukong

    result = doctest.testmod(wukong)
    assert result.attempted > 0 and result.failed == 0
