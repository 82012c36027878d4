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
