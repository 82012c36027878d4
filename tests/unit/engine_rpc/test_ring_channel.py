"""kvd's end of a ring (``RingChannel``) against the engine's (``EngineRing``), in one
process without a loop: drained by hand, the handler a stub."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from kvd.client.ring import DaemonGone, EngineRing, RingClosed
from kvd.engine_rpc import ring as kvd_ring
from kvd.engine_rpc.ring import RingChannel
from kvd.errors import RoomError
from kvd.protocol import rpc

NO = 1 << 40


class Kvd:
    """A stub daemon: refuses rooms from :data:`NO` on (with ``why``), forgets cleared
    ones."""

    def __init__(self) -> None:
        self.ran: list[rpc.Call] = []
        self.held: set[int] = set()
        self.failed: list[tuple[set[int], str]] = []
        self.why = "no"
        self.clearable: set[int] = set()  # refused rooms whose Clear still runs

    def handle(self, call: Any) -> None:
        self.ran.append(call)
        if call.room >= NO and not (isinstance(call, rpc.Clear) and call.room in self.clearable):
            raise RoomError(f"room {call.room}: {self.why}")
        if isinstance(call, rpc.Clear):
            self.held.discard(call.room)
        else:
            self.held.add(call.room)


@pytest.fixture
def pair() -> Iterator[tuple[Kvd, RingChannel, EngineRing]]:
    kvd = Kvd()
    channel = RingChannel(8, 512, kvd.handle, lambda rooms, why: kvd.failed.append(
        (rooms, why)), lambda room: room in kvd.held)
    a, b = socket.socketpair()
    engine = EngineRing(channel.result(), [os.dup(fd) for fd in channel.fds], a.fileno())
    yield kvd, channel, engine
    engine.close()
    channel.close()
    a.close()
    b.close()


def submit(engine: EngineRing, call: Any) -> int:
    data = engine.encode(call)
    assert data is not None
    return engine.submit(data, call.room, timeout=1.0)


def test_calls_run_in_order_and_only_refusals_come_back(
        pair: tuple[Kvd, RingChannel, EngineRing]) -> None:
    kvd, channel, engine = pair
    seqs = [submit(engine, rpc.SenderCreate(room=r)) for r in (1, NO, 3)]
    assert not any(engine.done(s) for s in seqs)
    channel.drain()
    assert [c.room for c in kvd.ran] == [1, NO, 3]  # type: ignore[attr-defined]
    assert all(engine.done(s) for s in seqs) and engine.drained()
    assert engine.result_of(seqs[0]) is None
    assert isinstance(engine.refused.pop(NO), RoomError)  # kept by room: nobody waited
    assert channel.sub.sleeping  # drained: kvd asks to be woken next time


def test_a_waited_refusal_is_returned_not_kept(pair: tuple[Kvd, RingChannel, EngineRing]
                                              ) -> None:
    _kvd, channel, engine = pair
    seq = submit(engine, rpc.Clear(room=NO + 4))
    channel.drain()
    engine.wait_done(seq, 1.0)  # done already: no wait
    refusal = engine.result_of(seq)
    assert isinstance(refusal, RoomError) and str(NO + 4) in str(refusal)
    assert engine.refused == {}


def test_an_unwaited_clear_drops_its_rooms_kept_refusal_once_run_unless_refused(
        pair: tuple[Kvd, RingChannel, EngineRing]) -> None:
    """P9: a Clear nobody waited for (noted in ``clearing``) that kvd ran drops the
    refusal kept for its room from calls before it, and a later call's refusal of the
    same id is kept; a Clear kvd refused leaves its room's refusal (the room reads
    Failed)."""
    kvd, channel, engine = pair
    kvd.clearable.add(NO + 1)
    submit(engine, rpc.SenderCreate(room=NO + 1))  # refused
    submit(engine, rpc.SenderCreate(room=NO + 2))  # refused
    for room in (NO + 1, NO + 2):  # the first runs, the second is refused
        engine.clearing[submit(engine, rpc.Clear(room=room))] = room
    channel.drain()
    kvd.why = "the later room"
    submit(engine, rpc.SenderCreate(room=NO + 1))  # reads the completions first
    channel.drain()
    engine.collect()
    assert engine.cleared == [NO + 1] and engine.clearing == {}
    assert set(engine.refused) == {NO + 1, NO + 2}
    assert "the later room" in str(engine.refused[NO + 1])  # not the cleared room's
    assert str(engine.refused[NO + 2]).endswith(": no")  # kept: its Clear was refused


def test_a_refusal_longer_than_a_record_is_cut_to_fit(
        pair: tuple[Kvd, RingChannel, EngineRing]) -> None:
    kvd, channel, engine = pair
    kvd.why = "x" * 5000  # a record is 512 bytes
    seq = submit(engine, rpc.SenderCreate(room=NO))
    channel.drain()
    refusal = engine.result_of(seq)
    assert isinstance(refusal, RoomError) and str(refusal).startswith(f"room {NO}: xxx")


def test_a_full_completion_ring_stops_kvd_until_the_engine_reads_it(
        pair: tuple[Kvd, RingChannel, EngineRing]) -> None:
    kvd, channel, engine = pair
    for r in range(NO, NO + 8):  # eight refusals fill the completion ring
        submit(engine, rpc.SenderCreate(room=r))
    channel.drain()
    ok = [submit(engine, rpc.SenderCreate(room=r)) for r in (5, 6)]  # collects first
    assert len(engine.refused) == 8
    channel.drain()
    assert all(engine.done(s) for s in ok) and len(kvd.ran) == 10


def test_the_rooms_a_ring_carried_are_pruned_of_those_kvd_forgot(
        pair: tuple[Kvd, RingChannel, EngineRing]) -> None:
    """The set the channel fails on its end stays bounded by kvd's own rooms."""
    kvd, channel, engine = pair
    for room in range(3 * kvd_ring.PRUNE_AT):
        submit(engine, rpc.SenderCreate(room=room))
        kvd.held.discard(room - 1)  # kvd forgets the one before
        channel.drain()
        assert len(channel.rooms) <= kvd_ring.PRUNE_AT + 3  # 2 x the one kvd holds + 1
    assert 3 * kvd_ring.PRUNE_AT - 1 in channel.rooms


