"""The sides' one-loop polls (prefill.py, decode.py) answer exactly as the generic
``Side.poll`` over every room state a test can reach: each status, failed rooms whose
pages are and are not releasable yet, aborted, timed-out, cleared and unknown rooms, a
chunked room part-way, and lists with duplicates, reversed, empty, an iterator, ids at
the edges of the 64-bit range. (The fast loops were rewritten for speed in issue 14.)"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kvd.daemon.side import Side
from kvd.errors import KvdError
from kvd.protocol import rpc
from kvd.rooms import UNKNOWN_ROOM, KVPoll
from tests.inproc.harness import Cluster, Node, settle

FAILED, SUCCESS = int(KVPoll.Failed), int(KVPoll.Success)


def same_as_generic(nodes: tuple[Node, ...], rooms: list[int],
                    seen: dict[str, set[tuple[int, bool]]]) -> None:
    """Every variant of ``rooms`` polled fast == generic, on every node."""
    variants = [rooms, rooms[::-1], rooms + rooms, rooms[:1] * 3, [], [2**64 - 1, 0]]
    for node in nodes:
        for ids in variants:
            generic = Side.poll(node.side, list(ids))
            assert node.side.poll(list(ids)) == generic, (node.side.role, ids)
            assert node.side.poll(iter(ids)) == generic, (node.side.role, "iterator")
            assert [type(s) for s in generic.statuses] == [int] * len(ids)
        res = node.side.poll(rooms)
        seen.setdefault(node.side.role, set()).update(
            (s, r in res.releasable) for r, s in zip(rooms, res.statuses, strict=True))


async def test_fast_polls_equal_the_generic_poll_in_every_room_state(cluster: Cluster) -> None:
    t = {"bootstrap_timeout": 3.0, "waiting_timeout": 3.0, "transfer_timeout": 3.0}
    p = await cluster.node("prefill", **t)
    d = await cluster.node("decode", **t)
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    nodes, rooms = (p, d), [*range(1, 13), 99]
    seen: dict[str, set[tuple[int, bool]]] = {}

    async def check() -> None:
        await settle(cluster)
        same_as_generic(nodes, rooms, seen)

    await de.receiver(1, [1], p.http_addr)  # 1: succeeds
    await pe.sender(1, [11])
    await check()
    await de.receiver(2, [2], p.http_addr)  # 2: decode waiting, no sender
    await pe.sender(3, [3], send=False)  # 3: prefill bootstrapping, no receiver
    await de.receiver(4, [4], p.http_addr)  # 4: prefill waiting for input
    await pe.sender(4, [4], send=False)
    await de.receiver(9, None, p.http_addr)  # 9: decode created, no init
    await pe.sender(6, [6], send=False)  # 6: aborted by the prefill engine
    await settle(cluster)
    await pe.call(rpc.Abort(room=6, reason="engine gone"))
    await de.receiver(8, [8], p.http_addr)  # 8: succeeds, then cleared on both sides
    await pe.sender(8, [18])
    await settle(cluster)
    await pe.call(rpc.Clear(room=8))
    await de.call(rpc.Clear(room=8))
    await check()
    await de.receiver(10, [10, 12], p.http_addr)  # 10: chunked, part-way
    await pe.sender(10, [20, 21], send=False)
    await pe.send(10, [20], last=False)
    await check()
    cluster.fabric.hold(d.session)  # writes to the decode held: 7 stays in flight
    await de.receiver(7, [7], p.http_addr)
    await pe.sender(7, [17])
    await check()
    await de.call(rpc.Abort(room=7, reason="client gone"))  # Failed, pages not releasable
    await check()
    await cluster.advance(1.5)
    await check()
    await cluster.advance(2.0)  # past every room timeout
    await check()
    cluster.fabric.release(d.session)
    await check()
    await cluster.advance(5.0)
    await check()
    for room in rooms:
        for engine in (pe, de):
            with contextlib.suppress(KvdError):  # pages not releasable yet: refused
                await engine.call(rpc.Clear(room=room))
    await check()
    # the states this test is about were reached (a decode still bootstrapping: below)
    reached = {FAILED, int(KVPoll.WaitingForInput), SUCCESS, UNKNOWN_ROOM}
    assert reached | {int(KVPoll.Bootstrapping)} <= {s for s, _ in seen["prefill"]}
    assert reached <= {s for s, _ in seen["decode"]}
    assert (FAILED, False) in seen["decode"] and (FAILED, True) in seen["decode"]


async def test_a_receiver_still_bootstrapping_polls_the_same(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    await p.engine(seed=1)
    de = await d.engine(seed=2)
    cluster.router.hung.add("127.0.0.1:9")  # its bootstrap lookup hangs
    seen: dict[str, set[tuple[int, bool]]] = {}
    task: asyncio.Future[Any] = asyncio.ensure_future(de.receiver(11, [11], "127.0.0.1:9"))
    await asyncio.sleep(0.01)
    same_as_generic((p, d), [11, 11, 99], seen)
    await task
    same_as_generic((p, d), [11, 11, 99], seen)
    await settle(cluster)
    same_as_generic((p, d), [11, 11, 99], seen)
    assert (int(KVPoll.Bootstrapping), False) in seen["decode"]
