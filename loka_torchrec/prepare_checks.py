"""What :func:`loka_torchrec.prepare` refuses up front, each with one line that says what to do.

* a model that a :class:`~loka_torchrec.Loka` already prepared and that is not closed: the first
  Probe's hooks and Dispatcher would go on acting on it beside the second's;
* a model that ``DistributedModelParallel`` already wraps (or whose embedding modules are already
  sharded) while the comms are compressed: the comm codecs go in through the sharders that DMP takes
  when it wraps the model, so FP8 would be planned for the dense layers and the comms left as they are;
* a device this machine does not have (``device="cuda"`` on a CPU-only machine, ``cuda:3`` on two GPUs).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

__all__ = ["PREPARED", "check_not_prepared", "check_not_sharded", "check_device"]

PREPARED = "_loka_prepared"
"""The attribute that :func:`~loka_torchrec.prepare` sets on the model it prepares (removed by ``Loka.close``)."""


def check_not_prepared(model: nn.Module) -> None:
    """Raise ``ValueError`` if a Loka that is not closed prepared ``model`` or one of its submodules."""
    for name, module in model.named_modules():
        if getattr(module, PREPARED, False):
            where = f" (its submodule {name!r})" if name else ""
            raise ValueError(
                f"model: already prepared by loka_torchrec.prepare{where}, whose Probe hooks and Dispatcher still act on "
                f"it; keep using that Loka, or call its close() before preparing this model again"
            )


def check_not_sharded(model: nn.Module, *, comms_compressed: bool) -> None:
    """Raise ``ValueError`` if ``model`` is already wrapped by ``DistributedModelParallel`` (or holds
    sharded TorchRec modules) and ``comms_compressed``: LoKA's comm codecs could not be installed."""
    if not comms_compressed:
        return
    from torchrec.distributed.types import ShardedModule  # TorchRec loads only where a model is checked

    for name, module in model.named_modules():
        if type(module).__name__ == "DistributedModelParallel" or isinstance(module, ShardedModule):
            where = f"{type(module).__name__} at {name!r}" if name else f"{type(module).__name__} at the root"
            raise ValueError(
                f"model: already sharded ({where}), so LoKA's FP8 comm codecs cannot be installed; call prepare on the "
                f"unsharded model and pass loka.sharders() to DistributedModelParallel (or set comms forward and "
                f"backward to fp32, or use loka_torchrec.apply for the dense layers alone)"
            )


def check_device(device: Optional[Any], *, field: str = "device") -> None:
    """Raise ``ValueError`` if ``device`` names a device this machine does not have.

    Example::

        >>> check_device("cpu")
        >>> check_device("cuda:99")
        Traceback (most recent call last):
        ...
        ValueError: device: cuda:99 is not on this machine (it has ... CUDA device(s)); pass a device it has, e.g. device='cpu'
    """
    if device is None:
        return
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{field}: expected a torch.device or a device string such as 'cuda:0' or 'cpu', got {device!r} ({exc})") from None
    if device.type in ("cpu", "meta"):
        return
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ValueError(
                f"{field}: {device} is not on this machine (it has {count} CUDA device(s)); pass a device it has, e.g. {field}='cpu'"
            )
        return
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if callable(available) and not available():
        raise ValueError(f"{field}: {device} is not on this machine ({device.type} is unavailable); pass a device it has, e.g. {field}='cpu'")
