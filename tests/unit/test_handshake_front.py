"""The handshake front (kvd/transfer/backends/handshake.py) against a stand-in for
Mooncake's handshake listener that behaves like the real one: ONE thread accepting and
serving connections one after another, 5 s receive timeout each (case S05).

Real loopback sockets, no transfer engine; waits are "poll until, within a generous
bound", never a wall-clock threshold.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.transfer.backends.handshake import (
    HEADER,
    FrameError,
    FrontLimits,
    HandshakeFront,
    Reservation,
    backend_host,
    max_frame,
    read_frame,
)

BOUND = 20.0


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def until(probe: Callable[[], object], what: str, timeout: float = BOUND) -> object:
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.01)
    return value


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


class SerialListener:
    """Mooncake's handshake daemon, as its source reads: one thread, one connection at a
    time, SO_RCVTIMEO 5 s; answers a request frame with ``b"answer:" + request body``,
    or closes without an answer when the body starts with ``!`` (as Mooncake does with a
    body that is not JSON or of an unknown type)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.seen: list[bytes] = []
        self.answering = threading.Event()  # cleared: requests are read, answers wait
        self.answering.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()
        return host, port

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(5.0)
                try:
                    header = recv_exact(conn, 8)
                    if len(header) < 8:
                        continue
                    body = recv_exact(conn, HEADER.unpack(header)[0])
                    self.seen.append(body)
                    if body.startswith(b"!"):
                        continue
                    self.answering.wait()
                    conn.sendall(frame(b"answer:" + body))
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(1)  # wait for the client to close, as Mooncake does
                except OSError:
                    continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[SerialListener]:
    s = SerialListener("127.0.0.2")
    yield s
    s.close()


def start_front(backend: tuple[str, int], limits: FrontLimits) -> HandshakeFront:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    front = HandshakeFront(sock, backend, limits)
    front.start()
    return front


@pytest.fixture
def front_for(listener: SerialListener) -> Iterator[Callable[..., HandshakeFront]]:
    made: list[HandshakeFront] = []

    def make(**limits: float) -> HandshakeFront:
        f = start_front(listener.address, FrontLimits(**limits))  # type: ignore[arg-type]
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


@pytest.fixture
def front_for_backend() -> Iterator[Callable[..., HandshakeFront]]:
    made: list[HandshakeFront] = []

    def make(backend: tuple[str, int], **limits: float) -> HandshakeFront:
        f = start_front(backend, FrontLimits(**limits))  # type: ignore[arg-type]
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def held_front(front_for: Callable[..., HandshakeFront]) -> tuple[HandshakeFront,
                                                                  threading.Event]:
    """A front (0.3 s request deadline) whose thread is blocked until the returned event
    is set (as by the GIL under load): connections queue in the kernel meanwhile."""
    front = front_for(request_deadline_s=0.3)
    assert front._loop is not None
    gate = threading.Event()
    front._loop.call_soon_threadsafe(gate.wait, BOUND)
    return front, gate


def handshake(addr: tuple[str, int], body: bytes) -> bytes:
    """One handshake as Mooncake's client does it: connect, write, read the answer."""
    with socket.create_connection(addr, timeout=BOUND) as c:
        c.sendall(frame(body))
        header = recv_exact(c, 8)
        assert len(header) == 8, "the front closed without an answer"
        return recv_exact(c, HEADER.unpack(header)[0])


def closed_by_peer(sock: socket.socket) -> bool:
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# ---- relaying -------------------------------------------------------------------------------


def test_a_complete_request_gets_the_listeners_answer_byte_exact(
        listener: SerialListener, front_for: Callable[..., HandshakeFront]) -> None:
    front = front_for()
    body = b"\x01" + json.dumps({"name": "p", "buffers": list(range(500))}).encode()
    assert handshake(front.address, body) == b"answer:" + body
    assert listener.seen == [body]
    until(lambda: front.counts["relayed"] == 1, "counted")  # after the answer is sent


