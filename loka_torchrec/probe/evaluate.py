"""From one layer's statistics to :class:`CandidateEvidence`: error (quantify) plus speed (speed)."""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from loka_torchrec.evidence import BF16, CandidateEvidence, GemmRole, GemmShape, Interval, KernelChoice
from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.quantify import CandidateError, LayerSnapshot, draw_rows, quantify_errors
from loka_torchrec.gemm.speed import SpeedCache

__all__ = ["evaluate_layer", "device_name", "choose_error"]

_INF = Interval(math.inf, math.inf, math.inf, 0, "none")


def device_name(device: torch.device) -> str:
    """``"cpu"`` or the CUDA device's marketing name."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def choose_error(err: CandidateError, basis: str) -> Tuple[Interval, Interval, str]:
    """The MERE interval, SQNR interval and a short label for ``basis`` (see :class:`ProbeConfig`)."""
    if basis == "gaussian" or err.captured is None:
        label = "gaussian" if basis == "gaussian" else "gaussian (no captured rows)"
        return err.gaussian, err.gaussian_sqnr, label
    if basis == "max" and err.captured_noise_ratio is not None:  # the real rows are judged by their noise ratio
        return err.gaussian, err.gaussian_sqnr, "gaussian; captured rows by their noise ratio"
    if basis == "captured" or err.captured.value > err.gaussian.value:
        return err.captured, err.captured_sqnr or err.gaussian_sqnr, "captured"
    return err.gaussian, err.gaussian_sqnr, "gaussian"


def evaluate_layer(
    snap: LayerSnapshot,
    candidates: Dict[GemmRole, Sequence[KernelChoice]],
    *,
    config: ProbeConfig,
    speed_cache: SpeedCache,
    seed: int = 0,
    seconds: Optional[Dict[str, float]] = None,
    forward_scaling: str = "current",
    grad_scaling: str = "current",
) -> Tuple[List[CandidateEvidence], List[Dict[str, Any]]]:
    """Evidence for every candidate of every role of one layer, and the detail records for the log.

    Args:
        snap: the layer (statistics, weight, reservoir, rows per call).
        candidates: kernels to evaluate per role (from ``EvidenceConsumer.candidates``).
        config: samples, row cap and error basis.
        speed_cache: shared timing cache (layers of one shape are timed once); its
            ``grad_format`` is also the gradient format of the error measurement.
        seed: base seed of the Gaussian draws.
        seconds: if given, host seconds spent measuring errors and timing candidates are added to
            its ``"error"`` and ``"speed"`` entries (both end in a device synchronization).
        forward_scaling: how training scales the layer's FP8 input (the consumer's
            ``forward_scaling``); the errors are measured so (:func:`quantify_errors`).
        grad_scaling: how training scales the layer's FP8 output gradient (the consumer's ``grad_scaling``).

    Returns:
        ``(evidence, details)``: one :class:`CandidateEvidence` per (role, candidate), and per
        evidence a dict with every error measurement (Gaussian, weight model, captured).
    """
    device = snap.weight.device
    dtype = snap.weight.dtype
    max_rows = config.resolved_max_rows(device)
    t0 = time.perf_counter()
    errors = quantify_errors(
        snap,
        candidates,
        samples=config.resolved_samples(device),
        max_rows=config.resolved_error_rows(device),
        seed=seed,
        dtype=dtype,
        grad_format=speed_cache.grad_format,
        forward_scaling=forward_scaling,
        grad_scaling=grad_scaling,
    )
    t1 = time.perf_counter()
    timed_rows = draw_rows(snap.rows, max_rows)
    name = device_name(device)
    evidence: List[CandidateEvidence] = []
    details: List[Dict[str, Any]] = []
    for role, choices in candidates.items():
        role = GemmRole(role)
        real_shape = GemmShape.for_role(role, snap.rows, snap.in_features, snap.out_features)
        timed_shape = GemmShape.for_role(role, timed_rows, snap.in_features, snap.out_features)
        baseline = speed_cache.time(BF16, role, timed_shape, dtype=dtype, device=device)
        for choice in dict.fromkeys(choices):
            err = errors[(role, choice)]
            notes = [err.note] if err.note else []
            if err.available:
                mere, sqnr, label = choose_error(err, config.error_basis)
                timing = speed_cache.time(choice, role, timed_shape, dtype=dtype, device=device)
                if isinstance(timing, str):
                    notes.append(f"unavailable: {timing}")
                    timing = _INF
                notes.append(f"error: {label}")
                if err.captured_noise_ratio is not None:
                    notes.append(f"FP8 noise {err.captured_noise_ratio.value:.3g}x the sampling noise of the captured rows' gradient")
            else:
                mere, sqnr, timing = err.gaussian, err.gaussian_sqnr, _INF
            if timed_rows != snap.rows:
                notes.append(f"timed at M={timed_shape.m}" if role != GemmRole.GRAD_WEIGHT else f"timed at K={timed_shape.k}")
            ev = CandidateEvidence(
                layer=snap.name,
                role=role,
                candidate=choice,
                shape=real_shape,
                error=mere,
                time_ms=timing,
                baseline_time_ms=baseline if isinstance(baseline, Interval) else _INF,
                source="probe",
                sqnr_db=sqnr,
                device=name,
                note="; ".join(notes),
                noise_ratio=err.captured_noise_ratio if err.available else None,
            )
            evidence.append(ev)
            details.append({"role": role.value, "candidate": str(choice), "errors": err.to_dict()})
    if seconds is not None:
        seconds["error"] = seconds.get("error", 0.0) + (t1 - t0)
        seconds["speed"] = seconds.get("speed", 0.0) + (time.perf_counter() - t1)
    return evidence, details
