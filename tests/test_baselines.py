"""``loka_job.baselines``: torchao / Transformer Engine FP8 on the dense layers, as baselines."""

import sys

import pytest
import torch
from torch import nn

from loka_job.baselines import BaselineConfig, TePaddedLinear, apply_baseline
from loka_torchrec.config import LokaConfig
from loka_job.training.trainer import check_baseline_vs_loka


class _Model(nn.Module):
    """Layers torchao/TE can take (dims multiple of 16) and some they cannot."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 32))  # 13 -> skipped
        self.over = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 1))  # 48 -> 1 skipped
        self.table = nn.Embedding(10, 4, device="meta")  # no linear: never touched

    def forward(self, x):
        return self.over(self.dense(x))


# --------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="tensorrt"), "baseline.kind"),
        (dict(kind="torchao", recipe="delayed"), "baseline.recipe"),
        (dict(kind="te", recipe="rowwise"), "baseline.recipe"),
        (dict(kind="te", recipe="delayed", auto_filter=True), "baseline.auto_filter"),
        (dict(kind="torchao", recipe="rowwise_with_gw_hp", auto_filter=True), "baseline.auto_filter"),
        (dict(kind="torchao", auto_filter="yes"), "baseline.auto_filter"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BaselineConfig(**kwargs)


def test_config_from_dict():
    assert BaselineConfig.from_dict({"kind": "te", "recipe": "delayed"}) == BaselineConfig("te", "delayed", False)
    assert BaselineConfig.from_dict(None) == BaselineConfig()
    with pytest.raises(ValueError, match=r"baseline: unknown option\(s\) \['compile'\]"):
        BaselineConfig.from_dict({"kind": "torchao", "compile": True})


def test_baseline_with_loka_is_refused():
    check_baseline_vs_loka(BaselineConfig("torchao"), LokaConfig(enabled=False))  # fine
    check_baseline_vs_loka(BaselineConfig(), LokaConfig(enabled=True))  # fine
    with pytest.raises(ValueError, match="baseline.kind=torchao cannot run with loka.enabled=true"):
        check_baseline_vs_loka(BaselineConfig("torchao"), LokaConfig(enabled=True))


def test_training_job_refuses_baseline_with_loka_before_starting(tmp_path):
    from loka_job.train import run

    cfg = {"model": {"name": "dlrm"}, "loka": {"enabled": True}, "baseline": {"kind": "te", "recipe": "delayed"}}
    with pytest.raises(ValueError, match="baseline.kind=te cannot run with loka.enabled=true"):
        run(cfg, str(tmp_path))
    assert not any(tmp_path.iterdir())  # refused before any set-up


def test_kind_none_changes_nothing():
    model = _Model()
    before = [type(m) for m in model.modules()]
    report = apply_baseline(model, BaselineConfig())
    assert [type(m) for m in model.modules()] == before
    assert report.converted == [] and report.skipped == []


# --------------------------------------------------------------------------------------- missing libraries
def test_missing_torchao_is_an_import_error_naming_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` fail
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    model = _Model()
    with pytest.raises(ImportError, match=r"pip install torchao"):
        apply_baseline(model, BaselineConfig("torchao", "tensorwise"))
    assert type(model.dense[2]) is nn.Linear


def test_missing_transformer_engine_is_an_import_error_naming_the_package(monkeypatch):
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install transformer-engine\[pytorch\]"):
        apply_baseline(_Model(), BaselineConfig("te", "delayed"))


def test_te_on_cpu_is_refused_with_the_reason(monkeypatch):
    """With a stand-in for TE's modules (TE itself needs CUDA): CPU layers are refused by name."""
    import types

    te_pkg = types.ModuleType("transformer_engine")
    te_pkg.__version__ = "0.0-standin"
    te_torch = types.ModuleType("transformer_engine.pytorch")
    te_common = types.ModuleType("transformer_engine.common")
    te_common.recipe = types.SimpleNamespace(DelayedScaling=object)
    for name, module in (
        ("transformer_engine", te_pkg),
        ("transformer_engine.pytorch", te_torch),
        ("transformer_engine.common", te_common),
        ("transformer_engine.common.recipe", te_common.recipe),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    te_pkg.pytorch, te_pkg.common = te_torch, te_common
    with pytest.raises(RuntimeError, match="Transformer Engine runs on CUDA only.*'dense.2'"):
        apply_baseline(_Model(), BaselineConfig("te", "delayed"))


# --------------------------------------------------------------------------------------- TE wrapper
def test_te_padded_linear_pads_rows_exactly():
    """Rows padded to a multiple of 16 and dropped again: output and gradients as unpadded."""
    torch.manual_seed(0)
    inner = nn.Linear(32, 16)
    calls = []
    inner.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape))
    wrapped = TePaddedLinear(inner)
    ref = nn.Linear(32, 16)
    ref.load_state_dict(inner.state_dict())
    x = torch.randn(3, 7, 32)  # 21 rows
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = wrapped(x1)
    y_ref = ref(x2)
    assert calls == [torch.Size([32, 32])]  # 21 rows padded to 32
    assert y.shape == (3, 7, 16)
    torch.testing.assert_close(y, y_ref)
    (y * y).sum().backward()
    (y_ref * y_ref).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(inner.weight.grad, ref.weight.grad)
    torch.testing.assert_close(inner.bias.grad, ref.bias.grad)


