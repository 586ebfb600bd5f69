"""Training steps whose loss is not finite: skipped, counted, and a stop after too many in a row.

What a large training job expects (the loss-scaler habit of mixed precision): a step whose loss
is inf or NaN on any rank changes nothing. Its backward is not run, so neither the dense
optimizer nor TorchRec's fused embedding optimizer (which updates the tables inside the
backward) sees its gradients, and its optimizer step is skipped. The ranks all-reduce one flag
per step before the backward, so that they skip together (the backward's collectives must match).

After ``limit`` consecutive skipped steps the run cannot recover by itself, and
:class:`NonFiniteLossError` stops it, naming the step, the first layer the safety valve sent
back to bf16, and the newest checkpoint written before the streak (to resume from, e.g. with a
lower learning rate).

Only the loss is checked: a finite loss with a non-finite gradient is applied, and shows as a
non-finite loss from the next step on.

The same all-reduce carries a second flag, a stop request (a SIGTERM, :mod:`~loka_job.training.preemption`),
so that the ranks also agree, at no extra collective, on the step after which they stop.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from loka_job.training.errors import JobError

__all__ = ["NonFiniteLossError", "NonFiniteSteps"]


class NonFiniteLossError(JobError, RuntimeError):
    """Too many consecutive training steps had a non-finite loss; the message says where to go on from."""


class NonFiniteSteps:
    """Skips the steps of a TorchRec train pipeline whose loss is not finite (see the module docstring).

    Args:
        limit: stop once this many consecutive steps were skipped (``train.max_nonfinite_steps``).

    Example::

        >>> steps = NonFiniteSteps(limit=2)
        >>> steps.nonfinite(torch.tensor([float("nan")])), steps.nonfinite(torch.tensor([1.0]))
        (True, False)
    """

    def __init__(self, limit: int) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"train.max_nonfinite_steps: expected an int >= 1, got {limit!r}")
        self.limit = limit
        self.skipped: List[int] = []  # every skipped step of the run, resumed ones included
        self.consecutive = 0
        self.stop_agreed = False  # some rank asked to stop in a step so far (see install's stop_requested)
        self._skip_current = False

    def nonfinite(self, losses: torch.Tensor) -> bool:
        """Whether any rank's ``losses`` hold inf or NaN (a collective: every rank calls it)."""
        return self.exchange(losses, stop_requested=False)[0]

    def exchange(self, losses: torch.Tensor, *, stop_requested: bool) -> Tuple[bool, bool]:
        """``(any rank's losses hold inf or NaN, any rank asked to stop)``: one all-reduce of two
        flags (a collective: every rank calls it)."""
        nonfinite = (~torch.isfinite(losses.detach())).any().to(torch.float32).reshape(1)
        flags = torch.cat([nonfinite, torch.full_like(nonfinite, float(stop_requested))])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        nonfinite_any, stop_any = flags.tolist()
        return bool(nonfinite_any), bool(stop_any)

    def install(self, pipeline, *, stop_requested: Optional[Callable[[], bool]] = None) -> None:
        """Wrap ``pipeline``'s backward and optimizer step (``TrainPipelineSparseDist``'s
        ``_backward`` and ``_optimizer_step``) so that a non-finite loss skips both.

        ``stop_requested``: whether this rank was asked to stop (e.g. ``StopSignal.requested``);
        its value goes into the same all-reduce, and :attr:`stop_agreed` turns true on every rank
        in the step where any rank asked.
        """
        backward = pipeline._backward
        optimizer_step = getattr(pipeline, "_optimizer_step", None)

        def guarded_backward(losses: torch.Tensor) -> None:
            asked = stop_requested is not None and stop_requested()
            self._skip_current, stop = self.exchange(losses, stop_requested=asked)
            self.stop_agreed = self.stop_agreed or stop
            if not self._skip_current:
                backward(losses)

        pipeline._backward = guarded_backward
        if optimizer_step is not None:  # without it, the step sees no gradients (zero_grad set them to None)

            def guarded_step() -> None:
                if not self._skip_current:
                    optimizer_step()

            pipeline._optimizer_step = guarded_step

    def after_step(self, step: int) -> bool:
        """Count the step just run; returns whether it was skipped."""
        skipped, self._skip_current = self._skip_current, False
        if skipped:
            self.skipped.append(step)
            self.consecutive += 1
        else:
            self.consecutive = 0
        return skipped

    @property
    def exhausted(self) -> bool:
        """The run must stop: ``limit`` consecutive steps were skipped."""
        return self.consecutive >= self.limit

    def error(self, step: int, *, first_valve: Optional[str], last_checkpoint: Optional[str]) -> NonFiniteLossError:
        """The one-line error that stops the run at ``step``."""
        first = step - self.consecutive + 1
        valve = first_valve or "no layer tripped the safety valve"
        resume = f"last good checkpoint: {last_checkpoint}" if last_checkpoint else "no checkpoint was written before it"
        return NonFiniteLossError(
            f"train: the loss was not finite for {self.consecutive} consecutive steps ({first} to {step}; "
            f"train.max_nonfinite_steps={self.limit}); first layer the safety valve saw: {valve}; {resume}",
            field="train.max_nonfinite_steps",
        )

    def state_dict(self) -> Dict[str, Any]:
        return {"skipped": list(self.skipped), "consecutive": self.consecutive}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.skipped = [int(s) for s in state.get("skipped", [])]
        self.consecutive = int(state.get("consecutive", 0))
