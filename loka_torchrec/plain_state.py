"""Checkpoint state as plain containers and tensors: what ``torch.load(weights_only=True)`` reads.

Since PyTorch 2.6 ``torch.load`` unpickles only tensors, plain containers (``dict``, ``list``,
``tuple``), strings, numbers and a few torch types by default (``weights_only=True``): an object of
any other class in a checkpoint makes the whole load fail. The Probe's state holds such objects
(its statistics, reservoirs, evidence, amax histories in a ``deque``). :func:`to_plain` writes each
as a tagged dict of its fields, and :func:`from_plain` builds it back, for the classes named in
:data:`PLAIN_CLASSES` only: a checkpoint names no code to run. Anything else is refused with the
path to the value, so a class that a state gains is noticed where it is added.
"""

from __future__ import annotations

import collections
import enum
import importlib
from typing import Any, Dict

import torch

__all__ = ["to_plain", "from_plain", "PLAIN_CLASSES"]

TAG = "__loka_object__"
"""The key of a tagged dict; its value names the class."""

PLAIN_CLASSES = frozenset(
    {
        "loka_torchrec.probe.statistics.TensorStatistics",
        "loka_torchrec.probe.weight_statistics.WeightStatistics",
        "loka_torchrec.probe.reservoir.RowReservoir",
        "loka_torchrec.evidence.CandidateEvidence",
        "loka_torchrec.evidence.Interval",
        "loka_torchrec.evidence.KernelChoice",
        "loka_torchrec.evidence.GemmShape",
        "loka_torchrec.evidence.GemmRole",
    }
)
"""Classes whose objects a plain state may hold (by module and name), besides ``deque`` and
``torch.Generator``: their fields are stored, and :func:`from_plain` sets them back."""

_PLAIN_TYPES = (str, int, float, bool, type(None), torch.Tensor, torch.device, torch.dtype)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def to_plain(value: Any, *, path: str = "state") -> Any:
    """``value`` with every object of :data:`PLAIN_CLASSES`, ``deque`` and ``torch.Generator`` as a
    tagged dict (tuples and lists keep their kind).

    Raises:
        TypeError: an object of another class, named with its path in ``value``.

    Example::

        >>> import collections
        >>> plain = to_plain({"amax": collections.deque([1.0, 2.0], maxlen=4)})
        >>> plain["amax"]["items"], from_plain(plain)["amax"]
        ([1.0, 2.0], deque([1.0, 2.0], maxlen=4))
    """
    if isinstance(value, enum.Enum):
        name = _name(type(value))
        if name not in PLAIN_CLASSES:
            raise TypeError(f"{path}: {name} is not a class a plain state may hold")
        return {TAG: name, "value": value.value}
    if isinstance(value, _PLAIN_TYPES):
        return value
    if isinstance(value, dict):
        return {k: to_plain(v, path=f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [to_plain(v, path=f"{path}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, collections.deque):
        return {TAG: "collections.deque", "maxlen": value.maxlen, "items": [to_plain(v, path=f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, torch.Generator):
        return {TAG: "torch.Generator", "device": str(value.device), "rng_state": value.get_state()}
    name = _name(type(value))
    if name not in PLAIN_CLASSES:
        raise TypeError(f"{path}: an object of {name}, not a class a plain state may hold (loka_torchrec.plain_state.PLAIN_CLASSES)")
    return {TAG: name, "fields": {k: to_plain(v, path=f"{path}.{k}") for k, v in vars(value).items()}}


def from_plain(value: Any) -> Any:
    """The inverse of :func:`to_plain`; a value without tags (an older checkpoint's objects) is
    returned as it is.

    Raises:
        ValueError: a tag that names a class outside :data:`PLAIN_CLASSES`.
    """
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(from_plain(v) for v in value)
    if not isinstance(value, dict):
        return value
    if TAG not in value:
        return {k: from_plain(v) for k, v in value.items()}
    name = value[TAG]
    if name == "collections.deque":
        return collections.deque((from_plain(v) for v in value["items"]), maxlen=value["maxlen"])
    if name == "torch.Generator":
        generator = torch.Generator(device=value["device"])
        generator.set_state(value["rng_state"])
        return generator
    if name not in PLAIN_CLASSES:
        raise ValueError(f"plain state: {name!r} is not a class a plain state may hold")
    module, _, qualname = name.rpartition(".")
    cls = getattr(importlib.import_module(module), qualname)
    if issubclass(cls, enum.Enum):
        return cls(value["value"])
    fields: Dict[str, Any] = {k: from_plain(v) for k, v in value["fields"].items()}
    obj = cls.__new__(cls)
    if hasattr(obj, "__setstate__") and "__setstate__" in vars(cls):
        obj.__setstate__(fields)  # the class's own upgrade of older fields
    else:
        obj.__dict__.update(fields)  # frozen dataclasses too: their fields live in __dict__
    return obj
