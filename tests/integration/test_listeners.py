"""S01: every listening socket of a real daemon, the transfer engine's included, is bound to
the configured host, with the transfer engine's ports inside the configured range."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.cli import doctor
from kvd.config import Settings
from kvd.launch import start_daemon
from kvd.netstat import listeners, wider_than

pytestmark = pytest.mark.integration


def _settings() -> Settings:
    return Settings(role="decode")


def _two_free_ports() -> tuple[int, int]:
    """Two consecutive ports outside the kernel's ephemeral range that nothing holds now
    (other tests' transfer engines take ports from Mooncake's default 15000-17000)."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 30000, 2)
        try:
            for port in (base, base + 1):
                with socket.socket(socket.AF_INET6) as s6:
                    s6.bind(("::", port))
        except OSError:
            continue
        return base, base + 1
    raise AssertionError("no two consecutive free ports")


def test_s01_transfer_engine_listeners_bind_only_the_configured_host(tmp_path: Path) -> None:
    lo, hi = _two_free_ports()
    daemon = start_daemon("decode", tmp_path, host="127.0.0.1", http_host="127.0.0.1",
                          transfer_port_range=f"{lo}-{hi}")
    try:
        found = listeners(daemon.proc.pid)
        assert len(found) >= 4  # REST, ZMQ control, transfer handshake, transfer TCP data
        assert wider_than(found, {"127.0.0.1"}) == [], [str(x) for x in found]
        rpc_port = int(daemon.ready["session_id"].rsplit(":", 1)[1])
        transfer = {x.port for x in found} - {daemon.ready["http_port"],
                                              int(daemon.ready["control_endpoint"]
                                                  .rsplit(":", 1)[1])}
        assert rpc_port in transfer and transfer <= {lo, hi}, transfer
        c = doctor.check_listeners(doctor.daemon_pid(Path(daemon.socket)) or 0, _settings())
        assert c.status == "ok", c.detail
        assert f"127.0.0.1:{rpc_port}" in c.detail
    finally:
        daemon.stop()


def test_k39_the_transfer_engines_listeners_take_the_kernels_backlog(
        tmp_path: Path) -> None:
    """K39's cost: with Mooncake's TCP pool off every write dials the decode's data port,
    and Mooncake listens with a backlog of 128: a burst of rooms overflowed it and the
    dropped SYNs waited 1 s. Both transfer listeners of a real daemon have the kernel's
    cap (net.core.somaxconn) instead."""
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2)")
    lo, hi = _two_free_ports()
    daemon = start_daemon("decode", tmp_path, host="127.0.0.1", http_host="127.0.0.1",
                          transfer_port_range=f"{lo}-{hi}")
    try:
        cap = int(Path("/proc/sys/net/core/somaxconn").read_text())
        rows = subprocess.run(["ss", "-ltnH", f"( sport = :{lo} or sport = :{hi} )"],
                              capture_output=True, text=True, check=True).stdout
        backlogs = {(f[3], int(f[2])) for f in map(str.split, rows.splitlines())}
        # Send-Q of a listener is its backlog. The handshake port has two listeners:
        # kvd's front on the advertised address (its own backlog, 1024) and Mooncake's
        # behind it on another loopback address; the data port has Mooncake's only.
        front = f"127.0.0.1:{daemon.ready['session_id'].rsplit(':', 1)[1]}"
        mooncake = {b for addr, b in backlogs if addr != front}
        assert len(backlogs) == 3 and mooncake == {cap}, backlogs
    finally:
        daemon.stop()


def test_s01_listeners_of_base_code_were_wider(tmp_path: Path) -> None:
    """Positive control of the check itself: bind host 0.0.0.0 keeps Mooncake's own
    behaviour (every interface), and the check sees it."""
    daemon = start_daemon("decode", tmp_path, transfer_bind_host="0.0.0.0")
    try:
        wide = wider_than(listeners(daemon.proc.pid), {"127.0.0.1"})
        assert wide and all(x.wildcard for x in wide)
        c = doctor.check_listeners(doctor.daemon_pid(Path(daemon.socket)) or 0, _settings())
        assert c.status == "warn" and "wider than configured" in c.detail
    finally:
        daemon.stop()
