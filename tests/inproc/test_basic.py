"""In-process tier: the happy paths, byte for byte."""

from __future__ import annotations

from tests.inproc.harness import SUCCESS, Cluster, same_pages, settle


async def test_one_room_moves_every_byte(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(7, [3, 4, 5], p.http_addr, aux=2)
    await pe.sender(7, [10, 11, 12], aux=1, chunks=2)
    await settle(cluster)
    assert await de.status(7) == SUCCESS and await pe.status(7) == SUCCESS
    assert same_pages(de, pe, [10, 11, 12], [3, 4, 5])
    assert (de.pool.aux[2] == pe.pool.aux[1]).all()


async def test_peers_carry_their_liveness(cluster: Cluster) -> None:
    """Status peers (``Side.snapshot``): the prefill's view of its decode (last message,
    last error) and the decode's view of its prefill (last message, last heartbeat, last
    error), as unix seconds."""
    import time

    from kvd.protocol import rpc

    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(1, [3], p.http_addr)
    await pe.sender(1, [10])
    await settle(cluster)
    await d.heartbeat()
    (dp,) = [x for x in d.side.snapshot().peers if x.endpoint == p.endpoint]
    assert dp.last_message is not None and abs(time.time() - dp.last_message) < 60
    assert dp.last_heartbeat is not None and dp.last_error == "" and dp.heartbeat == "ok"
    await de.receiver(2, [4], p.http_addr)
    await pe.sender(2, [11], send=False)
    await settle(cluster)
    await de.call(rpc.Abort(room=2, reason="liveness test"))
    await settle(cluster)
    (pp,) = [x for x in p.side.snapshot().peers if x.endpoint == d.endpoint]
    assert pp.last_message is not None and abs(time.time() - pp.last_message) < 60
    assert "liveness test" in pp.last_error and pp.last_error_time is not None
    await p.stop()
    await d.heartbeat()
    (dp,) = [x for x in d.side.snapshot().peers if x.endpoint == p.endpoint]
    assert dp.heartbeat == "missed 1" and "heartbeat" in dp.last_error
    assert dp.last_error_time is not None


async def test_wait_with_a_non_finite_timeout_is_a_clear_error(cluster: Cluster) -> None:
    """``Wait(timeout=nan)`` used to escape as an InternalError ("cannot convert float NaN
    to integer"); infinite timeouts are capped like any long one."""
    import asyncio
    import math

    import pytest

    from kvd.errors import ProtocolError
    from kvd.protocol import rpc

    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    await pe.sender(5, [10], send=False)
    with pytest.raises(ProtocolError, match="NaN"):
        await pe.call(rpc.Wait(rooms=[5], timeout=math.nan))
    for t in (-math.inf, -1.0):
        res = await pe.call(rpc.Wait(rooms=[5], timeout=t))
        assert res.statuses == [1]
    waiting = asyncio.ensure_future(pe.call(rpc.Wait(rooms=[5], timeout=math.inf)))
    await asyncio.sleep(0)
    assert not waiting.done()
    await pe.call(rpc.Abort(room=5))
    res = await asyncio.wait_for(waiting, 5)
    assert res.statuses == [0]
