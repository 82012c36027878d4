"""kvd.rooms.state: KVPoll numbering, failure kinds, the deadline table."""

from __future__ import annotations

from kvd.rooms.state import UNKNOWN_ROOM, FailureKind, KVPoll, Timeouts


def test_kvpoll_numbering_matches_sglang() -> None:
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2), ("Transferring", 3),
        ("Success", 4)]
    assert UNKNOWN_ROOM == -1
    assert UNKNOWN_ROOM not in {int(p) for p in KVPoll}


def test_failure_kinds_parse_from_the_wire() -> None:
    assert FailureKind.parse("transport") is FailureKind.TRANSPORT
    assert FailureKind.parse("no-such-kind") is FailureKind.ABORTED
    assert {k.value for k in FailureKind} == {
        "timeout", "aborted", "heartbeat", "unreachable", "bootstrap", "registration",
        "layout", "transport", "duplicate", "peer"}


def test_every_non_terminal_state_has_a_deadline() -> None:
    t = Timeouts(bootstrap=1, waiting=2, transfer=3)
    assert [t.limit(s) for s in KVPoll] == [None, 1, 2, 3, None]
