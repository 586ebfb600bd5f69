"""``loka_torchrec.prepare``: LoKA for an existing TorchRec job, as one object.

:func:`prepare` does, on the unsharded model and before ``DistributedModelParallel`` wraps it,
everything LoKA is: the model mods, the conversion of the linear layers, the Probe that learns
their statistics, the Dispatcher that plans a kernel per GEMM from the Probe's evidence (with its
accuracy gate, speed gate, layer check and step-time guard), the FP8 embedding comms (through
:meth:`Loka.sharders`; ``"auto"`` precisions are decided by :meth:`Loka.decide_comms` before the
first step) and, when asked, ``torch.compile`` of the dense modules. The returned :class:`Loka`
is what the job holds: it gives DMP its sharders, hears about each step, and puts every decision
into the job's checkpoints.

Example (the lines a TorchRec job adds; ``model`` built, process group initialized)::

    loka = loka_torchrec.prepare(model, loka_torchrec.LokaConfig(enabled=True), run_dir="runs/x")
    model = DistributedModelParallel(model, device=device, sharders=loka.sharders())
    ...
    for step in range(1, steps + 1):
        with loka.step(step):
            pipeline.progress(batches)
    checkpoint["loka"] = loka.state_dict()   # and loka.load_state_dict(...) on resume
    loka.close()

``LokaConfig(enabled=False)`` gives a :class:`Loka` that changes nothing: the model is left as it
is, ``step`` blocks run the loop as they are, ``sharders()`` gives TorchRec's sharders without codecs.

What is refused, each with one line that says what to do: a model already prepared (by a Loka not
closed) or already sharded by ``DistributedModelParallel`` with compressed comms, a device this
machine does not have (:mod:`loka_torchrec.prepare_checks`); ``loka.step(s)`` never entered with
``with``, step numbers that repeat or go backwards, nested ``step`` blocks (:mod:`loka_torchrec.steps`);
a checkpoint of another model (:meth:`Loka.load_state_dict`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from loka_torchrec.activation_offload import offload_saved_activations
from loka_torchrec.api import ApplyReport, apply
from loka_torchrec.atomic_files import write_json_atomic
from loka_torchrec.comms.auto import decide as decide_comms_precision
from loka_torchrec.comms.choice import CommsChoice, CommsSelection
from loka_torchrec.comms.config import CommsConfig
from loka_torchrec.comms.ranks import world_size as _world_size
from loka_torchrec.comms.sharders import model_embedding_dims
from loka_torchrec.comms.sharders import sharders as comms_sharders
from loka_torchrec.comms.step_check import CommsStepCheck, CommsStepChecker
from loka_torchrec.compile import compile_dense, dense_modules, eager, end_compiled_step, resolve_compile_mode, uses_cuda_graphs
from loka_torchrec.config import LokaConfig
from loka_torchrec.dense_inputs import DenseInputs
from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.dispatch.dispatcher import Dispatcher
from loka_torchrec.plain_state import from_plain, to_plain
from loka_torchrec.prepare_checks import PREPARED, check_device, check_not_prepared, check_not_sharded
from loka_torchrec.probe import ProbeCallback
from loka_torchrec.steps import StepBlock, StepOrder

__all__ = ["Loka", "prepare", "COMMS_PLAN_FILE"]

logger = logging.getLogger(__name__)

COMMS_PLAN_FILE = "comms_plan.json"
"""In the run folder: the comms precisions in force, and for ``"auto"`` how they were decided."""


@dataclasses.dataclass
class Loka:
    """What :func:`prepare` set up for one job (one per rank).

    Attributes:
        config: the configuration in force (``dispatch.compiled`` set when the dense modules compile).
        report: what the conversion and the mods changed (:class:`~loka_torchrec.api.ApplyReport`).
        probe: the Probe callback, or ``None`` when ``probe.enabled`` is false.
        compiled_modules: the dense submodules compiled in place (empty: eager).
        comms_selection: the choice the ``"auto"`` comm codecs follow (``None`` when no
            direction is ``"auto"``); set by :meth:`decide_comms` or :meth:`load_state_dict`.
        comms_checker: the check of a compressed ``"auto"`` choice in the training step
            (``comms.step_check_steps``; ``None``: nothing to check).
        run_dir, process_group, batch_size, embedding_dims: what :meth:`decide_comms` writes to
            and times (see :func:`prepare`).
        dense_inputs: with ``dispatch.grad_check`` under a ``policy`` plan, the dense modules'
            inputs recorded until the first FP8 plan is checked (then ``None``).
        cuda_graphs: the compiled modules replay CUDA graphs (``compile="reduce-overhead"``):
            :meth:`step_end` marks the end of each step for them
            (:func:`~loka_torchrec.compile.end_compiled_step`).
        model: the model prepared (marked so until :meth:`close`; ``None`` when LoKA is off).
        offload_probe_activations: the steps whose compiled modules run eagerly, and the gradient
            check's passes, keep autograd's saved activations in pinned host memory
            (``probe.offload_activations``, on a CUDA device).
    """

    config: LokaConfig
    report: ApplyReport
    probe: Optional[Any]
    compiled_modules: List[str]
    comms_selection: Optional[CommsSelection] = None
    comms_checker: Optional[CommsStepChecker] = None
    run_dir: Optional[str] = None
    process_group: Optional[Any] = None
    batch_size: Optional[int] = None
    embedding_dims: List[int] = dataclasses.field(default_factory=list)
    dense_inputs: Optional[DenseInputs] = None
    cuda_graphs: bool = False
    model: Optional[nn.Module] = None
    offload_probe_activations: bool = False
    _started: bool = False
    _last_step_end: Optional[float] = None
    _comms_restored: bool = False
    _steps: StepOrder = dataclasses.field(default_factory=StepOrder)

    @property
    def enabled(self) -> bool:
        """Whether LoKA acts (``config.enabled``); a disabled Loka changes nothing."""
        return self.config.enabled

    @property
    def dispatcher(self):
        """The :class:`~loka_torchrec.dispatch.Dispatcher` that owns the plan (``dispatcher.plan``;
        what runs now: ``dispatcher.in_force()``)."""
        return self.report.dispatcher

    # ------------------------------------------------------------------ the job's hooks
    def sharders(self, sharders: Optional[Sequence[Any]] = None, *, fused_params: Optional[Dict[str, Any]] = None) -> list:
        """Sharders for ``DistributedModelParallel``: TorchRec's embedding sharders with LoKA's comm
        codecs (``comms.forward`` / ``comms.backward``; plain fp32 comms when both are fp32 or LoKA
        is off; the ``"auto"`` directions follow :attr:`comms_selection`, fp32 until :meth:`decide_comms`).

        Args:
            sharders: the sharders the job would give ``DistributedModelParallel`` without LoKA
                (e.g. ``get_default_sharders()``): those of other module types follow LoKA's, and
                TorchRec's own ``EmbeddingBagCollectionSharder`` / ``EmbeddingCollectionSharder`` are
                replaced by LoKA's, which take their ``fused_params``
                (:func:`loka_torchrec.comms.sharders.sharders` says what is refused).
            fused_params: TBE options for LoKA's sharders (the fused optimizer, cache settings), as
                TorchRec's sharders take them.

        Example::

            model = DistributedModelParallel(model, sharders=loka.sharders(get_default_sharders(), fused_params=fused))
        """
        comms = self.config.comms if self.enabled else CommsConfig(forward="fp32", backward="fp32")
        return comms_sharders(comms, selection=self.comms_selection, fused_params=fused_params, extra=sharders)

    @property
    def comms_choice(self) -> Optional[CommsChoice]:
        """The decision of the ``"auto"`` comms directions (``None``: none, or not decided yet)."""
        return None if self.comms_selection is None else self.comms_selection.choice

    def decide_comms(self, *, timer=None) -> Optional[CommsChoice]:
        """Decide the ``"auto"`` comms precisions once, before the first training step (a collective).

        Every rank times the embedding all-to-all in fp32 and in FP8 on the process group and all
        take the same decision (:func:`loka_torchrec.comms.decide`); one rank takes fp32 without
        timing. The choice switches the codecs the sharders installed, is logged and written to
        ``RUN_DIR/comms_plan.json``. Nothing is done when no direction is ``"auto"`` or a choice
        is already set (decided, or restored by :meth:`load_state_dict`, which a resumed job
        calls first). :meth:`step` calls it; a job that drives :meth:`step_end` itself calls it
        after restoring its checkpoint, before the first step.

        Args:
            timer: passed to :func:`~loka_torchrec.comms.decide` (tests).
        """
        if self.comms_selection is None or self.comms_selection.choice is not None:
            return self.comms_choice
        choice = decide_comms_precision(
            self.config.comms, process_group=self.process_group, embedding_dims=self.embedding_dims,
            batch_size=self.batch_size, timer=timer,
        )  # fmt: skip
        self.comms_selection.set(choice)
        logger.info("loka comms: %s", choice.summary())
        self._arm_comms_check()
        self._write_comms_plan()
        return choice

    def _arm_comms_check(self) -> None:
        """A compressed ``"auto"`` choice not checked yet gets its check in the training step; it
        starts once Dispatch needs no step times (:meth:`_step_times_free`)."""
        if CommsStepChecker.needed(self.comms_choice, self.config.comms.step_check_steps):
            check = CommsStepCheck(block=self.config.comms.step_check_steps)
            self.comms_checker = CommsStepChecker(self.comms_selection, check, self.process_group)

    def _step_times_free(self) -> bool:
        """Whether Dispatch is done with step times for now: no policy plan to wait for, no trial of
        one under way. The same on every rank (plans and verdicts are agreed)."""
        dispatcher = self.dispatcher
        plan_pending = (dispatcher.config.mode == "policy" and dispatcher.plan.step == 0
                        and (self.probe is not None or dispatcher.config.evidence != "probe"))  # fmt: skip
        return not plan_pending and not dispatcher.judging_step_times

    def step_times_free(self) -> bool:
        """Whether no decision of LoKA needs step times now (Dispatch's plan made and judged, the comms
        check done or not needed): a job's own step-time comparison may run without confounding them.
        Always true with LoKA off."""
        if not self.enabled:
            return True
        checking = self.comms_checker is not None and not self.comms_checker.check.done
        return not checking and self._step_times_free()

    def _observe_step_time(self, step: int, step_ms: float) -> None:
        """A step's time goes to the comms check while it runs (one of its arms), else to Dispatch."""
        checker = self.comms_checker
        if checker is not None and not checker.check.done:
            taken = checker.observe(step, step_ms, ready=self._step_times_free())
            if checker.check.done:
                self._write_comms_plan()
            if taken:
                return
        self.dispatcher.observe_step_time(step, step_ms)

    def _write_comms_plan(self) -> None:
        if self.run_dir is None or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
            return
        choice = self.comms_choice
        comms = self.config.comms
        if choice is not None:
            comms = comms.resolved(choice.forward, choice.backward)
        plan = {
            "forward": comms.forward,
            "backward": comms.backward,
            "config": dataclasses.asdict(self.config.comms),
            "restored": self._comms_restored,
            "choice": None if choice is None else choice.to_dict(),
        }
        write_json_atomic(os.path.join(self.run_dir, COMMS_PLAN_FILE), plan)

    def start(self) -> None:
        """Check that every rank runs the same plan and write the initial plan file. Called by the
        first :meth:`step` or :meth:`step_end`; call it yourself to check before training."""
        if not self._started and self.enabled:
            self._started = True
            self.dispatcher.start()
            if self.comms_selection is None:
                self._write_comms_plan()  # fixed precisions: nothing to decide
            self._record_dense_inputs(1)

    def eager_at(self, step: int) -> bool:
        """Whether compiled modules must run eagerly at ``step`` (numbered from 1): the Probe's
        hooks are armed, or Dispatch plans from random evidence after it and reads the row counts."""
        if not self.compiled_modules:
            return False
        if self.probe is not None and self.probe.probing:
            return True
        dispatch = self.config.dispatch
        return dispatch.mode == "policy" and dispatch.evidence == "random" and step <= dispatch.plan_at_step

    def step(self, step: int, *, timed: bool = True) -> StepBlock:
        """The block of one training step (numbered from 1): ``with loka.step(step): ...``.

        Compiled modules run eagerly where :meth:`eager_at` says so; at the end of the block the
        step is reported (:meth:`step_end`) with its time: host time from the previous step's end
        (over a window, the loop's throughput; the step-time guard compares medians of these; a
        compiled model's eager steps are not timed). A block left by an exception (the data ran
        out) reports nothing, and its number may run again.

        Args:
            step: the step's number, from 1, larger than the last step's.
            timed: give the step's time to the step-time guard; ``False`` for a step whose time
                holds other work (an evaluation or a checkpoint since the previous step, a profiler).

        Raises:
            RuntimeError: the block of the previous call was never entered (``loka.step(s)``
                without ``with`` does nothing; such a block also warns when it is dropped), or the
                block is entered inside another step's block.
            ValueError: ``step`` is not an int >= 1, or not after the last step (checked on entry).
        """
        self._steps.made(step)
        caller = sys._getframe(1)
        return StepBlock(self, step, timed=timed, where=(caller.f_code.co_filename, caller.f_lineno))

    def _begin_step(self, step: int) -> Tuple[ContextManager, bool]:
        """The block of ``step`` opens: the context its body runs in, and whether it runs eagerly."""
        self._steps.enter(step)
        context, ran_eagerly = contextlib.nullcontext(), True
        if self.enabled:
            self.start()
            self.decide_comms()
            ran_eagerly = not self.compiled_modules or self.eager_at(step)
            if ran_eagerly and self.compiled_modules:
                context = self._eager_step()
        self._steps.inside = step
        return context, ran_eagerly

    def _eager_step(self) -> ContextManager:
        """The context of a step whose compiled modules run eagerly; with ``probe.offload_activations``
        on a GPU, autograd's saved activations wait for the backward in pinned host memory."""
        stack = contextlib.ExitStack()
        stack.enter_context(eager())
        if self.offload_probe_activations:
            stack.enter_context(offload_saved_activations())
        return stack

    def _end_step(self, step: int, *, completed: bool, timed: bool, ran_eagerly: bool) -> None:
        """The block of ``step`` closes; a completed step is reported with its time."""
        self._steps.inside = None
        if not completed:
            return
        now = time.perf_counter()
        # A step whose compiled modules ran eagerly (a probe step) is not the step the guard compares:
        # its time would make the bf16 baseline look slow.
        timed = timed and not (ran_eagerly and self.compiled_modules)
        step_ms = None if self._last_step_end is None or not timed else 1e3 * (now - self._last_step_end)
        self.step_end(step, step_ms=step_ms)
        self._last_step_end = time.perf_counter()  # planning work in step_end is not the next step's

    def _record_dense_inputs(self, step: int) -> None:
        """``dispatch.grad_check``: record the dense modules' inputs in ``step`` if it may be the
        planning step (under compile only eager steps: a hook would change the compiled graph)."""
        if self.dense_inputs is not None and (not self.compiled_modules or self.eager_at(step)):
            self.dense_inputs.record()

    def _drop_unneeded_dense_inputs(self) -> None:
        """After a plan without FP8: the recorded dense inputs have nothing to check; drop them (the
        probe steps that precede a later plan record them again)."""
        if self.dense_inputs is not None and not self.dispatcher.plan.fp8_gemm_count():
            self.dense_inputs.clear()

    def _check_gradients(self, step: int) -> None:
        """``dispatch.grad_check``: the first plan with FP8 is checked against the weight gradients
        of the dense modules on the inputs they saw in the planning step, once per run (all ranks
        make the plan at the same step; the check broadcasts rank 0's result)."""
        inputs, self.dense_inputs = self.dense_inputs, None
        if not inputs.recorded:
            logger.warning("dispatch.grad_check: no dense-module inputs were recorded before the plan at step %d; not checked", step)
            return
        loss_fn = functools.partial(inputs.loss, halves=True)
        if self.offload_probe_activations:  # the check's eager passes save what a probe step does
            loss_fn = functools.partial(_offloaded, loss_fn)
        # The Probe's hooks are armed for the next step already: the check's own passes are not its data.
        with self.probe.paused() if self.probe is not None else contextlib.nullcontext():
            self.dispatcher.check_gradients(loss_fn, step=step)
        inputs.clear()

    def step_end(self, step: int, *, step_ms: Optional[float] = None) -> None:
        """Report the end of training step ``step`` (numbered from 1): the Probe merges and plans
        when due, Dispatch plans from random evidence when due, and ``step_ms`` (the step's wall
        time, if known) goes to the step-time guard. :meth:`step` calls it for you. ``"auto"``
        comms not decided yet are decided here (from the next step on; see :meth:`decide_comms`).
        Call it after the optimizer step: under CUDA graphs it also ends the step for them, and
        the step's compiled outputs must not be read after it. Step numbers must increase (``ValueError``)."""
        self._steps.check_next(step, call="loka.step_end")
        self._steps.last = step
        if not self.enabled:
            return
        self.start()
        self.decide_comms()
        plan = self.dispatcher.plan
        if self.dense_inputs is not None:
            self.dense_inputs.stop()
        self.dispatcher.on_step_end(step)
        if self.probe is not None:
            self.probe.on_step_end(step)
        made = self.dispatcher.plan  # a policy plan made at this step has its step number
        if made.step > 0 and made.step != plan.step:
            if self.dense_inputs is not None and made.fp8_gemm_count():
                self._check_gradients(step)
            self._drop_unneeded_dense_inputs()
        self._record_dense_inputs(step + 1)
        if step_ms is not None:
            self._observe_step_time(step, step_ms)
        if self.cuda_graphs:
            end_compiled_step()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Every decision so far (plan, safety valve, step-time guard, the Probe's statistics and
        schedule, the comms precisions and the ``"auto"`` choice): put it into the job's checkpoint.

        Plain containers and tensors only, so a checkpoint holding it loads with ``torch.load``'s
        default ``weights_only=True`` (the Probe's objects are stored as their fields:
        :mod:`loka_torchrec.plain_state`). With LoKA off: ``{"enabled": False}``.
        """
        if not self.enabled:
            return {"enabled": False}
        state: Dict[str, Any] = {"dispatch": self.dispatcher.state_dict(), "comms": dataclasses.asdict(self.config.comms)}
        if self.comms_choice is not None:
            state["comms_choice"] = self.comms_choice.to_dict()
        if self.comms_checker is not None and not self.comms_checker.check.done:
            state["comms_step_check"] = self.comms_checker.state_dict()
        if self.probe is not None:
            state["probe"] = to_plain(self.probe.state_dict(), path="loka.probe")
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, step: int) -> None:
        """Restore :meth:`state_dict`'s decisions in a job resumed after training step ``step``
        (the next :meth:`step` is ``step + 1`` or later).

        The ``"auto"`` comms choice is restored without timing anything, unless the checkpoint's
        choice did not decide every ``"auto"`` direction of this run or was made for another
        world size (then :meth:`decide_comms` decides anew, and a warning says why). What this
        run's ``dispatch`` configuration changes on resume: :meth:`Dispatcher.load_state_dict
        <loka_torchrec.dispatch.Dispatcher.load_state_dict>`. With LoKA off on either side, a
        warning says that nothing is restored.

        Raises:
            ValueError: ``state`` is not a :meth:`state_dict` (names the missing key), or is of
                another model (names the layers or shapes that differ).
        """
        if not isinstance(state, Mapping) or ("dispatch" not in state and state.get("enabled", True)):
            raise ValueError("loka state: expected the mapping Loka.state_dict() returned (with key 'dispatch')")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"loka.load_state_dict: step: expected the checkpoint's training step, an int >= 0, got {step!r}")
        self._steps.last = step
        if not self.enabled or "dispatch" not in state:
            if self.enabled or "dispatch" in state:
                logger.warning("loka state: LoKA is %s in this run and was %s in the checkpoint; nothing is restored",
                               "on" if self.enabled else "off", "on" if "dispatch" in state else "off")  # fmt: skip
            if self.probe is not None:
                self.probe.resume_at(step + 1)
            return
        self.dispatcher.load_state_dict(state["dispatch"])
        if self.dispatcher.plan.fp8_gemm_count() and self.dense_inputs is not None:
            self.dense_inputs.clear()  # the plan made before the checkpoint was checked then
            self.dense_inputs = None
        if self.comms_selection is not None and state.get("comms_choice") is not None:
            self._restore_comms(CommsChoice.from_dict(state["comms_choice"]))
            if self._comms_restored:
                self._arm_comms_check()  # a choice saved before its check finished is checked in this run
                if self.comms_checker is not None and state.get("comms_step_check"):
                    self.comms_checker.load_state_dict(state["comms_step_check"])
        if self.probe is not None:
            if "probe" in state:
                self.probe.load_state_dict(from_plain(state["probe"]))
            self.probe.resume_at(step + 1)

    def _restore_comms(self, choice: CommsChoice) -> None:
        comms = self.config.comms
        auto = {d for d in ("forward", "backward") if getattr(comms, d) == "auto"}
        world = _world_size(self.process_group)
        if not auto <= set(choice.decided) or choice.world_size != world:
            logger.warning(
                "loka comms: the checkpoint's choice (%s, %d rank(s)) does not fit this run (auto: %s, %d rank(s)); "
                "deciding anew", ", ".join(choice.decided), choice.world_size, ", ".join(sorted(auto)), world,
            )  # fmt: skip
            return
        self.comms_selection.set(choice)
        self._comms_restored = True
        logger.info("loka comms: restored from the checkpoint: %s", choice.summary())
        self._write_comms_plan()

    def comms_summary(self) -> str:
        """One line: the comms precision of each direction and, for ``"auto"``, how it was decided."""
        comms, choice = self.config.comms, self.comms_choice
        if choice is None:
            pending = " (decided before the first step)" if self.comms_selection is not None else ""
            return f"forward {comms.forward}, backward {comms.backward}{pending}"
        resolved = comms.resolved(choice.forward, choice.backward)
        how = "restored from the checkpoint: " if self._comms_restored else ""
        checking = ""
        if self.comms_checker is not None and not self.comms_checker.check.done:
            checking = "; being checked in the training step" if self.comms_checker.started else "; to be checked in the training step"
        return f"forward {resolved.forward}, backward {resolved.backward} (auto, {how}{choice.summary()}{checking})"

    def close(self) -> None:
        """Flush the Probe's logs and remove its hooks (idempotent); the model may be prepared again."""
        if self.probe is not None:
            self.probe.close()
        if self.model is not None and getattr(self.model, PREPARED, False):
            delattr(self.model, PREPARED)

    def __str__(self) -> str:
        if not self.enabled:
            return "LoKA is off (LokaConfig.enabled=False): the model is unchanged"
        lines = [str(self.report)]
        lines.append(f"dispatch: {self.dispatcher.summary()}")
        lines.append(f"probe: {'on' if self.probe is not None else 'off'}; comms: {self.comms_summary()}")
        if self.compiled_modules:
            lines.append(f"torch.compile: {', '.join(self.compiled_modules)}; "
                         f"FP8 forward operands: {self.dispatcher.forward_scaling} scaling")
        return "\n".join(lines)


def prepare(
    model: nn.Module,
    config: Optional[LokaConfig] = None,
    *,
    run_dir: Optional[str] = None,
    compile: str = "none",
    device: Optional[Any] = None,
    process_group=None,
    batch_size: Optional[int] = None,
) -> Loka:
    """Set LoKA up for ``model``, in place, before ``DistributedModelParallel`` wraps it.

    Args:
        model: the unsharded model (embedding tables may be on ``meta``).
        config: what LoKA does; ``None``: ``LokaConfig(enabled=True)`` (the Probe plans each GEMM's
            kernel). ``LokaConfig(enabled=False)`` changes nothing: the returned Loka leaves the
            model as it is, its ``step`` blocks run the loop unchanged, and its ``sharders()`` are
            TorchRec's without codecs.
        run_dir: where the plan, the dispatch events and the Probe's per-rank logs go (the same
            folder on every rank; ``loka-inspect RUN_DIR`` reads it). Required with the Probe on.
        compile: ``torch.compile`` of the dense modules (:data:`loka_torchrec.compile.COMPILE_MODES`;
            ``auto`` is ``reduce-overhead`` on CUDA, eager elsewhere); ``none`` leaves them eager.
        device: the dense modules' device, for ``compile="auto"`` (default: the first parameter's);
            it must be one this machine has.
        process_group: the ranks that merge statistics and agree on the plan (default: all); also
            the ranks whose embedding all-to-all ``"auto"`` comms time.
        batch_size: rows per rank of a training batch, for the ``"auto"`` comms timing (``None``:
            a representative default, said so in ``comms_plan.json``).

    Raises:
        TypeError: ``model`` or ``config`` of the wrong type.
        ValueError: the Probe is on and ``run_dir`` is missing; an unknown ``compile`` mode; a
            device this machine does not have; a model already prepared by a Loka that is not
            closed; a model already sharded by ``DistributedModelParallel`` while the comms are
            compressed (:mod:`loka_torchrec.prepare_checks`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    config = LokaConfig(enabled=True) if config is None else config
    if not isinstance(config, LokaConfig):
        raise TypeError(f"config: expected a LokaConfig, got {type(config).__name__}")
    if not config.enabled:
        return _disabled(config)
    if config.probe.enabled and run_dir is None:
        raise ValueError("run_dir: required when the Probe is on (its per-rank logs and the plan go there)")
    check_device(device)
    check_not_prepared(model)
    check_not_sharded(model, comms_compressed=config.comms.enabled)
    if device is None:
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), "cpu")
    mode = resolve_compile_mode(compile, device)
    if mode is not None:  # Dispatch offers only kernels that trace, timed as the compiled step runs them
        config = dataclasses.replace(config, dispatch=dataclasses.replace(config.dispatch, compiled=True))
    report = apply(model, config, run_dir=run_dir, process_group=process_group)
    probe = None
    if config.probe.enabled:
        probe = ProbeCallback(
            model, config.probe, run_dir=run_dir, consumer=report.dispatcher, process_group=process_group, start_step=1
        )
    compiled = compile_dense(model, mode) if mode is not None else []
    setattr(model, PREPARED, True)
    return Loka(
        config, report, probe, compiled,
        comms_selection=CommsSelection() if config.comms.auto else None,
        run_dir=run_dir, process_group=process_group, batch_size=batch_size,
        embedding_dims=model_embedding_dims(model), cuda_graphs=uses_cuda_graphs(mode),
        dense_inputs=DenseInputs({n: model.get_submodule(n) for n in dense_modules(model)})
        if config.dispatch.grad_check and config.dispatch.mode == "policy" else None,
        model=model,
        offload_probe_activations=probe is not None and config.probe.offload_activations and torch.device(device).type == "cuda",
    )  # fmt: skip


def _disabled(config: LokaConfig) -> Loka:
    """The Loka of ``LokaConfig(enabled=False)``: no layer converted, no hook, nothing written."""
    nothing = Dispatcher({}, DispatchConfig(mode="all-bf16"))
    return Loka(config, ApplyReport([], [], None, nothing), None, [])


def _offloaded(loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``loss_fn()`` with autograd's saved activations in host memory (``probe.offload_activations``)."""
    with offload_saved_activations():
        return loss_fn()
