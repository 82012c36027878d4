"""In-process tier: membership (K37, K38, K41), deterministic, no sleeps."""

from __future__ import annotations

import pytest

from kvd.addr import http_url
from kvd.protocol import rpc
from tests.inproc.harness import FAILED, SUCCESS, Cluster, same_pages, settle, until


def requests(cluster: Cluster, addr: str) -> int:
    return sum(addr in r for r in cluster.router.requests)


@pytest.mark.parametrize("misses", [1, 2])
@pytest.mark.parametrize("ports", ["same", "new"])
async def test_k37_rooms_created_after_a_restart_is_known_succeed(
        cluster: Cluster, misses: int, ports: str) -> None:
    """P restarts (same bootstrap address; its control endpoint the same or new) while D's
    heartbeats miss it once or twice (down). A room D creates afterwards looks P up
    fresh: the /route answer names the new instance, which fails the room bound to the
    old one (kind peer, or heartbeat when the misses made P down first) and the new room
    succeeds -- no heartbeat needed."""
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(1, [0], p.http_addr)
    await pe.sender(1, [1])
    await settle(cluster)
    assert await de.status(1) == SUCCESS
    await de.receiver(2, [1], p.http_addr)  # bound to the old instance, waiting
    await settle(cluster)
    old = p.core.instance_id
    http, endpoint = p.http_addr, p.endpoint
    await p.stop()
    for _ in range(misses):
        await d.heartbeat()
    p2 = await cluster.node("prefill", http_addr=http,
                            endpoint=endpoint if ports == "same" else None)
    pe2 = await p2.engine(seed=3)
    assert p2.core.instance_id != old
    await de.receiver(3, [2], http)
    await pe2.sender(3, [4])
    await settle(cluster)
    assert await de.status(3) == SUCCESS
    assert same_pages(de, pe2, [4], [2])
    assert await de.status(2) == FAILED
    kind, reason = await de.failure(2)
    if misses < 2:
        assert kind == "peer" and "restarted" in reason and "route" in reason
    else:
        assert kind == "heartbeat"
    peer = d.side.members.peers[http]
    assert peer.instance == p2.core.instance_id and not peer.down


async def test_k37_a_room_resolved_from_the_old_lookup_fails_with_kind_peer(
        cluster: Cluster) -> None:
    """The heartbeat that learns the new instance fails only rooms bound to the old one;
    a room created after it resolves against the new instance and succeeds."""
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(1, [0], p.http_addr)
    await settle(cluster)
    http, endpoint = p.http_addr, p.endpoint
    await p.stop()
    p2 = await cluster.node("prefill", http_addr=http, endpoint=endpoint)
    pe2 = await p2.engine(seed=3)
    await d.heartbeat()
    assert (await de.failure(1))[0] == "peer"
    await de.receiver(2, [1], http)
    await pe2.sender(2, [5])
    await settle(cluster)
    assert await de.status(2) == SUCCESS and same_pages(de, pe2, [5], [1])
    del pe


async def test_k38_one_dp_group_lost_leaves_the_other_routable(cluster: Cluster) -> None:
    """Prefill attn DP 2; group 1's rank stops (deregistered). A decode started afterwards
    resolves and fills rooms of group 0; a room of group 1 fails in bound naming the
    group; once group 1 is back its rooms succeed, nothing restarted."""
    p0 = await cluster.node("prefill", attn_dp_size=2, attn_dp_rank=0)
    p1 = await cluster.node("prefill", bootstrap=p0, attn_dp_size=2, attn_dp_rank=1)
    e0 = await p0.engine(seed=1)
    await p1.engine(seed=2)
    await until(lambda: p1.side.bootstrap_registered)
    await p1.daemon.drain()  # SIGTERM: deregisters
    await p1.stop()
    assert p0.daemon.table is not None and len(p0.daemon.table.ranks) == 1
    d = await cluster.node("decode")
    de = await d.engine(seed=3)
    await de.receiver(10, [1], p0.http_addr, dp_rank=0)
    await e0.sender(10, [5])
    await de.receiver(11, [2], p0.http_addr, dp_rank=1)
    await settle(cluster)
    assert await de.status(10) == SUCCESS and same_pages(de, e0, [5], [1])
    assert await de.status(11) == FAILED
    kind, reason = await de.failure(11)
    assert kind == "bootstrap" and "DP group 1 has 0/1 ranks" in reason
    p1b = await cluster.node("prefill", bootstrap=p0, attn_dp_size=2, attn_dp_rank=1)
    e1b = await p1b.engine(seed=4)
    await until(lambda: p1b.side.bootstrap_registered)
    await de.receiver(12, [3], p0.http_addr, dp_rank=1)
    await e1b.sender(12, [6])
    await de.receiver(13, [4], p0.http_addr, dp_rank=0)
    await e0.sender(13, [7])
    await settle(cluster)
    assert await de.status(12) == SUCCESS and same_pages(de, e1b, [6], [3])
    assert await de.status(13) == SUCCESS and same_pages(de, e0, [7], [4])


async def test_k41_thousands_of_dead_bootstraps_cost_bounded_probes(cluster: Cluster) -> None:
    """One Many of 4 096 ReceiverCreate calls naming 4 096 distinct dead bootstrap
    addresses: a heartbeat round while they resolve probes at most the cap (0.01/s x the
    harness's 3 600 s interval = 36); the rooms fail within the lookup budget; the next
    round forgets every address (no targets, no probes) and /health answers throughout.
    A live prefill's rooms keep working."""
    p = await cluster.node("prefill")
    d = await cluster.node("decode", heartbeat_max_probes_per_s=0.01)
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    n = 4096
    calls = [rpc.ReceiverCreate(room=1000 + i, bootstrap_addr=f"127.0.{i // 250}."
                                f"{1 + i % 250}:9", dp_rank=None) for i in range(n)]
    await de.call(rpc.Many(calls=calls))  # type: ignore[arg-type]
    await d.side.heartbeat_round()  # while every lookup still retries
    assert d.side.last_round_probes == 36
    resp = await d.core.http("GET", http_url(d.http_addr, "/health"))
    assert resp.status_code == 200
    await settle(cluster)
    states = (await de.call(rpc.Poll(rooms=[c.room for c in calls]))).statuses
    assert states == [FAILED] * n
    cluster.router.requests.clear()
    await d.heartbeat()
    assert cluster.router.requests == [] and d.side.members.peers == {}
    assert d.side.snapshot().tables["heartbeat_targets"] == 0
    await de.receiver(1, [0], p.http_addr)
    await pe.sender(1, [3])
    await settle(cluster)
    assert await de.status(1) == SUCCESS and same_pages(de, pe, [3], [0])
    cluster.router.requests.clear()
    await d.heartbeat()
    assert requests(cluster, p.http_addr) == 1  # an idle prefill that answers: probed
