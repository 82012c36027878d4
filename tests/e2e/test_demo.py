"""End to end: the demo in a reduced form (real model, real daemons, real Mooncake)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvd.refengine.demo import run_demo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_reduced_demo_completions_equal_reference() -> None:
    out = io.StringIO()
    code = run_demo(n_prompts=2, max_new_tokens=4, page_size=16, chunk_pages=1,
                    console=Console(file=out, width=120))
    text = out.getvalue()
    assert code == 0, text
    assert "all completions equal" in text
    assert text.count("yes") >= 2
