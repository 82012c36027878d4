"""uvicorn embedded on the daemon's event loop (no thread, no second loop).

Connections are bounded here (case S04: tens of thousands of idle, half-sent
requests used up the daemon's file descriptors, so heartbeat probes failed and
new decodes could not bootstrap). uvicorn has no deadline for a request head
(its keep-alive timer starts only after a response and any byte cancels it), and
``limit_concurrency`` answers 503 only once a request is complete, so neither
bounds idle connections. :class:`GuardedH11Protocol` adds, per connection:

- a head deadline: a connection must deliver a complete request head within
  ``header_timeout`` seconds of opening or of its last response, else it is closed;
- admission by a :class:`ConnectionGuard` shared by every listener of the daemon:
  at most ``max_connections`` open connections, fewer when the process comes within
  ``fd_reserve`` descriptors of ``RLIMIT_NOFILE`` (the engine socket, the control
  plane, the transfer engine and outgoing requests keep those). At the limit, an
  idle connection (no request in progress) is closed to make room: first those that
  never completed a request, oldest first, then kept-alive ones, longest idle first;
  only when every connection is busy is the new one refused. An idle flood therefore
  never locks out a peer that sends a request at once, nor a peer's kept-alive
  connection (a heartbeat prober's) while the flood's half-sent requests are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvd.errors import ConfigError

log = logging.getLogger(__name__)

#: Largest request head (request line + headers), bytes; h11's own default too.
MAX_HEAD_BYTES = 16 << 10
#: Listen backlog. libuv accepts every pending connection in one go, so the backlog bounds
#: how long one accept burst holds the loop under a connection flood (~65 us each here):
#: with 512, /health p99 reached 0.5 s during an idle-connection flood, with 64-128 it
#: stayed near 25 ms. A newcomer that finds the backlog full retries its SYN (1 s).
ACCEPT_BACKLOG = 128
#: Receive buffer of HTTP connections (bytes); the largest body taken is 64 KiB.
RECV_BUFFER = 256 << 10


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6; port 0 picks one).

    Raises :class:`ConfigError` if it cannot bind (so the daemon exits, not waits).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Inherited by accepted connections: no request body kvd takes is near this, and it
    # caps what a client can push into the kernel before a refusal closes the connection.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind HTTP listener {host}:{port}: {exc.strerror}") from exc
    sock.listen(ACCEPT_BACKLOG)
    sock.setblocking(False)
    return sock


class Conn(Protocol):
    """What the guard needs of a connection."""

    def evict(self) -> None: ...


def open_fds() -> int | None:
    """Descriptors this process has open now (Linux ``/proc``; None elsewhere)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def nofile_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` (descriptors)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass
class HttpLimits:
    """Connection limits of the HTTP listeners (seconds, connections, descriptors)."""

    max_connections: int = 1024
    fd_reserve: int = 256
    header_timeout: float = 5.0


class ConnectionGuard:
    """Admission of HTTP connections across every listener of one daemon. PURE apart
    from ``fd_count``/``fd_limit`` (injected for tests), re-read at most every
    ``refresh_s`` seconds of ``clock``.

    Connections are tracked by state, each idle state in order of idleness, so that
    admission costs O(1) whatever the number of open connections (an O(n) scan per
    accept would itself slow accepting under a connection flood): ``fresh`` (open,
    no request yet), ``kept`` (kept alive after a response), and busy (a request in
    progress: never evicted). The protocol reports :meth:`started`/:meth:`finished`.
    """

    def __init__(self, limits: HttpLimits | None = None,
                 fd_count: Callable[[], int | None] = open_fds,
                 fd_limit: Callable[[], int] = nofile_limit,
                 clock: Callable[[], float] = time.monotonic, refresh_s: float = 0.5) -> None:
        self.limits = limits if limits is not None else HttpLimits()
        self.fd_count, self.fd_limit, self.clock = fd_count, fd_limit, clock
        self.refresh_s = refresh_s
        self._fresh: OrderedDict[Conn, None] = OrderedDict()
        self._kept: OrderedDict[Conn, None] = OrderedDict()
        self._busy: set[Conn] = set()
        self.evicted = 0
        self.refused = 0
        self._others = 0          # descriptors open that are not HTTP connections
        self._refreshed = -refresh_s * 2

    def __len__(self) -> int:
        return len(self._fresh) + len(self._kept) + len(self._busy)

    def capacity(self) -> int:
        """How many HTTP connections may be open now."""
        now = self.clock()
        if now - self._refreshed >= self.refresh_s:
            self._refreshed = now
            fds = self.fd_count()
            if fds is not None:
                self._others = max(0, fds - len(self))
        headroom = self.fd_limit() - self.limits.fd_reserve - self._others
        return max(0, min(self.limits.max_connections, headroom))

    def admit(self, conn: Conn) -> bool:
        """Make room for ``conn`` (evicting idle connections: never-served ones first,
        then the longest kept-alive) and add it; False if every open connection is busy
        and there is no room."""
        limit = self.capacity()
        while len(self) >= limit:
            idle = self._fresh or self._kept
            if not idle:
                self.refused += 1
                return False
            victim, _ = idle.popitem(last=False)
            victim.evict()
            self.evicted += 1
        self._fresh[conn] = None
        return True

    def started(self, conn: Conn) -> None:
        """A request head arrived on ``conn``: busy until :meth:`finished`."""
        if conn in self._fresh or conn in self._kept:
            self._fresh.pop(conn, None)
            self._kept.pop(conn, None)
            self._busy.add(conn)

    def finished(self, conn: Conn) -> None:
        """``conn`` answered its request and is kept alive: the newest idle one."""
        if conn in self._busy:
            self._busy.discard(conn)
            self._kept[conn] = None

    def release(self, conn: Conn) -> None:
        """``conn`` closed."""
        self._fresh.pop(conn, None)
        self._kept.pop(conn, None)
        self._busy.discard(conn)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with admission by a :class:`ConnectionGuard` and a
    deadline for each request head. Subclassed per server (:func:`protocol_for`)."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._cycle_seen: object = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.release(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_cycle()

    def on_response_complete(self) -> None:
        self.guard.finished(self)
        self._arm()
        super().on_response_complete()
        self._track_cycle()  # a pipelined request may have started just now

    def _track_cycle(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle is not self._cycle_seen and not cycle.response_complete:
            self._cycle_seen = cycle  # a request head is complete: no deadline now
            self._disarm()
            self.guard.started(self)

    def evict(self) -> None:
        """Close an idle connection to make room for a new one."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.guard.limits.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():
            self.transport.close()


def protocol_for(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``guard``."""
    return type("KvdH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class PerRequestWarnings(logging.Filter):
    """At most one of each uvicorn warning per ``interval_s`` seconds (uvicorn warns once
    per invalid or upgrade request, so a flood of them would otherwise flood the log);
    the next one that passes says how many were held back."""

    def __init__(self, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        key, now = str(record.msg), self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} ({held} more held back in {self.interval_s:g}s)"
        return True


def _limit_uvicorn_warnings() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, PerRequestWarnings) for f in logger.filters):
        logger.addFilter(PerRequestWarnings())


class _Server(uvicorn.Server):
    """uvicorn that leaves signal handling to the daemon's lifecycle."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """An ASGI app served by uvicorn as one task of the current loop; its connections
    are admitted by ``guard`` (a default one if None)."""

    def __init__(self, app: FastAPI, sock: socket.socket,
                 guard: ConnectionGuard | None = None) -> None:
        self.sock = sock
        self.guard = guard if guard is not None else ConnectionGuard()
        _limit_uvicorn_warnings()
        keep_alive = max(1, round(self.guard.limits.header_timeout))  # uvicorn takes int s
        # log_config=None: uvicorn's records go to kvd's handler (text or JSON), not to a
        # handler of its own that would put plain text lines into a JSON log
        config = uvicorn.Config(app, loop="none", lifespan="off", log_level="warning",
                                log_config=None, access_log=False, timeout_graceful_shutdown=2,
                                http=protocol_for(self.guard), timeout_keep_alive=keep_alive,
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES)
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.sock.getsockname()[1])

    async def start(self) -> None:
        """Start serving; returns once uvicorn has started."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]),
                                         name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Ask uvicorn to exit and wait for it."""
        self._server.should_exit = True
        if self._task is not None:
            await self._task
