"""kvd's end of one engine connection's rings (issue 21 step B): room calls in shared memory.

:class:`RingChannel` lays out a submission ring and a completion ring
(:mod:`kvd.protocol.ring`) in one memfd, makes two eventfds (``wake_kvd``: the engine
writes it; ``wake_engine``: kvd writes it) and hands all three to the engine
(:class:`~kvd.protocol.rpc.OpenRing`). The engine's room call is then "write a record,
bump ``head``, and write ``wake_kvd`` only if kvd said it sleeps".

kvd drains the submission ring on its loop: when ``wake_kvd`` is readable, and again on
the next loop turn while records remain (at most :data:`BATCH` per turn: a flooding
engine cannot starve the loop); before any socket call of the same connection, every
record published by then, whatever their number (calls run in the order the engine made
them, whichever way each went): up to :data:`BATCH` with the call
(:meth:`RingChannel.catch_up`), more a batch a loop turn before it, the call answered
later (:meth:`RingChannel.caught_up`); and when the
connection drops, every record published by then (:meth:`RingChannel.orphan`: the
engine counts them as made), :data:`BATCH` a loop turn too, ordered before every
later engine call by the daemon's :class:`Backlog` (K41). Before it waits it
sets the ring's ``sleeping`` word and looks at ``head`` once more (a full barrier
between, :func:`~kvd.protocol.ring.fence`), so a record published in between is never
left waiting for a wake-up that will not come; the daemon's sweep drains every ring
too, a bound on any wake-up lost all the same.

Each record is decoded with the socket path's codec (:func:`kvd.protocol.rpc.decode_request`)
and run by the socket path's handler (``handle``: ``Daemon.run_now``); a refusal
goes to the completion ring as a :class:`~kvd.protocol.rpc.Reply` with the call's id,
and only then is the record consumed (``tail`` published). A record that depends on an
earlier one (:meth:`~kvd.protocol.ring.Ring.depends`: the engine's calls of a room whose
create it did not wait for) runs only if that call was not refused; otherwise it is
refused too, with the earlier refusal's kind and a text naming it, and never reaches the
handler (so a refused create's init, send, abort or clear cannot act on another
incarnation of the room). A record kvd cannot trust -- a header out of bounds, a
record out of sequence or over its length, a dependency more than a ring's capacity
back, a frame that does not decode, a call id that is not the record's seq, a call a
ring does not carry, a completion ring the engine filled with nonsense -- fails the
channel: logged once, both rings marked ``closed``, every room the ring carried aborted
(``on_fail``). The daemon, its other connections and rooms are untouched; the engine
goes on over the socket.

kvd's cursors (the submission ``tail``, the completion ``head``) are kept here and only
published into the shared header (:class:`~kvd.protocol.ring.Consumer`,
:class:`~kvd.protocol.ring.Producer`): whatever the engine writes there is checked,
never believed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import mmap
import os
import typing
from collections.abc import Callable
from typing import Any

from kvd.errors import KvdError, ProtocolError
from kvd.logs import log_context, message_context
from kvd.protocol import codec, rpc
from kvd.protocol.ring import Consumer, Producer, Ring, fence

log = logging.getLogger("kvd")

#: Records drained per loop turn before yielding to the loop's other work.
BATCH = 256
_RING_CALLS: tuple[type, ...] = typing.get_args(rpc.RingCall)
_CREATES = (rpc.SenderCreate, rpc.ReceiverCreate)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

Handle = Callable[[rpc.Call], Any]
OnFail = Callable[[set[int], str], None]
Known = Callable[[int], bool]
#: The rooms a ring carried are pruned of those kvd forgot once they pass this many (and
#: then twice what was left): bounded by kvd's own rooms, at O(1) amortised per call.
PRUNE_AT = 1024


def check_sizes(capacity: int, record_bytes: int) -> int:
    """Bytes of the memfd for two rings of these sizes; ProtocolError outside the bounds
    of :class:`~kvd.protocol.rpc.OpenRing` (:func:`~kvd.protocol.rpc.ring_sizes`)."""
    try:
        return rpc.ring_sizes(capacity, record_bytes)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc


class RingChannel:
    """One connection's rings, their memfd (``fd``) and eventfds. ``handle(call)`` runs one
    call as the socket path does (raising its refusal); ``on_fail(rooms, reason)`` is told
    once if the channel fails (``rooms``: those the ring carried that were not cleared
    since, whichever way, :meth:`cleared`); ``known(room)``: whether kvd still holds
    ``room``. Raises ProtocolError for sizes out of bounds, OSError if the memfd or
    eventfds cannot be made."""

    def __init__(self, capacity: int, record_bytes: int, handle: Handle,
                 on_fail: OnFail, known: Known) -> None:
        self.size = check_sizes(capacity, record_bytes)
        self.capacity, self.record_bytes = capacity, record_bytes
        self.handle, self.on_fail, self.known = handle, on_fail, known
        self._prune_at = PRUNE_AT
        self.fd = os.memfd_create("kvd-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.wake_kvd = self.wake_engine = -1
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)  # no SIGBUS in kvd's reads
            self.wake_kvd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self.wake_engine = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except OSError:
            self._close_fds()
            raise
        half = self.size // 2
        view = memoryview(self.map)
        self.sub = Ring.create(view[:half], capacity, record_bytes)
        self.comp = Ring.create(view[half:], capacity, record_bytes)
        del view
        self.sub.sleeping = True  # the engine's first record wakes kvd
        self.inbox, self.outbox = Consumer(self.sub), Producer(self.comp)
        self.rooms: set[int] = set()  # rooms the ring carried, not cleared since
        #: refusals of the last ``capacity`` records, by seq: ``(kind, error)`` (a record
        #: may depend only on one that was in the ring with it)
        self.refusals: dict[int, tuple[str, str]] = {}
        self.failed = ""
        self.closed = False
        self._draining = False
        self._again = False
        #: the connection dropped: refusals reach nobody (:meth:`orphan`), and the records
        #: up to ``_target`` run in slices (:meth:`finish_some`, :class:`Backlog`)
        self.orphaned = False
        self._target = 0
        self._unread_failed = False
        #: one entry per completion written, the last ``capacity``: ``[room, call, error,
        #: standing]`` for a refused call of its own room (not a create, not refused for
        #: the call it depended on), else None; ``standing`` until a later record names
        #: the room (:meth:`finish_some` fails the room of a standing one the engine never read)
        self.written: collections.deque[list[Any] | None] = collections.deque(
            maxlen=capacity)
        self.standing: dict[int, list[Any]] = {}  # room -> its standing entry
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handled = 0

    @property
    def fds(self) -> list[int]:
        """What rides with the :class:`~kvd.protocol.rpc.RingResult`, in its order."""
        return [self.fd, self.wake_kvd, self.wake_engine]

    def result(self) -> rpc.RingResult:
        return rpc.RingResult(capacity=self.capacity, record_bytes=self.record_bytes,
                              size=self.size)

    def start(self) -> None:
        """Drain whenever the engine writes ``wake_kvd`` (on the running loop)."""
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.wake_kvd, self._woken)

    def _woken(self) -> None:
        with contextlib.suppress(OSError):  # a spurious wake-up: nothing to read
            os.eventfd_read(self.wake_kvd)
        self.drain()

    # ---- draining ----------------------------------------------------------------------

    def drain(self) -> None:
        """The wake-up path (``wake_kvd``, the sweep, the next loop turn): run the
        published records, at most :data:`BATCH` now and the rest on the next loop turn
        (a flooding engine cannot starve the loop), then sleep. Re-entrant calls (a
        record's handler asking again) and calls after the channel failed or closed do
        nothing."""
        if self._draining or self.failed or self.closed or self.orphaned:
            return
        if self.sub.sleeping and self.sub.head == self.inbox.tail:
            return  # nothing published, nothing to change
        self.sub.sleeping = False
        with self._running(wake=True):
            if self._run(BATCH) and self._can_progress():
                self._later()
                return
            self.sub.sleeping = True  # then look again: a record published meanwhile
            fence()
            if self._can_progress():
                self.sub.sleeping = False
                self._later()

    @contextlib.contextmanager
    def _running(self, wake: bool) -> typing.Iterator[None]:
        """One run of records (:meth:`drain`, :meth:`catch_up`, :meth:`orphan`,
        :meth:`finish_some`): marks the channel draining (re-entrant calls do nothing); a
        ProtocolError fails the channel with its message, and any other exception (a bug
        here) is logged and fails it too, so the engine is never left waiting; with
        ``wake``, the engine is woken at the end if it waits."""
        self._draining = True
        try:
            yield
        except ProtocolError as exc:
            self.fail(str(exc))
        except Exception as exc:
            log.exception("engine ring drain failed")
            self.fail(f"internal error: {exc}")
        finally:
            self._draining = False
            if wake:
                self._wake_engine()

    def behind(self) -> bool:
        """Whether more than :data:`BATCH` published records wait: a socket call of this
        connection is then answered later, after :meth:`caught_up` (K41)."""
        return not (self.failed or self.closed or self.orphaned) and \
            self.sub.head - self.inbox.tail > BATCH

    async def caught_up(self) -> None:
        """Before a socket call of this connection answered later (the daemon's
        ``dispatch``): return once at most :data:`BATCH` of the records published now are
        left unrun (:meth:`catch_up` runs those with the call, in its turn). The wake-up
        path runs them, :data:`BATCH` a loop turn (K41), so the loop's other work goes on
        between slices while the engine waits in its call. A completion ring full with
        nothing run in a turn cannot be waited out (the engine reads no completion while
        it waits in the call): the channel fails, naming why, as in :meth:`catch_up`."""
        if not self.behind():
            return
        with self._running(wake=False):
            target = self.inbox.tail + self.inbox.pending()
        while not (self.failed or self.closed or self.orphaned) and \
                target - self.inbox.tail > BATCH:
            before = self.inbox.tail
            if not self._again:
                self.drain()
            await asyncio.sleep(0)  # the next turn's slice (drain reschedules itself)
            if not (self.failed or self.closed or self.orphaned) and \
                    self.inbox.tail == before and self.outbox.free() == 0:
                self.fail("the engine made a socket call while its completion ring was "
                          "full: the records before the call cannot run in order")

    def catch_up(self) -> None:
        """Before a socket call of the same connection: run EVERY record published now
        (up to the ``head`` read here: at most :data:`BATCH` once the daemon awaited
        :meth:`caught_up`, unless records keep coming from another thread), so the
        socket call runs
        after every call the engine made before it, whichever way each went. A
        completion ring that fills first cannot be waited out (the engine is blocked in
        its socket call and reads no completion; :class:`~kvd.client.rpc.KvdClient`
        reads them all before a socket call, so ``capacity`` slots always suffice): the
        channel fails, naming why (its rooms aborted, :meth:`fail`), and the socket call
        runs after it. Does nothing re-entrantly, with nothing published, or after the
        channel failed or closed."""
        if self._draining or self.failed or self.closed or self.orphaned or \
                self.sub.head == self.inbox.tail:
            return
        with self._running(wake=True):
            self._run_to(self.inbox.tail + self.inbox.pending(), full=(
                "the engine made a socket call while its completion ring was full: "
                "the records before the call cannot run in order"))

    def _run_to(self, target: int, full: str) -> None:
        """Run records until ``tail`` reaches ``target`` (a ``head`` read before, checked
        then); ProtocolError ``full`` if the completion ring fills first, and for a
        ``head`` the engine moved back below ``target``."""
        while self.inbox.tail < target:
            if not self._run(target - self.inbox.tail):
                if self.outbox.free() == 0:
                    raise ProtocolError(f"{full} ({target - self.inbox.tail} records "
                                        f"unrun)")
                raise ProtocolError(f"ring head moved back below {target}")

    def _later(self) -> None:
        if self.loop is not None and not self._again:
            self._again = True
            self.loop.call_soon(self._drain_again)

    def _drain_again(self) -> None:
        self._again = False
        self.drain()

    def _can_progress(self) -> bool:
        """A record waits and the completion ring has room for its answer."""
        return bool(self.inbox.pending()) and self.outbox.free() > 0

    def _run(self, limit: int) -> int:
        """Run up to ``limit`` records; how many ran. Stops early while the completion
        ring is full (the engine reads it, then wakes kvd)."""
        ran = 0
        while ran < limit and (self.orphaned or self.outbox.free() > 0):
            payload = self.inbox.peek()
            if payload is None:
                break
            self._one(self.inbox.tail, payload)
            self.inbox.done()
            ran += 1
        self.handled += ran
        return ran

    def _one(self, seq: int, payload: bytes) -> None:
        req = rpc.decode_request(payload, self.record_bytes)
        call = req.call
        if req.id != seq:
            raise ProtocolError(f"ring record {seq} carries call id {req.id}")
        if not isinstance(call, _RING_CALLS):
            raise ProtocolError(f"ring record {seq} carries {type(call).__name__}, which "
                                f"a ring does not carry")
        room = call.room  # type: ignore[union-attr]
        if self.standing:
            entry = self.standing.pop(room, None)
            if entry is not None:
                entry[3] = False  # a later call on the room: the engine went on with it
        dep = self.sub.depends(seq)
        refusals = self.refusals
        while refusals and next(iter(refusals)) < seq - self.capacity:
            del refusals[next(iter(refusals))]
        if dep is not None:
            if dep < seq - self.capacity:
                raise ProtocolError(f"ring record {seq} depends on record {dep}, more than "
                                    f"{self.capacity} records back")
            if dep in refusals:
                kind, error = refusals[dep]
                self._refuse(seq, kind, f"room {room}: {type(call).__name__} not run: call "
                                        f"{dep} it depends on was refused: {error}", error)
                return
        try:
            with log_context(**message_context(call)):
                self.handle(call)
        except Exception as exc:
            if not isinstance(exc, KvdError):
                log.exception("engine call %s failed", type(call).__name__)
            kind, error = rpc.failure(exc)
            own = None if isinstance(call, _CREATES) else [room, type(call).__name__, error,
                                                            True]
            self._refuse(seq, kind, error, entry=own)
            if self.orphaned and own is not None:
                self._fail_room(room, f"the engine's {own[1]} was refused after its "
                                      f"connection dropped (the refusal reached nobody): "
                                      f"{error}")
            return
        if isinstance(call, rpc.Clear):
            self.cleared(room)
            return
        self.rooms.add(room)
        if len(self.rooms) > self._prune_at:
            self.rooms = {r for r in self.rooms if self.known(r)}
            self._prune_at = 2 * len(self.rooms) + PRUNE_AT

    def cleared(self, room: int) -> None:
        """kvd cleared ``room``, by a call through this ring or any other way (the
        socket, a ``Many``, another connection): the ring no longer carries it, so a
        room of the same id made later (another incarnation, maybe over the socket) is
        not aborted if this ring fails (:meth:`fail`)."""
        self.rooms.discard(room)

    def _refuse(self, seq: int, kind: str, error: str, root: str = "",
                entry: list[Any] | None = None) -> None:
        """Call ``seq`` was refused: its answer in the completion ring, and the first
        refusal of its chain (``root``, else ``error``: a chain's texts do not grow) kept
        for the records that depend on it; ``entry``: what :attr:`written` keeps of it."""
        self.refusals[seq] = (kind, root or error)
        self._complete(rpc.Reply(id=seq, ok=False, error=error, kind=kind))
        if not self.orphaned:
            self.written.append(entry)
            if entry is not None:
                self.standing[entry[0]] = entry
                if len(self.standing) > 2 * self.capacity:  # only those still written
                    self.standing = {e[0]: e for e in self.written if e is not None and e[3]}

    def _complete(self, reply: rpc.Reply) -> None:
        """Put ``reply`` in the completion ring (its error text cut to fit a record)."""
        if self.orphaned:
            return  # nobody reads it: the room fails instead (:meth:`orphan`)
        data = codec.encode(reply)
        over = len(data) - self.comp.max_payload
        if over > 0:
            cut = reply.error[:max(0, len(reply.error) - over - 8)]
            data = codec.encode(rpc.Reply(id=reply.id, ok=False, error=cut, kind=reply.kind))
        if self.outbox.push(data) is None:
            raise ProtocolError("the completion ring filled while kvd held its last slot")

    def _wake_engine(self) -> None:
        """Write ``wake_engine`` if the engine said it waits (the completion ring's
        ``sleeping``)."""
        if self.wake_engine < 0:
            return
        fence()  # the tails published before the engine's flag is read
        if self.comp.sleeping:
            with contextlib.suppress(OSError):  # its counter is full: it is awake anyway
                os.eventfd_write(self.wake_engine, 1)

    # ---- ending ------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """Stop serving the rings for good: logged once, both marked closed, the engine
        woken, ``on_fail`` told which rooms the ring carried."""
        if self.failed or self.closed:
            return
        self.failed = reason
        log.warning("engine ring failed, the engine goes on over the socket: %s "
                    "(%d rooms it carried are aborted)", reason, len(self.rooms))
        self._stop_reading()
        self.sub.close()
        self.comp.close()
        self.comp.sleeping = True  # whatever the engine wrote there: it must look now
        self._wake_engine()
        rooms, self.rooms = self.rooms, set()
        self.on_fail(rooms, reason)

    def _stop_reading(self) -> None:
        if self.loop is not None and self.wake_kvd >= 0:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.wake_kvd)

    def orphan(self) -> None:
        """The connection dropped (or registered again): from now on the records the
        engine published before (up to the ``head`` read here; the engine's
        :meth:`~kvd.client.rpc.KvdClient.submit` returned for them, so it counts them as
        made; a record it died half way through was never published and does not run)
        run only through :meth:`finish_some`, in slices, as the engine's :class:`Backlog`
        orders them; none is read on a wake-up any more. Their refusals reach nobody
        (the engine's client drops its ring with the connection): none is written, and
        the room of each refused call fails instead, at once (:meth:`_fail_room`), so
        nothing the engine handed over is lost silently and a reconnecting engine (K27)
        reads the room Failed. A refused create (and the calls that depended on it)
        fails no room: the id's live room, if any, is another incarnation. A ``head``
        out of bounds fails the channel as when live (:meth:`fail`), and the rings
        close."""
        if self.closed or self.orphaned:
            return
        self._stop_reading()
        self.orphaned = True
        if not self.failed and not self._draining:
            with self._running(wake=False):
                self._target = self.inbox.tail + self.inbox.pending()
        if self.failed or self._draining:
            self.close()

    def finish_some(self, limit: int) -> int:
        """Run up to ``limit`` (>= 1) of the records :meth:`orphan` left; how many ran. The
        first slice first fails the rooms of refusals the engine never read
        (:meth:`_fail_unread`). Closes the rings once the last one ran, or when one
        cannot be trusted (the channel fails first, :meth:`fail`): every call makes
        progress or closes the rings."""
        if self.closed:
            return 0
        ran = 0
        with self._running(wake=False):
            if not self._unread_failed:
                self._unread_failed = True
                self._fail_unread()
            ran = self._run(min(limit, self._target - self.inbox.tail))
            if not ran and self.inbox.tail < self._target:
                raise ProtocolError(f"ring head moved back below {self._target}")
        if self.failed or self.inbox.tail >= self._target:
            self.close()
        return ran

    def _fail_unread(self) -> None:
        """At the drop, before the records still published run: the refusals kvd wrote
        that the engine has not read (past the completion ring's ``tail`` it published:
        :class:`~kvd.client.rpc.KvdClient` reads them all when its connection drops, so
        these came in between, or a registration replaces the ring and the client reads
        them after: either way the engine reads the room Failed) fail their rooms,
        unless a later call named the room (the engine went on with it: a Clear, a
        create of another incarnation). ProtocolError for a ``tail`` out of bounds."""
        unread = self.comp.capacity - self.outbox.free()
        entries = list(self.written)[max(0, len(self.written) - unread):] if unread else []
        for entry in entries:
            if entry is not None and entry[3]:
                room, name, error, _ = entry
                self._fail_room(room, f"the engine's {name} was refused and its connection "
                                      f"dropped before it read the refusal: {error}")

    def _fail_room(self, room: int, reason: str) -> None:
        """A call on ``room`` was refused with nobody to tell (``reason`` says which):
        the room fails now, before the next record runs (an ``Abort`` as the engine's: a
        later Clear or create of the id in the ring acts after it, as for an engine that
        read the refusal)."""
        with contextlib.suppress(KvdError):
            self.handle(rpc.Abort(room=room, reason=reason))

    def close(self) -> None:
        """The connection dropped (or kvd stops): mark the rings closed, stop reading,
        release the memfd and eventfds."""
        if self.closed:
            return
        self.closed = True
        self._stop_reading()
        with contextlib.suppress(Exception):
            self.sub.close()
            self.comp.close()
            self.comp.sleeping = True
        self._wake_engine()
        del self.sub, self.comp, self.inbox, self.outbox
        self._close_fds()

    def _close_fds(self) -> None:
        if getattr(self, "map", None) is not None:
            with contextlib.suppress(BufferError):  # a numpy view alive: the GC unmaps
                self.map.close()
        for fd in (self.fd, self.wake_kvd, self.wake_engine):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self.wake_kvd = self.wake_engine = -1


class Backlog:
    """The engine's work across its connections: the rings of its connections that
    dropped (:meth:`RingChannel.orphan`), in the order they dropped, and the rule that
    orders everything else of the engine's after them.

    kvd serves one engine at a time and a ring is opened only by the connection that
    registered it, so every ring is that engine's. Its records run :data:`BATCH` a loop
    turn (K41: the loop's other work -- other connections' ``Info``, the control plane,
    transfers, sweeps -- goes on between slices; a full ring of
    :data:`~kvd.protocol.rpc.MAX_RING_CAPACITY` records takes 16 turns). Until the last
    one ran, no call of the engine's may run (:meth:`holds`): a reconnecting engine's
    registration and every later call, on the socket or a new ring, run after every
    record it handed over before its connection dropped, as if that connection had
    stayed (which connection is the engine's again is known only once it registered, so
    every engine call waits, from any connection). The daemon asks :meth:`holds` before
    it answers a call at once and awaits :meth:`settled` before it runs one later; a
    ring is opened only then, so no live ring runs beside an orphaned one."""

    def __init__(self) -> None:
        self.rings: collections.deque[RingChannel] = collections.deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._scheduled = False

    def holds(self, call: rpc.Call) -> bool:
        """Whether ``call`` must wait: an orphaned ring has records left and ``call`` is
        the engine's (anything but ``Info``, which reads no room and no registration)."""
        return bool(self.rings) and not isinstance(call, rpc.Info)

    def add(self, ring: RingChannel) -> None:
        """``ring``'s connection dropped (or registered again): its published records run
        after those of rings that dropped before it, a slice a loop turn (the first in
        this turn when no other ring waits)."""
        ring.orphan()
        if ring.closed:
            return
        self.rings.append(ring)
        if len(self.rings) == 1 and not self._scheduled:
            self._slice()  # the drop's own turn takes the first slice
        else:
            self._schedule()

    async def settled(self) -> None:
        """Return once no orphaned ring has records left (at once if none has)."""
        while self.rings:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def close(self) -> None:
        """kvd stops: the orphaned rings close with their records unrun (as live rings
        do), and whoever waits goes on."""
        while self.rings:
            self.rings.popleft().close()
        self._wake()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._slice)

    def _slice(self) -> None:
        """One loop turn's share: at most :data:`BATCH` records, oldest ring first."""
        self._scheduled = False
        budget = BATCH
        while self.rings and budget > 0:
            ring = self.rings[0]
            budget -= ring.finish_some(budget)
            if ring.closed:
                self.rings.popleft()
        if self.rings:
            self._schedule()
        else:
            self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
