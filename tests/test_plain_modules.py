"""plain_modules: a converted model back to plain modules that compute what the original did."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loka_torchrec
from loka_torchrec import DispatchConfig, LokaConfig, LokaLinear
from loka_torchrec.dispatch.linear import GemmSite
from loka_torchrec.dispatch.sites import is_scoped
from loka_torchrec.mods import ModsConfig


class Tower(nn.Module):
    """Raw-Parameter GEMMs (``x @ W``, ``F.linear``), attention, a LayerNorm and linears."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(8, 16) / 3)  # (in, out): x @ w_in
        self.w_mix = nn.Parameter(torch.randn(16, 16) / 4)  # (out, in): F.linear
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x @ self.w_in, self.w_mix)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.mlp(self.norm(h + a)).squeeze(-1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Tower()


def _params(model):
    return {name: p for name, p in model.named_parameters()}


def test_a_converted_model_becomes_plain_again_sharing_its_parameters():
    model, reference = _model(), _model()
    x = torch.randn(4, 5, 8)
    keys = list(model.state_dict())
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise"))
    assert len(report.converted) == 6  # w_in, w_mix, in_proj, out_proj, mlp.0, mlp.2
    assert not torch.equal(model(x), reference(x))  # FP8 ran: the conversion is live
    params = _params(model)

    assert loka_torchrec.plain_modules(model) is model
    assert not [m for m in model.modules() if isinstance(m, GemmSite) or is_scoped(m)]
    assert "_loka_sites" not in dict(model.named_children())
    assert type(model.mlp[0]) is nn.Linear and type(model.mlp[2]) is nn.Linear and type(model.attn.out_proj) is nn.Linear
    assert list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in _params(model).items())  # the same Parameter objects
    for training in (True, False):
        model.train(training), reference.train(training)
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)  # the original model's computation
    model(x).sum().backward()
    assert all(p.grad is not None for p in params.values())


def test_a_layer_used_twice_stays_one_layer_and_a_lone_loka_linear_becomes_a_linear():
    shared = LokaLinear.from_linear(nn.Linear(4, 4))
    model = nn.Sequential(shared, nn.ReLU(), shared)
    loka_torchrec.plain_modules(model)
    assert type(model[0]) is nn.Linear and model[0] is model[2] and model[0].weight is shared.weight
    lone = LokaLinear.from_linear(nn.Linear(3, 2))
    plain = loka_torchrec.plain_modules(lone)
    assert type(plain) is nn.Linear and plain.weight is lone.weight


def test_mods_stay_the_checkpoint_keys_are_the_modded_models():
    """A mods-changed model has another architecture: plain_modules undoes the conversion, not the mods."""
    model = _model()
    original = set(model.state_dict())
    loka_torchrec.apply(model, LokaConfig(enabled=True, mods=ModsConfig(preset="all"), dispatch=DispatchConfig(mode="all-bf16")))
    modded = set(model.state_dict())
    assert modded != original and "norm.weight" not in modded  # BlockNorm replaced the LayerNorm's affine
    loka_torchrec.plain_modules(model)
    assert set(model.state_dict()) == modded
    assert not [m for m in model.modules() if isinstance(m, GemmSite)]
    assert type(model.norm).__name__ == "BlockNorm"


def test_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="model: expected an nn.Module, got dict"):
        loka_torchrec.plain_modules({})


def test_the_docstring_example_runs():
    import doctest

    import loka_torchrec.plain

    result = doctest.testmod(loka_torchrec.plain)
    assert result.attempted > 0 and result.failed == 0
