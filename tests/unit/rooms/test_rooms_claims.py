"""K42 on the decode machine under random engine calls (tier 1, pure, hypothesis): rooms
name random pages, aux slots, state slots and window pages, and end in every way (success,
abort before or after their pages went out, quiescence, the release bound, clear); ``init``
is refused exactly when a region is named twice or held by a room whose writes may still
land, and after every step no two such rooms share any region."""

from __future__ import annotations

import contextlib

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
