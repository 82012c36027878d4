"""poll_many turns kvd's status values into KVPoll; a value that is no status is a
ProtocolError naming it (it used to escape as an IndexError, or read as UNKNOWN_ROOM)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.client import poll_array, poll_many
from kvd.errors import ProtocolError
from kvd.protocol import rpc
from kvd.rooms import UNKNOWN_ROOM, KVPoll
from tests.helpers.fake_kvd import FakeKvd


class _Answers:
    """A client whose every call answers ``statuses``."""

    table = None  # no status table: every poll asks
    ring = None  # no submission ring: no refusal is kept

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses

    def read_table(self, rooms: Any) -> None:
        return None

    def read_statuses(self, rooms: Any) -> None:
        return None

    def holds_refusals(self) -> bool:  # none kept across a reconnect either
        return False

    def ring_refused(self, rooms: Any) -> None:
        return None

    def read_table_one(self, room: int) -> None:
        return None

    def call(self, call: Any) -> rpc.PollResult:
        return rpc.PollResult(statuses=self.statuses, releasable=[])


@given(st.lists(st.sampled_from([*map(int, KVPoll), UNKNOWN_ROOM]), max_size=200))
def test_every_status_value_maps_to_its_kvpoll(values: list[int]) -> None:
    got = poll_many(_Answers(values), list(range(len(values))))  # type: ignore[arg-type]
    assert got == [UNKNOWN_ROOM if v == UNKNOWN_ROOM else KVPoll(v) for v in values]
    assert all(type(g) is KVPoll for g, v in zip(got, values, strict=True) if v >= 0)


@pytest.mark.parametrize("bad", [5, 9, -2, 2**40])
def test_a_value_that_is_no_status_is_a_protocol_error(bad: int) -> None:
    with pytest.raises(ProtocolError, match=f"room status {bad}"):
        poll_many(_Answers([4, bad]), [1, 2])  # type: ignore[arg-type]


def test_an_answer_with_fewer_statuses_than_rooms_is_a_protocol_error(tmp_path: Any) -> None:
    """A short answer used to escape as an IndexError (``Sender.poll``) or be zipped
    against the wrong rooms; Poll, Wait and a Many's polls check the count."""
    from kvd.client import KvdClient, Sender

    one = rpc.PollResult(statuses=[4], releasable=[])
    FakeKvd(str(tmp_path / "one.sock"), result=one)
    client = KvdClient(str(tmp_path / "one.sock"), timeout=10.0)
    with pytest.raises(ProtocolError, match="1 statuses for 2 rooms"):
        client.call(rpc.Poll(rooms=[1, 2]))
    with pytest.raises(ProtocolError, match="1 statuses for 3 rooms"):
        client.wait([1, 2, 3], 0.0)
    assert client.call(rpc.Poll(rooms=[7])).statuses == [4]  # the right count passes

    FakeKvd(str(tmp_path / "none.sock"), result=rpc.PollResult(statuses=[]))
    with pytest.raises(ProtocolError, match="0 statuses for 1 rooms"):
        Sender.attach(KvdClient(str(tmp_path / "none.sock"), timeout=10.0), 5).poll()

    many = rpc.ManyResult(outcomes=[rpc.Outcome(ok=True, result=one)])
    FakeKvd(str(tmp_path / "many.sock"), result=many)
    with pytest.raises(ProtocolError, match="1 statuses for 2 rooms"):
        KvdClient(str(tmp_path / "many.sock"), timeout=10.0).call_many([rpc.Poll(rooms=[1, 2])])


@pytest.mark.parametrize("bad", [[-1], [2**64], ["seven"], [np.int64(-3)], [1.5],
                                 np.array([5, -1], dtype=np.int64), np.array([1.7]),
                                 np.array([-(2**63)], dtype=np.int64), np.array([True]),
                                 np.array([2**64], dtype=object)])