def test_s05_idle_connections_never_reach_the_serial_listener(
        listener: SerialListener, front_for: Callable[..., HandshakeFront]) -> None:
    """20 idle connections to the front, then a handshake → answered while they are still
    open (with the serial listener itself in front, it would wait 20 x 5 s); the front
    closes each idle one after its deadline and the listener never saw any of them."""
    front = front_for(request_deadline_s=3.0)
    idle = [socket.create_connection(front.address) for _ in range(20)]
    try:
        body = b"\x01{}"
        assert handshake(front.address, body) == b"answer:" + body
        assert not any(closed_by_peer(s) for s in idle[-5:]), "idle ones already closed"
        until(lambda: all(closed_by_peer(s) for s in idle), "idle connections closed")
    finally:
        for s in idle:
            s.close()
    assert listener.seen == [body]
    until(lambda: front.counts["idle"] == 20, "20 idle counted")


@pytest.mark.parametrize("payload", [
    HEADER.pack(0),                           # zero length (Mooncake refuses it too)
    HEADER.pack((1 << 20) + 1) + b"x" * 64,   # above MC_HANDSHAKE_MAX_LENGTH
    HEADER.pack(2**64 - 1),                   # absurd length
])
def test_a_frame_with_a_bad_length_is_closed_without_reaching_the_listener(
        listener: SerialListener, front_for: Callable[..., HandshakeFront],
        payload: bytes) -> None:
    front = front_for()
    with socket.create_connection(front.address, timeout=BOUND) as c:
        c.sendall(payload)
        until(lambda: closed_by_peer(c), "closed")
    until(lambda: front.counts["malformed"] == 1, "counted as malformed")
    assert listener.seen == []


def test_a_request_cut_short_is_closed_without_reaching_the_listener(
        listener: SerialListener, front_for: Callable[..., HandshakeFront]) -> None:
    """A header announcing 100 bytes, 10 sent, then silence (slowloris) → closed after
    the deadline; a peer that closes half way is dropped too."""
    front = front_for(request_deadline_s=0.3)
    with socket.create_connection(front.address, timeout=BOUND) as c:
        c.sendall(HEADER.pack(100) + b"x" * 10)
        until(lambda: closed_by_peer(c), "closed")
    with socket.create_connection(front.address, timeout=BOUND) as c:
        c.sendall(HEADER.pack(100) + b"x" * 10)
    until(lambda: front.counts["idle"] == 2, "both counted")
    assert listener.seen == []


def test_the_oldest_incomplete_connection_makes_room_for_a_new_one(
        listener: SerialListener, front_for: Callable[..., HandshakeFront]) -> None:
    """max_pending 4, a long deadline: 6 idle connections → the 2 oldest are closed
    (evicted), the 4 newest stay; a handshake still gets through."""
    front = front_for(max_pending=4, request_deadline_s=60.0)
    idle = []
    for n in range(1, 7):
        idle.append(socket.create_connection(front.address))
        until(lambda n=n: front.counts["evicted"] + len(front._pending) >= n, "accepted")
    try:
        until(lambda: all(closed_by_peer(s) for s in idle[:2]), "the 2 oldest closed")
        assert not any(closed_by_peer(s) for s in idle[2:])
        assert handshake(front.address, b"\x03{}") == b"answer:\x03{}"
        assert front.counts["evicted"] >= 3  # 2 idle + one more to admit the handshake
    finally:
        for s in idle:
            s.close()


def test_announced_requests_that_never_arrive_cannot_lock_out_a_complete_one(
        listener: SerialListener, front_for: Callable[..., HandshakeFront]) -> None:
    """request_bytes 1000: two connections announce 500 bytes each and send nothing more
    (the whole budget, held until their deadline; with the real limits 64 headers of
    8 bytes announcing 1 MiB each) → a complete request still gets its answer: the oldest
    incomplete one is closed to make room, the other keeps its share."""
    front = front_for(request_bytes=1000, request_deadline_s=60.0)
    holders = [socket.create_connection(front.address, timeout=BOUND) for _ in range(2)]
    try:
        for n, h in enumerate(holders, 1):
            h.sendall(HEADER.pack(500))
            until(lambda n=n: front._reading == 500 * n, "budget held")
        assert handshake(front.address, b"\x02{}") == b"answer:\x02{}"
        until(lambda: closed_by_peer(holders[0]), "the oldest holder closed")
        assert not closed_by_peer(holders[1])
        assert front.counts["evicted"] == 1 and front.counts["malformed"] == 0
    finally:
        for h in holders:
            h.close()
    until(lambda: front._reading == 0 and not front._held, "budget released")


