"""The engine RPC server: an asyncio Unix-socket server on the daemon's loop.

The listening socket is either bound here (:class:`~kvd.engine_rpc.socket_path.SocketClaim`:
one daemon per path, a live socket is refused, only our own file is unlinked at stop) or
inherited from systemd socket activation (``kvd@.socket``, ``LISTEN_FDS``): then systemd
owns the path, its mode and its lifetime, and the engine's connections queue in the
backlog while kvd (re)starts.

Each connection carries length-prefixed frames (:mod:`kvd.protocol.rpc`).
Requests on one connection are answered in order. A connection has one reader
callback for its life (no ``add_reader``/``remove_reader`` per request); calls the
daemon can answer at once (``dispatch_now``: polls, engine room calls) are answered
from that callback with a plain non-blocking ``send``, without a task or a
coroutine; the others (``Wait``, registration) run as a task while the connection's
reading pauses, so answers stay in order. The server reads with
``socket.recvmsg`` (a plain ``recv``, or an asyncio stream, drops descriptors):
descriptors sent with ``SCM_RIGHTS`` belong to the request whose bytes carried them,
are handed to the call (``fd`` memory handles), and are closed after its reply.
More than :data:`~kvd.protocol.rpc.MAX_FDS` at once close the connection. A kvd error becomes a
failed :class:`~kvd.protocol.rpc.Reply` naming its class; a malformed frame
is answered with a ProtocolError reply and the connection keeps serving; a
frame over the size limit closes the connection (the stream cannot be
resynchronised).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import grp
import logging
import os
import pwd
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvd import notify
from kvd.engine_rpc.socket_path import SocketClaim
from kvd.errors import ConfigError, KvdError, ProtocolError
from kvd.logs import log_context, message_context
from kvd.protocol import rpc

log = logging.getLogger(__name__)

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_FD = array.array("i")


def _group_id(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError as exc:
        raise ConfigError(f"engine_socket_group {name!r} does not exist") from exc


def _supplementary_groups(uid: int) -> list[int]:
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return []
    return os.getgrouplist(user.pw_name, user.pw_gid)


def inherited_socket(path: Path) -> socket.socket | None:
    """The engine socket systemd passed (``kvd@.socket``), or None if none was passed.

    With several sockets, the one named ``engine`` (``FileDescriptorName=engine``) is
    used. Raises :class:`ConfigError` if it is not a listening Unix stream socket or
    is bound to another path than ``engine_socket``.
    """
    fds = notify.listen_fds()
    if not fds:
        return None
    fd = fds.get("engine", next(iter(fds.values())) if len(fds) == 1 else None)
    if fd is None:
        raise ConfigError(f"systemd passed {len(fds)} sockets ({', '.join(fds)}) and none is "
                          f"named 'engine': set FileDescriptorName=engine in kvd@.socket")
    sock = socket.socket(fileno=fd)
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        sock.detach()
        raise ConfigError("the socket systemd passed is not a listening Unix stream socket: "
                          "use ListenStream=/path in kvd@.socket")
    if sock.getsockname() != str(path):
        name = sock.getsockname()
        sock.detach()
        raise ConfigError(f"systemd passed the socket {name} but engine_socket is {path}: "
                          f"make ListenStream= and --engine-socket the same path")
    return sock


Dispatch = Callable[[rpc.Call, "Connection"], Awaitable[Any]]
#: ``dispatch_now(call, conn)``: the result at once, or :data:`LATER` for ``dispatch``.
DispatchNow = Callable[[rpc.Call, "Connection"], Any]
LATER = object()


class Connection:
    """One engine connection: the peer's ``pid``/``uid`` (``SO_PEERCRED``), the descriptors
    that came with the request being served (``fds``); ``on_close`` callbacks run when it
    drops."""

    def __init__(self, conn_id: int, pid: int = 0, uid: int | None = None) -> None:
        self.id = conn_id
        self.pid, self.uid = pid, uid
        self.fds: list[int] = []
        #: descriptors the reply being built carries (``SCM_RIGHTS``); the call keeps
        #: owning them (the kernel dups them into the engine)
        self.reply_fds: list[int] = []
        self.on_close: list[Callable[[], None]] = []


_ANC_SPACE = socket.CMSG_LEN(rpc.MAX_FDS * _FD.itemsize)


def _fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
    """Descriptors passed with SCM_RIGHTS in ``recvmsg`` ancillary data."""
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[:len(data) - len(data) % arr.itemsize])
            fds += arr
    return fds


class _Link:
    """One connection's reading, answering and writing, driven by one reader callback."""

    def __init__(self, server: EngineRpcServer, sock: socket.socket, conn: Connection) -> None:
        self.server, self.sock, self.conn = server, sock, conn
        self.loop = asyncio.get_running_loop()
        self.fd = sock.fileno()
        self.buf = bytearray()
        self.fds: list[int] = []
        self.busy = False  # a call or a write is being awaited: do not read ahead
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        while True:
            try:  # recvmsg itself: socket.recv_fds costs ~5 us more per call
                data, anc, flags, _ = self.sock.recvmsg(1 << 16, _ANC_SPACE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close()
                return
            if anc:
                self.fds += _fds_of(anc)
            if flags & socket.MSG_CTRUNC:
                log.warning("engine socket: more than %d descriptors in one request; closing",
                            rpc.MAX_FDS)
                self.close()
                return
            if not data:
                self.close()
                return
            self.buf += data
            if len(data) < 1 << 16:
                break
        self._process()

    def _process(self) -> None:
        """Answer every complete frame in the buffer (stops while a call is awaited)."""
        size = rpc.LENGTH.size
        while not self.busy and not self.closed.done() and len(self.buf) >= size:
            (length,) = rpc.LENGTH.unpack_from(self.buf)
            if length > self.server.max_frame:
                log.warning("engine frame of %d bytes over the limit; closing connection",
                            length)
                self.close()
                return
            if len(self.buf) < size + length:
                return
            frame = bytes(self.buf[size:size + length])
            del self.buf[:size + length]
            self.conn.fds, self.fds = self.fds, []
            reply = self.server.answer_now(frame, self.conn)
            if reply is None:  # needs the loop: run it as a task, reading paused
                self._later(frame)
                return
            self._done_with_fds()
            self._send(rpc.encode(reply), self._take_reply_fds())

    def _later(self, frame: bytes) -> None:
        self.busy = True
        self.loop.remove_reader(self.fd)
        self.task = self.loop.create_task(self._answer_later(frame))

    async def _answer_later(self, frame: bytes) -> None:
        try:
            reply = await self.server.answer(frame, self.conn)
        finally:
            self._done_with_fds()
        await self._write_all(rpc.encode(reply))
        self._resume()

    def _take_reply_fds(self) -> list[int]:
        fds, self.conn.reply_fds = self.conn.reply_fds, []
        return fds

    def _send(self, data: bytes, fds: list[int] | None = None) -> None:
        try:  # descriptors ride with the reply's first bytes
            sent = socket.send_fds(self.sock, [data], fds) if fds else self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):  # the socket is full: finish it on the loop, reading paused
            self.busy = True
            self.loop.remove_reader(self.fd)
            self.task = self.loop.create_task(self._finish_write(data[sent:]))

    async def _finish_write(self, rest: bytes) -> None:
        await self._write_all(rest)
        self._resume()

    async def _write_all(self, data: bytes) -> None:
        try:
            await self.loop.sock_sendall(self.sock, data)
        except OSError:
            self.close()

    def _resume(self) -> None:
        self.busy, self.task = False, None
        if self.closed.done():
            return
        self.loop.add_reader(self.fd, self._readable)
        self._process()

    def _done_with_fds(self) -> None:
        for fd in self.conn.fds:  # the call dup'ed what it keeps
            with contextlib.suppress(OSError):
                os.close(fd)
        self.conn.fds = []

    def close(self) -> None:
        if self.closed.done():
            return
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.fd)
        self.closed.set_result(None)

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self._done_with_fds()


