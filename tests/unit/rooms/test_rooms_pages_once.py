"""K42 in the room machines (tier 1, pure): a room's destination pages are distinct, two
live rooms of one decode rank never share a page (pages of releasable rooms are free
again), a prefill room never names a source page twice, and a prefill refuses a decode's
page list that names a page twice (a peer is never trusted)."""

from __future__ import annotations

import pytest
from roomkit import (
    BOOT,
    D0,
    P0,
    POOL,
    of,
    pages,
    receiver,
    registered,
    room_pages,
    room_status,
    sender,
    targets,
)

from kvd.errors import RoomError
from kvd.protocol.codec import pack_indices
from kvd.rooms.effects import Report, Send
from kvd.rooms.receiver import ReceiverRooms
from kvd.rooms.state import FailureKind, KVPoll


def test_k42_init_refuses_a_destination_page_named_twice() -> None:
    d = receiver()
    d.create(1, BOOT, None, 0.0)
    with pytest.raises(RoomError, match=r"page 40 is named twice \(positions 0 and 2\)"):
        d.init(1, pack_indices([40, 41, 40]), 0, 0.0)
    assert d.rooms[1].dst_pages is None  # refused: nothing recorded, init may be retried
    d.init(1, pack_indices([40, 41, 42]), 0, 0.0)


def live(d: ReceiverRooms, room: int, dst: list[int], now: float = 0.0) -> None:
    d.create(room, BOOT, None, now)
    d.init(room, pack_indices(dst), 0, now)


def test_k42_a_page_held_by_a_live_room_is_refused_naming_page_and_room() -> None:
    d = receiver()
    live(d, 1, [3, 4, 5])
    d.create(2, BOOT, None, 0.0)
    with pytest.raises(RoomError, match=r"room 2 destination page 5 \(position 1\) is held "
                                        r"by room 1"):
        d.init(2, pack_indices([9, 5]), 0, 0.0)
    d.init(2, pack_indices([9, 6]), 0, 0.0)  # disjoint: fine


def test_k42_pages_of_a_succeeded_room_are_free_again() -> None:
    d = receiver()
    live(d, 1, [3, 4])
    d.resolved(1, d.rooms[1].inc, targets(P0), 0.0)
    d.on_status(room_status(1, d.rooms[1].inc, KVPoll.Success), 1.0)
    assert d.rooms[1].status == KVPoll.Success
    live(d, 2, [4, 3], now=2.0)  # the engine reuses them before clearing room 1


def test_k42_pages_of_a_failed_room_are_held_until_releasable() -> None:
    d = receiver()
    live(d, 1, [3, 4])
    inc = d.rooms[1].inc
    sends = of(d.resolved(1, inc, targets(P0), 0.0), Send)
    assert sends  # the pages went out: a write may be in flight after the abort
    d.abort(1, "engine gave up", 1.0)
    d.create(2, BOOT, None, 1.0)
    with pytest.raises(RoomError, match="page 3"):
        d.init(2, pack_indices([3]), 0, 1.0)
    d.on_status(room_status(1, inc, KVPoll.Failed, quiesced=True), 1.5)  # nothing in flight
    d.init(2, pack_indices([3]), 0, 1.5)


def test_k42_pages_of_a_cleared_or_forgotten_room_are_free() -> None:
    d = receiver()
    live(d, 1, [7])
    d.clear(1, 0.0)  # never sent: releasable, forgotten
    live(d, 2, [7])
    d.engine_released(1.0)
    assert d.quiet(1.0)  # room 2 never sent pages: nothing can land
    d.forget_rooms()
    d.engine_registered(POOL, 0, ())
    live(d, 3, [7], now=1.0)


def test_k42_send_refuses_a_source_page_named_twice_in_one_room() -> None:
    s = sender()
    registered(s)
    s.create(1, 0.0)
    s.init(1, 3, 0, 0.0)
    s.on_pages(room_pages(1, 1, (0, 1, 2)), 0.0)
    s.send(1, pages(5, 6), False, 0.0)
    with pytest.raises(RoomError, match=r"source page 6 is named twice") as refused:
        s.send(1, pages(6), True, 0.0)  # an earlier chunk named it
    assert s.rooms[1].failure is not None and s.rooms[1].failure.kind == FailureKind.LAYOUT
    rep = of(refused.value.effects, Report)
    assert rep and rep[0].to == D0 and rep[0].status == KVPoll.Failed


def test_k42_send_refuses_a_source_page_twice_within_a_chunk() -> None:
    s = sender()
    registered(s)
    s.create(1, 0.0)
    s.init(1, 2, 0, 0.0)
    with pytest.raises(RoomError, match=r"source page 9 is named twice \(positions 0 and 1\)"):
        s.send(1, pages(9, 9), True, 0.0)


def test_k42_prefill_refuses_decode_pages_named_twice() -> None:
    s = sender()
    registered(s)
    s.create(1, 0.0)
    s.init(1, 3, 0, 0.0)
    out = s.on_pages(room_pages(1, 1, (40, 41, 40)), 0.0)
    rep = of(out, Report)
    assert rep and rep[0].failure is not None and rep[0].failure.kind == FailureKind.LAYOUT
    assert "page 40 is named twice" in rep[0].failure.reason
    assert s.rooms[1].status == KVPoll.Failed
