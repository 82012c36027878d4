"""Issue 22 from a hostile user's side, in process: every field of the compatibility
fingerprint mismatched in turn (each fails the pair's first room at registration, naming
the field, with no byte written), one engine that names no fingerprint against one that
does, and page sizes that do not divide each other (16 <-> 24 tokens), served byte for byte
against a token-by-token copy."""

from __future__ import annotations

import contextlib

import msgspec
import numpy as np
import pytest

from kvd.protocol import codec, rpc
from kvd.protocol.control import Compat
from kvd.refengine.standin import ModelSpec
from tests.inproc.harness import FAILED, SUCCESS, Cluster, settle
from tests.inproc.test_retile import _room, token_copy

SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=16)
BASE = Compat(model_id="qwen", kv_dtype="bfloat16", scale_layout="none", layer_types="AA",
              spec_config="")
OTHER = {"model_id": "llama", "kv_dtype": "fp8_e4m3", "scale_layout": "per_tensor",
         "layer_types": "AL", "spec_config": "eagle3:3"}


async def _refused_pair(cluster: Cluster, prefill: Compat | None,
                        decode: Compat | None) -> tuple[str, str]:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await p.shard_engine(SPEC, source=SPEC.global_kv(1), seed=1, compat=prefill)
    de = await d.shard_engine(SPEC, seed=2, compat=decode)
    await de.receiver(1, [1], p.http_addr)
    await pe.sender(1, [2])
    await settle(cluster)
    assert await de.status(1) == FAILED and await pe.status(1) == FAILED
    assert not cluster.fabric.writes  # no byte moved
    return await de.failure(1)


@pytest.mark.parametrize("field", sorted(OTHER))
async def test_i22_each_engine_fingerprint_field_mismatched_fails_the_first_room(
        cluster: Cluster, field: str) -> None:
    decode = msgspec.structs.replace(BASE, **{field: OTHER[field]})
    kind, reason = await _refused_pair(cluster, BASE, decode)
    assert kind == "registration"
    assert f"{field} {getattr(BASE, field)!r} vs {OTHER[field]!r}" in reason


