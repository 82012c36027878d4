"""K41: a record the engine published into a dropped connection's ring after kvd read
that ring's ``head`` never runs (kvd runs the dropped ring up to the head it read, then
closes it). The client knows every record it published; once the old ring's ``tail`` is
final -- kvd closed the ring, or answered the engine's next registration (it runs the
dropped ring's records first) -- each record past it keeps a refusal for its room, so the
room reads Failed on every read path until the room is cleared.

The engine's real :class:`~kvd.client.ring.EngineRing` and :class:`~kvd.client.KvdClient`
over memory; "kvd" runs records by publishing ``tail`` and closes the ring."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.client import KvdClient
from kvd.client.ring import NEW, EngineRing
from kvd.errors import KvdUnreachable
from kvd.protocol import rpc
from kvd.protocol.ring import Consumer, Ring, ring_bytes

CAPACITY, RECORD = 16, 512


class Model:
    """A client with a live ring, and kvd's consuming end of it (in this thread)."""

    def __init__(self) -> None:
        half = ring_bytes(CAPACITY, RECORD)
        fd = os.memfd_create("test-ring")
        os.ftruncate(fd, 2 * half)
        self.map = mmap.mmap(fd, 2 * half)
        view = memoryview(self.map)
        self.sub = Ring.create(view[:half], CAPACITY, RECORD)
        Ring.create(view[half:], CAPACITY, RECORD)
        del view
        self.inbox = Consumer(self.sub)
        self.sock, self.peer = socket.socketpair()
        fds = [fd, os.eventfd(0), os.eventfd(0)]
        self.ring = EngineRing(rpc.RingResult(capacity=CAPACITY, record_bytes=RECORD,
                                              size=2 * half), fds, self.sock.fileno())
        self.client = KvdClient("/nonexistent/kvd.sock", use_ring=True,
                                ring_capacity=CAPACITY, ring_record_bytes=RECORD)
        self.client.ring = self.ring
        self.rooms: list[int] = []  # the room of each published record, by call id

    def publish(self, call: rpc.RingCall, key: int | None = None) -> int:
        data = self.ring.encode(call)
        assert data is not None
        seq = self.ring.submit(data, call.room, 1.0, key)
        self.rooms.append(call.room)
        return seq

    def run(self, n: int) -> None:
        """kvd runs ``n`` records (publishes ``tail`` past them)."""
        for _ in range(n):
            assert self.inbox.peek() is not None
            self.inbox.done()

    def drop(self) -> None:
        """The engine notices its connection dropped (as ``KvdClient._drop``)."""
        self.client._close_ring(keep=True)

    def registered(self, instance: str = "kvd-1") -> None:
        """kvd answered the engine's next registration (its Backlog ran the old ring)."""
        self.client._served_by(rpc.RegisterResult(num_pages=1, num_aux_slots=0,
                                                  session_id="s", instance_id=instance))

    def close(self) -> None:
        self.client._settle_dropped(keep=False)
        with contextlib.suppress(BufferError):
            self.map.close()
        self.sock.close()
        self.peer.close()


def refused(client: KvdClient, rooms: list[int]) -> set[int]:
    hit = client.ring_refused(np.array(rooms, dtype=np.uint64))
    by_array = set() if hit is None else {r for r, h in zip(rooms, hit, strict=True) if h}
    by_room = {r for r in rooms if client.room_refusal(r) is not None}
    assert by_array == by_room  # every read path says the same
    return by_room


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, CAPACITY), data=st.data())
def test_k41_records_past_the_dropped_rings_final_tail_fail_their_rooms(
        n: int, data: st.DataObject) -> None:
    """kvd runs the first ``ran`` of ``n`` published records (rooms 100 + seq); the engine
    notices the drop while kvd has not closed the ring, and kvd closes it then or only
    by the registration's answer. Rooms of records before the final ``tail`` hold no
    refusal, each room past it holds one (KvdUnreachable, naming the lost call) on every
    read path; its next call raises it once (taken), and a Clear drops it."""
    ran = data.draw(st.integers(0, n), label="ran")
    closed_at_drop = data.draw(st.booleans(), label="kvd closed the ring before the drop")
    m = Model()
    try:
        m.client.instance = "kvd-1"
        for seq in range(n):
            assert m.publish(rpc.SenderCreate(room=100 + seq), key=NEW) == seq
        m.run(ran)
        if closed_at_drop:
            m.sub.close()
        m.drop()
        if not closed_at_drop:
            assert refused(m.client, m.rooms) == set()  # tail not final yet
            m.sub.close()  # kvd ran the Backlog (up to the head it read), then answered
            m.registered()
        lost = set(m.rooms[ran:])
        assert refused(m.client, m.rooms) == lost
        for room in lost:
            refusal = m.client.room_refusal(room)
            assert isinstance(refusal, KvdUnreachable) and "never ran" in str(refusal)
        if lost:
            room = min(lost)
            assert m.client.ring_refusal(room) is None  # no ring: kept, taken already
            m.client._forget_refusals([room])  # the room's Clear
            assert refused(m.client, m.rooms) == lost - {room}
        assert not m.client._dropped_rings
    finally:
        m.close()


def test_k41_a_restarted_kvd_keeps_no_refusal_of_the_old_rings_records() -> None:
    """A registration another kvd instance answers: the old rooms are gone with the old
    kvd (K27, a new epoch); the dropped ring's unrun records keep nothing."""
    m = Model()
    try:
        m.client.instance = "kvd-1"
        for seq in range(4):
            m.publish(rpc.SenderCreate(room=200 + seq))
        m.run(1)
        m.drop()
        m.registered(instance="kvd-2")
        assert refused(m.client, m.rooms) == set()
        assert not m.client._dropped_rings and m.client.epoch == 1
    finally:
        m.close()


def test_k41_an_unrun_clear_past_the_final_tail_leaves_its_room_failed() -> None:
    """A refused call's room, then an unwaited Clear of it the engine published after kvd
    read the head: the Clear never ran, so the room reads Failed (its kept refusal goes
    at the drop as if the Clear ran, and comes back as the lost Clear's)."""
    m = Model()
    try:
        m.client.instance = "kvd-1"
        m.publish(rpc.SenderCreate(room=7))
        m.run(1)
        m.ring.refused[7] = KvdUnreachable("refused", "KvdUnreachable")
        seq = m.publish(rpc.Clear(room=7))
        m.ring.clearing[seq] = 7
        m.drop()
        m.sub.close()
        m.registered()
        assert refused(m.client, [7]) == {7}
        assert "never ran" in str(m.client.room_refusal(7))
    finally:
        m.close()
