"""DCN-V2 of the zoo: shapes, gradients to every dense parameter for each cross network and
structure, the paper's formulas in float64, config errors."""

import pytest
import torch
from torchrec import KeyedTensor

from test_models_dhen import _batch, _spec

from loka_job.models.dcn_v2 import CROSS_KINDS, STRUCTURES, DcnV2Config, DcnV2OverArch, build_dcn_v2

CPU = torch.device("cpu")


def _model(config=None, spec=None, seed=0):
    torch.manual_seed(seed)
    return build_dcn_v2(config or DcnV2Config.small(), spec or _spec(dim=16), CPU, embedding_device=CPU)


@pytest.mark.parametrize("cross", CROSS_KINDS)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_forward_backward_shapes_and_every_parameter_gets_a_gradient(cross, structure):
    spec = _spec(dim=16)
    model = _model(DcnV2Config(cross=cross, structure=structure, low_rank=4, num_experts=3), spec)
    assert model.over_arch.width == (len(spec.pooled_tables) + 1) * 16
    dense, kjt = _batch(spec, batch=8)
    logits = model(dense, kjt)
    assert logits.shape == (8,)
    logits.square().mean().backward()
    for name, p in model.over_arch.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def _arch(config, num_features=3, num_dense=2):
    torch.manual_seed(0)
    return DcnV2OverArch([f"f{i}" for i in range(num_features)], num_dense, config).double()


def _inputs(arch, batch=5):
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(batch, arch.num_dense, generator=g, dtype=torch.float64)
    tensors = [torch.randn(batch, 16, generator=g, dtype=torch.float64) for _ in arch.feature_names]
    return dense, KeyedTensor.from_tensor_list(list(arch.feature_names), tensors), tensors


def _x0(arch, dense, tensors):
    return torch.cat([arch.dense_arch(dense), *tensors], dim=1)  # the dense embedding first, then the features


def test_stacked_full_rank_is_the_paper_formula():
    """``logit = w^T deep(x_L)``, ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l``, against float64."""
    arch = _arch(DcnV2Config(cross="full", cross_layers=2, structure="stacked"))
    dense, pooled, tensors = _inputs(arch)
    x0 = _x0(arch, dense, tensors)
    x = x0
    for kernel, bias in zip(arch.cross.kernels, arch.cross.bias):
        x = x0 * (x @ kernel.T + bias[:, 0]) + x
    expected = (arch.deep(x) @ arch.logit.weight.T + arch.logit.bias).squeeze(-1)
    torch.testing.assert_close(arch(dense, pooled), expected)


def test_parallel_mixture_of_low_rank_experts_is_the_paper_formula():
    """``logit = w^T [x_L, deep(x_0)]`` with ``x_{l+1} = sum_i softmax(g(x_l))_i x_0 * (U_i
    relu(C_i relu(V_i x_l)) + b) + x_l``, against float64."""
    arch = _arch(DcnV2Config(cross="mixture", cross_layers=2, low_rank=3, num_experts=2, structure="parallel"))
    dense, pooled, tensors = _inputs(arch)
    x0 = _x0(arch, dense, tensors)
    cross = arch.cross
    x = x0
    for layer in range(2):
        gates = torch.softmax(torch.cat([gate(x) for gate in cross.gates], dim=1), dim=1)  # (B, experts)
        experts = []
        for i in range(2):
            low = torch.relu(torch.relu(x @ cross.V_kernels[layer][i].T) @ cross.C_kernels[layer][i].T)
            experts.append(x0 * (low @ cross.U_kernels[layer][i].T + cross.bias[layer][:, 0]))
        x = sum(gates[:, i : i + 1] * experts[i] for i in range(2)) + x
    features = torch.cat([x, arch.deep(x0)], dim=1)
    expected = (features @ arch.logit.weight.T + arch.logit.bias).squeeze(-1)
    torch.testing.assert_close(arch(dense, pooled), expected)


def test_low_rank_cross_is_the_paper_formula():
    arch = _arch(DcnV2Config(cross="low_rank", cross_layers=1, low_rank=4, deep_hidden=()))
    dense, pooled, tensors = _inputs(arch)
    x0 = _x0(arch, dense, tensors)
    cross = arch.cross
    x1 = x0 * (x0 @ cross.V_kernels[0].T @ cross.W_kernels[0].T + cross.bias[0]) + x0
    torch.testing.assert_close(arch(dense, pooled), (x1 @ arch.logit.weight.T + arch.logit.bias).squeeze(-1))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cross": "diagonal"}, "DcnV2Config.cross must be one of ('full', 'low_rank', 'mixture')"),
        ({"structure": "tree"}, "DcnV2Config.structure must be one of ('stacked', 'parallel')"),
        ({"cross_layers": 0}, "DcnV2Config.cross_layers must be an int >= 1"),
        ({"deep_hidden": 7}, "DcnV2Config.deep_hidden must be a sequence of ints"),
        ({"preset": "huge"}, "model.preset must be one of"),
        ({"bogus": 1}, "model: unknown DCNv2 option(s) ['bogus']"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises((TypeError, ValueError)) as info:
        DcnV2Config.from_options(options)
    assert message in str(info.value)


def test_tables_must_be_as_wide_as_the_embeddings():
    with pytest.raises(ValueError, match="data.embedding_dim: table 't0' is 32 wide but DcnV2Config.embedding_dim is 16"):
        _model(spec=_spec(dim=32))


def test_docstring_examples_run():
    import doctest

    from loka_job.models import dcn_v2

    result = doctest.testmod(dcn_v2)
    assert result.attempted > 0 and result.failed == 0