# --------------------------------------------------------------------------------------- torchao


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_converts_the_aligned_dense_linears(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = _Model()
    weight = model.dense[2].weight
    report = apply_baseline(model, BaselineConfig("torchao", recipe))
    assert [name for name, _, _ in report.converted] == ["dense.2", "over.0"]
    assert dict(report.skipped).keys() == {"dense.0", "over.2"}
    assert "in_features=13" in dict(report.skipped)["dense.0"] and "multiples of 16" in dict(report.skipped)["over.2"]
    assert isinstance(model.dense[2], Float8Linear) and isinstance(model.over[0], Float8Linear)
    assert type(model.dense[0]) is nn.Linear and type(model.over[2]) is nn.Linear
    assert model.dense[2].weight is weight  # same Parameter: optimizer state and checkpoints carry over
    assert model.dense[2].config.pad_inner_dim
    assert report.summary()["converted_layers"] == 2 and report.versions["torchao"]
    with report.forward_context():  # a no-op for torchao
        y = model(torch.randn(16, 13))
    assert y.shape == (16, 1)


def test_torchao_auto_filter_leaves_small_layers_and_says_why():
    pytest.importorskip("torchao.float8")
    model = _Model()
    report = apply_baseline(model, BaselineConfig("torchao", "tensorwise", auto_filter=True))
    assert report.converted == []  # all far below torchao's H100 thresholds
    reasons = dict(report.skipped)
    assert "auto filter" in reasons["dense.2"] and "auto filter" in reasons["over.0"]
    assert type(model.dense[2]) is nn.Linear


def test_recipe_sections_compose_and_validate():
    """`baseline.*` and `train.autocast` exist in the default recipe (overridable without `+`)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from loka_job.training.trainer import TrainConfig

    with initialize_config_module("loka_job.recipes", version_base=None):
        default = OmegaConf.to_container(compose("config"), resolve=True)
        cfg = OmegaConf.to_container(
            compose("config", ["baseline.kind=te", "baseline.recipe=delayed", "train.autocast=bf16", "loka.enabled=false"]),
            resolve=True,
        )
    assert BaselineConfig.from_dict(default["baseline"]) == BaselineConfig()
    assert TrainConfig(**default["train"]).autocast == "none"
    assert BaselineConfig.from_dict(cfg["baseline"]) == BaselineConfig("te", "delayed")
    assert TrainConfig(**cfg["train"]).autocast == "bf16"
    check_baseline_vs_loka(BaselineConfig.from_dict(cfg["baseline"]), LokaConfig.from_dict(cfg["loka"]))
