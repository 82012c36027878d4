"""Room calls through the submission ring (issue 21 step B) between real processes: engine
clients with ``use_ring=True`` against real daemons over Mooncake TCP loopback."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KvdClient, KVPoll, Receiver, Sender, poll_array, poll_many
from kvd.errors import KvdError, KvdUnreachable, RoomError
from kvd.launch import start_daemon
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import PdPair, start_pair, stop_pair

pytestmark = [pytest.mark.integration]

BOUND = 30.0


def until(predicate: Callable[[], object], what: str, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not predicate():
        assert time.monotonic() < deadline, f"not within {bound}s: {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def ring_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    pair = start_pair(tmp_path_factory.mktemp("ring"), engine_opts={"use_ring": True})
    yield pair
    stop_pair(pair)


def test_rooms_move_byte_exact_with_both_engines_on_the_ring(ring_pair: PdPair) -> None:
    """Eight rooms of three chunks each, every call of both engines through its ring:
    every room succeeds on both sides and every page arrives byte for byte."""
    pe, de = ring_pair.p_engine, ring_pair.d_engine
    assert pe.client.ring is not None and de.client.ring is not None
    before = pe.client.ring.sub.tail, de.client.ring.sub.tail
    rooms = list(range(8100, 8108))
    src = {r: [(r * 5 + i) % pe.num_pages for i in range(6)] for r in rooms}
    dst = {r: [(r * 7 + i) % de.num_pages for i in range(6)] for r in rooms}
    pairs = [transfer_room(pe, de, ring_pair.bootstrap, r, src[r], dst[r], chunk=2,
                           aux_src=r % 4, aux_dst=dst[r][0]) for r in rooms]  # own slot (K42)
    assert wait_rooms(de.client, rooms, BOUND) == [KVPoll.Success] * len(rooms)
    assert wait_rooms(pe.client, rooms, BOUND) == [KVPoll.Success] * len(rooms)
    for r in rooms:
        assert de.pages_equal(pe, src[r], dst[r]), f"room {r}"
    # create, init and three sends per prefill room; create and init per decode room
    assert pe.client.ring.sub.tail - before[0] == 5 * len(rooms)
    assert de.client.ring.sub.tail - before[1] == 2 * len(rooms)
    for s, r in pairs:
        assert s.refused is None and r.refused is None
        r.clear()
        s.clear()
    assert [r.poll() for _, r in pairs] == [-1] * len(rooms)


def test_a_refused_send_through_the_ring_fails_the_room_for_the_engine(
        ring_pair: PdPair) -> None:
    """A send kvd refuses (a page beyond the pool) returns at once; the refusal comes back
    in the completion ring: the room reads Failed, names it, and its next send raises."""
    pe = ring_pair.p_engine
    s = Sender(pe.client, 8200)
    s.init(2, 0)
    s.send(np.array([pe.num_pages + 5]), is_last=False)  # no answer waited for
    until(lambda: s.poll() == KVPoll.Failed, "the refusal read back")
    kind, reason = s.failure()
    assert kind and "8200" in reason
    with pytest.raises(KvdError):
        s.send(np.array([1]))
    s.clear()  # the refusal goes with the room
    assert s.refused is None and s.poll() == -1


def test_an_engine_on_the_ring_whose_kvd_died_falls_back_and_registers_again(
        tmp_path: Path) -> None:
    """K27 with the ring: kvd SIGKILLed, the engine's next call that waits on the ring sees
    kvd's end of the socket close (KvdUnreachable, not a timeout); kvd restarted on the
    same socket, the next call reconnects, registers again and gets a fresh ring, and a
    room moves byte for byte through it."""
    pair = start_pair(tmp_path, engine_opts={"use_ring": True})
    try:
        pe = pair.p_engine
        old_ring = pe.client.ring
        assert old_ring is not None
        pair.prefill.kill(signal.SIGKILL)
        pair.prefill.proc.wait(10)
        t = time.monotonic()
        with pytest.raises(KvdUnreachable):  # a create is not waited for: a clear is
            pe.client.submit(rpc.Clear(room=8300), wait=True)
        assert time.monotonic() - t < BOUND / 3
        assert pe.client.ring is None
        pair.prefill = start_daemon("prefill", tmp_path, serve_bootstrap=True,
                                    engine_socket=pair.prefill.socket,
                                    http_port=pair.prefill.ready["http_port"])
        _s, r = transfer_room(pe, pair.d_engine, pair.bootstrap, 8301, [1, 2], [3, 4], chunk=1)
        assert pe.client.reconnects == 1
        assert pe.client.ring is not None and pe.client.ring is not old_ring
        assert r.wait(BOUND) == KVPoll.Success
        assert pair.d_engine.pages_equal(pe, [1, 2], [3, 4])
        assert isinstance(pe, EngineStandIn)
    finally:
        stop_pair(pair)


def test_each_room_reads_its_own_refusal_whatever_other_rooms_hold(
        ring_pair: PdPair) -> None:
    """Refusals of three rooms come back at different times; one room's refusal not yet
    looked at does not hide another's. (Sends to rooms kvd does not know: refused, and
    kvd reads them unknown, so only the refusal says Failed.)"""
    pe = ring_pair.p_engine
    ring = pe.client.ring
    assert ring is not None
    a, b, c = (Sender.attach(pe.client, r) for r in (8400, 8401, 8402))
    a.send(np.array([1]), is_last=False)
    c.send(np.array([1]), is_last=False)
    until(ring.drained, "kvd ran both sends")
    assert a.poll() == KVPoll.Failed  # c's refusal is read with a's and kept for c
    b.send(np.array([1]), is_last=False)
    until(ring.drained, "kvd ran b's send")
    assert b.poll() == KVPoll.Failed  # its refusal is read, though c's is still kept
    assert c.poll() == KVPoll.Failed
    for s in (a, b, c):
        assert f"unknown room {s.room}" in s.failure()[1]
        s.clear()
        assert s.poll() == -1


def test_a_clear_not_waited_for_drops_the_rooms_kept_refusal_once_kvd_ran_it(
        ring_pair: PdPair) -> None:
    """A room reading Failed by a refusal nobody waited for (a send to a room kvd does not
    know), then a Clear of it through the ring, not waited for: once kvd ran the clear
    the room reads unknown (-1), not Failed, and a later room of the id starts clean."""
    pe = ring_pair.p_engine
    ring = pe.client.ring
    assert ring is not None
    room = 8410
    Sender.attach(pe.client, room).send(np.array([1]), is_last=False)
    until(ring.drained, "kvd ran the send")
    ids = np.array([room], dtype=np.uint64)
    assert poll_array(pe.client, ids).tolist() == [int(KVPoll.Failed)]
    pe.client.submit(rpc.Clear(room=room))  # not waited for
    until(ring.drained, "kvd ran the clear")
    assert poll_array(pe.client, ids).tolist() == [-1]
    assert pe.client.room_refusal(room) is None


class CountingRoundtrips:
    """Counts the socket round trips of one client, by call type."""

    def __init__(self, client: KvdClient, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        real = client._roundtrip

        def counted(call: rpc.Call, *args: object, **kw: object) -> object:
            self.calls.append(type(call).__name__)
            return real(call, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(client, "_roundtrip", counted)


def _prefill_batch(rooms: list[int], pages: dict[int, list[int]]) -> list[rpc.RingCall]:
    calls: list[rpc.RingCall] = [rpc.SenderCreate(room=r) for r in rooms]
    for r in rooms:
        calls += [rpc.SenderInit(room=r, num_pages=len(pages[r]), aux_index=0),
                  rpc.SenderSend(room=r, pages=pack_indices(pages[r]), is_last=True)]
    return calls


@pytest.mark.parametrize("path", ["ring", "many"])
def test_submit_all_runs_a_step_of_room_calls_in_one_wait_and_names_each_refusal(
        ring_pair: PdPair, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Issue 21 item 3: a step's room calls of 6 rooms (create, init, send each) through
    ``submit_all``: no socket round trip through the ring (18 records, one wait), ONE
    ``Many`` without it. A room whose send names a page beyond the pool is refused, and
    only that room; the others move byte for byte."""
    pe, de = ring_pair.p_engine, ring_pair.d_engine
    base = 8600 if path == "ring" else 8700
    rooms = list(range(base, base + 6))
    bad = rooms[2]
    src = {r: [(r * 3 + i) % pe.num_pages for i in range(3)] for r in rooms}
    src[bad] = [1, pe.num_pages + 7, 2]
    dst = {r: [(r * 5 + i) % de.num_pages for i in range(3)] for r in rooms}
    recv_calls: list[rpc.RingCall] = [rpc.ReceiverCreate(room=r, bootstrap_addr=ring_pair.
                                                         bootstrap) for r in rooms]
    recv_calls += [rpc.ReceiverInit(room=r, dst_pages=pack_indices(dst[r]),
                                   aux_index=dst[r][0]) for r in rooms]  # own slot (K42)
    if path == "many":
        monkeypatch.setattr(pe.client, "_usable_ring", lambda: None)
    counted = CountingRoundtrips(pe.client, monkeypatch)
    assert pe.client.ring is not None
    tail = pe.client.ring.sub.tail
    assert de.client.submit_all(recv_calls) == {}
    refused = pe.client.submit_all(_prefill_batch(rooms, src))
    assert list(refused) == [bad] and isinstance(refused[bad], KvdError)
    if path == "ring":
        assert counted.calls == [] and pe.client.ring.sub.tail - tail == 3 * len(rooms)
    else:
        assert counted.calls == ["Many"] and pe.client.ring.sub.tail == tail
    good = [r for r in rooms if r != bad]
    assert wait_rooms(de.client, good, BOUND) == [KVPoll.Success] * len(good)
    for r in good:
        assert de.pages_equal(pe, src[r], dst[r]), f"room {r}"
    assert pe.client.submit_all([rpc.Abort(room=bad, reason="test")]) == {}
    clears: list[rpc.RingCall] = [rpc.Clear(room=r) for r in rooms]
    assert pe.client.submit_all(clears) == {}
    wait_rooms(de.client, rooms, BOUND)
    assert de.client.submit_all(clears) == {}


