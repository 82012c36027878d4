"""A review of the engine ring (issue 21) between real processes: engine clients with
``use_ring=True`` (and without) against real daemons over Mooncake TCP loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvd.client import KvdClient, KVPoll, Receiver, Sender
from kvd.errors import ProtocolError, RoomError
from kvd.launch import start_daemon
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import StandInPool
from tests.conftest import PdPair, start_pair, stop_pair

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def ring_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    pair = start_pair(tmp_path_factory.mktemp("ring-review"), engine_opts={"use_ring": True})
    yield pair
    stop_pair(pair)


def _rooms(client: KvdClient) -> int:
    return int(client.call(rpc.Info())["tables"]["rooms"])


def _ways(client: KvdClient) -> list[Callable[[Any], object]]:
    """Every way a room call leaves the engine's client."""
    return [client.call, client.submit, lambda c: client.submit(c, wait=True),
            lambda c: client.submit_all([rpc.Clear(room=424242), c]),
            lambda c: client.submit_all([rpc.Clear(room=424242), c], wait=False),
            lambda c: client.call_many([c])]


def test_a_room_call_past_its_wire_bounds_raises_value_error_and_sends_nothing(
        ring_pair: PdPair) -> None:
    """A room id below 0 (or past 2**64) or an index past int64 in a room call: before,
    kvd took ``SenderCreate(room=-1)``, made the room, and answered "internal error"
    (through the ring and the socket alike; the room then sat in kvd, no Poll able to
    name it), and ``ReceiverInit(state_index=2**63)`` failed inside the receiver machine.
    Now every way a call leaves the client raises ValueError naming the field and sends
    nothing (through the ring a record kvd cannot decode would fail the channel and abort
    every room it carried); a frame that bypasses the check gets a ProtocolError from kvd,
    and no room is made."""
    p, d = ring_pair.p_engine.client, ring_pair.d_engine.client
    boot = ring_pair.bootstrap
    bad = {p: [rpc.SenderCreate(room=-1), rpc.SenderCreate(room=2**64),
               rpc.SenderInit(room=7, num_pages=2**63, aux_index=0), rpc.Abort(room=-3)],
           d: [rpc.ReceiverCreate(room=-1, bootstrap_addr=boot),
               rpc.ReceiverInit(room=7, dst_pages=pack_indices([1]), aux_index=0,
                                state_index=2**63),
               rpc.ReceiverCreate(room=7, bootstrap_addr=boot, dp_rank=2**64 - 1)]}
    for client, calls in bad.items():
        ring = client.ring
        assert ring is not None
        head, rooms = ring.out.head, _rooms(client)
        for call in calls:
            for way in _ways(client):
                with pytest.raises(ValueError, match=rf"{type(call).__name__}\.\w+ must be"):
                    way(call)
        assert client.ring is ring and not ring.sub.closed and ring.out.head == head
        with pytest.raises(ProtocolError, match="malformed frame"):
            client._roundtrip(calls[0], None)  # past the client's check: kvd's decoder
        assert _rooms(client) == rooms
    r = Receiver(d, 9100, boot)
    with pytest.raises(ValueError, match="state_index"):
        r.init([1], aux_index=0, state_index=2**63)
    r.init([1], aux_index=0)  # the room is untouched by the refused call
    assert r.poll() in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
    r.clear()
    with pytest.raises(ValueError, match="num_pages"):
        Sender(p, 9100).init(2**64, 0)
    Sender.attach(p, 9100).clear()


def test_a_ring_call_does_not_wait_for_another_threads_wait_on_the_socket(
        ring_pair: PdPair) -> None:
    """One client, two threads: thread A waits (one chunk) for a room that does not end;
    thread B makes a room and inits it through the ring without waiting. B's calls are
    records in shared memory: they return while A still waits (a second connection then
    aborts A's room, which ends its wait)."""
    client = ring_pair.p_engine.client
    assert client.ring is not None
    a = Sender(client, 9200)
    a.wait_created()
    waiter = threading.Thread(target=lambda: client.wait([9200], 10.0))
    waiter.start()
    try:
        deadline = time.monotonic() + 10
        while not client._lock.locked():  # A is inside its Wait
            assert time.monotonic() < deadline and waiter.is_alive()
            time.sleep(0.001)
        b = Sender(client, 9201)
        b.init(1, 0)
        assert waiter.is_alive(), "B's ring calls waited for A's Wait to end"
    finally:
        other = KvdClient(ring_pair.prefill.socket)
        Sender.attach(other, 9200).abort("test over")
        waiter.join(30)
        other.close()
    for room in (9200, 9201):
        Sender.attach(client, room).clear()


