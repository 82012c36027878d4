"""KvdClient.interrupt: another thread ends a call in progress (the idle sleeper's Wait)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from kvd.client import KvdClient
from kvd.errors import KvdUnreachable
from tests.helpers.fake_kvd import FakeKvd


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


def test_a_timed_out_call_on_an_open_connection_is_not_sent_again(tmp_path: Path) -> None:
    """A call that times out on a connection that already served one is not retried on a
    fresh connection: a stalled kvd may still run it (twice, for a Many), and the caller
    would wait twice its timeout."""
    from kvd.protocol import rpc

    server = FakeKvd(str(tmp_path / "slow.sock"), answered=1)
    client = KvdClient(str(tmp_path / "slow.sock"), timeout=0.3)
    try:
        client.call(rpc.Poll(rooms=[]))
        with pytest.raises(KvdUnreachable, match=r"no answer within 0\.3s"):
            client.call_many([rpc.SenderCreate(room=1)])
        assert server.seen == [(1, "Poll"), (1, "Many")]  # once, on the first connection
    finally:
        client.close()
        server.close()


def test_interrupt_ends_a_call_on_an_open_connection_without_sending_it_again(
        tmp_path: Path) -> None:
    """interrupt() during a call on a connection that already served one (every call of a
    registered engine) ends the call: it is not sent again on a fresh connection."""
    from kvd.protocol import rpc

    server = FakeKvd(str(tmp_path / "silent.sock"), answered=1)
    client = KvdClient(str(tmp_path / "silent.sock"), timeout=60.0)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            client.call_many([rpc.Poll(rooms=[1])])
        except KvdUnreachable as exc:
            errors.append(exc)

    try:
        client.call(rpc.Poll(rooms=[]))
        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 10.0
        while len(server.seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.seen == [(1, "Poll"), (1, "Many")]  # the call waits for its answer
        client.interrupt()
        t.join(10)
        assert not t.is_alive() and errors
        assert server.seen == [(1, "Poll"), (1, "Many")]  # and was not sent again
    finally:
        client.close()
        server.close()


def test_call_many_refuses_calls_a_many_cannot_carry_before_sending(tmp_path: Path) -> None:
    from kvd.protocol import rpc

    client = KvdClient(str(tmp_path / "none.sock"))
    for call in (rpc.Wait(rooms=[1], timeout=1.0), rpc.Info(), rpc.Release(),
                 rpc.Many(calls=[])):
        with pytest.raises(ValueError, match="cannot carry"):
            client.call_many([rpc.Poll(rooms=[]), call])  # type: ignore[list-item]


def test_a_request_kvd_cannot_decode_raises_kvds_reason(tmp_path: Path) -> None:
    """kvd answers a frame it cannot decode with id 0: the client raises that error (its
    reason), not a reply-id mismatch."""
    from kvd.errors import ProtocolError
    from kvd.protocol import rpc

    bad = rpc.Reply(id=0, ok=False, error="invalid frame: bad room", kind="ProtocolError")
    server = FakeKvd(str(tmp_path / "k.sock"), answered=1, reply=bad)
    client = KvdClient(str(tmp_path / "k.sock"), timeout=10.0)
    try:
        with pytest.raises(ProtocolError, match="bad room"):
            client.call(rpc.Poll(rooms=[1]))
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf"), 1e30])
def test_a_timeout_no_socket_can_take_is_refused_at_once(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        KvdClient("/nonexistent.sock", timeout=timeout)


def test_call_many_refuses_polls_naming_too_many_rooms_before_sending(tmp_path: Path) -> None:
    from kvd.protocol import rpc

    client = KvdClient(str(tmp_path / "none.sock"))
    with pytest.raises(ValueError, match="at most"):
        client.call_many([rpc.Poll(rooms=[1] * rpc.MAX_MANY_POLLED), rpc.Poll(rooms=[1])])


def test_an_interrupt_with_no_call_in_flight_ends_nothing(tmp_path: Path) -> None:
    """``interrupt()`` ends the call in progress; with none in flight it ends nothing: the
    next call runs on the same connection (no broken pipe, no "interrupted"), and an
    interrupt that came too late for a call that just finished is consumed by the next
    call, which reconnects instead of failing."""
    from kvd.protocol import rpc

    server = FakeKvd(str(tmp_path / "kvd.sock"))
    client = KvdClient(str(tmp_path / "kvd.sock"), timeout=5.0)
    try:
        client.call(rpc.Poll(rooms=[]))
        client.interrupt()  # nothing in flight
        client.call(rpc.Poll(rooms=[]))
        assert server.seen == [(1, "Poll"), (1, "Poll")]  # the same connection
        # an interrupt that raced a call's end: the socket is shut, nobody consumed it
        sock = client._sock
        assert sock is not None
        client._interrupted = sock
        sock.shutdown(socket.SHUT_RDWR)
        client.call(rpc.Poll(rooms=[]))  # reconnects, not "interrupted"
        assert server.seen[-1] == (2, "Poll")
    finally:
        client.close()
        server.close()
