"""vLLM through kvd: what waiting costs (K36) and PD throughput against one engine.

    make bench-vllm            # or: .venv-vllm/bin/python benchmarks/vllm_pd.py [--quick]

1. **Idle cost of waiting rooms.** A prefill engine (vLLM + kvd connector) and its kvd;
   ``--rooms`` prefill-only requests whose decode never comes, so their rooms wait in kvd
   (Bootstrapping) and vLLM keeps their blocks. CPU seconds of the engine's processes
   (API server, engine core, workers) per wall second, over ``--window`` s, with the rooms
   waiting and with none: "near zero" is the goal.
2. **Throughput at equal total cores.** One plain engine on cores 0-1 against a PD pair
   (prefill on core 0, decode on core 1, each with its kvd, behind ``kvd proxy``):
   ``--requests`` chat requests at concurrency ``--concurrency``, ``--max-tokens`` each;
   req/s and TTFT p50 (first streamed token). Goal: PD >= 0.8x one engine.

Numbers are printed and written to ``benchmarks/results/vllm_pd.json``. The machine is
shared: run it on a quiet machine, and compare runs made back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvd.adapters.hfmodel import ensure_hf_model  # noqa: E402
from kvd.adapters.vllm import launch  # noqa: E402
from kvd.launch import start_daemon  # noqa: E402
from tests.adapters.vllm_env import free_port, tree_cpu_s  # noqa: E402


def cores_used(pid: int, seconds: float) -> float:
    start = tree_cpu_s(pid)
    time.sleep(seconds)
    return (tree_cpu_s(pid) - start) / seconds


def idle_cost(model: Path, work: Path, rooms: int, window: float) -> dict[str, Any]:
    kvd_p = start_daemon("prefill", work, serve_bootstrap=True, bootstrap_timeout=600.0)
    engine = launch.start_engine(launch.engine_command(
        sys.executable, model, free_port(),
        launch.kv_transfer_config("kv_producer", kvd_p.socket, kvd_p.http_addr)),
        work / "idle-prefill.log", launch.engine_env())
    try:
        launch.wait_healthy(engine, 900)
        time.sleep(3)
        idle = cores_used(engine.proc.pid, window)
        for i in range(rooms):
            body = {"model": "smol", "messages": [{"role": "user", "content": f"Hi {i}"}],
                    "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                            "bootstrap_room": 1000 + i}}
            httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120)
        time.sleep(3)
        health = httpx.get(f"http://{kvd_p.http_addr}/health", timeout=5).json()
        waiting = cores_used(engine.proc.pid, window)
    finally:
        engine.stop()
        kvd_p.stop()
    return {"rooms_waiting": health["rooms"], "engine_cores_idle": round(idle, 4),
            "engine_cores_with_rooms_waiting": round(waiting, 4), "window_s": window}


async def _one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int
               ) -> tuple[float, float]:
    body = {"model": "smol", "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "messages": [{"role": "user", "content": f"Write a short story about robot "
                                                     f"number {i} and its garden."}]}
    started = time.perf_counter()
    ttft = 0.0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and not ttft:
                ttft = time.perf_counter() - started
    return ttft, time.perf_counter() - started


async def _load(url: str, requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900) as client:
        async def run(i: int) -> tuple[float, float]:
            async with sem:
                return await _one(client, url, i, max_tokens)

        await run(-1)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(requests)))
        wall = time.perf_counter() - started
    return {"req_per_s": round(requests / wall, 3),
            "ttft_p50_s": round(statistics.median(r[0] for r in results), 3),
            "latency_p50_s": round(statistics.median(r[1] for r in results), 3)}


def throughput(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    load = (args.requests, args.concurrency, args.max_tokens)
    single = launch.start_engine(launch.engine_command(sys.executable, model, free_port()),
                                 work / "single.log", launch.engine_env("0-1"))
    try:
        launch.wait_healthy(single, 900)
        one = asyncio.run(_load(single.url, *load))
    finally:
        single.stop()
    kvd_p = start_daemon("prefill", work, serve_bootstrap=True)
    kvd_d = start_daemon("decode", work)
    p = launch.start_engine(launch.engine_command(
        sys.executable, model, free_port(),
        launch.kv_transfer_config("kv_producer", kvd_p.socket, kvd_p.http_addr)),
        work / "pd-prefill.log", launch.engine_env("0"))
    d = launch.start_engine(launch.engine_command(
        sys.executable, model, free_port(), launch.kv_transfer_config("kv_consumer",
                                                                      kvd_d.socket)),
        work / "pd-decode.log", launch.engine_env("1"))
    port = free_port()
    proxy = None
    try:
        launch.wait_healthy(p, 900)
        launch.wait_healthy(d, 900)
        proxy = subprocess.Popen([sys.executable, "-m", "kvd.cli.main", "proxy", "--prefill",
                                  p.url, "--decode", d.url, "--port", str(port)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        pd = asyncio.run(_load(f"http://127.0.0.1:{port}", *load))
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for e in (p, d):
            e.stop()
        kvd_p.stop()
        kvd_d.stop()
    return {"one_engine_cores_0_1": one, "pd_pair_cores_0_and_1": pd,
            "pd_over_one": round(pd["req_per_s"] / one["req_per_s"], 3),
            "requests": args.requests, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rooms", type=int, default=4)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    model = ensure_hf_model(REPO / ".cache" / "hf-models")
    work = REPO / ".cache" / "bench-vllm"
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"idle_cost": idle_cost(model, work, args.rooms, args.window)}
    print(json.dumps(out, indent=2), flush=True)
    if not args.skip_throughput:
        out["throughput"] = throughput(model, work, args)
    results = REPO / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "vllm_pd.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
