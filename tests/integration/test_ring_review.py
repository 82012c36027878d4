"""A review of the engine ring (issue 21) between real processes: engine clients with
``use_ring=True`` (and without) against real daemons over Mooncake TCP loopback."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvd.client import KvdClient, KVPoll, Receiver, Sender, poll_array, poll_many, wait_many
from kvd.errors import KvdUnreachable, ProtocolError, RoomError
from kvd.launch import DaemonProcess, start_daemon
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


@pytest.fixture
def own_kvd(tmp_path: Path) -> Iterator[tuple[DaemonProcess, StandInPool]]:
    """A prefill daemon of the test's own (it may be stopped) and a pool to register."""
    d = start_daemon("prefill", tmp_path, serve_bootstrap=True)
    pool = StandInPool(seed=1)
    try:
        yield d, pool
    finally:
        pool.close()
        d.stop()


def _ring_client(d: DaemonProcess, pool: StandInPool, **opts: Any) -> KvdClient:
    """A client on the ring whose status table never reads stale (``stale_ns``): ring
    calls stay on the ring however busy the machine is."""
    client = KvdClient(d.socket, use_ring=True, stale_ns=10**15, **opts)
    client.call(pool.registration)
    assert client.ring is not None
    return client


def test_ring_and_socket_calls_of_several_threads_keep_the_ordering_rule(
        own_kvd: tuple[DaemonProcess, StandInPool]) -> None:
    """One client of an 8-record ring, three threads at once: C makes rooms through the
    ring without waiting and hands each id to B once its call returned; B polls each
    over the socket -- it must find the room made (a socket call runs after every
    ring call that returned before it began, in any thread: kvd's catch-up) -- and makes
    and polls rooms of its own the same way; R floods the ring with calls kvd refuses
    (a completion each). kvd's catch-up before each of B's socket calls cannot wait for a
    completion to be read: the ring must survive (unread completions plus unrun records
    stay within capacity), and every refusal reaches its room."""
    d, pool = own_kvd
    client = _ring_client(d, pool, ring_capacity=8)
    ring = client.ring
    made: queue.Queue[int | None] = queue.Queue()
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                made.put(None)
        return run

    def maker() -> None:  # C
        for room in range(6000, 6100):
            client.submit(rpc.SenderCreate(room=room))
            made.put(room)
        made.put(None)

    refused_rooms = range(7000, 7016)

    def refuser() -> None:  # R: an init of a room nobody made is refused
        n = 0
        while not stop.is_set():
            client.submit(rpc.SenderInit(room=refused_rooms[n % 16], num_pages=1, aux_index=0))
            n += 1

    threads = [threading.Thread(target=guarded(maker)),
               threading.Thread(target=guarded(refuser))]
    for t in threads:
        t.start()
    seen: list[int] = []
    try:
        own = 8000
        while (room := made.get(timeout=60)) is not None:
            polled = client.call(rpc.Poll(rooms=[room]))
            assert polled.statuses == [KVPoll.Bootstrapping], (room, polled)
            seen.append(room)
            client.submit(rpc.SenderCreate(room=own))  # B's own: ring, then socket
            assert client.call(rpc.Poll(rooms=[own])).statuses == [KVPoll.Bootstrapping]
            own += 1
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert seen == list(range(6000, 6100))
    assert client.ring is ring and not ring.sub.closed, "a catch-up met a full completion ring"
    assert client.call(rpc.Info())["tables"]["rooms"] >= 200
    client.submit_all([rpc.Clear(room=r) for r in [*range(6000, 6100), *range(8000, own)]])
    refused = client.ring_refused(np.asarray(refused_rooms, dtype=np.uint64))
    assert refused is not None and refused.all()  # every refusal reached its room
    client.close()


