"""The membership machine, event by event (tier 1, pure)."""

from __future__ import annotations

from typing import Any

from kvd.membership.effects import (
    Close,
    FailRooms,
    Forget,
    Lookup,
    Measure,
    Probe,
    Resource,
    ResourceKind,
    Source,
    Verify,
)
from kvd.membership.machine import Limits, Members
from kvd.rooms.state import FailureKind

A, B = "10.0.0.1:8998", "10.0.0.2:8998"
EP0, EP1 = "tcp://10.0.0.1:17000", "tcp://10.0.0.1:17001"
LOOKUP_A = Resource(ResourceKind.LOOKUP, A)


def members(**limits: float) -> Members:
    return Members(Limits(**{"max_failures": 2, "peer_ttl": 60.0, "fresh_for": 5.0,
                             "max_probes": 100, "down_retry": 0.5,
                             **limits}))  # type: ignore[arg-type]


def of(out: list[object], kind: type) -> list[object]:
    return [e for e in out if isinstance(e, kind)]


def one(out: list[object], kind: type) -> Any:
    found = of(out, kind)
    assert len(found) == 1, out
    return found[0]


def closes(out: list[object]) -> list[Resource]:
    return [e.resource for e in out if isinstance(e, Close)]


def resolved(m: Members, addr: str = A, instance: str = "i1", now: float = 0.0,
             endpoints: tuple[str, ...] = (EP0,)) -> list[object]:
    """A room of ``addr`` resolved: the lookup answered for ``instance``; its ranks'
    sockets and registrations are held."""
    out: list[object] = [*m.used(addr, now), *m.route_answered(addr, instance, now)]
    out += m.hold(addr, Resource(ResourceKind.LOOKUP, addr))
    for ep in endpoints:
        out += m.hold(addr, Resource(ResourceKind.SOCKET, ep), instance)
        out += m.hold(addr, Resource(ResourceKind.REGISTRATION, ep))
    return out


def test_k37_a_route_answer_naming_a_new_instance_clears_down_and_fails_only_the_old() -> None:
    m = members()
    resolved(m)
    assert m.heartbeat_missed(A, "ConnectError", 1.0) == []
    out = m.heartbeat_missed(A, "ConnectError", 2.0)
    assert out[0] == FailRooms(A, FailureKind.HEARTBEAT, out[0].reason)  # type: ignore[union-attr]
    assert Close(LOOKUP_A) in out and Close(Resource(ResourceKind.REGISTRATION, EP0)) in out
    assert Close(Resource(ResourceKind.SOCKET, EP0)) not in out  # kept until forgotten
    assert m.peers[A].down and m.peers[A].heartbeat == "down"
    # while down, one room per down_retry tries a fresh lookup; the others fail at once
    assert m.lookup(A, 2.5) == Lookup(refresh=True, retry=False)
    assert m.lookup(A, 2.9).refuse
    assert m.lookup(A, 3.0) == Lookup(refresh=True, retry=False)
    out = m.route_answered(A, "i2", 3.0)  # the restarted prefill answered /route
    fail = [e for e in out if isinstance(e, FailRooms)]
    assert len(fail) == 1 and fail[0].keep == "i2" and fail[0].kind is FailureKind.PEER
    assert "i1 -> i2" in fail[0].reason and "route" in fail[0].reason
    p = m.peers[A]
    assert not p.down and p.instance == "i2" and p.misses == 0
    assert p.fact is not None and p.fact.source is Source.ROUTE and p.fact.at == 3.0
    assert m.bound_to(A, "i2") and not m.bound_to(A, "i1")
    assert m.lookup(A, 3.5) == Lookup(refresh=False, retry=True)  # up again: no refusal


def test_k37_every_source_naming_the_instance_counts() -> None:
    for event in ("heartbeat", "watch", "control", "refusal"):
        m = members()
        resolved(m)
        m.heartbeat_missed(A, "x", 1.0)
        m.heartbeat_missed(A, "x", 2.0)
        assert m.peers[A].down
        if event == "heartbeat":
            m.heartbeat_answered(A, "i1", 0, 3.0)
        elif event == "watch":
            m.watch_put(A, "i1", 3.0)
        elif event == "control":
            m.control_seen(EP0, "i1", 3.0)
        else:
            m.refused(EP0, "i1", 3.0)
        assert not m.peers[A].down, event
        assert m.peers[A].fact.source.value == event  # type: ignore[union-attr]


def test_a_rank_restart_fails_only_rooms_at_that_rank() -> None:
    m = members()
    resolved(m, endpoints=(EP0, EP1))
    out = m.refused(EP1, "r2", 1.0)  # a claim (sealed with the shared secret): verify it
    assert Verify(A, EP1) in out and not [e for e in out if isinstance(e, FailRooms)]
    out = m.rank_verified(A, EP1, "r2", 1.2)  # a fresh lookup says so
    fail = [e for e in out if isinstance(e, FailRooms)]
    assert fail == [FailRooms(A, FailureKind.PEER, fail[0].reason, keep="r2", endpoint=EP1)]
    assert Close(Resource(ResourceKind.REGISTRATION, EP1)) in out
    assert Close(Resource(ResourceKind.REGISTRATION, EP0)) not in out
    assert m.refused(EP1, "r2", 1.5) == []  # known now: nothing more to do
    assert m.rank_verified(A, EP1, "r2", 1.6) == []


