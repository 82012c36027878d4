"""Blocking engine-side RPC client (stdlib + msgspec; safe to import in any engine)."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import socket
import struct
import threading
import time
import typing
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvd.client.peer import EXPECTED_UID_ENV, check_peer, parse_expected_uid, trust_for
from kvd.client.ring import NEW, DaemonGone, EngineRing, Handle, RingClosed
from kvd.engine_rpc.socket_path import default_engine_socket
from kvd.errors import KvdError, KvdUnreachable, ProtocolError
from kvd.protocol import rpc
from kvd.protocol.table import DEFAULT_STALE_NS, FEW, Misses, StatusTable


def _error_from_reply(reply: rpc.Reply | rpc.RawReply) -> Exception:
    return rpc.error_from(reply.kind, reply.error)


#: Typed results of the calls that have one (the others answer None or a dict).
RESULT_TYPES: dict[type, type] = {rpc.Poll: rpc.PollResult, rpc.Wait: rpc.PollResult,
                                  rpc.RegisterKV: rpc.RegisterResult,
                                  rpc.Many: rpc.ManyResult, rpc.OpenTable: rpc.TableResult,
                                  rpc.OpenRing: rpc.RingResult}
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(t, strict=False) for t in set(RESULT_TYPES.values())}
_ANY = msgspec.msgpack.Decoder()
#: The calls a Many may carry (:data:`~kvd.protocol.rpc.NowCall`).
_NOW_CALLS: tuple[type, ...] = typing.get_args(rpc.NowCall)

#: What a send or recv past SO_SNDTIMEO/SO_RCVTIMEO fails with.
_TIMED_OUT = (errno.EAGAIN, errno.EWOULDBLOCK)

#: The longest client timeout, in seconds (a kernel socket timeout takes ~9e9 at most).
MAX_TIMEOUT = 1e9

#: A server-side wait never runs longer than this fraction of the client's timeout:
#: a long ``wait`` is several calls, never a transport timeout (K27).
WAIT_SHARE = 0.5


class KvdClient:
    """A connection to the local kvd's engine socket.

    Thread-safe: one socket call at a time (:attr:`_lock`), and the ring's producer side
    under a lock of its own (:attr:`_ring_lock`), so a room call through the ring -- a
    record and a ``head`` bump -- never waits for another thread's socket call (a
    ``Wait`` blocks for up to ``timeout * WAIT_SHARE``). The ordering rule, whichever
    threads make the calls: the ring's records are published in the order their calls
    took the ring lock, and kvd runs them in that order; a socket call runs after every
    record published before kvd read it (kvd's ``catch_up``), so after every ring call
    that returned before the socket call began, in any thread (a ring call made while
    another thread's socket call is in flight runs before or after it). kvd cannot wait
    for completions to be read during that catch-up; every record is published after
    the completions kvd wrote before it were read, and only while the unrun records
    then left a free slot (:meth:`~kvd.client.ring.EngineRing.submit`), so unread
    completions plus unrun records never exceed the ring's capacity and catch-up never
    meets a full completion ring, whichever thread is in a socket call. Lock order:
    ``_lock`` before ``_ring_lock``; a thread holding only ``_ring_lock`` never waits
    for ``_lock`` (it lets go first). ``timeout`` bounds each call in seconds (the
    socket's kernel timeouts: a signal handler in the engine that fires more often than
    ``timeout`` restarts the wait each time, so a stalled kvd is then noticed late).
    ``fd`` memory handles (:class:`~kvd.protocol.memory.FdHandle`, e.g. from
    :class:`~kvd.client.FdPool`) name descriptors of this process; they are sent with
    the request (``SCM_RIGHTS``) and must stay open while registered.
    Raises :class:`KvdUnreachable` when kvd is not there (the next call
    reconnects), and the kvd error named by a failed reply otherwise. After a
    reconnect (kvd restarted, or the connection dropped) the engine's last
    ``RegisterKV`` is sent again first, with this client's ``engine_id``, so the
    same daemon keeps the engine's rooms and a new one learns its buffers (a new one,
    another ``instance_id``, starts a new :attr:`epoch`: a room object made before reads
    Failed, K27).
    Results: :class:`~kvd.protocol.rpc.PollResult` for ``Poll``/``Wait`` (one status per
    room asked, checked), :class:`~kvd.protocol.rpc.RegisterResult` for ``RegisterKV``.
    A reply that is malformed (undecodable, another request's id, not one status per
    room) raises :class:`~kvd.errors.ProtocolError`.

    Every connection proves its server before the first byte is sent (case S17,
    :mod:`kvd.client.peer`): the server's uid (``SO_PEERCRED``) must be root, this
    process's euid, or ``expected_uid`` (default: ``KVD_EXPECTED_UID``, else the owner
    of the socket's folder when only that user could have made it); any other raises
    :class:`~kvd.errors.UntrustedDaemon` and nothing is sent. ``path`` defaults to
    :func:`~kvd.engine_rpc.socket_path.default_engine_socket` (the daemon's default).
    Raises ValueError for a bad ``timeout`` or ``expected_uid``.

    With ``use_table`` (the default), each registration also maps kvd's room status
    table (:mod:`kvd.protocol.table`, when kvd serves one): :meth:`read_table` then
    answers polls without a syscall. The table is dropped with the connection (a
    restarted kvd has a new one, mapped at the re-registration) and ignored once its
    writer has not beaten for ``stale_ns`` (a kvd that died without a word).

    With ``use_ring`` (and the table), each registration also opens a submission ring
    (issue 21 step B, :class:`~kvd.protocol.rpc.OpenRing` of ``ring_capacity`` records of
    ``ring_record_bytes`` bytes): :meth:`submit` then sends room calls through shared
    memory instead of the socket. Without a ring (none asked, kvd has none, it failed,
    or the table says kvd is silent) :meth:`submit` is :meth:`call`. ValueError for
    ``use_ring`` without ``use_table``, and for ring sizes kvd would refuse
    (:func:`~kvd.protocol.rpc.ring_sizes`: a power-of-two capacity, records a multiple of
    8 bytes, both within bounds).
    """

    def __init__(self, path: str | None = None, timeout: float = 30.0,
                 expected_uid: int | None = None, use_table: bool = True,
                 stale_ns: int = DEFAULT_STALE_NS, use_ring: bool = False,
                 ring_capacity: int = 256, ring_record_bytes: int = 4096) -> None:
        if not 0 <= timeout <= MAX_TIMEOUT:  # NaN too; a bad one would fail every call
            raise ValueError(f"timeout must be in [0, {MAX_TIMEOUT:g}] seconds, got {timeout}")
        if path is None:
            path = str(default_engine_socket())
        self.path = str(path)
        self.expected_uid = parse_expected_uid(
            expected_uid if expected_uid is not None else os.environ.get(EXPECTED_UID_ENV))
        self.timeout = timeout
        self.engine_id = secrets.token_hex(8)
        self._sock: socket.socket | None = None
        #: the socket's lock: one socket call at a time (connection, registration)
        self._lock = threading.Lock()
        #: the ring's lock: its producer and completion reader, the kept refusals, and the
        #: ring's replacement (taken after ``_lock`` when both are held; re-entrant: a
        #: socket fallback under both locks drops the connection under it)
        self._ring_lock = threading.RLock()
        self._next_id = 0
        self._registration: rpc.RegisterKV | None = None
        self._replay = False
        self._rbuf = bytearray()
        self.reconnects = 0
        self._interrupted: socket.socket | None = None
        #: rings of dropped connections kvd had not closed when the drop was noticed:
        #: their ``tail`` is final once kvd answers the next registration (its Backlog
        #: ran them first), and the records past it never ran (:meth:`_settle_dropped`)
        self._dropped_rings: list[EngineRing] = []
        self.use_table, self.stale_ns = use_table, stale_ns
        self.table: StatusTable | None = None
        self._table_map: mmap.mmap | None = None
        self.use_ring = use_ring
        if use_ring:  # ValueError now, not a silent "no ring" at the registration
            if not use_table:
                raise ValueError("use_ring needs use_table: the ring is used only while "
                                 "kvd's status table says kvd is alive")
            rpc.ring_sizes(ring_capacity, ring_record_bytes)
        self._ring_sizes = rpc.OpenRing(capacity=ring_capacity,
                                        record_bytes=ring_record_bytes)
        self.ring: EngineRing | None = None
        #: the kvd instance that answered the last registration, and how many times the
        #: engine's rooms in kvd were lost: a registration found another instance (a
        #: restarted kvd), or :meth:`close` said goodbye (kvd failed them). Rooms of an
        #: earlier epoch are gone, and read Failed through their room objects
        self.instance = ""
        self.epoch = 0
        #: refusals :meth:`ring_refusal` handed out, by room, until the room is cleared
        self._refusal_taken: dict[int, KvdError] = {}
        #: epoch -> (kind, why) of its end: its rooms are gone (:meth:`epoch_end`)
        self._epoch_ends: dict[int, tuple[str, str]] = {}
        #: set by :meth:`close` until a call reopens the client: reads of room statuses
        #: raise instead of registering the engine again (:meth:`_check_open`)
        self.closed = ""

    def _served_by(self, result: rpc.RegisterResult) -> None:
        """A registration answered: a kvd instance other than the one that served the
        previous registration (it restarted) starts a new :attr:`epoch` -- it never knew
        the rooms made before (K27)."""
        instance = result.instance_id
        restarted = bool(instance and self.instance and instance != self.instance)
        if restarted:
            self._end_epoch("unreachable", f"kvd restarted (now instance {instance}): it "
                            f"does not know the rooms the previous kvd held")
            with self._ring_lock:
                self._refusal_taken.clear()  # the new kvd never knew those rooms
        self._settle_dropped(keep=not restarted)
        self.instance = instance or self.instance

    def _settle_dropped(self, keep: bool) -> None:
        """kvd answered a registration: the rings of dropped connections it ran first
        (:class:`~kvd.engine_rpc.ring.Backlog`) have a final ``tail``, and every record
        past it -- published after kvd read the ring at the drop, K41 -- never ran. With
        ``keep`` (the same kvd instance) each such record's room keeps a refusal
        (:meth:`EngineRing.refuse_unrun`) with the ring's other kept refusals; without
        (a restarted kvd, or a goodbye) the rooms are gone anyway. The rings close."""
        with self._ring_lock:
            rings, self._dropped_rings = self._dropped_rings, []
            for ring in rings:
                if keep:
                    ring.refuse_unrun()
                    self._keep_refusals(ring)
                ring.close()

    def _end_epoch(self, kind: str, why: str) -> None:
        """The rooms of the current :attr:`epoch` are gone in kvd (``why``: it restarted,
        or :meth:`close` said goodbye; ``kind`` a FailureKind value): a new epoch starts,
        and room objects of the old one read Failed naming ``why`` (:meth:`epoch_end`)."""
        self._epoch_ends[self.epoch] = (kind, why)
        self.epoch += 1

    def epoch_end(self, epoch: int) -> tuple[str, str]:
        """``(kind, why)`` of the end of ``epoch``: how its rooms went (``("", "")``
        while it is the current one; a restarted kvd, K27, or the engine's
        :meth:`close`)."""
        return ("", "") if epoch >= self.epoch else self._epoch_ends[epoch]

    def _check_open(self, call: rpc.Call) -> None:
        """Before a socket call (under the socket's lock). After :meth:`close`, a read of
        room statuses (``Poll``, ``Wait``, a ``Many`` of polls only) raises
        :class:`KvdUnreachable` naming the close, so the poll helpers read Failed: it
        would register the engine again only to read the rooms kvd failed and forgot at
        the goodbye as ``UNKNOWN_ROOM``. Any other call (a registration, a room call,
        ``Info``) reopens the client (a reconnect registers again)."""
        if not self.closed:
            return
        if isinstance(call, rpc.Poll | rpc.Wait) or (
                isinstance(call, rpc.Many) and all(isinstance(c, rpc.Poll) for c in call.calls)):
            raise KvdUnreachable(f"kvd client closed: {self.closed} (a poll does not "
                                 f"reopen it; any other call, a room call or a "
                                 f"registration, does)",
                                 "KvdUnreachable")
        self.closed = ""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
                check_peer(sock, self.path, trust_for(self.path, self.expected_uid))
            except OSError as exc:
                sock.close()
                raise KvdUnreachable(f"kvd unreachable at {self.path}: {exc.strerror or exc}",
                                     "KvdUnreachable") from exc
            except BaseException:
                sock.close()  # an untrusted server gets nothing, not even a goodbye
                raise
            # Blocking, with the kernel's per-call timeouts: Python's own socket timeout
            # polls before every send and recv (two more syscalls, about 20 us a call).
            # A call past ``timeout`` still fails (EAGAIN, an OSError: KvdUnreachable).
            sock.settimeout(None)
            seconds = max(self.timeout, 0.001)
            tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._sock = sock
        return self._sock

    def call(self, call: rpc.Call) -> Any:
        """Send one request and return its (typed) result. ValueError (nothing sent) for
        a room call with an integer outside its wire bounds
        (:func:`~kvd.protocol.rpc.check_bounds`: a room id is a 64-bit unsigned integer)."""
        if isinstance(call, rpc.Wait):
            return self.wait(call.rooms, call.timeout, call.any_done)
        rpc.check_bounds(call)  # as submit does: the same error whichever way it goes
        if isinstance(call, rpc.Many):
            for c in call.calls:
                rpc.check_bounds(c)
        if isinstance(call, rpc.RegisterKV) and not call.engine_id:
            call = msgspec.structs.replace(call, engine_id=self.engine_id)
        kind = RESULT_TYPES.get(type(call))
        with self._lock:
            self._check_open(call)
            if isinstance(call, rpc.RegisterKV):
                with self._ring_lock:  # no record goes into a ring this one replaces
                    result = self._exchange(call, kind)
                    self._served_by(result)
                    self._registration, self._replay = call, False
                    self._open_table()
                    self._open_ring()
            else:
                result = self._exchange(call, kind)
        if isinstance(call, rpc.Clear | rpc.Many):
            self._forget_refusals(_cleared(call))
        return result

    def submit(self, call: rpc.RingCall, wait: bool = False,
               handle: Handle | None = None) -> None:
        """A room call (create, init, send, abort, clear) through the submission ring:
        one record, no syscall while kvd is draining. With ``wait``, block until kvd ran
        it and raise its refusal, as :meth:`call` would; without, return at once: a
        refusal comes back later, kept for its room (:meth:`ring_refusal`) or, for a call
        of ``handle`` (:meth:`create`), for the handle (:meth:`handle_state`). Calls run
        in the order they were made, whether each went over the ring or the socket (kvd
        drains the ring before every socket call). A Clear not waited for drops the
        room's kept refusals once kvd ran it unrefused (refused: the room reads Failed
        until cleared again). Without a usable ring, or for a call larger than a record,
        it is :meth:`call`. Raises what :meth:`call` raises (ValueError, nothing sent,
        for an integer outside its wire bounds; :class:`KvdUnreachable` when kvd's
        socket end closed or it ran nothing within ``timeout``); the create's refusal
        (nothing sent) when kvd refused ``handle``'s create; a ring kvd closed while
        this call waited raises ProtocolError (kvd aborted the rooms the ring carried)
        and later calls use the socket. A waited Clear drops the room's kept refusals
        (a room of the same id later starts clean)."""
        self._submit(call, wait, handle)
        if wait and isinstance(call, rpc.Clear):
            self._forget_refusals([call.room])

    def create(self, call: rpc.SenderCreate | rpc.ReceiverCreate) -> Handle | None:
        """A room's create through the ring WITHOUT waiting for kvd: the room's later
        calls go with the returned :class:`~kvd.client.ring.Handle` (:meth:`submit`),
        each depending on the create until it ran, so kvd runs none of them if it refused
        the create; the refusal is read with :meth:`handle_state` (at the handle's next
        call or poll). Without a usable ring (or for a create larger than a record) the
        create goes over the socket, its refusal raised here, and the answer is None.
        Raises what :meth:`submit` raises."""
        return self._submit(call, False, NEW)

    def _submit(self, call: rpc.RingCall, wait: bool,
                handle: Handle | int | None) -> Handle | None:
        key = handle.key if isinstance(handle, Handle) else handle
        rpc.check_bounds(call)  # nothing sent: a record kvd cannot decode fails the ring
        broken: _Broken | None = None
        with self._ring_lock:  # the ring alone: no wait for another thread's socket call
            ring = self._usable_ring()
            data = ring.encode(call) if ring is not None else None
            if ring is not None and data is not None and (
                    not isinstance(handle, Handle) or ring is handle.ring):
                try:
                    return self._submit_record(ring, call, data, wait, key)
                except RingClosed:
                    pass  # kvd closed the ring, nothing published: the way below
                except _Broken as exc:
                    broken = exc
        if broken is not None:
            self._ring_broken_unlocked(broken)
        with self._lock, self._ring_lock:  # the socket way (or the ring, as it now is)
            self._check_open(call)
            ring = self._usable_ring()
            data = ring.encode(call) if ring is not None else None
            if isinstance(handle, Handle) and (ring is not handle.ring or data is None):
                self._settle_create(handle, call.room)  # the socket carries no dependency
                key = None
            if ring is None or data is None:
                self._exchange(call, None)
                return None
            try:
                return self._submit_record(ring, call, data, wait, key)
            except RingClosed:  # kvd closed the ring, nothing published: the socket
                if isinstance(handle, Handle):
                    self._settle_create(handle, call.room)
                self._close_ring()
                self._exchange(call, None)
                return None
            except _Broken as exc:  # both locks held: drop the connection at once
                self._drop()
                raise KvdUnreachable(exc.why, "KvdUnreachable") from exc.exc

    def _submit_record(self, ring: EngineRing, call: rpc.RingCall, data: bytes, wait: bool,
                       key: int | None) -> Handle | None:
        """:meth:`_submit` through ``ring`` (under the ring's lock only). Raises RingClosed
        when kvd closed the ring before the record was published (nothing sent: the caller
        goes the socket way), :class:`_Broken` for a ring that no longer serves (the caller
        drops the connection once it let go of the ring's lock), and the call's refusal."""
        try:
            seq = ring.submit(data, call.room, self.timeout, key)
        except (DaemonGone, TimeoutError, ProtocolError) as exc:
            raise _Broken(ring, exc, self._broken_why(exc)) from exc
        if not wait:
            if isinstance(call, rpc.Clear):  # its room's kept refusals go once it ran
                ring.clearing[seq] = call.room
            return Handle(ring, seq) if key == NEW else None
        try:
            ring.wait_done(seq, self.timeout)
            refusal = ring.result_of(seq)
        except RingClosed as exc:  # published: never sent again over the socket
            self._close_ring()
            raise ProtocolError(f"kvd closed the engine ring before it ran call {seq} "
                                f"(room {call.room})") from exc
        except (DaemonGone, TimeoutError, ProtocolError) as exc:
            raise _Broken(ring, exc, self._broken_why(exc)) from exc
        if refusal is not None:
            raise refusal
        return None

    def _settle_create(self, handle: Handle, room: int) -> None:
        """Before a call of ``handle`` goes over the socket (under the lock): a socket call
        carries no dependency, so kvd would run it on whatever room of the id lives -- the
        live incarnation a refused duplicate create was refused for. Wait until kvd ran the
        handle's create (kvd runs the ring's records before any socket call anyway) and
        raise its refusal (nothing sent). Raises ProtocolError (nothing sent) when kvd
        closed the handle's ring without running the create, and what :meth:`submit`
        raises with ``wait``. A ring of an earlier connection says what it read at the
        drop."""
        own = handle.ring
        if own is self.ring:
            try:
                if not own.done(handle.key):
                    own.wait_done(handle.key, self.timeout)
                own.collect_new()
            except RingClosed:
                with contextlib.suppress(ProtocolError):
                    own.collect()
                if handle.key not in own.unborn and not own.done(handle.key):
                    raise ProtocolError(
                        f"kvd closed the engine ring before it ran room {room}'s create: "
                        f"the room's later calls are not sent (they could act on another "
                        f"room of the id)") from None
            except (DaemonGone, TimeoutError, ProtocolError) as exc:
                self._ring_broken(exc)
        if handle.key in own.unborn:
            raise own.failed[handle.key]

    def handle_state(self, handle: Handle, wait: bool = False
                     ) -> tuple[bool, KvdError | None]:
        """``(settled, refusal)`` of ``handle``: settled once kvd ran every call of it and
        refused none, or once its ring is gone (kvd aborted the rooms it carried: the
        room's status says the rest); ``refusal``: the first refusal of the handle's
        calls. With ``wait``, block until kvd ran every call of it first (raises as
        :meth:`submit` with ``wait``)."""
        with self._ring_lock:
            ring = handle.ring
            if ring is not self.ring:
                return True, None
            try:
                if wait:
                    ring.wait_done(ring.last.get(handle.key, handle.key), self.timeout)
                return ring.handle(handle.key)
            except RingClosed:
                self._close_ring()
                return True, None
            except (DaemonGone, TimeoutError, ProtocolError) as exc:
                broken = _Broken(ring, exc, self._broken_why(exc))
        self._ring_broken_unlocked(broken)

    def wait_created(self, handle: Handle) -> None:
        """Block until kvd ran ``handle``'s create (at once if it did, or if its ring is
        gone); raises as :meth:`submit` with ``wait``."""
        with self._ring_lock:
            ring = handle.ring
            if ring is not self.ring or ring.done(handle.key):
                return
            try:
                ring.wait_done(handle.key, self.timeout)
                return
            except RingClosed:
                self._close_ring()
                return
            except (DaemonGone, TimeoutError, ProtocolError) as exc:
                broken = _Broken(ring, exc, self._broken_why(exc))
        self._ring_broken_unlocked(broken)

    def unborn(self, handle: Handle) -> bool:
        """Whether kvd refused ``handle``'s create itself (known once it ran)."""
        return handle.key in handle.ring.unborn

    def forget_handle(self, handle: Handle) -> None:
        """Drop what the ring keeps for ``handle`` (its room was cleared)."""
        with self._ring_lock:
            handle.ring.forget(handle.key)

    def submit_all(self, calls: list[rpc.RingCall],
                   wait: bool = True) -> dict[int, KvdError]:
        """Run ``calls`` (room calls) in order (issue 21: an adapter's step of room calls
        together). With ``wait``, wait ONCE for all of them: through the ring, one record
        each and one wait for the last; without a usable ring, one
        :class:`~kvd.protocol.rpc.Many` per ``rpc.MAX_MANY`` calls. Returns the first
        refusal of each room that had one (a room missing from it: every call of it ran),
        including a refusal of an earlier call of that room nobody waited for.

        Without ``wait`` (an engine step, P9) every call goes into the ring and this
        returns ``{}`` at once, no wait and no syscall while kvd is draining: a refusal
        comes back for its room, which then reads Failed on every read path
        (:func:`~kvd.client.poll_array`, :func:`~kvd.client.poll_many`,
        :func:`~kvd.client.wait_many`, the room object; :meth:`ring_refused`,
        :meth:`room_refusal`) until the room is cleared. A Clear kvd ran drops the room's
        kept refusals (a later room of the same id starts clean); a Clear kvd refused
        (the room's pages not releasable yet, K06: kvd aborts an unfinished room first)
        leaves the room in kvd, its pages held, reading Failed here until the engine
        clears it again once it is releasable. So an engine should clear only rooms the
        table shows ended (Success or Failed: releasable), as the waited form would
        tell it. A call larger than a record goes over the socket in its place in the
        order (its refusal kept for its room as well). Without a usable ring, or for the
        calls left when kvd closed the ring, it falls back to the waited form
        (``Many``) and returns their refusals.

        Raises ValueError (nothing sent) if a call has an integer outside its wire
        bounds (:func:`~kvd.protocol.rpc.check_bounds`), :class:`KvdUnreachable` as
        :meth:`call` does, and ProtocolError when kvd
        closed the ring before running waited calls (kvd aborted the rooms the ring
        carried; unwaited calls it never ran read as those rooms do then)."""
        if not calls:
            return {}
        for call in calls:  # nothing sent: a record kvd cannot decode fails the ring
            rpc.check_bounds(call)
        broken: _Broken | None = None
        with self._ring_lock:  # the ring alone while every call fits a record
            ring = self._usable_ring()
            try:
                if ring is not None and not wait:
                    calls = calls[self._submit_nowait(ring, calls, held=False):]
                    if not calls:
                        return {}  # else: a call past a record, or kvd closed the ring
                elif ring is not None and all(_fits(ring, c) for c in calls):
                    return self._submit_ring(ring, calls, held=False)
            except _Broken as exc:
                broken = exc
        if broken is not None:
            self._ring_broken_unlocked(broken)
        with self._lock, self._ring_lock:  # a call past a record goes by the socket, in order
            ring = self._usable_ring()
            try:
                if ring is not None and not wait:
                    calls = calls[self._submit_nowait(ring, calls, held=True):]
                    if not calls:
                        return {}
                elif ring is not None and all(ring.encode(c) is not None for c in calls):
                    return self._submit_ring(ring, calls, held=True)
            except _Broken as exc:
                broken = exc
        if broken is not None:
            self._ring_broken_unlocked(broken)
        refused: dict[int, KvdError] = {}
        for at in range(0, len(calls), rpc.MAX_MANY):
            chunk = calls[at:at + rpc.MAX_MANY]
            for call, out in zip(chunk, self.call_many(list(chunk)), strict=True):
                if isinstance(out, KvdError):
                    refused.setdefault(call.room, out)
        return refused

    def _submit_nowait(self, ring: EngineRing, calls: list[rpc.RingCall], held: bool) -> int:
        """:meth:`submit_all` without a wait (under the ring's lock; ``held``: the
        socket's too): each call a ring record (one larger than a record goes over the
        socket, in order, its refusal kept for its room -- with ``held``; without, this
        stops there); a Clear is noted so that its room's kept refusals go once kvd ran it
        unrefused. How many calls it took: fewer than all when kvd closed the ring (the
        rest are the caller's to send over the socket) or, without ``held``, at the first
        call past a record. Raises :class:`_Broken` for a ring that no longer serves."""
        done = 0
        try:
            for done, call in enumerate(calls):  # done: read after the loop
                data = ring.encode(call)
                if data is None:
                    if not held:
                        return done
                    try:
                        self._exchange(call, None)  # kvd drains the ring before it
                    except KvdUnreachable:
                        raise
                    except KvdError as exc:
                        ring.refused.setdefault(call.room, exc)
                    continue
                seq = ring.submit(data, call.room, self.timeout)
                if isinstance(call, rpc.Clear):
                    ring.clearing[seq] = call.room
        except RingClosed:
            self._close_ring()  # kvd aborted the rooms the ring carried
            return done
        except (DaemonGone, TimeoutError, ProtocolError) as exc:
            raise _Broken(ring, exc, self._broken_why(exc)) from exc
        return len(calls)

    def _submit_ring(self, ring: EngineRing, calls: list[rpc.RingCall],
                     held: bool) -> dict[int, KvdError]:
        """:meth:`submit_all` through ``ring`` (under the ring's lock; ``held``: the
        socket's too). Each record is encoded as it is submitted (its call id is the
        ring's head then); one that has grown past a record since the check (a longer id)
        goes over the socket, in order -- only with ``held``: without, every call fits a
        record whatever its id (:func:`_fits`). Raises :class:`_Broken` for a ring that
        no longer serves."""
        refused: dict[int, KvdError] = {}
        try:
            seq = -1
            for call in calls:
                data = ring.encode(call)
                if data is None:
                    if not held:
                        raise AssertionError("a call checked to fit a record did not")
                    try:
                        self._exchange(call, None)  # kvd drains the ring before it
                    except KvdUnreachable:
                        raise
                    except KvdError as exc:
                        refused.setdefault(call.room, exc)
                    continue
                seq = ring.submit(data, call.room, self.timeout)
            if seq >= 0:
                ring.wait_done(seq, self.timeout)
            ring.collect()
        except RingClosed as exc:
            self._close_ring()
            raise ProtocolError(f"kvd closed the engine ring before it ran a batch of "
                                f"{len(calls)} calls") from exc
        except (DaemonGone, TimeoutError, ProtocolError) as exc:
            raise _Broken(ring, exc, self._broken_why(exc)) from exc
        for c in calls:
            if c.room in ring.refused:
                refused.setdefault(c.room, ring.refused.pop(c.room))
        return refused

    def ring_refusal(self, room: int) -> KvdError | None:
        """The refusal of a call on ``room`` that :meth:`submit` did not wait for, handed
        out once (taken: a later call answers None), or None. The room still reads Failed
        on every read path (:meth:`room_refusal`, :meth:`ring_refused`) until it is
        cleared."""
        ring = self._collected()
        if ring is None:
            return None
        with self._ring_lock:
            # the Clears another thread's read found ran go first: a refusal taken now
            # came after them, and stays (:meth:`_drop_cleared`)
            self._drop_cleared(ring)
            refusal = ring.refused.pop(room, None)
            if refusal is not None:
                self._refusal_taken[room] = refusal
        return refusal

    def holds_refusals(self) -> bool:
        """Whether any refusal of a call :meth:`submit` did not wait for is kept (for a
        room or a handle): False lets a reader skip looking for one (no lock)."""
        ring = self.ring
        return bool(self._refusal_taken) or (
            ring is not None and bool(ring.refused or ring.failed))

    def room_refusal(self, room: int) -> KvdError | None:
        """The refusal kept for ``room`` (a call :meth:`submit` did not wait for that kvd
        refused), taken by :meth:`ring_refusal` or not; None when there is none. Kept until
        the room is cleared, by any path."""
        ring = self._collected()  # kept ones are read with no ring open too (K27)
        return (None if ring is None else ring.refused.get(room)) or \
            self._refusal_taken.get(room)

    def ring_refused(self, rooms: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_] | None:
        """Which of ``rooms`` (uint64, 1-D) hold a refusal of a call :meth:`submit` did not
        wait for (kept, not taken: the room object's ``failure()`` still names it); None
        when none does (the common case: no work per room). Such a room reads Failed for
        the engine on every read path (:func:`~kvd.client.poll_many`,
        :func:`~kvd.client.poll_array`, :func:`~kvd.client.wait_many`, the room object),
        though kvd itself may still hold it unfailed: its refused call never ran."""
        ring = self._collected()  # kept ones are read with no ring open too (K27)
        live = {} if ring is None else ring.refused
        if not (live or self._refusal_taken):
            return None
        # one C-level copy of each dict (another thread's collect may add to them)
        held = np.array([*live, *self._refusal_taken], dtype=np.uint64)
        hit = np.isin(rooms, held)
        return hit if hit.any() else None

    def _collected(self) -> EngineRing | None:
        """The ring with every completion kvd wrote read into its kept refusals (None: no
        ring, or it no longer reads)."""
        ring = self.ring
        if ring is None:
            return None
        if ring.comp.head != ring.inbox.tail or (  # a completion waits: read them all
                ring.clearing and (ring.refused or self._refusal_taken)):
            with self._ring_lock:
                if self.ring is not ring:
                    return None
                try:
                    ring.collect()
                except (ProtocolError, OSError):
                    return None
        if ring.cleared:
            with self._ring_lock:
                self._drop_cleared(ring)
        return ring

    def _drop_cleared(self, ring: EngineRing) -> None:
        """Drop the taken refusals of the rooms whose unwaited Clear ``ring`` found ran
        (under the ring's lock). Done before any refusal is taken: a refusal the same read
        found after the Clear is still in ``ring.refused`` then, and a refusal taken
        earlier came before the Clear. (Taken first, a later call's refusal was dropped
        as the Clear's: the room read unknown though its call never ran.)"""
        for room in ring.cleared:
            self._refusal_taken.pop(room, None)
        ring.cleared.clear()

    def _forget_refusals(self, rooms: list[int]) -> None:
        """``rooms`` were cleared: their kept refusals go with them (after every completion
        kvd wrote before the clear was read), so a room of the same id later starts clean."""
        ring = self._collected()
        for room in rooms if (ring is not None and ring.refused) or self._refusal_taken \
                else ():
            if ring is not None:
                ring.refused.pop(room, None)
            self._refusal_taken.pop(room, None)

    def _usable_ring(self) -> EngineRing | None:
        """The ring, if kvd is known alive (a fresh status table) and no reconnect waits."""
        ring, table = self.ring, self.table
        if ring is None or table is None or self._replay or self._sock is None or \
                self._sock is self._interrupted:  # an interrupt no call consumed: the
            return None  # socket reconnects first (:meth:`interrupt`)
        if not table.fresh(time.monotonic_ns(), self.stale_ns):
            return None  # kvd silent: the socket tells whether it is gone
        return ring

    def _ring_broken(self, exc: Exception) -> typing.NoReturn:
        """kvd's socket end closed, it ran nothing within ``timeout``, or its ring is
        corrupt: drop the connection (the next call reconnects and registers again).
        Under the socket's lock; :meth:`_ring_broken_unlocked` without it."""
        why = self._broken_why(exc)
        self._drop()
        raise KvdUnreachable(why, "KvdUnreachable") from exc

    def _ring_broken_unlocked(self, broken: _Broken) -> typing.NoReturn:
        """:meth:`_ring_broken` for a ring call that held only the ring's lock (and let go
        of it): drop the connection unless another thread did already (it then runs on
        a fresh one, with another ring)."""
        with self._lock, self._ring_lock:
            if self.ring is broken.ring:
                self._drop()
        raise KvdUnreachable(broken.why, "KvdUnreachable") from broken.exc

    def _broken_why(self, exc: Exception) -> str:
        """The message of a ring wait that ended with ``exc``: :meth:`interrupt` shut the
        socket down (the ring's wait sees the socket end close, as at kvd's death), no
        answer within ``timeout``, or what ``exc`` says."""
        interrupted = self._interrupted
        if isinstance(exc, DaemonGone) and interrupted is not None and \
                interrupted is self._sock:
            return (f"interrupted: KvdClient.interrupt() ended this call's wait on the "
                    f"engine ring ({self.path}); the next call reconnects")
        why = (f"no answer within {self.timeout:g}s" if isinstance(exc, TimeoutError)
               else str(exc))
        return f"kvd unreachable at {self.path}: {why}"

    def _open_ring(self) -> None:
        """Open this connection's rings (after a registration; under the lock). A kvd
        without them leaves room calls on the socket. A ring this registration replaced
        ran its records before kvd answered (its ``tail`` is final: the Backlog's rule,
        :meth:`_settle_dropped`)."""
        self._close_ring(keep=True)
        self._settle_dropped(keep=True)
        if not self.use_ring or self.table is None or self._sock is None:
            return
        fds: list[int] = []
        try:
            result: rpc.RingResult = self._roundtrip(self._ring_sizes, rpc.RingResult, fds)
            ring = EngineRing(result, fds, self._sock.fileno())
            fds = []  # the ring owns them
            with self._ring_lock:
                self.ring = ring
        except (KvdError, OSError, ValueError):
            self._close_ring(keep=True)  # an older or channel-less kvd: the socket carries calls
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _close_ring(self, keep: bool = False) -> None:
        """Drop the ring. ``keep`` (the connection dropped, or a registration replaces
        the ring): first read every completion kvd wrote into it and keep each room's
        refusal (:attr:`_refusal_taken`) -- kvd keeps the rooms of an engine that comes
        back within the grace (K27), and a call it refused must still read Failed then;
        a new kvd instance forgets them (:meth:`_served_by`). Without ``keep`` (kvd closed
        the ring: it aborted the rooms it carried) the kept refusals go. Takes the ring's
        lock (a ring call in progress ends first)."""
        with self._ring_lock:
            ring, self.ring = self.ring, None
            if ring is None:
                return
            if not keep:
                self._refusal_taken.clear()
                # kvd closed the ring: its tail is final, and a record past it never ran
                # (its room was never carried, so kvd aborted nothing of it)
                self._refusal_taken.update(
                    (room, exc) for room, exc in ring.refuse_unrun().items()
                    if room not in self._refusal_taken)
                ring.close()
                return
            with contextlib.suppress(ProtocolError):
                ring.collect()
            self._keep_refusals(ring)
            if ring.drained():  # kvd closed the ring (tail final), or every record ran
                ring.refuse_unrun()
                self._keep_refusals(ring)
                ring.close()
            else:  # kvd runs its records before it answers the next registration
                self._dropped_rings.append(ring)

    def _keep_refusals(self, ring: EngineRing) -> None:
        """Keep ``ring``'s refusals by room (:attr:`_refusal_taken`), its completions
        read (under the ring's lock): the connection dropped or the ring is replaced."""
        self._drop_cleared(ring)
        # an unwaited Clear kvd has not run yet runs after the drop (the engine's
        # records run in order before its reconnect, K41), and one it refuses then
        # fails the room in kvd: the refusals kept from before it go as if it ran (one
        # past the ring's final tail never ran: EngineRing.refuse_unrun)
        clearing = set(ring.clearing.values())
        for room in clearing:
            self._refusal_taken.pop(room, None)
        for room, refusal in ring.refused.items():
            if room not in clearing:
                self._refusal_taken.setdefault(room, refusal)
        ring.refused.clear()

    def read_table(self, rooms: npt.NDArray[np.uint64]) -> tuple[
            npt.NDArray[np.int8], npt.NDArray[np.bool_], npt.NDArray[np.bool_]] | None:
        """``(statuses, releasable, hit)`` of ``rooms`` (uint64, 1-D) from kvd's status
        table, no syscall (:meth:`StatusTable.read`); None when there is no fresh table
        (none mapped, closed, or its writer silent for ``stale_ns``), or while another
        thread is in a ring call: ask the socket. A room named by a ring record kvd has
        not run yet reads ``hit`` False (the table does not reflect that call yet; the
        socket's ``Poll`` runs it first): the table answers the others."""
        read = self._readable_table()
        if read is None:
            return None
        table, unrun = read
        statuses, releasable, hit = table.read(rooms)
        if unrun:
            hit = hit & ~np.isin(rooms, _ids(unrun))
        return statuses, releasable, hit

    def read_statuses(self, rooms: npt.NDArray[np.uint64]) -> tuple[
            npt.NDArray[np.int8], Misses] | None:
        """``(statuses, misses)`` of ``rooms`` from the status table: a poll's read
        (:meth:`StatusTable.read_statuses`: no ``releasable``, and the positions of the
        rooms it does not answer, those a ring record kvd has not run yet names among
        them); None where :meth:`read_table` answers None."""
        read = self._readable_table()
        if read is None:
            return None
        table, unrun = read
        statuses, misses = table.read_statuses(rooms)
        return statuses, (_unrun_missed(rooms, misses, unrun) if unrun else misses)

    def read_table_one(self, room: int) -> tuple[int, bool] | None:
        """``(status, releasable)`` of one room from the status table, or None: ask the
        socket (no fresh table, the table does not answer this room, a ring record kvd
        has not run yet names it, or another thread is in a ring call)."""
        read = self._readable_table()
        if read is None or room in read[1]:
            return None
        return read[0].read_one(room)

    def _readable_table(self) -> tuple[StatusTable, set[int]] | None:
        """The status table if a read of it answers now (mapped and fresh), and the rooms
        it cannot answer yet: those a ring record kvd has not run names (issue 21, P9: a
        poll right after a call not waited for answers every other room from the table;
        the socket's ``Poll`` runs the records first). The rooms are read before the
        table, so a room not named was published by kvd before the read. None while
        another thread holds the ring's lock with records unrun (a ring call in
        progress: the records are read under that lock; the socket answers instead of
        waiting for it)."""
        table = self.table
        if table is None or not table.fresh(time.monotonic_ns(), self.stale_ns):
            return None
        ring = self.ring
        if ring is None or ring.drained():
            return table, _NO_ROOMS
        if not self._ring_lock.acquire(blocking=False):
            return None
        try:
            if self.ring is not ring:
                return None  # replaced meanwhile (a reconnect): the socket
            return table, ring.unrun_rooms()
        finally:
            self._ring_lock.release()

    def _open_table(self) -> None:
        """Map kvd's status table (after a registration; under the lock). A kvd without
        one, or a table that does not check out, leaves polls on the socket."""
        self._close_table()
        if not self.use_table:
            return
        fds: list[int] = []
        try:
            result: rpc.TableResult = self._roundtrip(rpc.OpenTable(), rpc.TableResult, fds)
            if len(fds) != 1:
                raise ProtocolError(f"kvd sent {len(fds)} descriptors with its status table")
            self._table_map = mmap.mmap(fds[0], result.size, prot=mmap.PROT_READ)
            self.table = StatusTable.open(self._table_map)
        except (KvdError, OSError, ValueError):
            self._close_table()  # an older or channel-less kvd: the socket serves polls
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _close_table(self) -> None:
        self.table = None
        if self._table_map is not None:
            with contextlib.suppress(BufferError):  # a reader's view alive: the GC unmaps
                self._table_map.close()
            self._table_map = None

    def call_many(self, calls: list[rpc.NowCall]) -> list[Any]:
        """Several calls in ONE round trip (:class:`~kvd.protocol.rpc.Many`), run in order
        as if called one by one: each call's result (typed as :meth:`call` types it), or
        for a call that failed its exception object (returned, not raised: one room's
        refusal leaves the others' results). Raises :class:`KvdUnreachable` as
        :meth:`call` does, and ValueError for more than ``rpc.MAX_MANY`` calls, polls naming
        more than ``rpc.MAX_MANY_POLLED`` rooms together, or a call a Many cannot carry
        (``Wait``, ``RegisterKV``, ``Info``, ``Release``, ``Many``)."""
        if not calls:
            return []
        if len(calls) > rpc.MAX_MANY:
            raise ValueError(f"at most {rpc.MAX_MANY} calls in one Many, got {len(calls)}")
        for c in calls:
            if not isinstance(c, _NOW_CALLS):
                raise ValueError(f"a Many cannot carry {type(c).__name__} (only "
                                 f"{', '.join(t.__name__ for t in _NOW_CALLS)}): call it alone")
        many = rpc.Many(calls=list(calls))
        if many.polled() > rpc.MAX_MANY_POLLED:
            raise ValueError(f"the polls of one Many name at most {rpc.MAX_MANY_POLLED} rooms, "
                             f"got {many.polled()}: poll more alone")
        result: rpc.ManyResult = self.call(many)
        if len(result.outcomes) != len(calls):
            raise ProtocolError(f"Many answered {len(result.outcomes)} outcomes for "
                                f"{len(calls)} calls")
        out: list[Any] = []
        for call, outcome in zip(calls, result.outcomes, strict=True):
            if not outcome.ok:
                out.append(rpc.error_from(outcome.kind, outcome.error))
                continue
            kind = RESULT_TYPES.get(type(call))
            try:
                out.append(outcome.result if kind is None or outcome.result is None
                           else msgspec.convert(outcome.result, kind, strict=False))
            except msgspec.ValidationError as exc:
                name = getattr(kind, "__name__", "result")
                raise ProtocolError(f"malformed {name}: {exc}") from exc
            if isinstance(call, rpc.Poll):
                _check_answered(call.rooms, out[-1])
        return out

    def wait(self, rooms: list[int], timeout: float, any_done: bool = False) -> rpc.PollResult:
        """``Wait`` for up to ``timeout`` s (until every room ended, or with ``any_done``
        one of them), as several calls each shorter than the transport timeout; returns
        the last answer."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            chunk = max(min(remaining, self.timeout * WAIT_SHARE), 0.0)
            call = rpc.Wait(rooms=list(rooms), timeout=chunk, any_done=any_done)
            with self._lock:
                self._check_open(call)
                result = self._exchange(call, rpc.PollResult)
            pending = _pending(rooms, result)
            done = pending < len(rooms) if any_done else pending == 0
            if remaining <= chunk or done:
                return result

    def _exchange(self, call: rpc.Call, kind: type | None) -> Any:
        """One call (its result decoded as ``kind``, None: plain), registering again first
        after a reconnect. A connection that was already open and turns out dead (kvd
        restarted since) is retried once on a fresh one: the old daemon is gone, so the
        new one has not seen the request. Not one that timed out (a stalled kvd may still
        run the call: it would run twice, and the caller would wait twice its timeout) nor
        one :meth:`interrupt` ended (the caller wants the call over)."""
        for attempt in (0, 1):
            if self._sock is not None and self._sock is self._interrupted:
                self._drop()  # an interrupt that ended no call: consumed by a reconnect
            sock = self._sock
            try:
                if self._replay and self._registration is not None and \
                        not isinstance(call, rpc.RegisterKV):
                    self._served_by(self._roundtrip(self._registration, rpc.RegisterResult))
                    self.reconnects += 1
                    self._replay = False
                    self._open_table()
                    self._open_ring()
                self._collect_first()
                return self._roundtrip(call, kind)
            except KvdUnreachable as exc:
                cause = exc.__cause__
                timed_out = isinstance(cause, OSError) and cause.errno in _TIMED_OUT
                if sock is None or attempt or timed_out or sock is self._interrupted:
                    raise
        raise AssertionError("unreachable")

    def _collect_first(self) -> None:
        """Before a socket call (under the lock): read every completion kvd wrote if the
        ring holds calls kvd has not run. kvd runs them all before the socket call and
        cannot wait for this thread, blocked in the call, to read a completion: with the
        completion ring read empty here, its ``capacity`` slots hold a refusal for each
        call still in the submission ring (at most ``capacity``), so kvd never meets a
        full one (it would fail the ring, aborting the rooms it carried). Skipped while
        another thread holds the ring's lock (a ring call in progress): that thread
        reads the completions before each record it publishes, and publishes only while
        unread completions plus unrun records leave a slot
        (:meth:`~kvd.client.ring.EngineRing.submit`), so the bound holds without this
        read. A corrupt completion ring drops the connection (:meth:`_ring_broken`: the
        call is retried on a fresh one)."""
        ring = self.ring
        if ring is None or ring.drained() or not self._ring_lock.acquire(blocking=False):
            return
        try:
            if self.ring is ring:
                ring.collect()
        except ProtocolError as exc:
            self._ring_broken(exc)
        finally:
            self._ring_lock.release()

    def _roundtrip(self, call: rpc.Call, kind: type | None,
                   fds_in: list[int] | None = None) -> Any:
        """One request and its reply; the result decoded as ``kind`` (None: plain).
        With ``fds_in``, descriptors that ride with the reply are appended to it."""
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
            reply = rpc.decode_raw_reply(self._read_frame(sock, fds_in))
        except OSError as exc:
            self._drop()
            why = (f"no answer within {self.timeout:g}s" if exc.errno in _TIMED_OUT
                   else str(exc))
            raise KvdUnreachable(f"kvd unreachable at {self.path}: {why}",
                                 "KvdUnreachable") from exc
        except ProtocolError:
            self._drop()
            raise
        if reply.id == 0 and not reply.ok:  # kvd could not decode the request: its reason
            raise _error_from_reply(reply)
        if reply.id != req_id:
            raise ProtocolError(f"reply id {reply.id} does not match request {req_id}")
        if not reply.ok:
            raise _error_from_reply(reply)
        try:
            result = (_DECODERS[kind] if kind is not None else _ANY).decode(reply.result)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed {getattr(kind, '__name__', 'reply')}: "
                                f"{exc}") from exc
        if isinstance(call, rpc.Poll | rpc.Wait):
            _check_answered(call.rooms, result)
        return result

    def _drop(self) -> None:
        """Close the connection (under the socket's lock; takes the ring's: a ring call's
        wait polls the socket, which is closed only once no ring call is in progress)."""
        with self._ring_lock:
            self._close_table()  # this daemon's table: a new connection may reach another
            self._close_ring(keep=True)
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._rbuf.clear()
            self._replay = self._registration is not None

    def _read_frame(self, sock: socket.socket, fds_in: list[int] | None = None) -> bytes:
        """The next reply frame: usually ONE ``recv`` for header and body (``recvmsg``
        with ``fds_in``: descriptors are kept there)."""
        buf, size = self._rbuf, rpc.LENGTH.size
        while True:
            if len(buf) >= size:
                (length,) = rpc.LENGTH.unpack_from(buf)
                if len(buf) >= size + length:
                    frame = bytes(buf[size:size + length])
                    del buf[:size + length]
                    return frame
            if fds_in is None:
                chunk = sock.recv(1 << 16)
            else:
                chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, rpc.MAX_FDS)
                fds_in += fds
            if not chunk:
                raise ConnectionError("kvd closed the connection")
            buf += chunk

    def interrupt(self) -> None:
        """From another thread: end the call in progress on this connection now (it raises
        :class:`KvdUnreachable`; the next call reconnects). For a long ``Wait`` that is no
        longer needed. The call is not sent again on a fresh connection. With no call in
        flight (neither the socket's lock nor the ring's held) it ends nothing; one that
        races a call's end leaves the socket shut with no call to fail, and the next call
        drops it and reconnects (:meth:`_exchange`, :meth:`_usable_ring`) instead of
        failing as interrupted."""
        sock = self._sock
        if sock is None:
            return
        if self._lock.acquire(blocking=False):  # no socket call in progress
            try:
                if self._ring_lock.acquire(blocking=False):  # nor a ring call
                    self._ring_lock.release()
                    return
            finally:
                self._lock.release()
        self._interrupted = sock  # the call on it fails: not retried on a fresh one
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Say goodbye and close the connection: kvd fails this engine's rooms and releases
        its memory at once (a dropped connection instead keeps them for the reconnect
        grace period). Room objects made before then read Failed, their ``failure()``
        naming the close (a new :attr:`epoch`, as after a kvd restart: K27). Until a call
        reopens the client, reads of room statuses by id raise :class:`KvdUnreachable`
        naming the close (the poll helpers read Failed; :meth:`_check_open`); any other
        call (a registration, a room call) reopens it: it reconnects and registers
        again."""
        with self._lock:
            if self._sock is not None and self._registration is not None:
                with contextlib.suppress(KvdError):
                    self._collect_first()
                    self._roundtrip(rpc.Release(), None)
            self._drop()
            with self._ring_lock:
                self._settle_dropped(keep=False)
                self._refusal_taken.clear()  # kvd fails and forgets the rooms at a goodbye
            why = ("the engine closed its kvd client (KvdClient.close()): kvd failed its "
                   "rooms at the goodbye")
            self._end_epoch("aborted", why)
            self.closed = why


class _Broken(Exception):
    """A ring call found the ring no longer serving (kvd's socket end closed, no answer,
    a corrupt ring) while holding only the ring's lock: ``why`` is the KvdUnreachable's
    message once the connection is dropped (:meth:`KvdClient._ring_broken_unlocked`)."""

    def __init__(self, ring: EngineRing, exc: Exception, why: str) -> None:
        super().__init__(why)
        self.ring, self.exc, self.why = ring, exc, why


#: How many bytes a record's call id may grow by from the one it was encoded with (a
#: msgpack integer takes 1 to 9 bytes).
_ID_GROWTH = 8


#: :meth:`KvdClient._readable_table`'s rooms when no ring record waits (never changed)
_NO_ROOMS: set[int] = set()


def _ids(rooms: set[int]) -> npt.NDArray[np.uint64]:
    return np.fromiter(rooms, dtype=np.uint64, count=len(rooms))


def _unrun_missed(rooms: npt.NDArray[np.uint64], misses: Misses,
                  unrun: set[int]) -> Misses:
    """``misses`` (positions in ``rooms`` the table does not answer) with the positions
    of the rooms in ``unrun`` added, in order (up to :data:`~kvd.protocol.table.FEW`
    rooms in plain Python, as the table reads them)."""
    if len(rooms) <= FEW:
        missed = set(misses)
        return [i for i, room in enumerate(rooms.tolist()) if room in unrun or i in missed]
    stale = np.isin(rooms, _ids(unrun))
    stale[misses] = True
    return np.flatnonzero(stale) if stale.any() else []


def _fits(ring: EngineRing, call: rpc.RingCall) -> bool:
    """Whether ``call`` fits a record of ``ring`` whatever call id it gets."""
    data = ring.encode(call)
    return data is not None and len(data) + _ID_GROWTH <= ring.max_payload


def _cleared(call: rpc.Call) -> list[int]:
    """The rooms a Clear (or the Clears of a Many) names."""
    if isinstance(call, rpc.Clear):
        return [call.room]
    if isinstance(call, rpc.Many):
        return [c.room for c in call.calls if isinstance(c, rpc.Clear)]
    return []


def _check_answered(rooms: list[int], result: rpc.PollResult) -> None:
    """Raise ProtocolError unless kvd answered one status per room asked (a short answer
    would read as another room's status, or fail later as an IndexError)."""
    if len(result.statuses) != len(rooms):
        raise ProtocolError(f"kvd answered {len(result.statuses)} statuses for "
                            f"{len(rooms)} rooms")


def _pending(rooms: list[int], result: rpc.PollResult) -> int:
    """How many rooms are still in flight (or, on decode, their pages not releasable)?"""
    free = set(result.releasable)
    return sum(s in (1, 2, 3) or room not in free
               for room, s in zip(rooms, result.statuses, strict=True))
