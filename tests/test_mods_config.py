"""ModsConfig validation, the ModsReport, and apply_mods' contract (order, preset none, wrapped models)."""

import copy

import pytest
import torch
from torch import nn

from loka_torchrec.mods import MOD_NAMES, ModResult, ModsConfig, ModsReport, apply_mods


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 30), nn.LayerNorm(30), nn.SiLU(), nn.Linear(30, 1))


def test_presets_resolve_to_mods_in_application_order():
    assert ModsConfig().enabled == ()
    assert ModsConfig(preset="all").enabled == MOD_NAMES
    assert ModsConfig(preset="all_but_no_bias").enabled == ("block_norm", "hard_swish", "fuse_siblings", "pad_to_16")
    assert ModsConfig(preset="custom", pad_to_16=True, no_bias=True).enabled == ("no_bias", "pad_to_16")
    assert ModsConfig(preset="custom").enabled == ()
    assert ModsConfig.only("fuse_siblings").enabled == ("fuse_siblings",)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preset": "some"}, "ModsConfig.preset"),
        ({"preset": "none", "hard_swish": True}, "preset='custom'"),
        ({"preset": "all_but_no_bias", "no_bias": True}, "^ModsConfig: preset='all_but_no_bias' keeps every bias, but no_bias is switched on"),
        ({"preset": "all_but_no_bias", "keep_bias": ["head.*"]}, r"^ModsConfig.keep_bias: says which biases no_bias keeps, but no_bias is not applied \(preset='all_but_no_bias'\)"),
        ({"preset": "none", "keep_prediction_bias": False}, r"^ModsConfig.keep_prediction_bias: .* no_bias is not applied \(preset='none'\)"),
        ({"preset": "custom", "pad_to_16": True, "keep_bias": ["a"]}, "^ModsConfig.keep_bias: "),
        ({"preset": "all", "block_size": 0}, "ModsConfig.block_size"),
        ({"preset": "all", "block_size": 2.5}, "ModsConfig.block_size"),
        ({"preset": "custom", "no_bias": 1}, "ModsConfig.no_bias: expected true or false, got 1"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ModsConfig(**kwargs)


def test_keep_bias_accepts_a_list_or_a_single_glob():
    assert ModsConfig(preset="all", keep_bias=["a.*", "b"]).keep_bias == ("a.*", "b")
    assert ModsConfig(preset="all", keep_bias="head.*").keep_bias == ("head.*",)
    with pytest.raises(TypeError, match="keep_bias"):
        ModsConfig(preset="all", keep_bias=[3])


def test_preset_none_changes_nothing():
    model = _model()
    before = copy.deepcopy(model)
    report = apply_mods(model, ModsConfig())
    assert report.results == () and not report.changed
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), before.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


def test_preset_all_reports_every_mod_with_the_modules_it_touched():
    model = _model()
    report = apply_mods(model, ModsConfig(preset="all", block_size=16))
    assert [r.name for r in report] == list(MOD_NAMES)
    assert report["no_bias"].modules == ("0",)
    assert report["no_bias"].skipped == (("3", "final prediction layer"),)
    assert report["block_norm"].modules == ("1",)
    assert report["hard_swish"].modules == ("2",)
    assert report["fuse_siblings"].modules == ()
    assert report["pad_to_16"].modules == ("0", "3")
    assert report.to_dict()["mods"]["pad_to_16"]["modules"] == ["0", "3"]
    assert "pad_to_16: 2 module(s)" in str(report)
    with pytest.raises(KeyError):
        apply_mods(_model(), ModsConfig.only("hard_swish"))["no_bias"]


def test_preset_all_but_no_bias_changes_the_model_as_all_does_except_that_every_bias_stays():
    with_all, kept = _model(), _model()
    apply_mods(with_all, ModsConfig(preset="all", block_size=16))
    report = apply_mods(kept, ModsConfig(preset="all_but_no_bias", block_size=16))
    assert [r.name for r in report] == [name for name in MOD_NAMES if name != "no_bias"]
    assert [type(m) for m in kept.modules()] == [type(m) for m in with_all.modules()]
    assert kept[0].bias is not None and with_all[0].bias is None
    assert kept[3].bias is not None and with_all[3].bias is not None  # the prediction layer's, kept by both
    x = torch.randn(5, 20)
    with torch.no_grad():
        kept[0].bias.zero_()  # with a zero bias the two models compute the same function
        torch.testing.assert_close(kept(x), with_all(x), rtol=0, atol=0)


def test_apply_mods_rejects_wrapped_models_and_bad_arguments():
    class DistributedDataParallel(nn.Module):  # stands in for the wrapper by its class name
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(TypeError, match="before DistributedModelParallel"):
        apply_mods(DistributedDataParallel(_model()), ModsConfig(preset="all"))
    with pytest.raises(TypeError, match="ModsConfig"):
        apply_mods(_model(), {"preset": "all"})


def test_report_str_lists_skipped_modules():
    report = ModsReport(ModsConfig(preset="all"), (ModResult("no_bias", ("a",), (("b", "kept"),)),))
    assert str(report) == "mods (preset=all):\n  no_bias: 1 module(s) [a]; skipped b (kept)"
