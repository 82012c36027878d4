"""Adversarial checks of layer streaming on re-tiled rooms (issue 22 items 3-4): chunks
whose edges cut a page of the other side, a room that ends inside a page, and an abort
racing the layer sends."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvd.errors import RoomError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from tests.inproc.harness import FAILED, SUCCESS, Cluster, Engine, settle
from tests.inproc.test_layers import LAYERS, TOKEN, _tokens_landed


async def _retiled(cluster: Cluster, ps: int, pd: int, tokens: int
                   ) -> tuple[Engine, Engine, list[np.ndarray], list[int], list[int]]:
    src = [int(x) for x in np.random.default_rng(ps).permutation(40)[:-(-tokens // ps)]]
    dst = [int(x) for x in np.random.default_rng(pd).permutation(40)[:-(-tokens // pd)]]
    p, d = await cluster.node("prefill"), await cluster.node("decode")
    pe = await p.engine(seed=1, page_size=ps, item_len=ps * TOKEN, head_dim=8, num_pages=40,
                        num_layers=LAYERS)
    de = await d.engine(seed=2, page_size=pd, item_len=pd * TOKEN, head_dim=8, num_pages=40,
                        num_layers=LAYERS)
    before = [b.copy() for b in de.pool.kv]
    await de.receiver(9, dst, p.http_addr, aux=3)
    await pe.sender(9, src, aux=1, send=False)
    return pe, de, before, src, dst


async def _layers(pe: Engine, pages: list[int], lo: int, hi: int, last: bool = False) -> None:
    await pe.call(rpc.SenderSendLayers(room=9, pages=pack_indices(pages), layer_start=lo,
                                       layer_end=hi, is_last=last))


@pytest.mark.parametrize(("ps", "pd"), [(16, 64), (64, 16)])
async def test_i22_layer_chunks_cutting_a_page_of_the_other_side_land_token_exact(
        cluster: Cluster, ps: int, pd: int) -> None:
    """80 tokens: the room ends inside a page of the larger side; layer 0 comes in two
    chunks whose edge cuts a page of the other side, then the other layers of all."""
    tokens = 80
    pe, de, before, src, dst = await _retiled(cluster, ps, pd, tokens)
    # the room's page count as this side names it; the first chunk: 48 tokens (ps 16) or
    # the first 64-token page (ps 64)
    cut = 3 if ps == 16 else 1
    await _layers(pe, src[:cut], 0, 1)
    await _layers(pe, src[cut:], 0, 1)
    for layer in range(1, LAYERS):
        await _layers(pe, [], layer, layer + 1)
    await _layers(pe, [], LAYERS, LAYERS, last=True)
    await settle(cluster)
    assert await pe.status(9) == SUCCESS and await de.status(9) == SUCCESS, \
        await de.failure(9)
    assert _tokens_landed(pe, de, before, src, dst, ps, pd, set(range(LAYERS)), tokens)


@pytest.mark.parametrize(("ps", "pd"), [(16, 64), (64, 16)])
async def test_i22_an_abort_racing_layer_sends_of_a_retiled_room_writes_no_later_layer(
        cluster: Cluster, ps: int, pd: int) -> None:
    tokens = 128
    pe, de, before, src, _ = await _retiled(cluster, ps, pd, tokens)
    await _layers(pe, src, 0, 1)
    await pe.call(rpc.Abort(room=9, reason="the engine's abort"))  # layer 0 may be in flight
    for layer in range(1, LAYERS):
        with contextlib.suppress(RoomError):
            await _layers(pe, [], layer, layer + 1, last=layer == LAYERS - 1)
    await settle(cluster)
    assert await pe.status(9) == FAILED and await de.status(9) == FAILED
    for b, (got, old) in enumerate(zip(de.pool.kv, before, strict=True)):
        if b % LAYERS:  # no byte of a layer sent after the abort
            assert np.array_equal(got, old), f"buffer {b} written after the abort"
