"""The compatibility fingerprint in process (issue 22 item 5): a pair whose engines name
different models fails at its first room with a registration reason naming the field,
and nothing is written; equal fingerprints with a page size left out of it still pair."""

from __future__ import annotations

from kvd.protocol.control import Compat
from kvd.refengine.standin import ModelSpec
from tests.inproc.harness import SUCCESS, Cluster, settle

SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=16)
QWEN = Compat(model_id="qwen", kv_dtype="bfloat16", scale_layout="none", layer_types="AA")


async def test_i22_mismatched_fingerprint_fails_the_first_room_naming_the_field(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await p.shard_engine(SPEC, source=SPEC.global_kv(1), seed=1, compat=QWEN)
    llama = Compat(model_id="llama", kv_dtype="bfloat16", scale_layout="none", layer_types="AA")
    de = await d.shard_engine(SPEC, seed=2, compat=llama)
    await de.receiver(1, [1], p.http_addr)
    await pe.sender(1, [2])
    await settle(cluster)
    kind, reason = await de.failure(1)
    assert kind == "registration"
    assert "fingerprint mismatch" in reason and "model_id 'qwen' vs 'llama'" in reason
    assert not cluster.fabric.writes


async def test_i22_equal_fingerprints_pair(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    source = SPEC.global_kv(1)
    pe = await p.shard_engine(SPEC, source=source, seed=1, compat=QWEN)
    de = await d.shard_engine(SPEC, seed=2, compat=QWEN)
    await de.receiver(1, [1, 3], p.http_addr)
    await pe.sender(1, [2, 5])
    await settle(cluster)
    assert await de.status(1) == SUCCESS and de.pool.holds(source, [2, 5], [1, 3])
