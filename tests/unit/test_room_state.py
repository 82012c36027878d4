"""kvd.rooms: KVPoll numbering and the monotonic room-state rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.rooms import UNKNOWN_ROOM, KVPoll, RoomState

NON_FAILED = [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]


def test_kvpoll_numbering_matches_sglang() -> None:
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2), ("Transferring", 3),
        ("Success", 4)]
    assert UNKNOWN_ROOM == -1
    assert UNKNOWN_ROOM not in {int(p) for p in KVPoll}


def test_new_room() -> None:
    r = RoomState(room=42)
    assert r.status == KVPoll.Bootstrapping
    assert r.reason == ""
    assert not r.done


def test_states_move_up() -> None:
    r = RoomState(room=1)
    assert r.advance(KVPoll.WaitingForInput)
    assert r.status == KVPoll.WaitingForInput
    assert not r.advance(KVPoll.Bootstrapping)  # down: refused, nothing changes
    assert r.status == KVPoll.WaitingForInput
    assert not r.advance(KVPoll.WaitingForInput)  # same: not an upgrade
    assert r.advance(KVPoll.Success)  # skipping a state is fine
    assert r.done


def test_since_updates_only_on_change() -> None:
    r = RoomState(room=1, since=-100.0)
    assert not r.advance(KVPoll.Bootstrapping)
    assert r.since == -100.0
    assert r.advance(KVPoll.Transferring)
    assert r.since > -100.0
    before = r.since
    assert not r.advance(KVPoll.WaitingForInput)
    assert r.since == before


def test_success_is_terminal() -> None:
    r = RoomState(room=1)
    assert r.advance(KVPoll.Success)
    for s in NON_FAILED:
        assert not r.advance(s)
    assert not r.fail("late error")
    assert r.status == KVPoll.Success
    assert r.reason == ""


def test_failed_is_sticky_with_reason() -> None:
    r = RoomState(room=1)
    r.advance(KVPoll.Transferring)
    assert r.fail("peer died")
    assert r.status == KVPoll.Failed
    assert r.reason == "peer died"
    assert r.done
    for s in NON_FAILED:
        assert not r.advance(s)
    assert not r.fail("second reason")
    assert r.reason == "peer died"
    assert r.status == KVPoll.Failed


def test_advance_to_failed_raises() -> None:
    r = RoomState(room=1)
    with pytest.raises(ValueError, match="fail"):
        r.advance(KVPoll.Failed)
    assert r.status == KVPoll.Bootstrapping


@given(st.lists(st.one_of(st.sampled_from(NON_FAILED), st.text(min_size=1, max_size=5)),
                max_size=20))
def test_random_sequences_are_monotonic(ops: list[KVPoll | str]) -> None:
    r = RoomState(room=0)
    first_fail: str | None = None
    highest = KVPoll.Bootstrapping
    for op in ops:
        was_done, before = r.done, r.status
        if isinstance(op, str):
            changed = r.fail(op)
            assert changed == (not was_done)
            if not was_done:
                first_fail = op
        else:
            changed = r.advance(op)
            assert changed == (not was_done and op > before)
            if changed:
                highest = op
        if first_fail is not None:
            assert r.status == KVPoll.Failed and r.reason == first_fail
        else:
            assert r.status == highest
