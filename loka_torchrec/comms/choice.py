"""What ``CommsConfig`` precision ``"auto"`` decided for a run, and the holder its codecs read.

:class:`CommsChoice` is the decision (the precision per direction, the timings it came from and
why); it goes into ``Loka.state_dict()``, ``RUN_DIR/comms_plan.json`` and the job's summary.
:class:`CommsSelection` is the one mutable object every ``"auto"`` codec of a run shares
(:class:`~loka_torchrec.comms.codec.AutoCommCodec`): the codecs are built with the sharders,
before ``DistributedModelParallel``, and the choice is set on the selection after DMP exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

from loka_torchrec.comms.config import FIXED_PRECISIONS

__all__ = ["CommsChoice", "CommsSelection", "DIRECTIONS"]

DIRECTIONS = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class CommsChoice:
    """The precision each ``"auto"`` direction of the embedding all-to-all runs in, and why.

    Attributes:
        forward: precision of the forward payload (``"fp32"``, ``"bf16"`` or ``"fp8"``).
        backward: precision of the gradients.
        decided: the directions this choice decided (those that were ``"auto"``); the others
            follow ``CommsConfig`` as given.
        reasons: ``{direction: why}`` for each decided direction.
        times_ms: ``{direction: {precision: ms}}``, the median time of one all-to-all of the
            payload (encode and decode included), the largest over ranks; empty when nothing
            was timed.
        payload: what was timed (``values_per_rank``, ``width``, ``rows_per_rank``, ``source``).
        world_size: ranks of the process group the choice is for.
        seconds: host seconds the decision took on this rank.
        step_check: the check in the training step (:mod:`~loka_torchrec.comms.step_check`):
            ``{"chosen": {...}, "verdict": {...}}``, the precisions the timing chose and the
            verdict; empty when the choice was not checked (fp32 everywhere, or the check off).
    """

    forward: str
    backward: str
    decided: Tuple[str, ...] = DIRECTIONS
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)
    times_ms: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    payload: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    world_size: int = 1
    seconds: float = 0.0
    step_check: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in DIRECTIONS:
            value = getattr(self, name)
            if value not in FIXED_PRECISIONS:
                raise ValueError(f"CommsChoice.{name}: expected one of {', '.join(FIXED_PRECISIONS)}, got {value!r}")
        decided = tuple(self.decided)
        bad = [d for d in decided if d not in DIRECTIONS]
        if bad:
            raise ValueError(f"CommsChoice.decided: expected directions among forward, backward, got {bad}")
        object.__setattr__(self, "decided", decided)
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"CommsChoice.world_size: expected a positive int, got {self.world_size!r}")

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (``from_dict`` reads it back)."""
        out = dataclasses.asdict(self)
        out["decided"] = list(self.decided)
        out["reasons"] = dict(self.reasons)
        out["times_ms"] = {d: dict(t) for d, t in self.times_ms.items()}
        out["payload"] = dict(self.payload)
        out["step_check"] = {k: dict(v) for k, v in self.step_check.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CommsChoice":
        """Read :meth:`to_dict`'s output; a wrong shape is a one-line ``ValueError``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"comms choice: expected a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"comms choice: unknown keys {unknown}")
        missing = [k for k in DIRECTIONS if k not in data]
        if missing:
            raise ValueError(f"comms choice: missing keys {missing}")
        kwargs = dict(data)
        if "decided" in kwargs:
            kwargs["decided"] = tuple(kwargs["decided"])
        return cls(**kwargs)

    def summary(self) -> str:
        """One line: each decided direction's precision, its timings and why."""
        parts = []
        for direction in self.decided:
            times = self.times_ms.get(direction) or {}
            timed = ", ".join(f"{p} {ms:.3f} ms" for p, ms in times.items())
            parts.append(f"{direction} {getattr(self, direction)} ({timed + '; ' if timed else ''}{self.reasons.get(direction, '')})")
        line = "; ".join(parts) + f" [{self.world_size} rank(s), decided in {self.seconds:.2f} s]"
        verdict = self.step_check.get("verdict")
        if verdict:
            chosen = self.step_check.get("chosen") or {}
            was = ", ".join(f"{d} {p}" for d, p in chosen.items())
            ratio = verdict["chosen_ms"] / verdict["fp32_ms"] if verdict["fp32_ms"] else float("nan")
            line += (
                f"; {was} checked in the training step: median {verdict['chosen_ms']:.2f} ms vs {verdict['fp32_ms']:.2f} ms "
                f"in fp32 ({ratio:.3f}x, {verdict['steps_per_arm']} steps each): "
                + ("kept" if verdict["keep_chosen"] else "fp32 instead")
            )
        return line


class CommsSelection:
    """The choice every ``"auto"`` codec of one run reads at each collective; set once, before training.

    Until :meth:`set` is called, :meth:`precisions` is ``("fp32", "fp32")``: the codecs pass the
    payload through unchanged, as TorchRec without codecs would.
    """

    def __init__(self) -> None:
        self.choice: Optional[CommsChoice] = None
        self.trial: Optional[Tuple[str, str]] = None

    def set(self, choice: CommsChoice) -> None:
        if not isinstance(choice, CommsChoice):
            raise TypeError(f"choice: expected a CommsChoice, got {type(choice).__name__}")
        self.choice = choice

    def try_precisions(self, precisions: Optional[Tuple[str, str]]) -> None:
        """Run ``(forward, backward)`` instead of the choice until called with ``None`` (the comms
        step check's fp32 arm); set between training steps, as the choice is."""
        if precisions is not None and any(p not in FIXED_PRECISIONS for p in precisions):
            raise ValueError(f"precisions: expected two of {', '.join(FIXED_PRECISIONS)}, got {precisions!r}")
        self.trial = None if precisions is None else tuple(precisions)

    def precisions(self) -> Tuple[str, str]:
        """``(forward, backward)`` in force for the ``"auto"`` directions."""
        if self.trial is not None:
            return self.trial
        if self.choice is None:
            return "fp32", "fp32"
        return self.choice.forward, self.choice.backward

    def __repr__(self) -> str:
        return f"CommsSelection({'undecided: fp32' if self.choice is None else self.choice.summary()})"
