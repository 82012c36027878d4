"""A real etcd server for tests: Debian's ``etcd-server`` (``/usr/bin/etcd``) on loopback
with free ports and a temporary data dir (scripts/system-deps.sh installs it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
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

    def __init__(self, workdir: Path, binary: str, host: str = "127.0.0.1",
                 netns: str | None = None) -> None:
        self.binary, self.workdir, self.host, self.netns = binary, workdir, host, netns
        self.data = workdir / "etcd-data"
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "etcd.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def start(self, timeout: float = 30.0) -> None:
        peer = f"http://{self.host}:{self.peer_port}"
        args = [self.binary, "--name", "kvd-test", "--data-dir", str(self.data),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvd-test={peer}", "--log-level", "warn"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self._prefix() + args, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            if self._healthy():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd not healthy within {timeout}s")

    def _prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    def _healthy(self) -> bool:
        if self.netns:  # only reachable from inside its namespace
            probe = ("import httpx, sys; r = httpx.get(sys.argv[1] + '/health', timeout=1.0); "
                     "sys.exit(0 if r.json().get('health') == 'true' else 1)")
            done = subprocess.run([*self._prefix(), sys.executable, "-c", probe, self.url],
                                  capture_output=True, timeout=30)
            return done.returncode == 0
        try:
            return bool(httpx.get(f"{self.url}/health", timeout=1.0).json().get("health")
                        == "true")
        except (httpx.HTTPError, ValueError):
            return False

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
