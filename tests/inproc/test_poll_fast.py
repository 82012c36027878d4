"""The sides' one-loop ``poll`` answers exactly what the generic per-room ``Side.poll`` does."""

from __future__ import annotations

from kvd.daemon.side import Side
from tests.inproc.harness import Cluster, settle


async def test_fast_poll_equals_the_generic_poll_on_both_sides(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    for room in range(1, 5):  # succeeded
        await de.receiver(room, [room], p.http_addr)
        await pe.sender(room, [room + 10])
    await de.receiver(5, [5], p.http_addr)  # waiting for its sender
    await pe.sender(6, [6], send=False)  # bootstrapping on the prefill
    await de.receiver(7, [7], p.http_addr)
    await pe.sender(7, [7], send=False)
    from kvd.protocol import rpc

    await de.call(rpc.Abort(room=7, reason="engine said so"))  # failed, then quiesced
    await settle(cluster)
    rooms = [1, 2, 3, 4, 5, 6, 7, 99]  # 99: unknown
    for node in (p, d):
        fast, generic = node.side.poll(rooms), Side.poll(node.side, rooms)
        assert fast == generic
    assert d.side.poll(rooms).kinds.get(7) == "aborted"


async def test_fast_poll_equals_the_generic_poll_while_a_failed_room_is_not_releasable(
        cluster: Cluster) -> None:
    """A decode room aborted while its write is in flight is Failed but not releasable
    (K06) until the write returned: both polls say so, before and after."""
    from kvd.protocol import rpc

    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    cluster.fabric.hold(d.session)
    await de.receiver(1, list(range(4)), p.http_addr)
    await pe.sender(1, list(range(8, 12)))
    await de.receiver(2, [9], p.http_addr)  # waiting for its sender
    await settle(cluster)
    await de.call(rpc.Abort(room=1, reason="client gone"))
    await settle(cluster)
    rooms = [1, 2, 3]
    for node in (p, d):
        assert node.side.poll(rooms) == Side.poll(node.side, rooms)
    held = d.side.poll(rooms)
    assert held.statuses[0] == 0 and 1 not in held.releasable and 3 in held.releasable
    cluster.fabric.release(d.session)
    await settle(cluster)
    for node in (p, d):
        assert node.side.poll(rooms) == Side.poll(node.side, rooms)
    assert 1 in d.side.poll(rooms).releasable
