"""``loka_job.baselines``: torchao / Transformer Engine FP8 on the dense layers, as baselines."""

import sys

import pytest
import torch
from torch import nn

from torchrec.sparse.jagged_tensor import KeyedTensor

from loka_job.baselines import BaselineConfig, BaselineReport, TeGraphedCall, TePaddedLinear, apply_baseline
from loka_torchrec.config import LokaConfig
from loka_job.training.trainer import check_baseline_in_job, check_baseline_vs_loka


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
        (dict(kind="torchao", cuda_graphs=True), "baseline.cuda_graphs: only for baseline.kind=te"),
        (dict(kind="te", recipe="delayed", cuda_graphs="yes"), "baseline.cuda_graphs: expected true or false"),
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


def test_te_cuda_graphs_are_refused_by_the_job_before_starting(tmp_path):
    check_baseline_in_job(BaselineConfig("te", "delayed"))  # fine
    from loka_job.train import run

    cfg = {"model": {"name": "dlrm"}, "loka": {"enabled": False}, "baseline": {"kind": "te", "recipe": "delayed", "cuda_graphs": True}}
    with pytest.raises(ValueError, match="baseline.cuda_graphs=true: TE's CUDA graphs cannot capture"):
        run(cfg, str(tmp_path))
    assert not any(tmp_path.iterdir())


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


# --------------------------------------------------------------------------------------- TE's CUDA graphs
class _OverArch(nn.Module):
    """A dense module called as DHEN's: a dense tensor and a ``KeyedTensor`` of pooled embeddings."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(13 + 2 * 16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense, pooled):
        return self.mlp(torch.cat([dense, pooled.values()], dim=1)).squeeze(1)


def _stand_in_capture(captures):
    """Stands in for TE's ``make_graphed_callables`` (which needs CUDA): records the samples and,
    as TE does, replaces the module's ``forward`` by the "graphed" one (here: counting, then eager)."""

    def capture(flat, samples, report):
        captures.append(samples)
        eager_forward = flat.forward

        def graphed(*leaves):
            captures.append("replay")
            return eager_forward(*leaves)

        flat.forward = graphed

    return capture


def _pooled(rows, requires_grad=False):
    values = torch.randn(rows, 32, requires_grad=requires_grad)
    return KeyedTensor(keys=["a", "b"], length_per_key=[16, 16], values=values), values


def test_te_graphed_call_captures_once_and_replays_only_the_captured_training_signature():
    torch.manual_seed(0)
    over, reference = _OverArch(), _OverArch()
    reference.load_state_dict(over.state_dict())
    captures = []
    call = TeGraphedCall.install(over, BaselineReport(BaselineConfig("te", "delayed", cuda_graphs=True)),
                                 capture=_stand_in_capture(captures))  # fmt: skip
    dense = torch.randn(8, 13)
    pooled, values = _pooled(8, requires_grad=True)
    out = over(dense, pooled)  # the first training call: capture, then replay
    assert len(captures) == 2 and captures[1] == "replay"
    samples = captures[0]
    assert [t.shape for t in samples] == [dense.shape, values.shape]
    assert [t.requires_grad for t in samples] == [False, True]  # as the call's own tensors
    assert all(s is not t and s.data_ptr() != t.data_ptr() for s, t in zip(samples, (dense, values)))
    ref_values = values.detach().clone().requires_grad_()
    ref = reference(dense, KeyedTensor(keys=["a", "b"], length_per_key=[16, 16], values=ref_values))
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(values.grad, ref_values.grad)  # gradients reach the KeyedTensor's values
    torch.testing.assert_close(over.mlp[0].weight.grad, reference.mlp[0].weight.grad)
    over(dense, pooled)
    assert captures.count("replay") == 2 and call.graphed_calls == 2 and call.eager_calls == 0
    over(torch.randn(4, 13), _pooled(4, requires_grad=True)[0])  # another shape: eager
    assert captures.count("replay") == 2 and call.eager_calls == 1
    over(dense, _pooled(8, requires_grad=False)[0])  # another requires_grad: eager
    assert call.eager_calls == 2
    over.eval()
    with torch.no_grad():
        torch.testing.assert_close(over(dense, pooled), reference.eval()(dense, pooled))  # evaluation: eager, not counted
    assert captures.count("replay") == 2 and call.eager_calls == 2 and len(captures) == 3  # captured once
    assert list(over.state_dict()) == list(reference.state_dict())  # names unchanged
    assert call.report.summary()["graphed_modules"] == {}  # installed by hand here, not by apply_baseline


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


# --------------------------------------------------------------------------------------- GPU (with TE)
class _AlignedOverArch(_OverArch):
    def __init__(self):
        nn.Module.__init__(self)
        self.mlp = nn.Sequential(nn.Linear(16 + 2 * 64, 128), nn.ReLU(), nn.Linear(128, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_te_graphed_training_steps_match_eager_te(recipe):
    """TE's CUDA graphs replay what eager TE computes: outputs and every gradient over steps."""
    pytest.importorskip("transformer_engine.pytorch")
    torch.manual_seed(0)
    device = torch.device("cuda")
    eager_model = _AlignedOverArch().to(device, torch.bfloat16)
    graphed_model = _AlignedOverArch().to(device, torch.bfloat16)
    graphed_model.load_state_dict(eager_model.state_dict())
    eager = apply_baseline(eager_model, BaselineConfig("te", recipe))
    graphed = apply_baseline(graphed_model, BaselineConfig("te", recipe, cuda_graphs=True))
    assert len(graphed.converted) == 2 and list(graphed.graphed) == ["mlp"]
    for step in range(4):
        dense = torch.randn(256, 16, device=device, dtype=torch.bfloat16)
        values = torch.randn(256, 128, device=device, dtype=torch.bfloat16)
        results = []
        for model, report in ((eager_model, eager), (graphed_model, graphed)):
            v = values.clone().requires_grad_()
            with report.forward_context():
                out = model(dense, KeyedTensor(keys=["a", "b"], length_per_key=[64, 64], values=v))
            (out.float() ** 2).sum().backward()
            results.append((out.float(), v.grad.float(), [p.grad.float() for p in model.parameters()]))
            for p in model.parameters():
                p.grad = None
        (out_e, dv_e, dw_e), (out_g, dv_g, dw_g) = results
        tol = dict(rtol=2e-2, atol=2e-2 * out_e.abs().max().item())
        torch.testing.assert_close(out_g, out_e, **tol)
        torch.testing.assert_close(dv_g, dv_e, rtol=2e-2, atol=2e-2 * dv_e.abs().max().item())
        for g, e in zip(dw_g, dw_e):
            torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2 * e.abs().max().item())
    assert graphed.graphed["mlp"].graphed_calls == 4 and graphed.graphed["mlp"].eager_calls == 0