def test_poll_array_refuses_an_id_that_is_no_uint64_by_name(bad: Any) -> None:
    """A negative, too large or non-integer room id is a ValueError naming the rule (it
    escaped as numpy's OverflowError), and nothing is asked -- whatever carries it: an
    int64 array's -1 was cast to room 2**64 - 1 and a float 1.7 read as room 1 (another
    room's status answered, S19)."""
    with pytest.raises(ValueError, match=r"room ids are integers in \[0, 2\*\*64\)"):
        poll_array(_Answers([]), bad)  # type: ignore[arg-type]


class _Racing:
    """A client whose status table races kvd's writer (tests/helpers/racing_table.py)
    and whose socket answers every room it is asked :data:`SOCKET`."""

    ring = None
    SOCKET = int(KVPoll.WaitingForInput)

    def __init__(self, table: Any) -> None:
        self.table = table
        self.asked: list[int] = []

    def read_statuses(self, rooms: Any) -> Any:
        return self.table.read_statuses(rooms)

    def holds_refusals(self) -> bool:
        return False

    def ring_refused(self, rooms: Any) -> None:
        return None

    def call(self, call: Any) -> rpc.PollResult:
        self.asked += call.rooms
        return rpc.PollResult(statuses=[self.SOCKET] * len(call.rooms), releasable=[])


@settings(max_examples=200)
@given(data=st.data())
def test_poll_array_asks_the_socket_for_every_room_the_racing_table_does_not_answer(
        data: st.DataObject) -> None:
    """poll_array over a table whose writes land between and across its gathers (any
    ids, either way of a bucket, torn writes): each room reads a status a slot naming it
    held during the read, or the socket's answer -- asked for exactly those rooms; no
    room gets another room's status."""
    from kvd.protocol.table import StatusTable, table_bytes
    from tests.helpers import racing_table as racing

    rooms = data.draw(st.lists(st.one_of(st.integers(0, 15), st.integers(0, 2**64 - 1)),
                               min_size=1, max_size=40, unique=True))
    tab = StatusTable.create(bytearray(table_bytes(8)), 8)
    slots, rec = racing.writer(tab)
    calls = st.lists(st.tuples(st.sampled_from(rooms), st.sampled_from([-1, 0, 1, 2, 3, 4]),
                               st.booleans()), max_size=16)
    for part in range(2):
        for room, status, free in data.draw(calls):
            slots.place(room)
            slots.publish(room, status, free)
        if part == 0:
            racing.run(rec.take())  # the rooms landed; the next writes race the poll
    stores = rec.take()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stores)), max_size=12)))
    race = racing.Race(tab, [stores[a:b] for a, b in zip([0, *cuts], cuts, strict=False)])
    client = _Racing(tab)
    got = poll_array(client, np.array(rooms, dtype=np.uint64)).tolist()  # type: ignore[arg-type]
    race.done()
    for room, status in zip(rooms, got, strict=True):
        if room in client.asked:
            assert status == _Racing.SOCKET
        else:
            assert status in {s for s, _ in race.seen.get(room, set())}, (room, status)
    assert len(client.asked) == len(set(client.asked))
    if race.quiet:
        assert set(client.asked) == {r for r in rooms if r not in race.seen}


@pytest.mark.parametrize("good", [[0, 2**64 - 1], np.array([0, 2**63 - 1], dtype=np.int64),
                                  np.array([7, 2**32], dtype=np.uint64),
                                  np.array([3], dtype=np.uint8), np.array([0, 2**64 - 1],
                                                                         dtype=object),
                                  (4, 5), np.zeros(0)])
def test_poll_array_takes_every_uint64_whatever_carries_it(good: Any) -> None:
    """Ids at their bounds (0, 2**63 - 1, 2**64 - 1) in a list, a tuple, an array of any
    integer dtype or of Python ints, are asked exactly."""
    asked = []

    class Asking(_Answers):
        def call(self, call: rpc.Poll) -> rpc.PollResult:
            asked.extend(call.rooms)
            return rpc.PollResult(statuses=[UNKNOWN_ROOM] * len(call.rooms))

    assert poll_array(Asking([]), good).tolist() == [UNKNOWN_ROOM] * len(good)
    assert asked == [int(x) for x in good]
