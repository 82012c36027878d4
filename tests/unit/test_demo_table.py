"""The demo's result table is whole when stdout is a pipe or a CI log (no model needed)."""

from __future__ import annotations

import io
import sys

import pytest

from kvd.refengine import demo


def test_demo_table_is_not_cut_when_stdout_is_not_a_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    rows = [{"backend": "mooncake", "tokens": 37, "pages": 3, "chunks": 1,
             "kv_bytes": 2_211_840, "xfer_s": 0.02503, "equal": True, "problem": ""}]
    demo._print_table(demo.demo_console(), rows, 16, 4, "prefill TP1 PP1 -> decode TP1")
    text = out.getvalue()
    assert "2,211,840" in text and "transfer ms" in text and "25.03" in text
    assert "…" not in text