def test_interrupt_during_a_ring_wait_names_the_interrupt(
        own_kvd: tuple[DaemonProcess, StandInPool]) -> None:
    """A waited ring call while kvd is stopped (SIGSTOP): another thread's
    ``interrupt()`` ends it. Before, the call raised "kvd closed the engine socket" (the
    ring's wait sees the socket end close, as at kvd's death); now it names the
    interrupt. The next call reconnects."""
    d, pool = own_kvd
    client = _ring_client(d, pool)
    ring = client.ring
    assert ring is not None
    errors: list[KvdUnreachable] = []

    def waited() -> None:
        try:
            client.submit(rpc.SenderCreate(room=41), wait=True)
        except KvdUnreachable as exc:
            errors.append(exc)

    d.proc.send_signal(signal.SIGSTOP)
    try:
        t = threading.Thread(target=waited)
        t.start()
        deadline = time.monotonic() + 30
        while not ring.comp.sleeping:  # the call waits on the ring for kvd
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.001)
        client.interrupt()
        t.join(30)
        assert not t.is_alive() and len(errors) == 1
    finally:
        d.proc.send_signal(signal.SIGCONT)
    message = str(errors[0])
    assert "interrupt" in message and "closed the engine socket" not in message, message
    assert client.call(rpc.Poll(rooms=[41])).statuses[0] in (
        KVPoll.Bootstrapping, -1)  # reconnected (kvd ran the published create, or not yet)
    client.close()


@pytest.mark.parametrize("use_ring", [False, True])
def test_a_closed_clients_room_objects_read_failed_naming_the_close(
        own_kvd: tuple[DaemonProcess, StandInPool], use_ring: bool) -> None:
    """``close()`` says goodbye: kvd fails the engine's rooms and forgets them. Before, a
    room object made before read UNKNOWN_ROOM (-1) and ``failure()`` said "room is not
    failed" (over the socket and the ring alike). Now it reads Failed for good, naming
    the close (a new epoch, as after a kvd restart, K27). Reads by raw id on the closed
    client raise KvdUnreachable naming the close (``call``, ``wait``) or read Failed
    (the poll helpers); a room call reopens the client, and a new room of the same id
    lives in the new epoch while the old object stays Failed."""
    d, pool = own_kvd
    if use_ring:
        client = _ring_client(d, pool)
    else:
        client = KvdClient(d.socket)
        client.call(pool.registration)
    s = Sender(client, 31)
    s.wait_created()
    s.init(1, 0)
    assert s.poll() == KVPoll.Bootstrapping
    probe = KvdClient(d.socket)
    client.close()
    assert probe.call(rpc.Poll(rooms=[31])).statuses[0] in (KVPoll.Failed, -1)  # kvd's side
    assert s.poll() == KVPoll.Failed
    kind, reason = s.failure()
    assert kind == "aborted" and "room 31" in reason and "KvdClient.close()" in reason, reason
    assert s.wait(1.0) == KVPoll.Failed and s.releasable()
    with pytest.raises(KvdUnreachable, match=r"kvd client closed: .*KvdClient\.close\(\)"):
        client.call(rpc.Poll(rooms=[31]))
    with pytest.raises(KvdUnreachable, match="kvd client closed"):
        client.wait([31], 1.0)
    with pytest.raises(KvdUnreachable, match="kvd client closed"):
        client.call_many([rpc.Poll(rooms=[31])])
    assert poll_many(client, [31]) == [KVPoll.Failed]
    assert poll_array(client, [31]).tolist() == [int(KVPoll.Failed)]
    assert wait_many(client, [31], 1.0) == [KVPoll.Failed]
    again = Sender(client, 31)  # a room call reopens the client: it registers again
    again.wait_created()
    assert again.poll() == KVPoll.Bootstrapping and s.poll() == KVPoll.Failed
    assert client.call(rpc.Poll(rooms=[31])).statuses == [KVPoll.Bootstrapping]
    assert (client.ring is not None) == use_ring
    again.clear()
    client.close()
    probe.close()


