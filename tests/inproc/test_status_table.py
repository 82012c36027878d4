"""The shared status table answers what ``Poll`` answers (issue 21, step A), in process:
two daemons, fake fabric and clock; the table read as the engine reads it."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import RpcError
from kvd.protocol import rpc
from kvd.protocol.table import StatusTable
from tests.inproc.harness import SUCCESS, Cluster, Node, settle
from tests.inproc.test_many import PREFILL_CALLS, decode_calls

ROOMS = [1, 2, 3, 4, 99]  # 99: never created


def engine_table(node: Node) -> StatusTable:
    """The table as an engine maps it (the daemon's memfd opened afresh), once the
    re-publish the last changes asked for ran (it runs on the loop's next turn)."""
    writer = node.daemon.status_table
    assert writer is not None
    writer.flush()
    return StatusTable.open(writer.map)


def assert_table_is_poll(node: Node, touched: set[int]) -> None:
    """Every room the table answers reads as ``Poll`` says; every room an engine call
    touched is answered."""
    rooms = np.array(ROOMS, dtype=np.uint64)
    table = engine_table(node)
    statuses, free, hit = table.read(rooms)
    polled = node.side.poll(ROOMS)
    released = set(polled.releasable)
    for i, room in enumerate(ROOMS):
        if room in touched:
            assert hit[i], f"room {room} is missing from the table"
        one = table.read_one(room)
        assert (one is not None) == bool(hit[i])
        if hit[i]:
            assert one == (int(statuses[i]), bool(free[i]))
            assert int(statuses[i]) == polled.statuses[i], f"room {room}"
            assert bool(free[i]) == (room in released), f"room {room} releasable"


async def run_sequence(draw: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        try:
            p = await cluster.node("prefill")
            d = await cluster.node("decode")
            pe, de = await p.engine(seed=1), await d.engine(seed=2)
            actions = st.one_of(
                PREFILL_CALLS.map(lambda c: ("p", c)), decode_calls(p.http_addr).map(
                    lambda c: ("d", c)), st.sampled_from([("settle", 0.0), ("advance", 5.0),
                                                          ("advance", 40.0)]))
            touched: dict[str, set[int]] = {"p": set(), "d": set()}
            for kind, arg in draw(st.lists(actions, min_size=1, max_size=30)):
                if kind == "settle":
                    await settle(cluster)
                elif kind == "advance":
                    await cluster.advance(arg)
                else:
                    eng = pe if kind == "p" else de
                    with contextlib.suppress(Exception):  # refusals: the socket path's too
                        await eng.call(arg)
                    if hasattr(arg, "room"):
                        touched[kind].add(arg.room)
                assert_table_is_poll(p, touched["p"])
                assert_table_is_poll(d, touched["d"])
        finally:
            await cluster.stop()


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_the_table_answers_every_room_as_poll_does_on_both_roles(data: st.DataObject) -> None:
    """Any sequence of room calls on a prefill and its decode (valid or refused),
    settling and deadlines between them: after each step, every room the table answers
    reads exactly as Poll (status and releasable), and every room the engine touched is
    answered."""
    asyncio.run(run_sequence(data.draw))


async def test_a_room_moved_end_to_end_reads_success_and_releasable(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(1, [3, 4], p.http_addr)
    await pe.sender(1, [7, 8])
    await settle(cluster)
    for node in (p, d):
        statuses, free, hit = engine_table(node).read(np.array([1], dtype=np.uint64))
        assert hit[0] and int(statuses[0]) == SUCCESS and free[0]
    await de.call(rpc.Clear(room=1))
    statuses, _, hit = engine_table(d).read(np.array([1], dtype=np.uint64))
    assert hit[0] and int(statuses[0]) == -1


async def test_a_failed_room_not_yet_releasable_reads_so_until_its_write_returns(
        cluster: Cluster) -> None:
    """K06 through the table: aborted while its write is held, Failed and not
    releasable; releasable once the write returned."""
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    cluster.fabric.hold(d.session)
    await de.receiver(1, list(range(4)), p.http_addr)
    await pe.sender(1, list(range(8, 12)))
    await settle(cluster)
    await de.call(rpc.Abort(room=1, reason="client gone"))
    await settle(cluster)
    one = np.array([1], dtype=np.uint64)
    statuses, free, hit = engine_table(d).read(one)
    assert hit[0] and int(statuses[0]) == 0 and not free[0]
    cluster.fabric.release(d.session)
    await settle(cluster)
    statuses, free, hit = engine_table(d).read(one)
    assert hit[0] and int(statuses[0]) == 0 and free[0]


async def test_a_kvd_with_the_channel_off_refuses_the_table(cluster: Cluster) -> None:
    p = await cluster.node("prefill", engine_channel=False)
    pe = await p.engine(seed=1)
    assert p.daemon.status_table is None
    try:
        await pe.call(rpc.OpenTable())
    except RpcError as exc:
        assert "engine_channel" in str(exc)
    else:
        raise AssertionError("OpenTable answered without a table")
    await pe.call(rpc.SenderCreate(room=1))  # rooms work as before
    assert (await pe.poll(1)).statuses == [1]


async def test_open_table_hands_the_memfd_to_the_connection(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    result = await pe.call(rpc.OpenTable())
    writer = p.daemon.status_table
    assert writer is not None
    assert result == rpc.TableResult(nslots=writer.nslots, size=writer.size)
    assert pe.conn.reply_fds == [writer.fd]
