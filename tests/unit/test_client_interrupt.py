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


def test_a_call_kvd_never_answers_fails_after_the_client_timeout(tmp_path: Path) -> None:
    """The client's socket is blocking with kernel timeouts (SO_RCVTIMEO): a daemon that
    accepts and never answers makes the call fail as KvdUnreachable naming the timeout,
    and the next call reconnects."""
    from kvd.protocol import rpc

    path = str(tmp_path / "silent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    client = KvdClient(path, timeout=0.3)
    with pytest.raises(KvdUnreachable, match=r"no answer within 0\.3s"):
        client.call(rpc.Poll(rooms=[]))
    first, _ = server.accept()
    with pytest.raises(KvdUnreachable, match=r"no answer within 0\.3s"):
        client.call(rpc.Poll(rooms=[]))
    second, _ = server.accept()  # a new connection: the timed-out one was dropped
    assert second.fileno() != first.fileno()
    for s in (first, second, server):
        s.close()
