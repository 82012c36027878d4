"""In-process tier, issue 22 items 1 and 2: a room moves, besides its paged KV, extra paged
cache groups on the same pages -- a draft model's KV (head-sliced, its own heads and item
length) and an indexer K cache (replicated) -- byte for byte, with TP resharding and a
chunked send; pairing refuses a decode without the group, with another group shape, or
with another spec config or typed aux layout, naming why, and nothing is written."""

from __future__ import annotations

from typing import Any

import pytest

from kvd.engine_rpc.server import Connection
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.protocol.control import AuxField, Compat
from kvd.refengine.grouppool import GroupDef, GroupShard
from kvd.refengine.standin import ModelSpec
from tests.inproc.harness import SUCCESS, Cluster, Engine, Node, settle

SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=16,
                 aux_item_len=64)
DRAFT = GroupDef("draft", layers=1, heads=2, head_bytes=12, layout="HND")
INDEXER = GroupDef("indexer", layers=2, heads=1, head_bytes=20, replicated=True)
GROUPS = (DRAFT, INDEXER)
EAGLE = "eagle:draft=tiny;steps=3"
COMPAT = Compat(model_id="tiny", kv_dtype="float32", spec_config=EAGLE)
FIELDS = (AuxField("ids", "int32", 0, 4), AuxField("hidden", "float32", 4, 32))


async def group_engine(node: Node, groups: tuple[GroupDef, ...], tp_rank: int = 0,
                       tp_size: int = 1, **kw: Any) -> Engine:
    kw = {"compat": COMPAT, "aux_fields": FIELDS} | kw
    sp = GroupShard(SPEC, groups, tp_rank, tp_size, shm_dir=str(node.cluster.shm_dir), **kw)
    node.cluster.shards.append(sp)  # closed with the cluster
    eng = Engine(node, sp, Connection(next(node.cluster._conns)))  # type: ignore[arg-type]
    await eng.call(sp.registration)
    node.engines.append(eng)
    return eng


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1)])
async def test_i22_a_room_moves_its_draft_and_indexer_groups_byte_for_byte(
        cluster: Cluster, prefill_tp: int, decode_tp: int) -> None:
    kv = SPEC.global_kv(3)
    truth = {g.name: g.truth(SPEC, 40 + i) for i, g in enumerate(GROUPS)}
    ps = [await cluster.node("prefill", attn_tp_size=prefill_tp, attn_tp_rank=0)]
    ps += [await cluster.node("prefill", bootstrap=ps[0], attn_tp_size=prefill_tp,
                              attn_tp_rank=r) for r in range(1, prefill_tp)]
    pes = [await group_engine(p, GROUPS, r, prefill_tp, source=kv, group_source=truth,
                              seed=r + 1) for r, p in enumerate(ps)]
    ds = [await cluster.node("decode", attn_tp_size=decode_tp, attn_tp_rank=r)
          for r in range(decode_tp)]
    des = [await group_engine(d, GROUPS, r, decode_tp, seed=10 + r) for r, d in enumerate(ds)]
    src, dst = [3, 4, 5], [10, 1, 7]
    for de in des:
        assert de.pool.group_holds(truth, src, dst) == {"draft": False, "indexer": False}  # type: ignore[attr-defined]
        await de.receiver(5, dst, ps[0].http_addr)
    for pe in pes:
        await pe.sender(5, src, chunks=2)
    await settle(cluster)
    for de in des:
        assert await de.status(5) == SUCCESS, await de.failure(5)
        assert de.pool.holds(kv, src, dst)
        assert de.pool.group_holds(truth, src, dst) == {"draft": True, "indexer": True}  # type: ignore[attr-defined]


async def _refused(cluster: Cluster, decode_groups: tuple[GroupDef, ...],
                   **decode_kw: Any) -> str:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await group_engine(p, GROUPS, source=SPEC.global_kv(1),
                            group_source={g.name: g.truth(SPEC, 1) for g in GROUPS}, seed=1)
    de = await group_engine(d, decode_groups, seed=2, **decode_kw)
    await de.receiver(1, [1], p.http_addr)
    await pe.sender(1, [2])
    await settle(cluster)
    kind, reason = await de.failure(1)
    assert kind == "registration", reason
    assert not cluster.fabric.writes
    return reason


async def test_i22_a_decode_without_the_draft_group_is_refused(cluster: Cluster) -> None:
    reason = await _refused(cluster, (INDEXER,))
    assert "group 'draft' only on the prefill" in reason


async def test_i22_a_draft_group_of_another_shape_is_refused(cluster: Cluster) -> None:
    other = GroupDef("draft", layers=1, heads=2, head_bytes=16, layout="HND")
    reason = await _refused(cluster, (other, INDEXER))
    assert "group 'draft'" in reason and "head_dim 3 vs 4" in reason


async def test_i22_a_decode_with_another_spec_config_is_refused(cluster: Cluster) -> None:
    reason = await _refused(cluster, GROUPS,
                            compat=Compat(model_id="tiny", kv_dtype="float32",
                                          spec_config="eagle:draft=tiny;steps=5"))
    assert f"spec_config {EAGLE!r} vs 'eagle:draft=tiny;steps=5'" in reason


async def test_i22_a_decode_with_another_typed_aux_is_refused(cluster: Cluster) -> None:
    reason = await _refused(cluster, GROUPS, aux_fields=(AuxField("ids", "int32", 0, 4),
                                                         AuxField("hidden", "bfloat16", 4, 16)))
    assert "aux_layout" in reason and "hidden:bfloat16@4+16" in reason


async def test_i22_a_layer_streamed_room_writes_its_groups_once(cluster: Cluster) -> None:
    """Groups ride with the write of the pool's last layer: a room streamed layer by layer
    moves them byte for byte, and the bytes written are the room's KV, its groups and aux
    once each (before, every layer write wrote the groups again)."""
    kv = SPEC.global_kv(3)
    truth = {g.name: g.truth(SPEC, 40 + i) for i, g in enumerate(GROUPS)}
    p, d = await cluster.node("prefill"), await cluster.node("decode")
    pe = await group_engine(p, GROUPS, source=kv, group_source=truth, seed=1)
    de = await group_engine(d, GROUPS, seed=10)
    src, dst = [3, 4, 5], [10, 1, 7]
    await de.receiver(5, dst, p.http_addr)
    await pe.sender(5, src, send=False)
    start = len(cluster.fabric.writes)
    for layer in range(SPEC.num_layers):
        await pe.call(rpc.SenderSendLayers(room=5, pages=pack_indices(src if not layer else []),
                                           layer_start=layer, layer_end=layer + 1,
                                           is_last=layer == SPEC.num_layers - 1))
        await settle(cluster)
    assert await de.status(5) == SUCCESS, await de.failure(5)
    assert de.pool.group_holds(truth, src, dst) == {"draft": True, "indexer": True}  # type: ignore[attr-defined]
    reg = pe.pool.registration
    want = len(src) * (sum(reg.kv_item_lens) + sum(
        n for g in reg.groups for n in g.item_lens)) + sum(reg.aux_item_lens)
    assert sum(n for _, _, n in cluster.fabric.writes[start:]) == want
