"""A poll right after a room call the engine did not wait for (issue 21, P9): the status
table answers every room no unrun ring record names, and only the rooms such a record
names go to the socket -- whose ``Poll`` runs the records first, so no room reads a
status older than a call the engine made on it.

The engine's real :class:`~kvd.client.ring.EngineRing` and status table over memory;
"kvd" is a model: running a record publishes its room's new status into the table
before ``tail`` passes it (as kvd's channel does), and the socket's ``Poll`` runs every
record published first (kvd's catch-up) and answers the model's statuses."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.client import KvdClient, poll_array, poll_many
from kvd.client.ring import EngineRing
from kvd.protocol import codec, rpc
from kvd.protocol.ring import Consumer, Producer, Ring, ring_bytes
from kvd.protocol.table import SlotMap, StatusTable, table_bytes
from kvd.rooms import UNKNOWN_ROOM

CAPACITY, RECORD = 8, 512
NSLOTS = 128  # rooms 0..63 each have a bucket of their own


class Model:
    """A client with a ring and a table, and the kvd that serves them (in this thread)."""

    def __init__(self) -> None:
        half = ring_bytes(CAPACITY, RECORD)
        fd = os.memfd_create("test-ring")
        os.ftruncate(fd, 2 * half)
        self.map = mmap.mmap(fd, 2 * half)
        view = memoryview(self.map)
        self.sub = Ring.create(view[:half], CAPACITY, RECORD)
        self.outbox = Producer(Ring.create(view[half:], CAPACITY, RECORD))
        del view
        self.inbox = Consumer(self.sub)
        self.sock, self.peer = socket.socketpair()
        fds = [fd, os.eventfd(0), os.eventfd(0)]
        ring = EngineRing(rpc.RingResult(capacity=CAPACITY, record_bytes=RECORD,
                                         size=2 * half), fds, self.sock.fileno())
        self.client = KvdClient("/nonexistent/kvd.sock", use_ring=True,
                                ring_capacity=CAPACITY, ring_record_bytes=RECORD)
        self.table = StatusTable.create(bytearray(table_bytes(NSLOTS)), NSLOTS)
        self.table.beat(time.monotonic_ns())
        self.slots = SlotMap(self.table)
        self.client.table, self.client.ring = self.table, ring
        self.client.call = self._socket  # type: ignore[method-assign]
        self.kvd: dict[int, int] = {}  # room -> status in kvd (what a Poll answers)
        self.made: dict[int, int] = {}  # room -> status after every call the engine made
        self.effects: list[tuple[int, int]] = []  # the published records' (room, status)
        self.asked: list[list[int]] = []  # rooms of each socket Poll

    def close(self) -> None:
        assert self.client.ring is not None
        self.client.ring.close()
        self.sub = self.inbox = self.outbox = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view alive: the GC unmaps
            self.map.close()
        self.sock.close()
        self.peer.close()

    def call(self, room: int, status: int) -> None:
        """The engine calls on ``room`` through the ring, not waiting; once run, the room
        reads ``status`` (UNKNOWN_ROOM: a clear)."""
        if self.sub.head - self.sub.tail == CAPACITY:
            self.run(1)  # a full ring: kvd runs one first (the engine would wait)
        ring = self.client.ring
        assert ring is not None
        call = rpc.Clear(room=room) if status == UNKNOWN_ROOM else rpc.Abort(room=room)
        data = ring.encode(call)
        assert data is not None
        ring.submit(data, room, 1.0)
        self.effects.append((room, status))
        self.made[room] = status

    def run(self, n: int) -> None:
        """kvd runs up to ``n`` records: each publishes its room, then ``tail`` passes it."""
        for _ in range(n):
            if self.inbox.peek() is None:
                return
            room, status = self.effects[self.inbox.tail]
            self.kvd[room] = status
            if status != UNKNOWN_ROOM:
                self.slots.place(room)
            self.slots.publish(room, status, False)
            self.inbox.done()

    def _socket(self, call: Any) -> rpc.PollResult:
        assert isinstance(call, rpc.Poll)
        self.run(CAPACITY)  # kvd's catch-up before the socket call
        self.asked.append(list(call.rooms))
        return rpc.PollResult(statuses=[self.kvd.get(r, UNKNOWN_ROOM) for r in call.rooms],
                              releasable=[])

    def unrun(self) -> set[int]:
        return {room for room, _ in self.effects[self.sub.tail:self.sub.head]}


@pytest.fixture
def model() -> Iterator[Model]:
    m = Model()
    yield m
    m.close()


STATUSES = st.sampled_from([1, 2, 3, 4, UNKNOWN_ROOM])  # Bootstrapping..Success, cleared
ROOMS = st.integers(0, 50)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.one_of(
    st.tuples(st.just("call"), ROOMS, STATUSES),
    st.tuples(st.just("run"), st.integers(1, CAPACITY), st.just(0)),
    st.tuples(st.just("poll"), st.lists(ROOMS, min_size=1, max_size=40), st.just(0))),
    max_size=40))
def test_a_poll_answers_from_the_table_every_room_no_unrun_record_names(
        steps: list[tuple[Any, ...]]) -> None:
    """Every poll reads, for each room, the status after every call the engine made on
    it (never an older one); the socket is asked for exactly the rooms an unrun record
    names or the table does not hold -- none while the table answers them all, however
    many records on other rooms kvd has not run."""
    m = Model()
    try:
        for op, a, b in steps:
            if op == "call":
                m.call(a, b)
            elif op == "run":
                m.run(a)
            else:
                unrun, held = m.unrun(), set(m.slots.where)
                ask = [r for r in a if r in unrun or r not in held]
                one = a[0]
                view = m.client.read_table_one(one)
                if one in unrun or one not in held:
                    assert view is None
                else:
                    assert view == (m.made[one], False)
                table = m.client.read_table(np.array(a, dtype=np.uint64))
                assert table is not None
                assert [r for r, h in zip(a, table[2].tolist(), strict=True) if not h] == ask
                m.asked.clear()
                got = poll_array(m.client, np.array(a, dtype=np.uint64)).tolist()
                assert got == [m.made.get(r, UNKNOWN_ROOM) for r in a]
                assert m.asked == ([ask] if ask else [])
    finally:
        m.close()


def test_p9_a_poll_after_an_unwaited_clear_reads_other_rooms_from_the_table(
        model: Model) -> None:
    """The P9 step: rooms 1-3 ended, the engine clears room 1 without waiting and polls
    2 and 3 -- the table answers, no socket call; a poll naming room 1 too asks the
    socket for room 1 alone, which reads cleared, never its status before the clear."""
    for room in (1, 2, 3):
        model.call(room, 4)
    model.run(3)
    model.call(1, UNKNOWN_ROOM)
    assert poll_many(model.client, [2, 3]) == [4, 4]
    assert model.asked == []
    assert poll_many(model.client, [1, 2, 3]) == [UNKNOWN_ROOM, 4, 4]
    assert model.asked == [[1]]


def test_another_thread_in_a_ring_call_sends_the_read_to_the_socket(model: Model) -> None:
    """While another thread holds the ring's lock with records unrun, the read does not
    wait for it: the socket answers (as before the table answered per room)."""
    model.call(5, 3)
    model.call(6, 2)
    model.run(1)
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        with model.client._ring_lock:
            held.set()
            go.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(30)
        assert model.client.read_statuses(np.array([5], dtype=np.uint64)) is None
    finally:
        go.set()
        t.join(30)
    statuses, misses = model.client.read_statuses(np.array([5, 6], dtype=np.uint64)) or \
        (None, None)
    assert statuses is not None and list(misses or []) == [1]  # room 6's record unrun


def test_a_refusal_read_before_tail_passed_its_record_still_leaves_its_room_out(
        model: Model) -> None:
    """kvd writes a refused call's completion before ``tail`` passes the record, and a
    refused call may have changed its room too (kvd publishes it all the same): the
    client reading the completion early still counts the record unrun until ``tail``
    passes it, so the room is asked of the socket meanwhile, not read from the table."""
    model.call(7, 2)
    model.run(1)
    model.call(7, 3)
    ring = model.client.ring
    assert ring is not None
    seq = model.inbox.tail
    model.outbox.push(codec.encode(rpc.Reply(id=seq, ok=False, error="no", kind="bad_call")))
    ring.collect()  # the refusal is read; tail has not passed the record yet
    assert 7 in ring.refused and ring.unrun_rooms() == {7}
    assert model.client.read_table_one(7) is None
    model.run(1)
    assert ring.unrun_rooms() == set() and model.client.read_table_one(7) == (3, False)