def test_s11_a_claimed_restart_fails_no_room_until_a_lookup_confirms_it() -> None:
    m = members()
    resolved(m, endpoints=(EP0, EP1))
    out = m.control_seen(EP1, "forged", 1.0)
    assert out and all(isinstance(e, Verify | Close) for e in out)
    assert m.rank_verified(A, EP1, "i1", 1.1) == []  # the lookup names the known one


def test_an_idle_peer_is_refreshed_on_its_next_use() -> None:
    m = members(fresh_for=5.0)
    resolved(m)
    assert m.lookup(A, 4.0) == Lookup(refresh=False, retry=True)
    assert m.lookup(A, 6.0) == Lookup(refresh=True, retry=True)  # nothing learned since 0


def test_a_new_epoch_refreshes_lookups_and_registrations() -> None:
    m = members()
    resolved(m)
    assert m.heartbeat_answered(A, "i1", 0, 1.0) == []
    out = m.heartbeat_answered(A, "i1", 1, 2.0)
    assert Close(LOOKUP_A) in out and not any(isinstance(e, FailRooms) for e in out)


def test_k41_idle_dead_addresses_are_dropped_and_probes_are_capped() -> None:
    m = members(max_probes=10)
    addrs = [f"10.1.{i // 256}.{i % 256}:8998" for i in range(4096)]
    for a in addrs:
        m.used(a, 0.0)
    probes = m.heartbeat_round(1.0, set(addrs))  # every room still resolving
    assert len(probes) == 10 and all(isinstance(p, Probe) for p in probes)
    second = m.heartbeat_round(2.0, set(addrs))
    assert not {p.addr for p in probes} & {p.addr for p in second}  # round robin
    out = m.heartbeat_round(3.0, set())  # their rooms failed: nothing ever answered
    assert sum(isinstance(e, Forget) for e in out) == 4096
    assert not any(isinstance(e, Probe) for e in out) and m.peers == {}


def test_k31_a_forgotten_peer_holds_nothing_and_shared_resources_stay() -> None:
    m = members(peer_ttl=10.0)
    resolved(m, A)
    resolved(m, B, "j1")  # B names the same rank endpoint (a shared socket)
    m.hold(B, Resource(ResourceKind.SOCKET, EP0), "i1")
    out = m.heartbeat_round(11.0, {B})  # A idle for peer_ttl
    assert Forget(A) in out and Close(LOOKUP_A) in out
    assert Close(Resource(ResourceKind.SOCKET, EP0)) not in out  # B still holds it
    assert A not in m.peers
    out = m.forget(B)
    assert Close(Resource(ResourceKind.SOCKET, EP0)) in out


def test_nothing_is_held_for_a_peer_forgotten_meanwhile() -> None:
    m = members()
    assert m.hold(A, LOOKUP_A) == [Close(LOOKUP_A)]
    assert m.seen(A, Source.ROUTE, "i1", 0.0) == []  # an unused address is not tracked
    assert A not in m.peers


def test_a_lease_expiry_or_watch_delete_is_a_loss() -> None:
    m = members()
    resolved(m)
    out = m.lost(A, Source.LEASE, "lease of 10.0.0.1:8998 expired", 1.0)
    assert out[0] == FailRooms(A, FailureKind.PEER, "lease of 10.0.0.1:8998 expired")
    assert m.peers[A].down and m.lost(A, Source.WATCH, "deleted", 2.0) == []


# ---- discovery watch events (issue 19 item 5: the machine decides, the side performs) ----

def test_k37_a_watch_put_replacing_a_rank_fails_its_old_rooms_and_drops_the_registration() -> None:
    m = members()
    resolved(m, endpoints=(EP0, EP1))
    out = m.rank_put(A, EP1, "r2", 1.0, previous="i1", rank="rank dp 0 tp 1 pp 0")
    fail = one(out, FailRooms)
    assert (fail.kind, fail.keep, fail.endpoint) == (FailureKind.PEER, "r2", EP1)
    assert "rank dp 0 tp 1 pp 0" in fail.reason and "i1 -> r2" in fail.reason
    assert closes(out) == [Resource(ResourceKind.REGISTRATION, EP1)]  # socket kept: same port
    assert m.rank_put(A, EP1, "r2", 1.1, previous="i1") == []  # known now: nothing twice
    assert m.rank_put(A, EP0, "i1", 1.2) == []  # a re-registration of the same instance


