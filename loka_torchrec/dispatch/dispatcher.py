"""The runtime that owns the plan: decides, keeps ranks identical, applies, records.

A :class:`Dispatcher` is made by :func:`loka_torchrec.apply`. It holds the converted layers
(``LokaLinear`` modules, by canonical FQN), sets each layer's kernels from the current plan, and
implements :class:`~loka_torchrec.evidence.EvidenceConsumer`, so the Probe can hand it evidence
and pull its safety valve. In ``policy`` mode with ``evidence="random"`` it measures candidates
itself after ``plan_at_step`` training steps (:meth:`on_step_end`).

All ranks run the identical plan: rank 0 decides and broadcasts, every rank applies, and the
digests of what each rank actually runs are all-gathered and compared; a mismatch raises
:class:`PlanMismatchError` naming the ranks (:mod:`~loka_torchrec.dispatch.plan_ranks`).

Its parts live beside it: the candidates a configuration offers
(:mod:`~loka_torchrec.dispatch.candidates`), which sites run and the share of the model they
reach (:mod:`~loka_torchrec.dispatch.reach`), and what a resumed run's configuration can change
(:mod:`~loka_torchrec.dispatch.resume`).

What the layers run can differ from the plan (the safety valve, the step-time guard, a kernel that
cannot run at a layer's shape): :meth:`Dispatcher.in_force` says what runs, and every count it
reports gives both. Rank 0 says each plan, safety-valve and step-time-guard event in one line at
warning level (``loka_torchrec.dispatch``), with the GEMMs planned in FP8 and in force; the details
(the plan table, the layer check) are at info level.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import torch

from loka_torchrec.atomic_files import write_text_atomic
from loka_torchrec.dispatch.candidates import require_runnable, resolve_candidates
from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.dispatch.grad_check import check_plan_gradients
from loka_torchrec.dispatch.layer_check import check_plan_layers
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.plan import GUARD_HOLD, DispatchPlan, InForce, LayerPlan, RoleDecision
from loka_torchrec.dispatch.plan_ranks import PlanMismatchError, PlanRanks
from loka_torchrec.dispatch.policy import decide, share_quantizations
from loka_torchrec.dispatch.reach import SiteReach
from loka_torchrec.dispatch.resume import overriding_field, warn_differing_fields
from loka_torchrec.dispatch.random_evidence import measure_random_evidence
from loka_torchrec.gemm.backends import get_backend
from loka_torchrec.gemm.recipes import recipe_for
from loka_torchrec.dispatch.plan_trials import ACCURACY_GATED, BF16_CHOSEN, LAYER_CHECKED, PlanTrials, candidate_plans, ranked_plans
from loka_torchrec.dispatch.step_guard import GuardVerdict, StepTimeGuard
from loka_torchrec.evidence import BF16, CandidateEvidence, EvidenceConsumer, GemmRole, GemmShape, KernelChoice
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.json_values import json_line
from loka_torchrec.peak_rises import PeakRises

__all__ = ["Dispatcher", "PlanMismatchError", "resolve_candidates"]  # the last two re-exported

logger = logging.getLogger("loka_torchrec.dispatch")

PLAN_FILE = "dispatch_plan.json"
EVENTS_FILE = "dispatch_events.jsonl"


class Dispatcher(EvidenceConsumer):
    """Owns the dispatch plan of a set of ``LokaLinear`` layers.

    Args:
        layers: canonical FQN -> ``LokaLinear``.
        config: the dispatch configuration.
        run_dir: where ``dispatch_plan.json`` and ``dispatch_events.jsonl`` go (rank 0 writes
            them); ``None`` writes nothing.
        process_group: ranks that must agree on the plan (default: the default group, if any).
        unreached: GEMM -> multiply-adds per forward row of each GEMM left in high precision
            (``ConversionReport.unreached``); the plan's coverage counts them.
    """

    def __init__(
        self,
        layers: Dict[str, torch.nn.Module],
        config: DispatchConfig,
        *,
        run_dir: Optional[str] = None,
        process_group=None,
        unreached: Optional[Dict[str, int]] = None,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.process_group = process_group
        self._ranks = PlanRanks(process_group)
        self._layers = dict(layers)
        self._reach = SiteReach(self._layers, unreached)
        self._grad_format = Fp8Format.parse(config.grad_format, field="dispatch.grad_format")
        self._fallen_back: Dict[str, str] = {}
        self._guard = StepTimeGuard(config.step_guard_window, config.step_guard_tolerance)
        self._trials: Optional[PlanTrials] = None  # candidate plans the compiled step judges (plan_trials)
        self._readmitted: Set[str] = set()  # layers the valve readmitted since the guard's last verdict
        self.seconds = {"decide": 0.0, "layer_check": 0.0}  # host seconds spent planning, on this rank
        self.peak_rises = PeakRises()  # the checks that raised the device's peak memory, on this rank
        self.step_guard_reason: Optional[str] = None  # set when the guard sent every GEMM back to bf16
        self.events: List[dict] = []
        self.plan: DispatchPlan = self._annotated(self._initial_plan())
        self._apply(self.plan)

    @property
    def times_in_graphs(self) -> bool:
        """Candidates are timed as CUDA-graph replays (``dispatch.compiled``: the compiled step with
        CUDA graphs pays device time only); the Probe reads this too."""
        return self.config.compiled

    @property
    def forward_scaling(self) -> str:
        """What scales the forward's FP8 tensorwise input in training (the Probe measures errors
        with it): ``dispatch.forward_scaling`` where the layers run compiled, else ``"current"``
        (eager calls scale by the current amax)."""
        return self.config.site_forward_scaling

    @property
    def grad_scaling(self) -> str:
        """What scales the backward's FP8 tensorwise ``dy`` in training: ``dispatch.grad_scaling``
        where the layers run compiled, else ``"current"``."""
        return self.config.site_grad_scaling

    def grad_scaling_events(self) -> Dict[str, int]:
        """Over this rank's layers, the backward calls that recorded ``dy``'s amax, and those whose
        ``dy`` saturated against its delayed amax or held inf/NaN (:meth:`GemmSite.grad_scaling_events`;
        zeros under current scaling)."""
        totals = {"calls": 0, "saturated": 0, "nonfinite": 0}
        for site in self._layers.values():
            for key, count in site.grad_scaling_events().items():
                totals[key] += count
        return totals

    @property
    def grad_format(self) -> Fp8Format:
        """FP8 format of the gradient operands (``dispatch.grad_format``); the Probe measures with it."""
        return self._grad_format

    # ------------------------------------------------------------------ EvidenceConsumer
    def managed_layers(self) -> Dict[str, torch.nn.Module]:
        return dict(self._layers)

    def candidates(self, layer: str) -> Dict[GemmRole, List[KernelChoice]]:
        module = self._layers[layer]
        device = module.weight.device
        rows = max(int(getattr(module, "last_rows", 0) or 0), 1)
        out: Dict[GemmRole, List[KernelChoice]] = {}
        for role in GemmRole:
            shape = GemmShape.for_role(role, rows, module.in_features, module.out_features)
            runnable = []
            for choice in resolve_candidates(self.config, device):
                recipe = recipe_for(choice.recipe, role, grad_format=self._grad_format)
                if get_backend(choice.backend).check_padded(recipe, shape, device) is None:
                    runnable.append(choice)
            out[role] = runnable
        return out

    def replan(self, evidence: List[CandidateEvidence], *, source: str, step: int) -> None:
        """Decide from ``evidence`` on rank 0, broadcast, apply on every rank, verify identity."""
        if self.config.mode != "policy":
            logger.info("dispatch: mode %s is static; ignoring %d evidence records from %s", self.config.mode, len(evidence), source)
            return
        plans = None
        if self._ranks.rank == 0:
            t0 = time.perf_counter()
            plan = decide(
                evidence,
                self._layer_sizes(),
                max_mere=self.config.max_mere,
                min_speedup=self.config.min_speedup,
                max_noise_ratio=self.config.max_grad_noise_ratio,
                source=f"policy/{source}",
                mode=self.config.mode,
                step=step,
                device=self._device_name(),
            )
            t1 = time.perf_counter()
            self.seconds["decide"] += t1 - t0
            gated, checks = plan, []
            if self.config.layer_check_reps > 0:
                with self.peak_rises.phase(f"dispatch: layer check at step {step}", self._layers_device()):
                    plan, checks = self._check_layers(plan, step)
            self.seconds["layer_check"] += time.perf_counter() - t1
            labelled = [(LAYER_CHECKED, plan)]
            if self._tries_plans():  # the compiled step judges the plans the layer check judged eagerly
                labelled += [*ranked_plans(plan, gated, checks, self.config.ranked_trials), (ACCURACY_GATED, gated)]
            if self.config.compiled:
                # After the layer check: it decides FP8 against bf16 per layer, timing eager layers,
                # where a tensorwise operand pays a quantization that the compiled step fuses and shares.
                share = functools.partial(
                    share_quantizations, max_mere=self.config.max_mere, min_speedup=self.config.min_speedup,
                    max_noise_ratio=self.config.max_grad_noise_ratio,
                )
                labelled = [(label, share(p)) for label, p in labelled]
            plans = candidate_plans(*labelled) or labelled[:1]  # those with FP8, no repeats
        labelled = [(label, self._annotated(p)) for label, p in self._ranks.broadcast_labelled(plans)]
        self._trials = None
        if len(labelled) > 1:  # several candidates, judged in order, the most conservative first
            self._trials = PlanTrials.of(labelled, confirm=self.config.confirm_trials)
        plan = self.plan = labelled[0][1]
        self._guard.restart()
        self._readmitted = set()
        self._apply(plan)
        self._verify_identical()
        self._record({"event": "replan", "step": step, "source": source, "digest": plan.digest(), "summary": plan.summary(self.in_force())})
        self._save_plan()
        if self._ranks.rank == 0:
            logger.info("dispatch plan at step %d (evidence: %s):\n%s", step, source, plan.table(self.in_force()))
        self._announce(f"plan made at step {step} from {source} evidence")

    def _check_layers(self, plan: DispatchPlan, step: int) -> Tuple[DispatchPlan, List[dict]]:
        """``plan`` with the FP8 layers that are not faster as a whole back in bf16 (rank 0 times
        them), and the check's records (what ranks the plans between the two, :func:`ranked_plans`)."""
        before = plan.fp8_gemm_count()
        plan, records = check_plan_layers(
            plan, self._layers, min_speedup=self.config.min_speedup, reps=self.config.layer_check_reps,
            grad_format=self._grad_format, device_time=self.times_in_graphs,
        )
        for record in records:
            self._record({"event": "layer_check", "step": step, **record})
        if records:
            logger.info(
                "dispatch: layer check at step %d kept %d of %d FP8 layers (%d -> %d FP8 GEMMs)",
                step, sum(r["kept_fp8"] for r in records), len(records), before, plan.fp8_gemm_count(),
            )
        return plan, records

    def check_gradients(self, loss_fn: Callable[[], torch.Tensor], *, step: int = 0) -> DispatchPlan:
        """Send back to bf16 the FP8 roles that put a site's weight gradient below
        ``dispatch.min_grad_sqnr_db`` against high precision (:mod:`loka_torchrec.dispatch.grad_check`).

        ``loss_fn`` runs one deterministic forward of the model on a fixed batch and returns the
        scalar loss, or the two losses of the batch's halves (for the check's noise rule,
        ``dispatch.max_grad_noise_ratio``); it must run no collectives (every rank checks on its
        own; rank 0's plan is
        broadcast). No Parameter's ``.grad`` changes. Call it after a plan is made (a ``policy``
        replan, or at start for a static or pinned plan); the checked plan is applied, saved and
        returned, and each run and demotion is a ``grad_check`` event (each with the whole check's
        wall time, ``check_seconds``, also logged).
        """
        start = time.perf_counter()
        target = self.plan_to_check
        with self.peak_rises.phase(f"dispatch: gradient check at step {step}", self._layers_device()):
            plan, records = check_plan_gradients(
                target, self._layers, loss_fn, floor_db=self.config.min_grad_sqnr_db,
                max_noise_ratio=self.config.max_grad_noise_ratio, compiled=self.config.compiled,
            )
        if self._trials is not None:  # what the broadest candidate may not run in FP8, none may
            self._trials.demote_like(target, plan)
            self._trials.candidates = [self._annotated(p) for p in self._ranks.broadcast_plans(self._trials.candidates)]
            plan = self._trials.current()
        plan = self._annotated(self._ranks.broadcast(plan))
        seconds = time.perf_counter() - start
        for record in records:
            self._record({"event": "grad_check", "step": step, **record, "check_seconds": seconds})
        demoted = sum(r["kind"] == "demote" for r in records)
        if self._ranks.rank == 0:
            logger.info("dispatch: gradient check at step %d took %.1f s (%d plan run(s), %d demotion(s))",
                        step, seconds, len(records) - demoted, demoted)  # fmt: skip
            self._say_noise_rule(records, step)
        self.plan = plan
        self._apply(plan)
        self._verify_identical()
        self._save_plan()
        if demoted:
            self._announce(f"gradient check at step {step} sent {demoted} FP8 GEMM(s) back to bf16 "
                           f"(worst weight gradient {records[-1]['worst_db_after']:.1f} dB)")  # fmt: skip
        return plan

    def _say_noise_rule(self, records: List[dict], step: int) -> None:
        """One warning line for the weight gradients under the floor that the noise rule accepted in
        the check of the plan (the events file has the numbers): a pass the user would otherwise miss."""
        checked = next((r for r in records if r["kind"] == "plan"), None)
        if checked is None:
            return
        kept = {n: v for n, v in checked["under_floor"].items() if n not in checked["failing"] and "noise_ratio" in v}
        if not kept:
            return
        shown = ", ".join(
            f"{name} at {v['db']:.1f} dB (FP8 error {v['noise_ratio']:.3g} of the batch noise, shared part {v['systematic_db']:.1f} dB)"
            for name, v in sorted(kept.items())
        )
        logger.warning(
            "dispatch: gradient check at step %d: %d weight gradient(s) below the %g dB floor kept in FP8 by the noise "
            "rule (dispatch.max_grad_noise_ratio=%g): %s", step, len(kept), self.config.min_grad_sqnr_db,
            self.config.max_grad_noise_ratio, shown,
        )  # fmt: skip

    def fallback(self, layer: str, reason: str, *, step: int) -> None:
        if layer not in self._layers:
            raise ValueError(f"dispatch.fallback: unknown layer {layer!r}")
        self._fallen_back[layer] = reason
        self._layers[layer].set_kernels(LayerKernels())
        self._fp8_running = self._runs_fp8()
        self._readmitted.discard(layer)
        if self._guard.collecting:  # the window under way timed another set of FP8 layers: time it anew
            self._guard.restart()
        self._record({"event": "fallback", "step": step, "layer": layer, "reason": reason})
        self._save_plan()
        self._announce(f"safety valve sent layer {layer} back to bf16 at step {step}: {reason}")

    def readmit(self, layer: str, *, step: int) -> None:
        """The safety valve returns ``layer`` to its planned kernels. Where the step-time guard has
        judged the plan already, the step is timed again with the layer back (a window against the
        same baseline), and the layer goes back to bf16 for good if that step is slower: the valve
        watches accuracy, and a set of FP8 layers the guard never timed must not slow the run down.
        A layer the guard holds this way is not the valve's to readmit."""
        if self._fallen_back.get(layer, "").startswith(GUARD_HOLD):
            return
        if self._fallen_back.pop(layer, None) is None:
            return
        if layer in self.plan.layers and self.step_guard_reason is None and not self._confirming_bf16:
            # (during a confirmation's bf16 window the layer gets its kernels with the others after it)
            self._layers[layer].set_kernels(self.plan.layers[layer].kernels)
            self._fp8_running = self._runs_fp8()
            if not self._layers[layer].kernels.all_high_precision and (self._guard.collecting or self._guard.decided):
                if self._guard.decided and (self._trials is None or self._trials.done):
                    self._readmitted.add(layer)  # judged again: a window with the layer back
                self._guard.restart()  # (a window under way starts over)
        self._record({"event": "readmit", "step": step, "layer": layer})
        self._save_plan()
        self._announce(f"safety valve readmitted layer {layer} to its planned kernels at step {step}")

    def guarded_layers(self) -> List[str]:
        """The layers whose GEMMs run FP8 now, and those sent back to bf16 whose plan has FP8 to
        return to (none once the step-time guard turned FP8 off or holds them): what the safety valve watches."""
        waiting = set()
        if self.step_guard_reason is None:
            waiting = {n for n, reason in self._fallen_back.items() if n in self.plan.layers
                       and not self.plan.layers[n].kernels.all_high_precision and not reason.startswith(GUARD_HOLD)}  # fmt: skip
        return sorted(n for n, m in self._layers.items() if not m.kernels.all_high_precision or n in waiting)

    # ------------------------------------------------------------------ step-time guard
    def observe_step_time(self, step: int, step_ms: float) -> Optional[GuardVerdict]:
        """Report one training step's wall time (ms, as the training loop times it) to the guard.

        Call it after every step on every rank (the project's job does). When a trial window after
        an FP8 plan completes, the ranks agree on the medians (the slowest rank counts), the verdict
        is recorded in ``dispatch_events.jsonl``, and when the step got slower every GEMM returns
        to bf16 for the rest of the run (:attr:`step_guard_reason` says why). Returns the verdict
        at that step, else ``None``.
        """
        fp8_active = self.step_guard_reason is None and self._fp8_running
        if self._confirming_bf16:  # the fresh bf16 window of a confirmation (plan_trials)
            self._guard.observe(step, step_ms, fp8_active=False)
            if self._trials.bf16_step(self._guard.settle + self._guard.window):
                self._apply(self.plan)  # the candidate again, timed against the bf16 steps just run
                self._guard.restart()
                self._verify_identical()
                self._save_plan()
                self._announce(f"{self._trials.describe()} at step {step}")
            return None
        verdict = self._guard.observe(step, step_ms, fp8_active=fp8_active)
        if verdict is None:
            return None
        verdict = self._agree(verdict)
        self._record({"event": "step_guard", "step": step, "bf16_ms": verdict.bf16_ms, "fp8_ms": verdict.fp8_ms,
                      "keep_fp8": verdict.keep_fp8, **({"readmitted": sorted(self._readmitted)} if self._readmitted else {})})  # fmt: skip
        if self._trials is not None and not self._trials.done:
            self._next_trial(step, verdict)
            return verdict
        if self._readmitted:
            self._judge_readmitted(step, verdict)
            return verdict
        if verdict.keep_fp8:
            self._announce(f"{verdict.describe()} at step {step}")
            return verdict
        self.step_guard_reason = verdict.describe()
        self._apply(self.plan)
        self._save_plan()
        self._announce(f"{self.step_guard_reason} at step {step}")
        return verdict

    def _judge_readmitted(self, step: int, verdict: GuardVerdict) -> None:
        """The window after the safety valve readmitted layers: they stay if the step is not slower
        than the baseline, else they go back to bf16 for the rest of the run (the rest of the plan,
        judged before, stays)."""
        layers, self._readmitted = sorted(self._readmitted), set()
        if verdict.keep_fp8:
            self._announce(f"{verdict.describe()} at step {step} with {len(layers)} readmitted layer(s)")
            return
        reason = f"{GUARD_HOLD} readmitting made the step slower ({verdict.fp8_ms:.2f} ms against {verdict.bf16_ms:.2f} ms in bf16)"
        for layer in layers:
            self._fallen_back[layer] = reason
            self._layers[layer].set_kernels(LayerKernels())
            self._record({"event": "fallback", "step": step, "layer": layer, "reason": reason})
        self._fp8_running = self._runs_fp8()
        self._save_plan()
        self._announce(f"{reason} at step {step}: {len(layers)} layer(s) back to bf16")

    @property
    def judging_step_times(self) -> bool:
        """Whether a decision still waits on step times: plan trials under way, or the step-time guard
        collecting its trial of the FP8 plan in force. Other step-time checks (the comms') wait for it."""
        if self._trials is not None and not self._trials.done:
            return True
        return self.step_guard_reason is None and self._fp8_running and self._guard.collecting

    def _tries_plans(self) -> bool:
        """Whether a policy plan is judged by plan trials (:mod:`~loka_torchrec.dispatch.plan_trials`):
        where the layers run compiled and the step-time guard is on."""
        return self.config.compiled and self._guard.enabled

    @property
    def plan_to_check(self) -> DispatchPlan:
        """The plan the gradient check must see: the broadest candidate while plan trials go on,
        else the plan."""
        return self._trials.broadest() if self._trials is not None and not self._trials.done else self.plan

    @property
    def trials(self) -> Optional[PlanTrials]:
        """The plan trials of the last policy plan (``None``: one candidate, judged by the guard alone)."""
        return self._trials

    def _next_trial(self, step: int, verdict: GuardVerdict) -> None:
        """A candidate's window is complete: try the next one, or keep the fastest (or bf16)."""
        trials = self._trials
        if trials.confirming == "fp8":
            trials.record_confirmation(verdict.bf16_ms, verdict.fp8_ms, tolerance=self._guard.tolerance)
            self._record({"event": "plan_confirmation", "step": step, "candidate": trials.labels[trials.pending],
                          "bf16_ms": verdict.bf16_ms, "fp8_ms": verdict.fp8_ms, "kept": trials.chosen != BF16_CHOSEN})  # fmt: skip
        else:
            label = trials.labels[trials.index]
            trials.record(verdict.bf16_ms, verdict.fp8_ms, tolerance=self._guard.tolerance)
            self._record({"event": "plan_trial", "step": step, "candidate": label, "bf16_ms": verdict.bf16_ms,
                          "fp8_ms": verdict.fp8_ms, "fp8_gemms": self.plan.fp8_gemm_count()})  # fmt: skip
        if trials.chosen == BF16_CHOSEN:
            self.step_guard_reason = trials.describe()
        self.plan = trials.current()
        if not trials.done:
            self._guard.restart()  # the next window (a candidate's, or the confirmation's bf16 one)
        self._apply(self.plan)
        self._verify_identical()
        self._save_plan()
        if trials.done:
            self._record({"event": "plan_selected", "step": step, "chosen": None if trials.chosen == BF16_CHOSEN
                          else trials.labels[trials.chosen], "summary": trials.describe()})  # fmt: skip
        now = "" if trials.done or trials.pending is not None else f"; now trying the {trials.labels[trials.index]} plan"
        self._announce(f"{trials.describe()} at step {step}{now}")

    @property
    def _confirming_bf16(self) -> bool:
        """Whether every GEMM runs bf16 for a confirmation's fresh bf16 window (plan_trials)."""
        return self._trials is not None and self._trials.confirming == "bf16"

    def _runs_fp8(self) -> bool:
        return any(not m.kernels.all_high_precision for m in self._layers.values())

    def _agree(self, verdict: GuardVerdict) -> GuardVerdict:
        """The verdict every rank takes: medians all-reduced with max (the slowest rank counts)."""
        device = self._layers_device() or torch.device("cpu")
        return self._ranks.agree(verdict, device, self._guard.tolerance)

    # ------------------------------------------------------------------ training-loop hook
    def on_step_end(self, step: int) -> None:
        """Call after each training step (``step`` counts from 1): plans from random evidence when due.

        At the first step in which any site ran (eagerly or compiled), the sites that did not run
        are recorded as never ran (plan, ``dispatch_plan.json``, events).
        """
        self._check_ran(step)
        if self.config.mode == "policy" and self.config.evidence in ("random", "auto") and step == self.config.plan_at_step:
            evidence = self.measure_random(seed=step)
            self.replan(evidence, source="random", step=step)

    def measure_random(self, *, seed: int = 0) -> List[CandidateEvidence]:
        """Random-input evidence for every layer at the row counts seen so far (rank 0 only does the work)."""
        if self._ranks.rank != 0:
            return []
        rows = {name: int(getattr(m, "last_rows", 0) or 0) for name, m in self._layers.items()}
        candidates = {name: self.candidates(name) for name in self._layers}
        return measure_random_evidence(
            self._layers,
            rows,
            candidates,
            samples=self.config.samples,
            reps=self.config.timing_reps,
            grad_format=self._grad_format,
            seed=seed,
            device_time=self.times_in_graphs,
            forward_scaling=self.forward_scaling,
            grad_scaling=self.grad_scaling,
        )

    @property
    def fallen_back(self) -> Dict[str, str]:
        """Layers currently held in bf16 by the safety valve, with the reason."""
        return dict(self._fallen_back)

    # ------------------------------------------------------------------ what runs
    def in_force(self) -> InForce:
        """What the layers run now, next to :attr:`plan`: the plan after the safety valve
        (:attr:`fallen_back`), the step-time guard (:attr:`step_guard_reason`) and the planned
        kernels that cannot run at a layer's shape on its device (``fallback_reasons``). The sites
        that never ran are left out, as the plan's counts leave them out."""
        kernels: Dict[str, LayerKernels] = {}
        held: Dict[str, Tuple[str, str]] = {}
        for name, module in self._layers.items():
            if name in self._reach.never_ran:
                continue
            running = module.kernels
            for role in module.fallback_reasons:
                running = running.replace(role, BF16)
            kernels[name] = running
            planned = self.plan.layers[name].kernels if name in self.plan.layers else LayerKernels()
            if running == planned:
                continue
            if self.step_guard_reason is not None:
                held[name] = ("step-time guard", self.step_guard_reason)
            elif self._fallen_back.get(name, "").startswith(GUARD_HOLD):
                held[name] = ("step-time guard", self._fallen_back[name])
            elif name in self._fallen_back:
                held[name] = ("safety valve", self._fallen_back[name])
            else:
                held[name] = ("kernel cannot run here", "; ".join(module.fallback_reasons.values()))
        return InForce(kernels, held)

    def summary(self) -> str:
        """One line: the GEMMs planned in FP8 and in force, and what holds the others in bf16."""
        return self.plan.summary(self.in_force())

    def _announce(self, what: str) -> None:
        """Rank 0: one line at warning level for a plan, safety-valve or step-time-guard event, with
        the GEMMs planned in FP8 and in force (a job that logs at WARNING sees it)."""
        if self._ranks.rank != 0:
            return
        now = self.in_force()
        total = sum(self.plan.counts().values())
        held = now.held_summary()
        logger.warning(
            "loka dispatch: %s; FP8 GEMMs: %d/%d planned, %d/%d in force%s", what, self.plan.fp8_gemm_count(), total,
            now.fp8_gemm_count(), total, f" ({held})" if held else "",
        )  # fmt: skip

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything this dispatcher decided: the plan, the layers the safety valve holds in bf16,
        the step-time guard's verdict and its collected times, the events so far, and the
        configuration they were made under. Plain containers only (``torch.load(weights_only=True)``)."""
        return {
            "plan": self.plan.to_dict(),
            "fallen_back": dict(self._fallen_back),
            "step_guard_reason": self.step_guard_reason,
            "guard": self._guard.state_dict(),
            "readmitted": sorted(self._readmitted),
            "trials": None if self._trials is None else self._trials.to_dict(),
            "events": list(self.events),
            "config": dataclasses.asdict(self.config),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (a resumed run; call on every rank, after :meth:`start`).

        The plan, valve holds and guard verdict apply at once; ``dispatch_plan.json`` and
        ``dispatch_events.jsonl`` are rewritten to what the checkpoint holds, so a resumed run's
        files say what it runs. States of older checkpoints (plan and valve only) load too.

        What this run's configuration changes:

        * a static or pinned ``dispatch.mode`` decides the plan: where it gives another plan than
          the checkpoint's (another mode, another ``plan_path``), this run's plan runs and the
          checkpoint's plan, valve holds and guard verdict are not restored (a warning names the field);
        * under ``policy``, the checkpoint's plan runs on (a resumed run does not plan again from
          scratch); a warning names the fields that shape a plan and differ from the checkpoint's
          (``max_mere``, ``min_speedup``, ``candidates``, ...): they apply from the next plan (a
          readmission that re-plans). A checkpoint of a static or pinned mode resumed under
          ``policy`` keeps its plan, said in a warning.

        Raises:
            ValueError: ``state`` is not a :meth:`state_dict`, or is of another model (its plan's
                layers or their shapes differ from this dispatcher's: one line names them).
        """
        if not isinstance(state, Mapping) or "plan" not in state:
            raise ValueError("dispatch state: expected the mapping Dispatcher.state_dict() returned (with key 'plan')")
        saved = DispatchPlan.from_dict(state["plan"])
        problem = saved.shape_mismatch(self._layer_shapes())
        if problem:
            raise ValueError(f"dispatch state: the checkpoint is of another model ({problem}); resume from a checkpoint of this model")
        saved_config = state.get("config") or {}
        self._reach.restore(saved)
        self.events = list(state.get("events", []))
        override = overriding_field(self.config, self.plan, saved, saved_config)
        if override is None:
            self.plan = saved
            self._fallen_back = dict(state.get("fallen_back", {}))
            self.step_guard_reason = state.get("step_guard_reason")
            if "guard" in state:
                self._guard.load_state_dict(state["guard"])
            self._readmitted = set(state.get("readmitted", []))
            self._trials = None if state.get("trials") is None else PlanTrials.from_dict(state["trials"])
            if self._ranks.rank == 0:
                warn_differing_fields(self.config, saved, saved_config)
        else:
            self.plan = self._annotated(self.plan)
            self._fallen_back, self.step_guard_reason = {}, None
            if self._ranks.rank == 0:
                logger.warning(
                    "dispatch.%s: the checkpoint ran %s (%d FP8 GEMM(s) planned), this run has %s: this run's plan "
                    "runs; the checkpoint's plan, safety-valve holds and step-time guard verdict are not restored",
                    override, saved_config.get(override, saved.mode), saved.fp8_gemm_count(), getattr(self.config, override),
                )  # fmt: skip
            self._record({"event": "resume_override", "field": override, "checkpoint_digest": saved.digest(), "digest": self.plan.digest()})
        self._apply(self.plan)
        self._verify_identical()
        if self.run_dir and self._ranks.rank == 0:
            write_text_atomic(os.path.join(self.run_dir, EVENTS_FILE), "".join(json_line(e) + "\n" for e in self.events))
        self._save_plan()
        self._announce(f"plan restored from the checkpoint (made at step {self.plan.step}, mode {self.plan.mode})")

    # ------------------------------------------------------------------ reach
    @property
    def never_ran(self) -> Dict[str, str]:
        """Managed sites that did not run in the first eager training step(s), with why."""
        return dict(self._reach.never_ran)

    def _check_ran(self, step: int) -> None:
        """After a step: the sites that did not run by the first one in which any did are never-ran (once)."""
        if not self._reach.check_ran():
            return
        never_ran = self._reach.never_ran
        self.plan = self._annotated(self.plan)
        if never_ran:
            self._record({"event": "never_ran", "step": step, "layers": dict(never_ran)})
            if self._ranks.rank == 0:
                for name, reason in sorted(never_ran.items()):
                    logger.warning("dispatch: converted site %s never ran by step %d: %s", name, step, reason)
        self._save_plan()

    def _annotated(self, plan: DispatchPlan) -> DispatchPlan:
        """``plan`` with this run's never-ran sites and coverage."""
        return self._reach.annotated(plan)

    # ------------------------------------------------------------------ internals
    def _initial_plan(self) -> DispatchPlan:
        cfg = self.config
        sizes = self._layer_sizes()
        device = self._layers_device() or torch.device("cpu")
        if cfg.mode == "pinned":
            plan = DispatchPlan.load(cfg.plan_path)
            problem = plan.shape_mismatch(self._layer_shapes())
            if problem:
                raise ValueError(f"dispatch.plan_path: plan {cfg.plan_path!r} does not match the model: {problem}")
            for name, layer_plan in plan.layers.items():
                for role, decision in layer_plan.roles.items():
                    if not decision.choice.is_high_precision:
                        require_runnable(decision.choice, cfg, device, field=f"dispatch.plan_path ({name} {role.value})")
            return plan
        static = cfg.static_choice
        if static is not None and not static.is_high_precision:
            if not require_runnable(static, cfg, device, field="dispatch.mode"):
                static = BF16
        choice, reason = (static, f"static mode {cfg.mode}") if static is not None else (BF16, "not planned yet: bf16 until evidence arrives")
        layers = {}
        for name, (rows, fan_in, fan_out) in sizes.items():
            roles = {}
            for role in GemmRole:
                chosen = choice
                why = reason
                if not choice.is_high_precision:
                    module = self._layers[name]
                    shape = GemmShape.for_role(role, 1, fan_in, fan_out)
                    recipe = recipe_for(choice.recipe, role, grad_format=self._grad_format)
                    problem = get_backend(choice.backend).check_padded(recipe, shape, module.weight.device)
                    if problem:
                        chosen, why = BF16, f"{choice} cannot run here: {problem}"
                roles[role] = RoleDecision(chosen, why, "static")
            layers[name] = LayerPlan(name, fan_in, fan_out, rows, roles)
        return DispatchPlan(layers, cfg.mode, 0, self._device_name())

    def _apply(self, plan: DispatchPlan) -> None:
        for name, module in self._layers.items():
            kernels = plan.layers[name].kernels if name in plan.layers else LayerKernels()
            if name in self._fallen_back or self.step_guard_reason is not None or self._confirming_bf16:
                kernels = LayerKernels()
            module.set_kernels(kernels)
        self._fp8_running = self._runs_fp8()

    def _layer_shapes(self) -> Dict[str, Tuple[int, int]]:
        return {name: (m.in_features, m.out_features) for name, m in self._layers.items()}

    def _layer_sizes(self) -> Dict[str, tuple]:
        return {
            name: (int(getattr(m, "last_rows", 0) or 0), m.in_features, m.out_features) for name, m in self._layers.items()
        }

    def _layers_device(self) -> Optional[torch.device]:
        """The device of the managed layers' weights (``None``: no layers)."""
        return next((site.weight.device for site in self._layers.values()), None)

    def _device_name(self) -> str:
        device = self._layers_device() or torch.device("cpu")
        return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    def running_digest(self) -> str:
        """Digest of the kernels this rank's layers actually run now."""
        running = DispatchPlan(
            {
                name: LayerPlan(name, m.in_features, m.out_features, 0, {
                    role: RoleDecision(m.kernels.for_role(role), "", "") for role in GemmRole
                })
                for name, m in self._layers.items()
            },
            mode="running",
        )
        return running.digest()

    def _verify_identical(self) -> None:
        self._ranks.verify_identical(self.running_digest())

    def _record(self, event: dict) -> None:
        self.events.append(event)
        if self.run_dir and self._ranks.rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, EVENTS_FILE), "a") as f:
                f.write(json_line(event) + "\n")  # strict JSON: an infinite SQNR is written "inf"
                f.flush()

    def _save_plan(self) -> None:
        """Rank 0 writes the plan with what runs now (its ``in_force`` section)."""
        if self.run_dir and self._ranks.rank == 0:
            self.plan.save(os.path.join(self.run_dir, PLAN_FILE), self.in_force())

    def start(self) -> None:
        """Verify identity across ranks and write the initial plan (call once, after process groups exist).

        Also checks the candidate backends here, before training: the check imports each library
        (FBGEMM's gen_ai ops, Transformer Engine), which takes seconds on a first import and would
        otherwise land in the planning step.
        """
        if self.config.mode == "policy":
            for device in sorted({str(m.weight.device) for m in self._layers.values()}):
                resolve_candidates(self.config, torch.device(device))
        self._verify_identical()
        self._save_plan()
        if self.config.mode == "policy":
            self._announce(f"policy mode: bf16 until the plan from {self.config.evidence} evidence")
        else:
            self._announce(f"{self.config.mode} plan in place" + (f" from {self.config.plan_path}" if self.config.mode == "pinned" else ""))

