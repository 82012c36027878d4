"""The shared status table's layout (issue 21, step A): what a reader takes from a slot,
and what it refuses (torn, reused, foreign, stale). PURE: tables over bytearrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvd.errors import ProtocolError
from kvd.protocol import table as t
from kvd.protocol.table import SlotMap, StatusTable, pack, table_bytes
from tests.helpers import racing_table as racing

STATUSES = st.sampled_from([-1, 0, 1, 2, 3, 4])
ROOMS = st.integers(0, 2**64 - 1)


def new(nslots: int = 16) -> StatusTable:
    return StatusTable.create(bytearray(table_bytes(nslots)), nslots, pid=7)


def ids(*rooms: int) -> np.ndarray:
    return np.array(rooms, dtype=np.uint64)


@given(room=ROOMS, status=STATUSES, releasable=st.booleans(),
       nslots=st.sampled_from([2, 4, 16, 1024]))
def test_a_published_room_reads_back_its_status(room: int, status: int, releasable: bool,
                                                nslots: int) -> None:
    tab = new(nslots)
    tab.write(tab.slot_of(room), room, pack(status, releasable))
    statuses, free, hit = tab.read(ids(room))
    assert hit.tolist() == [True]
    assert int(statuses[0]) == status and bool(free[0]) is releasable
    assert tab.read_one(room) == (status, releasable)


@given(room=ROOMS, other=ROOMS, status=STATUSES)
def test_a_slot_holding_another_room_is_a_miss(room: int, other: int, status: int) -> None:
    tab = new(16)
    for slot in tab.bucket(room):
        tab.write(slot, other, pack(status, True))
    assert tab.read(ids(room))[2][0] == (other == room)
    assert (tab.read_one(room) is not None) == (other == room)


@given(room=ROOMS, status=STATUSES, releasable=st.booleans(), way=st.integers(0, 1))
def test_a_room_is_read_from_whichever_slot_of_its_bucket_holds_it(
        room: int, status: int, releasable: bool, way: int) -> None:
    tab = new(16)
    slots = tab.bucket(room)
    tab.write(slots[1 - way], room ^ 1 << 40, pack(2, False))  # a neighbour
    tab.write(slots[way], room, pack(status, releasable))
    statuses, free, hit = tab.read(ids(room))
    assert hit[0] and (int(statuses[0]), bool(free[0])) == (status, releasable)
    assert tab.read_one(room) == (status, releasable)


def test_an_empty_table_answers_nothing_not_even_room_zero() -> None:
    tab = new(16)
    assert not tab.read(ids(0, 1, 2**64 - 1))[2].any()
    assert tab.read_one(0) is None and tab.read_one(2**64 - 1) is None


@given(room=ROOMS, status=STATUSES)
def test_a_slot_being_written_is_a_miss(room: int, status: int) -> None:
    """gen odd (the writer is between its two gen stores): never read."""
    tab = new(16)
    tab.write(tab.slot_of(room), room, pack(status, True))
    tab.heads[tab.slot_of(room)] += np.uint64(1 << t.GEN_SHIFT)
    assert not tab.read(ids(room))[2][0]
    assert tab.read_one(room) is None


@given(room=ROOMS, before=STATUSES, after=STATUSES, writes=st.integers(1, 3))
def test_a_write_between_a_readers_two_loads_is_a_miss(room: int, before: int, after: int,
                                                       writes: int) -> None:
    """The seqlock: fields gathered, then the slot rewritten (any number of times,
    even back to the same values), then gen re-read: the reader sees a miss, never
    a mixture."""
    tab = new(16)
    slot = tab.slot_of(room)
    tab.write(slot, room, pack(before, False))
    rooms = ids(room)
    at = tab.buckets_of(rooms)
    heads, held = tab.head_rows.take(at, axis=0), tab.room_rows.take(at, axis=0)
    for _ in range(writes):
        tab.write(slot, room, pack(after, True))
    assert not tab.check(rooms, heads, held, tab.head_rows.take(at, axis=0)).any()


@given(room=ROOMS, before=STATUSES, after=STATUSES, other=ROOMS)
def test_a_slot_handed_to_another_room_mid_read_is_a_miss(room: int, before: int,
                                                          after: int, other: int) -> None:
    """The slot is rewritten for another room between the head and room loads (and
    perhaps back): the heads differ, so neither room's status is taken from it."""
    tab = new(16)
    slot = tab.slot_of(room)
    tab.write(slot, room, pack(before, False))
    rooms = ids(room)
    at = tab.buckets_of(rooms)
    heads = tab.head_rows.take(at, axis=0)
    tab.write(slot, other, pack(after, True))
    held = tab.room_rows.take(at, axis=0)
    tab.write(slot, room, pack(before, False))
    assert not tab.check(rooms, heads, held, tab.head_rows.take(at, axis=0)).any()


