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
    assert "mooncake" in text and "local" in text  # one prompt through each backend


# The model has 3 KV heads and 30 layers.
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "prefill_pp"),
                         [(1, 3, 1), (3, 1, 1), (1, 1, 2)],
                         ids=["P-TP1-to-D-TP3", "P-TP3-to-D-TP1", "P-PP2-to-D-PP1"])
def test_mismatched_layouts_decode_token_exact(prefill_tp: int, decode_tp: int,
                                               prefill_pp: int) -> None:
    out = io.StringIO()
    code = run_demo(n_prompts=2, max_new_tokens=4, page_size=16, chunk_pages=2,
                    console=Console(file=out, width=140), prefill_tp=prefill_tp,
                    decode_tp=decode_tp, prefill_pp=prefill_pp, backends=("local",))
    text = out.getvalue()
    assert code == 0, text
    assert f"prefill TP{prefill_tp} PP{prefill_pp} -> decode TP{decode_tp}" in text
    assert "all completions equal" in text


def test_i22_retiled_pages_decode_token_exact() -> None:
    """Prefill page size 16, decode 64: kvd re-tiles the pages (chunks of 3 pages are not
    whole decode pages), the completion equals the colocated one."""
    out = io.StringIO()
    code = run_demo(n_prompts=2, max_new_tokens=4, page_size=16, chunk_pages=3,
                    console=Console(file=out, width=140), backends=("mooncake",),
                    decode_page_size=64, first_prompt=4)
    text = out.getvalue()
    assert code == 0, text
    assert "page_size=16 -> 64" in text and "all completions equal" in text
