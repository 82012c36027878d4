"""In-process tier: the control plane's typed refusals (issue 19: push, don't wait) and
clock skew between daemons (case K40), deterministic, no sleeps."""

from __future__ import annotations

import time

from kvd.protocol import control, rpc
from kvd.security import Authenticator
from tests.inproc.harness import FAILED, SECRET, SUCCESS, Cluster, same_pages, settle

HOUR = 3600.0


async def pair(cluster: Cluster, p_opts: dict | None = None, d_opts: dict | None = None):
    p = await cluster.node("prefill", **(p_opts or {}))
    d = await cluster.node("decode", **(d_opts or {}))
    return p, d, await p.engine(seed=1), await d.engine(seed=2)


def skew(node, seconds: float) -> None:
    """The node's wall clock jumps ``seconds`` (an NTP step, a resumed VM)."""
    node.core.auth.clock = lambda: time.time() + seconds


async def test_k40_a_decode_an_hour_ahead_fails_its_room_fast_naming_the_skew(
        cluster: Cluster) -> None:
    """D starts with its clock an hour ahead: its first lookup is refused by P's bootstrap
    with the measured offset, and the room fails at once with kind peer naming it."""
    p, _d, pe, de = await pair(cluster, d_opts={"test_clock_offset": HOUR})
    await de.receiver(400, [0], p.http_addr)
    await pe.sender(400, [1], send=False)
    await settle(cluster)  # no time passes: it did not wait for any deadline
    assert await de.status(400) == FAILED
    kind, reason = await de.failure(400)
    assert kind == "peer" and "clock skew" in reason and "3600.0s behind" in reason


async def test_k40_a_decode_clock_that_jumps_is_told_by_the_prefill(cluster: Cluster) -> None:
    """The kind on the control plane: D resolved P, then its clock jumps an hour. P drops
    D's frames as stale -- and answers with a typed skew refusal dated in D's clock, so D
    fails the room now (kind peer, the offset named) instead of at its waiting timeout;
    P's peer rows show D's offset. Back in sync, rooms work again."""
    p, d, pe, de = await pair(cluster)
    await de.receiver(401, [0], p.http_addr)
    await pe.sender(401, [1])
    await settle(cluster)
    assert await de.status(401) == SUCCESS
    skew(d, HOUR)
    await de.receiver(402, [2], p.http_addr)  # resolved from the cache
    await pe.sender(402, [3], send=False)
    await settle(cluster)
    assert await de.status(402) == FAILED
    kind, reason = await de.failure(402)
    assert kind == "peer" and "clock skew" in reason and "prefill rank" in reason
    assert "3600.0s behind" in reason  # D's view: P is an hour behind
    rows = {r.endpoint: r for r in p.side.snapshot().peers}
    assert rows[d.endpoint].clock_offset_s is not None
    assert abs(rows[d.endpoint].clock_offset_s - HOUR) < 5
    assert p.core.totals()["skewed"] >= 1 and p.core.totals()["refusals_sent"] >= 1
    skew(d, 0.0)
    await cluster.advance(11.0)  # past the decode's memory of the skew
    await de.receiver(403, [4], p.http_addr)
    await pe.sender(403, [5])
    await settle(cluster)
    assert await de.status(403) == SUCCESS
    assert same_pages(de, pe, [5], [4])
    rows = {r.endpoint: r for r in d.side.snapshot().peers}
    assert abs(rows[p.endpoint].clock_offset_s) < 5  # measured again, in sync


async def test_k40_a_prefill_clock_that_jumps_is_caught_by_the_decode(cluster: Cluster) -> None:
    """The other direction: P's clock jumps back an hour; its status to D is stale. D can
    tell: the room bound to P fails now with kind peer naming the offset."""
    p, _d, pe, de = await pair(cluster)
    await de.receiver(404, [0], p.http_addr)
    await pe.sender(404, [1], send=False)
    await settle(cluster)
    skew(p, -HOUR)
    await pe.send(404, [1])
    await settle(cluster)
    assert await de.status(404) == FAILED
    kind, reason = await de.failure(404)
    assert kind == "peer" and "clock skew" in reason and "3600" in reason