@given(rooms=st.lists(ROOMS, min_size=1, max_size=50, unique=True), data=st.data())
def test_many_rooms_read_in_one_gather_as_one_by_one(rooms: list[int],
                                                     data: st.DataObject) -> None:
    tab = new(64)
    for room in rooms:
        if data.draw(st.booleans()):
            tab.write(tab.slot_of(room), room, pack(data.draw(STATUSES), data.draw(st.booleans())))
    together = tab.read(ids(*rooms))
    for i, room in enumerate(rooms):
        alone = tab.read(ids(room))
        assert [a[0] for a in alone] == [x[i] for x in together] or not alone[2][0]
        assert alone[2][0] == together[2][i]


def test_open_reads_back_a_created_table() -> None:
    buf = bytearray(table_bytes(8))
    made = StatusTable.create(buf, 8)
    made.write(made.slot_of(3) + 1, 3, pack(4, True))
    tab = StatusTable.open(buf)
    assert tab.nslots == 8 and tab.read(ids(3))[0][0] == 4


@pytest.mark.parametrize(("word", "value"), [
    (0, 0), (0, t.MAGIC + 1), (1, t.VERSION + 1), (2, 0), (2, 1), (2, 3),
    (2, t.MAX_SLOTS * 2), (2, 1024)])  # 1024 slots do not fit the 8-slot buffer
def test_open_refuses_a_header_that_does_not_check_out(word: int, value: int) -> None:
    buf = bytearray(table_bytes(8))
    StatusTable.create(buf, 8)
    np.frombuffer(buf, dtype="<u8")[word] = value
    with pytest.raises(ProtocolError):
        StatusTable.open(buf)


@settings(max_examples=200)
@given(buf=st.binary(max_size=512))
def test_open_of_any_bytes_is_a_table_or_a_protocol_error(buf: bytes) -> None:
    try:
        tab = StatusTable.open(bytearray(buf))
    except ProtocolError:
        return
    assert table_bytes(tab.nslots) <= len(buf)


def test_open_refuses_a_buffer_shorter_than_the_header() -> None:
    with pytest.raises(ProtocolError, match="shorter"):
        StatusTable.open(bytearray(16))


