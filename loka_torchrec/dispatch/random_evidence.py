"""The simple evidence provider: random inputs at each layer's real shapes, on this device.

For every managed layer, role and candidate it measures

* error: MERE against a float64 reference on ``samples`` random draws (standard normal
  activations and output gradients, the layer's *actual* weight), with a t-interval;
* time: the role's whole work (quantization of both operands included) at the layer's real
  shape, median and IQR over ``reps`` runs, next to the bf16 baseline at the same shape.

A candidate that fails at a shape (a backend's kernel that cannot take it) is recorded with NaN
numbers and the error in ``note`` (``"excluded: ..."``); the policy never picks it.

It knows nothing about the data's real distribution (outliers, correlations); the Probe's provider
does, and becomes the default when the Probe is on. Both tag their evidence with ``source``.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List

import torch

from loka_torchrec.gemm.intervals import mean_interval
from loka_torchrec.gemm.measure import error_samples, excluded_note, role_operands, run_role_gemm, time_ms
from loka_torchrec.evidence import BF16, CandidateEvidence, GemmRole, GemmShape, Interval, KernelChoice
from loka_torchrec.fp8 import Fp8Format

__all__ = ["measure_random_evidence"]

logger = logging.getLogger(__name__)

_ERROR_ROWS = 256  # rows per error sample for fwd/dgrad: per-element error does not depend on M


def measure_random_evidence(
    layers: Dict[str, torch.nn.Module],
    rows: Dict[str, int],
    candidates: Dict[str, Dict[GemmRole, List[KernelChoice]]],
    *,
    samples: int,
    reps: int,
    grad_format: Fp8Format,
    seed: int = 0,
    device_time: bool = False,
    forward_scaling: str = "current",
    grad_scaling: str = "current",
) -> List[CandidateEvidence]:
    """Evidence for every layer, role and candidate (see the module docstring).

    Args:
        layers: FQN -> linear module (its ``weight`` is used as is).
        rows: FQN -> rows per step the layer sees (the ``M`` of its forward GEMM).
        candidates: FQN -> role -> candidate kernels.
        samples: error samples per candidate.
        reps: timed repetitions per candidate.
        grad_format: FP8 format of gradients in dgrad and wgrad.
        seed: seeds the random inputs.
        device_time: time as CUDA-graph replays (``dispatch.compiled``; see
            :func:`~loka_torchrec.gemm.measure.time_ms`).
        forward_scaling: how training scales the layer input's FP8 operand (``"delayed"``: each
            error sample by the largest amax of the samples before it;
            :class:`~loka_torchrec.gemm.measure.DelayedOperandAmax`).
        grad_scaling: the same for the output gradient's FP8 operand.
    """
    generator = torch.Generator().manual_seed(seed)
    evidence: List[CandidateEvidence] = []
    for name, module in layers.items():
        weight = module.weight.detach()
        device = weight.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        m = max(int(rows.get(name, 0)), 1)
        out_features, in_features = weight.shape
        randn = lambda *shape: torch.randn(*shape, generator=generator).to(device=device, dtype=torch.float32)  # noqa: E731
        for role, choices in candidates.get(name, {}).items():
            fp8_choices = [c for c in choices if not c.is_high_precision]
            if not fp8_choices:
                continue
            shape = GemmShape.for_role(role, m, in_features, out_features)
            error_rows = m if role == GemmRole.GRAD_WEIGHT else min(m, _ERROR_ROWS)
            pairs = [
                role_operands(role, randn(error_rows, in_features), weight.float(), randn(error_rows, out_features))
                for _ in range(samples)
            ]
            full_a, full_b = role_operands(role, randn(m, in_features), weight, randn(m, out_features))
            full_a, full_b = full_a.to(weight.dtype), full_b.to(weight.dtype)
            baseline = time_ms(lambda: run_role_gemm(BF16, role, full_a, full_b, grad_format=grad_format, out_dtype=weight.dtype), reps=reps, device=device, device_time=device_time)
            for choice in fp8_choices:
                note = ""
                try:
                    error = mean_interval(error_samples(
                        choice, role, pairs, grad_format=grad_format, forward_scaling=forward_scaling, grad_scaling=grad_scaling
                    ))
                    timing = time_ms(
                        lambda: run_role_gemm(choice, role, full_a, full_b, grad_format=grad_format, out_dtype=weight.dtype),
                        reps=reps, device=device, device_time=device_time,
                    )
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot run at this shape is excluded
                    error = timing = Interval(math.nan, math.nan, math.nan, 0, "none")
                    note = excluded_note(exc)
                    logger.warning("dispatch: %s %s %s at %s excluded: %s", name, role.value, choice, shape, note)
                evidence.append(
                    CandidateEvidence(
                        layer=name,
                        role=role,
                        candidate=choice,
                        shape=shape,
                        error=error,
                        time_ms=timing,
                        baseline_time_ms=baseline,
                        source="random",
                        device=device_name,
                        note=note,
                    )
                )
    return evidence
