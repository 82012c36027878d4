"""In-process tier: cases K01-K20 (first round), deterministic, no sleeps."""

from __future__ import annotations

import pytest

from kvd.errors import RoomError
from kvd.protocol import rpc
from kvd.refengine.standin import ModelSpec
from kvd.transfer.faults import FaultInjector, FaultPlan
from tests.inproc.harness import (
    FAILED,
    SUCCESS,
    UNKNOWN,
    Cluster,
    same_pages,
    settle,
    until,
)


async def pair(cluster: Cluster, p_opts: dict | None = None, d_opts: dict | None = None,
               **pool: int):
    p = await cluster.node("prefill", **(p_opts or {}))
    d = await cluster.node("decode", **(d_opts or {}))
    return p, d, await p.engine(seed=1, **pool), await d.engine(seed=2, **pool)


SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=16)


async def test_k01_lookup_before_every_prefill_rank_registered(cluster: Cluster) -> None:
    source = SPEC.global_kv(1)
    p0 = await cluster.node("prefill", attn_tp_size=2, attn_tp_rank=0)
    d = await cluster.node("decode", attn_tp_size=2, attn_tp_rank=0)
    e0 = await p0.shard_engine(SPEC, 0, 2, source=source, seed=1)
    de = await d.shard_engine(SPEC, 0, 2, seed=2)
    await de.receiver(1, [0], p0.http_addr)  # rank 1 never registered: bounded retries
    await until(lambda: d.side.rooms.rooms[1].status == 0)
    kind, reason = await de.failure(1)
    assert kind == "bootstrap" and "503" in reason
    p1 = await cluster.node("prefill", bootstrap=p0, attn_tp_size=2, attn_tp_rank=1)
    await p1.shard_engine(SPEC, 1, 2, source=source, seed=3)
    await until(lambda: p1.side.bootstrap_registered)
    await de.receiver(2, [1], p0.http_addr)
    await e0.sender(2, [5])
    await settle(cluster)
    assert await de.status(2) == SUCCESS and de.pool.holds(source, [5], [1])


async def test_k01_k02_a_prefill_retries_registration_until_the_bootstrap_is_up(
        cluster: Cluster) -> None:
    p0 = await cluster.node("prefill")
    cluster.router.hung.add(p0.http_addr)  # slower than the client's timeout, then down
    p1 = await cluster.node("prefill", bootstrap=p0, attn_dp_size=2, attn_dp_rank=1)
    await p1.engine(seed=1)
    await until(lambda: sum(p0.http_addr in r for r in cluster.router.requests) >= 2)
    assert not p1.side.bootstrap_registered
    cluster.router.hung.clear()
    await until(lambda: p1.side.bootstrap_registered)
    assert p0.daemon.table is not None and len(p0.daemon.table.ranks) == 1


