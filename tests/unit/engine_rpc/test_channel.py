"""kvd's status table writer (issue 21, step A): its memfd, its seals, what it publishes."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator

import pytest

from kvd.engine_rpc.channel import TableWriter
from kvd.protocol import rpc
from kvd.protocol.table import StatusTable


class _Side:
    """A poll answered from a dict ``room -> (status, releasable)``; ``changed``: the rooms
    a test changed (what a room machine's ``take_changed`` hands over)."""

    def __init__(self) -> None:
        self.rooms: dict[int, tuple[int, bool]] = {}
        self.changed: set[int] = set()

    def set(self, room: int, value: tuple[int, bool] | None) -> None:
        if value is None:
            self.rooms.pop(room, None)
        else:
            self.rooms[room] = value
        self.changed.add(room)

    def take_changed(self) -> set[int]:
        out, self.changed = self.changed, set()
        return out

    def poll(self, rooms: list[int]) -> rpc.PollResult:
        got = [self.rooms.get(r, (-1, True)) for r in rooms]
        return rpc.PollResult(statuses=[s for s, _ in got],
                              releasable=[r for r, (_, f) in zip(rooms, got, strict=True) if f])


@pytest.fixture
def writer() -> Iterator[TableWriter]:
    side = _Side()
    w = TableWriter(side.poll, 16, changed=side.take_changed)
    w.side = side  # type: ignore[attr-defined]
    yield w
    w.close()


def _engine_view(w: TableWriter) -> StatusTable:
    return StatusTable.open(mmap.mmap(w.fd, w.size, prot=mmap.PROT_READ))


def test_an_engine_cannot_write_shrink_or_grow_the_table(writer: TableWriter) -> None:
    with pytest.raises(PermissionError):
        os.ftruncate(writer.fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(writer.fd, writer.size * 2)
    with pytest.raises(PermissionError):  # F_SEAL_FUTURE_WRITE (Linux >= 5.1)
        mmap.mmap(writer.fd, writer.size)
    _engine_view(writer)  # reading is fine


def test_a_tracked_room_reads_back_what_poll_says_and_settles(writer: TableWriter) -> None:
    side = writer.side  # type: ignore[attr-defined]
    side.rooms[3] = (1, True)
    writer.track(3)
    view = _engine_view(writer)
    assert view.read_one(3) == (1, True)
    side.set(3, (4, True))
    writer.sweep()
    assert view.read_one(3) == (4, True) and 3 in writer.held
    side.set(3, None)
    writer.sweep()
    assert view.read_one(3) == (-1, True) and 3 not in writer.held


def test_a_room_whose_bucket_known_rooms_fill_stays_out(writer: TableWriter) -> None:
    side = writer.side  # type: ignore[attr-defined]
    side.rooms[1] = side.rooms[9] = side.rooms[17] = (2, False)  # one bucket of 8
    for room in (1, 9, 17):
        writer.track(room)
    view = _engine_view(writer)
    assert view.read_one(1) == view.read_one(9) == (2, False) and view.read_one(17) is None
    side.set(9, None)  # forgotten: its slot is free again
    writer.sweep()
    writer.track(17)
    assert view.read_one(17) == (2, False) and view.read_one(1) == (2, False)


def test_a_closed_table_is_not_fresh(writer: TableWriter) -> None:
    view = _engine_view(writer)
    assert view.fresh(time.monotonic_ns())
    writer.table.close()
    assert not view.fresh(time.monotonic_ns())


def test_k41_a_change_re_publishes_only_the_changed_rooms_in_slices_one_per_loop_turn(
) -> None:
    """K41: 2 000 rooms held; a change of one room writes one slot (not one per room
    held); 1 900 changed rooms are written at most ``slice`` per loop turn (counted by a
    callback that runs once per turn), each once; a change mid-way is written too."""
    import asyncio

    side = _Side()
    w = TableWriter(side.poll, 8192, changed=side.take_changed)
    w.slice = 300
    rooms = list(range(1, 2001))
    for r in rooms:
        side.rooms[r] = (1, False)
        w.track(r)
    polled: list[list[int]] = []
    inner = w.poll
    w.poll = lambda rs: polled.append(list(rs)) or inner(rs)  # type: ignore[method-assign]

    async def one_change() -> None:
        side.set(7, (2, False))
        w.touch()
        for _ in range(5):
            await asyncio.sleep(0)

    async def many_changes() -> None:
        for r in rooms[100:]:
            side.set(r, (0, True))
        w.touch()
        for _ in range(30):  # 30 loop turns, one sleep(0) each
            await asyncio.sleep(0)
            if len(polled) == 3 and side.rooms[50] == (1, False):
                side.set(50, (3, False))  # a change mid-way, to a room not changed yet
                w.touch()

    try:
        written = w.written
        asyncio.run(one_change())
        assert polled == [[7]] and w.written - written == 1
        polled.clear()
        asyncio.run(many_changes())
        assert max(len(p) for p in polled) <= 300
        assert sorted(r for p in polled for r in p) == sorted([50, *rooms[100:]])  # once each
        assert len(polled) == 7  # ceil(1 901 / 300) turns
        table = _engine_view(w)
        assert table.read_one(1500) == (0, True)  # (status, releasable) as published
        assert table.read_one(50) == (3, False)
        assert table.read_one(60) == (1, False)
    finally:
        w.close()


def test_k41_the_sweeps_safety_net_re_publishes_every_room_once_a_period_in_slices() -> None:
    """A change nobody recorded (the machine's set missed it) still reaches the table: the
    sweep re-publishes every room held once a ``NET_PERIOD_S``, a slice per sweep or loop
    turn, and not more often."""
    side = _Side()
    now = [0]
    w = TableWriter(side.poll, 4096, clock_ns=lambda: now[0], changed=side.take_changed)
    w.slice = 400
    rooms = list(range(1, 1001))
    try:
        for r in rooms:
            side.rooms[r] = (1, False)
            w.track(r)
        for r in rooms:
            side.rooms[r] = (2, False)  # unrecorded
        view = _engine_view(w)
        written = w.written
        w.sweep()  # (no loop running: each sweep takes the next slice)
        assert w.written - written == 400
        w.sweep()
        w.sweep()
        assert w.written - written == 1000
        assert all(view.read_one(r) == (2, False) for r in rooms)
        now[0] += int(0.5e9)
        w.sweep()  # within the period: nothing
        assert w.written - written == 1000
        now[0] += int(0.6e9)
        w.sweep()  # a new round
        assert w.written - written == 1400
    finally:
        w.close()
