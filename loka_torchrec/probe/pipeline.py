"""``ProbedTrainPipeline``: TorchRec's ``TrainPipelineSparseDist`` that calls the Probe after every step."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from loka_torchrec.probe.callback import ProbeCallback

try:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
except ImportError as exc:  # pragma: no cover - torchrec is a dependency; this names the fix if it is broken
    raise ImportError(
        "ProbedTrainPipeline needs torchrec (pip install torchrec, with fbgemm-gpu-cpu on a CPU machine): " + str(exc)
    ) from exc

__all__ = ["ProbedTrainPipeline"]


class ProbedTrainPipeline(TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` whose :meth:`progress` ends with ``probe.on_step_end(step)``.

    Each ``progress`` call runs the forward, backward and optimizer step of one batch; the dense
    layers' forward for that batch happens inside the call, so the Probe's hooks (armed by the
    previous ``on_step_end``) see exactly that step.

    Args:
        model, optimizer, device: as for ``TrainPipelineSparseDist``.
        probe: the :class:`ProbeCallback` to drive.
        start_step: number of the first step (e.g. when resuming).
        **kwargs: passed on to ``TrainPipelineSparseDist``.

    Example::

        pipeline = ProbedTrainPipeline(dmp_model, optimizer, device, probe=probe)
        while True:
            try:
                pipeline.progress(batches)
            except StopIteration:
                break
        probe.close()
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *, probe: ProbeCallback, start_step: int = 0, **kwargs: Any) -> None:
        if not isinstance(probe, ProbeCallback):
            raise TypeError(f"probe: expected a ProbeCallback, got {type(probe).__name__}")
        super().__init__(model, optimizer, device, **kwargs)
        self.probe = probe
        self.step = start_step

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        out = super().progress(dataloader_iter)  # StopIteration passes through before the probe is called
        self.probe.on_step_end(self.step)
        self.step += 1
        return out