async def test_k03_duplicate_sender_and_receiver_refused(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    await pe.call(rpc.SenderCreate(room=42))
    with pytest.raises(RoomError, match="already active"):
        await pe.call(rpc.SenderCreate(room=42))
    await de.receiver(42, [1], p.http_addr)
    with pytest.raises(RoomError, match="already active"):
        await de.receiver(42, [2], p.http_addr)
    await pe.call(rpc.SenderInit(room=42, num_pages=1, aux_index=0))
    await pe.send(42, [3])
    await settle(cluster)
    assert await de.status(42) == SUCCESS and same_pages(de, pe, [3], [1])
    await pe.call(rpc.Clear(room=42))
    await de.call(rpc.Clear(room=42))
    assert await pe.status(42) == UNKNOWN and await de.status(42) == UNKNOWN


async def test_k04_extra_receivers_of_a_bound_room_fail_at_once(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ds = [await cluster.node("decode") for _ in range(3)]
    es = [await d.engine(seed=10 + i) for i, d in enumerate(ds)]
    await pe.sender(100, [1], send=False)
    for i, e in enumerate(es):
        await e.receiver(100, [i], p.http_addr)
        await settle(cluster)
    assert [await e.status(100) for e in es[1:]] == [FAILED, FAILED]  # no time passed
    assert [(await e.failure(100))[0] for e in es[1:]] == ["duplicate", "duplicate"]
    await pe.send(100, [1])
    await settle(cluster)
    assert await es[0].status(100) == SUCCESS


async def test_k05_late_aborts_after_clear_leave_no_trace(cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster)
    base_p, base_d = p.daemon.table_sizes(), d.daemon.table_sizes()
    for i in range(200):
        room = 5000 + i % 3  # ids are reused
        await de.receiver(room, [i % 8], p.http_addr)
        await pe.sender(room, [i % 8])
        await settle(cluster)
        assert await de.status(room) == SUCCESS
        await de.call(rpc.Abort(room=room, reason="late"))  # after Success: nothing
        await pe.call(rpc.Clear(room=room))
        await de.call(rpc.Clear(room=room))
        await de.call(rpc.Abort(room=room, reason="late"))  # after clear: nothing
        await settle(cluster)
        assert await pe.status(room) == UNKNOWN and await de.status(room) == UNKNOWN
    after_p, after_d = p.daemon.table_sizes(), d.daemon.table_sizes()
    for key in ("rooms", "retired", "pending", "early_aborts", "outboxes"):
        assert after_p.get(key) == base_p.get(key), key
    assert after_d["rooms"] == base_d["rooms"] == 0
    assert after_p["tombstones"] <= 3  # one per room id, bounded
    assert d.core.counters.rooms_failed == 0 and p.core.counters.rooms_failed == 0


async def test_k06_abort_mid_transfer_defers_release(cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster)
    cluster.fabric.hold(d.session)  # each batch takes "2 s"
    await de.receiver(1, list(range(8)), p.http_addr)
    await pe.sender(1, list(range(8, 16)))
    await settle(cluster)
    await de.call(rpc.Abort(room=1, reason="client gone"))
    await settle(cluster)
    assert await de.status(1) == FAILED and not await de.releasable(1)
    with pytest.raises(RoomError, match="not releasable"):
        await de.call(rpc.Clear(room=1))
    cluster.fabric.release(d.session)
    await settle(cluster)
    assert await de.releasable(1)
    await de.call(rpc.Clear(room=1))
    await pe.call(rpc.Clear(room=1))
    await de.receiver(2, list(range(8)), p.http_addr)  # R2 reuses R1's pages
    await pe.sender(2, list(range(16, 24)))
    await settle(cluster)
    assert await de.status(2) == SUCCESS and same_pages(de, pe, list(range(16, 24)), range(8))


async def test_k07_one_failed_batch_does_not_poison_the_session(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    cluster.fabric.hook = FaultInjector(FaultPlan(fail_batches=[0]))
    cluster.fabric.retry_budget = 0.01
    for room in (1, 2, 3):
        await de.receiver(room, [room], p.http_addr)
        await pe.sender(room, [room + 10])
        await settle(cluster)
    assert [await de.status(r) for r in (1, 2, 3)] == [FAILED, SUCCESS, SUCCESS]
    assert p.core.counters.session_failures == 1 and p.core.counters.session_recoveries == 1


async def test_k07_a_dead_decode_fails_fast_and_alone(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d1, d2 = await cluster.node("decode"), await cluster.node("decode")
    pe, e1, e2 = await p.engine(seed=1), await d1.engine(seed=2), await d2.engine(seed=3)
    await e1.receiver(1, [1], p.http_addr)
    await e2.receiver(2, [2], p.http_addr)
    await settle(cluster)
    await d1.stop()
    await pe.sender(1, [5])
    await pe.sender(2, [6])
    await settle(cluster)
    assert await pe.status(1) == FAILED and (await pe.failure(1))[0] == "transport"
    assert await e2.status(2) == SUCCESS


async def test_k08_a_failure_reaches_every_decode_endpoint(cluster: Cluster) -> None:
    source = SPEC.global_kv(2)
    p = await cluster.node("prefill")
    d0 = await cluster.node("decode", attn_tp_size=2, attn_tp_rank=0)
    d1 = await cluster.node("decode", attn_tp_size=2, attn_tp_rank=1)
    pe = await p.shard_engine(SPEC, 0, 1, source=source, seed=1)
    e0 = await d0.shard_engine(SPEC, 0, 2, seed=2)
    e1 = await d1.shard_engine(SPEC, 1, 2, seed=3)
    await e0.receiver(1, [0], p.http_addr)
    await e1.receiver(1, [1], p.http_addr)
    await settle(cluster)
    cluster.fabric.hook = lambda dst, batch, attempt: -1 if dst == d0.session else None
    cluster.fabric.retry_budget = 0.01
    await pe.sender(1, [4])
    await settle(cluster)
    assert await e0.status(1) == FAILED and await e1.status(1) == FAILED
    assert (await e1.failure(1))[0] == "transport"
    base = d1.daemon.table_sizes()["rooms"]
    await e1.call(rpc.Clear(room=1))  # a late report for a cleared room creates nothing
    p.side.run(p.side.rooms.tick(cluster.clock()))
    await settle(cluster)
    assert d1.daemon.table_sizes()["rooms"] == base - 1


async def test_k09_aux_slots_are_reused_without_mixing(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster, p_opts={"aux_transport": "control"})
    for wave in range(10):
        rooms = [wave * 8 + i for i in range(4)]
        for slot, room in enumerate(rooms):
            pe.pool.aux[slot + 4][:] = room % 251
            await de.receiver(room, [slot], p.http_addr, aux=slot)
            await pe.sender(room, [slot + 4], aux=slot + 4)
        await settle(cluster)
        for slot, room in enumerate(rooms):
            assert await de.status(room) == SUCCESS
            assert (de.pool.aux[slot] == room % 251).all(), (room, slot)
            await de.call(rpc.Clear(room=room))
            await pe.call(rpc.Clear(room=room))
            de.pool.aux[slot][:] = 0  # a freed slot reads as empty


async def test_k10_unequal_page_counts_fail_only_that_room(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    await de.receiver(1, [1, 2], p.http_addr)
    await pe.sender(1, [3, 4, 5])
    await settle(cluster)
    assert await pe.status(1) == FAILED and await de.status(1) == FAILED
    kind, reason = await de.failure(1)
    assert kind == "layout" and "index length mismatch 3 vs 2" in reason
    await de.receiver(2, [1, 2], p.http_addr)
    await pe.sender(2, [3, 4])
    await settle(cluster)
    assert await de.status(2) == SUCCESS


async def test_k11_gqa_replication_when_decode_tp_exceeds_kv_heads(cluster: Cluster) -> None:
    spec = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, page_size=4, num_pages=8)
    source = spec.global_kv(11)
    p = await cluster.node("prefill")
    pe = await p.shard_engine(spec, 0, 1, source=source, seed=1)
    ds = [await cluster.node("decode", attn_tp_size=4, attn_tp_rank=r) for r in range(4)]
    es = [await d.shard_engine(spec, r, 4, seed=10 + r) for r, d in enumerate(ds)]
    for e in es:
        await e.receiver(1, [2, 3], p.http_addr)
    await pe.sender(1, [5, 6])
    await settle(cluster)
    assert [await e.status(1) for e in es] == [SUCCESS] * 4
    assert [(e.pool.h0, e.pool.nh) for e in es] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert all(e.pool.holds(source, [5, 6], [2, 3]) for e in es)


async def test_k12_item_len_mismatch_is_refused_before_any_write(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await p.shard_engine(SPEC, source=SPEC.global_kv(1), seed=1)
    de = await d.shard_engine(SPEC, seed=2, item_len_scale=0.5)
    await de.receiver(1, [1], p.http_addr)
    await pe.sender(1, [2])
    await settle(cluster)
    kind, reason = await de.failure(1)
    assert kind == "registration" and "item len mismatch" in reason
    assert not cluster.fabric.writes


async def test_k13_ipv6_end_to_end(cluster: Cluster) -> None:
    p = await cluster.node("prefill", http_addr="[::1]:18990", host="::1", http_host="::1")
    d = await cluster.node("decode", host="::1", http_host="::1")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    assert p.endpoint.startswith("tcp://[::1]:")
    await de.receiver(1, [1, 2], "[::1]:18990")
    await pe.sender(1, [3, 4])
    await settle(cluster)
    assert await de.status(1) == SUCCESS and same_pages(de, pe, [3, 4], [1, 2])


async def test_k14_dp_routing_by_room_and_explicit(cluster: Cluster) -> None:
    p0 = await cluster.node("prefill", attn_dp_size=2, attn_dp_rank=0)
    p1 = await cluster.node("prefill", bootstrap=p0, attn_dp_size=2, attn_dp_rank=1)
    d = await cluster.node("decode")
    e0, e1, de = await p0.engine(seed=1), await p1.engine(seed=2), await d.engine(seed=3)
    await until(lambda: p1.side.bootstrap_registered)
    await de.receiver(11, [1], p0.http_addr)  # 11 % 2 = dp 1
    await de.receiver(10, [2], p0.http_addr)  # dp 0
    await de.receiver(20, [3], p0.http_addr, dp_rank=1)  # explicit
    await e1.sender(11, [5])
    await e0.sender(10, [6])
    await e1.sender(20, [7])
    await settle(cluster)
    assert [await de.status(r) for r in (11, 10, 20)] == [SUCCESS] * 3
    assert same_pages(de, e1, [5, 7], [1, 3]) and same_pages(de, e0, [6], [2])
    await de.receiver(30, [4], p0.http_addr, dp_rank=2)
    await settle(cluster)
    assert await de.status(30) == FAILED and "dp" in (await de.failure(30))[1]


async def test_k15_pp_stages_time_out_at_different_moments(cluster: Cluster) -> None:
    s0 = await cluster.node("prefill", pp_size=2, pp_rank=0, bootstrap_timeout=2.0)
    s1 = await cluster.node("prefill", bootstrap=s0, pp_size=2, pp_rank=1,
                            bootstrap_timeout=2.0)
    e0 = await s0.shard_engine(SPEC, layer_start=0, num_layers=1, seed=1)
    e1 = await s1.shard_engine(SPEC, layer_start=1, num_layers=1, seed=2)
    d = await cluster.node("decode")
    de = await d.shard_engine(SPEC, seed=3)
    await e0.sender(1, [1], send=False)
    await cluster.advance(0.3)
    await e1.sender(1, [1], send=False)
    await cluster.advance(1.8)  # 2.1 s: stage 0 times out, stage 1 not yet
    assert await e0.status(1) == FAILED and await e1.status(1) == 1
    await cluster.advance(0.3)
    assert await e1.status(1) == FAILED
    assert (await e1.failure(1))[0] == "timeout"
    await de.receiver(1, [2], s0.http_addr)  # pages after both gave up: answered Failed
    await settle(cluster)
    assert await de.status(1) == FAILED
    assert s0.side.rooms.table_sizes()["pending"] == 0


async def test_k16_every_state_has_a_deadline(cluster: Cluster) -> None:
    t = {"bootstrap_timeout": 3.0, "waiting_timeout": 3.0, "transfer_timeout": 3.0}
    p, d, pe, de = await pair(cluster, p_opts=t, d_opts=t)
    await de.receiver(1, [1], p.http_addr)  # P never creates it: D WaitingForInput
    await pe.sender(2, [1], send=False)  # D never sends: P Bootstrapping
    await settle(cluster)
    await cluster.advance(3.5)
    assert (await de.failure(1))[0] == "timeout" and "WaitingForInput" in (
        await de.failure(1))[1]
    assert (await pe.failure(2))[0] == "timeout" and "Bootstrapping" in (
        await pe.failure(2))[1]
    assert p.side.rooms.table_sizes()["pending"] == 0  # D's pages for room 1 dropped
    cluster.fabric.hold(d.session)  # a transfer stuck in Transferring
    await de.receiver(3, [2], p.http_addr)
    await pe.sender(3, [2])
    await settle(cluster)
    await cluster.advance(3.5)
    assert await pe.status(3) == FAILED and await de.status(3) == FAILED
    cluster.fabric.release(d.session)
    await settle(cluster)
    assert await de.status(3) == FAILED  # a late Success does not change it


async def test_k17_a_hung_bootstrap_does_not_stall_other_rooms(cluster: Cluster) -> None:
    pa = await cluster.node("prefill")
    pb = await cluster.node("prefill")
    d = await cluster.node("decode")
    ea, de = await pa.engine(seed=1), await d.engine(seed=3)
    await pb.engine(seed=2)
    cluster.router.hung.add(pb.http_addr)
    await de.receiver(1, [1], pb.http_addr)
    for room in range(10, 15):
        await de.receiver(room, [room - 8], pa.http_addr)
        await ea.sender(room, [room - 8])
    await settle(cluster)
    assert [await de.status(r) for r in range(10, 15)] == [SUCCESS] * 5
    await until(lambda: d.side.rooms.rooms[1].status == 0)
    kind, reason = await de.failure(1)
    assert kind == "bootstrap" and "unreachable" in reason


async def test_k18_transient_refusals_are_backpressure(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    cluster.fabric.hook = FaultInjector(FaultPlan(transient_per_batch=3))
    cluster.fabric.retry_budget = 5.0
    for room in range(50):  # pages reused only once their room succeeded (K42)
        await de.receiver(room, [room % 16], p.http_addr)
        await pe.sender(room, [room % 16])
        if room % 16 == 15:
            await settle(cluster)
    await settle(cluster)
    assert [await de.status(r) for r in range(50)] == [SUCCESS] * 50
    assert p.core.counters.session_failures == 0
    cluster.fabric.hook = FaultInjector(FaultPlan(transient_per_batch=10**9))
    cluster.fabric.retry_budget = 0.02
    await de.receiver(99, [1], p.http_addr)
    await pe.sender(99, [1])
    await settle(cluster)
    assert "queue full" in (await de.failure(99))[1]
    cluster.fabric.hook = None
    await de.receiver(100, [2], p.http_addr)
    await pe.sender(100, [2])
    await settle(cluster)
    assert await de.status(100) == SUCCESS


@pytest.mark.parametrize("fault", ["frozen", "dead"])
async def test_k19_sends_to_a_dead_or_frozen_prefill_fail_in_bounded_time(
        cluster: Cluster, fault: str) -> None:
    p1 = await cluster.node("prefill")
    p2 = await cluster.node("prefill")
    d = await cluster.node("decode")
    e1, e2 = await p1.engine(seed=1), await p2.engine(seed=2)
    de = await d.engine(seed=3, num_pages=64)  # 50 live rooms, distinct pages (K42)
    await de.receiver(1, [1], p1.http_addr)
    await e1.sender(1, [1])
    await settle(cluster)
    if fault == "frozen":
        cluster.bus.freeze(p1.endpoint)
        cluster.router.hung.add(p1.http_addr)
    else:
        await p1.stop()
        cluster.bus.dead.add(p1.endpoint)
    for room in range(100, 150):  # an aux slot of its own each, too (K42)
        await de.receiver(room, [room - 90], p1.http_addr, aux=room - 90)
    await de.receiver(7, [7], p2.http_addr, aux=7)
    await e2.sender(7, [8])
    await settle(cluster)
    for _ in range(d.daemon.settings.heartbeat_max_failures):
        await d.heartbeat()
    assert await de.status(7) == SUCCESS
    states = [await de.status(r) for r in range(100, 150)]
    assert states == [FAILED] * 50
    assert p1.http_addr in (await de.failure(100))[1] or p1.endpoint in (
        await de.failure(100))[1]


async def test_k20_mla_dummy_ranks_conclude(cluster: Cluster) -> None:
    spec = ModelSpec(num_layers=2, total_kv_heads=1, head_dim=16, page_size=4, num_pages=8,
                     is_mla=True)
    source = spec.global_kv(20)
    ps = [await cluster.node("prefill", attn_tp_size=4, attn_tp_rank=0)]
    ps += [await cluster.node("prefill", bootstrap=ps[0], attn_tp_size=4, attn_tp_rank=r)
           for r in (1, 2, 3)]
    pes = [await n.shard_engine(spec, r, 4, source=source, seed=r) for r, n in enumerate(ps)]
    ds = [await cluster.node("decode", attn_tp_size=2, attn_tp_rank=r) for r in (0, 1)]
    des = [await n.shard_engine(spec, r, 2, seed=10 + r) for r, n in enumerate(ds)]
    await until(lambda: all(n.side.bootstrap_registered for n in ps))
    for e in des:
        await e.receiver(1, [2], ps[0].http_addr)
    for e in pes:
        await e.sender(1, [3])
    await settle(cluster)
    assert [await e.status(1) for e in des] == [SUCCESS, SUCCESS]
    assert [await e.status(1) for e in pes] == [SUCCESS] * 4
    assert all(e.pool.holds(source, [3], [2]) for e in des)
    real = {w[0] for w in cluster.fabric.writes}
    assert real == {ps[0].session, ps[2].session}  # ranks 1 and 3 are dummies
