"""kvd's front for the transfer engine's P2P handshake port (case S05).

Why: Mooncake's handshake daemon is ONE thread that accepts and serves connections one
after another, each with a 5 s receive timeout, and the Python binding opens a new
peer's segment (a handshake) while holding its engine-wide mutex. So a few idle TCP
connections to a decode's handshake port delay the first transfer of every prefill to
that decode by 5 s each, and meanwhile every other transfer of those prefills waits on
the mutex (docs/transfer.md, "S05", measured with ``benchmarks/handshake_idle.py``).

What: the advertised handshake address ``host:port`` is a socket of kvd's, served by
an asyncio loop on its own thread (idle connections cost a file descriptor, no
thread). Mooncake's own handshake listener is pinned to a loopback address on the same
port (:func:`reserve`, through :mod:`.bindaddr`). For each connection the front reads
ONE complete request frame within ``request_deadline_s``, relays it to Mooncake's
listener, reads the answer frame and hands it back. Mooncake's thread therefore only
ever sees complete requests from kvd, served in microseconds; an idle, slow or
malformed connection is closed by the front without reaching it.

Frame (Mooncake's ``writeString``/``readString``, ``include/common.h``): a u64 length
in host byte order, then ``length`` bytes (a request-type byte, then JSON);
``0 < length <= max`` with max from ``MC_HANDSHAKE_MAX_LENGTH`` (1 MiB to 128 MiB,
default 1 MiB), the limit Mooncake itself enforces.

Bounds: at most ``max_pending`` connections that have not yet delivered a request
(the oldest is closed to admit a new one), at most ``request_bytes`` bytes of requests
being read or relayed at once (a request's announced length counts from its header on;
when a new one does not fit, the oldest incomplete requests are closed to make room, so
connections that announce large requests and send nothing cannot lock out the complete
requests of real peers), at most ``relays`` relays to Mooncake at a time; connections
are accepted a few per pass of the loop, the kernel queues the rest (``BACKLOG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

HEADER = struct.Struct("=Q")  # Mooncake writes the length as a native uint64_t
MIN_MAX_FRAME, MAX_MAX_FRAME = 1 << 20, 128 << 20  # MC_HANDSHAKE_MAX_LENGTH's range
#: Connections the kernel completes while the front's thread is busy (a burst beyond it:
#: new SYNs are dropped and a real peer's connect waits for its retransmission, 1 s+).
BACKLOG = 1024


def max_frame() -> int:
    """The largest frame Mooncake accepts, in bytes: ``MC_HANDSHAKE_MAX_LENGTH`` when it
    is an integer within 1 MiB..128 MiB, else 1 MiB (the engine's own rule)."""
    raw = os.environ.get("MC_HANDSHAKE_MAX_LENGTH", "")
    value = int(raw) if raw.isdigit() else 0
    return value if MIN_MAX_FRAME <= value <= MAX_MAX_FRAME else MIN_MAX_FRAME


def backend_host(front_host: str) -> str:
    """The loopback address Mooncake's handshake listener binds behind a front on
    ``front_host``: 127.0.0.1, or 127.0.0.2 when the front itself is on 127.0.0.1
    (every 127/8 address is local on Linux)."""
    return "127.0.0.2" if front_host == "127.0.0.1" else "127.0.0.1"


@dataclass(frozen=True)
class FrontLimits:
    """Bounds of the handshake front. Seconds: ``request_deadline_s`` for a connection
    to deliver its complete request (Mooncake's clients send it at once after connecting),
    ``answer_deadline_s`` for Mooncake to answer a relayed one (its clients wait 60 s);
    ``max_pending`` connections without a complete request; ``request_bytes`` bytes of
    requests being read at once; ``relays`` relays to Mooncake at a time."""

    request_deadline_s: float = 1.0
    answer_deadline_s: float = 30.0
    max_pending: int = 256
    request_bytes: int = 64 << 20
    relays: int = 8


class FrameError(ValueError):
    """A frame whose length is 0 or above the limit."""


async def read_frame(reader: asyncio.StreamReader, limit: int,
                     reserve: Callable[[int], bool] | None = None) -> bytes:
    """One handshake frame (header included). Raises :class:`FrameError` for a length
    of 0, above ``limit``, or refused by ``reserve(length)``;
    ``asyncio.IncompleteReadError`` if the peer closes first."""
    header = await reader.readexactly(HEADER.size)
    (length,) = HEADER.unpack(header)
    if not 0 < length <= limit:
        raise FrameError(f"frame length {length} outside 1..{limit}")
    if reserve is not None and not reserve(length):
        raise FrameError(f"frame of {length} bytes over the front's request budget")
    return header + await reader.readexactly(length)


class HandshakeFront:
    """Serves the advertised handshake socket ``sock`` (bound) and relays
    complete requests to Mooncake's listener at ``backend`` (host, port).

    :meth:`start` starts the thread and returns once it listens; :meth:`close` stops it.
    ``counts``: connections by outcome (relayed, idle, malformed, evicted, unanswered),
    written by the front's thread only."""

    def __init__(self, sock: socket.socket, backend: tuple[str, int],
                 limits: FrontLimits | None = None) -> None:
        self.sock = sock
        self.backend = backend
        self.limits = limits or FrontLimits()
        self.max_frame = max_frame()
        self.counts: Counter[str] = Counter()
        self._pending: dict[asyncio.StreamWriter, None] = {}  # insertion order = age
        self._held: dict[asyncio.StreamWriter, int] = {}  # request bytes per connection
        self._reading = 0  # sum of _held: bytes of requests being read or relayed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> None:
        self.sock.listen(BACKLOG)
        self.sock.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="kvd-handshake-front",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(10.0):
            raise RuntimeError("the handshake front did not start within 10 s")

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket (connections in progress are dropped)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._relays = asyncio.Semaphore(self.limits.relays)
        # asyncio's backlog is listen()'s AND how many connections it accepts per pass of
        # the loop: a few, so that a burst is admitted in steps and a peer's request, read
        # on the next passes, is not evicted unread by max_pending newer admissions (under
        # a connection flood every real handshake failed so); then the kernel's queue
        batch = max(1, min(64, self.limits.max_pending // 4))
        server = await asyncio.start_server(self._serve, sock=self.sock, backlog=batch)
        self.sock.listen(BACKLOG)
        self._started.set()
        async with server:
            await self._stop.wait()
            server.close()
            for writer in list(self._pending):
                writer.transport.abort()
            # and those being relayed or answered (else their tasks are destroyed pending,
            # and from Python 3.12 the server's exit waits for every connection to end)
            serving = asyncio.all_tasks() - {asyncio.current_task()}
            for task in serving:
                task.cancel()
            await asyncio.gather(*serving, return_exceptions=True)

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        while len(self._pending) >= self.limits.max_pending:
            self._evict(next(iter(self._pending)))
        self._pending[writer] = None

    def _evict(self, writer: asyncio.StreamWriter) -> None:
        del self._pending[writer]
        self._release(writer)
        self.counts["evicted"] += 1
        writer.transport.abort()

    def _reserve(self, writer: asyncio.StreamWriter, length: int) -> bool:
        """Count ``length`` request bytes for ``writer``, closing the oldest incomplete
        requests that hold bytes while it does not fit; False if it still does not (the
        bytes are held by requests already complete, being relayed)."""
        budget = self.limits.request_bytes
        if length > budget:
            return False
        for old in [w for w in self._pending if w is not writer and w in self._held]:
            if self._reading + length <= budget:
                break
            self._evict(old)
        if self._reading + length > budget:
            return False
        self._held[writer] = length
        self._reading += length
        return True

    def _release(self, writer: asyncio.StreamWriter) -> None:
        self._reading -= self._held.pop(writer, 0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._admit(writer)
        outcome = "relayed"
        try:
            try:
                async with asyncio.timeout(self.limits.request_deadline_s):
                    request = await read_frame(reader, self.max_frame,
                                               lambda n: self._reserve(writer, n))
            except FrameError:
                outcome = "malformed"
                return
            except (TimeoutError, asyncio.IncompleteReadError, OSError):
                outcome = "evicted" if writer not in self._pending else "idle"
                return
            finally:
                self._pending.pop(writer, None)
            try:
                async with asyncio.timeout(self.limits.answer_deadline_s):
                    answer = await self._relay(request)
            except asyncio.IncompleteReadError:  # closed unanswered: it refused the request
                outcome = "unanswered"  # (not JSON, unknown type: anyone can send those)
                return
            except (TimeoutError, FrameError, OSError) as exc:
                outcome = "unanswered"
                log.warning("handshake front: relaying a request to the transfer engine's "
                            "listener %s:%d failed: %r", *self.backend, exc)
                return
            self._release(writer)
            try:
                async with asyncio.timeout(self.limits.answer_deadline_s):
                    writer.write(answer)
                    await writer.drain()
            except (TimeoutError, OSError):  # the peer's own doing: not the listener's
                writer.transport.abort()
        finally:
            self._release(writer)
            if outcome != "evicted":  # an evicted one was counted when it was closed
                self.counts[outcome] += 1
            writer.transport.abort() if outcome != "relayed" else writer.close()

    async def _relay(self, request: bytes) -> bytes:
        async with self._relays:
            reader, writer = await asyncio.open_connection(*self.backend)
            try:
                writer.write(request)
                await writer.drain()
                return await read_frame(reader, self.max_frame)
            finally:
                writer.close()


class Reservation:
    """A bind policy for :func:`kvd.transfer.backends.bindaddr.pinned_binds` that puts a
    front before the engine's handshake listener.

    The engine's FIRST wildcard bind is its handshake listener (``TransferEngineImpl::init``
    finds the RPC port before any transport starts): for it, ``front_host:port`` is bound
    here first (a refusal makes the engine try another port, as for any port in use),
    then the engine's socket binds ``backend:port``. Every later wildcard bind goes to
    ``bind_host``. The caller checks afterwards that :attr:`port` is the engine's RPC
    port (:meth:`check`), so a change in that order is an error, not a silent exposure."""

    def __init__(self, front_host: str, bind_host: str) -> None:
        self.front_host = front_host
        self.bind_host = bind_host
        self.backend = backend_host(front_host)
        self.sock: socket.socket | None = None

    @property
    def port(self) -> int | None:
        return int(self.sock.getsockname()[1]) if self.sock is not None else None

    def __call__(self, port: int, bind_to: Callable[[str], int]) -> int:
        if self.sock is not None:
            return bind_to(self.bind_host)
        front = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        front.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            front.bind((self.front_host, port))
        except OSError as exc:
            front.close()
            return -(exc.errno or errno.EADDRINUSE)
        rc = bind_to(self.backend)
        if rc != 0:
            front.close()
            return rc
        # listening now holds the address: a bound socket that does not listen yet lets
        # any other SO_REUSEADDR socket (asyncio servers set it) bind and listen on it
        # too, and the front's own listen() would then fail; connections wait in the
        # kernel's queue until the front serves them
        front.listen(BACKLOG)
        self.sock = front
        return 0

    def check(self, rpc_port: int) -> str | None:
        """None if the front holds the engine's handshake port ``rpc_port``; else why not."""
        if self.port == rpc_port:
            return None
        return (f"the transfer engine's handshake listener took port {rpc_port} but the "
                f"front reserved {self.port}: this Mooncake build binds in another order")

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
