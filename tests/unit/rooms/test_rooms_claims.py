"""K42 on the decode machine under random engine calls (tier 1, pure, hypothesis): rooms
name random pages, aux slots, state slots and window pages, and end in every way (success,
abort before or after their pages went out, quiescence, the release bound, clear); ``init``
is refused exactly when a region is named twice or held by a room whose writes may still
land, and after every step no two such rooms share any region."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from roomkit import BOOT, P0, TIMEOUTS, live_regions, receiver, room_status, targets

from kvd.errors import RoomError
from kvd.protocol.codec import pack_indices
from kvd.rooms.claims import AUX, PAGE, STATE, WINDOW
from kvd.rooms.receiver import ReceiverRooms
from kvd.rooms.state import KVPoll

PAGES, AUX_SLOTS, STATE_SLOTS, WINDOW_POOL = 8, 3, 3, 6
ROOMS = (1, 2, 3, 4)

idx = st.integers(0, PAGES - 1)
step = st.one_of(
    st.tuples(st.just("init"), st.sampled_from(ROOMS), st.lists(idx, min_size=1, max_size=3),
              st.integers(0, AUX_SLOTS - 1), st.integers(-1, STATE_SLOTS - 1),
              st.lists(st.integers(0, WINDOW_POOL - 1), max_size=2)),
    st.tuples(st.sampled_from(["resolve", "succeed", "abort", "quiesce", "clear"]),
              st.sampled_from(ROOMS)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 30.0])))


def expected_refusal(d: ReceiverRooms, regions: dict[str, list[int]], now: float) -> bool:
    """Named twice, or held by a live room (the model: :func:`live_regions`)."""
    held = live_regions(d, now)
    return any(len(set(v)) < len(v) or set(v) & held[k] for k, v in regions.items())


Step = tuple  # type: ignore[type-arg]


def run(d: ReceiverRooms, s: Step, now: float) -> float:
    kind, room = s[0], s[1]
    r = d.rooms.get(room) if kind != "advance" else None
    match s:
        case ("init", _, pages, aux, state, window):
            if r is None or r.done:
                try:
                    d.create(room, BOOT, None, now)
                except RoomError:
                    return now  # its previous attempt is not releasable yet (K06)
            if d.rooms[room].dst_pages is not None:
                return now
            regions = {PAGE: pages, AUX: [aux], STATE: [state] if state >= 0 else [],
                       WINDOW: window}
            refuse = expected_refusal(d, regions, now)
            try:
                d.init(room, pack_indices(pages), aux, now, state_index=state,
                       window_pages=pack_indices(window))
            except RoomError as exc:
                assert refuse, f"refused without cause: {exc}"
                assert d.rooms[room].dst_pages is None
                return now
            assert not refuse, f"room {room} accepted regions a live room holds: {regions}"
        case ("resolve", _) if r is not None and r.targets is None and not r.done:
            d.resolved(room, r.inc, targets(P0), now)
        case ("succeed", _) if r is not None and r.sent and not r.done:
            d.on_status(room_status(room, r.inc, KVPoll.Success), now)
        case ("abort", _):
            d.abort(room, "engine", now)
        case ("quiesce", _) if r is not None and r.sent:
            d.on_status(room_status(room, r.inc, KVPoll.Failed, quiesced=True), now)
        case ("clear", _):
            with contextlib.suppress(RoomError):  # not releasable yet: kept
                d.clear(room, now)
        case ("advance", dt):
            now += dt
            d.tick(now)
    return now


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=40))
def test_k42_no_two_live_rooms_of_a_decode_rank_share_any_region(steps: list[Step]) -> None:
    d = receiver(timeouts=TIMEOUTS)
    d.engine_registered(PAGES, AUX_SLOTS, (), STATE_SLOTS, WINDOW_POOL)
    now = 0.0
    for s in steps:
        now = run(d, s, now)
        live_regions(d, now)


def test_s19_room_ids_past_int64_claim_and_refuse_like_any_other() -> None:
    """A room id is a 64-bit unsigned integer on the wire (``RoomId``): ``2**63`` up to
    ``2**64 - 1`` are ids an engine may send and every bound accepts. Before, the claim
    table held rooms as int64 with -1 for free: ``init`` of such a room raised
    OverflowError (the engine got an internal error, not a refusal naming a cause, and
    the room could never be initialised), and the numpy path stacked rooms with
    incarnations as float64, merging ids past 2**53."""
    top, below = 2**64 - 1, 2**64 - 2
    for n in (2, 20):  # the Python path (<= SMALL regions) and the numpy path
        d = receiver()
        d.engine_registered(64, 4, (), 0, 0)
        d.create(top, BOOT, None, 0.0)
        d.init(top, pack_indices(list(range(n))), 0, 0.0)  # claims pages [0, n), aux 0
        assert d.claims.holders(PAGE) == {i: (top, d.rooms[top].inc) for i in range(n)}
        d.create(below, BOOT, None, 0.0)
        with pytest.raises(RoomError, match=f"held by room {top},"):
            d.init(below, pack_indices([*range(n, 2 * n), n - 1]), 1, 0.0)
        d.init(below, pack_indices(list(range(n, 2 * n))), 1, 0.0)
        assert d.claims.holders(PAGE)[n] == (below, d.rooms[below].inc)
        d.abort(top, "engine", 0.0)  # nothing sent: its regions free at once
        d.create(2**63, BOOT, None, 0.0)
        d.init(2**63, pack_indices(list(range(n))), 0, 0.0)
        assert d.claims.holders(PAGE)[0] == (2**63, d.rooms[2**63].inc)
