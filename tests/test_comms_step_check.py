"""The ``"auto"`` comms choice checked in the training step (``loka_torchrec.comms.step_check``)."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

import loka_torchrec
from loka_torchrec.comms import CommsChoice, CommsConfig, CommsSelection
from loka_torchrec.comms.step_check import CommsStepCheck, CommsStepChecker
from loka_torchrec.dispatch.step_guard import StepTimeGuard

prepare_module = importlib.import_module("loka_torchrec.prepare")


def test_arms_alternate_a_b_b_a_skipping_settle_steps_and_untimed_steps():
    check = CommsStepCheck(block=2, rounds=2, settle=1, min_gain=0.0)
    assert check.schedule == ["chosen", "fp32", "fp32", "chosen"]
    arms, step = [], 0
    while not check.done:
        step += 1
        arms.append(check.arm)
        ms = None if step % 4 == 0 else (5.0 if check.arm == "chosen" else 7.0)  # every 4th step: no time
        result = check.observe(step, ms)
    # per block: 1 settle + 2 taken = 3 timed steps; untimed steps stay in their block
    assert arms.count("chosen") >= 6 and arms.count("fp32") >= 6
    assert check.samples == {"chosen": [5.0] * 4, "fp32": [7.0] * 4}
    assert result.keep_chosen and (result.chosen_ms, result.fp32_ms, result.steps_per_arm) == (5.0, 7.0, 4)
    assert check.observe(step + 1, 1.0) is None and check.arm is None  # done: nothing more is taken
    assert check.observe(1, float("nan")) is None


@pytest.mark.parametrize("chosen_ms, keep", [(9.8, True), (9.95, False), (10.0, False), (11.0, False)])
def test_the_chosen_precision_must_be_min_gain_faster(chosen_ms, keep):
    assert CommsStepCheck(min_gain=0.01).judge(7, chosen_ms, 10.0).keep_chosen is keep


def test_bad_settings_are_refused():
    for kwargs in ({"block": 0}, {"rounds": 0}, {"settle": -1}, {"min_gain": 1.0}):
        with pytest.raises(ValueError, match="CommsStepCheck: expected block >= 1"):
            CommsStepCheck(**kwargs)
    with pytest.raises(ValueError, match="CommsConfig.step_check_steps"):
        CommsConfig(step_check_steps=-1)
    with pytest.raises(ValueError, match="precisions"):
        CommsSelection().try_precisions(("fp8", "int4"))


def test_only_a_compressed_multi_rank_unchecked_choice_needs_a_check():
    fp8 = CommsChoice("fp8", "fp32", world_size=2)
    assert CommsStepChecker.needed(fp8, 10)
    assert not CommsStepChecker.needed(fp8, 0)  # the check is off
    assert not CommsStepChecker.needed(CommsChoice("fp32", "fp32", world_size=2), 10)  # fp32 is TorchRec's own
    assert not CommsStepChecker.needed(CommsChoice("fp8", "fp8", world_size=1), 10)
    assert not CommsStepChecker.needed(CommsChoice("fp8", "fp8", world_size=2, step_check={"verdict": {}}), 10)
    assert not CommsStepChecker.needed(CommsChoice("fp32", "fp8", decided=("forward",), world_size=2), 10)  # fp8 not auto's


def test_the_checker_waits_until_ready_then_switches_the_codecs_and_sets_the_checked_choice():
    selection = CommsSelection()
    selection.set(CommsChoice("fp8", "fp8", reasons={"forward": "measured: faster", "backward": "measured: faster"}, world_size=2))
    checker = CommsStepChecker(selection, CommsStepCheck(block=2, rounds=1, settle=0))
    assert checker.observe(1, 9.0, ready=False) is False and not checker.started
    assert checker.observe(2, 9.0, ready=True) is False and checker.started  # starts for the next step
    seen = []
    step = 2
    while not checker.check.done:
        step += 1
        seen.append(selection.precisions())
        ms = 12.0 if selection.precisions() == ("fp8", "fp8") else 10.0  # FP8 slower in the step
        assert checker.observe(step, ms, ready=True) is True
    assert seen == [("fp8", "fp8")] * 2 + [("fp32", "fp32")] * 2
    choice = selection.choice
    assert (choice.forward, choice.backward, selection.trial) == ("fp32", "fp32", None)
    assert choice.step_check["chosen"] == {"forward": "fp8", "backward": "fp8"}
    assert choice.step_check["verdict"]["keep_chosen"] is False and "not faster in the training step" in choice.reasons["forward"]
    assert "forward fp8, backward fp8 checked in the training step: median 12.00 ms vs 10.00 ms in fp32 (1.200x" in choice.summary()
    assert CommsChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice
    assert not CommsStepChecker.needed(choice, 10)  # checked: not again (e.g. after a resume)
    assert checker.observe(step + 1, 1.0, ready=True) is False  # done: the time is Dispatch's again


def _prepare(run_dir):
    from test_comms_auto import _model

    config = loka_torchrec.LokaConfig.from_dict(
        {"enabled": True, "probe": {"enabled": False}, "dispatch": {"mode": "all-bf16"}, "comms": {"step_check_steps": 2}}
    )
    return loka_torchrec.prepare(_model(), config, run_dir=str(run_dir), batch_size=32)


def _decided_fp8(loka, monkeypatch):
    """The timing's choice as on a multi-rank run where FP8 was faster alone."""
    choice = CommsChoice("fp8", "fp8", reasons={"forward": "measured: fp8 faster", "backward": "measured: fp8 faster"},
                         times_ms={"forward": {"fp32": 2.0, "fp8": 1.0}}, world_size=2)  # fmt: skip
    monkeypatch.setattr(prepare_module, "decide_comms_precision", lambda *a, **k: choice)
    assert loka.decide_comms() is choice and loka.comms_checker is not None


