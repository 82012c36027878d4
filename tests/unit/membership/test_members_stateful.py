"""The membership machine against a simulated fleet (tier 1, pure): a hypothesis stateful
test.

A few prefill bootstrap addresses, each with DP groups whose ranks listen at control
endpoints (two addresses share one endpoint: a socket two peers hold). Rules: a decode
room is created for an address and resolves against the world (its lookup answers for
the current instance, or fails when the address is dead; a DP group may be missing),
rooms end, prefill instances restart at the same ports or at new ones (every rank gets a
new instance), single ranks restart, addresses die and come back, heartbeat rounds run
their probes against the world, control messages and refusals arrive from ranks,
discovery watch puts/deletes (of an address, and of one rank, with the instance it
replaced) and lease expiries arrive, an address's clock jumps beyond the freshness
window and back, ranks claim clock skew (truly or forged), time passes.

The simulated decode performs the machine's effects: it opens resources as it holds
them, closes them on ``Close``, fails rooms on ``FailRooms`` with the same rule as
:meth:`kvd.rooms.receiver.ReceiverRooms.peer_lost`.

Checked after every step:

(a) ownership: the open resources are exactly those some peer holds; a forgotten
    peer holds nothing;
(b) a room resolved from a lookup naming the address's current instance, with every
    rank it targets at its current instance, never failed because of a restart;
(c) a round probes at most ``max_probes`` peers, each tracked, never an idle one that
    is down, and no peer without a live room is kept when nothing ever answered for it;
(d) once a fact naming the current instance arrived, the machine knows that instance;
(e) a claimed skew the own measurement contradicts fails no room: every room failed
    for skew was failed while the newest clock reading fed for its address was beyond
    the window, and a room failed for skew only after a claim for its rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvd.membership.effects import (
    Close,
    FailRooms,
    Forget,
    Measure,
    Probe,
    Resource,
    ResourceKind,
    Source,
)
from kvd.membership.machine import Limits, Members

ADDRS = ("a:1", "b:1", "c:1", "d:1")
MAX_PROBES = 2
SHARED = "tcp://shared:9"  # a rank endpoint both a:1 and b:1 name
WINDOW = 30.0  # max_skew


@dataclass
class Site:
    """One prefill bootstrap address in the world."""

    addr: str
    instance: str
    dp: int
    ports: int = 0
    alive: bool = True
    clock: float = 0.0   # its clock minus the decode's (s)
    missing: set[int] = field(default_factory=set)   # DP groups deregistered

    def endpoint(self, dp: int) -> str:
        if self.addr in ("a:1", "b:1") and dp == 0:
            return SHARED
        return f"tcp://{self.addr}-{self.ports}:{dp}"


@dataclass
class Room:
    addr: str
    dp: int
    via: str | None = None
    targets: tuple[tuple[str, str], ...] | None = None  # (endpoint, instance)
    done: bool = False
    failed: str = ""


class MembershipWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = Members(Limits(max_failures=2, peer_ttl=30.0, fresh_for=5.0,
                                max_probes=MAX_PROBES, max_skew=WINDOW))
        self.now = 0.0
        self.ids = itertools.count()
        self.sites = {a: Site(a, self._new(), dp=2 if a in ("a:1", "c:1") else 1)
                      for a in ADDRS}
        # rank endpoint -> the instance of the kvd listening there (one for SHARED)
        self.ranks = {s.endpoint(g): self._new() for s in self.sites.values()
                      for g in range(s.dp)}
        self.open: set[Resource] = set()
        self.rooms: list[Room] = []
        self.learned: dict[str, str] = {}  # addr -> instance a fact named last
        self.measured: dict[str, float] = {}  # addr -> the clock reading fed last
        self.claimed: set[str] = set()  # rank endpoints that claimed skew
        self.etcd: dict[str, str] = {}  # rank endpoint -> instance the watch put last

    def _new(self) -> str:
        return f"i{next(self.ids)}"

    # ---- performing effects -----------------------------------------------------------

    def apply(self, effects: list[object]) -> list[Probe]:
        probes = []
        for e in effects:
            if isinstance(e, Close):
                assert e.resource in self.open, e
                self.open.discard(e.resource)
            elif isinstance(e, FailRooms):
                if e.reason.startswith("clock skew"):  # (e)
                    assert abs(self.measured[e.addr]) > WINDOW, (e, self.measured)
                    assert e.endpoint in self.claimed, e
                for r in self.rooms:
                    if r.addr == e.addr and not r.done and self._hit(r, e):
                        r.done, r.failed = True, e.reason
            elif isinstance(e, Forget):
                assert e.addr not in self.m.peers
            elif isinstance(e, Probe):
                probes.append(e)
            elif isinstance(e, Measure):
                self.measure(e.addr)
        return probes

    def measure(self, addr: str) -> None:
        """Read ``addr``'s clock, as a ``/health`` answer would (nothing when dead)."""
        s = self.sites[addr]
        if s.alive:
            self.measured[addr] = s.clock
            self.apply(self.m.clock_measured(addr, s.clock, self.now))

    @staticmethod
    def _hit(r: Room, e: FailRooms) -> bool:
        if e.keep is None and e.endpoint is None:
            return True
        if r.targets is None:
            return False
        if e.endpoint is not None:
            return any(ep == e.endpoint and inst != e.keep for ep, inst in r.targets)
        return r.via != e.keep

    def hold(self, addr: str, r: Resource, instance: str | None = None) -> None:
        out = self.m.hold(addr, r, instance)
        self.open.add(r)
        self.apply(out)

    # ---- rules ------------------------------------------------------------------------

    @rule(addr=st.sampled_from(ADDRS), dp=st.integers(0, 1))
    def create_and_resolve(self, addr: str, dp: int) -> None:
        s = self.sites[addr]
        room = Room(addr, dp % s.dp)
        self.rooms.append(room)
        self.apply(self.m.used(addr, self.now))
        plan = self.m.lookup(addr, self.now)
        if plan.refuse:  # down, tried moments ago
            assert self.m.peers[addr].down
            room.done, room.failed = True, "down"
            return
        if plan.refresh and Resource(ResourceKind.LOOKUP, addr) in self.open:
            self.open.discard(Resource(ResourceKind.LOOKUP, addr))  # refreshed at once
            self.open.add(Resource(ResourceKind.LOOKUP, addr))
        if not s.alive or room.dp in s.missing:
            room.done, room.failed = True, "bootstrap"
            return
        self.apply(self.m.route_answered(addr, s.instance, self.now))
        self.learned[addr] = s.instance
        self.hold(addr, Resource(ResourceKind.LOOKUP, addr))
        ep = s.endpoint(room.dp)
        self.hold(addr, Resource(ResourceKind.SOCKET, ep), self.ranks[ep])
        self.hold(addr, Resource(ResourceKind.REGISTRATION, ep))
        if self.m.bound_to(addr, s.instance):
            room.via, room.targets = s.instance, ((ep, self.ranks[ep]),)
        else:
            room.done, room.failed = True, "restarted while resolving"

    @rule(i=st.integers(0, 200))
    def room_ends(self, i: int) -> None:
        live = [r for r in self.rooms if not r.done]
        if live:
            live[i % len(live)].done = True

    @rule(addr=st.sampled_from(ADDRS), new_ports=st.booleans())
    def restart(self, addr: str, new_ports: bool) -> None:
        s = self.sites[addr]
        s.instance, s.alive, s.missing = self._new(), True, set()
        if new_ports:
            s.ports += 1
        for g in range(s.dp):
            self.ranks[s.endpoint(g)] = self._new()

    @rule(addr=st.sampled_from(ADDRS))
    def rank_restarts(self, addr: str) -> None:
        s = self.sites[addr]
        self.ranks[s.endpoint(s.dp - 1)] = self._new()

    @rule(addr=st.sampled_from(ADDRS), alive=st.booleans())
    def dies_or_returns(self, addr: str, alive: bool) -> None:
        self.sites[addr].alive = alive

    @rule(addr=st.sampled_from(("a:1", "c:1")), present=st.booleans())
    def dp_group_one(self, addr: str, present: bool) -> None:
        s = self.sites[addr]
        if present:
            s.missing.discard(1)
        else:
            s.missing.add(1)

    @rule()
    def heartbeat_round(self) -> None:
        live = {r.addr for r in self.rooms if not r.done}
        probes = self.apply(self.m.heartbeat_round(self.now, live))
        assert len(probes) <= MAX_PROBES
        for p in self.m.peers.values():
            assert p.addr in live or p.answered
        assert all(p.addr in live or not self.m.peers[p.addr].down for p in probes)
        for p in probes:
            assert p.addr in self.m.peers
            s = self.sites[p.addr]
            if s.alive:
                self.apply(self.m.heartbeat_answered(p.addr, s.instance, len(s.missing),
                                                     self.now))
                self.learned[p.addr] = s.instance
                if p.addr in self.m.peers:
                    self.measure(p.addr)
            else:
                self.apply(self.m.heartbeat_missed(p.addr, "ConnectError", self.now))

    @rule(addr=st.sampled_from(ADDRS), refusal=st.booleans())
    def rank_speaks(self, addr: str, refusal: bool) -> None:
        s = self.sites[addr]
        if not s.alive:
            return
        ep = s.endpoint(s.dp - 1)
        source = Source.REFUSAL if refusal else Source.CONTROL
        self.apply(self.m.rank_seen(ep, self.ranks[ep], source, self.now))

    @rule(addr=st.sampled_from(ADDRS), put=st.booleans())
    def discovery(self, addr: str, put: bool) -> None:
        s = self.sites[addr]
        if put and s.alive:
            self.apply(self.m.watch_put(addr, s.instance, self.now))
            self.learned[addr] = s.instance
        elif not put and not s.alive:
            self.apply(self.m.lost(addr, Source.LEASE, f"lease of {addr} expired", self.now))

    @rule(addr=st.sampled_from(ADDRS), put=st.booleans())
    def rank_watch(self, addr: str, put: bool) -> None:
        """A watch event for one rank: a put naming the instance it replaced, or (the
        address dead) a delete."""
        s = self.sites[addr]
        ep = s.endpoint(s.dp - 1)
        if put and s.alive:
            prev = self.etcd.get(ep)
            self.apply(self.m.rank_put(addr, ep, self.ranks[ep], self.now,
                                       prev if prev != self.ranks[ep] else None))
            self.etcd[ep] = self.ranks[ep]
        elif not put and not s.alive:
            self.apply(self.m.rank_deleted(addr, ep, self.etcd.pop(ep, self.ranks[ep]),
                                           self.now))

    @rule(addr=st.sampled_from(ADDRS), far=st.booleans())
    def clock_jumps(self, addr: str, far: bool) -> None:
        self.sites[addr].clock = 3600.0 if far else 0.5

    @rule(addr=st.sampled_from(ADDRS), forged=st.booleans())
    def skew_claimed(self, addr: str, forged: bool) -> None:
        """A rank of ``addr`` claims skew: truly (its clock is off) or forged (by any
        holder of the secret, whatever the clocks)."""
        s = self.sites[addr]
        if not forged and abs(s.clock) <= WINDOW:
            return
        ep = s.endpoint(s.dp - 1)
        self.claimed.add(ep)
        self.apply(self.m.clock_claimed(ep, self.now))

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0, 40.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    # ---- invariants -------------------------------------------------------------------

    @invariant()
    def ownership(self) -> None:
        held = set().union(*(p.held for p in self.m.peers.values()))
        assert held == self.open, (held ^ self.open)
        for r in held:  # the machine's holder index agrees with the peers
            assert self.m.holders(r) == sum(r in p.held for p in self.m.peers.values())

    @invariant()
    def rooms_of_the_current_instance_never_fail_for_the_old_one(self) -> None:
        for r in self.rooms:
            if r.targets is None or "restarted" not in r.failed:
                continue
            current = r.via == self.sites[r.addr].instance and all(
                self.ranks.get(ep) == inst for ep, inst in r.targets)
            assert not current, r

    @invariant()
    def the_newest_fact_is_known(self) -> None:
        for addr, inst in self.learned.items():
            p = self.m.peers.get(addr)
            if p is not None and p.fact is not None and p.fact.instance is not None:
                assert p.instance == inst, (addr, p)


TestMembershipWorld = MembershipWorld.TestCase
TestMembershipWorld.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
