"""LoKA for TorchRec: FP8 where it is safe and fast, bf16 where it is not.

Top level (the three capabilities):

* **dispatch** -- :func:`apply` converts a model's linear layers to :class:`LokaLinear` and sets
  up the :class:`~loka_torchrec.dispatch.Dispatcher` that picks a kernel per GEMM;
* **probe** -- :class:`ProbeCallback` learns per-layer statistics during training and gives
  Dispatch its evidence (``loka_torchrec.probe``);
* **mods** -- :func:`apply_mods` makes a model FP8-friendly (``loka_torchrec.mods``); FP8
  embedding all-to-all comes from ``loka_torchrec.comms.registry``.

Configuration: :class:`LokaConfig` and the per-capability dataclasses it holds.
Not public: everything under ``loka_torchrec.training`` (the reference training job's parts).
"""

from loka_torchrec.api import ApplyReport, apply
from loka_torchrec.config import LokaConfig
from loka_torchrec.dispatch.config import DispatchConfig

__all__ = ["ApplyReport", "DispatchConfig", "LokaConfig", "LokaLinear", "apply"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LokaLinear":
        from loka_torchrec.dispatch.linear import LokaLinear

        return LokaLinear
    raise AttributeError(name)
