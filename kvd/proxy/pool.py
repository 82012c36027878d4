"""The servers of one role, their health and load. PURE (no I/O; the app probes).

Choice: least outstanding requests among the healthy servers, ties broken round-robin
(so equal servers share the load), avoiding servers an earlier attempt of the same
request used (unless every server was: a retry may then go to the same one). A
server is unhealthy after ``max_failures`` failed probes or requests in a row, and
healthy again after one good probe. When no server is healthy the least-failed one is
tried anyway (better an attempt than a certain 503).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


class NoServer(LookupError):
    """No server of a role can take the request."""


@dataclass
class Server:
    """One OpenAI-compatible server (``url`` without a trailing slash)."""

    url: str
    outstanding: int = 0
    failures: int = 0          # consecutive failed probes or requests
    healthy: bool = True
    served: int = 0


@dataclass
class Pool:
    """The servers of one role (``"prefill"`` or ``"decode"``)."""

    role: str
    servers: list[Server]
    max_failures: int = 2
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @staticmethod
    def of(role: str, urls: list[str], max_failures: int = 2) -> Pool:
        if not urls:
            raise ValueError(f"no {role} server given")
        return Pool(role, [Server(u.rstrip("/")) for u in urls], max_failures)

    def choose(self, exclude: set[str] | frozenset[str] = frozenset()) -> Server:
        """The server for the next request (see the module docstring). NoServer when the
        pool is empty."""
        candidates = [s for s in self.servers if s.url not in exclude] or self.servers
        if not candidates:
            raise NoServer(f"no {self.role} server")
        healthy = [s for s in candidates if s.healthy] or sorted(
            candidates, key=lambda s: s.failures)[:1]
        low = min(s.outstanding for s in healthy)
        best = [s for s in healthy if s.outstanding == low]
        return best[next(self._turn) % len(best)]

    def ok(self, server: Server) -> None:
        """A request or probe succeeded."""
        server.failures, server.healthy = 0, True

    def failed(self, server: Server) -> None:
        """A request or probe failed (the server did not answer, or answered 5xx)."""
        server.failures += 1
        if server.failures >= self.max_failures:
            server.healthy = False
