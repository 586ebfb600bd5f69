"""CommsConfig precision "auto": the decision on one rank, the switchable codec, and Loka's record of it.

The two-rank agreement (MAX over ranks) and the switch of codecs installed in a real DMP are in
tests/test_comms_distributed.py (``test_auto_comms_*``).
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import pickle

import pytest
import torch

import loka_torchrec
from loka_torchrec import comms
from loka_torchrec.comms import CommsChoice, CommsConfig, CommsSelection
from loka_torchrec.comms.auto import ONE_RANK_REASON
from loka_torchrec.probe.inspect import comms_line

prepare_module = importlib.import_module("loka_torchrec.prepare")  # the package's `prepare` is the function


def test_auto_is_the_default_and_explicit_values_stay():
    assert (CommsConfig().forward, CommsConfig().backward) == ("auto", "auto")
    assert CommsConfig().enabled and CommsConfig().auto
    explicit = CommsConfig(forward="fp8", backward="fp32")
    assert not explicit.auto and explicit.resolved("fp32", "fp8") == explicit  # an explicit choice is never overridden
    assert CommsConfig(backward="bf16").resolved("fp8", "fp8").backward == "bf16"


@pytest.mark.parametrize("field", ["forward", "backward"])
def test_bad_precisions_are_one_line_errors_naming_the_field(field):
    with pytest.raises(ValueError, match=rf"^CommsConfig\.{field}: expected one of auto, fp32, bf16, fp8, got 'int8'$"):
        CommsConfig(**{field: "int8"})
    with pytest.raises(TypeError, match=rf"^CommsConfig\.{field}: expected a str, got 8$"):
        CommsConfig(**{field: 8})


def test_bad_choices_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^CommsChoice\.forward: expected one of fp32, bf16, fp8, got 'auto'$"):
        CommsChoice("auto", "fp32")
    with pytest.raises(ValueError, match=r"^comms choice: unknown keys \['colour'\]$"):
        CommsChoice.from_dict({"forward": "fp8", "backward": "fp32", "colour": 1})
    choice = CommsChoice("fp8", "fp32", reasons={"forward": "r"}, times_ms={"forward": {"fp32": 1.0, "fp8": 0.5}}, world_size=2)
    assert CommsChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice


def test_one_rank_takes_fp32_without_timing():
    def timer(label, run):
        raise AssertionError("one rank must not time anything")

    choice = comms.decide(CommsConfig(), timer=timer)
    assert (choice.forward, choice.backward, choice.world_size) == ("fp32", "fp32", 1)
    assert choice.reasons == {"forward": ONE_RANK_REASON, "backward": ONE_RANK_REASON}
    assert choice.times_ms == {}
    # A fixed direction is kept and not decided.
    mixed = comms.decide(CommsConfig(forward="bf16"))
    assert (mixed.forward, mixed.backward, mixed.decided) == ("bf16", "fp32", ("backward",))


def _a2a(reg):
    return reg["POOLED_EMBEDDINGS_ALL_TO_ALL"]


def test_auto_codec_is_identity_until_set_then_sends_the_choice():
    selection = CommsSelection()
    reg = comms.registry(CommsConfig(), embedding_dims=[8, 16], selection=selection)
    fwd, bwd = _a2a(reg).forward, _a2a(reg).backward
    assert fwd.selection is selection and bwd.selection is selection
    x = torch.randn(4, 16)
    ctx = fwd.create_context()
    assert fwd.quantized_dtype == torch.float32 and fwd.encode(x, ctx) is x  # undecided: fp32, unchanged
    assert fwd.calc_quantized_size(64, ctx) == 64
    selection.set(CommsChoice("fp8", "fp32"))
    ctx = fwd.create_context()
    payload = fwd.encode(x, ctx)
    assert payload.dtype == torch.uint8 and fwd.quantized_dtype == torch.uint8
    # block 8 (gcd of the dims), fp32 scales: 8 bytes + 4 scale bytes per 8 values
    assert payload.numel() == fwd.calc_quantized_size(x.numel(), ctx) == x.numel() // 8 * 12
    decoded = fwd.decode(payload, ctx).view_as(x)
    assert 0 < (decoded - x).abs().max() <= x.abs().max() * 2**-4
    assert bwd.quantized_dtype == torch.float32 and bwd.encode(x) is x  # the backward stayed fp32
    # The reduce-scatter steps fp8 down to bf16, as an explicit fp8 does.
    assert reg["POOLED_EMBEDDINGS_REDUCE_SCATTER"].forward.quantized_dtype == torch.bfloat16


@pytest.mark.parametrize("round_trip", [pickle.loads, copy.deepcopy])
def test_auto_codecs_survive_pickle_and_deepcopy_sharing_one_selection(round_trip):
    ebc_sharder, ec_sharder = comms.sharders(CommsConfig())
    assert ebc_sharder.comms_selection is ec_sharder.comms_selection is not None
    copied = round_trip(pickle.dumps(ebc_sharder)) if round_trip is pickle.loads else round_trip(ebc_sharder)
    codec = _a2a(copied.qcomm_codecs_registry).forward
    assert codec.selection is copied.comms_selection  # still one selection inside the copy
    copied.comms_selection.set(CommsChoice("fp8", "fp8"))
    assert codec.encode(torch.ones(2, 32)).dtype == torch.uint8
    assert _a2a(ebc_sharder.qcomm_codecs_registry).forward.quantized_dtype == torch.float32  # the original is untouched


def test_explicit_precisions_build_fixed_codecs():
    reg = comms.registry(CommsConfig(forward="fp8", backward="bf16"), embedding_dims=[16])
    assert isinstance(_a2a(reg).forward, comms.Fp8CommCodec) and isinstance(_a2a(reg).backward, comms.Bf16CommCodec)
    assert comms.sharders(CommsConfig(forward="fp8", backward="fp32"))[0].comms_selection is None
    assert comms.sharders(CommsConfig(forward="fp8"))[0].comms_selection is not None  # backward: auto


def _model():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=f"t{d}", embedding_dim=d, num_embeddings=4, feature_names=[f"f{d}"]) for d in (16, 48)],
                device=torch.device("meta"),
            )
            self.dense = torch.nn.Linear(16, 8)

    return Model()


def _prepare(run_dir, **comms_kwargs):
    config = loka_torchrec.LokaConfig.from_dict({"enabled": True, "probe": {"enabled": False}, "comms": comms_kwargs})
    return loka_torchrec.prepare(_model(), config, run_dir=str(run_dir), batch_size=32)


def _no_timing(*args, **kwargs):
    raise AssertionError("nothing may be timed here")


def test_loka_on_one_rank_records_fp32_and_why(tmp_path):
    loka = _prepare(tmp_path)
    assert loka.embedding_dims == [16, 48] and loka.batch_size == 32
    assert "comms: forward auto, backward auto (decided before the first step)" in str(loka)
    assert loka.sharders()[0].comms_selection is loka.comms_selection
    choice = loka.decide_comms()
    assert (choice.forward, choice.backward) == ("fp32", "fp32")
    assert loka.decide_comms() is choice  # once per run
    plan = json.loads((tmp_path / prepare_module.COMMS_PLAN_FILE).read_text())
    assert (plan["forward"], plan["backward"], plan["restored"]) == ("fp32", "fp32", False)
    assert plan["choice"]["reasons"]["forward"] == ONE_RANK_REASON
    assert ONE_RANK_REASON in str(loka) and ONE_RANK_REASON in comms_line(plan)
    assert loka.state_dict()["comms_choice"] == choice.to_dict()


def test_resume_restores_the_choice_without_timing(tmp_path, monkeypatch):
    saved = CommsChoice("fp8", "fp32", reasons={"forward": "measured: fp8 faster", "backward": "measured: fp8 not faster"},
                        times_ms={"forward": {"fp32": 2.0, "fp8": 1.0}}, world_size=1)  # fmt: skip
    first = _prepare(tmp_path / "a")
    first.comms_selection.set(saved)
    state = first.state_dict()
    monkeypatch.setattr(prepare_module, "decide_comms_precision", _no_timing)
    resumed = _prepare(tmp_path / "b")
    resumed.start()
    resumed.load_state_dict(state, step=10)
    assert resumed.decide_comms() == saved
    codec = _a2a(resumed.sharders()[0].qcomm_codecs_registry).forward
    assert codec.quantized_dtype == torch.uint8  # the restored fp8 forward is what the codecs send
    plan = json.loads((tmp_path / "b" / prepare_module.COMMS_PLAN_FILE).read_text())
    assert plan["restored"] and plan["forward"] == "fp8" and plan["choice"]["times_ms"]["forward"]["fp8"] == 1.0
    assert "restored from the checkpoint" in str(resumed) and "restored from a checkpoint" in comms_line(plan)


def test_a_choice_for_another_world_size_is_decided_anew(tmp_path, caplog):
    loka = _prepare(tmp_path)
    state = loka.state_dict()
    state["comms_choice"] = CommsChoice("fp8", "fp8", world_size=8).to_dict()
    with caplog.at_level(logging.WARNING, logger="loka_torchrec.prepare"):
        loka.load_state_dict(state, step=3)
    assert "does not fit this run" in caplog.text and loka.comms_choice is None
    assert loka.decide_comms().forward == "fp32"  # decided here: one rank


def test_explicit_comms_bypass_the_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "decide_comms_precision", _no_timing)
    loka = _prepare(tmp_path, forward="fp8", backward="bf16")
    assert loka.comms_selection is None and loka.decide_comms() is None
    assert isinstance(_a2a(loka.sharders()[0].qcomm_codecs_registry).forward, comms.Fp8CommCodec)
    loka.start()
    plan = json.loads((tmp_path / prepare_module.COMMS_PLAN_FILE).read_text())
    assert (plan["forward"], plan["backward"], plan["choice"]) == ("fp8", "bf16", None)
    assert "comms: forward fp8, backward bf16" in str(loka)
