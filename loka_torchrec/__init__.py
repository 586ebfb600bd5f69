"""LoKA for TorchRec: FP8 where it is safe and fast, bf16 where it is not.

Top level UX:

* :func:`prepare` -- everything LoKA does to a TorchRec job, as one :class:`Loka` object the job
  holds: the mods, the Probe, the Dispatcher, FP8 embedding comms (``loka.sharders()``) and
  ``torch.compile`` of the dense modules. Call it before ``DistributedModelParallel``.
* :func:`apply` -- only the model mods and the conversion of the linear layers to
  :class:`LokaLinear`, with the :class:`~loka_torchrec.dispatch.Dispatcher` that sets their kernels
  (``prepare`` calls it; use it alone for static plans or models outside a training loop).
* :func:`plain_modules` -- a converted model back to plain ``nn.Linear`` layers and modules,
  sharing its Parameters, for serving (the model mods stay: they change the architecture).
* :func:`inference_modules` -- the serving form: the layers whose forward GEMM ran FP8 in training
  keep it (weights quantized once, ``torch._scaled_mm``), the rest plain; ``torch.export``-able
  (:mod:`loka_torchrec.inference`).

Configuration: :class:`LokaConfig` (most jobs take a recipe: ``LokaConfig.from_recipe("default")``,
:class:`LokaRecipe`), holding each capability's frozen dataclass
(:class:`~loka_torchrec.probe.ProbeConfig`, :class:`DispatchConfig`,
:class:`~loka_torchrec.mods.ModsConfig`, :class:`~loka_torchrec.comms.CommsConfig`).

Capabilities, each a package: ``loka_torchrec.probe`` (statistics -> evidence),
``loka_torchrec.dispatch`` (evidence -> plan -> kernels), ``loka_torchrec.mods`` (model changes),
``loka_torchrec.comms`` (FP8 embedding all-to-all), ``loka_torchrec.compile`` (the dense part
under ``torch.compile``).
"""

from loka_torchrec.api import ApplyReport, apply
from loka_torchrec.config import LokaConfig, LokaRecipe
from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.inference import inference_modules
from loka_torchrec.plain import plain_modules
from loka_torchrec.prepare import Loka, prepare

__all__ = [
    "ApplyReport", "DispatchConfig", "Loka", "LokaConfig", "LokaLinear", "LokaRecipe", "apply", "inference_modules", "plain_modules",
    "prepare",
]  # fmt: skip
__version__ = "0.1.0"
