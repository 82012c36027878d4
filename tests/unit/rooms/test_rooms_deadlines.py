"""K41: the decode machine's sweep looks at rooms with something due, not at every room
(tier 1, pure; operations counted, no clock). That it decides what a walk over every room
would is checked after every sweep of the stateful world (test_rooms_stateful.py, (h))."""

from __future__ import annotations

from kvd.rooms.deadlines import Deadlines, after
from kvd.rooms.effects import Ended, Wake
from kvd.rooms.receiver import ReceiverRooms
from kvd.rooms.state import FailureKind, KVPoll, RoomFailure, Timeouts

T = Timeouts(bootstrap=8.0, waiting=10.0, transfer=10.0, release=3.0, tombstone=30.0,
             finished_ttl=25.0)


def _machine(n: int) -> ReceiverRooms:
    m = ReceiverRooms("tcp://d:1", "d-1", T)
    m.num_pages, m.num_aux_slots = 16, 1
    for room in range(n):
        m.create(room, f"p{room}:8998", None, 0.0)
    return m


def test_deadlines_hand_back_each_due_incarnation_once_earliest_first() -> None:
    d = Deadlines()
    d.schedule(1, 1, 5.0)
    d.schedule(2, 1, 3.0)
    d.schedule(1, 1, 7.0)  # later than known: kept at 5
    d.schedule(3, 1, 9.0)
    d.schedule(3, 1, 4.0)  # earlier: moves
    d.schedule(4, 1, None)
    assert d.due(2.9) == [] and len(d) == 3
    assert d.due(5.0) == [(2, 1), (3, 1), (1, 1)]
    assert d.due(100.0) == [] and len(d) == 0  # (3, 1) at 9.0 was superseded
    d.schedule(5, 1, 1.0)
    d.forget(5, 1)
    assert d.due(100.0) == []
    assert after(1.0) > 1.0 and not after(1.0) - 1.0 > 1e-12


def test_k41_a_sweep_of_4096_quiet_rooms_looks_at_none_of_them() -> None:
    """4 096 rooms resolving, far from their deadline: 10 sweeps a second for 5 s look at
    no room (the walk looked at 4 096 per sweep)."""
    m = _machine(4096)
    for k in range(1, 51):
        assert m.tick(k * 0.1) == []
    assert m.looked == 0


def test_k41_the_sweep_fails_rooms_at_their_deadline_and_looks_at_each_once() -> None:
    m = _machine(4096)
    m.take_changed()
    assert m.tick(T.bootstrap) == []  # not past it: the rule is now > deadline
    out = m.tick(T.bootstrap + 0.1)
    assert sum(isinstance(e, Ended) for e in out) == 4096 and m.looked == 4096
    assert m.take_changed() == set(range(4096))  # every one shows Failed
    m.looked = 0
    assert [e for e in m.tick(T.bootstrap + 0.2) if not isinstance(e, Wake)] == []
    assert m.looked == 4096  # failed with nothing sent: releasable, noted once
    m.looked = 0
    for k in range(3, 100):
        m.tick(T.bootstrap + k * 0.1)
    assert m.looked == 0  # nothing more until finished_ttl
    m.tick(T.bootstrap + 0.1 + T.finished_ttl + 0.1)
    assert m.looked == 4096 and not m.rooms and m.table_sizes() == {"rooms": 0}


def test_k41_a_lost_peer_fails_its_rooms_found_through_the_index() -> None:
    """peer_lost picks the rooms of one bootstrap address without walking the others;
    fail_rooms leaves a room that was created again since it was chosen alone."""
    m = _machine(100)
    for room in range(100, 110):
        m.create(room, "shared:8998", None, 0.0)
    keys = m.lost_rooms("shared:8998")
    assert keys == [(room, m.rooms[room].inc) for room in range(100, 110)]
    m.abort(105, "gone", 1.0)
    m.clear(105, 1.0)
    m.create(105, "shared:8998", None, 1.0)  # a new incarnation: not one of the keys
    f = RoomFailure(FailureKind.HEARTBEAT, "prefill shared:8998 lost", "decode")
    out = m.fail_rooms(keys, f, 2.0)
    assert sum(isinstance(e, Ended) for e in out) == 9
    assert m.rooms[105].status == KVPoll.Bootstrapping
    assert all(m.rooms[r].status == KVPoll.Bootstrapping for r in range(100))
