"""Values as strict JSON: what every JSON file and JSON-lines log of the project holds.

Python's ``json`` writes ``Infinity`` and ``NaN`` for non-finite floats, which no strict JSON
reader accepts (``jq``, JavaScript, most databases). Every writer of the project passes its data
through :func:`to_jsonable` and dumps with ``allow_nan=False``: non-finite floats become the
strings ``"inf"``, ``"-inf"`` and ``"nan"``, which ``float()`` reads back.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["to_jsonable", "json_line"]


def to_jsonable(obj: Any) -> Any:
    """``obj`` with non-finite floats as strings, tuples as lists and tensors/numbers as Python floats.

    Example::

        >>> to_jsonable({"db": float("inf"), "shape": (2, 3), "ratio": float("nan")})
        {'db': 'inf', 'shape': [2, 3], 'ratio': 'nan'}
    """
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # 0-d tensors and numpy scalars
        return to_jsonable(obj.item())
    return obj


def json_line(obj: Any) -> str:
    """``obj`` as one line of strict JSON (no newline), for a JSON-lines log.

    Example::

        >>> json_line({"step": 3, "worst_db": float("inf")})
        '{"step": 3, "worst_db": "inf"}'
    """
    return json.dumps(to_jsonable(obj), allow_nan=False)
