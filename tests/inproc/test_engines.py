"""In-process tier: what engines need of the daemon (issue 13, Engines).

* ranks come from the engine's registration (settings unset), are checked when set;
* decode-side prefix caching: the decode names the first room page it needs
  (``first_page``) and the prefill writes only the pages from there on.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvd.errors import RegistrationError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import ModelSpec
from tests.inproc.harness import FAILED, SUCCESS, Cluster, same_pages, settle

SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=16)


def ranks(tp_rank: int, tp_size: int) -> rpc.EngineRanks:
    return rpc.EngineRanks(attn_tp_rank=tp_rank, attn_tp_size=tp_size)


async def test_ranks_come_from_the_engine_hetero_tp(cluster: Cluster) -> None:
    """No rank settings anywhere: prefill TP 1 feeds decode TP 2, every daemon using the
    ranks its engine registered with (bootstrap table, routing, head slices)."""
    source = SPEC.global_kv(5)
    p = await cluster.node("prefill")
    d0, d1 = await cluster.node("decode"), await cluster.node("decode")
    pe = await p.shard_engine(SPEC, 0, 1, ranks=ranks(0, 1), source=source, seed=1)
    e0 = await d0.shard_engine(SPEC, 0, 2, ranks=ranks(0, 2), seed=2)
    e1 = await d1.shard_engine(SPEC, 1, 2, ranks=ranks(1, 2), seed=3)
    assert d1.core.ranks.attn_tp_rank == 1 and d1.core.ranks.attn_tp_size == 2
    await e0.receiver(1, [0, 1], p.http_addr)
    await e1.receiver(1, [2, 3], p.http_addr)
    await pe.sender(1, [6, 7])
    await settle(cluster)
    assert [await e.status(1) for e in (pe, e0, e1)] == [SUCCESS] * 3
    assert e0.pool.holds(source, [6, 7], [0, 1]) and e1.pool.holds(source, [6, 7], [2, 3])
    assert (e0.pool.h0, e1.pool.h0) == (0, 2)  # each decode rank got its own heads


async def test_ranks_that_contradict_the_settings_are_refused(cluster: Cluster) -> None:
    d = await cluster.node("decode", attn_tp_size=2, attn_tp_rank=1)
    with pytest.raises(RegistrationError, match="attn_tp_rank: kvd is configured with 1, "
                                                "the engine says 0"):
        await d.shard_engine(SPEC, 0, 2, ranks=ranks(0, 2), seed=1)
    assert d.core.local is None and d.core.ranks is None  # nothing left registered
    e = await d.shard_engine(SPEC, 1, 2, ranks=ranks(1, 2), seed=1)  # the right one
    assert d.core.ranks.attn_tp_rank == 1 and e.pool.tp_rank == 1


async def test_engine_ranks_outside_their_size_are_refused(cluster: Cluster) -> None:
    d = await cluster.node("decode")
    with pytest.raises(RegistrationError, match=r"attn_tp_rank 2 outside \[0, attn_tp_size 2"):
        await d.shard_engine(SPEC, 0, 2, ranks=ranks(2, 2), seed=1)


async def test_a_daemon_keeps_the_ranks_of_its_first_engine(cluster: Cluster) -> None:
    d = await cluster.node("decode")
    e = await d.shard_engine(SPEC, 0, 2, ranks=ranks(0, 2), seed=1)
    await e.call(rpc.Release())
    with pytest.raises(RegistrationError, match="restart kvd to serve another rank"):
        await d.shard_engine(SPEC, 1, 2, ranks=ranks(1, 2), seed=2)


async def _prefix_room(cluster: Cluster, first: int, dst: list[int], chunks: list[list[int]]
                       ) -> tuple[Any, Any, Any]:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    de.before = [b.copy() for b in de.pool.kv]  # type: ignore[attr-defined]
    await de.call(rpc.ReceiverCreate(room=9, bootstrap_addr=p.http_addr))
    await de.call(rpc.ReceiverInit(room=9, dst_pages=pack_indices(dst), aux_index=3,
                                   first_page=first))
    total = sum(len(c) for c in chunks)
    await pe.call(rpc.SenderCreate(room=9))
    await pe.call(rpc.SenderInit(room=9, num_pages=total, aux_index=1))
    for i, c in enumerate(chunks):
        await pe.call(rpc.SenderSend(room=9, pages=pack_indices(c),
                                     is_last=i == len(chunks) - 1))
    await settle(cluster)
    return p, pe, de


@pytest.mark.parametrize("chunks", [[[10, 11, 12, 13]], [[10], [11, 12], [13]],
                                    [[10, 11], [12, 13]]])
async def test_decode_prefix_hit_moves_only_the_pages_it_needs(
        cluster: Cluster, chunks: list[list[int]]) -> None:
    """A 4-page room whose first 2 pages the decode already holds: only room pages 2 and 3
    move (into decode pages 20, 21), aux rides along, untouched pages stay as they were."""
    p, pe, de = await _prefix_room(cluster, 2, [20, 21], chunks)
    assert await de.status(9) == SUCCESS and await pe.status(9) == SUCCESS
    assert same_pages(de, pe, [12, 13], [20, 21])
    assert not same_pages(de, pe, [10, 11], [20, 21])
    assert (de.pool.aux[3] == pe.pool.aux[1]).all()
    item_bytes = sum(int(n) for n in pe.pool.registration.kv_item_lens)
    aux_bytes = sum(int(n) for n in pe.pool.registration.aux_item_lens)
    assert p.core.counters.bytes_sent == 2 * item_bytes + aux_bytes
    others = [i for i in range(de.pool.kv[0].shape[0]) if i not in (20, 21)]
    assert all((now[others] == then[others]).all() for now, then in zip(
        de.pool.kv, de.before, strict=True))

async def test_decode_prefix_that_does_not_match_the_room_fails_it(cluster: Cluster) -> None:
    """first_page 1 with 2 destination pages for a 4-page room: the pages do not end
    where the room ends -> index length mismatch, on both sides, nothing written past."""
    _p, pe, de = await _prefix_room(cluster, 1, [20, 21], [[10, 11, 12, 13]])
    assert await pe.status(9) == FAILED and await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout" and "index length mismatch" in reason