def test_k39_a_rank_moved_or_gone_closes_its_socket() -> None:
    m = members()
    resolved(m, endpoints=(EP0, EP1))
    moved = m.rank_put(A, "tcp://10.0.0.1:17009", "r2", 1.0, previous="i1",
                       previous_endpoint=EP1)
    assert one(moved, FailRooms).endpoint == EP1
    assert set(closes(moved)) == {Resource(ResourceKind.REGISTRATION, EP1),
                                  Resource(ResourceKind.SOCKET, EP1)}
    gone = m.rank_deleted(A, EP0, "i1", 2.0)
    fail = one(gone, FailRooms)
    assert (fail.kind, fail.keep, fail.endpoint) == (FailureKind.PEER, None, EP0)
    assert "left discovery" in fail.reason
    assert set(closes(gone)) == {Resource(ResourceKind.REGISTRATION, EP0),
                                 Resource(ResourceKind.SOCKET, EP0)}
    assert not m.peers[A].down  # one rank left, not the peer (K38)
    assert m.rank_deleted(A, EP0, "i1", 2.1) == []  # nothing held there any more


# ---- clock skew: measured, not believed (K40, S11) ----------------------------------------

def test_s11_a_claimed_skew_the_own_measurement_contradicts_fails_no_room() -> None:
    m = members(max_skew=30.0)
    resolved(m, endpoints=(EP0, EP1))
    assert m.clock_claimed(EP1, 1.0) == [Measure(A)]  # no own measurement yet: ask
    assert m.clock_claimed(EP1, 1.1) == []  # asked moments ago: one request, not one each
    assert m.clock_measured(A, 0.2, 1.2) == []  # in sync: the claim was forged
    assert m.skewed(A, [EP1], 1.3) is None
    assert m.clock_claimed(EP1, 2.0) == [Measure(A)]  # a recent in-sync reading is re-checked
    assert m.clock_measured(A, -0.1, 2.1) == []
    assert Resource(ResourceKind.REGISTRATION, EP1) in m.peers[A].held


def test_k40_a_skew_the_own_measurement_confirms_fails_the_rooms_at_that_rank() -> None:
    m = members(max_skew=30.0, skew_memory=10.0)
    resolved(m, endpoints=(EP0, EP1))
    assert m.clock_claimed(EP1, 1.0) == [Measure(A)]
    out = m.clock_measured(A, -3600.0, 1.1)
    fail = one(out, FailRooms)
    assert (fail.kind, fail.endpoint, fail.keep) == (FailureKind.PEER, EP1, None)
    assert "prefill rank " + EP1 in fail.reason and "3600.0s behind" in fail.reason
    assert closes(out) == [Resource(ResourceKind.REGISTRATION, EP1)]  # registers again later
    assert m.skewed(A, [EP0, EP1], 5.0) == fail.reason  # new rooms fail at once...
    assert m.skewed(A, [EP0], 5.0) is None  # ...at that rank only
    assert m.skewed(A, [EP1], 11.2) is None  # ...for skew_memory
    again = m.clock_claimed(EP0, 3.0)  # a fresh measurement beyond the window: now
    assert one(again, FailRooms).endpoint == EP0 and not of(again, Measure)
    assert m.clock_measured(A, 0.5, 4.0) == [] and m.skewed(A, [EP0], 4.1) is None  # synced


def test_s11_a_refusal_not_confirmed_leaves_the_registration_and_the_rooms() -> None:
    m = members()
    resolved(m, endpoints=(EP0, EP1))
    out = m.refused(EP1, "forged", 1.0)
    assert not of(out, FailRooms)
    assert Resource(ResourceKind.REGISTRATION, EP1) not in closes(out)
    assert m.rank_verified(A, EP1, "i1", 1.1) == []  # the lookup names the known instance
    assert Resource(ResourceKind.REGISTRATION, EP1) in m.peers[A].held


def test_k40_a_claim_inside_the_measure_bound_is_measured_by_the_next_round() -> None:
    m = members(max_skew=30.0, down_retry=1.0)
    resolved(m, endpoints=(EP0,))
    assert m.clock_claimed(EP0, 1.0) == [Measure(A)]
    assert m.clock_measured(A, 0.0, 1.1) == []  # contradicted
    assert m.clock_claimed(EP0, 1.5) == []  # the clock jumped meanwhile: asked 0.5 s ago
    assert Measure(A) in m.heartbeat_round(2.5, {A})
    assert one(m.clock_measured(A, 3600.0, 2.6), FailRooms).endpoint == EP0


def test_heartbeat_field_with_etcd_discovery_is_not_a_never_changing_unknown() -> None:
    """A new user's `kvd peers` on an etcd decode read 'unknown' in the heartbeat column
    for ever (no heartbeat is sent: leases replace them); it reads 'n/a (etcd)' unless the
    machine saw the peer down. Bootstrap discovery keeps 'unknown' until a probe."""
    from kvd.daemon.decode import health_detail, heartbeat_of
    from kvd.membership.machine import Peer as Member

    assert heartbeat_of(None, "etcd") == "n/a (etcd)"
    assert heartbeat_of(None, "bootstrap") == "unknown"
    fresh = Member("127.0.0.1:8998", last_used=0.0)
    assert heartbeat_of(fresh, "etcd") == "n/a (etcd)"
    assert heartbeat_of(fresh, "bootstrap") == "unknown"
    assert health_detail(fresh, "etcd") == "" and "never answered" in health_detail(
        fresh, "bootstrap")  # the detail column said 'never answered' for ever too
    fresh.down, fresh.misses = True, 1
    assert heartbeat_of(fresh, "etcd") == "down"
