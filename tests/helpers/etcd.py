"""A real etcd server for tests: Debian's ``etcd-server`` (``/usr/bin/etcd``) on loopback
with free ports and a temporary data dir (scripts/system-deps.sh installs it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

ETCD = os.environ.get("KVD_TEST_ETCD", "/usr/bin/etcd")


def etcd_binary() -> str | None:
    """The etcd server binary, or None when it is not installed."""
    if os.access(ETCD, os.X_OK):
        return ETCD
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One single-member etcd cluster; :meth:`stop` and :meth:`start` again keep its
    data dir and ports (an etcd restart, as an operator's would be)."""

    def __init__(self, workdir: Path, binary: str) -> None:
        self.binary, self.workdir = binary, workdir
        self.data = workdir / "etcd-data"
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "etcd.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [self.binary, "--name", "kvd-test", "--data-dir", str(self.data),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvd-test={peer}", "--log-level", "warn"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd not healthy within {timeout}s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def call(self, path: str, body: dict) -> dict:
        """One gateway request (tests read etcd with it)."""
        resp = httpx.post(f"{self.url}{path}", json=body, timeout=5.0)
        resp.raise_for_status()
        out: dict = resp.json()
        return out
