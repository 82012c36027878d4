"""Boundary room ids end to end, in process (case S19): a room id is any 64-bit unsigned
integer an engine may send (``RoomId``); rooms at ``0``, ``2**63 - 1``, ``2**63`` and
``2**64 - 1`` move every byte and answer polls on both roles, over the socket and over
the ring, as room 7 does. Before, a decode's ``init`` of a room at ``2**63`` or past
raised OverflowError (the claim table held rooms as int64): an internal error to the
engine, and the room could never be initialised."""

from __future__ import annotations

import pytest

from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from tests.inproc.harness import SUCCESS, Cluster, same_pages, settle
from tests.inproc.test_ring import RingEngine

BOUNDS = [0, 2**63 - 1, 2**63, 2**64 - 1]


@pytest.mark.parametrize("room", BOUNDS)
async def test_s19_a_room_id_at_every_bound_moves_every_byte(cluster: Cluster,
                                                              room: int) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(room, [3, 4, 5], p.http_addr, aux=2)
    await pe.sender(room, [10, 11, 12], aux=1, chunks=2)
    await settle(cluster)
    assert await de.status(room) == SUCCESS and await pe.status(room) == SUCCESS
    assert same_pages(de, pe, [10, 11, 12], [3, 4, 5])
    assert (de.pool.aux[2] == pe.pool.aux[1]).all()


async def test_s19_room_ids_at_every_bound_move_every_byte_through_the_ring(
        cluster: Cluster) -> None:
    """The same rooms, all at once, every call through both engines' rings."""
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    pr, dr = await RingEngine.open(pe), await RingEngine.open(de)
    try:
        seqs = []
        for k, room in enumerate(BOUNDS):
            dst, src = [3 * k, 3 * k + 1], [10 + 2 * k, 11 + 2 * k]
            seqs += [(dr, dr.push(rpc.ReceiverCreate(room=room, bootstrap_addr=p.http_addr))),
                     (dr, dr.push(rpc.ReceiverInit(room=room, dst_pages=pack_indices(dst),
                                                   aux_index=k))),
                     (pr, pr.push(rpc.SenderCreate(room=room))),
                     (pr, pr.push(rpc.SenderInit(room=room, num_pages=2, aux_index=k))),
                     (pr, pr.push(rpc.SenderSend(room=room, pages=pack_indices(src),
                                                 is_last=True)))]
        await dr.drained()
        await pr.drained()
        await settle(cluster)
        for ring, seq in seqs:
            ring.collect()
            assert ring.outcome(seq) == (True, None, ""), ring.outcome(seq)
        for k, room in enumerate(BOUNDS):
            assert await de.status(room) == SUCCESS and await pe.status(room) == SUCCESS
            assert same_pages(de, pe, [10 + 2 * k, 11 + 2 * k], [3 * k, 3 * k + 1])
            assert (de.pool.aux[k] == pe.pool.aux[k]).all()
    finally:
        pr.close()
        dr.close()
