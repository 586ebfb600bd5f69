"""The Probe's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from loka_torchrec.config_fields import check_field_types

__all__ = ["ProbeConfig", "ERROR_BASES"]

ERROR_BASES = ("gaussian", "captured", "max")
"""Which measured error becomes :attr:`CandidateEvidence.error` (see :attr:`ProbeConfig.error_basis`)."""


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """What the Probe collects, how often, and when its safety valve fires.

    Steps are the integers passed to :meth:`ProbeCallback.on_step_end`. A step ``s`` is a
    *probe step* (hooks collect statistics during it) when ``s < warmup_steps`` and
    ``s % every == 0``, and after the warm-up window on the monitoring steps: ``warmup_steps``,
    then every ``every_after`` steps, stretched by ``monitor_budget`` when the measured cost of a
    monitoring step needs it (:mod:`loka_torchrec.probe.cadence`).
    At the end of the last warm-up step the Probe merges its statistics across ranks,
    measures error and speed of every candidate kernel, and hands the evidence to Dispatch.

    Attributes:
        enabled: master switch (on by default: the Probe's evidence is what Dispatch plans from); a
            disabled Probe registers no hook and does nothing.
        every: cadence (in steps) during the warm-up window.
        warmup_steps: length of the warm-up window; evidence is produced at its end.
        every_after: shortest interval (steps) between two monitoring steps after the warm-up
            window (safety-valve checks); 0 turns them off. Lower it to catch distribution
            shifts sooner.
        monitor_budget: the share of training time the monitoring steps may take (0.0025 =
            0.25%). After each monitoring step its extra wall time over a plain step is measured,
            and the next one waits ``ceil(extra / (monitor_budget * plain_step))`` steps, at
            least ``every_after`` and at most ``every_after_max``; all ranks take the largest
            wait. 0 keeps the fixed ``every_after`` cadence.
        every_after_max: longest interval (steps) between two monitoring steps.
        samples: K, the number of Gaussian draws per layer, role and candidate. ``None``
            resolves to 8: the per-draw MERE of an LRM-sized GEMM varies by a few percent, so 8
            draws give a t-interval within a few percent of the mean. Every draw costs a
            high-precision reference GEMM and, per candidate, a quantized one, so the planning
            step's error measurement grows with the draws.
        max_cov_dim: full covariance is kept for at most this many features of a tensor; a
            wider tensor keeps full covariance on a fixed random subset of ``max_cov_dim``
            features plus the variance of every feature (see ``docs/probe.md``). The weight
            model keeps a diagonal factor beyond this size.
        max_rows_per_step: cap on ``M`` (rows) for the speed benchmark and for each Gaussian
            draw. ``None`` resolves to no cap on CUDA and 128 on the CPU.
        error_rows: cap on the rows of each draw that measures error (Gaussian, weight model,
            captured chunks). ``None`` resolves to ``max_rows_per_step`` when that is set, else
            2048 on CUDA and 128 on the CPU. Speed is timed at the real rows; error need not be:
            FP8's relative error per output element does not depend on how many independent
            rows a draw has (the ``fwd``/``dgrad`` reduction is over features; ``wgrad``'s is over
            rows, where rounding errors add like the signal, as a random walk), so more rows only
            tighten an interval that 2048 rows already make narrow, at a float32 reference GEMM
            per draw (a 65536-row layer's draws cost 32x more than at 2048 rows).
        speed_reps: timed repetitions per candidate. ``None`` resolves to 20 on CUDA and 5 on the CPU.
        reservoir_rows: real rows (input and output-gradient pairs) kept per layer to measure
            the error on captured data next to the Gaussian model.
        amax_history: number of probe steps whose amax is remembered (the delayed-scaling
            saturation fraction in the logs, and plots).
        weight_ema: EMA decay of the weight model's row and column factors (0 = latest only).
        error_basis: which error becomes the evidence's ``error``: ``"gaussian"`` (draws from
            the learned distributions), ``"captured"`` (the reservoir of real rows) or ``"max"``
            (the larger of the two point estimates, with its interval; the default, since the
            Gaussian model misses heavy tails). Except, under ``"max"``, a grad-weight GEMM whose
            captured rows give a noise ratio (the FP8 error's power over the sampling noise of the
            rows' own weight gradient, :attr:`CandidateEvidence.noise_ratio`, which Dispatch
            gates): its ``error`` is the Gaussian one. A weight gradient sums many rows, and its
            elementwise relative error is large wherever their contributions cancel, which says
            little about training; its error power next to the batch's own noise says how much
            noise FP8 adds to SGD's.
        seed: seed of the Gaussian draws and of the covariance subset (identical on all ranks).
        amax_jump_ratio: safety valve: a probe step whose amax exceeds this multiple of the
            reference amax trips the layer.
        kurtosis_spike_ratio: safety valve: a probe step whose kurtosis exceeds this multiple of
            the reference kurtosis trips the layer.
        underflow_rise: safety valve: absolute rise of an underflow fraction (0..1) that trips.
        batch_event_share: safety valve: a ``kurtosis_spike`` of a tensor (input or gradient) that
            at least this share of the layers running bf16 by plan also show at the same probe step
            belongs to the batch, not to FP8: it is logged as a batch event and trips no layer
            (needs at least two such layers; ``None``: every spike trips). Kurtosis is a proxy;
            what a heavy tail does to FP8 (values lost below the scale) is the underflow trigger's,
            which still trips.
        readmit_windows: probe steps without a trigger that a tripped layer needs before it is
            re-evaluated for readmission.
        readmit_every: while a layer is in fallback, the next monitoring step comes at most this
            many steps later (0: the usual cadence), so that a layer tripped by a passing shift
            is readmitted after ``readmit_windows`` short waits, not after as many of the budgeted
            intervals (hundreds to thousands of steps, in bf16 meanwhile).
        readmit_error_ratio: a re-evaluated layer keeps its plan when every candidate's new
            error is at most this multiple of its plan-time error; otherwise Dispatch re-plans
            with the new evidence before the layer is readmitted.
        offload_activations: in a probe step of a compiled model on a GPU (its compiled modules
            run eagerly there) and in the gradient check's passes after a plan, keep the
            activations autograd saves for the backward in pinned host memory instead of on the
            GPU (:mod:`loka_torchrec.activation_offload`: asynchronous copies of the tensors of
            1 MiB or more). An eager step saves more than the compiled one and can set the run's
            peak GPU memory (the run summary's ``peak_memory_rises`` and its planning rises say
            which work did); offloaded, those steps copy the activations to the host and back.
            Off by default.

    Example::

        >>> ProbeConfig(enabled=True, every=5, warmup_steps=50).resolved_samples("cpu")
        8
    """

    enabled: bool = True
    every: int = 10
    warmup_steps: int = 200
    every_after: int = 500
    monitor_budget: float = 0.0025
    every_after_max: int = 10_000
    samples: Optional[int] = None
    max_cov_dim: int = 1024
    max_rows_per_step: Optional[int] = None
    error_rows: Optional[int] = None
    speed_reps: Optional[int] = None
    reservoir_rows: int = 512
    amax_history: int = 16
    weight_ema: float = 0.9
    error_basis: str = "max"
    seed: int = 0
    amax_jump_ratio: float = 8.0
    kurtosis_spike_ratio: float = 4.0
    underflow_rise: float = 0.05
    batch_event_share: Optional[float] = 0.5
    readmit_windows: int = 2
    readmit_every: int = 50
    readmit_error_ratio: float = 1.25
    offload_activations: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, "probe")  # types first: a range check of a str fails deep inside
        _positive_int("every", self.every)
        _positive_int("warmup_steps", self.warmup_steps)
        if self.every_after < 0:
            raise ValueError(f"every_after: expected an int >= 0 (0 = no checks after warm-up), got {self.every_after!r}")
        if not 0.0 <= self.monitor_budget < 1.0:
            raise ValueError(f"monitor_budget: expected a share of training time in [0, 1) (0 = fixed cadence), got {self.monitor_budget!r}")
        _positive_int("every_after_max", self.every_after_max)
        if self.every_after and self.every_after_max < self.every_after:
            raise ValueError(f"every_after_max: expected at least every_after ({self.every_after}), got {self.every_after_max}")
        for name in ("samples", "max_rows_per_step", "error_rows", "speed_reps"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value)
        if self.samples is not None and self.samples < 2:
            raise ValueError(f"samples: a confidence interval needs at least 2 draws, got {self.samples}")
        _positive_int("max_cov_dim", self.max_cov_dim)
        _positive_int("reservoir_rows", self.reservoir_rows)
        _positive_int("amax_history", self.amax_history)
        _positive_int("readmit_windows", self.readmit_windows)
        if self.readmit_every < 0:
            raise ValueError(f"readmit_every: expected an int >= 0 (0 = the usual cadence), got {self.readmit_every!r}")
        if not 0.0 <= self.weight_ema < 1.0:
            raise ValueError(f"weight_ema: expected a decay in [0, 1), got {self.weight_ema!r}")
        if self.error_basis not in ERROR_BASES:
            raise ValueError(f"error_basis: expected one of {', '.join(ERROR_BASES)}, got {self.error_basis!r}")
        for name in ("amax_jump_ratio", "kurtosis_spike_ratio", "readmit_error_ratio"):
            if not getattr(self, name) > 1.0:
                raise ValueError(f"{name}: expected a ratio > 1, got {getattr(self, name)!r}")
        if not 0.0 < self.underflow_rise <= 1.0:
            raise ValueError(f"underflow_rise: expected a fraction in (0, 1], got {self.underflow_rise!r}")
        if self.batch_event_share is not None and not 0.0 < self.batch_event_share <= 1.0:
            raise ValueError(f"batch_event_share: expected a share in (0, 1] or None, got {self.batch_event_share!r}")

    # ------------------------------------------------------------------------------ cadence
    def is_probe_step(self, step: int) -> bool:
        """Whether statistics are collected during ``step`` on the fixed cadence (``every_after``
        between monitoring steps; the Probe's :class:`~loka_torchrec.probe.cadence.MonitorCadence`
        stretches it under ``monitor_budget``)."""
        if step < 0:
            return False
        if step < self.warmup_steps:
            return step % self.every == 0
        if self.every_after == 0:
            return False
        return (step - self.warmup_steps) % self.every_after == 0

    def is_last_warmup_step(self, step: int) -> bool:
        """Whether the evidence is produced at the end of ``step``."""
        return step == self.warmup_steps - 1

    # ------------------------------------------------------------------------------ device defaults
    def resolved_samples(self, device: "torch.device | str") -> int:
        if self.samples is not None:
            return self.samples
        return 8

    def resolved_max_rows(self, device: "torch.device | str") -> Optional[int]:
        if self.max_rows_per_step is not None:
            return self.max_rows_per_step
        return None if torch.device(device).type == "cuda" else 128

    def resolved_error_rows(self, device: "torch.device | str") -> int:
        if self.error_rows is not None:
            return self.error_rows
        if self.max_rows_per_step is not None:
            return self.max_rows_per_step
        return 2048 if torch.device(device).type == "cuda" else 128

    def resolved_speed_reps(self, device: "torch.device | str") -> int:
        if self.speed_reps is not None:
            return self.speed_reps
        return 20 if torch.device(device).type == "cuda" else 5


def _positive_int(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
