"""The engine channel (issue 21) from a buggy or hostile engine's side, in process: the
order of ring and socket calls past one drain batch, records published just before the
connection drops, and the status table for room ids at the top of the 64-bit range and
for a room id cleared and used again."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.engine_rpc.ring import BATCH
from kvd.protocol import codec, rpc
from tests.inproc.harness import Cluster, settle
from tests.inproc.test_ring import RingEngine

BOOTSTRAPPING, FAILED, UNKNOWN = 1, 0, -1


async def test_a_socket_call_runs_after_every_record_published_before_it(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe, capacity=1024, record_bytes=512)
    try:  # (the harness's call drains twice: dispatch, then dispatch_now; the server once)
        rooms = list(range(1000, 1000 + 2 * BATCH + 44))
        for r in rooms:  # published; kvd not woken: the next socket call must run them first
            assert ring.out.push(ring_record(ring, rpc.SenderCreate(room=r))) is not None
        # the engine's last call of the step: an init too large for a record, over the socket
        await pe.call(rpc.SenderInit(room=rooms[-1], num_pages=1, aux_index=0))
        assert p.side.poll(rooms).statuses == [BOOTSTRAPPING] * len(rooms)
    finally:
        ring.close()


async def test_records_published_before_the_connection_drops_are_run(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe)
    try:
        ring.push(rpc.SenderCreate(room=5))
        await ring.drained()
        ring.out.push(ring_record(ring, rpc.Abort(room=5, reason="the engine's abort")))
        await pe.reconnect()  # published, then the connection dropped before kvd woke
        await settle(cluster)
        assert p.side.poll([5]).statuses == [FAILED]
    finally:
        ring.close()


def ring_record(ring: RingEngine, call: rpc.Call) -> bytes:
    return codec.encode(rpc.Request(id=ring.out.head, call=call))


TOP = [2**64 - 1, 2**63, 2**63 + 1, 2**64 - 2]


async def test_the_table_answers_room_ids_at_the_top_of_the_64_bit_range(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    for r in TOP:
        await pe.call(rpc.SenderCreate(room=r))
    table = p.daemon.status_table.table
    statuses, _, hit = table.read(np.array(TOP, dtype=np.uint64))
    assert hit.all() and statuses.tolist() == [BOOTSTRAPPING] * len(TOP)
    assert [table.read_one(r) for r in TOP] == [(BOOTSTRAPPING, True)] * len(TOP)
    await pe.call(rpc.Abort(room=TOP[0], reason="x"))
    await settle(cluster)
    assert table.read_one(TOP[0]) == (FAILED, True) == (p.side.poll([TOP[0]]).statuses[0], True)
    assert [table.read_one(r) for r in TOP[1:]] == [(BOOTSTRAPPING, True)] * 3


async def test_a_room_id_cleared_and_used_again_reads_its_new_room_never_the_old(
        cluster: Cluster) -> None:
    """Room 7 fails, is cleared (the table answers unknown) and is created again: the
    table answers the new room's state at every step, never the old room's Failed; a room
    id never created is not answered (the socket is asked)."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    table = p.daemon.status_table.table
    await pe.call(rpc.SenderCreate(room=7))
    await pe.call(rpc.SenderInit(room=7, num_pages=1, aux_index=0))
    await pe.call(rpc.Abort(room=7, reason="the engine's"))
    await settle(cluster)
    assert table.read_one(7) == (FAILED, True) == (p.side.poll([7]).statuses[0], True)
    await pe.call(rpc.Clear(room=7))
    polled = p.side.poll([7])
    assert polled.statuses == [UNKNOWN]
    assert table.read_one(7) in (None, (UNKNOWN, 7 in polled.releasable))
    await pe.call(rpc.SenderCreate(room=7))
    assert table.read_one(7) == (BOOTSTRAPPING, True)  # a prefill's pages: always
    assert table.read_one(8) is None and table.read_one(7 + table.nbuckets) is None


# ---- a lying engine: each kind of bad record or cursor, one at a time ------------------


