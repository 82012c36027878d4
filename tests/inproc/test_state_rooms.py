"""In-process tier, issue 22 item 1: a hybrid model's room moves paged KV, its state slot
(with TP resharding) and its window pages through the daemons' dispatch, byte for byte;
pairing refuses a mismatched state layout with one reason; a plan that would write
outside the room's state slot never starts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvd.engine_rpc.server import Connection
from kvd.errors import RoomError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.statepool import HybridShard, HybridSpec
from tests.inproc.harness import FAILED, SUCCESS, Cluster, Engine, Node, settle

SPEC = HybridSpec()
ROOM_PAGES, DST_PAGES = [3, 4, 5], [10, 11, 12]
SRC_WIN, DST_WIN = [6, 7, 2], [1, 9, 14]


async def hybrid(node: Node, spec: HybridSpec, tp_rank: int = 0, tp_size: int = 1,
                 **kw: object) -> Engine:
    sp = HybridShard(spec, tp_rank, tp_size, shm_dir=str(node.cluster.shm_dir), **kw)  # type: ignore[arg-type]
    node.cluster.shards.append(sp)  # closed with the cluster
    eng = Engine(node, sp, Connection(next(node.cluster._conns)))  # type: ignore[arg-type]
    await eng.call(sp.registration)
    node.engines.append(eng)
    return eng


async def send_room(pe: Engine, room: int, state: int) -> None:
    await pe.call(rpc.SenderCreate(room=room))
    await pe.call(rpc.SenderInit(room=room, num_pages=len(ROOM_PAGES), aux_index=0,
                                 state_index=state, window_pages=pack_indices(SRC_WIN)))
    await pe.send(room, ROOM_PAGES, chunks=2)


async def recv_room(de: Engine, room: int, bootstrap: str, state: int) -> None:
    await de.call(rpc.ReceiverCreate(room=room, bootstrap_addr=bootstrap))
    await de.call(rpc.ReceiverInit(room=room, dst_pages=pack_indices(DST_PAGES), aux_index=0,
                                   state_index=state, window_pages=pack_indices(DST_WIN)))


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1)])
async def test_i22_a_hybrid_room_moves_kv_state_and_window_bytes_exact(
        cluster: Cluster, prefill_tp: int, decode_tp: int) -> None:
    truth = SPEC.truth(7)
    ps = [await cluster.node("prefill", attn_tp_size=prefill_tp, attn_tp_rank=0)]
    ps += [await cluster.node("prefill", bootstrap=ps[0], attn_tp_size=prefill_tp,
                              attn_tp_rank=r) for r in range(1, prefill_tp)]
    pes = [await hybrid(p, SPEC, r, prefill_tp, source=truth, seed=r + 1)
           for r, p in enumerate(ps)]
    ds = [await cluster.node("decode", attn_tp_size=decode_tp, attn_tp_rank=r)
          for r in range(decode_tp)]
    des = [await hybrid(d, SPEC, r, decode_tp, seed=10 + r) for r, d in enumerate(ds)]
    for de in des:
        await recv_room(de, 5, ps[0].http_addr, state=3)
        before = de.pool.holds(truth, ROOM_PAGES, DST_PAGES, 1, 3, SRC_WIN, DST_WIN)  # type: ignore[attr-defined]
        assert before == {"kv": False, "window": False, "state": False}  # noise until moved
    for pe in pes:
        await send_room(pe, 5, state=1)
    await settle(cluster)
    for de in des:
        assert await de.status(5) == SUCCESS, await de.failure(5)
        got = de.pool.holds(truth, ROOM_PAGES, DST_PAGES, 1, 3, SRC_WIN, DST_WIN)  # type: ignore[attr-defined]
        assert got == {"kv": True, "window": True, "state": True}


async def test_i22_nothing_outside_the_room_state_slot_and_window_pages_changes(
        cluster: Cluster) -> None:
    truth = SPEC.truth(8)
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=truth, seed=1)
    d = await cluster.node("decode")
    de = await hybrid(d, SPEC, seed=2)
    sp: HybridShard = de.pool  # type: ignore[assignment]
    before = {k: v.copy() for k, v in sp.state.items()}
    win_before = [v.reshape(SPEC.window_pages, -1).copy() for v in sp.window]
    await recv_room(de, 6, p.http_addr, state=2)
    await send_room(pe, 6, state=0)
    await settle(cluster)
    assert await de.status(6) == SUCCESS
    for k, v in sp.state.items():
        others = [i for i in range(SPEC.state_slots) if i != 2]
        assert np.array_equal(v[others], before[k][others])
    untouched = [i for i in range(SPEC.window_pages) if i not in DST_WIN]
    for v, b in zip(sp.window, win_before, strict=True):
        assert np.array_equal(v.reshape(SPEC.window_pages, -1)[untouched], b[untouched])


async def test_i22_pairing_refuses_another_state_shape_with_one_reason(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=SPEC.truth(1), seed=1)
    d = await cluster.node("decode")
    other = replace(SPEC, state_kinds={"conv": (4, 12), "ssm": (4, 16)})
    de = await hybrid(d, other, seed=2)
    await recv_room(de, 7, p.http_addr, state=0)
    await send_room(pe, 7, state=0)
    await settle(cluster)
    assert await de.status(7) == FAILED
    kind, reason = await de.failure(7)
    assert kind == "registration", reason
    assert "layer 1 state 'ssm' head_bytes 32 vs 16" in reason


async def test_i22_pairing_refuses_a_decode_without_state_buffers(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=SPEC.truth(1), seed=1)
    d = await cluster.node("decode")
    de = await d.engine(seed=2, num_layers=2, item_len=256, page_size=4, head_dim=8)
    await de.receiver(8, DST_PAGES, p.http_addr)
    await send_room(pe, 8, state=0)
    await settle(cluster)
    assert await de.status(8) == FAILED
    assert "only the prefill registers state buffers" in (await de.failure(8))[1]


async def test_i22_a_room_naming_a_state_slot_outside_the_pool_fails_with_layout(
        cluster: Cluster) -> None:
    """The decode refuses its own slot past the pool at init (K42's claims know the pool);
    a prefill naming a source slot past its pool fails the room, kind layout."""
    p = await cluster.node("prefill")
    pe = await hybrid(p, SPEC, source=SPEC.truth(1), seed=1)
    d = await cluster.node("decode")
    de = await hybrid(d, SPEC, seed=2)
    with pytest.raises(RoomError, match=r"state slot 4 \(position 0\) outside \[0, 4\)"):
        await recv_room(de, 9, p.http_addr, state=SPEC.state_slots)  # one past the last slot
    await de.call(rpc.ReceiverInit(room=9, dst_pages=pack_indices(DST_PAGES), aux_index=0,
                                   state_index=0, window_pages=pack_indices(DST_WIN)))
    await send_room(pe, 9, state=SPEC.state_slots)
    await settle(cluster)
    assert await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout" and "state index 4 outside the 4 slots" in reason


async def test_i22_window_pages_must_be_whole_int32_indices(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    de = await hybrid(d, SPEC, seed=2)
    await de.call(rpc.ReceiverCreate(room=10, bootstrap_addr=p.http_addr))
    with pytest.raises(RoomError, match="window pages"):
        await de.call(rpc.ReceiverInit(room=10, dst_pages=pack_indices([1]), aux_index=0,
                                       state_index=0, window_pages=b"\x01\x02"))


# ---- the hybrid reference model, PD vs colocated --------------------------------------

@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1)])
async def test_i22_hybrid_model_pd_is_token_exact_against_colocated(
        cluster: Cluster, prefill_tp: int, decode_tp: int) -> None:
    from kvd.refengine.hybriddemo import as_truth, gather, model_spec
    from kvd.refengine.hybridmodel import HybridModel
    model, spec = HybridModel(5), model_spec()
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 97, 13)]
    want = model.generate_reference(prompt, 16)
    first, caches = model.prefill(prompt)
    truth = as_truth(spec, caches, slot=1)
    n_pages = -(-len(prompt) // spec.page_size)
    w0 = (len(prompt) - spec.window_tokens) // spec.page_size  # first page of the window
    src, dst = list(range(n_pages)), [9, 2, 14, 5][:n_pages]
    s_win, d_win = list(range(w0, n_pages)), [11, 3, 7][:n_pages - w0]
    ps = [await cluster.node("prefill", attn_tp_size=prefill_tp, attn_tp_rank=0)]
    ps += [await cluster.node("prefill", bootstrap=ps[0], attn_tp_size=prefill_tp,
                              attn_tp_rank=r) for r in range(1, prefill_tp)]
    pes = [await hybrid(p, spec, r, prefill_tp, source=truth, seed=r + 1)
           for r, p in enumerate(ps)]
    ds = [await cluster.node("decode", attn_tp_size=decode_tp, attn_tp_rank=r)
          for r in range(decode_tp)]
    des = [await hybrid(d, spec, r, decode_tp, seed=20 + r) for r, d in enumerate(ds)]
    for de in des:
        await de.call(rpc.ReceiverCreate(room=30, bootstrap_addr=ps[0].http_addr))
        await de.call(rpc.ReceiverInit(room=30, dst_pages=pack_indices(dst), aux_index=0,
                                       state_index=2, window_pages=pack_indices(d_win)))
    for pe in pes:
        await pe.call(rpc.SenderCreate(room=30))
        await pe.call(rpc.SenderInit(room=30, num_pages=n_pages, aux_index=0, state_index=1,
                                     window_pages=pack_indices(s_win)))
        await pe.send(30, src, chunks=2)
    await settle(cluster)
    assert [await de.status(30) for de in des] == [SUCCESS] * decode_tp
    got = gather(spec, [de.pool for de in des], dst, d_win, w0 * spec.page_size, 2,  # type: ignore[misc]
                 len(prompt))
    assert model.decode(got, first, 16) == want


@pytest.mark.parametrize("decode_tp", [1, 2])
async def test_i22_prefill_pp2_stages_each_write_their_state_and_window_layers(
        cluster: Cluster, decode_tp: int) -> None:
    """Prefill PP 2 split after the state layer (stage 0: full + state, stage 1: window +
    full), decode one stage: every part arrives byte for byte, from the stage holding it."""
    truth = SPEC.truth(9)
    s0 = await cluster.node("prefill", pp_size=2, pp_rank=0)
    s1 = await cluster.node("prefill", bootstrap=s0, pp_size=2, pp_rank=1)
    pes = [await hybrid(n, SPEC, source=truth, seed=k + 1, stage=st)
           for k, (n, st) in enumerate([(s0, (0, 2)), (s1, (2, 4))])]
    ds = [await cluster.node("decode", attn_tp_size=decode_tp, attn_tp_rank=r)
          for r in range(decode_tp)]
    des = [await hybrid(d, SPEC, r, decode_tp, seed=30 + r) for r, d in enumerate(ds)]
    for de in des:
        await recv_room(de, 40, s0.http_addr, state=0)
    for pe in pes:
        await send_room(pe, 40, state=2)
    await settle(cluster)
    for de in des:
        assert await de.status(40) == SUCCESS, await de.failure(40)
        got = de.pool.holds(truth, ROOM_PAGES, DST_PAGES, 2, 0, SRC_WIN, DST_WIN)  # type: ignore[attr-defined]
        assert got == {"kv": True, "window": True, "state": True}


def _tokens(views: list[np.ndarray], pages: list[int], page_size: int) -> np.ndarray:
    """``[buffer, token, token bytes]`` of the room pages ``pages`` (NHD): token ``t`` is
    page ``pages[t // page_size]`` slot ``t % page_size``."""
    token = SPEC.total_kv_heads * SPEC.head_dim * 2  # TP 1: every head
    return np.stack([v.reshape(-1, page_size, token)[np.asarray(pages)].reshape(
        len(pages) * page_size, token) for v in views])


@pytest.mark.parametrize(("ps", "pd"), [(4, 8), (8, 4)])
async def test_i22_a_hybrid_room_between_page_sizes_moves_kv_and_window_tokens_exact(
        cluster: Cluster, ps: int, pd: int) -> None:
    """A prefill of page size ``ps`` and a decode of ``pd``: the paged KV and the window
    pool are re-tiled in tokens (the window: the tokens both sides' window pages hold,
    each side's window pages being the tail of its room pages), the state slot moves as
    with equal pages; every decode byte of those tokens equals the prefill's, and the
    decode's other window bytes keep what they held."""
    t_end = 22  # the request's tokens; window_tokens 8: tokens [14, 22) must move
    ns, nd = -(-t_end // ps), -(-t_end // pd)
    room_end = min(ns * ps, nd * pd)
    start = t_end - SPEC.window_tokens
    src_pages, dst_pages = list(range(3, 3 + ns)), list(range(20, 20 - nd, -1))
    s_first, d_first = start // ps, start // pd
    src_win = [6, 7, 2, 9, 11][:ns - s_first]
    dst_win = [1, 9, 14, 3, 5][:nd - d_first]
    p = await cluster.node("prefill")
    pe = await hybrid(p, replace(SPEC, page_size=ps), source=replace(SPEC, page_size=ps).truth(9),
                      seed=1)
    d = await cluster.node("decode")
    de = await hybrid(d, replace(SPEC, page_size=pd), seed=2)
    sp: HybridShard = pe.pool  # type: ignore[assignment]
    dp: HybridShard = de.pool  # type: ignore[assignment]
    before = [v.copy() for v in dp.window]
    await de.call(rpc.ReceiverCreate(room=11, bootstrap_addr=p.http_addr))
    await de.call(rpc.ReceiverInit(room=11, dst_pages=pack_indices(dst_pages), aux_index=0,
                                   state_index=3, window_pages=pack_indices(dst_win)))
    await pe.call(rpc.SenderCreate(room=11))
    await pe.call(rpc.SenderInit(room=11, num_pages=ns, aux_index=0, state_index=1,
                                 window_pages=pack_indices(src_win)))
    await pe.send(11, src_pages, chunks=2)
    await settle(cluster)
    assert await de.status(11) == SUCCESS, await de.failure(11)
    kv_src, kv_dst = _tokens(sp.kv, src_pages, ps), _tokens(dp.kv, dst_pages, pd)
    assert np.array_equal(kv_dst[:, :room_end], kv_src[:, :room_end])
    lo = max(s_first * ps, d_first * pd)
    w_src = _tokens(sp.window, src_win, ps)  # token s_first * ps + i at row i
    w_dst = _tokens(dp.window, dst_win, pd)
    got = w_dst[:, lo - d_first * pd:room_end - d_first * pd]
    assert np.array_equal(got, w_src[:, lo - s_first * ps:room_end - s_first * ps])
    assert lo <= start  # the request's window is inside what moved
    untouched = _tokens(before, dst_win, pd)[:, :lo - d_first * pd]
    assert np.array_equal(w_dst[:, :lo - d_first * pd], untouched)
    for k, v in dp.state.items():
        assert np.array_equal(v[3], sp.state[k][1])
