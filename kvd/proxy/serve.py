"""Serving the proxy app: the daemon's HTTP server with the proxy's limits (case S20).

The listener is the daemon's (:mod:`kvd.bootstrap.server`): a bounded accept backlog
and receive buffer; per connection a deadline for each request head
(``header_timeout`` s from opening or from the last response, then closed); admission
by a :class:`~kvd.bootstrap.server.ConnectionGuard` (at most ``max_connections`` open,
fewer near ``RLIMIT_NOFILE``: idle connections are closed to make room, never-served
ones first, and a newcomer is refused at once only when every connection is busy --
nothing waits in a queue). A request whose head arrived is bounded by the body
deadline of :class:`kvd.proxy.guard.ProxyGuard`, then by the engines' ``timeout``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from fastapi import FastAPI

from kvd.bootstrap.guard import is_loopback
from kvd.bootstrap.server import ConnectionGuard, HttpLimits, HttpServer, bind_socket
from kvd.proxy.app import ProxyConfig, make_app


def limits_of(config: ProxyConfig) -> HttpLimits:
    """The connection limits of ``config`` (descriptors in reserve: the daemon's)."""
    return HttpLimits(max_connections=config.max_connections,
                      header_timeout=config.header_timeout)


def app_for(config: ProxyConfig, host: str) -> FastAPI:
    """The app serving ``config`` on ``host`` (Host headers checked on loopback). Raises
    :class:`kvd.errors.ConfigError` if the token file is refused."""
    return make_app(config, loopback=is_loopback(host))


async def serve(config: ProxyConfig, host: str, port: int,
                ready: Callable[[int], None] | None = None,
                stop: asyncio.Event | None = None,
                guard: ConnectionGuard | None = None, app: FastAPI | None = None) -> None:
    """Serve the proxy on ``host:port`` until ``stop`` is set (default: until SIGINT or
    SIGTERM); ``ready`` is called with the bound port once it accepts; ``guard`` admits
    connections (default: one with :func:`limits_of` ``config``); ``app`` is
    :func:`app_for` ``config`` unless given. Raises :class:`kvd.errors.ConfigError` if the
    port cannot be bound or the token file is refused (before anything is served)."""
    app = app if app is not None else app_for(config, host)
    sock = bind_socket(host, port)
    server = HttpServer(app, sock, guard if guard is not None else
                        ConnectionGuard(limits_of(config)))
    loop = asyncio.get_running_loop()
    signals: tuple[signal.Signals, ...] = ()
    if stop is None:
        stop, signals = asyncio.Event(), (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        async with app.router.lifespan_context(app):
            await server.start()
            if ready is not None:
                ready(server.port)
            await stop.wait()
            await server.stop()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        sock.close()