async def test_k40_skews_within_the_window_work(cluster: Cluster) -> None:
    p, d, pe, de = await pair(cluster, d_opts={"test_clock_offset": 20.0})
    await de.receiver(405, [0], p.http_addr)
    await pe.sender(405, [1])
    await settle(cluster)
    assert await de.status(405) == SUCCESS
    offset = {r.endpoint: r for r in p.side.snapshot().peers}[d.endpoint].clock_offset_s
    assert offset is not None and 15 < offset < 25  # D is 20 s ahead of P


async def test_a_restarted_prefill_refuses_old_frames_with_its_instance_and_new_rooms_work(
        cluster: Cluster) -> None:
    """Push, don't wait: P restarts at the same endpoint; D's next room, resolved from its
    cache, is sealed for the old instance. P answers with a refusal naming its new
    instance: that room fails at once (kind peer, no heartbeat), D drops its cached
    lookups, and a room created after the refusal never fails because of the old P (nor
    does the next heartbeat fail it: the refusal told it the new instance already)."""
    p, d, pe, de = await pair(cluster)
    await de.receiver(410, [0], p.http_addr)
    await pe.sender(410, [1])
    await settle(cluster)
    http, endpoint = p.http_addr, p.endpoint
    await p.stop()
    p2 = await cluster.node("prefill", http_addr=http, endpoint=endpoint)
    pe2 = await p2.engine(seed=3)
    await de.receiver(411, [1], http)
    await settle(cluster)
    assert await de.status(411) == FAILED
    kind, reason = await de.failure(411)
    assert kind == "peer" and p2.core.instance_id in reason
    await de.receiver(412, [2], http)  # created after the refusal, resolving now
    await d.heartbeat()  # sees the instance the refusal named: no news, nothing fails
    await pe2.sender(412, [4])
    for room in range(413, 416):
        await de.receiver(room, [room - 410], http)
        await pe2.sender(room, [room - 408])
    await settle(cluster)
    assert [await de.status(r) for r in range(412, 416)] == [SUCCESS] * 4


async def test_a_refusal_is_rate_limited_per_peer_and_a_replay_is_not_answered(
        cluster: Cluster) -> None:
    """A holder of the secret replays one captured frame sealed for P's previous instance
    many times, and sends many distinct ones: a replay is refused as a replay (the S09
    rule: no second answer), and distinct ones get at most the per-peer burst of
    refusals, never more (bounded, never amplifying)."""
    p, d, _pe, _de = await pair(cluster)
    sender = Authenticator(SECRET.encode())
    abort = control.encode(control.RoomAbort(room=1, inc=1, kind="aborted", reason="x" * 40,
                                             endpoint=d.endpoint, instance_id=d.core.instance_id))
    inbox = p.core.control.queue
    captured = sender.seal(abort, "previous-instance")
    for _ in range(10):
        inbox.put_nowait((b"attacker", captured))
    await settle(cluster)
    assert p.core.control.refusal_stats["sent"] == 1  # the replays were not answered
    for _ in range(50):
        inbox.put_nowait((b"attacker", sender.seal(abort, "previous-instance")))
    await settle(cluster)
    stats = p.core.control.refusal_stats
    assert stats["sent"] <= 1 + 4 + 1 and stats["limited"] >= 40  # burst 4, 2/s refill
    refusals = [f for ep, f in p.core.control.sent if ep == d.endpoint]
    assert refusals and all(len(f) < len(captured) for f in refusals)


async def test_k39_a_forgotten_decode_leaves_nothing_on_the_prefill(cluster: Cluster) -> None:
    """Decodes come and go; once each is forgotten (peer_ttl, no room), the prefill holds
    nothing for it: no registration, transfer session, plan, outbox, instance or clock
    entry -- the per-peer tables return to their baseline."""
    p = await cluster.node("prefill", peer_ttl=5.0)
    pe = await p.engine(seed=1)
    gone = []
    for i in range(3):
        d = await cluster.node("decode")
        de = await d.engine(seed=2 + i)
        await de.receiver(420 + i, [i], p.http_addr)
        await pe.sender(420 + i, [i + 3])
        await settle(cluster)
        assert await de.status(420 + i) == SUCCESS
        gone.append(d.endpoint)
        await d.stop()
    await pe.call(rpc.Clear(room=420))
    for i in (421, 422):
        await pe.call(rpc.Clear(room=i))
    await cluster.advance(6.0)
    side, ctl = p.side, p.core.control
    assert not side.rooms.peers and not side._registrations and not side._sessions
    assert not side._pairs and not p.core.outboxes
    assert all(ctl.instance_of(ep) is None and ctl.clock_offset(ep) is None for ep in gone)