def test_a_failed_channel_is_closed_for_the_engine_and_tells_once(
        pair: tuple[Kvd, RingChannel, EngineRing]) -> None:
    kvd, channel, engine = pair
    submit(engine, rpc.SenderCreate(room=7))
    channel.drain()
    engine.out.push(b"garbage")
    channel.drain()
    channel.drain()
    assert kvd.failed == [({7}, "not a kvd frame (bad magic)")]
    with pytest.raises(RingClosed):
        submit(engine, rpc.SenderCreate(room=8))
    assert len(kvd.ran) == 1


def test_a_wait_ends_when_kvd_closes_its_end_of_the_socket() -> None:
    kvd = Kvd()
    channel = RingChannel(8, 512, kvd.handle, lambda *_: None, lambda room: True)
    a, b = socket.socketpair()
    engine = EngineRing(channel.result(), [os.dup(fd) for fd in channel.fds], a.fileno())
    try:
        seq = submit(engine, rpc.SenderCreate(room=1))  # never drained: kvd "died"
        b.close()
        with pytest.raises(DaemonGone):
            engine.wait_done(seq, 5.0)
    finally:
        engine.close()
        channel.close()
        a.close()


def test_a_record_goes_in_only_while_unread_completions_and_unrun_records_leave_a_slot(
        pair: tuple[Kvd, RingChannel, EngineRing], monkeypatch: pytest.MonkeyPatch) -> None:
    """kvd's catch-up before a socket call runs every published record and cannot wait
    for a completion to be read. With the client's socket and ring under locks of their
    own, a socket call of another thread can reach kvd at any point of a ring call: the
    bound must hold at every publication. Here the ring is full of calls kvd refuses and
    kvd runs one between the engine's read of the completions and its push. Before, the
    record went into the slot that run freed: unread completions plus unrun records came
    to capacity + 1, and the catch-up met a full completion ring and failed the channel
    (aborting its rooms). Now the engine publishes only into a slot free before its read,
    and every refusal comes back."""
    _kvd, channel, engine = pair
    for i in range(8):
        submit(engine, rpc.SenderCreate(room=NO + i))
    collect_new = engine.collect_new

    def kvd_runs_one_after() -> None:
        collect_new()
        channel._run(1)

    monkeypatch.setattr(engine, "collect_new", kvd_runs_one_after)
    submit(engine, rpc.SenderCreate(room=NO + 8))
    monkeypatch.undo()
    channel.catch_up()
    assert not channel.failed and engine.drained()
    engine.collect()
    assert sorted(engine.refused) == [NO + i for i in range(9)]
