"""In-process tier: a restarted bootstrap server (S06). Waits are "until, within a
generous bound"."""

from __future__ import annotations

from kvd.refengine.standin import ModelSpec
from tests.inproc.harness import SUCCESS, Cluster, settle, until

SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=16)


def registered(bootstrap, tp_rank: int) -> bool:
    """Whether rank ``tp_rank`` is in ``bootstrap``'s table."""
    try:
        bootstrap.daemon.table.lookup(tp_rank, 0, 0)
    except Exception:  # NotReady / NotFound
        return False
    return True


async def test_s06_ranks_register_again_with_a_restarted_bootstrap_server(
        cluster: Cluster) -> None:
    """S06: the kvd serving bootstrap restarts (same address, new instance, empty table);
    rank 1's periodic check sees the new instance and registers again, so /route answers
    for it and a new room over both ranks succeeds."""
    source = SPEC.global_kv(12)
    p0 = await cluster.node("prefill", attn_tp_size=2, attn_tp_rank=0)
    p1 = await cluster.node("prefill", bootstrap=p0, attn_tp_size=2, attn_tp_rank=1)
    await p0.shard_engine(SPEC, 0, 2, source=source, seed=1)
    e1 = await p1.shard_engine(SPEC, 1, 2, source=source, seed=2)
    await until(lambda: p1.side.bootstrap_registered)
    http, endpoint = p0.http_addr, p0.endpoint
    await p0.stop()
    p0 = await cluster.node("prefill", http_addr=http, endpoint=endpoint, attn_tp_size=2,
                            attn_tp_rank=0)
    e0 = await p0.shard_engine(SPEC, 0, 2, source=source, seed=4)
    await until(lambda: registered(p0, 0))
    assert not registered(p0, 1)  # the new table forgot rank 1
    await p1.side._bootstrap_check()  # one round of rank 1's periodic check
    assert registered(p0, 1)
    d = await cluster.node("decode")
    de = await d.shard_engine(SPEC, 0, 1, seed=3)
    await de.receiver(201, [0, 1], p0.http_addr)
    await e0.sender(201, [3, 4])
    await e1.sender(201, [3, 4])
    await settle(cluster)
    assert await de.status(201) == SUCCESS and de.pool.holds(source, [3, 4], [0, 1])