def _step_outcomes(client: KvdClient, rooms: list[int], wait: bool,
                   calls: list[rpc.RingCall]) -> tuple[set[int], np.ndarray]:
    """One step of ``calls`` through ``submit_all(calls, wait)``: the rooms whose refusal
    the engine learns at the step's end (returned when waited; read Failed through
    ``poll_array`` once kvd ran them when not) and the rooms' ``poll_array`` then."""
    ring = client.ring
    assert ring is not None
    refused = client.submit_all(calls, wait=wait)
    if not wait:
        assert refused == {}  # returned at once: the refusals come back per room
        until(ring.drained, "kvd ran the step")
    states = poll_array(client, np.array(rooms, dtype=np.uint64))
    learned = set(refused) if wait else {r for r, s in zip(rooms, states, strict=True)
                                         if s == KVPoll.Failed}
    return learned, states


@pytest.mark.parametrize("wait", [True, False])
def test_a_step_not_waited_for_reads_as_the_waited_step_through_poll_array(
        ring_pair: PdPair, wait: bool) -> None:
    """P9: a step's calls through ``submit_all(calls, wait=False)`` return at once (no
    wait); what the engine learns through ``poll_array`` after the step is what the waited
    step tells it. A decode step of 5 rooms in which one init names the aux slot another
    live room holds (K42: refused): that room, and only it, is refused in the waited form
    and reads Failed at the next poll in the unwaited one; the other rooms move byte for
    byte. The step's clears drop every kept refusal: every room then reads unknown (-1),
    and a new room of the refused room's id starts clean."""
    pe, de = ring_pair.p_engine, ring_pair.d_engine
    base = 8900 if wait else 8950
    rooms = list(range(base, base + 5))
    bad = rooms[3]
    src = {r: [(r * 3 + i) % pe.num_pages for i in range(2)] for r in rooms}
    dst = {r: [(base * 2 + 2 * i + j) % de.num_pages for j in range(2)]
           for i, r in enumerate(rooms)}
    aux = {r: dst[r][0] for r in rooms}
    aux[bad] = aux[rooms[0]]  # held by a live room (K42)
    recv: list[rpc.RingCall] = [rpc.ReceiverCreate(room=r, bootstrap_addr=ring_pair.bootstrap)
                                for r in rooms]
    recv += [rpc.ReceiverInit(room=r, dst_pages=pack_indices(dst[r]), aux_index=aux[r])
             for r in rooms]
    learned, _ = _step_outcomes(de.client, rooms, wait, recv)
    assert learned == {bad}
    good = [r for r in rooms if r != bad]
    sent, _ = _step_outcomes(pe.client, good, wait, _prefill_batch(good, src))
    assert sent == set()
    # the engine reads the rooms it knows live: in the waited form not the refused one
    seen = rooms if not wait else good
    until(lambda: all(s in (KVPoll.Success, KVPoll.Failed) for s in
                      poll_array(de.client, np.array(seen, dtype=np.uint64))),
          "the decode's rooms ended")
    states = poll_array(de.client, np.array(seen, dtype=np.uint64))
    assert states.tolist() == [int(KVPoll.Failed if r == bad else KVPoll.Success)
                               for r in seen]
    assert wait_rooms(pe.client, good, BOUND) == [KVPoll.Success] * len(good)
    for r in good:
        assert de.pages_equal(pe, src[r], dst[r]), f"room {r}"
    for client in (de.client, pe.client):  # the step's clears of the rooms that ended
        ring = client.ring
        assert ring is not None
        assert client.submit_all([rpc.Clear(room=r) for r in good], wait=wait) == {}
        until(ring.drained, "kvd ran the clears")
        assert poll_array(client, np.array(good, dtype=np.uint64)).tolist() == \
            [-1] * len(good)

    def clear_bad() -> bool:  # cleared again each step until kvd took it (K06)
        de.client.submit_all([rpc.Clear(room=bad)], wait=wait)
        until(de.client.ring.drained, "kvd ran the clear")  # type: ignore[union-attr]
        return bool(poll_array(de.client, np.array([bad], dtype=np.uint64))[0] == -1)

    until(clear_bad, "the refused room cleared")
    assert de.client.room_refusal(bad) is None and not de.client.ring_refused(
        np.array([bad], dtype=np.uint64))
    # a new room of the refused room's id starts clean
    learned, states = _step_outcomes(de.client, [bad], wait, [
        rpc.ReceiverCreate(room=bad, bootstrap_addr=ring_pair.bootstrap),
        rpc.ReceiverInit(room=bad, dst_pages=pack_indices(dst[bad]), aux_index=dst[bad][0])])
    assert learned == set() and states.tolist() != [int(KVPoll.Failed)]
    de.client.submit(rpc.Abort(room=bad, reason="test"), wait=True)

    def cleared() -> bool:
        try:
            de.client.submit(rpc.Clear(room=bad), wait=True)
        except RoomError:
            return False
        return True

    until(cleared, "the aborted room releasable and cleared")
    assert poll_array(de.client, np.array([bad], dtype=np.uint64)).tolist() == [-1]


