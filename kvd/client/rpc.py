"""Blocking engine-side RPC client (stdlib + msgspec; safe to import in any engine)."""

from __future__ import annotations

import socket
import threading
from typing import Any

from kvd import errors
from kvd.errors import KvdUnreachable, ProtocolError, RpcError
from kvd.protocol import rpc


def _error_from_reply(reply: rpc.Reply) -> Exception:
    cls = getattr(errors, reply.kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.KvdError) and cls not in (
            errors.KVTransferError, errors.TransportError, errors.RpcError):
        return cls(reply.error)
    return RpcError(reply.error, reply.kind)


class KvdClient:
    """A connection to the local kvd's engine socket.

    Thread-safe (one call at a time). ``timeout`` bounds each call in seconds.
    ``fd`` memory handles (:class:`~kvd.protocol.memory.FdHandle`, e.g. from
    :class:`~kvd.client.FdPool`) name descriptors of this process; they are sent with
    the request (``SCM_RIGHTS``) and must stay open while registered.
    Raises :class:`KvdUnreachable` when kvd is not there (the next call
    reconnects), and the kvd error named by a failed reply otherwise. After a
    reconnect to a restarted kvd, the engine's last ``RegisterKV`` is sent again
    first, so the new daemon knows the engine's buffers.
    """

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        self.path = str(path)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._next_id = 0
        self._registration: rpc.RegisterKV | None = None
        self._replay = False
        self.reconnects = 0

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise KvdUnreachable(f"kvd unreachable at {self.path}: {exc.strerror or exc}",
                                     "KvdUnreachable") from exc
            self._sock = sock
        return self._sock

    def call(self, call: rpc.Call) -> Any:
        """Send one request and return its result."""
        with self._lock:
            if self._replay and self._registration is not None and \
                    not isinstance(call, rpc.RegisterKV):
                self._roundtrip(self._registration)
                self.reconnects += 1
                self._replay = False
            result = self._roundtrip(call)
            if isinstance(call, rpc.RegisterKV):
                self._registration, self._replay = call, False
            return result

    def _roundtrip(self, call: rpc.Call) -> Any:
        self._next_id += 1
        req_id = self._next_id
        try:
            sock = self._connect()
            wire_call, fds = rpc.number_fds(call)
            data = rpc.encode(rpc.Request(id=req_id, call=wire_call))
            if fds:  # descriptors ride with the request's first bytes (SCM_RIGHTS)
                sent = socket.send_fds(sock, [data], fds)
                sock.sendall(data[sent:])
            else:
                sock.sendall(data)
            reply = rpc.decode_reply(self._read_frame(sock))
        except OSError as exc:
            self._drop()
            raise KvdUnreachable(f"kvd unreachable at {self.path}: {exc}",
                                 "KvdUnreachable") from exc
        except ProtocolError:
            self._drop()
            raise
        if reply.id != req_id:
            raise ProtocolError(f"reply id {reply.id} does not match request {req_id}")
        if not reply.ok:
            raise _error_from_reply(reply)
        return reply.result

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._replay = self._registration is not None

    @staticmethod
    def _read_frame(sock: socket.socket) -> bytes:
        header = _recv_exact(sock, rpc.LENGTH.size)
        (length,) = rpc.LENGTH.unpack(header)
        return _recv_exact(sock, length)

    def close(self) -> None:
        """Close the connection (a later call reconnects and re-registers)."""
        with self._lock:
            self._drop()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("kvd closed the connection")
        buf += chunk
    return bytes(buf)
