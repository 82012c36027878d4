"""One benchmark row, and the table that prints them (issue 21: every row keyed by its id,
each with ``value``, ``baseline``, ``ratio``, ``goal`` and ``met``).

A row is a plain dict so it goes into the results JSON as it is:

- ``measure``: what was measured, in words;
- ``value``: kvd's number, in ``unit``;
- ``baseline``: the number it is compared with, measured in the same run (None: the row
  has a fixed goal only);
- ``ratio``: ``value / baseline`` (None without a baseline);
- ``goal``: the goal in words (``">= 1.0x"``, ``"<= 20 us"``);
- ``met``: True / False, or None where nothing is judged;
- ``unit``; ``detail``: anything else worth printing (the baseline's name, p99s, ...).
"""

from __future__ import annotations

import math
from typing import Any

FIELDS = ("measure", "value", "baseline", "ratio", "goal", "met", "unit", "detail")


def row(measure: str, value: float, unit: str, goal: str, met: bool | None,
        baseline: float | None = None, detail: str = "", **extra: Any) -> dict[str, Any]:
    """A row (the fields above; ``extra`` keys are kept beside them). Raises ValueError
    for a value or baseline that is not a finite number (a row must never claim a goal
    on NaN) and for an ``extra`` key that shadows a field."""
    for name, x in (("value", value), ("baseline", baseline)):
        if x is not None and not math.isfinite(float(x)):
            raise ValueError(f"row {measure!r}: {name} must be a finite number, got {x}")
    clash = set(extra) & set(FIELDS)
    if clash:
        raise ValueError(f"row {measure!r}: extra keys {sorted(clash)} shadow row fields")
    ratio = float(value) / float(baseline) if baseline else None
    return {"measure": measure, "value": float(value),
            "baseline": None if baseline is None else float(baseline),
            "ratio": ratio, "goal": goal, "met": met, "unit": unit, "detail": detail,
            **extra}


def _num(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f} {unit}".replace(",", " ")
    return f"{x:.3g} {unit}" if abs(x) < 1 else f"{x:.1f} {unit}"


def table(rows: dict[str, dict[str, Any]], title: str) -> Any:
    """A rich Table of ``rows`` (id -> row), in their order."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("id", "measure", "value", "baseline", "ratio", "goal", "met"):
        t.add_column(col)
    for key, r in rows.items():
        base = _num(r.get("baseline"), r.get("unit", ""))
        if r.get("detail"):
            base = f"{base} ({r['detail']})" if r.get("baseline") is not None else r["detail"]
        ratio = r.get("ratio")
        met = r.get("met")
        t.add_row(key, r.get("measure", ""), _num(r.get("value"), r.get("unit", "")), base,
                  "-" if ratio is None else f"{ratio:.3g}x", r.get("goal", "-"),
                  "-" if met is None else ("yes" if met else "NO"))
    return t