@pytest.mark.parametrize("nslots", [0, 1, 3, 6, t.MAX_SLOTS * 2])
def test_a_table_has_a_power_of_two_of_slots(nslots: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        table_bytes(nslots)


def test_pack_refuses_a_value_that_is_no_status() -> None:
    with pytest.raises(ValueError, match="none of"):
        pack(5, True)


def test_a_table_is_fresh_while_its_writer_beats_and_until_closed() -> None:
    tab = new()
    tab.beat(1_000)
    assert tab.fresh(1_000 + t.DEFAULT_STALE_NS)
    assert not tab.fresh(1_001 + t.DEFAULT_STALE_NS)
    assert tab.fresh(5_000, stale_ns=4_000)
    tab.close()
    assert not tab.fresh(1_000)


class SlotMachine(RuleBasedStateMachine):
    """The writer's slot map against a model: a room the map says it holds reads back
    its last published status; a room another known room's slot holds is never read."""

    def __init__(self) -> None:
        super().__init__()
        self.map = SlotMap(new(4))
        self.last: dict[int, tuple[int, bool]] = {}

    @rule(room=st.integers(0, 15))
    def place(self, room: int) -> None:
        had = self.map.holds(room)
        others = [self.map.holder.get(s) for s in self.map.table.bucket(room)]
        free = [o for o in others if o is None or o not in self.map.known]
        took = self.map.place(room)
        assert took == (had or bool(free))
        if took and not had:
            self.last.pop(room, None)  # a fresh slot: nothing published for it yet
            if free[0] is not None:
                self.last.pop(free[0], None)  # evicted: no longer answered

    @rule(room=st.integers(0, 15), status=STATUSES, releasable=st.booleans())
    def publish(self, room: int, status: int, releasable: bool) -> None:
        if self.map.holds(room):
            self.last[room] = (status, releasable)
        self.map.publish(room, status, releasable)

    @invariant()
    def reads_match(self) -> None:
        together = self.map.table.read(ids(*range(16)))  # both ways, one gather each
        for room in range(16):
            alone = self.map.table.read_one(room)
            assert (alone is not None) == bool(together[2][room])
            if alone is not None:
                assert alone == (int(together[0][room]), bool(together[1][room]))
            statuses, free, hit = self.map.table.read(ids(room))
            if self.map.holds(room) and room in self.last:
                assert hit[0] and (int(statuses[0]), bool(free[0])) == self.last[room]
            else:
                assert not hit[0]

    @invariant()
    def one_known_room_per_slot(self) -> None:
        slots = [self.map.where[r] for r in self.map.known]
        assert len(slots) == len(set(slots))
        assert all(self.map.holder[s] == r for r, s in self.map.where.items())


TestSlotMachine = SlotMachine.TestCase


@settings(max_examples=300)
@given(data=st.data(), how=st.sampled_from(["read", "statuses", "few"]))
def test_a_read_racing_the_writer_answers_a_room_only_what_its_slot_held(
        data: st.DataObject, how: str) -> None:
    """Any ids, landed in either way of their bucket (kvd's own slot map places them),
    then kvd's writes -- publishes, rooms forgotten and their slots reused -- cut into
    single stores that land before, between and across the read's loads (the three
    gathers of the vectorised read, every word of the plain-Python one), a write torn
    anywhere: a room the read answers gets a status some slot naming it held while the
    read ran; every other room is a miss (the socket's), and with no store between the
    loads every room the table holds is answered."""
    rooms = data.draw(st.lists(st.one_of(st.integers(0, 15), ROOMS), min_size=1,
                               max_size=12 if how == "few" else 40, unique=True))
    tab = new(8)  # 4 buckets: rooms share buckets and land in either way
    slots, rec = racing.writer(tab)
    calls = st.lists(st.tuples(st.sampled_from(rooms), STATUSES, st.booleans()), max_size=16)
    for room, status, free in data.draw(calls):
        slots.place(room)
        slots.publish(room, status, free)
    racing.run(rec.take())
    for room, status, free in data.draw(calls):
        slots.place(room)
        slots.publish(room, status, free)
    stores = rec.take()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stores)), max_size=12)))
    race = racing.Race(tab, [stores[a:b] for a, b in zip([0, *cuts], cuts, strict=False)])
    asked = ids(*rooms)
    if how == "read":
        statuses, free_, hit = tab.read(asked)
        got = [(int(s), bool(f)) for s, f in zip(statuses, free_, strict=True)]
    else:
        if how == "few":
            listed, misses = tab.read_few(rooms)
            statuses = np.frombuffer(listed, dtype=np.int8)
        else:
            statuses, misses = tab.read_statuses(asked)
        hit = np.ones(len(rooms), dtype=bool)
        hit[list(misses)] = False
        got = [(int(s), None) for s in statuses]
    race.done()
    assert race.loads >= 3
    for i, room in enumerate(rooms):
        held = race.seen.get(room, set())
        if hit[i]:
            assert any(got[i][0] == s and got[i][1] in (None, f) for s, f in held), \
                (room, got[i], held)
        if race.quiet:
            assert bool(hit[i]) == bool(held)


@given(writes=st.lists(st.tuples(st.integers(0, 7), ROOMS, STATUSES, st.booleans()),
                       max_size=8))
def test_the_racing_writers_stores_end_where_write_ends(
        writes: list[tuple[int, int, int, bool]]) -> None:
    """The race above cuts :meth:`StatusTable.write` into its three stores: run whole,
    they leave the table byte for byte as ``write`` does."""
    whole, cut = new(8), new(8)
    for slot, room, status, free in writes:
        whole.write(slot, room, pack(status, free))
        racing.run(racing.stores(cut, slot, room, pack(status, free)))
    assert whole.words.tobytes() == cut.words.tobytes()
