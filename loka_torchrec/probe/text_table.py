"""Plain-text tables that fit a terminal width, and their number cells, for ``loka-inspect``.

Each column is as wide as its widest cell except one, the *elastic* column (a free-text reason),
which gets the width the others leave and is cut with an ellipsis; a row may also be a plain
string that spans the whole width (a layer name too long for its column). Nothing wraps, so a
table of ``n`` rows is ``n`` lines plus its header.
"""

from __future__ import annotations

import math
from typing import Any, List, Sequence, Union

__all__ = ["render_table", "clip", "as_float", "number"]

GAP = "  "
MIN_ELASTIC = 12

Row = Union[str, Sequence[str]]


def as_float(x: Any) -> float:
    """``float(x)`` for a JSON value (numbers and ``"nan"``/``"inf"`` strings), NaN for anything else."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def number(x: Any, spec: str = ".3g") -> str:
    """A number cell: ``x`` formatted with ``spec``, ``-`` when it is missing or not a number."""
    v = as_float(x)
    return "-" if math.isnan(v) else format(v, spec)


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, the last one an ellipsis when it was cut."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "\u2026"


def render_table(headers: Sequence[str], rows: Sequence[Row], *, width: int, elastic: int = -1, right: Sequence[int] = ()) -> List[str]:
    """The table's lines, none longer than ``width`` (unless the fixed columns alone are wider).

    Args:
        headers: one per column.
        rows: lists of cells (as many as ``headers``), or strings printed alone on their line.
        width: the terminal's width in characters.
        elastic: index of the column that takes the remaining width and is clipped.
        right: indexes of right-aligned columns (numbers).
    """
    n = len(headers)
    elastic %= n
    cells = [list(r) for r in rows if not isinstance(r, str)]
    widths = [max([len(headers[i])] + [len(r[i]) for r in cells]) for i in range(n)]
    fixed = sum(w for i, w in enumerate(widths) if i != elastic) + len(GAP) * (n - 1)
    widths[elastic] = max(min(widths[elastic], width - fixed), MIN_ELASTIC)

    def line(values: Sequence[str]) -> str:
        parts = []
        for i, value in enumerate(values):
            value = clip(value, widths[i])
            parts.append(value.rjust(widths[i]) if i in right else value.ljust(widths[i]))
        return GAP.join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    for row in rows:
        out.append(clip(row, width) if isinstance(row, str) else line(row))
    return out
