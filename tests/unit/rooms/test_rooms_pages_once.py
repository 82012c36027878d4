"""K42 in the room machines (tier 1, pure): a room's destination regions (KV pages, aux
slot, state slot, window pages) are distinct, two live rooms of one decode rank never share
one (regions of releasable rooms are free again), a prefill room never names a source page
twice, and a prefill refuses a decode's page list that names a page twice (a peer is never
trusted)."""

from __future__ import annotations

import numpy as np
import pytest
from roomkit import (
    AUX,
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
from kvd.protocol import control
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
    """Room ``room`` created and initialised with pages ``dst`` and an aux slot of its own."""
    d.create(room, BOOT, None, now)
    d.init(room, pack_indices(dst), room % AUX, now)


def test_k42_a_page_held_by_a_live_room_is_refused_naming_page_and_room() -> None:
    d = receiver()
    live(d, 1, [3, 4, 5])
    d.create(2, BOOT, None, 0.0)
    with pytest.raises(RoomError, match=r"room 2 destination page 5 \(position 1\) is held "
                                        r"by room 1"):
        d.init(2, pack_indices([9, 5]), 2, 0.0)
    d.init(2, pack_indices([9, 6]), 2, 0.0)  # disjoint: fine


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
        d.init(2, pack_indices([3]), 2, 1.0)
    d.on_status(room_status(1, inc, KVPoll.Failed, quiesced=True), 1.5)  # nothing in flight
    d.init(2, pack_indices([3]), 2, 1.5)


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


# ---- every destination region, not only KV pages (aux, state slot, window pages) ----------

STATE_SLOTS, WINDOW_POOL = 4, 16


def hybrid() -> ReceiverRooms:
    """A decode rank of a hybrid model: ``POOL`` pages, ``AUX`` aux slots, state slots and
    a window pool."""
    d = receiver()
    d.engine_registered(POOL, AUX, (), STATE_SLOTS, WINDOW_POOL)
    return d


def init(d: ReceiverRooms, room: int, dst: list[int], aux: int, state: int = -1,
         window: list[int] | None = None, now: float = 0.0) -> None:
    if room not in d.rooms:
        d.create(room, BOOT, None, now)
    d.init(room, pack_indices(dst), aux, now, state_index=state,
           window_pages=pack_indices(window or []))


@pytest.mark.parametrize(("second", "named"), [
    ({"aux": 1}, r"aux slot 1 \(position 0\) is held by room 1"),
    ({"state": 2}, r"state slot 2 \(position 0\) is held by room 1"),
    ({"window": [9, 5]}, r"window page 5 \(position 1\) is held by room 1"),
])
def test_k42_a_region_held_by_a_live_room_is_refused_naming_kind_index_and_room(
        second: dict[str, object], named: str) -> None:
    """The second room's first token, state or window would overwrite the first's."""
    d = hybrid()
    init(d, 1, [3, 4], aux=1, state=2, window=[5, 6])
    args: dict[str, object] = {"aux": 0, "state": 3, "window": [7]} | second
    with pytest.raises(RoomError, match=named):
        init(d, 2, [10], **args)  # type: ignore[arg-type]
    assert d.rooms[2].dst_pages is None  # nothing claimed: init may be retried
    init(d, 2, [10], aux=0, state=3, window=[7])
    assert d.claims.holders("aux slot") == {1: (1, d.rooms[1].inc), 0: (2, d.rooms[2].inc)}


def test_k42_a_window_page_named_twice_or_a_state_slot_outside_the_pool_is_refused() -> None:
    d = hybrid()
    d.create(1, BOOT, None, 0.0)
    with pytest.raises(RoomError, match=r"window page 7 is named twice \(positions 0 and 2\)"):
        init(d, 1, [3], aux=0, window=[7, 8, 7])
    with pytest.raises(RoomError, match=r"state slot 4 \(position 0\) outside \[0, 4\)"):
        init(d, 1, [3], aux=0, state=STATE_SLOTS)
    init(d, 1, [3], aux=0, state=0, window=[7, 8])


def test_k42_regions_of_a_failed_room_are_held_until_releasable_then_free() -> None:
    """The same release rule as pages (K06/K22): an aborted room whose pages went out
    holds its aux slot, state slot and window pages until its writer quiesced."""
    d = hybrid()
    init(d, 1, [3], aux=1, state=2, window=[5])
    inc = d.rooms[1].inc
    d.resolved(1, inc, targets(P0), 0.0)
    d.abort(1, "engine gave up", 1.0)
    for kw in ({"aux": 1}, {"aux": 0, "state": 2}, {"aux": 0, "window": [5]}):
        with pytest.raises(RoomError, match="held by room 1"):
            init(d, 2, [9], now=1.0, **kw)  # type: ignore[arg-type]
    d.on_status(room_status(1, inc, KVPoll.Failed, quiesced=True), 1.5)
    init(d, 2, [9], aux=1, state=2, window=[5], now=1.5)


def test_k42_regions_of_a_cleared_room_or_a_new_pool_are_free() -> None:
    d = hybrid()
    init(d, 1, [3], aux=1, state=2, window=[5])
    d.clear(1, 0.0)  # never sent: releasable, forgotten
    init(d, 2, [3], aux=1, state=2, window=[5])
    d.engine_released(1.0)
    assert d.quiet(1.0)
    d.forget_rooms()
    d.engine_registered(POOL, AUX, (), STATE_SLOTS, WINDOW_POOL)
    init(d, 3, [3], aux=1, state=2, window=[5], now=1.0)


def test_k42_regions_of_a_kind_the_engine_registered_none_of_are_not_claimed() -> None:
    """No state pool, no aux buffers: those indices name no memory here (the prefill
    pairing refuses a state room against a rank without state)."""
    d = receiver()
    d.num_aux_slots = 0
    init(d, 1, [3], aux=0, state=0)
    init(d, 2, [4], aux=0, state=0)


def test_k16_a_room_of_more_pages_than_a_room_pages_message_carries_is_refused_at_init(
        ) -> None:
    """No peer would accept its RoomPages (a field past its bound, S19): the room would
    wait for its deadline; init refuses it instead."""
    d = ReceiverRooms(D0, "d-a")
    d.engine_registered(control.MAX_ROOM_PAGES + 2, 0, ())
    d.create(1, BOOT, None, 0.0)
    too_many = np.arange(control.MAX_ROOM_PAGES + 1, dtype=np.int64)
    with pytest.raises(RoomError, match=f"more than the {control.MAX_ROOM_PAGES}"):
        d.init(1, pack_indices(too_many), 0, 0.0)
    d.init(1, pack_indices(too_many[:-1]), 0, 0.0)


@pytest.mark.parametrize("n", [3, 20])  # the Python path and the numpy path of the table
def test_k42_rooms_of_few_and_many_pages_are_refused_alike(n: int) -> None:
    d = hybrid()
    init(d, 1, list(range(n)), aux=0, window=list(range(n % WINDOW_POOL)))
    d.create(2, BOOT, None, 0.0)
    with pytest.raises(RoomError, match=rf"destination page {n - 1} \(position 1\) is held "
                                        r"by room 1"):
        init(d, 2, [n + 1, n - 1, n + 2], aux=1)
    twice = [*range(n, 2 * n), n]
    with pytest.raises(RoomError, match=rf"page {n} is named twice \(positions 0 and {n}\)"):
        init(d, 2, twice, aux=1)
    with pytest.raises(RoomError, match=rf"page {POOL} \(position {n}\) outside \[0, {POOL}\)"):
        d.claims.check(2, {"page": np.array([*range(n, 2 * n), POOL])}, lambda r, i: True)
    init(d, 2, list(range(n, 2 * n)), aux=1)
    d.clear(1, 0.0)
    assert not set(d.claims.holders("page")) & set(range(n))  # freed
