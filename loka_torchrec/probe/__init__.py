"""Probe: learn each GEMM layer's statistics during training, measure FP8 error and speed, feed Dispatch.

Configuration:
    :class:`ProbeConfig`

Top level UX:
    :func:`probe` (same as constructing :class:`ProbeCallback`), :class:`ProbeCallback`
    (``on_step_end(step)``, ``close()``), :class:`ProbedTrainPipeline` (TorchRec pipeline that
    drives the callback; imported lazily since it imports torchrec), ``loka-inspect RUN_DIR``.

Types and building blocks:
    :class:`TensorStatistics`, :func:`all_reduce_statistics`, :class:`WeightStatistics`,
    :class:`GaussianModel`, :func:`quantify_errors`, :func:`time_gemm`.
"""

from typing import Any, Mapping, Optional

from torch import nn

from loka_torchrec.evidence import EvidenceConsumer
from loka_torchrec.probe.callback import ProbeCallback
from loka_torchrec.probe.evidence_rounds import default_candidates
from loka_torchrec.probe.hooks import canonical_fqn
from loka_torchrec.probe.config import ProbeConfig
from loka_torchrec.probe.merge import all_reduce_statistics
from loka_torchrec.probe.quantify import quantify_errors
from loka_torchrec.probe.sampling import GaussianModel
from loka_torchrec.gemm.speed import time_gemm
from loka_torchrec.probe.statistics import TensorStatistics
from loka_torchrec.probe.weight_statistics import WeightStatistics

__all__ = [
    # configuration
    "ProbeConfig",
    # top level UX
    "probe",
    "ProbeCallback",
    "ProbedTrainPipeline",
    # types and building blocks
    "TensorStatistics",
    "WeightStatistics",
    "GaussianModel",
    "all_reduce_statistics",
    "quantify_errors",
    "time_gemm",
    "canonical_fqn",
    "default_candidates",
]


def probe(
    model: nn.Module,
    config: Optional[ProbeConfig] = None,
    *,
    run_dir: str,
    consumer: Optional[EvidenceConsumer] = None,
    layers: Optional[Mapping[str, nn.Module]] = None,
    process_group: Optional[Any] = None,
) -> ProbeCallback:
    """Attach the Probe to ``model``: a :class:`ProbeCallback` (``ProbeConfig(enabled=True)`` by default)."""
    return ProbeCallback(
        model, config if config is not None else ProbeConfig(enabled=True), run_dir=run_dir, consumer=consumer, layers=layers, process_group=process_group
    )


def __getattr__(name: str) -> Any:
    if name == "ProbedTrainPipeline":  # needs TorchRec, which the library imports without: only on demand
        from loka_torchrec.probe.pipeline import ProbedTrainPipeline

        return ProbedTrainPipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
