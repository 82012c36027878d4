"""The daemon's ``Backlog`` of dropped connections' rings (K41), on a loop, the handler a
stub: oldest ring first, a batch a loop turn, every engine call held until the last
record ran."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from unittest import mock

from kvd.client.ring import EngineRing
from kvd.engine_rpc import ring as kvd_ring
from kvd.engine_rpc.ring import Backlog, RingChannel
from kvd.protocol import rpc
from tests.unit.engine_rpc.test_ring_channel import Kvd, submit


def _ring(kvd: Kvd, rooms: list[int]) -> tuple[RingChannel, EngineRing, socket.socket]:
    """A channel whose engine published a create of each of ``rooms``, kvd never woken."""
    channel = RingChannel(16, 512, kvd.handle, lambda rooms, why: None,
                          lambda room: room in kvd.held)
    a, b = socket.socketpair()
    engine = EngineRing(channel.result(), [os.dup(fd) for fd in channel.fds], a.fileno())
    for r in rooms:
        submit(engine, rpc.SenderCreate(room=r))
    b.close()
    return channel, engine, a


async def test_k41_dropped_rings_run_oldest_first_a_batch_a_turn_holding_engine_calls(
        ) -> None:
    """Two dropped rings (10 and 6 records) with a batch of 4: the first's records all
    run before the second's, no loop turn runs more than 4, every engine call (a Poll)
    is held while any is left and Info is not, and ``settled`` returns once both rings
    ran out and closed."""
    kvd = Kvd()
    first, second = _ring(kvd, list(range(1, 11))), _ring(kvd, list(range(100, 106)))
    backlog = Backlog()
    with mock.patch.object(kvd_ring, "BATCH", 4):
        backlog.add(first[0])
        backlog.add(second[0])
        ran = [len(kvd.ran)]
        while backlog.rings:
            assert backlog.holds(rpc.Poll(rooms=[1])) and not backlog.holds(rpc.Info())
            await asyncio.sleep(0)  # one loop turn
            ran.append(len(kvd.ran))
        await asyncio.wait_for(backlog.settled(), 5.0)
    assert [c.room for c in kvd.ran] == [*range(1, 11), *range(100, 106)]  # type: ignore[attr-defined]
    assert all(0 <= b - a <= 4 for a, b in itertools.pairwise(ran)) and ran[0] == 4
    assert first[0].closed and second[0].closed and not backlog.holds(rpc.Poll(rooms=[1]))
    for _, engine, sock in (first, second):
        assert engine.drained()
        engine.close()
        sock.close()


async def test_k41_settled_waits_for_the_last_slice_and_close_releases_waiters() -> None:
    """A waiter of ``settled`` returns only once the ring ran out; a backlog closed at
    kvd's stop releases its waiters with records unrun (the rings closed)."""
    kvd = Kvd()
    channel, engine, sock = _ring(kvd, list(range(1, 9)))
    backlog = Backlog()
    with mock.patch.object(kvd_ring, "BATCH", 2):
        backlog.add(channel)
        waiter = asyncio.ensure_future(backlog.settled())
        await asyncio.sleep(0)
        assert not waiter.done() and len(kvd.ran) < 8
        await asyncio.wait_for(waiter, 5.0)
        assert len(kvd.ran) == 8 and channel.closed
        other, other_engine, other_sock = _ring(kvd, list(range(20, 28)))
        backlog.add(other)
        waiter = asyncio.ensure_future(backlog.settled())
        backlog.close()
        await asyncio.wait_for(waiter, 5.0)
        assert other.closed and len(kvd.ran) == 8 + 2  # the first slice ran at the drop
    for e, s in ((engine, sock), (other_engine, other_sock)):
        e.close()
        s.close()
