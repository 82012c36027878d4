"""Lease keeping and backoff timing for etcd discovery. PURE (no I/O, ``now`` passed in,
seconds of a monotonic clock).

:class:`Keeper` decides what a prefill rank's registration task does next: grant a
lease, put the registration under it, renew it every third of its TTL, and start over
(grant, put) when etcd says the lease is gone (it expired while etcd was unreachable,
or etcd lost its data). Errors back off, capped, and never give up: a rank whose etcd
comes back registers again without a restart.

:class:`Freshness` says whether a decode's view may still be used for new lookups
while etcd is unreachable (``etcd_view_ttl``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass
class Backoff:
    """Capped exponential backoff: ``base``, 2 ``base``, ... up to ``cap`` seconds."""

    base: float = 0.05
    cap: float = 2.0
    _next: float = 0.0

    def delay(self) -> float:
        """The wait before the next try (s), growing each call."""
        d = self._next or self.base
        self._next = min(d * 2, self.cap)
        return d

    def reset(self) -> None:
        """Start again from ``base`` (after a success)."""
        self._next = 0.0


class Step(Enum):
    """What a registration task does next (:meth:`Keeper.next`)."""

    GRANT = "grant"          # ask etcd for a lease of ``ttl`` s
    PUT = "put"              # put the registration under the lease
    KEEPALIVE = "keepalive"  # renew the lease
    WAIT = "wait"            # nothing to do before ``at``


@dataclass(frozen=True)
class Action:
    """A :class:`Step` and when to take it (monotonic s)."""

    step: Step
    at: float  # when (monotonic s); for WAIT: when to ask again


class Keeper:
    """The registration lifecycle of one prefill rank in etcd (see the module doc).

    Feed it outcomes: :meth:`granted`, :meth:`put_done`, :meth:`renewed`,
    :meth:`lease_lost`, :meth:`failed`; ask :meth:`next` what to do. ``registered`` is
    True between a put under a live lease and the lease's (possible) expiry.
    """

    def __init__(self, ttl: float, backoff: Backoff | None = None) -> None:
        self.ttl = ttl
        self.backoff = backoff or Backoff(cap=max(0.1, ttl / 3))
        self.lease: int | None = None
        self.put_ok = False
        self.last_ok = 0.0      # last time etcd confirmed the lease alive
        self.retry_at = 0.0     # after a failure, not before this
        self.failures = 0

    @property
    def interval(self) -> float:
        """Renew period: a third of the TTL, so two renewals may fail before expiry."""
        return self.ttl / 3

    def registered(self, now: float) -> bool:
        """Is the registration (as far as this rank can tell) in etcd now?"""
        return self.lease is not None and self.put_ok and now < self.last_ok + self.ttl

    def next(self, now: float) -> Action:
        """The next step at ``now`` (monotonic s): renew every ``ttl / 3`` s; grant again
        once ``ttl`` s passed without a confirmation (etcd dropped the lease)."""
        if now < self.retry_at:
            return Action(Step.WAIT, self.retry_at)
        if self.lease is not None and now >= self.last_ok + self.ttl:
            self._restart()  # etcd has dropped it by now: renewing would only be refused
        if self.lease is None:
            return Action(Step.GRANT, now)
        if not self.put_ok:
            return Action(Step.PUT, now)
        due = self.last_ok + self.interval
        return Action(Step.KEEPALIVE, now) if now >= due else Action(Step.WAIT, due)

    def granted(self, lease: int, ttl: float, now: float) -> None:
        """etcd granted ``lease`` for ``ttl`` s (at least 1 s kept) at ``now``."""
        self.lease, self.put_ok, self.last_ok = lease, False, now
        self.ttl = max(ttl, 1.0)  # etcd may raise a TTL to its minimum
        self._ok()

    def put_done(self, now: float) -> None:
        """The registration was put under the lease at ``now`` (s)."""
        self.put_ok, self.last_ok = True, now
        self._ok()

    def renewed(self, now: float) -> None:
        """etcd confirmed the lease alive at ``now`` (s)."""
        self.last_ok = now
        self._ok()

    def lease_lost(self) -> None:
        """etcd answered that the lease does not exist (TTL 0): grant and put again."""
        self._restart()
        self._ok()

    def failed(self, now: float) -> float:
        """etcd did not answer (or refused): back off; returns the wait (s)."""
        self.failures += 1
        delay = self.backoff.delay()
        self.retry_at = now + delay
        return delay

    def _ok(self) -> None:
        self.failures, self.retry_at = 0, 0.0
        self.backoff.reset()

    def _restart(self) -> None:
        self.lease, self.put_ok = None, False


@dataclass
class Freshness:
    """How current a decode's view of etcd is. ``ttl``: how long after etcd was last
    reachable the view may still serve new lookups (``etcd_view_ttl``, s)."""

    ttl: float
    synced: bool = False          # a range has been read since start
    down_since: float | None = None
    last_error: str = ""

    def up(self) -> None:
        """etcd answered: the view is current."""
        self.synced, self.down_since, self.last_error = True, None, ""

    def down(self, now: float, error: str) -> None:
        """etcd did not answer at ``now`` (monotonic s; the first miss starts the
        ``ttl`` s the view may still serve); ``error``: why, for the failure reason."""
        if self.down_since is None:
            self.down_since = now
        self.last_error = error

    def stale(self, now: float) -> str | None:
        """Why the view may not be used now (None: it may)."""
        if self.down_since is None or now - self.down_since <= self.ttl:
            return None
        return (f"etcd unreachable for {now - self.down_since:.1f}s ({self.last_error}); the "
                f"last known view is used for etcd_view_ttl = {self.ttl:g}s only")
