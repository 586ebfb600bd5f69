"""Type checks of a frozen dataclass config's fields, read from their annotations.

Each config of LoKA (``DispatchConfig``, ``ProbeConfig``, ``ModsConfig``, ``CommsConfig``) calls
:func:`check_field_types` first in its ``__post_init__``: a value of the wrong type (a string
``"1.1"`` for a number, ``1`` for a flag) is one ``TypeError`` naming the field, before any range
check compares it with something and fails deep inside.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Dict, Tuple

__all__ = ["check_field_types"]


@functools.lru_cache(maxsize=None)
def _annotations(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _conforms(value: Any, annotation: Any) -> Tuple[bool, Any]:
    """Whether ``value`` is of ``annotation``, and the value to keep (a sequence of a tuple field as a tuple)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return True, value
        for arg in args:
            if arg is not type(None):
                ok, kept = _conforms(value, arg)
                if ok:
                    return True, kept
        return False, value
    if origin is tuple:  # Tuple[X, ...]: a list or tuple of X (a single str: a 1-tuple)
        item = args[0]
        if isinstance(value, str) and item is str:
            return True, (value,)
        if not isinstance(value, (list, tuple)):
            return False, value
        return all(_conforms(v, item)[0] for v in value), tuple(value)
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if isinstance(annotation, type):
        return isinstance(value, annotation), value
    return True, value  # an annotation this check does not read


def _expected(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        return " or ".join(_expected(a) for a in args if a is not type(None)) + " or None"
    if origin is tuple:
        return f"a list of {_expected(args[0]).removeprefix('a ').removeprefix('an ')}"
    names = {bool: "true or false", int: "an int", float: "a number", str: "a str"}
    return names.get(annotation, f"a {getattr(annotation, '__name__', annotation)}")


def check_field_types(config: Any, section: str) -> None:
    """Check every field of the dataclass ``config`` against its annotation; keep sequences of
    ``Tuple[...]`` fields as tuples.

    ``bool`` fields take ``True``/``False`` only, ``int`` fields an int (not a bool), ``float``
    fields an int or a float (not a bool), ``str`` fields a str, ``Optional[X]`` ``None`` or an X,
    ``Tuple[X, ...]`` a list or tuple of X (or a single str, for a tuple of str).

    Args:
        config: the dataclass instance (frozen: tuples are set with ``object.__setattr__``).
        section: the name the message gives the config, e.g. ``"dispatch"``.

    Raises:
        TypeError: ``"{section}.{field}: expected {what}, got {value!r}"``, for the first field of
            the wrong type.

    Example::

        >>> from loka_torchrec.dispatch.config import DispatchConfig
        >>> DispatchConfig(min_speedup="1.1")
        Traceback (most recent call last):
        ...
        TypeError: dispatch.min_speedup: expected a number, got '1.1'
    """
    hints = _annotations(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        ok, kept = _conforms(value, hints[field.name])
        if not ok:
            raise TypeError(f"{section}.{field.name}: expected {_expected(hints[field.name])}, got {value!r}")
        if kept is not value:
            object.__setattr__(config, field.name, kept)
