"""Who is alive, which instance it is, and what this side holds for it. PURE (no I/O).

One :class:`Members` per decode daemon holds a :class:`Peer` per prefill bootstrap
address (the address and the ranks it answers for). Every fact about a peer comes
with its :class:`Source` and time: a heartbeat (``/health``), a ``/route`` answer, a
control message from one of its ranks, a refusal naming a rank's current instance, a
discovery watch event or a lease expiry. Whatever learns a fact first changes the
peer; the heartbeat is one source among several (K37).

Events are methods (``now``: monotonic s, passed in); each returns the effects the
daemon performs, in order (:mod:`kvd.membership.effects`).

Rules this module guarantees (tested in ``tests/unit/membership``):

* **Instance facts win over liveness guesses.** A peer seen alive with instance X
  (any source) is up for X: "down" is cleared, misses reset. A *new* X fails the
  rooms bound to the old instance (:class:`FailRooms` with ``keep`` = X) and closes
  the lookups and registrations made for it, so rooms created after X is known never
  fail because of the old one (K37).
* **Down.** ``heartbeat_max_failures`` missed heartbeats in a row, a watch delete or a
  lease expiry make the peer down: its rooms fail, lookups and registrations close.
  A lookup while down is tried once, fresh (:class:`Lookup`), by one room per
  ``down_retry`` seconds (the others fail at once): a restarted peer is usable as soon
  as its bootstrap answers, and a dead one costs no lookup per room.
* **Ownership.** Each :class:`Resource` (cached lookup, registration, control socket)
  is held by peers; :class:`Close` is emitted when the last holder lets it go. A
  forgotten peer holds nothing (K31, K39).
* **Watch events are facts about one rank** (:meth:`rank_put`, :meth:`rank_deleted`,
  from an etcd watch: etcd's own record, not a claim). A rank replaced by another
  instance fails the rooms bound to the old one (kind ``peer``) and drops its
  registration; a rank gone fails its rooms, drops its registration and closes its
  socket (an endpoint nobody serves any more). Nothing else decides this (K37, K39).
* **Clock skew is measured, not believed** (K40, S11). A skew refusal or a frame
  sealed outside the window is dated by whoever holds the cluster secret, so it is
  a claim (:meth:`clock_claimed`). Only this side's own measurement of the peer's
  clock (``clock_s`` of its ``/health``, against this side's wall clock, fed as
  :meth:`clock_measured`) beyond ``max_skew`` fails the rooms at that rank (kind
  ``peer``, the measured offset named) and drops the registration; otherwise the
  machine asks for a measurement (:class:`Measure`) and fails nothing until one
  confirms. A confirmed skew fails new rooms at that rank at once for
  ``skew_memory`` s (:meth:`skewed`: its refusals are rate-limited, later ones may
  not come), or until a measurement within the window.
* **Bounded work.** A peer with no live room is forgotten at once when nothing ever
  answered for it, otherwise after ``peer_ttl``; one heartbeat round probes at most
  ``max_probes`` peers, those with a live room first, never an idle one that is down
  (K41). A peer's
  cached lookup is refreshed on its next use when no fact about it is younger than
  ``fresh_for`` or its last heartbeat went unanswered.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvd.membership.effects import (
    Close,
    Effect,
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
from kvd.rooms.state import FailureKind


@dataclass(frozen=True)
class Fact:
    """The newest thing learned about a peer: from ``source`` at ``at`` (monotonic s),
    naming ``instance`` (None: the source does not name one)."""

    source: Source
    at: float
    instance: str | None


@dataclass(frozen=True)
class Clock:
    """This side's own measurement of a peer's wall clock: the peer's minus this side's
    (``offset``, s; the half round trip of the request is the error) at ``at``
    (monotonic s), read from ``via`` (the URL that answered; empty when not told)."""

    offset: float
    at: float
    via: str = ""


@dataclass
class Peer:
    """One prefill bootstrap address as this side knows it (times: monotonic s)."""

    addr: str
    last_used: float
    instance: str | None = None
    epoch: int | None = None
    down: bool = False
    misses: int = 0
    last_ok: float = 0.0           # last answered heartbeat (0: never)
    last_error: str = ""
    last_probe: float | None = None
    last_try: float | None = None  # last lookup tried while down
    answered: bool = False         # some source ever showed it alive
    fact: Fact | None = None       # newest liveness fact, any source
    ranks: dict[str, str] = field(default_factory=dict)  # control endpoint -> instance
    held: set[Resource] = field(default_factory=set)
    clock: Clock | None = None     # own newest measurement of its clock
    asked: float | None = None     # when a Measure was last emitted
    claims: set[str] = field(default_factory=set)  # endpoints that claimed skew, unjudged
    skewed: dict[str, tuple[str, float]] = field(default_factory=dict)  # ep -> (reason, at)

    @property
    def heartbeat(self) -> str:
        """``unknown``, ``ok``, ``missed N`` or ``down`` (the /v1/status field)."""
        if self.misses == 0 and not self.last_ok:
            return "unknown"
        if self.down:
            return "down"
        return f"missed {self.misses}" if self.misses else "ok"


@dataclass(frozen=True)
class Limits:
    """The machine's settings (seconds; counts)."""

    max_failures: int = 2          # heartbeat_max_failures
    peer_ttl: float = 600.0
    fresh_for: float = 5.0         # heartbeat_interval
    max_probes: int = 500          # per heartbeat round
    down_retry: float = 1.0        # while down, one lookup try per this many seconds;
    #                                also at most one Measure per peer per this many s
    max_skew: float = 30.0         # auth_max_skew: the freshness window (s, K40)
    skew_memory: float = 10.0      # a confirmed skew fails new rooms at once this long