def test_requests_beyond_the_byte_budget_held_by_relays_are_refused(
        front_for_backend: Callable[..., HandshakeFront]) -> None:
    """The budget held by a complete request that is being relayed (a listener that
    never answers) is not taken back: a second request that does not fit is refused; once
    the relay fails the budget is free again."""
    silent = socket.socket()
    silent.bind(("127.0.0.2", 0))
    silent.listen(8)  # accepts in the kernel, never answers
    front = front_for_backend(silent.getsockname(), request_bytes=1000,
                              answer_deadline_s=60.0)
    with socket.create_connection(front.address, timeout=BOUND) as relaying:
        relaying.sendall(frame(b"\x01" + b"r" * 799))
        until(lambda: front._reading == 800 and not front._pending, "relaying, budget held")
        with socket.create_connection(front.address, timeout=BOUND) as c:
            c.sendall(frame(b"\x01" + b"y" * 799))
            until(lambda: closed_by_peer(c), "refused")
        assert front.counts["malformed"] == 1
        silent.close()  # resets the relay's connection
        until(lambda: closed_by_peer(relaying), "unanswered, closed")
    until(lambda: front._reading == 0 and not front._held, "budget released")
    assert front.counts["unanswered"] == 1


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (RST) instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


#: What a peer does: bytes it sends, then "read" (the answer), "rst", "close" or "stay".
PEERS = {
    "complete": (frame(b"\x01{}"), "read"),
    "complete then rst": (frame(b"\x01" + b"z" * 300), "rst"),
    "complete, never reads": (frame(b"\x01" + b"n" * 300), "stay"),
    "header then close": (HEADER.pack(400), "close"),
    "half then rst": (HEADER.pack(400) + b"h" * 200, "rst"),
    "header, silent": (HEADER.pack(700), "stay"),
    "absurd length": (HEADER.pack(2**63), "stay"),
    "nothing then rst": (b"", "rst"),
    "nothing, silent": (b"", "stay"),
}


@settings(max_examples=8, deadline=None)
@given(peers=st.lists(st.sampled_from(sorted(PEERS)), min_size=1, max_size=40))
def test_the_byte_budget_is_returned_whatever_the_peers_do(peers: list[str]) -> None:
    """Peers doing anything (complete requests, resets in every phase, announced bytes
    that never come, never reading the answer) against small bounds (1500 bytes, 6
    pending): every complete request that was read is answered or closed, and once all
    are gone the front holds no bytes and no connection; a handshake still passes."""
    listener = SerialListener("127.0.0.2")
    front = start_front(listener.address, FrontLimits(request_deadline_s=0.3,
                                                      request_bytes=1500, max_pending=6))
    stay: list[socket.socket] = []
    try:
        for kind in peers:
            payload, then = PEERS[kind]
            c = socket.create_connection(front.address, timeout=BOUND)
            c.sendall(payload)
            if then == "read":
                header = recv_exact(c, 8)
                assert header == b"" or recv_exact(c, HEADER.unpack(header)[0]) == \
                    b"answer:\x01{}"
                c.close()
            elif then == "rst":
                reset(c)
            elif then == "close":
                c.close()
            else:
                stay.append(c)
        until(lambda: not front._pending, "no connection pending")
        for c in stay:
            c.close()
        until(lambda: front._reading == 0 and not front._held, "budget released")
        assert handshake(front.address, b"\x03{}") == b"answer:\x03{}"
        assert front._reading == 0 and not front._held
    finally:
        for c in stay:
            c.close()
        front.close()
        listener.close()


