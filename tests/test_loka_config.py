"""``LokaConfig.from_recipe``: the named configurations most jobs start from, and what each one is."""

import copy
import dataclasses
import doctest
import os

import pytest
import torch
import yaml
from torch import nn

import loka_torchrec
from loka_torchrec import config as config_module
from loka_torchrec.comms.config import CommsConfig
from loka_torchrec.config import LokaConfig, LokaRecipe
from loka_torchrec.mods.config import ModsConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reference_job_config(**sections):
    """The reference job's ``recipes/loka/default.yaml``, with ``sections`` overriding some of it."""
    with open(os.path.join(ROOT, "recipes", "loka", "default.yaml")) as f:
        values = yaml.safe_load(f)
    for name, overrides in sections.items():
        values[name] = {**values[name], **overrides}
    return LokaConfig.from_dict(values)


def test_docstring_example_runs():
    result = doctest.testmod(config_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_default_and_all_mods_are_the_reference_jobs_configurations():
    assert LokaConfig.from_recipe("default") == _reference_job_config() == LokaConfig(enabled=True)
    assert LokaConfig.from_recipe(LokaRecipe.ALL_MODS) == _reference_job_config(mods={"preset": "all"})
    assert LokaConfig.from_recipe("all_mods").mods.enabled


def test_each_recipe_is_what_its_name_says():
    no_probe = LokaConfig.from_recipe("no_probe")
    assert no_probe.enabled and not no_probe.probe.enabled and no_probe.dispatch.evidence == "random"
    assert no_probe.dispatch.mode == "policy" and not no_probe.mods.enabled
    all_bf16 = LokaConfig.from_recipe("all_bf16")
    assert all_bf16.enabled and all_bf16.dispatch.mode == "all-bf16" and not all_bf16.probe.enabled
    assert all_bf16.comms == CommsConfig(forward="fp32", backward="fp32")
    assert LokaConfig.from_recipe("off") == LokaConfig() and not LokaConfig.from_recipe("off").enabled
    assert {r.value for r in LokaRecipe} == {"default", "all_mods", "no_probe", "all_bf16", "off"}
    assert loka_torchrec.LokaRecipe is LokaRecipe


def test_a_recipe_is_changed_with_dataclasses_replace_and_stays_checked():
    config = dataclasses.replace(LokaConfig.from_recipe("default"), mods=ModsConfig(preset="all"))
    assert config == LokaConfig.from_recipe("all_mods")
    with pytest.raises(TypeError, match="loka.mods: expected a ModsConfig, got dict"):
        dataclasses.replace(LokaConfig.from_recipe("default"), mods={"preset": "all"})


@pytest.mark.parametrize("recipe", ["fp8", "Default", None, 3])
def test_an_unknown_recipe_is_one_line_listing_the_recipes(recipe):
    with pytest.raises(ValueError, match=rf"^recipe: expected one of default, all_mods, no_probe, all_bf16, off, got {recipe!r}$"):
        LokaConfig.from_recipe(recipe)


def test_the_all_bf16_recipe_runs_the_model_as_it_was_with_the_plan_written(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    before = copy.deepcopy(model)
    loka = loka_torchrec.prepare(model, LokaConfig.from_recipe("all_bf16"), run_dir=str(tmp_path))
    x = torch.randn(8, 16)
    for step in (1, 2, 3):
        with loka.step(step):
            out = model(x)
            out.sum().backward()
        assert torch.equal(out, before(x))  # every GEMM in high precision: nn.Linear's result
    assert loka.dispatcher.plan.fp8_gemm_count() == 0 and loka.probe is None  # no Probe: no hooks
    assert (tmp_path / "dispatch_plan.json").exists()
    loka.close()
