"""Adversarial checks of the state rooms (issue 22): window pages a prefill names that
lie outside its pool or outnumber the decode's, an init again that changes the state
after chunks left, a state named on one side only, a state slot two decode rooms name."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from kvd.errors import RoomError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from tests.inproc.harness import FAILED, Cluster, settle
from tests.inproc.test_state_rooms import DST_PAGES, DST_WIN, ROOM_PAGES, SPEC, hybrid, recv_room


async def test_i22_a_prefill_window_page_outside_its_pool_fails_the_room(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=SPEC.truth(1), seed=1)
    d = await cluster.node("decode")
    de = await hybrid(d, SPEC, seed=2)
    await recv_room(de, 9, p.http_addr, state=0)
    await pe.call(rpc.SenderCreate(room=9))
    await pe.call(rpc.SenderInit(room=9, num_pages=len(ROOM_PAGES), aux_index=0,
                                 state_index=0,
                                 window_pages=pack_indices([6, 7, SPEC.window_pages + 5])))
    with contextlib.suppress(RoomError):
        await pe.send(9, ROOM_PAGES, chunks=1)
    await settle(cluster)
    assert await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout", reason


async def test_i22_window_pages_longer_than_the_decode_window_fail_the_room(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=SPEC.truth(1), seed=1)
    d = await cluster.node("decode")
    de = await hybrid(d, SPEC, seed=2)
    await de.call(rpc.ReceiverCreate(room=9, bootstrap_addr=p.http_addr))
    await de.call(rpc.ReceiverInit(room=9, dst_pages=pack_indices(DST_PAGES), aux_index=0,
                                   state_index=0, window_pages=pack_indices(DST_WIN[:1])))
    await pe.call(rpc.SenderCreate(room=9))
    await pe.call(rpc.SenderInit(room=9, num_pages=len(ROOM_PAGES), aux_index=0,
                                 state_index=0,
                                 window_pages=pack_indices([6, 7, 2, 1, 0])))
    with contextlib.suppress(RoomError):
        await pe.send(9, ROOM_PAGES, chunks=1)
    await settle(cluster)
    assert await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout" and "window pages: 5 source vs 1 destination" in reason


async def test_i22_an_init_again_naming_another_state_after_chunks_left_is_refused(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=SPEC.truth(1), seed=1)
    await pe.call(rpc.SenderCreate(room=9))
    await pe.call(rpc.SenderInit(room=9, num_pages=len(ROOM_PAGES), aux_index=0))
    await pe.call(rpc.SenderInit(room=9, num_pages=len(ROOM_PAGES), aux_index=0,
                                 state_index=1, window_pages=pack_indices([6, 7, 2])))
    with pytest.raises(RoomError, match="init again names state slot 2"):
        await pe.call(rpc.SenderInit(room=9, num_pages=len(ROOM_PAGES), aux_index=0,
                                     state_index=2, window_pages=pack_indices([6, 7, 2])))
    with pytest.raises(RoomError, match="init again names state slot 1"):
        await pe.call(rpc.SenderInit(room=9, num_pages=len(ROOM_PAGES), aux_index=0,
                                     state_index=1, window_pages=pack_indices([6, 7])))


async def test_i22_a_prefill_that_names_no_state_for_a_decode_that_waits_for_one_fails(
        cluster: Cluster) -> None:
    """The decode names state slot 0 and window pages; the prefill's init names neither
    (SGLang's state index -1, or an adapter that lost it): the room must not succeed with
    the decode's slot holding whatever was there (fail-open, as vllm#52234)."""
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=SPEC.truth(1), seed=1)
    d = await cluster.node("decode")
    de = await hybrid(d, SPEC, seed=2)
    await recv_room(de, 9, p.http_addr, state=0)
    await pe.call(rpc.SenderCreate(room=9))
    await pe.call(rpc.SenderInit(room=9, num_pages=len(ROOM_PAGES), aux_index=0))
    with contextlib.suppress(RoomError):
        await pe.send(9, ROOM_PAGES, chunks=1)
    await settle(cluster)
    assert await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout", reason