def test_refused_requests_and_peers_gone_before_the_answer_log_no_warning(
        listener: SerialListener, front_for: Callable[..., HandshakeFront],
        caplog: pytest.LogCaptureFixture) -> None:
    """A request the listener closes unanswered (anyone can send one: not JSON, unknown
    type) and a peer that resets before reading its answer are not the listener failing:
    no warning each (a remote could flood the log), counted unanswered and relayed."""
    front = front_for()
    with caplog.at_level(logging.WARNING, logger="kvd.transfer.backends.handshake"):
        with socket.create_connection(front.address, timeout=BOUND) as c:
            c.sendall(frame(b"!not json"))
            assert recv_exact(c, 8) == b""
        listener.answering.clear()
        c = socket.create_connection(front.address, timeout=BOUND)
        c.sendall(frame(b"\x01" + b"a" * 100))
        until(lambda: len(listener.seen) == 2, "relayed, the answer held back")
        reset(c)
        listener.answering.set()
        until(lambda: front.counts["unanswered"] == 1 and front.counts["relayed"] == 1,
              "both counted")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert front._reading == 0


def test_a_burst_of_connections_while_the_front_is_busy_waits_in_the_backlog(
        listener: SerialListener, front_for: Callable[..., HandshakeFront]) -> None:
    """The front's thread held (as by the GIL under load) while 300 connections arrive:
    the kernel completes them all (backlog 1024; asyncio's default of 100 would drop the
    SYNs beyond it, delaying real peers by a retransmission), and once free the front
    serves them and a handshake."""
    front, gate = held_front(front_for)
    burst: list[socket.socket] = []
    try:
        for _ in range(300):
            burst.append(socket.create_connection(front.address, timeout=BOUND))
    finally:
        gate.set()
        for c in burst:
            c.close()
    until(lambda: front.counts["idle"] + front.counts["evicted"] == 300, "all served")
    assert handshake(front.address, b"\x01{}") == b"answer:\x01{}"


def test_close_ends_every_connection_even_those_being_relayed(
        front_for_backend: Callable[..., HandshakeFront]) -> None:
    """close() with one connection pending and one being relayed (a listener that never
    answers): the thread ends, both peers see the connection closed, no task is left
    pending on the front's loop."""
    silent = socket.socket()
    silent.bind(("127.0.0.2", 0))
    silent.listen(8)
    front = front_for_backend(silent.getsockname(), request_deadline_s=60.0,
                              answer_deadline_s=60.0)
    try:
        with socket.create_connection(front.address, timeout=BOUND) as relaying, \
                socket.create_connection(front.address, timeout=BOUND) as pending:
            relaying.sendall(frame(b"\x01{}"))
            until(lambda: front._reading == 3 and len(front._pending) == 1, "both in place")
            front.close()
            assert front._thread is not None and not front._thread.is_alive()
            until(lambda: closed_by_peer(relaying) and closed_by_peer(pending), "closed")
        assert front._loop is not None and not asyncio.all_tasks(front._loop)
    finally:
        silent.close()


def test_a_request_queued_before_a_burst_is_read_before_the_burst_evicts_it(
        listener: SerialListener, front_for: Callable[..., HandshakeFront]) -> None:
    """The front's thread held; a real peer connects and sends its request, then 400
    idle connections arrive (a connection flood faster than the front). Once free, the
    front admits them in batches small enough (64 at a time) that the peer's request is
    read before 256 newer admissions would evict it: answered. (Accepting the whole
    backlog at once admitted all 401 first and evicted the peer unread: every real
    handshake failed under a flood the front could not keep up with.)"""
    front, gate = held_front(front_for)
    burst: list[socket.socket] = []
    try:
        with socket.create_connection(front.address, timeout=BOUND) as peer:
            peer.sendall(frame(b"\x01{}"))
            for _ in range(400):
                burst.append(socket.create_connection(front.address, timeout=BOUND))
            gate.set()
            header = recv_exact(peer, 8)
            assert len(header) == 8, "the peer's connection was closed unanswered"
            assert recv_exact(peer, HEADER.unpack(header)[0]) == b"answer:\x01{}"
    finally:
        gate.set()
        for c in burst:
            c.close()
    until(lambda: front.counts["relayed"] == 1 and not front._pending, "all served")


