"""The DHEN-style model: shapes, gradients, ensembles, LRM-sized GEMMs, and the mods on it."""

import copy

import pytest
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from loka_job.models.dhen import DhenConfig, DhenLayer, build_dhen, token_split
from loka_torchrec.mods import BlockNorm, ModsConfig, PaddedLinear, SiblingLinears, apply_mods
from loka_job.training.data_spec import DataSpec, TableSpec

CPU = torch.device("cpu")


def _spec(num_tables=4, dim=32, num_dense=5, rows=50) -> DataSpec:
    tables = tuple(TableSpec(f"t{i}", f"f{i}", rows, dim, 2) for i in range(num_tables))
    return DataSpec(num_dense=num_dense, tables=tables)


def _batch(spec: DataSpec, batch=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = [t.feature for t in spec.pooled_tables]
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    return torch.randn(batch, spec.num_dense, generator=g), KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)


def _model(config=None, spec=None, seed=0):
    torch.manual_seed(seed)
    return build_dhen(config or DhenConfig.small(), spec or _spec(), CPU, embedding_device=CPU)


@pytest.mark.parametrize("ensemble", ["concat", "sum"])
def test_forward_backward_shapes_and_every_parameter_gets_a_gradient(ensemble):
    config = DhenConfig(ensemble=ensemble)
    model = _model(config)
    dense, kjt = _batch(_spec())
    logits = model(dense, kjt)
    assert logits.shape == (6,) and torch.isfinite(logits).all()
    logits.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_layer_keeps_the_token_stack_and_marks_its_sibling_groups():
    layer = DhenLayer(5, DhenConfig.small())
    assert layer(torch.randn(3, 5, 32)).shape == (3, 5, 32)
    assert isinstance(layer.entry, SiblingLinears) and layer.entry.names == ("cross", "linear")
    assert layer.entry.widths == (32, 1 * 32)  # concat: 5 tokens -> (2, 1, 1, 1); "linear" is last
    assert isinstance(layer.interactions["self_attention"].qkv, SiblingLinears)
    assert token_split(8, 4) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="at least one output token per interaction"):
        DhenLayer(3, DhenConfig.small())


def test_samples_do_not_interact():
    model = _model()
    model.eval()
    spec = _spec()
    dense, kjt = _batch(spec, batch=4)
    base = model(dense, kjt).detach()
    dense2 = dense.clone()
    dense2[3] += 5.0
    changed = model(dense2, kjt).detach()
    torch.testing.assert_close(changed[:3], base[:3], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(changed[3], base[3])


def test_mods_all_runs_and_fusion_plus_padding_keep_the_model_function():
    spec = _spec()
    dense, kjt = _batch(spec)
    baseline = _model(spec=spec)
    exact = copy.deepcopy(baseline)
    report = apply_mods(exact, ModsConfig(preset="custom", fuse_siblings=True, pad_to_16=True))
    assert len(report["fuse_siblings"].modules) == 2 * 2  # entry + qkv in each of 2 layers
    torch.testing.assert_close(exact(dense, kjt), baseline(dense, kjt), rtol=1e-5, atol=1e-5)

    modded = copy.deepcopy(baseline)
    report = apply_mods(modded, ModsConfig(preset="all"))
    kinds = {type(m) for m in modded.modules()}
    assert BlockNorm in kinds and PaddedLinear in kinds and nn.Hardswish in kinds
    assert nn.LayerNorm not in kinds and nn.SiLU not in kinds
    assert report["no_bias"].skipped == (("over_arch.head.4", "final prediction layer"),)
    for module in modded.modules():
        if isinstance(module, nn.Linear):
            assert module.in_features % 16 == 0 and module.out_features % 16 == 0
    logits = modded(dense, kjt)
    assert logits.shape == (6,)
    logits.sum().backward()


def test_large_preset_has_lrm_shaped_gemms():
    spec = _spec(num_tables=7, dim=256, num_dense=13, rows=1000)
    model = build_dhen(DhenConfig.large(), spec, torch.device("meta"))  # sizes only, nothing allocated
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
    first_layers = {(13, 512), (28, 512)}  # dense input, and the 8 * 7 / 2 dot products
    prediction = {(256, 1)}
    for k, n in shapes - first_layers - prediction:
        assert 256 <= k <= 2048 and 256 <= n <= 2048, (k, n)
    assert (2048, 512) in shapes and (512, 2048) in shapes


def test_xl_preset_is_a_16384_wide_stack_and_runs_on_meta():
    """63 features x d 256 plus the dense token: every layer's widest GEMMs read or write the whole
    stack. The over arch runs on ``meta`` (shapes only: its 0.8 B parameters are never allocated)."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    meta = torch.device("meta")
    spec = _spec(num_tables=63, dim=256, num_dense=13, rows=1000)
    model = build_dhen(DhenConfig.xl(), spec, meta)
    arch = model.over_arch
    assert arch.num_tokens == 64 and arch.num_tokens * model.config.embedding_dim == 16384
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
    assert {(16384, 1024), (16384, 4096), (1024, 16384), (2016, 1024), (1024, 4096), (4096, 1024)} <= shapes
    head = [m for m in arch.head if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in head] == [(16384, 4096), (4096, 1024), (1024, 1)]
    batch = 4
    pooled = KeyedTensor(
        keys=[t.feature for t in spec.pooled_tables],
        length_per_key=[256] * 63,
        values=torch.empty(batch, 63 * 256, device=meta),
    )
    logits = arch(torch.empty(batch, 13, device=meta), pooled)
    assert logits.shape == (batch,) and logits.device.type == "meta"
    assert DhenConfig.from_options({"preset": "xl"}) == DhenConfig.xl()
    with pytest.raises(ValueError, match="model.preset must be one of"):
        DhenConfig.from_options({"preset": "huge"})


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="attention_heads"):
        DhenConfig(embedding_dim=30, attention_heads=4)
    with pytest.raises(ValueError, match="interactions"):
        DhenConfig(interactions=("dot", "conv"))
    with pytest.raises(ValueError, match="ensemble"):
        DhenConfig(ensemble="max")
    with pytest.raises(ValueError, match="data.embedding_dim"):
        build_dhen(DhenConfig.small(), _spec(dim=16), CPU)
    with pytest.raises(ValueError, match="unknown DHEN option"):
        DhenConfig.from_options({"preset": "small", "layers": 3})
    model = _model()
    with pytest.raises(ValueError, match=r"dense_features must be \(B, 5\)"):
        model(torch.randn(6, 4), _batch(_spec())[1])


def test_embedding_tables_default_to_meta():
    model = build_dhen(DhenConfig.small(), _spec(), CPU)
    assert {p.device.type for n, p in model.named_parameters() if "embedding_bag" in n} == {"meta"}
    assert {p.device.type for n, p in model.named_parameters() if "embedding_bag" not in n} == {"cpu"}