def _lie(ring: RingEngine, how: str) -> None:
    """Publish (or fake) the next record in a way kvd must not believe."""
    from kvd.protocol.ring import RECORD_HEAD
    sub, at = ring.sub, ring.sub._at(ring.out.head)
    good = ring_record(ring, rpc.SenderCreate(room=77))
    if how == "id_mismatch":
        ring.out.push(codec.encode(rpc.Request(id=ring.out.head + 5,
                                               call=rpc.SenderCreate(room=77))))
        return
    if how in ("head_back", "head_jump"):
        ring.out.push(good)
        sub.publish_head(ring.out.head - 3 if how == "head_back"
                         else ring.out.head + sub.capacity + 1)
        return
    ring.out.push(good)
    if how == "length_over":
        sub.mv[at + 8:at + 12] = (sub.max_payload + 1).to_bytes(4, "little")
    elif how == "length_short":
        sub.mv[at + 8:at + 12] = (len(good) - 3).to_bytes(4, "little")
    elif how == "seq_ahead":
        sub.mv[at:at + 8] = (ring.out.head + 7).to_bytes(8, "little")
    elif how == "seq_back":
        sub.mv[at:at + 8] = (ring.out.head - 2).to_bytes(8, "little")
    assert RECORD_HEAD == 16


LIES = ["id_mismatch", "head_back", "head_jump", "length_over", "length_short", "seq_ahead",
        "seq_back"]


@pytest.mark.parametrize("how", LIES)
async def test_each_lie_fails_only_the_channel_and_the_rooms_it_carried(
        cluster: Cluster, how: str) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe, capacity=8, record_bytes=512)
    try:
        await pe.call(rpc.SenderCreate(room=50))  # the socket's room
        for r in (2, 3):
            ring.push(rpc.SenderCreate(room=r))
        await ring.drained()
        _lie(ring, how)
        ring.wake()
        await settle(cluster)
        channel = p.daemon.rings[pe.conn.id]
        assert channel.failed and ring.sub.closed and ring.comp.closed, how
        assert p.side.poll([2, 3, 77]).statuses in ([FAILED, FAILED, UNKNOWN],)
        assert (await pe.call(rpc.Poll(rooms=[50]))).statuses == [BOOTSTRAPPING]
        await pe.call(rpc.SenderCreate(room=51))  # the socket still serves new rooms
        assert p.side.poll([51]).statuses == [BOOTSTRAPPING]
    finally:
        ring.close()


# ---- what the order and drop rules need ---------------------------------------------------


async def test_a_socket_call_meeting_a_full_completion_ring_fails_the_channel_naming_why(
        cluster: Cluster) -> None:
    """An engine that reads no completion and then makes a socket call with records still
    unrun: kvd cannot run them in order (the completion ring is full and the engine,
    blocked in its call, will not read it), so the channel fails naming why, the rooms it
    carried are aborted, and the socket call is answered -- no deadlock."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe, capacity=4, record_bytes=512)
    try:
        ring.push(rpc.SenderCreate(room=30))
        await ring.drained()
        for i in range(4):  # unknown rooms: four refusals fill the completion ring
            ring.push(rpc.SenderInit(room=100 + i, num_pages=1, aux_index=0))
        await ring.drained()
        assert ring.comp.head - ring.comp.tail == 4
        ring.out.push(ring_record(ring, rpc.SenderCreate(room=31)))  # unwoken
        polled = await pe.call(rpc.Poll(rooms=[30, 31]))  # answered, not held
        channel = p.daemon.rings[pe.conn.id]
        assert "completion ring was full" in channel.failed and "1 records unrun" in \
            channel.failed
        assert ring.sub.closed and ring.comp.closed and ring.sub.tail == 5
        assert polled.statuses == [FAILED, UNKNOWN]  # the carried room aborted; 31 never ran
        assert "completion ring was full" in p.side.poll([30]).reasons[30]
    finally:
        ring.close()


async def test_a_call_refused_after_the_drop_fails_its_room_naming_the_call(
        cluster: Cluster) -> None:
    """An init published just before the drop that kvd refuses when it runs it (a page
    count out of bounds: over the socket the room would stay Bootstrapping and the engine
    would raise): nobody reads the refusal, so the room fails, its reason naming the
    refused call; the engine's abort of another room runs, and a create after them makes
    its room, kept as K27 keeps rooms for an engine reconnecting within the grace."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe)
    try:
        for r in (5, 6):
            ring.push(rpc.SenderCreate(room=r))
        await ring.drained()
        ring.out.push(ring_record(ring, rpc.SenderInit(room=5, num_pages=-1, aux_index=0)))
        ring.out.push(ring_record(ring, rpc.Abort(room=6, reason="x")))
        ring.out.push(ring_record(ring, rpc.SenderCreate(room=7)))
        await pe.reconnect()
        assert ring.sub.tail == ring.out.head and ring.sub.closed
        assert ring.comp.head == 0  # no refusal written: nobody reads it
        polled = p.side.poll([5, 6, 7])
        assert polled.statuses == [FAILED, FAILED, BOOTSTRAPPING]
        assert "SenderInit was refused after its connection dropped" in polled.reasons[5]
        assert "num_pages -1" in polled.reasons[5]
        assert polled.reasons[6].endswith(": x")
    finally:
        ring.close()


