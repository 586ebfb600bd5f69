"""The evidence type where the Probe and Dispatch meet.

The Probe (and the simpler random-input provider in :mod:`loka_torchrec.dispatch.evidence`)
produce :class:`CandidateEvidence` records; the Dispatch policy consumes them. Nothing here
depends on either side.

A GEMM is always written ``C = A @ B^T`` with ``A`` of shape ``(M, K)`` and ``B`` of shape
``(N, K)`` (``K`` is the reduction dim). For a linear layer with ``x`` of shape
``(rows, in_features)`` and ``W`` of shape ``(out_features, in_features)``:

=========  ========================  =========  =========  ==================================
role       GEMM                      A          B          (M, K, N)
=========  ========================  =========  =========  ==================================
``fwd``    ``y  = x @ W^T``          ``x``      ``W``      (rows, in, out)
``dgrad``  ``dx = dy @ W``           ``dy``     ``W^T``    (rows, out, in)
``wgrad``  ``dW = dy^T @ x``         ``dy^T``   ``x^T``    (out, rows, in)
=========  ========================  =========  =========  ==================================
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["GemmRole", "GemmShape", "KernelChoice", "Interval", "CandidateEvidence", "BF16", "GUARD_HOLD"]


class GemmRole(str, enum.Enum):
    """The three GEMMs of a linear layer."""

    FORWARD = "fwd"
    GRAD_INPUT = "dgrad"
    GRAD_WEIGHT = "wgrad"


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """``C (M, N) = A (M, K) @ B (N, K)^T``."""

    m: int
    k: int
    n: int

    @classmethod
    def for_role(cls, role: GemmRole, rows: int, in_features: int, out_features: int) -> "GemmShape":
        role = GemmRole(role)
        if role == GemmRole.FORWARD:
            return cls(rows, in_features, out_features)
        if role == GemmRole.GRAD_INPUT:
            return cls(rows, out_features, in_features)
        return cls(out_features, rows, in_features)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    def __str__(self) -> str:
        return f"{self.m}x{self.k}x{self.n}"


@dataclasses.dataclass(frozen=True, order=True)
class KernelChoice:
    """A backend and one of its recipes, written ``"backend:recipe"`` (e.g. ``"scaled_mm:rowwise"``)."""

    backend: str
    recipe: str

    @classmethod
    def parse(cls, text: str, *, field: str = "kernel") -> "KernelChoice":
        backend, sep, recipe = str(text).partition(":")
        if not sep or not backend or not recipe:
            raise ValueError(f"{field}: expected 'backend:recipe' (e.g. 'scaled_mm:rowwise'), got {text!r}")
        return cls(backend.strip(), recipe.strip())

    @property
    def is_high_precision(self) -> bool:
        return self.backend == "bf16"

    def __str__(self) -> str:
        return f"{self.backend}:{self.recipe}"


BF16 = KernelChoice("bf16", "hp")
"""The high-precision baseline (bf16 on CUDA; the model's own dtype, e.g. fp32, on CPU)."""

GUARD_HOLD = "step-time guard:"
"""How the reason of a ``fallback`` starts where the step-time guard, not the safety valve, holds a layer
in bf16: one the valve readmitted whose return made the step slower (the valve does not readmit it
again). Dispatch writes it, the Probe's run view reads it from ``dispatch_events.jsonl``."""


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided interval.

    Attributes:
        value: point estimate (mean for errors, median for times).
        low, high: interval bounds.
        n: number of samples behind it.
        method: how the interval was made, e.g. ``"t95"`` (Student-t 95% CI of the mean),
            ``"iqr"`` (25th..75th percentile), ``"bootstrap95"``, ``"none"``.
    """

    value: float
    low: float
    high: float
    n: int
    method: str

    @classmethod
    def point(cls, value: float) -> "Interval":
        return cls(value, value, value, 1, "none")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Interval":
        return cls(float(d["value"]), float(d["low"]), float(d["high"]), int(d["n"]), str(d["method"]))


@dataclasses.dataclass(frozen=True)
class CandidateEvidence:
    """What is known about one candidate kernel for one GEMM of one layer.

    Attributes:
        layer: the layer's FQN in the (unwrapped) model.
        role: which of the layer's three GEMMs.
        candidate: backend and recipe.
        shape: the GEMM's ``(M, K, N)`` on this rank.
        error: MERE of the candidate against a high-precision reference.
        time_ms: time of the candidate for this GEMM, quantization included.
        baseline_time_ms: time of the high-precision baseline for the same GEMM.
        source: who produced it: ``"random"`` (random inputs) or ``"probe"`` (learned
            distributions); the plan records it.
        sqnr_db: optional SQNR of the same comparison.
        noise_ratio: grad-weight only, when the Probe captured real rows: the candidate's error
            power on them over the sampling noise power of the same rows' weight gradient. The
            accuracy gate judges the real rows by it (``dispatch.max_grad_noise_ratio``), and
            ``error`` is then the MERE on Gaussian draws (:attr:`ProbeConfig.error_basis`).
        device: where it was measured, e.g. ``"cpu"`` or ``"NVIDIA H100 80GB HBM3"``.
        note: anything that qualifies the numbers (e.g. "unavailable: ...").
    """

    layer: str
    role: GemmRole
    candidate: KernelChoice
    shape: GemmShape
    error: Interval
    time_ms: Interval
    baseline_time_ms: Interval
    source: str
    sqnr_db: Optional[Interval] = None
    device: str = ""
    note: str = ""
    noise_ratio: Optional[Interval] = None

    @property
    def speedup(self) -> float:
        """Point estimate of baseline time / candidate time."""
        return self.baseline_time_ms.value / self.time_ms.value if self.time_ms.value > 0 else math.inf

    @property
    def speedup_low(self) -> float:
        """Conservative speedup: the baseline's lower bound over the candidate's upper bound."""
        return self.baseline_time_ms.low / self.time_ms.high if self.time_ms.high > 0 else math.inf

    def to_dict(self) -> Dict[str, Any]:
        return {
            "layer": self.layer,
            "role": self.role.value,
            "candidate": str(self.candidate),
            "shape": [self.shape.m, self.shape.k, self.shape.n],
            "error": self.error.to_dict(),
            "time_ms": self.time_ms.to_dict(),
            "baseline_time_ms": self.baseline_time_ms.to_dict(),
            "source": self.source,
            "sqnr_db": self.sqnr_db.to_dict() if self.sqnr_db else None,
            "device": self.device,
            "note": self.note,
            "noise_ratio": self.noise_ratio.to_dict() if self.noise_ratio else None,
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "CandidateEvidence":
        m, k, n = d["shape"]
        return cls(
            layer=d["layer"],
            role=GemmRole(d["role"]),
            candidate=KernelChoice.parse(d["candidate"]),
            shape=GemmShape(int(m), int(k), int(n)),
            error=Interval.from_dict(d["error"]),
            time_ms=Interval.from_dict(d["time_ms"]),
            baseline_time_ms=Interval.from_dict(d["baseline_time_ms"]),
            source=d["source"],
            sqnr_db=Interval.from_dict(d["sqnr_db"]) if d.get("sqnr_db") else None,
            device=d.get("device", ""),
            note=d.get("note", ""),
            noise_ratio=Interval.from_dict(d["noise_ratio"]) if d.get("noise_ratio") else None,
        )


def shape_tuple(shape: GemmShape) -> Tuple[int, int, int]:
    return (shape.m, shape.k, shape.n)


class EvidenceConsumer:
    """What the Probe needs from Dispatch (implemented by ``loka_torchrec.dispatch.Dispatcher``).

    Written as a plain base class so that the Probe can depend on this module alone. The
    properties are optional: their defaults describe eager layers with E4M3 gradients.
    """

    def managed_layers(self) -> "Dict[str, Any]":
        """Canonical layer FQN -> the ``nn.Linear``/``LokaLinear`` module Dispatch manages."""
        raise NotImplementedError

    @property
    def forward_scaling(self) -> str:
        """How training scales the layers' FP8 input operands, ``"current"`` or ``"delayed"``
        (by earlier calls' amax); the Probe measures errors so. Default: ``"current"``."""
        return "current"

    @property
    def grad_scaling(self) -> str:
        """How training scales the layers' FP8 output-gradient operands, ``"current"`` or
        ``"delayed"``; the Probe measures errors so. Default: ``"current"``."""
        return "current"

    @property
    def grad_format(self) -> str:
        """FP8 format of the gradient operands; the Probe times the candidates with it. Default: ``"e4m3"``."""
        return "e4m3"

    @property
    def times_in_graphs(self) -> bool:
        """Whether the layers run as CUDA-graph replays, so that a step pays the candidates'
        device time only; the Probe times them so. Default: ``False``."""
        return False

    def candidates(self, layer: str) -> "Dict[GemmRole, list]":
        """The :class:`KernelChoice` candidates to evaluate for each role of ``layer``."""
        raise NotImplementedError

    def replan(self, evidence: "list", *, source: str, step: int) -> None:
        """Decide every layer's kernels again from ``evidence`` (a list of :class:`CandidateEvidence`)."""
        raise NotImplementedError

    def fallback(self, layer: str, reason: str, *, step: int) -> None:
        """Safety valve: run every GEMM of ``layer`` in bf16 until :meth:`readmit`."""
        raise NotImplementedError

    def readmit(self, layer: str, *, step: int) -> None:
        """Let ``layer`` use its planned FP8 kernels again."""
        raise NotImplementedError

    def guarded_layers(self) -> List[str]:
        """The layers the safety valve guards: those that run an FP8 GEMM now, and those it sent
        to bf16 that wait to run FP8 again. A layer that runs bf16 has nothing to fall back from,
        and with no guarded layer the Probe skips its monitoring steps. Default: every managed layer."""
        return sorted(self.managed_layers())