def test_a_duplicate_create_through_the_ring_is_refused_at_the_next_call_and_harms_nobody(
        ring_pair: PdPair) -> None:
    """A create through the ring is not waited for (``Sender(...)`` and ``Receiver(...)``
    return once the record is in the ring). A duplicate of a live room is refused later:
    the duplicate's handle reads Failed naming the refusal (its wait and poll never read
    the live room's status), its next init raises it, and its abort and clear are never
    run -- the live room, created through the same client, moves byte for byte (over the
    socket the duplicate's constructor raised instead)."""
    pe, de = ring_pair.p_engine, ring_pair.d_engine
    room = 8800
    recv = Receiver(de.client, room, ring_pair.bootstrap)
    recv.init([5, 6], 5)
    live = Sender(pe.client, room)
    live.init(2, 1)
    dup_s = Sender(pe.client, room)  # returns: the refusal comes back later
    dup_r = Receiver(de.client, room, ring_pair.bootstrap)
    for dup in (dup_s, dup_r):
        t = time.monotonic()  # not the live room's wait: that room waits for its send
        assert dup.wait(BOUND) == KVPoll.Failed and time.monotonic() - t < BOUND / 2
        assert dup.poll() == KVPoll.Failed and dup.releasable()
        assert "already active" in dup.failure()[1]
        with pytest.raises(RoomError, match="already active"):
            dup.init([1], 0) if dup is dup_r else dup.init(1, 0)
        dup.abort("the duplicate's")
        dup.clear()
    assert live.poll() != KVPoll.Failed and recv.poll() != KVPoll.Failed
    live.send(np.array([1, 2]))
    assert recv.wait(BOUND) == KVPoll.Success and live.wait(BOUND) == KVPoll.Success
    assert de.pages_equal(pe, [1, 2], [5, 6])
    assert live.refused is None and recv.refused is None
    recv.clear()
    live.clear()
    assert live.poll() == -1 and recv.poll() == -1