_DYING_ENGINE = """
import os, signal, sys
import msgspec
from kvd.client import KvdClient
from kvd.protocol import codec, rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import StandInPool
pool = StandInPool(seed=1)
client = KvdClient(sys.argv[1], use_ring=True)
client.call(msgspec.structs.replace(pool.registration, engine_id="dying"))
ring = client.ring
assert ring is not None
calls = []
for room in range(500, 510):
    calls += [rpc.SenderCreate(room=room), rpc.SenderInit(room=room, num_pages=1, aux_index=0)]
calls.append(rpc.SenderInit(room=505, num_pages=10**6, aux_index=0))  # refused: nobody reads it
client.submit_all(calls, wait=False)
half = codec.encode(rpc.Request(id=ring.out.head, call=rpc.SenderCreate(room=999)))
ring.sub.write_record(ring.out.head, half)  # the record written, head never published
print("published", ring.out.head, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_k27_an_engine_killed_mid_step_leaves_its_published_records_run_and_its_half_record_not(
        tmp_path: Path) -> None:
    """A real engine process on the ring publishes a step (ten rooms' creates and inits,
    and an init kvd refuses), writes one more record without publishing it, and is
    SIGKILLed. kvd runs what was published -- the ten rooms live on for the reconnect
    grace (K27), the refused init fails its room since nobody can read the refusal --
    and never the half-written record."""
    pair = start_pair(tmp_path, p_opts={"engine_reconnect_grace": 30.0})
    try:
        pair.p_engine.close()  # the engine socket is the dying engine's
        out = subprocess.run([sys.executable, "-c", _DYING_ENGINE, pair.prefill.socket],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
        assert "published 21" in out.stdout
        probe = KvdClient(pair.prefill.socket)
        rooms = list(range(500, 510))
        deadline = time.monotonic() + 30
        while True:
            polled = probe.call(rpc.Poll(rooms=[*rooms, 999]))
            if polled.statuses[5] == KVPoll.Failed:
                break
            assert time.monotonic() < deadline, polled
            time.sleep(0.02)
        assert polled.statuses == [KVPoll.Bootstrapping] * 5 + [KVPoll.Failed] + \
            [KVPoll.Bootstrapping] * 4 + [-1]
        assert "the engine's SenderInit was refused" in polled.reasons[505]  # before or after
        probe.close()
    finally:
        stop_pair(pair)


def test_a_duplicate_creates_call_that_goes_over_the_socket_never_acts_on_the_live_room(
        tmp_path: Path) -> None:
    """Room 9 lives (object ``a``); ``b`` is a duplicate whose create kvd refuses. A call
    of ``b`` that cannot go through the ring -- a send of 150 pages, past a 512-byte
    record -- went over the socket with no dependency on ``b``'s create: kvd ran it on
    ``a``'s room (its pages became a's, and a's own send then failed the room: "source
    page 0 is named twice"). Now the client waits for ``b``'s create first and raises its
    refusal; nothing is sent and ``a``'s room is untouched."""
    d = start_daemon("prefill", tmp_path, serve_bootstrap=True)
    pool = StandInPool(seed=1, num_pages=512)
    client = KvdClient(d.socket, use_ring=True, ring_record_bytes=rpc.MIN_RING_RECORD)
    try:
        client.call(pool.registration)
        assert client.ring is not None
        a = Sender(client, 9)
        a.wait_created()
        a.init(300, 0)
        b = Sender(client, 9)  # kvd refuses this create; b's calls depend on it
        with pytest.raises(RoomError, match="already active"):
            b.send(list(range(150)), is_last=False)  # past a record: over the socket
        assert b.poll() == KVPoll.Failed and "already active" in b.failure()[1]
        a.send(list(range(300)), is_last=True)  # a's room never saw b's pages
        assert a.poll() != KVPoll.Failed, a.failure()
        b.clear()
        a.clear()
    finally:
        client.close()
        pool.close()
        d.stop()


def test_a_duplicate_creates_call_while_kvd_is_silent_never_acts_on_the_live_room(
        ring_pair: PdPair) -> None:
    """The same through the other socket fallback: kvd stopped (SIGSTOP) right after a
    duplicate create went into the ring, its status table stale, so the duplicate's init
    goes by the socket. Before, kvd (resumed) ran the refused create, then the init on the
    live room, and the live room's own init was refused ("init called twice")."""
    client = ring_pair.p_engine.client
    pid = ring_pair.prefill.proc.pid
    a = Sender(client, 9300)
    a.wait_created()
    os.kill(pid, signal.SIGSTOP)
    try:
        b = Sender(client, 9300)  # published while the table is still fresh
        deadline = time.monotonic() + 30
        while client._usable_ring() is not None:  # the table goes stale within a second
            assert time.monotonic() < deadline
            time.sleep(0.01)

        def resume() -> None:  # once b's init waits (holding the client's lock)
            end = time.monotonic() + 30
            while not client._lock.locked() and time.monotonic() < end:
                time.sleep(0.001)
            time.sleep(0.05)
            os.kill(pid, signal.SIGCONT)

        waker = threading.Thread(target=resume)
        waker.start()
        with pytest.raises(RoomError, match="already active"):
            b.init(1, 0)
        waker.join()
    finally:
        os.kill(pid, signal.SIGCONT)
    a.init(2, 0)  # the live room's own init: its first
    assert a.poll() != KVPoll.Failed, a.failure()
    b.clear()
    a.clear()
