"""kvd.transfer.backends.mooncake.widen_backlogs: the listeners the transfer engine opens
take the kernel's largest accept backlog (K39's cost: with the TCP pool off, a burst of
rooms overflowed a decode's accept queue of 128 and dropped SYNs waited 1 s). Real
sockets of this process; the backlog is read back with ``ss``."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from kvd.transfer.backends.mooncake import _socket_fds, widen_backlogs

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")


def backlog(port: int) -> int:
    """A listener's accept backlog: ``ss -ltn``'s Send-Q column."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True,
                         text=True, check=True).stdout.split()
    return int(out[2])


def listener(n: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(n)
    return s


def test_k39_only_listeners_opened_after_the_snapshot_get_the_wider_backlog() -> None:
    with listener(2) as old:
        before = set(_socket_fds())
        with listener(2) as new, listener(3) as new6, \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
                socket.socket() as unconnected:
            udp.bind(("127.0.0.1", 0))
            unconnected.bind(("127.0.0.1", 0))
            changed = widen_backlogs(before, 77)
            ports = {s.getsockname()[1] for s in (new, new6)}
            assert set(changed) == ports  # neither the old listener nor non-listeners
            assert backlog(new.getsockname()[1]) == 77
            assert backlog(new6.getsockname()[1]) == 77
            assert backlog(old.getsockname()[1]) == 2
            # the original descriptors stay open and listening: a client is accepted
            with socket.create_connection(new.getsockname(), timeout=10):
                conn, _ = new.accept()
                conn.close()


def test_k39_the_default_backlog_is_the_kernels_cap() -> None:
    before = set(_socket_fds())
    with listener(1) as s:
        widen_backlogs(before)
        try:
            cap = int(Path("/proc/sys/net/core/somaxconn").read_text())
        except OSError:
            cap = 4096
        assert backlog(s.getsockname()[1]) == cap
