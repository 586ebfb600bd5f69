"""fuse_siblings: one GEMM for sibling linears, identical outputs, checkpoints of either layout."""

import pytest
import torch
from torch import nn

from loka_torchrec.mods import ModsConfig, SiblingLinears, apply_mods, fuse_siblings, no_bias


def _pair(k, widths, bias=True):
    torch.manual_seed(k)
    group = SiblingLinears(k, [(f"m{i}", w) for i, w in enumerate(widths)], bias=bias)
    fused = SiblingLinears(k, [(f"m{i}", w) for i, w in enumerate(widths)], bias=bias)
    fused.load_state_dict(group.state_dict())
    assert fused.fuse() is None and fused.is_fused
    return group, fused


U32 = 2.0**-24  # float32 unit roundoff


@pytest.mark.parametrize(
    "k, widths", [(8, (4, 4, 6)), (100, (37, 50, 13)), (512, (128, 128, 256, 256)), (2048, (512, 512))]
)
def test_fused_outputs_equal_the_unfused_ones(k, widths):
    group, fused = _pair(k, widths)
    x = torch.randn(257, k)
    gamma = (k + 1) * U32 / (1 - (k + 1) * U32)
    for name, a, b in zip(group.names, group(x), fused(x)):
        assert a.shape == b.shape
        member = group.members[name]
        # The same dot products; the GEMM kernel may order the K sum differently for another N.
        magnitude = x.abs().double() @ member.weight.detach().abs().double().T + member.bias.detach().abs().double()
        bound = 2 * gamma * magnitude
        assert torch.all((a - b).abs().double() <= bound)
    x64 = x.double()
    group64, fused64 = group.double(), fused.double()
    for a, b in zip(group64(x64), fused64(x64)):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_gradients_match():
    group, fused = _pair(100, (37, 50, 13))
    x1 = torch.randn(64, 100, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    sum((o * o).sum() for o in group(x1)).backward()
    sum((o * o).sum() for o in fused(x2)).backward()
    weight_grads = torch.cat([group.members[n].weight.grad for n in group.names])
    torch.testing.assert_close(fused.fused.weight.grad, weight_grads, rtol=1e-6, atol=1e-6)
    # dgrad sums over N in a different grouping (one GEMM instead of one per member plus adds).
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)


def test_checkpoints_load_in_either_layout():
    group, fused = _pair(16, (8, 24))
    x = torch.randn(5, 16)
    assert set(fused.state_dict()) == {"fused.weight", "fused.bias"}
    unfused = SiblingLinears(16, [("m0", 8), ("m1", 24)])
    unfused.load_state_dict(fused.state_dict())
    for a, b in zip(unfused(x), group(x)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="has 31 rows, expected 32"):
        unfused.load_state_dict({"fused.weight": torch.zeros(31, 16), "fused.bias": torch.zeros(31)})


def test_mixed_biases_are_not_fused_and_the_report_says_why():
    model = nn.ModuleDict({"a": SiblingLinears(8, {"u": 4, "v": 4}), "b": SiblingLinears(8, {"q": 4})})
    no_bias(model, keep_bias=["a.members.u"], keep_prediction_bias=False)
    result = fuse_siblings(model)
    assert result.modules == ("b",)
    assert result.skipped == (("a", "some members have a bias and some do not"),)
    assert fuse_siblings(model).skipped[-1] == ("b", "already fused")


def test_fuse_then_pad_keeps_the_outputs():
    group, _ = _pair(20, (10, 30))
    model = nn.ModuleDict({"g": group})
    x = torch.randn(7, 20)
    before = [t.detach() for t in group(x)]
    report = apply_mods(model, ModsConfig(preset="custom", fuse_siblings=True, pad_to_16=True))
    assert report["fuse_siblings"].modules == ("g",) and report["pad_to_16"].modules == ("g.fused",)
    assert model["g"].fused.linear.out_features == 48 and model["g"].fused.linear.in_features == 32
    for a, b in zip(model["g"](x), before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_member_validation():
    with pytest.raises(ValueError, match="unique"):
        SiblingLinears(4, [("a", 2), ("a", 2)])
    with pytest.raises(ValueError, match="out_features"):
        SiblingLinears(4, {"a": 0})
