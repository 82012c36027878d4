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
    """A poll answered from a dict ``room -> (status, releasable)``."""

    def __init__(self) -> None:
        self.rooms: dict[int, tuple[int, bool]] = {}

    def poll(self, rooms: list[int]) -> rpc.PollResult:
        got = [self.rooms.get(r, (-1, True)) for r in rooms]
        return rpc.PollResult(statuses=[s for s, _ in got],
                              releasable=[r for r, (_, f) in zip(rooms, got, strict=True) if f])


@pytest.fixture
def writer() -> Iterator[TableWriter]:
    side = _Side()
    w = TableWriter(side.poll, 16)
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
    assert view.read_one(3) == (1, True) and 3 in writer.unsettled
    side.rooms[3] = (4, True)
    writer.sweep()
    assert view.read_one(3) == (4, True) and 3 not in writer.unsettled and 3 in writer.held
    del side.rooms[3]
    writer.sweep()
    assert view.read_one(3) == (-1, True) and 3 not in writer.held


def test_a_room_whose_bucket_known_rooms_fill_stays_out(writer: TableWriter) -> None:
    side = writer.side  # type: ignore[attr-defined]
    side.rooms[1] = side.rooms[9] = side.rooms[17] = (2, False)  # one bucket of 8
    for room in (1, 9, 17):
        writer.track(room)
    view = _engine_view(writer)
    assert view.read_one(1) == view.read_one(9) == (2, False) and view.read_one(17) is None
    del side.rooms[9]  # forgotten: its slot is free again
    writer.sweep()
    writer.track(17)
    assert view.read_one(17) == (2, False) and view.read_one(1) == (2, False)


def test_a_closed_table_is_not_fresh(writer: TableWriter) -> None:
    view = _engine_view(writer)
    assert view.fresh(time.monotonic_ns())
    writer.table.close()
    assert not view.fresh(time.monotonic_ns())


def test_k41_a_change_re_publishes_the_unsettled_rooms_in_slices_one_per_loop_turn() -> None:
    """K41: 2 000 unsettled rooms; a change re-publishes them at most ``slice`` per loop
    turn (counted by a callback that runs once per turn), every one of them by the end;
    a change during a round starts one more round of every unsettled room after it."""
    import asyncio

    side = _Side()
    w = TableWriter(side.poll, 8192)
    w.slice = 300
    rooms = list(range(1, 2001))
    for r in rooms:
        side.rooms[r] = (1, False)  # Bootstrapping: unsettled
        w.track(r)
    polled: list[list[int]] = []
    inner = w.poll
    w.poll = lambda rs: polled.append(list(rs)) or inner(rs)  # type: ignore[method-assign]

    async def main() -> int:
        turns = 0
        for r in rooms[100:]:
            side.rooms[r] = (0, True)  # failed (nothing landed): settled once published
        w.touch()
        for _ in range(30):  # 30 loop turns, one sleep(0) each
            await asyncio.sleep(0)
            turns += 1
            if len(polled) == 3 and side.rooms[50] == (1, False):
                side.rooms[50] = (3, False)  # a change mid-round, to a room published
                w.touch()
        return turns

    try:
        asyncio.run(main())
        assert polled and max(len(p) for p in polled) <= 300
        assert sorted(r for p in polled[:7] for r in p) == rooms  # the first round: all
        assert sorted(polled[7]) == rooms[:100]  # then the 100 still unsettled, once
        assert w.turns == len(polled) == 8
        assert w.unsettled == set(rooms[:100])
        table = _engine_view(w)
        assert table.read_one(1500) == (0, True)  # (status, releasable) as published
        assert table.read_one(50) == (3, False)
    finally:
        w.close()