def test_a_listener_that_is_down_closes_the_connection_and_is_counted() -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.2", 0))
    addr = dead.getsockname()
    dead.close()  # nothing listens there now
    front = start_front(addr, FrontLimits())
    try:
        with socket.create_connection(front.address, timeout=BOUND) as c:
            c.sendall(frame(b"\x01{}"))
            assert recv_exact(c, 8) == b""
        until(lambda: front.counts["unanswered"] == 1, "counted")
    finally:
        front.close()


# ---- framing --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(body=st.binary(min_size=1, max_size=3000), cuts=st.lists(st.integers(0, 3100),
                                                                 max_size=6))
def test_read_frame_returns_the_frame_however_it_is_split(body: bytes, cuts: list[int]) -> None:
    data = frame(body) + b"trailing"
    points = sorted({min(c, len(data)) for c in cuts})

    async def run() -> bytes:
        reader = asyncio.StreamReader()
        last = 0
        for p in [*points, len(data)]:
            reader.feed_data(data[last:p])
            last = p
        reader.feed_eof()
        return await read_frame(reader, 1 << 20)

    assert asyncio.run(run()) == frame(body)


@given(length=st.one_of(st.just(0), st.integers((1 << 20) + 1, 2**64 - 1)))
def test_read_frame_refuses_lengths_mooncake_refuses(length: int) -> None:
    async def run() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(HEADER.pack(length))
        reader.feed_eof()
        await read_frame(reader, 1 << 20)

    with pytest.raises(FrameError):
        asyncio.run(run())


def test_max_frame_follows_mooncakes_own_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("", 1 << 20), ("abc", 1 << 20), (str(4 << 20), 4 << 20),
                      (str(1 << 19), 1 << 20), (str(256 << 20), 1 << 20)):
        monkeypatch.setenv("MC_HANDSHAKE_MAX_LENGTH", raw)
        assert max_frame() == want, raw


# ---- reserving the port ---------------------------------------------------------------------


def test_reservation_puts_the_front_on_the_first_bind_and_the_engine_behind_it() -> None:
    r = Reservation("127.0.0.1", "127.0.0.1")
    assert r.backend == backend_host("127.0.0.1") == "127.0.0.2"
    calls: list[str] = []
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    assert r(port, lambda host: calls.append(host) or 0) == 0
    assert calls == ["127.0.0.2"] and r.port == port
    assert r.sock is not None and r.sock.getsockname() == ("127.0.0.1", port)
    assert r(port + 1, lambda host: calls.append(host) or 0) == 0  # later binds: bind_host
    assert calls == ["127.0.0.2", "127.0.0.1"]
    assert r.check(port) is None
    assert "another order" in (r.check(port + 7) or "")
    r.release()
    assert r.sock is None


def test_a_reserved_front_address_cannot_be_shared_before_the_front_starts() -> None:
    """Between the reservation and the front's start (the rest of the engine's
    initialize) the address is held: another SO_REUSEADDR socket cannot bind it (it
    could while the front's socket only was bound, then listen first and make the
    front's start fail)."""
    r = Reservation("127.0.0.1", "127.0.0.1")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    assert r(port, lambda host: 0) == 0
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        with pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        other.close()
        r.release()


def test_reservation_refuses_a_port_whose_front_address_is_taken() -> None:
    """The front's address is in use → EADDRINUSE without binding the engine's socket (it
    tries another port); the engine's bind failing releases the front's socket."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    r = Reservation("127.0.0.1", "127.0.0.1")
    calls: list[str] = []
    try:
        assert r(port, lambda host: calls.append(host) or 0) == -errno.EADDRINUSE
        assert calls == [] and r.sock is None
    finally:
        taken.close()
    assert r(port, lambda host: -errno.EADDRINUSE) == -errno.EADDRINUSE
    assert r.sock is None
    again = socket.socket()
    again.bind(("127.0.0.1", port))  # the front's socket was released
    again.close()


def test_backend_is_loopback_and_never_the_front_address() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "10.1.2.3", "192.168.0.9"):
        assert backend_host(host) != host
        assert backend_host(host).startswith("127.")
