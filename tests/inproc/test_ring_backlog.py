"""A dropped connection's ring runs in slices, ordered before the engine's later calls
(K41 with the ring's order rule, :class:`kvd.engine_rpc.ring.Backlog`), in process: the
records it holds run a batch a loop turn, the loop answers other work between slices,
and no call of the engine -- its reconnect's registration, a call over the new
connection, a call from any connection but ``Info`` -- runs before the last of them."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.client import KvdClient
from kvd.client.ring import EngineRing
from kvd.engine_rpc import ring as ring_module
from kvd.engine_rpc.ring import BATCH
from kvd.engine_rpc.server import LATER, Connection
from kvd.errors import KvdUnreachable
from kvd.protocol import rpc
from kvd.rooms import UNKNOWN_ROOM
from tests.inproc.harness import Cluster, Engine, settle
from tests.inproc.test_many import PREFILL_CALLS, decode_calls
from tests.inproc.test_ring import CREATES, RingEngine, socket_outcome, statuses
from tests.inproc.test_ring_break import ring_record

BOOTSTRAPPING = 1


async def test_k41_a_reconnect_runs_after_the_dropped_rings_records_while_they_run_in_slices(
        cluster: Cluster) -> None:
    """Room 5 lives. The engine's ring holds 1000 creates, then an Abort and a Clear of
    room 5, kvd never woken; the connection drops. Between slices another connection's
    ``Info`` is answered at once (the loop serves), while its ``Poll`` is held (an engine
    call). The engine reconnects mid-way and creates room 5 again: its registration
    answers only once every old record ran, the held Poll reads room 5 cleared (it ran
    after the Clear, not before the Abort), and the new room 5 is not aborted."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    await pe.call(rpc.SenderCreate(room=5))
    ring = await RingEngine.open(pe, capacity=1024, record_bytes=rpc.MIN_RING_RECORD)
    try:
        fill = list(range(1000, 2000))
        for r in fill:
            assert ring.out.push(ring_record(ring, rpc.SenderCreate(room=r))) is not None
        for call in (rpc.Abort(room=5, reason="the old abort"), rpc.Clear(room=5)):
            assert ring.out.push(ring_record(ring, call)) is not None
        head = ring.out.head
        pe.disconnect()
        other = Connection(next(cluster._conns))
        answered = []  # how many records had run when Info was answered
        while len(set(answered)) < 2:  # two slices ran (of four)
            assert p.daemon.dispatch_now(rpc.Info(), other)["status"] == "ok"
            assert p.daemon.dispatch_now(rpc.Poll(rooms=[5]), other) is LATER
            answered.append(ring.sub.tail)
            await asyncio.sleep(0)  # one loop turn
        assert sorted(set(answered)) == [BATCH, 2 * BATCH] and ring.sub.tail < head
        held = asyncio.ensure_future(p.daemon.dispatch(rpc.Poll(rooms=[5]), other))
        pe.conn = Connection(next(cluster._conns))  # the reconnect
        await pe.call(pe.pool.registration)
        assert ring.sub.tail == head and ring.sub.closed  # every old record ran first
        await pe.call(rpc.SenderCreate(room=5))
        assert (await held).statuses == [UNKNOWN_ROOM]
        assert p.side.poll([5]).statuses == [BOOTSTRAPPING]  # the new room, unaborted
        assert p.side.poll(fill).statuses == [BOOTSTRAPPING] * len(fill)
        assert not p.daemon.backlog.rings
    finally:
        ring.close()


