"""Function-level mods: F.layer_norm / F.silu / x * sigmoid(x) inside a forward get the enabled mod's
rewrite (loka_torchrec/mods/functional.py), with the numerics of the module-level mod."""

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import loka_torchrec
from loka_torchrec import LokaConfig
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.mods import ModsConfig, apply_mods, block_rms_norm
from loka_torchrec.mods.functional import function_scopes
from test_mods_unmatched import OwnRMSNorm
from test_sites import raw_hstu

BOTH = ModsConfig(preset="custom", block_norm=True, hard_swish=True, block_size=8)


class FunctionalBlock(nn.Module):
    """Norm and activations called as functions; a sigmoid gate that is not a Swish."""

    def __init__(self, dim=32):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)
        self.out_norm = OwnRMSNorm(dim)

    def forward(self, x):
        u = F.silu(self.proj(F.layer_norm(x, x.shape[-1:])))
        g = torch.sigmoid(self.gate(x))
        return self.out_norm(x + u * torch.sigmoid(u) * g)


class ModuleBlock(FunctionalBlock):
    """FunctionalBlock with the same computation in modules, for the module-level mods."""

    def __init__(self, dim=32):
        super().__init__(dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.act, self.swish = nn.SiLU(), nn.SiLU()

    def forward(self, x):
        u = self.act(self.proj(self.norm(x)))
        g = torch.sigmoid(self.gate(x))
        return self.out_norm(x + self.swish(u) * g)


class AffineNormBlock(nn.Module):
    """F.layer_norm with the module's own gamma/beta (not rewritable without dropping them), over two
    dims (not rewritable), and torch.layer_norm over the last dim (rewritten)."""

    def __init__(self, dim=32):
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        y = F.layer_norm(x, x.shape[-1:], self.gamma, self.beta) + F.layer_norm(x, x.shape[-2:])
        return y + torch.layer_norm(x, [x.shape[-1]], eps=1e-6)  # rewritten: torch.layer_norm, no affine


def _pair():
    torch.manual_seed(0)
    functional = nn.Sequential(FunctionalBlock(), FunctionalBlock(), nn.Linear(32, 1))
    modules = nn.Sequential(ModuleBlock(), ModuleBlock(), nn.Linear(32, 1))
    modules.load_state_dict(functional.state_dict())
    return functional, modules


def test_function_level_rewrite_computes_what_the_module_level_mod_computes():
    functional, modules = _pair()
    x = torch.randn(4, 6, 32)
    before, keys = functional(x), list(functional.state_dict())
    report, module_report = apply_mods(functional, BOTH), apply_mods(modules, BOTH)
    assert module_report["block_norm"].modules == ("0.norm", "1.norm")
    y, y_module = functional(x), modules(x)
    y.square().mean().backward()
    y_module.square().mean().backward()
    torch.testing.assert_close(y, y_module, rtol=0, atol=0)
    for (name, p), p_module in zip(functional.named_parameters(), modules.parameters()):
        torch.testing.assert_close(p.grad, p_module.grad, rtol=0, atol=0, msg=name)
    assert (before - y).abs().max() > 1e-2  # the rewrite changed the model
    assert list(functional.state_dict()) == keys
    scopes = function_scopes(functional)
    assert sorted(scopes) == ["0", "1"]
    assert scopes["0"].rewritten == {"F.layer_norm -> block_rms_norm": 1, "F.silu -> F.hardswish": 1, "x * sigmoid(x) -> F.hardswish": 1}
    # the report: which call, which modules, how many; what stays unrewritten is still said
    block, swish = report["block_norm"], report["hard_swish"]
    assert block.functions == ("F.layer_norm -> block_rms_norm in FunctionalBlock.forward (0, 1): 1 call(s) each",)
    assert block.unmatched == "no nn.LayerNorm modules; OwnRMSNorm modules (0.out_norm, 1.out_norm), which block_norm does not rewrite"
    assert swish.functions == (
        "F.silu -> F.hardswish in FunctionalBlock.forward (0, 1): 1 call(s) each",
        "x * sigmoid(x) -> F.hardswish in FunctionalBlock.forward (0, 1): 1 call(s) each",
    )
    assert "function level: F.silu -> F.hardswish" in str(report) and report.changed
    assert report.to_dict()["mods"]["hard_swish"]["functions"] == list(swish.functions)


def test_only_the_enabled_mod_rewrites_and_a_model_without_calls_is_untouched():
    functional, modules = _pair()
    x = torch.randn(3, 32)
    ref = functional(x)
    report = apply_mods(functional, ModsConfig.only("hard_swish"))
    assert report["hard_swish"].functions and function_scopes(functional)["0"].mods == ("hard_swish",)
    y = functional(x)
    assert function_scopes(functional)["0"].rewritten.get("F.layer_norm -> block_rms_norm") is None
    assert not torch.equal(y, ref)
    untouched = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), OwnRMSNorm(8))
    forwards = [m.__dict__.get("forward") for m in untouched.modules()]
    report = apply_mods(untouched, BOTH)
    assert [m.__dict__.get("forward") for m in untouched.modules()] == forwards == [None] * 4
    assert report["block_norm"].functions == () and report["hard_swish"].functions == () and not report.changed
    assert apply_mods(functional, ModsConfig()).results == ()  # preset none: no function-level rewrite either


def test_layer_norms_with_affine_parameters_or_several_dims_are_kept_with_the_reason():
    model = AffineNormBlock()
    apply_mods(model, BOTH)
    x = torch.randn(5, 32)
    kept = F.layer_norm(x, (32,), model.gamma, model.beta) + F.layer_norm(x, (5, 32))
    torch.testing.assert_close(model(x), kept + block_rms_norm(x, 8, 1e-6), rtol=0, atol=0)
    mode = function_scopes(model)[""]
    assert mode.rewritten == {"F.layer_norm -> block_rms_norm": 1}
    assert mode.kept == {
        "F.layer_norm -> block_rms_norm: has a weight or bias that the rewrite would leave unused": 1,
        "F.layer_norm -> block_rms_norm: normalizes over 2 dimensions": 1,
    }


def test_rewritten_scopes_and_dispatch_sites_compile_fullgraph_without_graph_breaks():
    """The raw HSTU model (F.layer_norm x2, F.silu x2, a sigmoid gate) with both mods and FP8 sites."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32)
    model = raw_hstu()
    report = loka_torchrec.apply(model, LokaConfig(mods=BOTH, dispatch=DispatchConfig(mode="all:emulated:rowwise")))
    assert report.mods["block_norm"].functions == ("F.layer_norm -> block_rms_norm in RawHstuBlock.forward (0, 1): 2 call(s) each",)
    assert report.mods["hard_swish"].functions == ("F.silu -> F.hardswish in RawHstuBlock.forward (0, 1): 2 call(s) each",)
    y_eager = model(x)
    layers = report.dispatcher.managed_layers()
    assert layers["0._uvqk_weight"].last_rows == 32  # the sites still run inside the rewritten forward
    assert function_scopes(model)["0"].rewritten == {"F.layer_norm -> block_rms_norm": 2, "F.silu -> F.hardswish": 2}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    for _ in range(2):
        y = compiled(x)
        y.square().mean().backward()
    assert not counters["graph_break"]
    torch.testing.assert_close(y, y_eager, rtol=1e-4, atol=1e-4)
