"""Bad input and API edges: one error naming the field and what was expected, never a crash elsewhere."""

import pytest
import torch

import loka_torchrec
from loka_torchrec.config import LokaConfig
from loka_job.models import build_model
from loka_job.training.trainer import TrainConfig


def test_apply_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module .* got function"):
        loka_torchrec.apply(lambda x: x)


def test_loka_config_refuses_a_plain_dict_for_a_section():
    with pytest.raises(TypeError, match=r"loka.dispatch: expected a DispatchConfig, got dict.*LokaConfig.from_dict"):
        LokaConfig(dispatch={"mode": "policy"})
    assert LokaConfig.from_dict({"dispatch": {"mode": "policy"}}).dispatch.mode == "policy"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(steps=-5), r"train.steps: must be >= 1, got -5"),
        (dict(steps="abc"), r"train.steps: expected an int, got 'abc'"),
        (dict(steps=2.5), r"train.steps: expected an int, got 2.5"),
        (dict(lr="fast"), r"train.lr: expected a finite number > 0, got 'fast'"),
        (dict(lr=float("inf")), r"train.lr: expected a finite number > 0"),
        (dict(max_nonfinite_steps=0), r"train.max_nonfinite_steps: must be >= 1, got 0"),
        (dict(progress_bar="no"), r"train.progress_bar: expected true or false"),
        (dict(fused_optimizer="yes"), r"train.fused_optimizer: expected true or false, got 'yes'"),
        (dict(steps=10, timing_start=10), r"train.timing_start"),
        (dict(peer_timeout_s=-1), r"train.peer_timeout_s: expected a number of seconds >= 0 \(0: no watchdog\), got -1"),
        (dict(peer_timeout_s="5s"), r"train.peer_timeout_s: expected a number of seconds >= 0"),
        (dict(require_verified_checkpoints="yes"), r"train.require_verified_checkpoints: expected true or false, got 'yes'"),
    ],
)
def test_train_config_errors_name_the_field_the_user_typed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def _spec():
    from loka_job.training.synthetic import SyntheticConfig, make_data_spec

    return make_data_spec(SyntheticConfig(num_tables=2, num_embeddings=100, embedding_dim=16))


@pytest.mark.parametrize("model", ["dlrm", "dcn"])
def test_dlrm_and_dcn_refuse_unknown_options_and_a_mismatched_embedding_dim(model):
    options = {"dense_arch_layer_sizes": [32, 16], "over_arch_layer_sizes": [32, 1]}
    build_model(model, dict(options), _spec(), torch.device("cpu"))  # fine
    build_model(model, {**options, "embedding_dim": 16}, _spec(), torch.device("cpu"))  # agrees: fine
    with pytest.raises(ValueError, match=r"model: unknown option\(s\) \['foo'\] for the %s model" % model):
        build_model(model, {**options, "foo": 1}, _spec(), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"model.embedding_dim: 32 disagrees with data.embedding_dim \(16\)"):
        build_model(model, {**options, "embedding_dim": 32}, _spec(), torch.device("cpu"))


def _wrong_values():
    """For every field of the four section configs: a value of the wrong type (a str where a number
    or a flag goes, a number where a str goes, a list of numbers where names go)."""
    import dataclasses
    import typing

    from loka_torchrec.comms import CommsConfig
    from loka_torchrec.dispatch import DispatchConfig
    from loka_torchrec.mods import ModsConfig
    from loka_torchrec.probe import ProbeConfig

    cases = []
    for cls, section in ((DispatchConfig, "dispatch"), (ProbeConfig, "probe"), (ModsConfig, "ModsConfig"), (CommsConfig, "CommsConfig")):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kind = hints[field.name]
            if typing.get_origin(kind) is typing.Union:  # Optional[X]: None or an X
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            wrong = [1] if typing.get_origin(kind) is tuple else (7 if kind is str else "1.1")
            cases.append(pytest.param(cls, {field.name: wrong}, f"{section}.{field.name}: expected ", id=f"{section}.{field.name}"))
    return cases


@pytest.mark.parametrize("cls, kwargs, message", _wrong_values())
def test_every_config_field_of_the_wrong_type_is_one_line_naming_it(cls, kwargs, message):
    with pytest.raises(TypeError, match="^" + message.replace(".", r"\.")) as info:
        cls(**kwargs)
    assert "\n" not in str(info.value)


def test_the_reported_case_names_the_field_and_the_value():
    from loka_torchrec.dispatch import DispatchConfig

    with pytest.raises(TypeError, match=r"^dispatch.min_speedup: expected a number, got '1.1'$"):
        DispatchConfig(min_speedup="1.1")
    with pytest.raises(TypeError, match=r"^dispatch.grad_check: expected true or false, got 1$"):
        DispatchConfig(grad_check=1)
    with pytest.raises(TypeError, match=r"^loka.enabled: expected true or false, got 'false'$"):
        LokaConfig.from_dict({"enabled": "false"})  # a string is not taken for True
    assert DispatchConfig(min_speedup=2, candidates="emulated:rowwise").candidates == ("emulated:rowwise",)