async def test_k41_the_engines_release_runs_after_the_dropped_rings_records(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """An engine without an id (no reconnect grace) drops with 600 creates in its ring:
    its release (every room aborted, the pool unregistered) waits for the records, so it
    fails every room they created, none of them refused as made after the release."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe, capacity=1024, record_bytes=rpc.MIN_RING_RECORD)
    try:
        rooms = list(range(1000, 1600))
        for r in rooms:
            assert ring.out.push(ring_record(ring, rpc.SenderCreate(room=r))) is not None
        with caplog.at_level(logging.WARNING, logger="kvd"):
            pe.disconnect()
            assert ring.sub.tail < len(rooms)  # sliced
            await settle(cluster)
        assert ring.sub.tail == len(rooms) and ring.sub.closed
        assert p.daemon.core is not None and p.daemon.core.local is None  # released
        assert f"failing {len(rooms)} rooms and unregistering" in caplog.text
        assert "refused after its connection dropped" not in caplog.text
    finally:
        ring.close()


async def _drop_then_reconnect(role: str, draw: Any) -> None:
    """The same calls on two identical clusters. One engine makes them over the socket: the
    ``old`` calls (aborting the room of each refused one but a create: what kvd does for
    a refusal nobody reads), then the ``new`` ones. The other puts the ``old`` calls in
    its ring unwoken; its connection drops (kvd noticing it before or after the
    reconnect's registration, some loop turns before it); it reconnects and makes the
    ``new`` calls over the socket. Every new call's outcome and every room's status is
    what the socket engine got."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
            mock.patch.object(ring_module, "BATCH", draw(st.integers(1, 3))):
        clusters = [Cluster(Path(a)), Cluster(Path(b))]
        ring: RingEngine | None = None
        try:
            engines: list[Engine] = []
            for c in clusters:
                p = await c.node("prefill")
                node = p if role == "prefill" else await c.node("decode")
                engines.append(await node.engine(seed=1, engine_id="e1"))
            sock, via_ring = engines
            ring = await RingEngine.open(via_ring)
            strategy = PREFILL_CALLS if role == "prefill" else decode_calls(p.http_addr)
            old, new = ([c for c in draw(st.lists(strategy, min_size=1, max_size=n))
                         if not isinstance(c, rpc.Poll)] for n in (20, 8))
            noticed, turns = draw(st.booleans()), draw(st.integers(0, 4))
            for call in old:
                out = await socket_outcome(sock, call)
                if not out[0] and not isinstance(call, CREATES):
                    await socket_outcome(sock, rpc.Abort(room=call.room, reason="refused"))
            await sock.reconnect()
            want = [await socket_outcome(sock, call) for call in new]
            for call in old:
                ring.push(call, wake=False)
            dropped = via_ring.conn
            if noticed:
                via_ring.disconnect()
                for _ in range(turns):
                    await asyncio.sleep(0)
            via_ring.conn = Connection(next(clusters[1]._conns))
            await via_ring.call(via_ring.pool.registration)
            assert ring.sub.tail == ring.out.head  # every old record ran before it answered
            if not noticed:  # kvd notices the old connection's end only now
                for cb in dropped.on_close:
                    cb()
            got = [await socket_outcome(via_ring, call) for call in new]
            assert got == want
            for c in clusters:
                await settle(c)
            assert statuses(sock) == statuses(via_ring)
        finally:
            if ring is not None:
                ring.close()
            for c in clusters:
                await c.stop()


@pytest.mark.parametrize("role", ["prefill", "decode"])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_k41_calls_after_a_reconnect_never_overtake_the_dropped_rings_records(
        role: str, data: st.DataObject) -> None:
    """Any room calls left in a dropped connection's ring, run a batch (1 to 3 records) a
    loop turn, and any calls after the engine reconnects, whether kvd reads the
    reconnect before or after it notices the drop: the new calls get the outcomes, and
    the rooms the statuses, that the same calls made in order over the socket get."""
    asyncio.run(_drop_then_reconnect(role, data.draw))


async def test_k41_a_socket_call_behind_a_full_completion_ring_fails_the_channel_not_the_call(
        cluster: Cluster) -> None:
    """The completion ring holds 16 refusals the engine never read, then 10 records (more
    than a batch of 4) are published and the engine makes a socket call: the records
    cannot run in order before it (kvd has nowhere to write their refusals and the
    engine, in its call, reads none), so the channel fails naming why, its rooms
    aborted, and the call is answered after -- never a wait without end."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe, capacity=16, record_bytes=rpc.MIN_RING_RECORD)
    try:
        with mock.patch.object(ring_module, "BATCH", 4):
            for _ in range(16):  # refused (no such room): a completion each, never read
                ring.push(rpc.SenderInit(room=99, num_pages=1, aux_index=0))
            await ring.drained()
            assert ring.comp.head == 16
            for r in range(200, 210):
                assert ring.out.push(ring_record(ring, rpc.SenderCreate(room=r))) is not None
            channel = p.daemon.rings[pe.conn.id]
            assert channel.behind()
            polled = await asyncio.wait_for(pe.call(rpc.Poll(rooms=[200])), 20.0)
        assert channel.failed and "completion ring was full" in channel.failed
        assert polled.statuses == [UNKNOWN_ROOM]  # none of the 10 ran
    finally:
        ring.close()


async def test_k41_a_record_published_after_the_drop_runs_or_fails_its_room(
        cluster: Cluster) -> None:
    """kvd reads the dropped ring's ``head`` (600 creates) when it notices the drop and
    runs that far; the engine, not having noticed, publishes an Abort of room 5 after it.
    kvd publishes ``tail`` as the Backlog runs and answers the engine's registration only
    once the ring ran and closed: its ``tail`` (600) is final, and the engine's client
    keeps a refusal for room 5 -- the Abort never ran -- while the creates before it
    hold none (they ran in kvd)."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    await pe.call(rpc.SenderCreate(room=5))
    result = await pe.call(rpc.OpenRing(capacity=1024, record_bytes=rpc.MIN_RING_RECORD))
    fds = [os.dup(fd) for fd in pe.conn.reply_fds]  # as SCM_RIGHTS would
    pe.conn.reply_fds = []
    a, b = socket.socketpair()
    ring = EngineRing(result, fds, a.fileno())
    client = KvdClient("/nonexistent/kvd.sock", use_ring=True)
    client.ring = ring
    try:
        for r in range(1000, 1600):
            data = ring.encode(rpc.SenderCreate(room=r))
            assert data is not None
            ring.submit(data, r, 1.0)  # kvd woken, but the loop has not turned
        pe.disconnect()  # kvd reads head (600) and runs the first slice
        assert 0 < ring.sub.tail < 600 and not ring.sub.closed
        # the engine has not noticed: its scheduler thread aborts room 5, not waited for
        late = ring.encode(rpc.Abort(room=5, reason="late"))
        assert late is not None
        assert ring.submit(late, 5, 1.0) == 600
        client._close_ring(keep=True)  # the engine notices the drop; kvd is not done
        assert client.room_refusal(5) is None and client._dropped_rings == [ring]
        pe.conn = Connection(next(cluster._conns))
        answer = await pe.call(pe.pool.registration)  # after the Backlog ran
        assert ring.sub.closed and ring.sub.tail == 600
        client._served_by(answer)
        refusal = client.room_refusal(5)
        assert isinstance(refusal, KvdUnreachable) and "never ran" in str(refusal)
        hit = client.ring_refused(np.array([5, 1000, 1599], dtype=np.uint64))
        assert hit is not None and hit.tolist() == [True, False, False]
        assert UNKNOWN_ROOM not in p.side.poll([1000, 1599]).statuses  # they ran
    finally:
        client._settle_dropped(keep=False)
        ring.close()
        a.close()
        b.close()
