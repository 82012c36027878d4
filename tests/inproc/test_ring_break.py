"""The engine channel (issue 21) from a buggy or hostile engine's side, in process: the
order of ring and socket calls past one drain batch, records published just before the
connection drops, and the status table for room ids at the top of the 64-bit range and
for a room id cleared and used again."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.engine_rpc.ring import BATCH
from kvd.errors import RoomError
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
