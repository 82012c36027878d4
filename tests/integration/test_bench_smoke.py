"""`make bench` keeps working: its transfer, hetero-TP and same-host stages in a reduced form."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs_and_reports_ratios() -> None:
    before = set((ROOT / "benchmarks" / "results").glob("bench-*.json"))
    out = subprocess.run([sys.executable, "benchmarks/run.py", "--only", "transfer,hetero,samehost",
                          "--mib", "16", "--repeats", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "kvd/raw =" in out.stdout and "hetero/equal =" in out.stdout
    assert "local/mooncake =" in out.stdout and "local/memcpy =" in out.stdout
    new = set((ROOT / "benchmarks" / "results").glob("bench-*.json")) - before
    assert len(new) == 1
    result = json.loads(new.pop().read_text())
    assert result["transfer"]["bytes_equal"] is True
    assert result["transfer"]["ratio_kvd_over_raw"] > 0
    assert result["hetero"]["ratio_hetero_over_equal"] > 0
    assert result["samehost"]["bytes_equal"] is True
