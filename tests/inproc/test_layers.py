"""In-process tier: layer streaming (issue 22 item 4).

A prefill engine hands a room's KV layer range by layer range (``SenderSendLayers``) as
its forward pass would compute it; each range is written while the next is still to
come. The decode's buffers are compared byte for byte with the prefill's pages: after
each range exactly those layers have landed and the others are untouched; at the end
every layer of every page, and aux, is there. Mixed with whole chunks; a layer named
twice, an abort and a failed write mid-stream fail the room on both sides.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import RoomError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.transfer.faults import FaultInjector, FaultPlan
from tests.inproc.harness import FAILED, SUCCESS, Cluster, Engine, settle

LAYERS = 4
SRC = [5, 9, 2, 17, 11, 3]
DST = [30, 1, 8, 20, 6, 14]


async def _pair(cluster: Cluster) -> tuple[Engine, Engine, list[np.ndarray]]:
    p, d = await cluster.node("prefill"), await cluster.node("decode")
    pe = await p.engine(seed=1, num_layers=LAYERS)
    de = await d.engine(seed=2, num_layers=LAYERS)
    before = [b.copy() for b in de.pool.kv]
    await de.receiver(9, DST, p.http_addr, aux=3)
    await pe.sender(9, SRC, aux=1, send=False)
    return pe, de, before


async def _layers(pe: Engine, pages: list[int], lo: int, hi: int, last: bool = False) -> None:
    await pe.call(rpc.SenderSendLayers(room=9, pages=pack_indices(pages), layer_start=lo,
                                       layer_end=hi, is_last=last))


def _landed(pe: Engine, de: Engine, before: list[np.ndarray], layers: set[int],
            upto: int) -> bool:
    """Do the decode's buffers hold exactly ``layers`` of room pages ``[0, upto)`` (K and V
    buffers ``l`` and ``LAYERS + l``), every other byte as it was?"""
    src, dst = np.asarray(SRC), np.asarray(DST)
    for b, (got, old) in enumerate(zip(de.pool.kv, before, strict=True)):
        want = old.copy()
        if b % LAYERS in layers:
            want[dst[:upto]] = pe.pool.kv[b][src[:upto]]
        if not np.array_equal(got, want):
            return False
    return True


async def test_i22_a_room_streamed_layer_by_layer_lands_byte_for_byte(
        cluster: Cluster) -> None:
    pe, de, before = await _pair(cluster)
    await _layers(pe, SRC, 0, 1)  # new pages, layer 0
    await settle(cluster)
    assert _landed(pe, de, before, {0}, 6)  # layer 0 written, layers 1-3 not yet
    assert await de.status(9) != SUCCESS
    await _layers(pe, [], 1, 3)  # every open page
    await settle(cluster)
    assert _landed(pe, de, before, {0, 1, 2}, 6)
    await _layers(pe, SRC[::-1], 3, 4, last=True)  # named pages, any order; aux
    await settle(cluster)
    assert await pe.status(9) == SUCCESS and await de.status(9) == SUCCESS
    assert _landed(pe, de, before, set(range(LAYERS)), 6)
    assert (de.pool.aux[3] == pe.pool.aux[1]).all()


async def test_i22_layer_streams_mixed_with_whole_chunks(cluster: Cluster) -> None:
    pe, de, before = await _pair(cluster)
    await pe.send(9, SRC[:2], last=False)  # chunk 1: every layer
    await _layers(pe, SRC[2:5], 0, 2)  # chunk 2, layer by layer
    await _layers(pe, SRC[5:], 0, 1)  # chunk 3 starts before chunk 2 ends
    await settle(cluster)
    await _layers(pe, SRC[2:5], 2, 4)
    await _layers(pe, SRC[5:], 1, 4, last=True)
    await settle(cluster)
    assert await pe.status(9) == SUCCESS and await de.status(9) == SUCCESS
    assert _landed(pe, de, before, set(range(LAYERS)), 6)
    assert (de.pool.aux[3] == pe.pool.aux[1]).all()


async def test_i22_a_layer_named_twice_fails_the_room_on_both_sides(cluster: Cluster) -> None:
    pe, de, before = await _pair(cluster)
    await _layers(pe, SRC, 0, 2)
    with pytest.raises(RoomError, match="layer 1 of room page 0 is named twice"):
        await _layers(pe, [], 1, 3)
    await settle(cluster)
    assert await pe.status(9) == FAILED and await de.status(9) == FAILED
    assert (await de.failure(9))[0] == "layout"
    assert not (de.pool.aux[3] == pe.pool.aux[1]).all()  # aux never written
    assert _landed(pe, de, before, set(), 6) or _landed(pe, de, before, {0, 1}, 6)


@pytest.mark.parametrize("how", ["abort", "write_fails"])
async def test_i22_a_stream_ended_midway_fails_both_sides_and_writes_no_more(
        cluster: Cluster, how: str) -> None:
    pe, de, before = await _pair(cluster)
    await _layers(pe, SRC, 0, 1)
    await settle(cluster)
    if how == "abort":
        await pe.call(rpc.Abort(room=9, reason="client gone"))
    else:
        cluster.fabric.hook = FaultInjector(FaultPlan(fail_batches=list(range(1000))))
        await _layers(pe, [], 1, 2)
    await settle(cluster)
    assert await pe.status(9) == FAILED and await de.status(9) == FAILED
    landed = [b.copy() for b in de.pool.kv]
    cluster.fabric.hook = None
    await _layers(pe, [], 2, 4, last=True)  # dropped: the room ended (the engine polls)
    await settle(cluster)
    assert all(np.array_equal(g, w) for g, w in zip(de.pool.kv, landed, strict=True))
    assert _landed(pe, de, before, {0}, 6)  # layer 0 only, nothing after the end


TOKEN = 2 * 8 * 2  # bytes of one token in one buffer (2 heads x head_dim 8 x 2 bytes, NHD)


def _tokens_landed(pe: Engine, de: Engine, before: list[np.ndarray], src: list[int],
                   dst: list[int], ps: int, pd: int, layers: set[int], hi: int) -> bool:
    """Do the decode's buffers hold exactly room tokens ``[0, hi)`` of ``layers`` (a
    token-by-token copy from prefill page slot to decode page slot), every other byte as
    it was?"""
    for b, (got, old, s) in enumerate(zip(de.pool.kv, before, pe.pool.kv, strict=True)):
        want = old.copy()
        if b % LAYERS in layers:
            for t in range(hi):
                a, c = (t % ps) * TOKEN, (t % pd) * TOKEN
                want[dst[t // pd], c:c + TOKEN] = s[src[t // ps], a:a + TOKEN]
        if not np.array_equal(got, want):
            return False
    return True


@pytest.mark.parametrize(("ps", "pd"), [(16, 64), (64, 16)])
async def test_i22_a_stream_to_another_page_size_lands_layer_by_layer(
        cluster: Cluster, ps: int, pd: int) -> None:
    """Re-tiled pages stream too: each layer's tokens land as soon as its pages were named
    (not once every layer came), byte for byte against a token-by-token copy; a last send
    of no layers then finishes the room with aux."""
    tokens = 256  # 16 pages of 16, 4 of 64
    src = [int(x) for x in np.random.default_rng(ps).permutation(40)[:tokens // ps]]
    dst = [int(x) for x in np.random.default_rng(pd).permutation(40)[:tokens // pd]]
    p, d = await cluster.node("prefill"), await cluster.node("decode")
    pe = await p.engine(seed=1, page_size=ps, item_len=ps * TOKEN, head_dim=8, num_pages=40,
                        num_layers=LAYERS)
    de = await d.engine(seed=2, page_size=pd, item_len=pd * TOKEN, head_dim=8, num_pages=40,
                        num_layers=LAYERS)
    before = [b.copy() for b in de.pool.kv]
    await de.receiver(9, dst, p.http_addr, aux=3)
    await pe.sender(9, src, aux=1, send=False)
    await _layers(pe, src, 0, 1)
    await settle(cluster)
    assert _tokens_landed(pe, de, before, src, dst, ps, pd, {0}, tokens)
    assert await de.status(9) != SUCCESS
    for layer in range(1, LAYERS):
        await _layers(pe, [], layer, layer + 1)
        await settle(cluster)
        assert _tokens_landed(pe, de, before, src, dst, ps, pd, set(range(layer + 1)), tokens)
    assert await de.status(9) != SUCCESS  # aux has not come
    await _layers(pe, [], LAYERS, LAYERS, last=True)  # finish: every layer was sent
    await settle(cluster)
    assert await pe.status(9) == SUCCESS and await de.status(9) == SUCCESS
    assert (de.pool.aux[3] == pe.pool.aux[1]).all()


async def test_i22_a_last_send_of_no_layers_with_layers_missing_names_them(
        cluster: Cluster) -> None:
    pe, de, _ = await _pair(cluster)
    await _layers(pe, SRC, 0, 2)
    with pytest.raises(RoomError, match=r"room pages \[0, 6\) miss layers 2-3"):
        await _layers(pe, [], 0, 0, last=True)
    await settle(cluster)
    assert await pe.status(9) == FAILED and await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout" and "miss layers 2-3" in reason
