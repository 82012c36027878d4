"""uvicorn embedded on the daemon's event loop (no thread, no second loop)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from kvd.errors import ConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6; port 0 picks one).

    Raises :class:`ConfigError` if it cannot bind (so the daemon exits, not waits).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind HTTP listener {host}:{port}: {exc.strerror}") from exc
    sock.listen(512)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn that leaves signal handling to the daemon's lifecycle."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """An ASGI app served by uvicorn as one task of the current loop."""

    def __init__(self, app: FastAPI, sock: socket.socket) -> None:
        self.sock = sock
        # log_config=None: uvicorn's records go to kvd's handler (text or JSON), not to a
        # handler of its own that would put plain text lines into a JSON log
        config = uvicorn.Config(app, loop="none", lifespan="off", log_level="warning",
                                log_config=None, access_log=False, timeout_graceful_shutdown=2)
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