async def test_i22_a_decode_that_names_no_state_for_a_prefill_that_sends_one_fails(
        cluster: Cluster) -> None:
    """The mirror: the decode's init names no state slot (index -1) but the prefill sends
    slot 1: the room must not succeed with the decode's state never written."""
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=SPEC.truth(1), seed=1)
    d = await cluster.node("decode")
    de = await hybrid(d, SPEC, seed=2)
    await de.call(rpc.ReceiverCreate(room=9, bootstrap_addr=p.http_addr))
    await de.call(rpc.ReceiverInit(room=9, dst_pages=pack_indices(DST_PAGES), aux_index=0,
                                   state_index=-1, window_pages=pack_indices(DST_WIN)))
    await pe.call(rpc.SenderCreate(room=9))
    await pe.call(rpc.SenderInit(room=9, num_pages=len(ROOM_PAGES), aux_index=0,
                                 state_index=1, window_pages=pack_indices([6, 7, 2])))
    with contextlib.suppress(RoomError):
        await pe.send(9, ROOM_PAGES, chunks=1)
    await settle(cluster)
    assert await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout", reason


async def test_i22_two_live_decode_rooms_never_share_a_state_slot(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    de = await hybrid(d, SPEC, seed=2)
    await recv_room(de, 9, p.http_addr, state=2)
    await de.call(rpc.ReceiverCreate(room=10, bootstrap_addr=p.http_addr))
    with pytest.raises(RoomError, match="state slot 2"):
        await de.call(rpc.ReceiverInit(room=10, dst_pages=pack_indices([20, 21]),
                                       aux_index=1, state_index=2,
                                       window_pages=pack_indices([3])))


@pytest.mark.parametrize(("ps", "pd", "n_src", "n_dst"), [(4, 8, 1, 1), (8, 4, 1, 1),
                                                         (4, 8, 1, 2), (8, 4, 2, 1)])
async def test_i22_a_retiled_window_that_misses_window_tokens_fails_not_succeeds(
        cluster: Cluster, ps: int, pd: int, n_src: int, n_dst: int) -> None:
    """A room of 22 tokens, a window of 8 (tokens [14, 22) must move): a side whose window
    pages start after token 24 - 8 = 16 (the room's last write ends at 24) cannot hold the
    window. kvd used to move the tokens both lists held and report Success, leaving tokens
    of the decode's own window pages unwritten (fail-open): the room must fail instead."""
    t_end = 22
    ns, nd = -(-t_end // ps), -(-t_end // pd)
    src_pages, dst_pages = list(range(3, 3 + ns)), list(range(20, 20 - nd, -1))
    p = await cluster.node("prefill")
    pe = await hybrid(p, replace(SPEC, page_size=ps),
                      source=replace(SPEC, page_size=ps).truth(9), seed=1)
    d = await cluster.node("decode")
    de = await hybrid(d, replace(SPEC, page_size=pd), seed=2)
    await de.call(rpc.ReceiverCreate(room=11, bootstrap_addr=p.http_addr))
    await de.call(rpc.ReceiverInit(room=11, dst_pages=pack_indices(dst_pages), aux_index=0,
                                   state_index=3, window_pages=pack_indices([1, 9, 14][:n_dst])))
    await pe.call(rpc.SenderCreate(room=11))
    await pe.call(rpc.SenderInit(room=11, num_pages=ns, aux_index=0, state_index=1,
                                 window_pages=pack_indices([6, 7, 2][:n_src])))
    with contextlib.suppress(RoomError):
        await pe.send(11, src_pages, chunks=2)
    await settle(cluster)
    assert await de.status(11) == FAILED
    kind, reason = await de.failure(11)
    assert "window pages start at room token" in reason, (kind, reason)
