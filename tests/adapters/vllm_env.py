"""Shared pieces of the real-vLLM tests: a PD cluster (kvd daemons, vLLM engines,
``kvd proxy``), metrics and health readers. Imports neither vLLM nor torch."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvd.adapters.vllm import launch
from kvd.launch import DaemonProcess, start_daemon

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its descendants, now."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
            for task in Path(f"/proc/{p}/task").iterdir():  # children of every thread
                todo += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return total


def health(daemon: DaemonProcess) -> dict[str, Any]:
    return dict(httpx.get(f"http://{daemon.http_addr}/health", timeout=5).json())


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series at ``base_url``/metrics whose labels include
    ``labels`` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def until(predicate: Callable[[], Any], bound: float, what: str) -> Any:
    """Poll ``predicate`` until it is truthy, for at most ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {bound:.0f} s: {what}")
        time.sleep(0.2)


class PdCluster:
    """``n_prefill`` prefill instances (each: kvd serving bootstrap + vLLM producer, TP 1),
    one decode instance of TP ``decode_tp`` (one kvd per rank, rank settings unset: kvd
    takes them from the engine) and ``kvd proxy`` in front. ``prefill_args`` /
    ``decode_args``: more engine flags; ``extra``: more ``kv_connector_extra_config`` per
    side (``{"prefill": {...}, "decode": {...}}``)."""

    def __init__(self, model: Path, work: Path, n_prefill: int = 1, decode_tp: int = 1,
                 decode_cpus: str = "0-1", hybrid: bool = False,
                 decode_args: list[str] | None = None, prefill_args: list[str] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        self.work = work
        env = launch.engine_env()
        self.kvd_p = [start_daemon("prefill", work, serve_bootstrap=True)
                      for _ in range(n_prefill)]
        self.kvd_d = [start_daemon("decode", work, engine_socket=str(work / f"d-{r}.sock"))
                      for r in range(decode_tp)]
        self.prefill = [launch.start_engine(launch.engine_command(
            sys.executable, model, free_port(),
            launch.kv_transfer_config("kv_producer", k.socket, k.http_addr,
                                      **(extra or {}).get("prefill", {})),
            prefill_args, hybrid=hybrid), work / f"prefill-{i}.log", env)
            for i, k in enumerate(self.kvd_p)]
        d_cfg = launch.kv_transfer_config("kv_consumer", str(work / "d-{tp_rank}.sock"),
                                          **(extra or {}).get("decode", {}))
        tp_args = ["--tensor-parallel-size", str(decode_tp)] if decode_tp > 1 else []
        self.decode = launch.start_engine(launch.engine_command(
            sys.executable, model, free_port(), d_cfg, [*tp_args, *(decode_args or [])],
            hybrid=hybrid), work / "decode.log",
            launch.engine_env(decode_cpus))
        self.proxy_url = f"http://127.0.0.1:{free_port()}"
        self.proxy: subprocess.Popen[bytes] | None = None
        self.start_s: list[float] = []

    def wait(self) -> None:
        """Engines healthy (seconds each in ``start_s``), then the proxy."""
        self.start_s = [launch.wait_healthy(e, 900) for e in (*self.prefill, self.decode)]
        port = self.proxy_url.rsplit(":", 1)[1]
        args = [a for e in self.prefill for a in ("--prefill", e.url)]
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli.main", "proxy", *args, "--decode",
             self.decode.url, "--port", port, "--health-interval", "2", "--log-level", "info"],
            stdout=(self.work / "proxy.log").open("wb"), stderr=subprocess.STDOUT)
        until(lambda: _ok(f"{self.proxy_url}/health"), 60, "the proxy answers /health")

    def prefill_counter(self, name: str) -> int:
        return sum(int(health(k)["counters"][name]) for k in self.kvd_p)

    def stop(self, keep: str) -> None:
        """Stop everything; keep the logs under .cache/<keep>/."""
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.wait(10)
        for engine in (*self.prefill, self.decode):
            engine.stop()
        for daemon in (*self.kvd_p, *self.kvd_d):
            daemon.stop()
        dest = REPO / ".cache" / keep
        dest.mkdir(parents=True, exist_ok=True)
        for f in [*self.work.glob("*.log"), *self.work.glob("*.json")]:
            shutil.copy(f, dest / f.name)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def chat_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True, **extra}
