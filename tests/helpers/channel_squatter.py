"""A squatter on a peer channel socket (case S18): root binds the socket file (as kvd's
user could), a child running as another uid (``NOBODY``) calls ``listen`` on it -- so
``SO_PEERCRED`` shows that uid -- and hands every client a descriptor of a victim file
with ``SCM_RIGHTS`` (what an attacker holding such a descriptor would pass). It prints
``served`` per client it got to send to."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.helpers.squatter import NOBODY, SYSTEM_PYTHON

_SCRIPT = r"""
import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
victim = int(sys.argv[2])
s.listen(8)
print("ready", flush=True)
while True:
    conn, _ = s.accept()
    try:
        conn.recv(4096)
        socket.send_fds(conn, [b"\x82\xa4type\xa5files\xa5count\x01"], [victim])
        print("served", flush=True)
    except OSError:
        pass
    conn.close()
"""


class ChannelSquatter:
    """Serves ``path`` as ``uid``, passing ``victim`` (an open descriptor) to clients."""

    def __init__(self, path: Path, victim: int, uid: int = NOBODY) -> None:
        if os.geteuid() != 0:
            pytest.skip("running a server as another uid needs root")
        if not os.access(SYSTEM_PYTHON, os.X_OK):
            pytest.skip("no system python3 that another user can run")
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(str(path))
        try:
            self.proc = subprocess.Popen(
                [SYSTEM_PYTHON, "-c", _SCRIPT, str(sock.fileno()), str(victim)],
                stdout=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"},
                pass_fds=(sock.fileno(), victim), user=uid, group=uid, extra_groups=[])
        finally:
            sock.close()
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        """End the child (ours, by its pid) and remove the socket file."""
        self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> ChannelSquatter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