def test_handles_of_rooms_cleared_elsewhere_leave_what_the_ring_keeps_bounded(
        ring_pair: PdPair) -> None:
    """Rooms created through their handle and ended by other means (a step's batch, a
    handle from ``attach``): what the engine's ring keeps per handle stays bounded by its
    capacity, not by the rooms it ever carried."""
    pe = ring_pair.p_engine
    ring = pe.client.ring
    assert ring is not None
    cap = ring.sub.capacity
    for room in range(9000, 9000 + 3 * cap):
        s = Sender(pe.client, room)
        s.init(1, 0)
        assert pe.client.submit_all([rpc.Abort(room=room, reason="test"),
                                     rpc.Clear(room=room)]) == {}
    assert len(ring.last) <= 2 * cap and len(ring.inflight) <= cap


def test_a_socket_call_reads_the_completions_first_so_kvd_runs_every_record_before_it(
        ring_pair: PdPair) -> None:
    """The engine made ring calls kvd ran and refused (the completion ring full, not read
    yet) and one more kvd has not run, then a socket call: the client reads the
    completions before it, so kvd runs the last record first -- in order, the ring kept --
    instead of meeting a full completion ring it cannot wait out (it would fail the
    ring). Records are pushed here below ``submit``: the state a submit racing kvd's
    drain can leave."""
    client = ring_pair.p_engine.client
    ring = client.ring
    assert ring is not None
    cap = ring.comp.capacity
    rooms = list(range(8300, 8300 + cap))

    def publish(call: rpc.RingCall) -> None:
        with client._lock:
            data = ring.encode(call)
            assert data is not None
            seq = ring.out.push(data)
            assert seq is not None
            ring.inflight[seq] = call.room

    for r in rooms:  # unknown rooms: each init refused
        publish(rpc.SenderInit(room=r, num_pages=1, aux_index=0))
    os.eventfd_write(ring.wake_kvd, 1)
    until(lambda: ring.sub.tail == ring.out.head, "kvd ran them")
    assert ring.comp.head - ring.inbox.tail == cap  # the completion ring is full
    publish(rpc.SenderCreate(room=8299))  # kvd sleeps: not run yet
    assert client.call(rpc.Poll(rooms=[8299])).statuses == [KVPoll.Bootstrapping]
    assert client.ring is ring and not ring.sub.closed and ring.drained()
    assert all(isinstance(client.ring_refusal(r), KvdError) for r in rooms)
    client.call(rpc.Clear(room=8299))