def test_loka_runs_the_check_on_the_step_times_dispatch_does_not_need_and_resumes_it(tmp_path, monkeypatch):
    """Dispatch needs no step times here (every GEMM bf16), so the check starts at step 1: blocks of
    2 settle + 2 timed steps, chosen (2-5), fp32 (6-9), fp32 (10-13), chosen (14-17); FP8 is 8 ms a
    step against fp32's 10, so it stays. A checkpoint in the fp32 block resumes in that block."""
    loka = _prepare(tmp_path)
    _decided_fp8(loka, monkeypatch)
    assert "to be checked in the training step" in loka.comms_summary()

    def drive(run, steps, given, seen):
        for step in steps:
            seen.append(run.comms_selection.precisions())
            run.step_end(step, step_ms=8.0 if run.comms_selection.precisions() == ("fp8", "fp8") else 10.0)
            if step == 7:
                states.append(run.state_dict())
                assert "being checked in the training step" in run.comms_summary()

    given, seen, states = [], [], []
    monkeypatch.setattr(loka.dispatcher, "observe_step_time", lambda step, ms: given.append(step))
    drive(loka, range(1, 20), given, seen)
    fp8, fp32 = ("fp8", "fp8"), ("fp32", "fp32")
    assert seen == [fp8] * 5 + [fp32] * 8 + [fp8] * 6
    assert given == [1, 18, 19]  # the check's 16 steps are its own
    choice = loka.comms_choice
    assert (choice.forward, choice.backward) == ("fp8", "fp8") and choice.step_check["verdict"]["keep_chosen"]
    assert (choice.step_check["verdict"]["chosen_ms"], choice.step_check["verdict"]["fp32_ms"]) == (8.0, 10.0)
    plan = json.loads((tmp_path / prepare_module.COMMS_PLAN_FILE).read_text())
    assert plan["forward"] == "fp8" and plan["choice"]["step_check"]["verdict"]["steps_per_arm"] == 4
    assert "checked in the training step: median 8.00 ms vs 10.00 ms in fp32 (0.800x, 4 steps each): kept" in loka.comms_summary()
    assert "comms_step_check" not in loka.state_dict() and loka.state_dict()["comms_choice"]["step_check"]

    resumed = _prepare(tmp_path / "resumed")
    monkeypatch.setattr(prepare_module, "decide_comms_precision", lambda *a, **k: pytest.fail("restored, not timed"))
    resumed.start()
    with monkeypatch.context() as two_ranks:  # the choice is a 2-rank run's: resume it as one
        two_ranks.setattr(prepare_module, "_world_size", lambda group: 2)
        resumed.load_state_dict(states[0], step=7)
    assert resumed.comms_checker.started and resumed.comms_selection.precisions() == fp32  # step 8 runs in the fp32 arm
    resumed_given, resumed_seen = [], []
    monkeypatch.setattr(resumed.dispatcher, "observe_step_time", lambda step, ms: resumed_given.append(step))
    drive(resumed, range(8, 20), resumed_given, resumed_seen)
    assert resumed_seen == seen[7:] and resumed_given == [18, 19]
    assert resumed.comms_choice == choice


def test_a_slower_step_sends_the_choice_back_to_fp32(tmp_path, monkeypatch):
    loka = _prepare(tmp_path)
    _decided_fp8(loka, monkeypatch)
    for step in range(1, 19):
        loka.step_end(step, step_ms=10.5 if loka.comms_selection.precisions() == ("fp8", "fp8") else 10.0)
    choice = loka.comms_choice
    assert (choice.forward, choice.backward) == ("fp32", "fp32") and loka.comms_selection.precisions() == ("fp32", "fp32")
    assert "fp32 instead" in loka.comms_summary() and "forward fp32, backward fp32" in loka.comms_summary()


def test_the_guard_collects_only_with_a_baseline_and_until_its_verdict():
    guard = StepTimeGuard(window=4, tolerance=0.0, settle=0)
    assert guard.collecting is False  # no baseline yet
    for step in range(1, 3):
        guard.observe(step, 10.0, fp8_active=False)
    assert guard.collecting  # 2 baseline steps: a trial would be judged
    for step in range(3, 7):
        guard.observe(step, 9.0, fp8_active=True)
    assert guard.collecting is False  # judged
    assert not StepTimeGuard(window=0).collecting


def _two_rank_check(rank, world, init_file, out_dir):
    from multirank import process_group, write_result

    with process_group(rank, world, init_file):
        selection = CommsSelection()
        selection.set(CommsChoice("fp8", "fp8", world_size=world))
        checker = CommsStepChecker(selection, CommsStepCheck(block=2, rounds=1, settle=0, min_gain=0.0))
        checker.observe(1, 1.0, ready=True)
        step = 1
        while not checker.check.done:
            step += 1
            fp8 = selection.precisions() == ("fp8", "fp8")
            # rank 0 alone would keep FP8 (5 < 6 ms); rank 1's FP8 step is slower (8 ms): the slowest rank counts
            ms = (5.0 if rank == 0 else 8.0) if fp8 else 6.0
            checker.observe(step, ms, ready=True)
        write_result(out_dir, rank, selection.choice.to_dict())


@pytest.mark.slow
def test_ranks_agree_on_the_slowest_ranks_medians(tmp_path):
    from multirank import spawn_ranks

    spawn_ranks(_two_rank_check, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    choices = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert choices[0] == choices[1]
    verdict = choices[0]["step_check"]["verdict"]
    assert (verdict["chosen_ms"], verdict["fp32_ms"], verdict["keep_chosen"]) == (8.0, 6.0, False)
    assert (choices[0]["forward"], choices[0]["backward"]) == ("fp32", "fp32")