class EngineRpcServer:
    """Serves ``dispatch(call, connection)`` on ``path``.

    The socket is mode 0600 (owner only), or 0660 owned by ``group`` when one is
    given. Each connection's peer credentials (``SO_PEERCRED``) are checked too:
    only this daemon's user, root, or members of ``group`` are served; others are
    disconnected at once and counted in ``refused``.
    """

    def __init__(self, path: Path, dispatch: Dispatch, max_frame: int,
                 group: str | None = None, dispatch_now: DispatchNow | None = None) -> None:
        self.path = path
        self.dispatch = dispatch
        self.dispatch_now = dispatch_now
        self.max_frame = max_frame
        self.gid = _group_id(group) if group else None
        self.refused = 0
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._claim: SocketClaim | None = None
        self._next_id = 0
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Take the socket (inherited from systemd, or bound here) and start accepting.

        Raises :class:`ConfigError` (one line with the fix) if the path cannot be used:
        its folder cannot be created or written, another kvd serves it, a file that is
        not a socket is in the way, or an inherited socket does not match the settings.
        """
        sock = inherited_socket(self.path)
        if sock is None:
            self._claim = SocketClaim(self.path)
            sock = self._claim.bind(gid=self.gid)
        sock.setblocking(False)
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept_loop(sock), name="engine-rpc-accept")

    async def stop(self) -> None:
        """Stop accepting, close connections, unlink the socket if this daemon made it."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._claim is not None:
            self._claim.release()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and friends: keep serving the others
                log.warning("engine socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            task = asyncio.create_task(self._serve(sock), name="engine-rpc-conn")
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, sock: socket.socket) -> None:
        creds = self._peer_creds(sock)
        if creds is None:
            self.refused += 1
            sock.close()
            return
        self._next_id += 1
        conn = Connection(self._next_id, pid=creds[0], uid=creds[1])
        link = _Link(self, sock, conn)
        try:
            link.start()
            await link.closed
        finally:
            link.close()
            if link.task is not None and not link.task.done():
                link.task.cancel()
                await asyncio.gather(link.task, return_exceptions=True)
            link.close_fds()
            for cb in conn.on_close:
                try:
                    cb()
                except Exception:
                    log.exception("engine connection close callback failed")
            sock.close()

    def _peer_creds(self, sock: socket.socket) -> tuple[int, int] | None:
        """(pid, uid) of an allowed peer; None (logged) for anyone else."""
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
        except OSError:
            return None
        pid, uid, gid = _CREDS.unpack(creds)
        if uid in (0, os.getuid()) or (self.gid is not None and gid == self.gid):
            return pid, uid
        if self.gid is not None and self.gid in _supplementary_groups(uid):
            return pid, uid
        log.warning("engine socket: refused connection from pid %d uid %d", pid, uid)
        return None

    def answer_now(self, frame: bytes, conn: Connection) -> rpc.Reply | None:
        """The reply to ``frame`` if the daemon answers it at once; None: use :meth:`answer`."""
        try:
            req = rpc.decode_request(frame, self.max_frame)
        except ProtocolError as exc:
            log.warning("malformed engine frame: %s", exc)
            return rpc.Reply(id=0, ok=False, error=str(exc), kind="ProtocolError")
        if self.dispatch_now is None:
            return None
        try:
            rpc.check_fd_indices(req.call, len(conn.fds))
            context = message_context(req.call)  # as in answer(); a poll has none
            if context:
                with log_context(**context):
                    result = self.dispatch_now(req.call, conn)
            else:
                result = self.dispatch_now(req.call, conn)
        except Exception as exc:
            return _failed(req, exc)
        if result is LATER:
            return None
        return rpc.Reply(id=req.id, ok=True, result=result)

    async def answer(self, frame: bytes, conn: Connection) -> rpc.Reply:
        """The reply to ``frame``, awaiting the daemon's ``dispatch``."""
        try:
            req = rpc.decode_request(frame, self.max_frame)
        except ProtocolError as exc:
            log.warning("malformed engine frame: %s", exc)
            return rpc.Reply(id=0, ok=False, error=str(exc), kind="ProtocolError")
        try:
            rpc.check_fd_indices(req.call, len(conn.fds))
            # the call's room (and a receiver's bootstrap address) label every line logged
            # while it runs, and every task it starts
            with log_context(**message_context(req.call)):
                result = await self.dispatch(req.call, conn)
        except Exception as exc:
            return _failed(req, exc)
        return rpc.Reply(id=req.id, ok=True, result=result)


def _failed(req: rpc.Request, exc: Exception) -> rpc.Reply:
    """The reply to engine call ``req`` that raised ``exc``: its kind from the error
    table for a :class:`KvdError`, ``InternalError`` (logged with its traceback) for
    anything else."""
    if not isinstance(exc, KvdError):
        log.exception("engine call %s failed", type(req.call).__name__)
    kind, error = rpc.failure(exc)
    return rpc.Reply(id=req.id, ok=False, error=error, kind=kind)
