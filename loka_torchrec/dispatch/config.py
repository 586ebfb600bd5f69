"""Dispatch configuration (data only)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from loka_torchrec.config_fields import check_field_types
from loka_torchrec.evidence import KernelChoice
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.fp8.scaling import check_scaling

__all__ = ["DispatchConfig", "DISPATCH_MODES", "EVIDENCE_SOURCES"]

DISPATCH_MODES = ("policy", "all-bf16", "all", "pinned")
EVIDENCE_SOURCES = ("auto", "random", "probe")


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """How LoKA chooses a kernel for each GEMM.

    Attributes:
        mode: ``"policy"`` (measure candidates, keep the accurate ones that are fast enough, take
            the fastest, else bf16), ``"all-bf16"``, ``"all:<backend>:<recipe>"`` (every converted
            GEMM on one kernel, to compare), or ``"pinned"`` (load ``plan_path``, for resume and
            inference).
        plan_path: the plan JSON for ``mode="pinned"``.
        candidates: ``"backend:recipe"`` names to consider, or ``("auto",)`` for every FP8
            backend and recipe available on the device (``emulated`` excluded: it is a reference).
        max_mere: accuracy gate: a candidate's MERE upper confidence bound must be below this.
        min_speedup: speed gate: its speedup lower bound over bf16 must be at least this.
        evidence: who measures candidates in ``policy`` mode: ``"random"`` (random inputs at the
            layer's real shapes, right after ``plan_at_step`` steps), ``"probe"`` (the Probe's
            learned distributions, at the end of its warm-up window), or ``"auto"`` (the Probe when
            it is on, else random).
        plan_at_step: with ``evidence="random"``, plan after this many training steps (the
            first steps run in bf16 and reveal each layer's row count).
        samples: random-evidence error samples per layer, role and candidate.
        timing_reps: timed repetitions per candidate.
        include, exclude: FQN globs of the ``nn.Linear`` layers to convert (``fnmatch``).
        min_features: convert only layers whose ``in_features`` and ``out_features`` are both at
            least this.
        grad_format: FP8 format of gradients in the dgrad and wgrad GEMMs.
        fallback: what to do when a backend named in ``mode``/``candidates`` is unavailable:
            ``"error"`` (refuse to start, naming it and why) or ``"bf16"`` (warn and use bf16).
        step_guard_window: the step-time guard (:mod:`loka_torchrec.dispatch.step_guard`) compares
            the median of this many step times in bf16 with as many after a ``policy`` plan turns
            FP8 on, and returns every GEMM to bf16 when the step got slower; 0 turns it off. It
            needs the loop to report step times (``Dispatcher.observe_step_time``; the project's
            job does).
        step_guard_tolerance: relative slowdown allowed before the guard acts (noise margin).
        layer_check_reps: after a ``policy`` plan is made, every layer with an FP8 GEMM is timed
            whole (forward + backward, host overhead included) against bf16 with this many
            repetitions, and goes back to bf16 unless it reaches ``min_speedup``
            (:mod:`loka_torchrec.dispatch.layer_check`); 0 turns the check off.
        ranked_trials: where the layers run compiled, how many plans the training step tries
            between the layer-checked and the accuracy-gated ones: the layers the layer check sent
            back to bf16, ranked by how close their FP8 variant came to bf16 alone, added back in
            ``ranked_trials + 1`` equal parts (:mod:`loka_torchrec.dispatch.plan_trials`); 0 tries
            only the two ends. Each plan tried runs one step-time guard window.
        confirm_trials: where plan trials kept a candidate, confirm it against bf16 run next to it
            (one more guard window in bf16, then one with the candidate; kept only if faster there
            too), so that the step's drift over the trials cannot choose FP8
            (:mod:`loka_torchrec.dispatch.plan_trials`).
        min_grad_sqnr_db: the floor of :meth:`Dispatcher.check_gradients`: every site's weight
            gradient, with the plan's kernels, must reach this SQNR (dB) against the same step in
            high precision; the FP8 roles that push one below it go back to bf16
            (:mod:`loka_torchrec.dispatch.grad_check`).
        max_grad_noise_ratio: how much noise FP8 may add to a weight gradient, as a share of the
            gradient's own batch sampling noise (power over power). Two uses: the accuracy gate
            of a grad-weight candidate with real-row evidence (its ``noise_ratio`` upper bound
            must be at most this; :mod:`loka_torchrec.dispatch.policy`), and the gradient check's
            noise rule (a weight gradient under the floor still passes when its error is at most
            this share of the noise of two half-batch gradients and is not systematic). 0 turns
            both off: the real rows' noise ratio gates nothing, and the check has its floor alone.
        grad_check: run that check once, right after the first ``policy`` plan with FP8 in it
            (static and pinned plans run as given), on the inputs the dense modules saw before
            the plan (:class:`loka_torchrec.Loka` does it; a model that amplifies a forward
            GEMM's error, such as HSTU's attention over its fused u|v|q|k projection, needs it).
            Costs a few forward + backward passes of the dense part at that step, and keeps one
            step's dense inputs until then.
        compiled: the layers run under ``torch.compile`` (the training job sets it from
            ``train.compile``). Candidates whose kernels do not trace (a backend's
            ``compile_recipes``) are left out with the reason, and on CUDA GEMM candidates and the
            layer check are timed as the compiled step with CUDA graphs runs them: as CUDA-graph
            replays (device time, no host launch gaps), with one-pass fused quantization; and
            grad-input and grad-weight prefer the forward's tensorwise backend where it passes
            the gates (its quantizations are shared: :func:`~loka_torchrec.dispatch.policy.share_quantizations`).
        forward_scaling: what scales the forward's FP8 tensorwise operands (the layer input and
            the weight) where the layers run compiled (``compiled``; eager layers scale by the
            current amax): ``"delayed"`` (the default: the largest amax of the layer's last 16
            calls, so the cast is fused into one pass, and values beyond that amax saturate) or
            ``"current"`` (each tensor's own amax: the compiled step reads it twice, amax then
            cast). The Probe's error evidence and the gradient check measure the scaling the
            layers use. See :class:`~loka_torchrec.dispatch.gemm_site.GemmSite`.
        grad_scaling: what scales the backward's FP8 tensorwise ``dy`` operands (grad-input's and
            grad-weight's) where the layers run compiled: ``"current"`` (the default: ``dy``'s own
            amax, so the compiled backward reads ``dy`` twice, amax then cast) or ``"delayed"``
            (the largest amax of the layer's last 16 backward calls, recorded by the backward
            itself, so that Inductor can fuse the cast into ``dy``'s producer; values beyond it
            saturate, and the calls that saturated are counted, ``GemmSite.grad_scaling_events``).
            Eager layers scale ``dy`` by its current amax either way. The Probe's error evidence
            and random evidence scale each ``dy`` draw by the draws before it, as training does.
            Opt-in until measured on a GPU.
    """

    mode: str = "policy"
    plan_path: Optional[str] = None
    candidates: Tuple[str, ...] = ("auto",)
    max_mere: float = 0.2
    min_speedup: float = 1.05
    evidence: str = "auto"
    plan_at_step: int = 2
    samples: int = 8
    timing_reps: int = 5
    include: Tuple[str, ...] = ("*",)
    exclude: Tuple[str, ...] = ()
    min_features: int = 1
    grad_format: str = "e4m3"
    fallback: str = "error"
    step_guard_window: int = 50
    step_guard_tolerance: float = 0.02
    layer_check_reps: int = 10
    ranked_trials: int = 1
    confirm_trials: bool = True
    compiled: bool = False
    min_grad_sqnr_db: float = 17.0
    max_grad_noise_ratio: float = 0.1
    grad_check: bool = True
    forward_scaling: str = "delayed"
    grad_scaling: str = "current"

    def __post_init__(self) -> None:
        check_field_types(self, "dispatch")  # types first: a range check of a str fails deep inside
        if self.mode not in DISPATCH_MODES and not self.mode.startswith("all:"):
            raise ValueError(
                f"dispatch.mode: expected one of policy, all-bf16, all:<backend>:<recipe>, pinned; got {self.mode!r}"
            )
        if self.mode.startswith("all:"):
            KernelChoice.parse(self.mode[len("all:"):], field="dispatch.mode")
        if self.mode == "pinned" and not self.plan_path:
            raise ValueError("dispatch.plan_path: required when dispatch.mode is 'pinned'")
        if self.evidence not in EVIDENCE_SOURCES:
            raise ValueError(f"dispatch.evidence: expected one of {', '.join(EVIDENCE_SOURCES)}; got {self.evidence!r}")
        for name in self.candidates:
            if name != "auto":
                KernelChoice.parse(name, field="dispatch.candidates")
        if not self.max_mere > 0:
            raise ValueError(f"dispatch.max_mere: must be > 0, got {self.max_mere}")
        if not self.min_speedup >= 0:
            raise ValueError(f"dispatch.min_speedup: must be >= 0, got {self.min_speedup}")
        if self.plan_at_step < 1:
            raise ValueError(f"dispatch.plan_at_step: must be >= 1, got {self.plan_at_step}")
        if self.samples < 2:
            raise ValueError(f"dispatch.samples: must be >= 2 (a confidence interval needs two), got {self.samples}")
        if self.timing_reps < 1:
            raise ValueError(f"dispatch.timing_reps: must be >= 1, got {self.timing_reps}")
        if self.min_features < 1:
            raise ValueError(f"dispatch.min_features: must be >= 1, got {self.min_features}")
        if self.fallback not in ("error", "bf16"):
            raise ValueError(f"dispatch.fallback: expected 'error' or 'bf16', got {self.fallback!r}")
        Fp8Format.parse(self.grad_format, field="dispatch.grad_format")
        check_scaling(self.forward_scaling, "dispatch.forward_scaling")
        check_scaling(self.grad_scaling, "dispatch.grad_scaling")
        if self.step_guard_window < 0:
            raise ValueError(f"dispatch.step_guard_window: must be an int >= 0, got {self.step_guard_window!r}")
        if self.layer_check_reps < 0:
            raise ValueError(f"dispatch.layer_check_reps: must be an int >= 0, got {self.layer_check_reps!r}")
        if self.ranked_trials < 0:
            raise ValueError(f"dispatch.ranked_trials: must be an int >= 0, got {self.ranked_trials!r}")
        if math.isnan(self.min_grad_sqnr_db):
            raise ValueError(f"dispatch.min_grad_sqnr_db: expected a number of dB, got {self.min_grad_sqnr_db!r}")
        ratio = self.max_grad_noise_ratio
        if not ratio >= 0 or math.isinf(ratio):
            raise ValueError(f"dispatch.max_grad_noise_ratio: expected a finite number >= 0, got {ratio!r}")
        if not self.step_guard_tolerance >= 0:
            raise ValueError(f"dispatch.step_guard_tolerance: must be >= 0, got {self.step_guard_tolerance}")

    @property
    def site_forward_scaling(self) -> str:
        """The scaling Dispatch gives its sites: ``forward_scaling`` where the layers run compiled
        (``compiled``), else ``"current"``: an eager call scales by the current amax either way,
        and a ``"current"`` site keeps no amax history (two reductions a call that nothing reads)."""
        return self.forward_scaling if self.compiled else "current"

    @property
    def site_grad_scaling(self) -> str:
        """The ``dy`` scaling Dispatch gives its sites: ``grad_scaling`` where the layers run compiled, else ``"current"``."""
        return self.grad_scaling if self.compiled else "current"

    @property
    def static_choice(self) -> Optional[KernelChoice]:
        """The single kernel of ``all:<backend>:<recipe>`` mode (bf16 for ``all-bf16``), else ``None``."""
        if self.mode == "all-bf16":
            return KernelChoice("bf16", "hp")
        if self.mode.startswith("all:"):
            return KernelChoice.parse(self.mode[len("all:"):])
        return None
