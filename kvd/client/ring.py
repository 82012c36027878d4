"""The engine's end of its rings with kvd (issue 21 step B; stdlib + numpy + msgspec).

:class:`EngineRing` maps the memfd kvd handed over (:class:`~kvd.protocol.rpc.OpenRing`)
and produces room calls into the submission ring: a call is one record and a ``head``
bump, plus an ``eventfd`` write only when kvd said it sleeps -- no syscall while kvd is
draining. kvd publishes the submission ring's ``tail`` past a record once its call ran,
and writes a refused call's :class:`~kvd.protocol.rpc.Reply` (with the call's id) into the
completion ring before that, so "``tail`` passed my call and no refusal came" means the
call succeeded.

A *handle* is a room's calls made through one object (:class:`~kvd.client.rooms.Sender`,
:class:`~kvd.client.rooms.Receiver`) whose create was not waited for: its key is the
create's call id. While the create has not run, each later call of the handle depends on
it (the record's ``after``): kvd runs it only if the create was not refused, so a refused
create's calls never act on another incarnation of the room. Refusals of a handle's keyed
calls are kept by key (:attr:`failed`), not by room, so another handle on the same room
(the live incarnation a duplicate create was refused for) never reads them. Not
thread-safe: :class:`~kvd.client.rpc.KvdClient` calls it under its ring lock (not the
socket's: a record never waits for another thread's socket call).

Unread completions plus unrun records never exceed ``capacity``: a record is published
only after the completions kvd wrote were read and while the records kvd had not run
then left a free slot (:meth:`EngineRing.submit`); a record kvd runs writes at most one
completion. So kvd's catch-up before a socket call (which cannot wait for the engine to
read a completion) never meets a full completion ring, whichever thread is in the socket
call and whatever another thread publishes meanwhile.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import time
from collections.abc import Callable

from kvd.errors import KvdError, KvdUnreachable, ProtocolError
from kvd.protocol import codec, rpc
from kvd.protocol.ring import Consumer, Producer, Ring, fence

#: :meth:`EngineRing.submit`'s ``key`` for a create that opens a handle.
NEW = -1


class Handle:
    """A handle's key (its create's call id) in the ring it went through."""

    __slots__ = ("key", "ring")

    def __init__(self, ring: EngineRing, key: int) -> None:
        self.ring, self.key = ring, key


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
        #: call id -> room of calls not yet known run, in call-id order (their refusal may
        #: still come); a call leaves once ``tail`` passed it, so every record kvd has not
        #: run is here (:meth:`unrun_rooms`)
        self.inflight: dict[int, int] = {}
        #: refusals of calls nobody waited for: room -> the first one
        self.refused: dict[int, KvdError] = {}
        #: call id -> handle key, for calls of a handle not yet known done
        self.owner: dict[int, int] = {}
        #: handle key -> the first refusal of the handle's keyed calls
        self.failed: dict[int, KvdError] = {}
        #: the last record whose publication wrote ``wake_kvd``. While kvd has not run it,
        #: kvd is woken already and runs every record published before its drain ends:
        #: it consumes that record, then sets ``sleeping`` and reads ``head`` again (a
        #: fence between), while the engine publishes ``head`` and then reads ``tail`` (a
        #: fence between), so one of them sees the other's word. No second write.
        self.woke = -1
        self._prune_at = self.sub.capacity
        #: handle key -> its last keyed call's id
        self.last: dict[int, int] = {}
        #: handle keys whose create itself was refused
        self.unborn: set[int] = set()
        #: call id -> room of Clears nobody waited for, not yet known run
        self.clearing: dict[int, int] = {}
        #: rooms whose unwaited Clear kvd ran and did not refuse (their kept refusals
        #: went from :attr:`refused`; the client drops what else it keeps for them)
        self.cleared: list[int] = []

    # ---- submitting --------------------------------------------------------------------

    def encode(self, call: rpc.RingCall) -> bytes | None:
        """The record of ``call`` as the next call id, or None if it is larger than a
        record (send it over the socket)."""
        data = codec.encode(rpc.Request(id=self.out.head, call=call))
        return data if len(data) <= self.max_payload else None

    def submit(self, data: bytes, room: int, timeout: float, key: int | None = None) -> int:
        """Publish the record ``data`` (from :meth:`encode`, just now); its call id. Waits
        up to ``timeout`` s for room in a full ring. ``key``: None, a call of no handle;
        :data:`NEW`, a create that opens a handle (its key is its own call id); a handle's
        key, a later call of that handle (it depends on the create while the create has
        not run). Raises the create's refusal (a KvdError, nothing published) when kvd
        refused the handle's create; RingClosed,
        DaemonGone, TimeoutError, ProtocolError (a corrupt ring). Publishes only if a slot
        was free BEFORE the completions were read: unread completions plus unrun records
        then stay within ``capacity`` (the module's rule; a slot freed only after the
        read waits for the next turn of the loop)."""
        self._check_open()
        while True:
            after = 0
            free = self.out.free()  # before the completions: the unrun records then
            if key is not None and key >= 0:
                create_ran = self.sub.tail > key  # read before the completions
                self.collect_new()
                if key in self.unborn:
                    raise self.failed[key]
                after = 0 if create_ran else self.out.head - key  # in the ring: <= capacity
            else:
                self.collect_new()
            seq = self.out.push(data, after) if free else None
            if seq is not None:
                break
            self._wait(lambda: self.out.free() > 0, timeout)
        self.inflight[seq] = room
        if key is not None and (key >= 0 or key == NEW):
            key = seq if key == NEW else key
            self.owner[seq] = key
            self.last[key] = seq
        fence()  # head published before kvd's words are read (kvd does the converse)
        if self.sub.sleeping and self.sub.tail > self.woke:
            os.eventfd_write(self.wake_kvd, 1)
            self.woke = seq
        return seq

    def handle(self, key: int) -> tuple[bool, KvdError | None]:
        """``(settled, refusal)`` of the handle ``key``: settled once kvd ran every keyed
        call of it and refused none; the first refusal of its keyed calls (kept: the
        handle's for good; :meth:`forget` drops it). ``tail`` is read before the
        completions: a call that ``tail`` passed with no refusal read after it
        succeeded."""
        ran = self.sub.tail > self.last.get(key, key)
        self.collect_new()
        refusal = self.failed.get(key)
        return ran and refusal is None, refusal

    def forget(self, key: int) -> None:
        """The handle ``key`` is done with (settled, or its room cleared): drop what is
        kept for it (a keyed call not run yet keeps its refusal nowhere: forget a
        handle only once :meth:`handle` says settled, or for good)."""
        self.failed.pop(key, None)
        self.last.pop(key, None)
        self.unborn.discard(key)

    def done(self, seq: int) -> bool:
        """Whether kvd ran call ``seq`` (its refusal, if any, is in the completion ring)."""
        return self.sub.tail > seq

    def drained(self) -> bool:
        """Whether kvd ran every call submitted so far, or will run none of them any more
        (it closed the ring)."""
        return self.sub.tail >= self.out.head or self.sub.closed

    def unrun_rooms(self) -> set[int]:
        """The rooms named by a record kvd has not run yet (a create, init, send, abort or
        clear): the status table does not reflect those calls yet, so it answers only the
        other rooms. Empty once kvd ran every record, or closed the ring (it runs none
        any more). ``tail`` is read first: a record it passed ran, and kvd published its
        room into the table before (:mod:`kvd.engine_rpc.channel`). O(records not run):
        :attr:`inflight` is read from its newest call back to ``tail``."""
        tail = self.sub.tail
        if tail >= self.out.head or self.sub.closed:
            return set()
        rooms: set[int] = set()
        inflight = self.inflight
        for seq in reversed(inflight):
            if seq < tail:
                break
            rooms.add(inflight[seq])
        return rooms

    def refuse_unrun(self) -> dict[int, KvdError]:
        """Once this ring's ``tail`` is final -- kvd closed the ring, or answered the
        engine's registration on a later connection (kvd answers it only after the
        dropped ring's published records ran, :class:`kvd.engine_rpc.ring.Backlog`) --
        every record past ``tail`` never ran and never will: a record published after
        kvd read the dropped ring's ``head`` (K41). Each such record's room keeps a
        refusal (KvdUnreachable kind; in :attr:`refused`, and the handle's in
        :attr:`failed`), so the room reads Failed rather than never being created or
        aborted without anyone knowing; an unwaited Clear among them did not run (its
        room keeps what it had). Reads every completion first. Returns the refusals it
        added, by room (a room that already held one keeps its first)."""
        with contextlib.suppress(ProtocolError):
            self.collect()
        tail = self.sub.tail
        added: dict[int, KvdError] = {}
        for seq, room in self.inflight.items():
            if seq < tail:
                continue
            exc = KvdUnreachable(f"kvd closed the engine ring before running call {seq} "
                                 f"on room {room} (published after kvd read the dropped "
                                 f"connection's ring, K41): it never ran", "KvdUnreachable")
            key = self.owner.get(seq)
            if key is not None and key in self.last:
                self.failed.setdefault(key, exc)
            if room not in self.refused:
                self.refused[room] = added[room] = exc
            self.clearing.pop(seq, None)
        self.inflight.clear()
        self.owner.clear()
        return added

    def wait_done(self, seq: int, timeout: float) -> None:
        """Block until kvd ran call ``seq`` (RingClosed, DaemonGone, TimeoutError)."""
        self._wait(lambda: self.done(seq), timeout)

    def result_of(self, seq: int) -> KvdError | None:
        """Call ``seq``'s refusal (taken), after :meth:`wait_done`; None: it succeeded."""
        return self.collect(seq)

    # ---- completions -------------------------------------------------------------------

    def collect_new(self) -> None:
        """:meth:`collect` if kvd wrote a completion not read yet, or if calls known done
        are many (they leave :attr:`inflight`); else nothing (no completion: nothing to
        learn, a word read)."""
        if self.comp.head != self.inbox.tail or len(self.inflight) > self.sub.capacity:
            self.collect()

    def collect(self, want: int = -1) -> KvdError | None:
        """Read every completion kvd wrote; a refusal of call ``want`` is returned, the
        others are kept by room in :attr:`refused` (but those of a handle whose create kvd
        refused: the id's live room is another incarnation); calls known done leave
        :attr:`inflight`. ProtocolError for a corrupt completion ring."""
        tail = self.sub.tail  # before the completions: every refusal of a call before it
        found: KvdError | None = None
        took = 0
        while (payload := self.inbox.peek()) is not None:
            reply = rpc.decode_reply(payload, self.comp.record_bytes)
            self.inbox.done()
            took += 1
            if self.clearing:
                self._settle_clears(reply.id)
                self.clearing.pop(reply.id, None)  # a refused Clear: the room reads Failed
            room = self.inflight.get(reply.id)  # it leaves once tail passed it, below
            key = self.owner.pop(reply.id, None)
            if reply.ok or room is None:
                continue  # nothing to tell (kvd writes refusals of calls made here only)
            exc = rpc.error_from(reply.kind, reply.error)
            if key is not None and key in self.last:  # the handle's, waited for or not
                self.failed.setdefault(key, exc)
                if reply.id == key:
                    self.unborn.add(key)
            if reply.id == want:
                found = exc
            elif key is None or key not in self.unborn:
                # the room's own (its create ran): the room reads Failed on every read
                # path; a refused create's calls concern another incarnation of the id
                self.refused.setdefault(room, exc)
        if self.clearing:
            self._settle_clears(tail)
        if took and self.sub.sleeping and not self.drained():
            os.eventfd_write(self.wake_kvd, 1)  # kvd may have stopped at a full completion ring
        while self.inflight:
            first = next(iter(self.inflight))
            if first >= tail:
                break
            del self.inflight[first]
            self.owner.pop(first, None)
        if len(self.last) > self._prune_at:  # handles whose calls all ran, none refused:
            self.last = {k: v for k, v in self.last.items()  # settled (their refusals
                         if v >= tail or k in self.failed}  # were read above)
            self._prune_at = 2 * len(self.last) + self.sub.capacity
        return found

    def _settle_clears(self, below: int) -> None:
        """The unwaited Clears with a call id below ``below`` ran and were not refused
        (every refusal before ``below`` was read): the refusals kept for their rooms came
        from calls before them and go, so a later room of the same id starts clean."""
        while self.clearing:
            first = next(iter(self.clearing))
            if first >= below:
                break
            room = self.clearing.pop(first)
            self.refused.pop(room, None)
            self.cleared.append(room)

    # ---- waiting -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.sub.closed or self.comp.closed:
            raise RingClosed("kvd closed the engine ring")

    def _wait(self, ready: Callable[[], bool], timeout: float) -> None:
        """Block until ``ready()`` (kvd writes ``wake_engine`` when it sees the completion
        ring's ``sleeping`` set), kvd closes the ring, or the socket's end closes (kvd's
        side: DaemonGone; an ``interrupt()`` shutting it down reads the same)."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.wake_engine, select.POLLIN)
        # the socket's end closing, not its readability: another thread's socket call
        # (KvdClient's socket and ring have locks of their own) reads replies meanwhile
        poller.register(self.sock_fd, select.POLLRDHUP)
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