def test_a_ring_refusal_outlives_a_dropped_connection_within_the_grace(
        ring_pair: PdPair) -> None:
    """Room 8401's init names the aux slot live room 8400 holds (K42): kvd refuses it, the
    refusal waits in the completion ring unread, and the engine's connection drops. The
    client reads it before dropping the ring and keeps it: after the reconnect (kvd kept
    the rooms, K27) 8401 still reads Failed naming the refusal -- kvd never ran its init,
    so kvd's own status would leave the engine waiting -- and 8400 is untouched."""
    d = ring_pair.d_engine.client
    ring = d.ring
    assert ring is not None
    a = Receiver(d, 8400, ring_pair.bootstrap)
    a.init([1, 2], aux_index=7)
    b = Receiver(d, 8401, ring_pair.bootstrap)
    b.init([5, 6], aux_index=7)  # refused by kvd; the ring does not wait
    until(ring.drained, "kvd ran both inits")
    reconnects = d.reconnects
    with d._lock:
        d._drop()  # the connection drops before the engine read the completion
    assert d.call(rpc.Poll(rooms=[8400])).statuses[0] != KVPoll.Failed
    assert d.reconnects == reconnects + 1 and d.ring is not None and d.ring is not ring
    assert poll_many(d, [8400, 8401]) == [poll_many(d, [8400])[0], KVPoll.Failed]
    assert b.poll() == KVPoll.Failed and "aux slot 7" in b.failure()[1]
    b.clear()
    a.clear()
    assert poll_many(d, [8400, 8401]) == [-1, -1]
