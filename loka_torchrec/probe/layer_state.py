"""Everything the Probe keeps about one layer between steps."""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from typing import Any, Deque, Dict, List, Optional

import torch
from torch import nn

from loka_torchrec.evidence import CandidateEvidence
from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.reservoir import RowReservoir
from loka_torchrec.probe.statistics import TensorStatistics
from loka_torchrec.probe.weight_statistics import WeightStatistics

__all__ = ["LayerState", "LayerStatus", "linear_shape"]


def linear_shape(name: str, module: nn.Module) -> "tuple[int, int]":
    """``(out_features, in_features)`` of a linear-like module (one with a 2-D ``weight``)."""
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Module) or not torch.is_tensor(weight) or weight.dim() != 2:
        raise TypeError(
            f"layers[{name!r}]: expected an nn.Module with a 2-D weight (out_features, in_features), got {type(module).__name__}"
        )
    return int(weight.shape[0]), int(weight.shape[1])


class LayerStatus(str, enum.Enum):
    """Where a layer is in the Probe's life cycle (its value is what the logs and checkpoints hold)."""

    WARMUP = "warmup"  # collecting, no plan yet
    PLANNED = "planned"  # Dispatch decided from the evidence; monitored
    FALLBACK = "fallback"  # tripped the safety valve: bf16 until re-evaluated


class LayerState:
    """Statistics, reservoir, history and safety-valve status of one layer (:class:`LayerStatus`)."""

    def __init__(self, name: str, module: nn.Module, config: ProbeConfig) -> None:
        self.name = name
        self.module = module
        self.config = config
        self.out_features, self.in_features = linear_shape(name, module)
        cov = dict(max_cov_dim=config.max_cov_dim, seed=config.seed)
        self.window_act = TensorStatistics(self.in_features, key=f"{name}|act", **cov)
        self.window_grad = TensorStatistics(self.out_features, key=f"{name}|grad", **cov)
        self.weight = WeightStatistics(
            self.out_features, self.in_features, max_cov_dim=config.max_cov_dim, ema=config.weight_ema, amax_history=config.amax_history
        )
        self.reservoir = RowReservoir(self.in_features, self.out_features, capacity=config.reservoir_rows, seed=config.seed)
        self.act_amax: Deque[float] = deque(maxlen=config.amax_history)  # merged amax of earlier probe steps
        self.grad_amax: Deque[float] = deque(maxlen=config.amax_history)
        self.reference_act: Optional[TensorStatistics] = None  # merged statistics the plan was made from
        self.reference_grad: Optional[TensorStatistics] = None
        self.recovery_act: Optional[TensorStatistics] = None  # merged statistics since a trip
        self.recovery_grad: Optional[TensorStatistics] = None
        self.rows = 0  # most rows per call over all ranks: the forward GEMM's M
        self.state = LayerStatus.WARMUP
        self.clean_windows = 0
        self.reason = ""
        self.evidence: List[CandidateEvidence] = []
        self.evidence_step: Optional[int] = None
        self.evidence_records: List[Dict[str, Any]] = []  # evidence dicts with every error measurement, for logs
        self.latest_stats: Dict[str, Any] = {}  # merged digests of the latest probe step
        self.history: List[Dict[str, Any]] = []
        self.events: List[Dict[str, Any]] = []
        self.warned = False

    @property
    def collect_moments(self) -> bool:
        """Mean, covariance, weight factors and reservoir rows are needed before a plan and while recovering."""
        return self.state is not LayerStatus.PLANNED

    def reset_reservoir(self) -> None:
        """Forget the captured rows (on the layer's device, up to ``reservoir_rows x (in + out)``
        values): once the evidence is made nothing reads them again, and after a shift they
        describe the old distribution (a trip's recovery fills a new reservoir)."""
        self.reservoir = RowReservoir(self.in_features, self.out_features, capacity=self.config.reservoir_rows, seed=self.config.seed + 1)

    def delayed_amax(self, which: str) -> Optional[float]:
        """The amax a delayed tensorwise scale would use: the largest of earlier probe steps."""
        hist = self.act_amax if which == "act" else self.grad_amax
        return max(hist) if hist else None

    def reset_windows(self) -> None:
        self.window_act = self.window_act.empty_like()
        self.window_grad = self.window_grad.empty_like()

    def shape_dict(self) -> Dict[str, int]:
        return {"in_features": self.in_features, "out_features": self.out_features, "rows": self.rows}


@dataclasses.dataclass
class StepDigest:
    """Digests of one probe step for one layer (host values, ready for logs and the valve)."""

    local_act: Dict[str, Any]
    local_grad: Dict[str, Any]
    merged_act: Dict[str, Any]
    merged_grad: Dict[str, Any]
    deviation_act: Dict[str, float]
    deviation_grad: Dict[str, float]
    weight: Dict[str, Any]
