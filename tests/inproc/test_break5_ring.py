"""Adversarial checks of the submission ring (issue 21): a full ring of the largest
capacity at a drop (every record runs, before the reconnect's registration answers, at
most a batch a loop turn: K41), duplicate creates interleaved with clears of the live
room."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from kvd.engine_rpc.ring import BATCH
from kvd.engine_rpc.server import Connection
from kvd.protocol import rpc
from tests.inproc.harness import Cluster
from tests.inproc.test_ring import RingEngine
from tests.inproc.test_ring_break import ring_record

BOOTSTRAPPING, FAILED = 1, 0


async def test_a_full_ring_of_the_largest_capacity_runs_at_the_drop(cluster: Cluster) -> None:
    """4096 records published, kvd never woken, then the connection drops and the engine
    reconnects: every one runs (creates, and inits refused that fail their rooms) before
    the reconnect's registration answers."""
    cap = rpc.MAX_RING_CAPACITY
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe, capacity=cap, record_bytes=rpc.MIN_RING_RECORD)
    try:
        rooms = list(range(100, 100 + cap // 2))
        for r in rooms:
            assert ring.out.push(ring_record(ring, rpc.SenderCreate(room=r))) is not None
            assert ring.out.push(ring_record(
                ring, rpc.SenderInit(room=r, num_pages=-1, aux_index=0))) is not None
        assert ring.out.push(ring_record(ring, rpc.SenderCreate(room=1))) is None  # full
        t0 = time.perf_counter()
        await pe.reconnect()
        took = time.perf_counter() - t0
        print(f"finish of {cap} records: {took * 1e3:.1f} ms")
        assert ring.sub.tail == ring.out.head == cap
        polled = p.side.poll(rooms)
        assert polled.statuses == [FAILED] * len(rooms)
    finally:
        ring.close()


async def test_k41_a_drop_runs_a_full_ring_in_slices_of_one_batch_a_loop_turn(
        cluster: Cluster) -> None:
    """4096 creates published, kvd never woken, then the connection drops: no loop turn
    (the drop's own included) runs more than BATCH of them, and every one runs, in
    order, within a bounded number of turns."""
    cap = rpc.MAX_RING_CAPACITY
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe, capacity=cap, record_bytes=rpc.MIN_RING_RECORD)
    try:
        for r in range(100, 100 + cap):
            assert ring.out.push(ring_record(ring, rpc.SenderCreate(room=r))) is not None
        pe.disconnect()  # kvd notices the drop on its loop: this turn
        ran = [ring.sub.tail]
        while ring.sub.tail < cap and len(ran) < 4 * cap // BATCH:
            await asyncio.sleep(0)  # one loop turn
            ran.append(ring.sub.tail)
        steps = [b - a for a, b in itertools.pairwise(ran)]
        print(f"records a loop turn at the drop: {ran[0]}, then {steps}")
        assert ring.sub.tail == cap
        assert max([ran[0], *steps]) <= BATCH, f"{max(steps)} records ran in one loop turn"
        rooms = list(range(100, 100 + cap))
        assert p.side.poll(rooms).statuses == [BOOTSTRAPPING] * cap
    finally:
        ring.close()


async def test_duplicate_creates_interleaved_with_clears_of_the_live_room(
        cluster: Cluster) -> None:
    """Room 9 lives (over the socket). Through the ring: a duplicate create and an init
    depending on it, the live room's own init and Clear, a create of a new incarnation and
    its init depending on it, then another duplicate create whose abort depends on it.
    The duplicates and their calls are refused and act on no room; the live room's calls
    and the new incarnation's run, in order."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe)
    try:
        await pe.call(rpc.SenderCreate(room=9))
        dup = ring.push(rpc.SenderCreate(room=9), wake=False)
        bad_init = ring.push(rpc.SenderInit(room=9, num_pages=2, aux_index=0), depends=dup,
                             wake=False)
        live_init = ring.push(rpc.SenderInit(room=9, num_pages=1, aux_index=0), wake=False)
        clear = ring.push(rpc.Clear(room=9), wake=False)
        new = ring.push(rpc.SenderCreate(room=9), wake=False)
        new_init = ring.push(rpc.SenderInit(room=9, num_pages=3, aux_index=1), depends=new,
                             wake=False)
        dup2 = ring.push(rpc.SenderCreate(room=9), wake=False)
        bad_abort = ring.push(rpc.Abort(room=9, reason="dup's abort"), depends=dup2)
        await ring.drained()
        ring.collect()
        assert not ring.outcome(dup)[0] and not ring.outcome(bad_init)[0]
        assert ring.outcome(live_init)[0] and ring.outcome(clear)[0]
        assert ring.outcome(new)[0] and ring.outcome(new_init)[0]
        assert not ring.outcome(dup2)[0] and not ring.outcome(bad_abort)[0]
        assert p.side.poll([9]).statuses == [BOOTSTRAPPING]  # the new incarnation, unaborted
        with pytest.raises(Exception, match="num_pages 3"):  # inited by new_init, not dup's
            await pe.call(rpc.SenderInit(room=9, num_pages=2, aux_index=1))
    finally:
        ring.close()


async def test_k27_a_reconnect_kvd_sees_before_the_drop_runs_the_old_ring_first(
        cluster: Cluster) -> None:
    """The engine published an Abort of room 5 on its ring, its connection dropped, and it
    reconnected: kvd reads the new connection's registration, Clear and create of room 5
    before it notices the old connection closed (two sockets: either may be read first).
    The engine made the Abort first, so it must act on the old room 5, never on the new
    incarnation created after the Clear."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe)
    try:
        ring.push(rpc.SenderCreate(room=5))
        await ring.drained()
        ring.out.push(ring_record(ring, rpc.Abort(room=5, reason="the old abort")))
        old = pe.conn
        pe.conn = Connection(next(cluster._conns))  # the reconnect, read first
        await pe.call(pe.pool.registration)
        await pe.call(rpc.Clear(room=5))
        await pe.call(rpc.SenderCreate(room=5))
        for cb in old.on_close:  # kvd notices the old connection's end only now
            cb()
        assert ring.sub.tail == ring.out.head
        polled = p.side.poll([5])
        assert polled.statuses == [BOOTSTRAPPING], polled.reasons
    finally:
        ring.close()
