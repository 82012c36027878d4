"""A squatter on an engine socket path: a tiny Unix server in a child process, optionally
running as another uid (the caller must be root), that reports how many bytes each
client sent before closing (case S17)."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import time
from pathlib import Path

import pytest

#: The child: bind, listen, say "ready"; per connection print "got N" where N is the size
#: of the first chunk received (0: the client closed without sending anything).
_SCRIPT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(8)
print("ready", flush=True)
while True:
    conn, _ = s.accept()
    conn.settimeout(120)
    try:
        data = conn.recv(1 << 16)
    except OSError:
        data = b""
    print("got", len(data), flush=True)
    conn.close()
"""

#: A python another user can run (the venv may sit in a folder only root reaches).
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = 65534


class Squatter:
    """The squatter serving ``path`` as ``uid`` (None: this process's uid)."""

    def __init__(self, path: Path, uid: int | None = NOBODY) -> None:
        if uid is not None and os.geteuid() != 0:
            pytest.skip("running a server as another uid needs root")
        if not os.access(SYSTEM_PYTHON, os.X_OK):
            pytest.skip("no system python3 that another user can run")
        self.path = path
        as_user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        self.proc = subprocess.Popen([SYSTEM_PYTHON, "-c", _SCRIPT, str(path)],
                                     stdout=subprocess.PIPE, text=True, cwd="/",
                                     env={"PATH": "/usr/bin:/bin"}, **as_user)
        assert self.next_line() == "ready"

    def next_line(self, within: float = 60.0) -> str:
        """The child's next line, waiting at most ``within`` s (a generous bound)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.1)[0]:
                return self.proc.stdout.readline().strip()
            if self.proc.poll() is not None:
                raise AssertionError(f"squatter exited {self.proc.returncode}")
        raise AssertionError("squatter said nothing")

    def bytes_received(self) -> int:
        """Bytes the next client sent before it closed (waits for that client)."""
        word, n = self.next_line().split()
        assert word == "got"
        return int(n)

    def stop(self) -> None:
        """End the child (ours, by its pid) and remove the socket file."""
        self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> Squatter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