def forge(d, refusal: control.Refused) -> None:
    """A holder of the cluster secret (not P) seals ``refusal`` naming P and sends it to D
    (dated now: inside D's window, so D reads it as an authentic refusal)."""
    frame = Authenticator(SECRET.encode()).seal(control.encode(refusal), d.core.instance_id)
    d.core.control.queue.put_nowait((b"attacker", frame))


async def test_s11_a_forged_skew_refusal_fails_no_room_and_a_real_skew_still_does(
        cluster: Cluster) -> None:
    """Any holder of the secret can seal ``Refused(clock_skew)`` naming P. D does not
    believe it: it reads P's clock itself (``/health`` ``clock_s``), finds it in sync,
    and fails nothing -- the room bound to P and the registration with P stay, and the
    room then succeeds. A real skew (D's clock jumps an hour) is confirmed by D's own
    measurement: the room fails with kind peer, naming the measured offset."""
    p, d, pe, de = await pair(cluster)
    await de.receiver(430, [0], p.http_addr)
    await pe.sender(430, [1], send=False)
    await settle(cluster)
    registered = d.side.registered.get(p.endpoint)
    assert registered == p.core.instance_id
    forge(d, control.Refused(why="clock_skew", endpoint=p.endpoint,
                             instance_id=p.core.instance_id, offset_s=-HOUR, window_s=30.0))
    await settle(cluster)
    clock = d.side.members.peers[p.http_addr].clock
    assert clock is not None and abs(clock.offset) < 5  # D measured P itself
    assert await de.status(430) != FAILED
    assert d.side.registered.get(p.endpoint) == registered  # no re-registration churn
    await pe.send(430, [1])
    await settle(cluster)
    assert await de.status(430) == SUCCESS and same_pages(de, pe, [1], [0])

    await cluster.advance(2.0)  # past the one-measurement-per-second bound (down_retry)
    skew(d, HOUR)  # a real skew: P refuses D's frames, D's own reading agrees
    await de.receiver(431, [2], p.http_addr)
    await pe.sender(431, [3], send=False)
    await settle(cluster)
    assert await de.status(431) == FAILED
    kind, reason = await de.failure(431)
    assert kind == "peer" and f"prefill rank {p.endpoint}'s clock is 3600.0s behind" in reason


async def test_s11_a_forged_instance_refusal_leaves_the_registration_and_the_rooms(
        cluster: Cluster) -> None:
    """A refusal naming an instance P never had is a claim: D looks P's rank up again,
    the lookup names the instance D knows, and nothing changes -- the room bound to P
    goes on, the registration with P is kept (no re-registration per forged refusal)."""
    p, d, pe, de = await pair(cluster)
    await de.receiver(432, [0], p.http_addr)
    await pe.sender(432, [1], send=False)
    await settle(cluster)
    registered = d.side.registered.get(p.endpoint)
    for _ in range(3):
        forge(d, control.Refused(why="instance", endpoint=p.endpoint,
                                 instance_id="not-p-at-all"))
    await settle(cluster)
    assert d.side.registered.get(p.endpoint) == registered == p.core.instance_id
    assert await de.status(432) != FAILED
    await pe.send(432, [1])
    await settle(cluster)
    assert await de.status(432) == SUCCESS and same_pages(de, pe, [1], [0])


async def test_k40_status_shows_the_decodes_own_reading_of_a_prefill_clock(
        cluster: Cluster) -> None:
    """D's peer row carries both offsets: ``clock_offset_s`` as P's seals date P's frames,
    and ``clock_measured_*``, D's own reading of P's ``/health`` clock (the one that
    confirms or contradicts a skew claim): the offset, when it was read, from which URL."""
    p, d, pe, de = await pair(cluster, d_opts={"test_clock_offset": 20.0})
    await de.receiver(406, [0], p.http_addr)
    await pe.sender(406, [1])
    await settle(cluster)
    assert await de.status(406) == SUCCESS
    before = time.time()
    await d.heartbeat()
    row = {r.endpoint: r for r in d.side.snapshot().peers}[p.endpoint]
    assert row.clock_offset_s is not None and -25 < row.clock_offset_s < -15
    assert row.clock_measured_s is not None and -25 < row.clock_measured_s < -15
    assert row.clock_measured_from == f"http://{p.http_addr}/health"
    assert row.clock_measured_at is not None and row.clock_measured_at >= before - 1