def test_a_refusal_taken_while_another_thread_reads_a_clear_before_it_stays_kept(
        own_kvd: tuple[DaemonProcess, StandInPool], monkeypatch: pytest.MonkeyPatch) -> None:
    """Room 9100: a Clear, then an init kvd refuses (no such room), both through the ring
    without waiting. Thread A takes the room's refusal (``ring_refusal``) just as thread B
    reads the completions (here B's read is placed, deterministically, between A's look
    at the ring and A's taking of the lock). Before, A kept the init's refusal and the
    next read of the room dropped it as belonging to the Clear before it: the room read
    unknown, not Failed, though its init never ran. Now the room reads Failed until it is
    cleared again."""
    d, pool = own_kvd
    client = _ring_client(d, pool)
    ring = client.ring
    assert ring is not None
    room = 9100
    real = client._collected
    raced: list[bool] = []

    def collected_then_raced() -> Any:
        got = real()
        if not raced:  # thread B, in the window: kvd runs the records, B reads them
            raced.append(True)
            d.proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 60
            while ring.comp.head == ring.inbox.tail:
                assert time.monotonic() < deadline, "kvd never answered the init"
                time.sleep(0.001)
            with client._ring_lock:
                ring.collect()
        return got

    d.proc.send_signal(signal.SIGSTOP)  # the records wait unrun: A looks before kvd ran them
    try:
        client.submit(rpc.Clear(room=room))
        client.submit(rpc.SenderInit(room=room, num_pages=1, aux_index=0))
        monkeypatch.setattr(client, "_collected", collected_then_raced)
        taken = client.ring_refusal(room)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    monkeypatch.setattr(client, "_collected", real)
    assert raced and isinstance(taken, RoomError), taken
    assert client.room_refusal(room) is taken  # kept until the room is cleared again
    assert poll_array(client, [room]).tolist() == [int(KVPoll.Failed)]
    client.call(rpc.Clear(room=room))
    assert client.room_refusal(room) is None
    client.close()


@pytest.mark.parametrize("ran", [True, False])
def test_a_room_cleared_unwaited_before_a_drop_starts_clean_after_the_reconnect(
        own_kvd: tuple[DaemonProcess, StandInPool], ran: bool) -> None:
    """Room 9200 reads Failed by a refusal nobody waited for; a Clear of it goes through
    the ring, not waited for, and the connection drops (``ran``: after kvd ran the Clear,
    its completions unread; or before, kvd stopped: the Clear runs after the drop, K41).
    The engine reconnects within the grace and makes room 9200 again. Before, the client
    kept the old refusal across the drop (the ring that knew the Clear was gone) and the
    new room read Failed; now it reads as kvd says."""
    d, pool = own_kvd
    client = _ring_client(d, pool)
    ring = client.ring
    assert ring is not None
    room = 9200
    client.submit(rpc.SenderInit(room=room, num_pages=1, aux_index=0))  # no such room
    _until(ring.drained)
    assert poll_array(client, [room]).tolist() == [int(KVPoll.Failed)]
    assert isinstance(client.ring_refusal(room), RoomError)  # taken (a room's failure())
    if not ran:
        d.proc.send_signal(signal.SIGSTOP)
    try:
        client.submit(rpc.Clear(room=room))  # not waited for
        if ran:
            _until(ring.drained)
        with client._lock:  # the connection drops (an interrupt with no call in
            client._drop()  # flight ends nothing): the next call reconnects
    finally:
        if not ran:
            d.proc.send_signal(signal.SIGCONT)
    again = Sender(client, room)  # reconnects and registers again (same engine: K27)
    again.wait_created()
    assert client.room_refusal(room) is None
    assert poll_array(client, [room]).tolist() == [int(KVPoll.Bootstrapping)]
    assert again.poll() == KVPoll.Bootstrapping, again.failure()
    again.clear()
    client.close()


def _until(predicate: Callable[[], object], bound: float = 60.0) -> None:
    deadline = time.monotonic() + bound
    while not predicate():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.001)
