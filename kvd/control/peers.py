"""ZMQ control sockets: one PULL socket bound by each daemon, one PUSH per peer.

All sockets are ``zmq.asyncio`` sockets owned by the daemon's loop. Sends are
bounded: a high-water mark, ``linger=0`` and a send timeout, so a dead or
frozen peer costs at most ``send_timeout`` seconds per message and never
blocks the loop.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from kvd.addr import format_host
from kvd.errors import KvdError, PeerUnreachable

log = logging.getLogger(__name__)


PeerSendError = PeerUnreachable  # the name this module's callers use


class ControlPlane:
    """The daemon's control sockets.

    ``bind(host, port)`` opens the PULL socket (port 0 picks a free one);
    ``send(endpoint, frame)`` pushes a frame to a peer's PULL socket;
    ``recv()`` returns the next inbound frame (bytes).
    """

    def __init__(self, send_timeout: float = 5.0, hwm: int = 10000,
                 max_frame: int = 64 << 20) -> None:
        self.ctx = zmq.asyncio.Context()
        self.send_timeout = send_timeout
        self.hwm = hwm
        self.max_frame = max_frame
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self.endpoint = ""

    def bind(self, host: str, port: int) -> str:
        """Bind the inbound socket; returns its ``tcp://host:port`` endpoint."""
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame + 64)  # + the auth seal
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        addr = f"tcp://{format_host(host)}"
        try:
            if port:
                sock.bind(f"{addr}:{port}")
            else:
                port = sock.bind_to_random_port(addr)
        except zmq.ZMQError as exc:
            sock.close()
            raise KvdError(f"cannot bind control socket {addr}:{port}: {exc}") from exc
        self._pull = sock
        self.endpoint = f"{addr}:{port}"
        return self.endpoint

    async def recv(self) -> bytes:
        """Next inbound frame."""
        assert self._pull is not None, "bind() first"
        return bytes(await self._pull.recv())

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if "[" in endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        return sock

    async def send(self, endpoint: str, frame: bytes) -> None:
        """Push ``frame`` to ``endpoint``; raises :class:`PeerSendError` after the timeout."""
        sock = self._socket(endpoint)
        try:
            await asyncio.wait_for(sock.send(frame, copy=False), self.send_timeout)
        except (TimeoutError, zmq.ZMQError) as exc:
            self.drop(endpoint)
            raise PeerSendError(f"control send to {endpoint} failed: "
                                f"{exc or f'timed out after {self.send_timeout:.1f}s'}") from exc

    def drop(self, endpoint: str) -> None:
        """Close the socket to ``endpoint`` (it is re-created on the next send)."""
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        """Close every socket and the context."""
        for ep in list(self._push):
            self.drop(ep)
        if self._pull is not None:
            self._pull.close(linger=0)
        self.ctx.term()