async def test_i22_a_decode_of_another_wire_version_fails_the_first_room(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon stamps its own wire version: a decode daemon of another version (as an
    older kvd would be) is refused at pairing, naming both versions."""
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await p.shard_engine(SPEC, source=SPEC.global_kv(1), seed=1, compat=BASE)
    monkeypatch.setattr(codec, "VERSION", codec.VERSION + 1)
    de = await d.shard_engine(SPEC, seed=2, compat=BASE)
    monkeypatch.undo()
    await de.receiver(1, [1], p.http_addr)
    await pe.sender(1, [2])
    await settle(cluster)
    assert await de.status(1) == FAILED and not cluster.fabric.writes
    kind, reason = await de.failure(1)
    assert kind == "registration"
    assert f"wire_version {codec.VERSION} vs {codec.VERSION + 1}" in reason


async def test_i22_an_engine_naming_no_fingerprint_against_one_naming_a_model_is_refused(
        cluster: Cluster) -> None:
    """An engine that says nothing (``compat=None``) is not a wildcard: its model id is
    empty, which differs from the other side's."""
    kind, reason = await _refused_pair(cluster, BASE, None)
    assert kind == "registration" and "model_id 'qwen' vs ''" in reason


# 16 <-> 24: neither divides the other (lcm 48); 96 tokens on both sides, or fewer on one
ODD = [(16, 24, [0, 1, 2, 3, 4, 5], [7, 8, 9, 10], 0, [2, 2, 2]),
       (16, 24, [0, 1, 2, 3, 4], [7, 8, 9, 10], 0, [1, 1, 1, 1, 1]),
       (24, 16, [0, 1, 2, 3], [7, 8, 9, 10, 11, 12], 0, [1, 3]),
       (24, 16, [0, 1, 2, 3], [7, 8, 9, 10, 11, 12], 2, [4]),
       (16, 24, [0, 1, 2, 3, 4, 5], [7, 8, 9, 10], 1, [3, 3])]


@pytest.mark.parametrize(("ps", "pd", "src", "dst", "first", "chunks"), ODD)
async def test_i22_page_sizes_that_do_not_divide_move_byte_for_byte(
        cluster: Cluster, ps: int, pd: int, src: list[int], dst: list[int], first: int,
        chunks: list[int]) -> None:
    pe, de, before = await _room(cluster, ps, pd, src, dst, first, chunks)
    assert await pe.status(9) == SUCCESS and await de.status(9) == SUCCESS
    want = token_copy(de, pe, before, src, dst, ps, pd, first * pd,
                      min(len(src) * ps, len(dst) * pd))
    for got, exp in zip(de.pool.kv, want, strict=True):
        assert np.array_equal(got, exp)
    assert (de.pool.aux[3] == pe.pool.aux[1]).all()


# ---- a draft group, or a state slot, named on one side only ----------------------------


async def test_i22_a_draft_group_only_on_the_decode_is_refused(cluster: Cluster) -> None:
    """The reverse of test_groups' case: the decode registers a draft group that no
    prefill stage holds (the decode would read a draft KV nobody wrote)."""
    from tests.inproc.test_groups import GROUPS, INDEXER, group_engine
    from tests.inproc.test_groups import SPEC as GSPEC
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await group_engine(p, (INDEXER,), source=GSPEC.global_kv(1),
                            group_source={INDEXER.name: INDEXER.truth(GSPEC, 1)}, seed=1)
    de = await group_engine(d, GROUPS, seed=2)
    await de.receiver(1, [1], p.http_addr)
    await pe.sender(1, [2])
    await settle(cluster)
    kind, reason = await de.failure(1)
    assert kind == "registration" and "'draft'" in reason, reason
    assert not cluster.fabric.writes


@pytest.mark.parametrize(("prefill_state", "decode_state"), [(-1, 0), (0, -1), (-5, 0),
                                                             (0, -5)])
async def test_i22_a_hybrid_room_with_a_state_slot_on_one_side_only_never_succeeds(
        cluster: Cluster, prefill_state: int, decode_state: int) -> None:
    """A hybrid room whose prefill or decode names no state slot (or a negative one) is
    refused at init or fails, kind layout: a decode never reads Success with its state slot
    unwritten."""
    from kvd.errors import RoomError
    from tests.inproc.test_state_rooms import SPEC as HSPEC
    from tests.inproc.test_state_rooms import hybrid, recv_room, send_room
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await hybrid(p, HSPEC, source=HSPEC.truth(1), seed=1)
    de = await hybrid(d, HSPEC, seed=2)
    try:
        await recv_room(de, 9, p.http_addr, state=decode_state)
    except RoomError:
        return  # refused at init, before anything moves
    with contextlib.suppress(RoomError):
        await send_room(pe, 9, state=prefill_state)
    await settle(cluster)
    assert await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout", reason


# ---- layer streaming racing an abort, a clear and a room id used again -----------------


@pytest.mark.parametrize("end", ["abort", "clear"])
async def test_i22_a_layer_write_in_flight_when_the_room_ends_and_its_id_returns(
        cluster: Cluster, end: str) -> None:
    """Layer 0 is being written (the decode frozen) when the prefill engine aborts or clears
    the room and creates the same id again, streaming every layer: the decode's pages are not
    releasable while the old write is in flight; once it returned, only layer 0 of the old
    attempt landed (the new attempt has no decode room to write) and nothing else moved."""
    from tests.inproc.test_layers import DST, LAYERS, SRC, _landed, _layers, _pair
    pe, de, before = await _pair(cluster)
    d = de.node
    cluster.fabric.hold(d.session)
    await _layers(pe, SRC, 0, 1)
    await settle(cluster)
    if end == "abort":
        await pe.call(rpc.Abort(room=9, reason="client gone"))
    await pe.call(rpc.Clear(room=9))
    await pe.call(rpc.SenderCreate(room=9))
    await pe.call(rpc.SenderInit(room=9, num_pages=len(SRC), aux_index=1))
    await _layers(pe, SRC, 0, LAYERS, last=True)
    await settle(cluster)
    assert await de.status(9) == FAILED
    assert not await de.releasable(9)  # the old layer-0 write is still in flight
    cluster.fabric.release(d.session)
    await settle(cluster)
    assert await de.releasable(9)
    assert await pe.status(9) != SUCCESS
    assert _landed(pe, de, before, {0}, len(DST))  # the old write, waited out, and no more


async def test_i22_one_decode_rank_of_another_model_fails_the_room_on_every_rank(
        cluster: Cluster) -> None:
    """Decode TP 2 whose rank 1 serves another model: the prefill room waits for every
    decode rank, so neither rank is written -- not even rank 0, whose fingerprint matches --
    and both ranks' rooms fail, rank 1's naming the field."""
    p = await cluster.node("prefill")
    pe = await p.shard_engine(SPEC, source=SPEC.global_kv(1), seed=1, compat=BASE)
    ds = [await cluster.node("decode", attn_tp_size=2, attn_tp_rank=r) for r in range(2)]
    other = msgspec.structs.replace(BASE, model_id="llama")
    des = [await d.shard_engine(SPEC, r, 2, seed=10 + r, compat=c)
           for r, (d, c) in enumerate(zip(ds, (BASE, other), strict=True))]
    for de in des:
        await de.receiver(1, [1], p.http_addr)
    await pe.sender(1, [2])
    await settle(cluster)
    assert [await de.status(1) for de in des] == [FAILED, FAILED]
    assert await pe.status(1) == FAILED
    assert "model_id 'qwen' vs 'llama'" in (await des[1].failure(1))[1]
    assert not cluster.fabric.writes
