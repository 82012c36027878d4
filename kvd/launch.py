"""Start kvd daemons as child processes (used by the demo, benchmarks and tests).

A daemon writes one JSON "ready" line on stdout once every listener is open;
:func:`start_daemon` waits for it (bounded) and returns its ports.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvd.addr import join_hostport
from kvd.errors import KvdError


@dataclass
class DaemonProcess:
    """A running kvd child: its Popen, ready info (ports, endpoints) and config file."""

    proc: subprocess.Popen[bytes]
    ready: dict[str, Any]
    config: Path
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)
    #: the write end of the daemon's lifeline (:data:`LIFELINE_ENV`): closed by
    #: :meth:`stop`, and by the kernel when this process dies, which stops the daemon
    lifeline: int | None = None

    @property
    def http_addr(self) -> str:
        """``host:PORT`` of its HTTP server (``[v6]:PORT`` for IPv6)."""
        return join_hostport(str(self.extra["http_host"]).strip("[]"), self.ready["http_port"])

    @property
    def socket(self) -> str:
        """Path of its engine RPC socket."""
        return str(self.ready["engine_socket"])

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout`` s (then SIGKILL); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None
        return int(self.proc.returncode)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))


#: The environment variable naming a daemon's lifeline: a pipe's read end the daemon
#: inherits while its launcher keeps the write end. When the launcher dies without stopping
#: it (a killed test run or benchmark), the kernel closes the write end, the daemon reads
#: end of file and stops as at SIGTERM: no orphan keeps its ports and sockets.
LIFELINE_ENV = "KVD_LIFELINE_FD"

#: The cluster secret of daemons started by this process (tests, demo, benchmarks): one
#: random secret per launching process, handed to children through the environment.
LAUNCH_SECRET = os.environ.get("KVD_CLUSTER_SECRET") or secrets.token_hex(24)


def start_daemon(role: str, workdir: str | Path | None = None, timeout: float = 30.0,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None,
                 pass_fds: tuple[int, ...] = (), **settings: Any) -> DaemonProcess:
    """Start ``kvd serve`` with ``settings`` written to a TOML file.

    The daemon gets :data:`LAUNCH_SECRET` as its cluster secret (``KVD_CLUSTER_SECRET``)
    unless ``env`` says otherwise or ``insecure=True`` is passed. Raises
    :class:`KvdError` if the daemon exits or is not ready in ``timeout`` s (the message
    carries the tail of its log). ``prefix`` wraps the command (e.g. ``ip netns exec NS``);
    ``pass_fds`` are descriptors the child inherits (e.g. a socket to pass the way systemd
    socket activation does). The daemon stops by itself if this process dies first
    (:data:`LIFELINE_ENV`). The engine socket defaults to ``<workdir>/<role>-<8 hex
    digits>.sock``: short, because a Unix socket path is at most 107 bytes and test
    runners' temp dirs are deep (pytest-xdist's ``popen-gwN``).
    """
    work = Path(workdir or tempfile.mkdtemp(prefix="kvd-"))
    work.mkdir(parents=True, exist_ok=True)
    settings.setdefault("engine_socket", str(work / f"{role}-{secrets.token_hex(4)}.sock"))
    settings["role"] = role
    cfg = work / f"kvd-{role}-{time.time_ns()}.toml"
    cfg.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in settings.items()))
    log = cfg.with_suffix(".log")
    child_env = dict(os.environ)
    if not settings.get("insecure"):
        child_env.setdefault("KVD_CLUSTER_SECRET", LAUNCH_SECRET)
    child_env.update(env or {})
    line_r, line_w = os.pipe()  # both ends close-on-exec: only this daemon gets line_r
    child_env[LIFELINE_ENV] = str(line_r)
    try:
        with log.open("wb") as errf:
            proc = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", "kvd.cli.main", "serve",
                 "--config", str(cfg)], stdout=subprocess.PIPE, stderr=errf,
                env=child_env, pass_fds=(*pass_fds, line_r))
    except BaseException:
        os.close(line_w)
        raise
    finally:
        os.close(line_r)
    try:
        ready = _wait_ready(proc, log, timeout)
    except BaseException:
        os.close(line_w)
        raise
    return DaemonProcess(proc, ready, cfg, log,
                         {"http_host": settings.get("http_host", "127.0.0.1")}, line_w)


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline, buf = time.monotonic() + timeout, b""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        r, _, _ = select.select([proc.stdout], [], [], 0.05)
        if r:
            buf += os.read(proc.stdout.fileno(), 65536)
            for line in buf.splitlines():
                if line.startswith(b"{"):
                    ready: dict[str, Any] = json.loads(line)
                    if ready.get("event") == "ready":
                        return ready
    proc.kill()
    proc.wait()
    tail = log.read_text(errors="replace")[-2000:]
    raise KvdError(f"kvd did not become ready (exit {proc.returncode}):\n{tail}")
