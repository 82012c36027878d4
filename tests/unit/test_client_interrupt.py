"""KvdClient.interrupt: another thread ends a call in progress (the idle sleeper's Wait)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from kvd.client import KvdClient
from kvd.errors import KvdUnreachable


def test_interrupt_ends_a_call_in_progress(tmp_path: Path) -> None:
    path = str(tmp_path / "silent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)  # accepts the connection, never answers
    client = KvdClient(path, timeout=60.0)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            client.wait([1], 50.0)
        except KvdUnreachable as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    conn, _ = server.accept()
    assert conn.recv(4)  # the request went out: the client now waits for the answer
    client.interrupt()
    t.join(10)
    assert not t.is_alive() and errors
    conn.close()
    server.close()
    with pytest.raises(KvdUnreachable):  # the next call reconnects (and finds no server)
        client.wait([1], 0.1)