def skew_reason(peer: str, offset_s: float, window_s: float) -> str:
    """The failure reason of a room lost to clock skew, naming ``peer``'s clock minus
    this daemon's (``offset_s``, s) and the freshness window (``window_s``, s,
    ``auth_max_skew``), K40."""
    side = "ahead of" if offset_s > 0 else "behind"
    return (f"clock skew: {peer}'s clock is {abs(offset_s):.1f}s {side} this daemon's, "
            f"beyond the {window_s:.0f}s freshness window (auth_max_skew), so their signed "
            f"messages are refused; synchronise the hosts' clocks (NTP)")


class Members:
    """Peers of one decode daemon; see the module docstring for the rules."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.peers: dict[str, Peer] = {}
        # indexes (kept with Peer.held): how many peers hold each resource, and which
        # peers hold a socket to each rank endpoint -- events stay O(1) in the peer count
        self._holders: Counter[Resource] = Counter()
        self._by_endpoint: defaultdict[str, set[str]] = defaultdict(set)

    # ---- rooms ------------------------------------------------------------------------

    def used(self, addr: str, now: float) -> list[Effect]:
        """A room names ``addr`` (ReceiverCreate, or an abort of an unknown room)."""
        p = self.peers.get(addr)
        if p is None:
            self.peers[addr] = Peer(addr, last_used=now)
        else:
            p.last_used = now
        return []

    def lookup(self, addr: str, now: float) -> Lookup:
        """How a room of ``addr`` resolves now: from the cache, or fresh (and retried
        within the bootstrap budget unless the peer is down). While down, one room per
        ``down_retry`` seconds tries (the peer may be back: K37); the others fail at once
        (thousands of rooms for a dead peer cost no lookups, K19). Records that try."""
        p = self.peers.get(addr)
        if p is None:
            return Lookup(refresh=True, retry=True)
        if p.down:
            if p.last_try is not None and now - p.last_try < self.limits.down_retry:
                return Lookup(refresh=True, retry=False, refuse=True)
            p.last_try = now
            return Lookup(refresh=True, retry=False)
        # a missed heartbeat is a hint too: the peer may be restarting
        stale = p.fact is None or p.misses > 0 or now - p.fact.at > self.limits.fresh_for
        return Lookup(refresh=stale, retry=True)

    def bound_to(self, addr: str, instance: str | None) -> bool:
        """May a room resolved from a lookup of ``addr`` naming ``instance`` proceed? No
        when the peer is known to be another instance now (it restarted meanwhile)."""
        p = self.peers.get(addr)
        return p is None or p.instance is None or instance is None or instance == p.instance

    # ---- facts ------------------------------------------------------------------------

    def seen(self, addr: str, source: Source, instance: str | None, now: float,
             epoch: int | None = None) -> list[Effect]:
        """``addr`` answered for ``instance`` (``epoch``: its bootstrap table's, from a
        heartbeat). Creates no peer: an unused address is not tracked."""
        p = self.peers.get(addr)
        if p is None:
            return []
        out: list[Effect] = []
        if instance is not None and p.instance is not None and instance != p.instance:
            reason = (f"prefill {addr} restarted (instance {p.instance} -> {instance}, "
                      f"seen by {source.value})")
            out.append(FailRooms(addr, FailureKind.PEER, reason, keep=instance))
            self._release(p, out, (ResourceKind.LOOKUP, ResourceKind.REGISTRATION))
            p.ranks.clear()
        elif epoch is not None and p.epoch is not None and epoch != p.epoch:
            # a rank re-registered or left: refresh the endpoints
            self._release(p, out, (ResourceKind.LOOKUP, ResourceKind.REGISTRATION))
        p.instance = instance if instance is not None else p.instance
        p.epoch = epoch if epoch is not None else p.epoch
        p.down, p.misses, p.last_error, p.answered = False, 0, "", True
        p.fact = Fact(source, now, instance)
        if source is Source.HEARTBEAT:
            p.last_ok = now
        return out

    def heartbeat_answered(self, addr: str, instance: str | None, epoch: int | None,
                           now: float) -> list[Effect]:
        """A ``/health`` answer of ``addr`` (``now``: monotonic s); see :meth:`seen`."""
        return self.seen(addr, Source.HEARTBEAT, instance, now, epoch)

    def route_answered(self, addr: str, instance: str | None, now: float) -> list[Effect]:
        """A fresh ``/route`` answer of ``addr`` naming ``instance`` (K37); :meth:`seen`."""
        return self.seen(addr, Source.ROUTE, instance, now)

    def watch_put(self, addr: str, instance: str, now: float) -> list[Effect]:
        """A discovery source says ``addr`` is alive as ``instance``; :meth:`seen`."""
        return self.seen(addr, Source.WATCH, instance, now)

    def rank_seen(self, endpoint: str, instance: str, source: Source,
                  now: float) -> list[Effect]:
        """A rank's control endpoint spoke as ``instance`` (a control message, or a refusal
        naming its current instance). The instance resolved: the rank is alive. Another
        one is only a claim (any holder of the cluster secret can seal a frame naming any
        endpoint, S11): the cached lookup is dropped and the rank looked up again
        (:class:`Verify`); :meth:`rank_verified` decides."""
        out: list[Effect] = []
        for addr in sorted(self._by_endpoint.get(endpoint, ())):
            p = self.peers[addr]
            known = p.ranks.get(endpoint)
            if known is None:
                continue
            if known != instance:  # Verify first: the side reads the ranks it looked up
                out.append(Verify(p.addr, endpoint))
                self._release(p, out, (ResourceKind.LOOKUP,))
                continue
            p.down, p.misses = False, 0
            p.fact = Fact(source, now, p.instance)
        return out

    def rank_verified(self, addr: str, endpoint: str, instance: str,
                      now: float) -> list[Effect]:
        """A fresh lookup of ``addr`` says rank ``endpoint`` is ``instance`` now (the
        answer to :class:`Verify`). Another instance than the one resolved: that rank
        restarted, and the peer drops what it holds for the old one (K37)."""
        p = self.peers.get(addr)
        known = p.ranks.get(endpoint) if p is not None else None
        if p is None or known is None or known == instance:
            return []
        out: list[Effect] = [FailRooms(p.addr, FailureKind.PEER,
                                       f"prefill rank {endpoint} restarted (instance {known} "
                                       f"-> {instance}, seen by {Source.ROUTE.value})",
                                       keep=instance, endpoint=endpoint)]
        self._release(p, out, (ResourceKind.LOOKUP,))
        self._release_one(p, Resource(ResourceKind.REGISTRATION, endpoint), out)
        p.ranks[endpoint] = instance
        p.fact = Fact(Source.ROUTE, now, p.instance)
        return out

    def control_seen(self, endpoint: str, instance: str, now: float) -> list[Effect]:
        """An authentic control message from rank ``endpoint``; :meth:`rank_seen` (S11)."""
        return self.rank_seen(endpoint, instance, Source.CONTROL, now)

    def refused(self, endpoint: str, instance: str, now: float) -> list[Effect]:
        """A ``Refused(instance)`` from rank ``endpoint``: a claim, :meth:`rank_seen`
        (S11); the registration is dropped only by :meth:`rank_verified`."""
        return self.rank_seen(endpoint, instance, Source.REFUSAL, now)

    def rank_put(self, addr: str, endpoint: str, instance: str, now: float,
                 previous: str | None = None, previous_endpoint: str | None = None,
                 rank: str = "rank") -> list[Effect]:
        """A discovery watch put: rank ``rank`` (a label for reasons, e.g. ``rank dp 0 tp
        1 pp 0``) of ``addr`` is ``instance`` at control ``endpoint``; ``previous`` /
        ``previous_endpoint``: the instance and endpoint it replaced (None: a new key, or
        the same instance re-registered after etcd came back). A replacement fails the
        rooms at the old endpoint bound to another instance than ``instance`` (kind
        ``peer``), drops the registration made there and, when the rank moved, closes
        the old endpoint's socket. Nothing happens for a rank this side holds nothing
        for, or already knows as ``instance`` (a :class:`Verify` answer came first)."""
        p = self.peers.get(addr)
        if p is None:
            return []
        p.fact = Fact(Source.WATCH, now, p.instance)
        old = previous_endpoint or endpoint
        known = p.ranks.get(old)
        if previous is None or previous == instance or known is None or known == instance:
            return []
        out: list[Effect] = [FailRooms(addr, FailureKind.PEER,
                                       f"prefill {addr} {rank} at {old} restarted (instance "
                                       f"{previous} -> {instance})", keep=instance,
                                       endpoint=old)]
        self._release_one(p, Resource(ResourceKind.REGISTRATION, old), out)
        if old != endpoint:
            self._release_one(p, Resource(ResourceKind.SOCKET, old), out)
        else:
            p.ranks[old] = instance
        return out

    def rank_deleted(self, addr: str, endpoint: str, instance: str, now: float,
                     rank: str = "rank") -> list[Effect]:
        """A discovery watch delete: rank ``rank`` of ``addr``, last ``instance`` at
        ``endpoint``, left (its lease expired, or it deregistered). Its rooms fail (kind
        ``peer``), its registration is dropped and its socket closed (unless another peer
        still holds it). The other ranks of ``addr`` are untouched (K38)."""
        p = self.peers.get(addr)
        if p is None or endpoint not in p.ranks:
            return []
        p.fact = Fact(Source.WATCH, now, p.instance)
        out: list[Effect] = [FailRooms(addr, FailureKind.PEER,
                                       f"prefill {addr} {rank} at {endpoint} left discovery "
                                       f"(instance {instance}: lease expired or "
                                       f"deregistered)", endpoint=endpoint)]
        self._release_one(p, Resource(ResourceKind.REGISTRATION, endpoint), out)
        self._release_one(p, Resource(ResourceKind.SOCKET, endpoint), out)
        return out

    def clock_claimed(self, endpoint: str, now: float) -> list[Effect]:
        """Rank ``endpoint`` and this side cannot read each other's frames for clock skew,
        as claimed by a ``clock_skew`` refusal or by a frame sealed outside the window
        (either is dated by its sealer: a claim, S11). For each peer holding a socket to
        it: its own measurement younger than ``fresh_for`` s and beyond ``max_skew``
        confirms it now; otherwise the claim waits for :meth:`clock_measured`, and a
        :class:`Measure` is asked (at most one per peer per ``down_retry`` s, so a flood
        of claims costs one request per second; a claim inside that waits for the next
        heartbeat round's). Fails nothing else (K40)."""
        out: list[Effect] = []
        for addr in sorted(self._by_endpoint.get(endpoint, ())):
            p = self.peers[addr]
            if endpoint not in p.ranks:
                continue
            c = p.clock
            if c is not None and now - c.at <= self.limits.fresh_for and self._beyond(c):
                self._skew_confirmed(p, endpoint, c, now, out)
                continue
            p.claims.add(endpoint)
            if p.asked is None or now - p.asked >= self.limits.down_retry:
                p.asked = now
                out.append(Measure(addr))
        return out

    def clock_measured(self, addr: str, offset: float, now: float,
                       via: str = "") -> list[Effect]:
        """This side read ``addr``'s clock: it is ``offset`` s off this side's (its minus
        ours; from a heartbeat or the answer to :class:`Measure`, read from ``via``).
        Beyond ``max_skew``: the claims waiting for it are confirmed (their rooms fail,
        kind ``peer``, the offset named; their registrations are dropped). Within: they
        are contradicted and dropped, failing nothing, and the skew memory of ``addr``
        ends."""
        p = self.peers.get(addr)
        if p is None:
            return []
        c = p.clock = Clock(offset, now, via)
        claims, p.claims = p.claims, set()
        out: list[Effect] = []
        if not self._beyond(c):
            p.skewed.clear()
            return out
        for endpoint in sorted(claims):
            if endpoint in p.ranks:
                self._skew_confirmed(p, endpoint, c, now, out)
        return out

    def skewed(self, addr: str, endpoints: Iterable[str], now: float) -> str | None:
        """The reason a room of ``addr`` resolved to ``endpoints`` fails at once: one of
        them had its skew confirmed less than ``skew_memory`` s ago. None otherwise."""
        p = self.peers.get(addr)
        for endpoint in endpoints if p is not None else ():
            known = p.skewed.get(endpoint) if p is not None else None
            if known is not None and now - known[1] < self.limits.skew_memory:
                return known[0]
        return None

    def _beyond(self, c: Clock) -> bool:
        return abs(c.offset) > self.limits.max_skew

    def _skew_confirmed(self, p: Peer, endpoint: str, c: Clock, now: float,
                        out: list[Effect]) -> None:
        reason = skew_reason(f"prefill rank {endpoint}", c.offset, self.limits.max_skew)
        p.skewed[endpoint] = (reason, now)
        out.append(FailRooms(p.addr, FailureKind.PEER, reason, endpoint=endpoint))
        self._release_one(p, Resource(ResourceKind.REGISTRATION, endpoint), out)

    def heartbeat_missed(self, addr: str, error: str, now: float) -> list[Effect]:
        """One heartbeat of ``addr`` went unanswered (``error``: why)."""
        p = self.peers.get(addr)
        if p is None:
            return []
        p.misses += 1
        p.last_error = error
        if p.misses < self.limits.max_failures or p.down:
            return []
        return self._lost(p, Source.HEARTBEAT, FailureKind.HEARTBEAT,
                          f"prefill {addr} unreachable: {p.misses} heartbeats missed "
                          f"({error})", now)

    def lost(self, addr: str, source: Source, reason: str, now: float) -> list[Effect]:
        """A discovery source says ``addr`` is gone (watch delete, lease expiry)."""
        p = self.peers.get(addr)
        if p is None or p.down:
            return []
        return self._lost(p, source, FailureKind.PEER, reason, now)

    def _lost(self, p: Peer, source: Source, kind: FailureKind, reason: str,
              now: float) -> list[Effect]:
        p.down = True
        p.fact = Fact(source, now, None)
        out: list[Effect] = [FailRooms(p.addr, kind, reason, keep=None)]
        self._release(p, out, (ResourceKind.LOOKUP, ResourceKind.REGISTRATION))
        return out

    # ---- resources --------------------------------------------------------------------

    def hold(self, addr: str, resource: Resource,
             instance: str | None = None) -> list[Effect]:
        """Peer ``addr`` now holds ``resource`` (a rank socket's ``instance`` is noted for
        :meth:`rank_seen`). For a peer forgotten meanwhile, nothing may be held: the
        resource is closed at once unless another peer holds it."""
        p = self.peers.get(addr)
        if p is None:
            return [] if self.holders(resource) else [Close(resource)]
        if resource not in p.held:
            p.held.add(resource)
            self._holders[resource] += 1
            if resource.kind is ResourceKind.SOCKET:
                self._by_endpoint[resource.key].add(addr)
        if resource.kind is ResourceKind.SOCKET and instance is not None:
            p.ranks[resource.key] = instance
        return []

    def holders(self, resource: Resource) -> int:
        """How many peers hold ``resource``."""
        return self._holders.get(resource, 0)

    def _release(self, p: Peer, out: list[Effect], kinds: Iterable[ResourceKind]) -> None:
        for r in sorted((r for r in p.held if r.kind in tuple(kinds)),
                        key=lambda r: (r.kind.value, r.key)):
            self._release_one(p, r, out)

    def _release_one(self, p: Peer, r: Resource, out: list[Effect]) -> None:
        if r not in p.held:
            return
        p.held.discard(r)
        self._holders[r] -= 1
        if r.kind is ResourceKind.SOCKET:
            p.ranks.pop(r.key, None)
            peers = self._by_endpoint[r.key]
            peers.discard(p.addr)
            if not peers:
                del self._by_endpoint[r.key]
        if not self._holders[r]:
            del self._holders[r]
            out.append(Close(r))

    # ---- time -------------------------------------------------------------------------

    def heartbeat_round(self, now: float, live: set[str]) -> list[Effect]:
        """One heartbeat round: ``live``: bootstrap addresses with an unfinished room.
        Forgets the idle peers that no longer earn their entry (nothing ever answered
        for them, or unused for ``peer_ttl``), then probes at most ``max_probes``
        targets: peers with a live room first, then idle ones that are up (their death
        closes what is held for them before ``peer_ttl``), the longest unprobed first.
        An idle peer that is down is kept (so its rooms fail at once, K19) but not
        probed: a room's lookup is its probe (:meth:`lookup`). A peer with clock-skew
        claims still unjudged gets a :class:`Measure` (:meth:`clock_claimed` asks at
        most one per ``down_retry`` s)."""
        out: list[Effect] = []
        for addr in live:
            self.used(addr, now)
        for p in list(self.peers.values()):
            if p.addr in live:
                continue
            if not p.answered or now - p.last_used > self.limits.peer_ttl:
                self._forget(p, out)
        due = sorted((p for p in self.peers.values() if p.addr in live or not p.down),
                     key=lambda p: (p.addr not in live, p.last_probe is not None,
                                    p.last_probe or 0.0, p.addr))
        for p in due[:self.limits.max_probes]:
            p.last_probe = now
            out.append(Probe(p.addr))
        for p in self.peers.values():  # claims that came while a Measure was recent
            if p.claims and (p.asked is None or now - p.asked >= self.limits.down_retry):
                p.asked = now
                out.append(Measure(p.addr))
        return out

    def forget(self, addr: str) -> list[Effect]:
        """End ``addr``'s entry now: ``Close`` for what only it held, then ``Forget``
        (K31, K39)."""
        p = self.peers.get(addr)
        out: list[Effect] = []
        if p is not None:
            self._forget(p, out)
        return out

    def _forget(self, p: Peer, out: list[Effect]) -> None:
        self._release(p, out, tuple(ResourceKind))
        del self.peers[p.addr]
        out.append(Forget(p.addr))

    def table_sizes(self) -> dict[str, int]:
        """Counts for ``/health`` and leak checks: peers tracked, peers down (K41)."""
        return {"peers": len(self.peers),
                "peers_down": sum(p.down for p in self.peers.values())}
