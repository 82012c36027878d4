"""What the membership machine asks its daemon to do, and the names it uses. PURE values.

A :class:`~kvd.membership.machine.Members` method returns a list of effects; the daemon
performs them in order and feeds what it learns back as events (``heartbeat_answered``,
``route_answered``, ``rank_seen`` ...). Effects carry no callbacks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvd.rooms.state import FailureKind


class Source(enum.Enum):
    """Where a fact about a peer came from. A discovery backend adds its events under
    ``WATCH`` / ``LEASE``; nothing else in the machine depends on the source."""

    HEARTBEAT = "heartbeat"   # GET /health of the bootstrap address
    ROUTE = "route"           # a /route answer (parallel info names the instance)
    CONTROL = "control"       # a control message from one of the peer's ranks
    REFUSAL = "refusal"       # a rank refused a frame and named its current instance
    WATCH = "watch"           # a discovery watch (put: rank alive as X; delete: gone)
    LEASE = "lease"           # a discovery lease expired


class ResourceKind(enum.Enum):
    """What this side holds for a peer."""

    LOOKUP = "lookup"               # cached parallel info and rank lookups (key: address)
    REGISTRATION = "registration"   # this rank's KV args registered with a rank (endpoint)
    SOCKET = "socket"               # a control socket to a rank (key: endpoint)


@dataclass(frozen=True, order=True)
class Resource:
    """One thing held for peers: ``kind`` and its ``key`` (a bootstrap address for
    ``LOOKUP``, a rank's control endpoint otherwise)."""

    kind: ResourceKind
    key: str


@dataclass(frozen=True)
class Probe:
    """Heartbeat ``addr`` once (``GET /health``); answer with ``heartbeat_answered`` or
    ``heartbeat_missed``."""

    addr: str


@dataclass(frozen=True)
class Verify:
    """Rank ``endpoint`` of ``addr`` claimed another instance than the one resolved (a
    control message or a refusal: sealed with the cluster secret every member holds, so
    a claim, not proof). Look the rank up again (a fresh ``/route`` answer, or the
    discovery view) and answer with ``rank_verified``; only that answer fails rooms."""

    addr: str
    endpoint: str


@dataclass(frozen=True)
class Measure:
    """A rank of ``addr`` claimed that its clock and this side's are further apart than
    the freshness window (a ``clock_skew`` refusal, or a frame sealed outside the
    window: both dated by whoever sealed them with the cluster secret, so a claim).
    Read ``addr``'s clock once (``GET /health``, its ``clock_s``) and answer with
    ``clock_measured``; only a measurement beyond the window fails rooms (K40, S11).
    An unanswered measurement is no heartbeat miss."""

    addr: str


@dataclass(frozen=True)
class Close:
    """Nobody holds ``resource`` any more: drop the cache entry, the registration record
    or the socket."""

    resource: Resource


@dataclass(frozen=True)
class FailRooms:
    """Fail the unfinished rooms of bootstrap ``addr`` with ``kind`` and ``reason``, except
    rooms still resolving and rooms resolved from a lookup naming instance ``keep`` (the
    peer's new instance: they are not bound to the old one). ``endpoint``: only rooms
    with a target at that rank endpoint (one rank restarted)."""

    addr: str
    kind: FailureKind
    reason: str
    keep: str | None = None
    endpoint: str | None = None


@dataclass(frozen=True)
class Forget:
    """Peer ``addr`` has no entry any more (everything it held was closed before)."""

    addr: str


@dataclass(frozen=True)
class Lookup:
    """How a room resolves its targets now: ``refresh``: drop the cached lookups of the
    address first (nothing fresh enough is known about it); ``retry``: retry connection
    errors within the bootstrap budget (False: the peer is down, so a connection error
    fails the room at once; a 503 -- the server is up, its ranks not registered yet -- is
    retried either way); ``refuse``: the peer is down and was tried moments ago: fail
    the room at once."""

    refresh: bool
    retry: bool
    refuse: bool = False


Effect = Probe | Verify | Measure | Close | FailRooms | Forget
