"""The ``"auto"`` comms choice checked in the training step: FP8 on the wire stays only if the step got faster.

:func:`~loka_torchrec.comms.auto.decide` times one all-to-all alone. In training the all-to-all
overlaps other work, and the codec's encode and decode add kernels to a step that may already be
bound elsewhere: a precision faster alone can leave the step as slow, or slower. So when ``decide``
chose a compressed precision for some ``"auto"`` direction, :class:`CommsStepCheck` times the
training step itself with that choice and with fp32 in those directions, in alternating blocks
(A B B A ...: a drift during the check weighs on both), once Dispatch no longer needs step times
(its plan is made and judged: the step checked is the step that then runs). Per block it skips
``settle`` steps after the switch, then takes ``block`` step times; steps without a time (eager
probe steps, evaluations) do not count. The verdict compares the medians: the compressed choice
stays when its median is at least ``min_gain`` faster than fp32's, else fp32 it is.

:class:`CommsStepCheck` is the bookkeeping; :class:`StepCheckRun` drives it through training for
anything that switches between two arms (the job's dense all-reduce check uses it too);
:class:`CommsStepChecker` runs it on a run's
:class:`~loka_torchrec.comms.choice.CommsSelection`: it switches the codecs between steps, makes the
ranks agree on the medians (the slowest rank counts) and sets the checked choice.
:class:`~loka_torchrec.prepare.Loka` hands it every timed step and says when Dispatch is done with
step times.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Any, Callable, Dict, List, Optional, Tuple


from loka_torchrec.comms.choice import CommsChoice, CommsSelection
from loka_torchrec.comms.ranks import max_over_ranks

__all__ = ["ARMS", "CommsStepCheck", "CommsStepChecker", "StepCheckDriver", "StepCheckRun", "StepCheckVerdict", "agreed_medians"]

logger = logging.getLogger(__name__)

ARMS = ("chosen", "fp32")


@dataclasses.dataclass(frozen=True)
class StepCheckVerdict:
    """The end of a check: median step times of both arms and whether the chosen precision stays."""

    step: int
    chosen_ms: float
    fp32_ms: float
    keep_chosen: bool
    steps_per_arm: int

    def describe(self) -> str:
        verb = "kept" if self.keep_chosen else "fp32 instead"
        return (
            f"checked in the training step: median {self.chosen_ms:.2f} ms with it vs {self.fp32_ms:.2f} ms in fp32 "
            f"({self.chosen_ms / self.fp32_ms:.3f}x, {self.steps_per_arm} steps each, slowest rank): {verb}"
        )


class CommsStepCheck:
    """Which arm (:data:`ARMS`) the next step runs, and the verdict when the check is complete.

    Args:
        block: step times per block (>= 1).
        rounds: pairs of blocks (>= 1); the arms alternate chosen, fp32, fp32, chosen, ...
        settle: steps skipped after each switch (the first calls of a codec, the allocator).
        min_gain: how much faster (a fraction) the chosen precision's median step must be.

    Example::

        >>> check = CommsStepCheck(block=2, rounds=1, settle=0, min_gain=0.0)
        >>> check.arm
        'chosen'
        >>> check.observe(1, 5.0), check.observe(2, 5.0), check.arm
        (None, True, 'fp32')
        >>> check.observe(3, 9.0), check.observe(4, 9.0).keep_chosen
        (None, True)
    """

    def __init__(self, block: int = 10, rounds: int = 2, settle: int = 2, min_gain: float = 0.01) -> None:
        if block < 1 or rounds < 1 or settle < 0 or not 0.0 <= min_gain < 1.0:
            raise ValueError(
                f"CommsStepCheck: expected block >= 1, rounds >= 1, settle >= 0, 0 <= min_gain < 1, "
                f"got {block}, {rounds}, {settle}, {min_gain}"
            )
        self.block, self.rounds, self.settle, self.min_gain = block, rounds, settle, min_gain
        self.schedule: List[str] = [arm for r in range(rounds) for arm in (ARMS if r % 2 == 0 else ARMS[::-1])]
        self.samples: Dict[str, List[float]] = {arm: [] for arm in ARMS}
        self.position = 0  # index into the schedule
        self._skipped = 0
        self._taken = 0
        self.verdict: Optional[StepCheckVerdict] = None

    @property
    def total_steps(self) -> int:
        """Timed steps the whole check takes (settling included)."""
        return len(self.schedule) * (self.settle + self.block)

    @property
    def done(self) -> bool:
        return self.position >= len(self.schedule)

    @property
    def arm(self) -> Optional[str]:
        """The arm the next step runs in (``None`` once the check is complete)."""
        return None if self.done else self.schedule[self.position]

    def observe(self, step: int, step_ms: Optional[float]) -> Optional[object]:
        """Record the step that just ran in :attr:`arm`. Returns ``True`` when the arm changes for
        the next step, the :class:`StepCheckVerdict` (medians of this rank) when the check is
        complete, else ``None``. A step without a time (``None``, NaN) counts for nothing."""
        if self.done or step_ms is None or step_ms != step_ms or step_ms < 0:
            return None
        if self._skipped < self.settle:
            self._skipped += 1
            return None
        self.samples[self.schedule[self.position]].append(float(step_ms))
        self._taken += 1
        if self._taken < self.block:
            return None
        self.position += 1
        self._skipped = self._taken = 0
        if not self.done:
            return True
        return self.judge(step, statistics.median(self.samples["chosen"]), statistics.median(self.samples["fp32"]))

    def judge(self, step: int, chosen_ms: float, fp32_ms: float) -> StepCheckVerdict:
        """The verdict from the medians (those the ranks agreed on), kept as :attr:`verdict`."""
        keep = chosen_ms <= fp32_ms * (1.0 - self.min_gain)
        self.verdict = StepCheckVerdict(step, chosen_ms, fp32_ms, keep, self.block * self.rounds)
        return self.verdict

    def state_dict(self) -> dict:
        """Where the check stands (a checkpoint carries it: a resumed check goes on)."""
        return {"position": self.position, "skipped": self._skipped, "taken": self._taken,
                "samples": {arm: list(v) for arm, v in self.samples.items()},
                "verdict": None if self.verdict is None else dataclasses.asdict(self.verdict)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.position, self._skipped, self._taken = int(state["position"]), int(state["skipped"]), int(state["taken"])
        self.samples = {arm: [float(v) for v in state["samples"].get(arm, [])] for arm in ARMS}
        self.verdict = None if state.get("verdict") is None else StepCheckVerdict(**state["verdict"])


def agreed_medians(check: CommsStepCheck, process_group: Any = None) -> List[float]:
    """The medians of ``check``'s arms (:data:`ARMS` order), the largest over the ranks of
    ``process_group`` (a collective; one process: its own), so that every rank judges alike."""
    return max_over_ranks([statistics.median(check.samples[arm]) for arm in ARMS], process_group)


class StepCheckRun:
    """A :class:`CommsStepCheck` driven through training, for whatever switches between the arms.

    It starts at the first timed step at which ``ready`` (nothing else needs step times), has
    ``apply_arm(arm)`` put the next step in each block's arm, and ends with the verdict on the
    medians the ranks agreed on (:func:`agreed_medians`).

    Args:
        check: the bookkeeping.
        apply_arm: ``apply_arm("chosen" | "fp32")`` before the steps of that arm; ``apply_arm(None)``
            at the end, before the caller acts on the verdict.
        process_group: the ranks that agree (default: the world).
    """

    def __init__(self, check: CommsStepCheck, apply_arm: Callable[[Optional[str]], None], process_group: Any = None) -> None:
        self.check, self.apply_arm, self.process_group = check, apply_arm, process_group
        self.started = False

    @property
    def running(self) -> bool:
        return self.started and not self.check.done

    def observe(self, step: int, step_ms: Optional[float], *, ready: bool) -> Tuple[bool, Optional[StepCheckVerdict]]:
        """The step that just ran took ``step_ms`` (``None``: not timed). Returns ``(taken, verdict)``:
        whether the time belongs to the check (then nobody else should use it: it is one arm's), and
        the agreed verdict at the step that ends the check."""
        if self.check.done:
            return False, None
        if not self.started:
            if ready and step_ms is not None:
                self.started = True
                self.apply_arm(self.check.arm)
            return False, None
        result = self.check.observe(step, step_ms)
        if result is True:
            self.apply_arm(self.check.arm)
        elif result is not None:
            self.apply_arm(None)
            return True, self.check.judge(step, *agreed_medians(self.check, self.process_group))
        return True, None

    def state_dict(self) -> Dict[str, Any]:
        return {"started": self.started, **self.check.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check.load_state_dict(state)
        self.started = bool(state.get("started", False))
        if self.running:
            self.apply_arm(self.check.arm)


class StepCheckDriver:
    """What a step check shows, read from the :class:`StepCheckRun` it drives (``self.run``)."""

    run: StepCheckRun

    @property
    def check(self) -> CommsStepCheck:
        return self.run.check

    @property
    def started(self) -> bool:
        return self.run.started

    @property
    def running(self) -> bool:
        return self.run.running

    @property
    def verdict(self) -> Optional[StepCheckVerdict]:
        return self.check.verdict


class CommsStepChecker(StepCheckDriver):
    """Runs a :class:`CommsStepCheck` of the choice in ``selection`` (see the module docstring).

    Args:
        selection: the run's selection, whose choice compressed some decided direction.
        check: the bookkeeping (its block size from ``CommsConfig.step_check_steps``).
        process_group: the ranks that agree on the medians (default: the world).
    """

    def __init__(self, selection: CommsSelection, check: CommsStepCheck, process_group: Any = None) -> None:
        self.selection = selection
        self.run = StepCheckRun(check, self._apply_arm, process_group)

    @staticmethod
    def needed(choice: Optional[CommsChoice], block: int) -> bool:
        """Whether ``choice`` is to be checked: it compresses a direction it decided, on several ranks,
        and has not been checked (a checked choice carries its verdict), with the check on."""
        if choice is None or block == 0 or choice.world_size == 1 or choice.step_check:
            return False
        return any(getattr(choice, d) != "fp32" for d in choice.decided)

    def observe(self, step: int, step_ms: float, *, ready: bool) -> bool:
        """The step that just ran took ``step_ms``. Starts the check at the first step when
        ``ready`` (Dispatch needs no step times); while it runs, takes the step's time, switches the
        arm between blocks and ends with the checked choice. Returns whether the time was taken
        (then nobody else should use it: it belongs to one arm of the comparison)."""
        was_started = self.run.started
        taken, verdict = self.run.observe(step, step_ms, ready=ready)
        if self.run.started and not was_started:
            logger.info("loka comms: checking %s in the training step, blocks of %d steps", self._chosen_words(), self.check.block)
        if verdict is not None:
            self._finish(verdict)
        return taken

    def _chosen_words(self) -> str:
        choice = self.selection.choice
        return ", ".join(f"{d} {getattr(choice, d)}" for d in choice.decided)

    def _apply_arm(self, arm: Optional[str]) -> None:
        self.selection.try_precisions(("fp32", "fp32") if arm == "fp32" else None)

    def _finish(self, verdict: StepCheckVerdict) -> None:
        choice = self.selection.choice
        record = {"chosen": {d: getattr(choice, d) for d in choice.decided}, "verdict": dataclasses.asdict(verdict)}
        if verdict.keep_chosen:
            checked = dataclasses.replace(choice, step_check=record)
        else:
            reasons = {d: f"{choice.reasons.get(d, '')}; not faster in the training step" for d in choice.decided}
            checked = dataclasses.replace(choice, **{d: "fp32" for d in choice.decided}, reasons=reasons, step_check=record)
        self.selection.set(checked)
        logger.info("loka comms: %s, %s", self._chosen_words() if verdict.keep_chosen else "the timing's choice", verdict.describe())

    def state_dict(self) -> Dict[str, Any]:
        return self.run.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run.load_state_dict(state)
