"""The engine's end of its rings with kvd (issue 21 step B; stdlib + numpy + msgspec).

:class:`EngineRing` maps the memfd kvd handed over (:class:`~kvd.protocol.rpc.OpenRing`)
and produces room calls into the submission ring: a call is one record and a ``head``
bump, plus an ``eventfd`` write only when kvd said it sleeps -- no syscall while kvd is
draining. kvd publishes the submission ring's ``tail`` past a record once its call ran,
and writes a refused call's :class:`~kvd.protocol.rpc.Reply` (with the call's id) into the
completion ring before that, so "``tail`` passed my call and no refusal came" means the
call succeeded. Not thread-safe: :class:`~kvd.client.rpc.KvdClient` calls it under its
lock.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import time
from collections.abc import Callable

from kvd.errors import KvdError, ProtocolError
from kvd.protocol import codec, rpc
from kvd.protocol.ring import Consumer, Producer, Ring, fence


class RingClosed(Exception):
    """kvd stopped serving this ring (it failed it, or is shutting down): use the socket."""


class DaemonGone(Exception):
    """kvd's end of the engine socket closed while the engine waited on the ring."""


class EngineRing:
    """The engine's view of one :class:`~kvd.protocol.rpc.RingResult` and its three
    descriptors (``memfd``, ``wake_kvd``, ``wake_engine``; this object owns them from
    here on). ``sock_fd``: the engine socket, watched while waiting (kvd's death ends a
    wait at once). Raises ProtocolError if the rings do not check out (the caller falls
    back to the socket)."""

    def __init__(self, result: rpc.RingResult, fds: list[int], sock_fd: int) -> None:
        if len(fds) != 3:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise ProtocolError(f"kvd sent {len(fds)} descriptors with its rings, not 3")
        self.memfd, self.wake_kvd, self.wake_engine = fds
        self.sock_fd = sock_fd
        self.map: mmap.mmap | None = None
        try:
            if result.size % 2 or result.size <= 0 or result.size > rpc.MAX_RING_BYTES:
                raise ProtocolError(f"kvd's rings take {result.size} bytes")
            self.map = mmap.mmap(self.memfd, result.size)
            half = result.size // 2
            view = memoryview(self.map)
            self.sub, self.comp = Ring.open(view[:half]), Ring.open(view[half:])
            del view
            if (self.sub.capacity, self.sub.record_bytes) != (result.capacity,
                                                              result.record_bytes):
                raise ProtocolError("kvd's ring header does not match its answer")
        except (OSError, ValueError, ProtocolError) as exc:
            self.close()
            raise ProtocolError(f"kvd's rings: {exc}") from exc
        self.out, self.inbox = Producer(self.sub), Consumer(self.comp)
        self.max_payload = self.sub.max_payload
        #: call id -> room of calls not yet known done (their refusal may still come)
        self.inflight: dict[int, int] = {}
        #: refusals of calls nobody waited for: room -> the first one
        self.refused: dict[int, KvdError] = {}

    # ---- submitting --------------------------------------------------------------------

    def encode(self, call: rpc.RingCall) -> bytes | None:
        """The record of ``call`` as the next call id, or None if it is larger than a
        record (send it over the socket)."""
        data = codec.encode(rpc.Request(id=self.out.head, call=call))
        return data if len(data) <= self.max_payload else None

    def submit(self, data: bytes, room: int, timeout: float) -> int:
        """Publish the record ``data`` (from :meth:`encode`, just now); its call id. Waits
        up to ``timeout`` s for room in a full ring. Raises RingClosed, DaemonGone,
        TimeoutError, ProtocolError (a corrupt ring)."""
        self._check_open()
        while True:
            self.collect()
            seq = self.out.push(data)
            if seq is not None:
                break
            self._wait(lambda: self.out.free() > 0, timeout)
        self.inflight[seq] = room
        fence()  # head published before kvd's flag is read (kvd does the converse)
        if self.sub.sleeping:
            os.eventfd_write(self.wake_kvd, 1)
        return seq

    def done(self, seq: int) -> bool:
        """Whether kvd ran call ``seq`` (its refusal, if any, is in the completion ring)."""
        return self.sub.tail > seq

    def drained(self) -> bool:
        """Whether kvd ran every call submitted so far, or will run none of them any more
        (it closed the ring)."""
        return self.sub.tail >= self.out.head or self.sub.closed

    def wait_done(self, seq: int, timeout: float) -> None:
        """Block until kvd ran call ``seq`` (RingClosed, DaemonGone, TimeoutError)."""
        self._wait(lambda: self.done(seq), timeout)

    def result_of(self, seq: int) -> KvdError | None:
        """Call ``seq``'s refusal (taken), after :meth:`wait_done`; None: it succeeded."""
        return self.collect(seq)

    # ---- completions -------------------------------------------------------------------

    def collect(self, want: int = -1) -> KvdError | None:
        """Read every completion kvd wrote; a refusal of call ``want`` is returned, the
        others are kept by room in :attr:`refused`; calls known done leave
        :attr:`inflight`. ProtocolError for a corrupt completion ring."""
        tail = self.sub.tail  # before the completions: every refusal of a call before it
        found: KvdError | None = None
        took = 0
        while (payload := self.inbox.peek()) is not None:
            reply = rpc.decode_reply(payload, self.comp.record_bytes)
            self.inbox.done()
            took += 1
            room = self.inflight.pop(reply.id, None)
            if reply.ok or room is None:
                continue  # nothing to tell (kvd writes refusals of calls made here only)
            exc = rpc.error_from(reply.kind, reply.error)
            if reply.id == want:
                found = exc
            else:
                self.refused.setdefault(room, exc)
        if took and self.sub.sleeping and not self.drained():
            os.eventfd_write(self.wake_kvd, 1)  # kvd may have stopped at a full completion ring
        while self.inflight:
            first = next(iter(self.inflight))
            if first >= tail:
                break
            del self.inflight[first]
        return found

    # ---- waiting -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.sub.closed or self.comp.closed:
            raise RingClosed("kvd closed the engine ring")

    def _wait(self, ready: Callable[[], bool], timeout: float) -> None:
        """Block until ``ready()`` (kvd writes ``wake_engine`` when it sees the completion
        ring's ``sleeping`` set), kvd closes the ring, or kvd's socket end closes."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.wake_engine, select.POLLIN)
        poller.register(self.sock_fd, select.POLLIN)
        while True:
            self._check_open()
            if ready():
                return
            self.comp.sleeping = True  # then look again: kvd may have acted meanwhile
            fence()
            try:
                if ready():
                    return
                if self.sub.sleeping:
                    os.eventfd_write(self.wake_kvd, 1)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kvd ran no ring call within {timeout:g}s")
                for fd, _ in poller.poll(max(1, int(min(left, 1.0) * 1000))):
                    if fd == self.sock_fd:
                        raise DaemonGone("kvd closed the engine socket")
                    with contextlib.suppress(OSError):
                        os.eventfd_read(self.wake_engine)
            finally:
                self.comp.sleeping = False

    def close(self) -> None:
        """Close the descriptors and unmap the rings (once no view of them is alive: a
        thread still reading one reads memory nobody serves, never unmapped memory)."""
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view alive: the GC unmaps
                self.map.close()
            self.map = None
        for fd in (self.memfd, self.wake_kvd, self.wake_engine):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.memfd = self.wake_kvd = self.wake_engine = -1
