"""In-process tier: cases K21-K34 (second round), deterministic, no sleeps."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import RoomError
from kvd.protocol import control, rpc
from kvd.refengine.standin import ModelSpec
from kvd.transfer.faults import FaultInjector, FaultPlan
from tests.inproc.harness import (
    FAILED,
    SUCCESS,
    UNKNOWN,
    Cluster,
    same_pages,
    settle,
)


async def pair(cluster: Cluster, p_opts: dict | None = None, d_opts: dict | None = None):
    p = await cluster.node("prefill", **(p_opts or {}))
    d = await cluster.node("decode", **(d_opts or {}))
    return p, d, await p.engine(seed=1), await d.engine(seed=2)


async def test_k21_abort_before_the_decode_came_is_delivered_with_its_reason(
        cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster)
    await pe.sender(21, [1, 2], send=False)
    await pe.call(rpc.Abort(room=21, reason="client gone"))
    await pe.call(rpc.Clear(room=21))
    await de.receiver(21, [5, 6], p.http_addr)
    await settle(cluster)
    assert await de.status(21) == FAILED
    kind, reason = await de.failure(21)
    assert kind == "aborted" and "client gone" in reason
    # aborted but not cleared yet: still "aborted", not "duplicate"
    await pe.sender(22, [1, 2], send=False)
    await pe.call(rpc.Abort(room=22, reason="client gone"))
    await de.receiver(22, [5, 6], p.http_addr)
    await settle(cluster)
    assert await de.failure(22) == (kind, (await pe.failure(22))[1])
    assert d.metric("kvd_room_failures_total", reason="aborted") == 2
    assert d.metric("kvd_room_failures_total", reason="duplicate") == 0


async def test_k22a_a_decode_deadline_stops_the_prefill_writer(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster, d_opts={"waiting_timeout": 3.0, "release_timeout": 1.0})
    await de.receiver(30, [0, 1, 2, 3], p.http_addr)
    await pe.sender(30, [8, 9, 10, 11], send=False)
    await settle(cluster)
    await cluster.advance(2.5)
    await pe.send(30, [8, 9], last=False)  # chunk 1 at 2.5 s: lands
    await settle(cluster)
    assert same_pages(de, pe, [8, 9], [0, 1])
    await cluster.advance(0.6)  # 3.1 s: the decode's deadline
    assert await de.status(30) == FAILED
    assert (await de.failure(30))[0] == "timeout"
    assert await pe.status(30) == FAILED  # told at once, and past its write bound anyway
    await cluster.advance(1.1)
    assert await de.releasable(30)
    de.pool.kv[0][:4] = 0xAB  # the engine reuses the pages
    before = [kv[:4].copy() for kv in de.pool.kv]
    await cluster.advance(1.5)  # 5.5 s: chunk 2 — must not land
    await pe.call(rpc.SenderSend(room=30, pages=np.asarray([10, 11], "<i4").tobytes(),
                                 is_last=True))
    await settle(cluster)
    assert all((kv[:4] == b).all() for kv, b in zip(de.pool.kv, before, strict=True))


SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=16)


async def test_k22b_a_late_prefill_rank_writes_nothing_after_another_aborted(
        cluster: Cluster) -> None:
    source = SPEC.global_kv(7)
    p0 = await cluster.node("prefill", attn_tp_size=2, attn_tp_rank=0)
    p1 = await cluster.node("prefill", bootstrap=p0, attn_tp_size=2, attn_tp_rank=1)
    d = await cluster.node("decode")
    e0 = await p0.shard_engine(SPEC, 0, 2, source=source, seed=1)
    e1 = await p1.shard_engine(SPEC, 1, 2, source=source, seed=2)
    de = await d.shard_engine(SPEC, 0, 1, seed=3)
    await settle(cluster)
    await de.receiver(40, [0, 1], p0.http_addr)
    await e0.sender(40, [3, 4], send=False)
    await settle(cluster)
    await e0.call(rpc.Abort(room=40, reason="rank 0 gave up"))
    await settle(cluster)
    assert await de.status(40) == FAILED
    before = [b.copy() for b in de.pool.buffers]
    await cluster.advance(3.0)
    await e1.sender(40, [3, 4])  # rank 1 comes 3 s later
    await settle(cluster)
    assert await e1.status(40) == FAILED
    assert all((b == a).all() for b, a in zip(de.pool.buffers, before, strict=True))
    assert not [w for w in cluster.fabric.writes if w[0] == p1.session]


async def test_k23_a_refused_batch_counts_as_transport_on_both_sides(cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster)
    cluster.fabric.hook = FaultInjector(FaultPlan(fail_batches=[0]))
    cluster.fabric.retry_budget = 0.01
    await de.receiver(50, [1], p.http_addr)
    await pe.sender(50, [2])
    await settle(cluster)
    assert await de.failure(50) == await pe.failure(50)
    assert (await de.failure(50))[0] == "transport"
    for n in (p, d):
        assert n.metric("kvd_room_failures_total", reason="transport") == 1
        assert n.metric("kvd_room_failures_total", reason="unreachable") == 0


async def test_k24_a_frozen_decode_does_not_stall_another(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d1 = await cluster.node("decode")
    d2 = await cluster.node("decode")
    pe, e1, e2 = await p.engine(seed=1), await d1.engine(seed=2), await d2.engine(seed=3)
    await e1.receiver(60, list(range(16)), p.http_addr)
    await settle(cluster)
    cluster.fabric.hold(d1.session)  # D1 frozen while P writes into it
    cluster.bus.freeze(d1.endpoint)
    await pe.sender(60, list(range(16, 32)))
    await settle(cluster)
    assert cluster.fabric.held == 1
    await e2.receiver(61, [3], p.http_addr)
    await pe.sender(61, [4])
    await settle(cluster)
    assert await e2.status(61) == SUCCESS and same_pages(e2, pe, [4], [3])
    await cluster.advance(p.daemon.settings.transfer_timeout + 1)  # D1's room by its deadline
    assert await pe.status(60) == FAILED
    cluster.fabric.release(d1.session)
    cluster.bus.thaw(d1.endpoint)
    await settle(cluster)
    cluster.tick()
    await settle(cluster)
    assert await e1.status(60) == FAILED
    await e1.call(rpc.Clear(room=60))
    await e1.receiver(62, [5], p.http_addr)
    await pe.sender(62, [6])
    await settle(cluster)
    assert await e1.status(62) == SUCCESS and same_pages(e1, pe, [6], [5])


async def test_k25_a_layer_the_decode_reads_is_written_or_the_pair_is_refused(
        cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await p.engine(seed=1, num_layers=4)
    de = await d.engine(seed=2, num_layers=5)
    await de.receiver(70, [1], p.http_addr)
    await pe.sender(70, [2])
    await settle(cluster)
    assert await de.status(70) == FAILED and await pe.status(70) == FAILED
    kind, reason = await de.failure(70)
    assert kind == "registration" and "layer" in reason
    assert not cluster.fabric.writes


async def test_k26_a_retry_with_the_same_room_id_is_its_own_attempt(cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster)
    cluster.fabric.hold(d.session)  # P's batches are slow
    await de.receiver(80, [0, 1, 2, 3], p.http_addr)
    await pe.sender(80, [20, 21, 22, 23])
    await settle(cluster)
    await de.call(rpc.Abort(room=80, reason="router retries"))
    await settle(cluster)
    assert await de.status(80) == FAILED and not await de.releasable(80)
    # the retry: a new sender is accepted (the old attempt ended), a new receiver is refused
    # until the old attempt's pages are safe
    await pe.call(rpc.Clear(room=80))
    await pe.sender(80, [24, 25, 26, 27], send=False)
    with pytest.raises(RoomError, match="not releasable"):
        await de.call(rpc.ReceiverCreate(room=80, bootstrap_addr=p.http_addr))
    with pytest.raises(RoomError, match="not releasable"):
        await de.call(rpc.Clear(room=80))
    cluster.fabric.release(d.session)  # attempt 1's write returns, P confirms
    await settle(cluster)
    assert await de.releasable(80)
    await de.call(rpc.Clear(room=80))
    await de.receiver(80, [10, 11, 12, 13], p.http_addr)
    await pe.send(80, [24, 25, 26, 27])
    await settle(cluster)
    assert await de.status(80) == SUCCESS and await pe.status(80) == SUCCESS
    assert same_pages(de, pe, [24, 25, 26, 27], [10, 11, 12, 13])


async def test_k27_a_reconnecting_engine_keeps_its_registration_and_rooms(
        cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster)
    await de.receiver(90, [1, 2], p.http_addr)
    await settle(cluster)
    de.disconnect()
    reg = de.pool.registration
    from kvd.engine_rpc.server import Connection

    de.conn = Connection(999)
    engine_id = "engine-a"
    # the first registration had no engine_id: it is not recognised as the same engine
    assert d.core.local is not None
    await pe.sender(90, [3, 4])
    await settle(cluster)
    # an anonymous engine does not get a grace period: its rooms ended
    assert await de.status(90) in (FAILED, UNKNOWN)
    await de.call(reg.__class__(**{**_fields(reg), "engine_id": engine_id}))
    await de.receiver(91, [1, 2], p.http_addr)
    await settle(cluster)
    de.disconnect()
    de.conn = Connection(1000)
    await de.call(reg.__class__(**{**_fields(reg), "engine_id": engine_id}))  # same engine
    await pe.sender(91, [5, 6])
    await settle(cluster)
    assert await de.status(91) == SUCCESS and same_pages(de, pe, [5, 6], [1, 2])


def _fields(s: object) -> dict:
    import msgspec

    return {f: getattr(s, f) for f in msgspec.structs.fields(s) and
            [x.name for x in msgspec.structs.fields(s)]}


async def test_k28_a_restarted_decode_is_never_written_for_its_old_rooms(
        cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster)
    await de.receiver(100, [0, 1], p.http_addr)
    await settle(cluster)
    endpoint, http = d.endpoint, d.http_addr
    await d.stop()
    d2 = await cluster.node("decode", http_addr=http, endpoint=endpoint)
    de2 = await d2.engine(seed=5)
    before = [kv.copy() for kv in de2.pool.kv]
    await pe.sender(100, [2, 3], send=False)
    await settle(cluster)
    assert await pe.status(100) == 2  # WaitingForInput: bound to the old instance
    await de2.receiver(101, [5], p.http_addr)  # registers the new instance with P
    await settle(cluster)
    assert await pe.status(100) == FAILED
    assert (await pe.failure(100))[0] == "peer"
    await pe.send(100, [2, 3])
    await settle(cluster)
    assert all((kv == b).all() for kv, b in zip(de2.pool.kv, before, strict=True))


async def test_k29_an_abort_reaches_every_destination(cluster: Cluster) -> None:
    source = SPEC.global_kv(3)
    p = await cluster.node("prefill")
    d0 = await cluster.node("decode", attn_tp_size=2, attn_tp_rank=0)
    d1 = await cluster.node("decode", attn_tp_size=2, attn_tp_rank=1)
    pe = await p.shard_engine(SPEC, 0, 1, source=source, seed=1)
    e0 = await d0.shard_engine(SPEC, 0, 2, seed=2)
    e1 = await d1.shard_engine(SPEC, 1, 2, seed=3)
    await e0.receiver(110, [0, 1], p.http_addr)
    await e1.receiver(110, [2, 3], p.http_addr)
    await pe.sender(110, [5, 6], send=False)
    await settle(cluster)
    await e0.call(rpc.Abort(room=110, reason="decode rank 0 gave up"))
    await settle(cluster)
    assert await e1.status(110) == FAILED
    assert "decode rank 0 gave up" in (await e1.failure(110))[1]
    assert await pe.status(110) == FAILED


async def test_k29_only_a_bound_decode_rank_may_abort(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    other = await cluster.node("decode")
    oe = await other.engine(seed=9)
    await de.receiver(120, [1], p.http_addr)
    await oe.receiver(121, [1], p.http_addr)  # registers `other` with P
    await pe.sender(121, [1])
    await pe.sender(120, [2], send=False)
    await settle(cluster)
    forged = control.RoomAbort(room=120, inc=0, kind="aborted", reason="not yours",
                               endpoint=other.endpoint,
                               instance_id=other.daemon.settings.instance_id)
    p.side.on_control(forged)  # as if it came over the wire from `other`
    await settle(cluster)
    assert await pe.status(120) != FAILED  # `other` was never bound to room 120
    await pe.send(120, [2])
    await settle(cluster)
    assert await de.status(120) == SUCCESS


async def test_k30_a_refused_pairing_fails_both_sides_at_once(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe = await p.engine(seed=1, page_size=4)
    de = await d.engine(seed=2, page_size=8)
    await pe.sender(130, [1], send=False)
    await de.receiver(130, [1], p.http_addr)
    await settle(cluster)  # no time passes
    assert await de.status(130) == FAILED and await pe.status(130) == FAILED
    assert (await de.failure(130))[0] == "registration"
    await de.receiver(131, [1], p.http_addr)  # the sender comes after the refusal
    await settle(cluster)
    await pe.sender(131, [1], send=False)
    assert await pe.status(131) == FAILED


async def test_k31_a_crashing_probe_does_not_stop_the_others_and_dead_peers_are_forgotten(
        cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster, d_opts={"peer_ttl": 30.0})
    gone = await cluster.node("prefill")
    ge = await gone.engine(seed=4)
    await de.receiver(140, [1], p.http_addr)
    await de.receiver(141, [2], gone.http_addr)
    await pe.sender(140, [1])
    await ge.sender(141, [2])
    await settle(cluster)
    real = cluster.router.handle_async_request

    async def broken(request):  # an HTTP client bug, not an HTTP error
        if request.url.port == int(p.http_addr.rsplit(":", 1)[1]):
            raise RuntimeError("client bug")
        return await real(request)

    cluster.router.handle_async_request = broken  # type: ignore[method-assign]
    await gone.stop()
    cluster.router.requests.clear()
    await d.heartbeat()
    assert d.core.counters.loop_errors == 1
    assert any(gone.http_addr in r for r in cluster.router.requests)  # still probed
    for _ in range(3):
        await d.heartbeat()
    await cluster.advance(31.0)
    await d.heartbeat()  # unused for peer_ttl: forgotten
    cluster.router.requests.clear()
    await d.heartbeat()
    assert not any(gone.http_addr in r for r in cluster.router.requests)
    assert gone.http_addr not in d.side.members.peers


async def test_k32_every_room_ends_when_its_messages_cannot_be_delivered(
        cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    await de.receiver(150, [1], p.http_addr)
    await pe.sender(150, [1])
    await settle(cluster)  # D registered with P
    cluster.bus.dead.add(p.endpoint)  # P has just died: its sends fail
    await de.receiver(151, [2], p.http_addr)
    await de.receiver(152, [3], p.http_addr)
    await settle(cluster)  # no time passes: no deadline can be what ends them
    for room in (151, 152):
        assert await de.status(room) == FAILED
        kind, reason = await de.failure(room)
        assert kind == "unreachable" and p.endpoint in reason
        assert await de.releasable(room)  # its pages never left: no release wait


async def test_k33_a_refused_second_receiver_never_inherits_the_first(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    await de.receiver(160, [1, 2], p.http_addr)
    with pytest.raises(RoomError, match="already active"):
        await de.receiver(160, [3, 4], p.http_addr)
    await pe.sender(160, [7, 8])
    await settle(cluster)
    assert await de.status(160) == SUCCESS
    assert same_pages(de, pe, [7, 8], [1, 2])


async def test_k34_an_abort_before_the_sender_exists_fails_it_at_once(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    await de.receiver(170, [1], p.http_addr)
    await settle(cluster)
    await de.call(rpc.Abort(room=170, reason="prefix hit"))
    await settle(cluster)
    await pe.sender(170, [1], send=False)
    assert await pe.status(170) == FAILED
    assert "prefix hit" in (await pe.failure(170))[1]


async def test_k34_an_abort_from_a_restarted_decode_still_reaches_the_prefill(
        cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster)
    await de.receiver(180, [1], p.http_addr)
    await settle(cluster)
    endpoint, http = d.endpoint, d.http_addr
    await d.stop()
    d2 = await cluster.node("decode", http_addr=http, endpoint=endpoint)
    de2 = await d2.engine(seed=3)
    await de2.call(rpc.Abort(room=180, reason="cancelled", bootstrap_addr=p.http_addr))
    await settle(cluster)
    await pe.sender(180, [1], send=False)
    assert await pe.status(180) == FAILED


@pytest.mark.parametrize("addr", ["zzz", "127.0.0.1:99999", "[::1"])
async def test_k34_an_abort_naming_a_malformed_bootstrap_is_refused_not_dropped(
        cluster: Cluster, addr: str) -> None:
    """An engine's abort for a room this kvd does not know is delivered through the
    bootstrap it names; a malformed one was answered ok and the abort silently never left
    (the prefill room waited for its own deadline). It is refused as ReceiverCreate
    refuses that address, and the same abort with a good address still reaches the
    prefill."""
    from kvd.errors import ConfigError

    p, _d, pe, de = await pair(cluster)
    with pytest.raises(ConfigError, match="bad address"):
        await de.call(rpc.Abort(room=181, reason="cancelled", bootstrap_addr=addr))
    await de.call(rpc.Abort(room=181, reason="cancelled", bootstrap_addr=p.http_addr))
    await settle(cluster)
    await pe.sender(181, [1], send=False)
    assert await pe.status(181) == FAILED


async def test_k21_a_prefill_restart_before_any_heartbeat_fails_rooms_from_the_stale_cache(
        cluster: Cluster) -> None:
    """The kind behind "restart between heartbeats": a decode caches a prefill's lookups,
    the prefill restarts before any heartbeat probed it, and a room resolved from the stale
    cache is sealed for the old instance. The new instance answers with a typed refusal
    naming itself (issue 19: push, don't wait), so that room fails at once with kind
    "peer", before any heartbeat (not at the waiting timeout); the next room resolves
    afresh, registers again and succeeds."""
    p, _d, pe, de = await pair(cluster)
    await de.receiver(140, [0], p.http_addr)
    await pe.sender(140, [1])
    await settle(cluster)
    assert await de.status(140) == SUCCESS
    http, endpoint = p.http_addr, p.endpoint
    await p.stop()
    p2 = await cluster.node("prefill", http_addr=http, endpoint=endpoint)
    pe2 = await p2.engine(seed=3)
    await de.receiver(141, [2], http)  # resolved from the cache of the old instance
    await pe2.sender(141, [4], send=False)
    await settle(cluster)  # no heartbeat: the refusal alone ends it
    assert await de.status(141) == FAILED
    kind, reason = await de.failure(141)
    assert kind == "peer" and "restarted" in reason and p2.core.instance_id in reason
    assert p2.core.totals()["refusals_sent"] >= 1
    await de.receiver(142, [3], http)
    await pe2.sender(142, [5])
    await settle(cluster)
    assert await de.status(142) == SUCCESS
    assert same_pages(de, pe2, [5], [3])


async def test_k16_a_room_after_the_prefill_forgot_an_idle_decode_is_not_left_waiting(
        cluster: Cluster) -> None:
    """P forgets a decode rank idle for ``peer_ttl`` (S08) and drops its later messages
    unanswered (S13); D, whose own heartbeat round has not forgotten P yet, must not trust
    its registration then: the next room registers again and succeeds, instead of waiting
    in WaitingForInput until ``waiting_timeout`` (its pages dropped as ``unregistered``)."""
    p, d, pe, de = await pair(cluster, p_opts={"peer_ttl": 30.0}, d_opts={"peer_ttl": 30.0})
    await de.receiver(190, [1], p.http_addr)
    await pe.sender(190, [3])
    await settle(cluster)
    assert await de.status(190) == SUCCESS
    await cluster.advance(31.0)  # P's sweep forgets D; D's heartbeat round has not run
    assert d.endpoint not in p.side.rooms.peers
    await de.receiver(191, [2], p.http_addr)
    await pe.sender(191, [4])
    await settle(cluster)
    assert p.side.rooms.dropped["unregistered"] == 0
    assert await de.status(191) == SUCCESS
    assert same_pages(de, pe, [4], [2])


async def test_k16_pages_a_prefill_dropped_unregistered_are_sent_again(
        cluster: Cluster) -> None:
    """P forgets D after its ``peer_ttl`` (30 s) while D still trusts its registration (its
    own ``peer_ttl`` is 600 s): D's pages for the next room are dropped as
    ``unregistered`` -- and answered (K16): D registers again and sends them again, so
    the room succeeds byte-exact with no time passing, instead of waiting in
    WaitingForInput for ``waiting_timeout``."""
    p, d, pe, de = await pair(cluster, p_opts={"peer_ttl": 30.0}, d_opts={"peer_ttl": 600.0})
    await de.receiver(195, [1], p.http_addr)
    await pe.sender(195, [3])
    await settle(cluster)
    assert await de.status(195) == SUCCESS
    await cluster.advance(31.0)  # P's sweep forgets D; D would trust it for 300 s more
    assert d.endpoint not in p.side.rooms.peers
    refused = p.core.totals()["refusals_sent"]
    await de.receiver(196, [2], p.http_addr)
    await pe.sender(196, [4])
    await settle(cluster)  # no time passes: no deadline decided it
    assert p.side.rooms.dropped["unregistered"] == 1  # its pages were dropped once ...
    assert p.core.totals()["refusals_sent"] == refused + 1  # ... and answered
    assert await de.status(196) == SUCCESS
    assert same_pages(de, pe, [4], [2])


async def test_k16_a_prefill_at_max_peers_fails_the_refused_decodes_rooms_at_once(
        cluster: Cluster) -> None:
    """P holds at most one decode rank (``max_peers``): D1's room succeeds; D2's
    registration is dropped and answered ``full`` (K16), so D2's room fails at once with
    kind registration naming max_peers, not at its deadline; P keeps nothing of D2."""
    p = await cluster.node("prefill", max_peers=1)
    d1, d2 = await cluster.node("decode"), await cluster.node("decode")
    pe, de1, de2 = await p.engine(seed=1), await d1.engine(seed=2), await d2.engine(seed=3)
    await de1.receiver(197, [1], p.http_addr)
    await pe.sender(197, [3])
    await settle(cluster)
    assert await de1.status(197) == SUCCESS
    await de2.receiver(198, [2], p.http_addr)
    await pe.sender(198, [4], send=False)
    await settle(cluster)  # no time passes
    assert await de2.status(198) == FAILED
    kind, reason = await de2.failure(198)
    assert kind == "registration" and "max_peers" in reason, reason
    assert p.side.rooms.dropped["max_peers"] >= 1
    assert set(p.side.rooms.peers) == {d1.endpoint}


async def test_k16_a_full_refusal_that_comes_before_the_room_binds_still_fails_it(
        cluster: Cluster) -> None:
    """A prefill of two TP ranks; rank 0 holds one decode rank (``max_peers`` 1), rank 1
    two. D2's lookup registers with rank 0, then looks rank 1 up: rank 0's ``full``
    refusal is read while no room is bound to it yet. The refusal is kept, so the room
    fails as it binds (kind registration) instead of sending rank 0 pages it drops
    unanswered until the room's waiting deadline."""
    source = SPEC.global_kv(12)
    p0 = await cluster.node("prefill", attn_tp_size=2, attn_tp_rank=0, max_peers=1)
    p1 = await cluster.node("prefill", bootstrap=p0, attn_tp_size=2, attn_tp_rank=1,
                            max_peers=2)
    e0 = await p0.shard_engine(SPEC, 0, 2, source=source, seed=1)
    e1 = await p1.shard_engine(SPEC, 1, 2, source=source, seed=2)
    d1, d2 = await cluster.node("decode"), await cluster.node("decode")
    de1 = await d1.shard_engine(SPEC, 0, 1, seed=3)
    de2 = await d2.shard_engine(SPEC, 0, 1, seed=4)
    await de1.receiver(199, [0, 1], p0.http_addr)
    await e0.sender(199, [3, 4])
    await e1.sender(199, [3, 4])
    await settle(cluster)
    assert await de1.status(199) == SUCCESS and de1.pool.holds(source, [3, 4], [0, 1])
    await de2.receiver(200, [0, 1], p0.http_addr)
    await settle(cluster)  # no time passes
    assert p0.side.rooms.dropped["max_peers"] >= 1
    assert d2.endpoint in p1.side.rooms.peers  # rank 1 took it: only rank 0 refused
    assert await de2.status(200) == FAILED
    kind, reason = await de2.failure(200)
    assert kind == "registration" and "max_peers" in reason, reason