async def test_a_create_refused_after_the_drop_leaves_the_live_room_alone(
        cluster: Cluster) -> None:
    """A duplicate create published before the drop, and an init that depends on it: kvd
    refuses both when it runs them at the drop, and fails no room for them (the id's live
    room is another incarnation's), which goes on."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe)
    try:
        await pe.call(rpc.SenderCreate(room=9))  # the live room, over the socket
        dup = ring.out.push(ring_record(ring, rpc.SenderCreate(room=9)))
        assert dup is not None
        ring.out.push(ring_record(ring, rpc.SenderInit(room=9, num_pages=1, aux_index=0)),
                      after=ring.out.head - dup)
        await pe.reconnect()
        assert ring.sub.tail == ring.out.head
        assert p.side.poll([9]).statuses == [BOOTSTRAPPING]
    finally:
        ring.close()


async def test_a_record_kvd_cannot_trust_at_the_drop_fails_the_rooms_the_ring_carried(
        cluster: Cluster) -> None:
    """Garbage published before the drop: the records before it run, then the channel
    fails as when live (the rooms it carried aborted), so nothing after it is lost
    silently either."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe)
    try:
        ring.push(rpc.SenderCreate(room=3))
        await ring.drained()
        ring.out.push(ring_record(ring, rpc.SenderCreate(room=4)))
        ring.out.push(b"not a frame")
        ring.out.push(ring_record(ring, rpc.SenderCreate(room=5)))
        await pe.reconnect()
        polled = p.side.poll([3, 4, 5])
        assert polled.statuses == [FAILED, FAILED, UNKNOWN]
        assert "engine ring failed" in polled.reasons[3]
    finally:
        ring.close()


async def test_a_refusal_the_engine_never_read_fails_its_room_at_the_drop(
        cluster: Cluster) -> None:
    """Refusals kvd wrote before the drop: one the engine read (its client keeps it) is
    left to the engine; one it never read fails its room, naming it; one whose room a
    later call named (cleared and created again) fails nothing -- the engine went on
    with the id."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe)
    try:
        for r in (5, 6, 7):
            ring.push(rpc.SenderCreate(room=r))
        ring.push(rpc.SenderInit(room=7, num_pages=-1, aux_index=0))
        await ring.drained()
        ring.collect()  # read: the engine's client keeps it for room 7
        ring.push(rpc.SenderInit(room=5, num_pages=-1, aux_index=0))
        ring.push(rpc.SenderInit(room=6, num_pages=-1, aux_index=0))
        ring.push(rpc.Clear(room=6))
        ring.push(rpc.SenderCreate(room=6))
        await ring.drained()
        assert ring.comp.head - ring.comp.tail == 2  # two refusals, not read
        await pe.reconnect()
        polled = p.side.poll([5, 6, 7])
        assert polled.statuses == [FAILED, BOOTSTRAPPING, BOOTSTRAPPING]
        assert "SenderInit was refused and its connection dropped before it read" in \
            polled.reasons[5] and "num_pages -1" in polled.reasons[5]
    finally:
        ring.close()
