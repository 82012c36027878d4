"""A review of the engine ring (issue 21) in process: records no client of kvd's would
write, run by real daemons on one loop over fakes (the engine's end written here at the
protocol level, :class:`tests.inproc.test_ring.RingEngine`)."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from kvd.protocol import codec, rpc
from kvd.protocol.codec import pack_indices
from tests.inproc.harness import Cluster, until
from tests.inproc.test_ring import RingEngine

BOOTSTRAPPING, FAILED, UNKNOWN = 1, 0, -1


@pytest.mark.parametrize("role, bad", [
    ("prefill", rpc.SenderCreate(room=-1)),
    ("prefill", rpc.Clear(room=-(2**63))),
    ("decode", rpc.ReceiverInit(room=5, dst_pages=pack_indices([1]), aux_index=0,
                                state_index=2**63)),
])
async def test_a_record_with_an_integer_past_its_wire_bounds_fails_the_channel_not_kvd(
        cluster: Cluster, caplog: pytest.LogCaptureFixture, role: str, bad: rpc.Call) -> None:
    """A room id below 0 or an index past int64, written into the ring by an engine that
    bypasses the client's check: before, kvd ran it -- ``SenderCreate(room=-1)`` made a
    room it then failed to publish, answering "internal error" and keeping a room no Poll
    can name; ``state_index=2**63`` overflowed inside the receiver machine. Now the record
    does not decode: the channel fails as for any record kvd cannot trust, the rooms it
    carried are aborted, no handler saw the call, and the socket goes on."""
    node = await cluster.node(role)
    eng = await node.engine(seed=1)
    ring = await RingEngine.open(eng)
    create = rpc.SenderCreate(room=5) if role == "prefill" else rpc.ReceiverCreate(
        room=5, bootstrap_addr="127.0.0.1:1")
    try:
        ring.push(create)
        await ring.drained()
        with caplog.at_level(logging.ERROR, logger="kvd"):
            ring.push(bad)
            await until(lambda: ring.sub.closed)
        channel = node.daemon.rings[eng.conn.id]
        assert "malformed frame" in channel.failed and "$.call." in channel.failed
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], \
            "a handler ran the call and failed inside"
        assert node.side.poll([5]).statuses == [FAILED]  # the room the ring carried
        assert "engine ring failed" in node.side.poll([5]).reasons[5]
        if bad.room != 5:
            assert node.side.poll([bad.room]).statuses == [UNKNOWN]  # no room was made
        await eng.call(msgspec.structs.replace(create, room=6))
        assert (await eng.call(rpc.Poll(rooms=[6]))).statuses == [BOOTSTRAPPING]
    finally:
        ring.close()


async def test_a_room_the_ring_carried_then_cleared_over_the_socket_is_not_the_rings_any_more(
        cluster: Cluster) -> None:
    """Room 7 made through the ring, cleared over the socket, made again over the socket
    (a new incarnation the ring never carried); room 8 made through the ring, cleared
    through a Many. Then the ring fails (a record kvd cannot trust): only the rooms the
    ring carried and nobody cleared are aborted -- room 9 -- and the socket's room 7
    lives on."""
    node = await cluster.node("prefill")
    eng = await node.engine(seed=1)
    ring = await RingEngine.open(eng)
    try:
        for room in (7, 8, 9):
            ring.push(rpc.SenderCreate(room=room))
        await ring.drained()
        await eng.call(rpc.Clear(room=7))
        await eng.call(rpc.Many(calls=[rpc.Clear(room=8)]))
        await eng.call(rpc.SenderCreate(room=7))
        ring.out.push(b"not a frame")
        ring.wake()
        await until(lambda: ring.sub.closed)
        assert node.side.poll([7, 8, 9]).statuses == [BOOTSTRAPPING, UNKNOWN, FAILED]
    finally:
        ring.close()


@pytest.mark.parametrize("tail", [4, 2**64 - 1])
async def test_a_completion_tail_the_engine_could_not_have_published_fails_only_its_channel(
        cluster: Cluster, tail: int) -> None:
    """The engine is the completion ring's consumer: its ``tail`` is the one word there
    kvd reads. A tail past kvd's head, or one that wrapped the 64-bit word (further
    behind than the ring holds), is a lie: the next record kvd runs fails the
    channel (the rooms it carried aborted, the socket's room untouched), never a
    completion written over one the engine has not read, nor an exception out of the
    loop."""
    node = await cluster.node("prefill")
    eng = await node.engine(seed=1)
    ring = await RingEngine.open(eng, capacity=8, record_bytes=512)
    try:
        await eng.call(rpc.SenderCreate(room=50))  # the socket's room
        ring.push(rpc.SenderCreate(room=2))
        ring.push(rpc.SenderInit(room=99, num_pages=1, aux_index=0))  # refused: a completion
        await ring.drained()
        assert ring.comp.head == 1
        ring.comp.publish_tail(tail)
        ring.push(rpc.SenderCreate(room=3))
        await until(lambda: ring.sub.closed)
        channel = node.daemon.rings[eng.conn.id]
        assert channel.failed and "records behind head" in channel.failed
        assert node.side.poll([2, 3, 50]).statuses == [FAILED, UNKNOWN, BOOTSTRAPPING]
        await eng.call(rpc.SenderCreate(room=51))
        assert node.side.poll([51]).statuses == [BOOTSTRAPPING]
    finally:
        ring.close()


async def test_k41_a_socket_call_behind_a_full_ring_runs_it_in_slices_of_one_batch_a_turn(
        cluster: Cluster) -> None:
    """4 096 creates published without a wake-up, then a socket Poll on the connection:
    kvd must run them before the Poll (order), but no more than one BATCH per loop
    turn; other work of the loop (here a timer due at once) runs in between."""
    from kvd.engine_rpc.ring import BATCH

    cap = rpc.MAX_RING_CAPACITY
    node = await cluster.node("prefill")
    eng = await node.engine(seed=1)
    ring = await RingEngine.open(eng, capacity=cap, record_bytes=rpc.MIN_RING_RECORD)
    try:
        for room in range(100, 100 + cap):
            record = codec.encode(rpc.Request(id=ring.out.head,
                                              call=rpc.SenderCreate(room=room)))
            assert ring.out.push(record) is not None  # no wake-up: kvd sleeps on them
        seen: list[int] = []
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: seen.append(ring.sub.tail))  # the loop's next turn
        polled = await eng.call(rpc.Poll(rooms=[100 + cap - 1]))
        assert polled.statuses == [BOOTSTRAPPING]  # the order rule: every create ran first
        assert seen and seen[0] <= BATCH, f"{seen[0] if seen else cap} records in one turn"
    finally:
        ring.close()
