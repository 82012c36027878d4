"""A token bucket for HTTP routes that anyone who reaches the port may call. PURE.

``POST /v1/rooms/release`` carries no cluster signature (the room's release token is
its authority, :mod:`kvd.protocol.release`), so its cost is bounded here: each request
takes one token; the bucket holds at most ``burst`` and refills at ``rate`` per second.
Time is passed in (monotonic seconds), so the rule is tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Releases per second a daemon accepts (a proxy sends one per failed attempt).
RELEASE_RATE = 200.0
#: Releases accepted at once above the rate.
RELEASE_BURST = 400


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; :meth:`take` spends one."""

    rate: float = RELEASE_RATE
    burst: int = RELEASE_BURST
    _tokens: float = field(default=-1.0, repr=False)
    _at: float = field(default=0.0, repr=False)

    def take(self, now: float) -> bool:
        """True if a token was available at ``now`` (s) and is now spent."""
        if self._tokens < 0:
            self._tokens, self._at = float(self.burst), now
        self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.rate)
        self._at = max(self._at, now)
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
