"""The benchmark row helper (benchmarks/rows.py): every row has the fields issue 21 names."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rows


def test_row_fields_and_ratio() -> None:
    r = rows.row("engine-thread CPU per room", 10.0, "us", "<= 0.25x SGLang", False,
                 baseline=40.0, detail="SGLang", failed=0)
    assert {"value", "baseline", "ratio", "goal", "met"} <= set(r)
    assert r["value"] == 10.0 and r["baseline"] == 40.0 and r["ratio"] == 0.25
    assert r["goal"] == "<= 0.25x SGLang" and r["met"] is False and r["failed"] == 0


def test_row_without_baseline_has_no_ratio() -> None:
    r = rows.row("RSS idle", 108.0, "MB", "<= 150 MB", True)
    assert r["baseline"] is None and r["ratio"] is None and r["met"] is True


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_row_refuses_a_value_that_is_no_number(value: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        rows.row("x", value, "us", "<= 1 us", True)


def test_row_refuses_extra_keys_that_shadow_fields() -> None:
    with pytest.raises(ValueError, match="shadow"):
        rows.row("x", 1.0, "us", "<= 1 us", True, ratio=3.0)
