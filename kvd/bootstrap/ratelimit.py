"""Token buckets for HTTP routes that anyone who reaches the port may call. PURE.

``POST /v1/rooms/release`` carries no cluster signature (the room's release token is
its authority, :mod:`kvd.protocol.release`), so its cost is bounded here: each request
takes one token from its source address's bucket (at most ``burst``, refilled at ``rate``
per second) and one from a bucket shared by every source (the backstop that bounds the
daemon's work whatever the number of addresses). One address spending its bucket never
makes another address's releases fail, so a stranger who reaches the port cannot starve
the proxy (:class:`SourceBuckets`). Time is passed in (monotonic seconds), so the rule is
tested without sleeping.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

#: Releases per second one source address may send (a proxy sends one per failed attempt).
RELEASE_RATE = 200.0
#: Releases one source may send at once above the rate.
RELEASE_BURST = 400
#: Releases per second (and burst) the daemon accepts from all sources together: the
#: backstop, five sources' worth.
RELEASE_SHARED_RATE = 1000.0
RELEASE_SHARED_BURST = 2000
#: Source addresses tracked at once (least recently seen evicted first: an evicted source
#: starts again with a full bucket, so eviction never starves anyone; the shared bucket
#: bounds what fresh buckets can buy). About 100 bytes each.
RELEASE_SOURCES = 4096


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; :meth:`take` spends one."""

    rate: float = RELEASE_RATE
    burst: int = RELEASE_BURST
    _tokens: float = field(default=-1.0, repr=False)
    _at: float = field(default=0.0, repr=False)

    def take(self, now: float) -> bool:
        """True if a token was available at ``now`` (s) and is now spent."""
        if not self.peek(now):
            return False
        self._tokens -= 1.0
        return True

    def peek(self, now: float) -> bool:
        """Refill up to ``now`` (s); is a token available? Spends nothing."""
        if self._tokens < 0:
            self._tokens, self._at = float(self.burst), now
        self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.rate)
        self._at = max(self._at, now)
        return self._tokens >= 1.0


@dataclass
class SourceBuckets:
    """One :class:`TokenBucket` per source address (``rate``/``burst`` each, at most
    ``sources`` addresses, least recently seen evicted) and one ``shared`` by all.
    :meth:`take` spends a token of both or of neither."""

    rate: float = RELEASE_RATE
    burst: int = RELEASE_BURST
    sources: int = RELEASE_SOURCES
    shared: TokenBucket = field(default_factory=lambda: TokenBucket(RELEASE_SHARED_RATE,
                                                                    RELEASE_SHARED_BURST))
    _by_source: OrderedDict[str, TokenBucket] = field(default_factory=OrderedDict, repr=False)

    def take(self, source: str, now: float) -> bool:
        """True if ``source`` (an address; ``""``: unknown, one bucket for all of those)
        and the shared bucket both had a token at ``now`` (s); both are then spent."""
        bucket = self._by_source.pop(source, None)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst)
            while len(self._by_source) >= self.sources:
                self._by_source.popitem(last=False)
        self._by_source[source] = bucket  # most recently seen last
        if not bucket.peek(now):
            return False
        if not self.shared.take(now):
            return False
        return bucket.take(now)

    def __len__(self) -> int:
        return len(self._by_source)
