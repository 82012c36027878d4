"""The decode side of the room protocol (receivers) as a pure state machine.

A room on a decode rank moves ``Bootstrapping`` (resolving the prefill ranks
it needs) → ``WaitingForInput`` (as SGLang's receiver: the engine gives its
destination pages, kvd sends them to every target, the prefill ranks write)
→ ``Success`` once every target reported Success for this incarnation (their
last chunk and aux have landed by then); any state may move to ``Failed``.

Rules this module guarantees (tested in ``tests/unit/rooms``):

* **Incarnations.** Each ``Receiver(room)`` is a new incarnation (``inc``), numbered
  apart from every other instance's (:func:`first_incarnation`); every message about
  it carries ``inc``, and a status naming another incarnation or coming from another
  instance of the target than the one resolved is dropped and counted (K26, K28) —
  the latter also fails the room at once: that target restarted.
* **Success** only when every target reported Success for this incarnation.
* **Any end cancels every writer.** Whatever ends a room here (a target's
  failure, a deadline, bad aux, the engine, a lost peer), every target that has
  not itself reported the end gets a :class:`~kvd.protocol.control.RoomAbort`
  (K22, K29), including targets resolved after the room ended (K34).
* **Release safety.** A room's pages become releasable only when it succeeded,
  when they never left this rank, when every target they were sent to confirmed
  that no write is in flight (``quiesced``), or ``release`` seconds after the write
  bound every target was given (``RoomPages.write_within``), which the prefill side
  enforces too (K06, K22). ``clear`` refuses a room whose pages are not releasable.
* **Every region written by one room (K42).** A room's destination regions -- KV pages,
  its aux slot and, for hybrid models, its state slot and window pages -- are distinct,
  and no region is named by two rooms of this rank whose pages are not releasable:
  ``init`` refuses either, naming the region kind, the index and the room holding it
  (one claim table keyed by ``(region kind, index)``, :class:`~kvd.rooms.claims.Claims`).
  A releasable room's regions (ended, nothing in flight) are free for the next room.
* **Termination.** Every non-terminal room has a deadline (:class:`Timeouts`);
  :meth:`ReceiverRooms.tick` fails it when passed, whatever happened to the tasks
  performing its effects; a failed send fails its room at once (K32).
* **Work per change (K41).** Every step records the rooms whose poll answer it may have
  changed (:attr:`ReceiverRooms.changed`, drained by :meth:`ReceiverRooms.take_changed`):
  the daemon re-publishes only those to the status table. :meth:`ReceiverRooms.tick`
  looks only at rooms with something due (:class:`~kvd.rooms.deadlines.Deadlines`), and
  makes the same decisions at the same ``now`` as a walk over every room would.
* **Engine release.** When the engine goes (:meth:`ReceiverRooms.engine_released`) its
  rooms are aborted and kept until :meth:`ReceiverRooms.quiet` -- the release rule above,
  applied to the whole pool -- and only then may the daemon unregister the pool and a new
  one be registered, possibly at the same addresses: no write of an old room lands in it
  (K44). The daemon runs this rule; it does not re-implement it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvd.errors import LayoutError, ProtocolError, RoomError
from kvd.protocol import control
from kvd.protocol.codec import unpack_indices
from kvd.rooms.claims import AUX, PAGE, STATE, WINDOW, Claims
from kvd.rooms.deadlines import Deadlines, Key, after
from kvd.rooms.effects import AbortUnknown, Effect, Ended, Resolve, Send, Wake, WriteAux
from kvd.rooms.state import TERMINAL, FailureKind, KVPoll, RoomFailure, Timeouts
from kvd.transfer.plan import Pages, check_page_range

ORIGIN = "decode"


@dataclass(frozen=True)
class Target:
    """A prefill rank a room needs: its control endpoint and instance, how many decode
    ranks it feeds for the room, and whether it is an MLA dummy (sends no KV)."""

    endpoint: str
    instance: str
    required: int = 1
    is_dummy: bool = False


@dataclass
class ReceiverRoom:
    """Decode-side state of one incarnation of one room (times: monotonic s)."""

    room: int
    inc: int
    bootstrap_addr: str
    dp_rank: int | None
    created: float
    since: float
    status: KVPoll = KVPoll.Bootstrapping
    failure: RoomFailure | None = None
    dst_pages: bytes | None = None
    pages: Pages | None = None                         # dst_pages unpacked (int64)
    aux_index: int = 0
    first_page: int = 0
    state_index: int = -1                              # hybrid models: the state slot
    window_pages: bytes = b""                          # and window pages (int32 LE)
    targets: tuple[Target, ...] | None = None
    sent: set[str] = field(default_factory=set)        # RoomPages handed to a send
    successes: set[str] = field(default_factory=set)
    quiesced: set[str] = field(default_factory=set)    # confirmed: no write in flight
    told: set[str] = field(default_factory=set)        # know the room ended
    write_deadline: float | None = None
    release_seen: bool = False
    via: str | None = None   # instance named by the bootstrap lookup it was resolved from
    regions: dict[str, Pages] = field(default_factory=dict)  # claimed at init, by kind

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def releasable(self, now: float, timeouts: Timeouts) -> bool:
        """May the engine reuse this room's pages? See the module docstring."""
        if self.status == KVPoll.Success:
            return True
        if self.status != KVPoll.Failed:
            return False
        if not self.sent or self.sent <= self.quiesced:
            return True
        bound = self.write_deadline if self.write_deadline is not None else self.since
        return now >= max(bound, self.since) + timeouts.release

    def deadline(self, timeouts: Timeouts) -> float | None:
        limit = timeouts.limit(self.status)
        return None if limit is None else self.since + limit


def first_incarnation(instance: str) -> int:
    """Where instance ``instance`` starts numbering incarnations: 1 + 2**24 * (32 bits of
    a hash of the instance id). Two instances of a decode daemon at one endpoint thus
    number their rooms apart (unless one creates 2**24 rooms and their hashes fall that
    close, about 2**-31), so a status sent to a previous instance, delivered to the new
    one after a restart, names no incarnation of it and is dropped (K28)."""
    digest = hashlib.blake2b(instance.encode(), digest_size=4).digest()
    return 1 + (int.from_bytes(digest, "big") << 24)


@dataclass(frozen=True)
class Poll:
    """What the engine sees of a room."""

    status: KVPoll
    failure: RoomFailure | None
    releasable: bool


class ReceiverRooms:
    """Every receiver of one decode rank.

    ``endpoint``/``instance`` name this daemon on the control plane. Engine events:
    :meth:`create`, :meth:`init`, :meth:`abort`, :meth:`clear`. Results:
    :meth:`resolved`, :meth:`resolve_failed`, :meth:`send_failed`. Peer events:
    :meth:`on_status`, :meth:`peer_lost`. Time: :meth:`tick`. Each returns the
    effects to perform, in order; engine events raise :class:`RoomError` for calls
    the engine got wrong (with the effects of whatever the call still changed).
    ``num_pages``, ``num_aux_slots``, ``aux_sizes`` (bytes per aux item, per buffer),
    ``num_state_slots`` and ``num_window_pages`` (hybrid models; 0: none registered)
    describe the local pool once the engine registered.
    """

    def __init__(self, endpoint: str, instance: str, timeouts: Timeouts | None = None,
                 first_inc: int | None = None) -> None:
        self.endpoint = endpoint
        self.instance = instance
        self.timeouts = timeouts or Timeouts()
        self.num_pages = 0
        self.num_aux_slots = 0
        self.aux_sizes: tuple[int, ...] = ()
        self.num_state_slots = 0
        self.num_window_pages = 0
        self.rooms: dict[int, ReceiverRoom] = {}
        self.dropped: Counter[str] = Counter()
        self._incs = itertools.count(first_inc if first_inc is not None else
                                     first_incarnation(instance))
        # (region kind, index) -> (room, incarnation) that last named it; checked lazily
        # against the room's releasability, so it needs no update when regions free up.
        self.claims = Claims()
        self.released = False  # the engine's pool is going away (engine_released)
        #: rooms whose :meth:`poll` answer may have changed since :meth:`take_changed`
        self.changed: set[int] = set()
        self.deadlines = Deadlines()  # when each incarnation next needs the sweep
        self._by_addr: dict[str, set[int]] = {}  # bootstrap address -> its rooms
        self.looked = 0  # rooms the sweep examined, all ticks together (tests count it)

    # ---- engine events ----------------------------------------------------------------

    def create(self, room: int, bootstrap_addr: str, dp_rank: int | None,
               now: float) -> list[Effect]:
        """``Receiver(room, bootstrap_addr)``: a new incarnation. Raises RoomError if the
        room is in flight, or if its previous incarnation's pages are not releasable."""
        if self.released:
            raise RoomError(f"room {room}: the engine released its KV pool; register it "
                            f"again first")
        old = self.rooms.get(room)
        if old is not None and not old.done:
            raise RoomError(f"room {room} already active on this decode rank (duplicate room)")
        if old is not None and not old.releasable(now, self.timeouts):
            raise RoomError(f"room {room}: the previous attempt's pages are not releasable "
                            f"yet (a prefill write may be in flight); wait for it, clear it, "
                            f"then create the room again")
        if old is not None:
            self._unindex(old)
        r = ReceiverRoom(room, next(self._incs), bootstrap_addr, dp_rank, now, now)
        self.rooms[room] = r
        self._by_addr.setdefault(bootstrap_addr, set()).add(room)
        self._touch(r)
        return [Resolve(room, r.inc, bootstrap_addr, dp_rank)]

    def init(self, room: int, dst_pages: bytes, aux_index: int, now: float,
             first_page: int = 0, state_index: int = -1,
             window_pages: bytes = b"") -> list[Effect]:
        """``receiver.init``: destination pages (int32 LE bytes), aux slot, the first
        room page they receive (``first_page``: the pages before it are already here) and,
        for hybrid models, the state slot (-1: none) and window pages (int32 LE bytes).
        Raises RoomError for an unknown room, a second init, an index out of range, more
        pages than a RoomPages carries, a region named twice, or a region (page, aux slot,
        state slot, window page) a live room of this rank holds (K42)."""
        r = self._room(room)
        if first_page < 0:
            raise RoomError(f"room {room}: first_page {first_page} < 0")
        try:
            pages = unpack_indices(dst_pages)
        except ProtocolError as exc:
            raise RoomError(f"room {room}: {exc}") from exc
        try:
            check_page_range(pages, self.num_pages, f"room {room} destination")
        except LayoutError as exc:
            raise RoomError(str(exc)) from exc
        if self.num_aux_slots and not 0 <= aux_index < self.num_aux_slots:
            raise RoomError(f"room {room}: aux_index {aux_index} outside "
                            f"[0, {self.num_aux_slots})")
        if r.dst_pages is not None:
            raise RoomError(f"room {room}: init called twice")
        if len(window_pages) % 4 or len(window_pages) > 4 * control.MAX_WINDOW_PAGES:
            raise RoomError(f"room {room}: window pages must be at most "
                            f"{control.MAX_WINDOW_PAGES} int32 indices")
        if pages.size > control.MAX_ROOM_PAGES:  # no peer would take its RoomPages (K16)
            raise RoomError(f"room {room}: {pages.size} destination pages, more than the "
                            f"{control.MAX_ROOM_PAGES} one room may name")
        self._claim(r, self._regions(pages, aux_index, state_index, window_pages), now)
        r.dst_pages, r.pages, r.aux_index, r.first_page = dst_pages, pages, aux_index, first_page
        r.state_index, r.window_pages = state_index, window_pages
        out: list[Effect] = []
        self._send_pages(r, now, out)
        return out

    def abort(self, room: int, reason: str, now: float, bootstrap_addr: str | None = None,
              dp_rank: int | None = None) -> list[Effect]:
        """The engine ends the room (Failed, aborted; every target is told). For a room
        this rank does not know, an abort naming ``bootstrap_addr`` still reaches the
        prefill ranks (K34)."""
        r = self.rooms.get(room)
        out: list[Effect] = []
        failure = RoomFailure(FailureKind.ABORTED, f"room {room} aborted on decode: {reason}",
                              ORIGIN)
        if r is None:
            if bootstrap_addr:
                out.append(AbortUnknown(room, bootstrap_addr, dp_rank, failure))
            return out
        self._fail(r, failure, now, out)
        return out

    def clear(self, room: int, now: float) -> list[Effect]:
        """Forget a room (an unfinished one is aborted first). Raises RoomError, and
        keeps the room, while its pages are not releasable (K06); the error carries the
        abort's effects (its prefill ranks must hear it, K22)."""
        r = self.rooms.get(room)
        if r is None:
            return []
        out = [] if r.done else self.abort(room, "cleared before it finished", now)
        if not r.releasable(now, self.timeouts):  # the abort's effects still happen
            raise RoomError(f"room {room}: pages not releasable yet (a prefill write may be "
                            f"in flight); wait for the room, then clear", out)
        self._forget(r)
        return out

    def engine_released(self, now: float, failure: RoomFailure | None = None
                        ) -> list[Effect]:
        """The engine went away (``failure`` None: every unfinished room is aborted), or
        its registration is dropped because its memory no longer stands (every unfinished
        room fails with ``failure``, kind ``layout``, case S16); its targets are told, and
        no room can be created until :meth:`engine_registered`. The engine's memory must stay
        registered until :meth:`quiet`: a new pool may be registered at the same addresses
        (the same shm remapped, the same device memory), so no write bound to a room of the
        old registration may start or land once it is (K44; a restarted decode daemon is
        K28). Then the daemon unregisters it and calls :meth:`forget_rooms`."""
        self.released = True
        out: list[Effect] = []
        for room in [k for k, r in self.rooms.items() if not r.done]:
            if failure is None:
                out += self.abort(room, "engine disconnected", now)
            else:
                self._fail(self.rooms[room], failure, now, out)
        return out

    def quiet(self, now: float) -> bool:
        """Nothing can still be written into the released pool: every room's pages are
        releasable (their targets confirmed quiescence, or the write bound they were
        given plus the release margin passed)."""
        return all(r.releasable(now, self.timeouts) for r in self.rooms.values())

    def forget_rooms(self) -> None:
        """After :meth:`quiet`: forget every room of the released pool (late statuses about
        them are dropped as stale)."""
        self.changed.update(self.rooms)
        self.rooms.clear()
        self._by_addr.clear()
        self.deadlines.clear()
        self.num_pages = self.num_aux_slots = self.num_state_slots = self.num_window_pages = 0
        self.aux_sizes = ()
        self.claims.reset({})  # the memory they named is gone

    def engine_registered(self, num_pages: int, num_aux_slots: int,
                          aux_sizes: tuple[int, ...], num_state_slots: int = 0,
                          num_window_pages: int = 0) -> None:
        """The engine registered a pool (again): its size (pages, aux slots, bytes per aux
        item per buffer, state slots, window pages); rooms can be created again."""
        self.num_pages, self.num_aux_slots, self.aux_sizes = num_pages, num_aux_slots, aux_sizes
        self.num_state_slots, self.num_window_pages = num_state_slots, num_window_pages
        self.released = False

    # ---- results ----------------------------------------------------------------------

    def resolved(self, room: int, inc: int, targets: list[Target], now: float,
                 via: str | None = None) -> list[Effect]:
        """The prefill ranks of ``room`` are known and this rank is registered with each;
        ``via``: the instance the bootstrap lookup they came from named (None: unknown)."""
        r = self._current(room, inc)
        out: list[Effect] = []
        if r is None or r.targets is not None:
            return out
        r.targets, r.via = tuple(targets), via
        if r.done:  # ended while resolving: the prefill ranks must hear it (K34)
            self._abort_targets(r, out)
            return out
        if self._overdue(r, now, out):  # too late: no new deadline for it
            return out
        r.status, r.since = KVPoll.WaitingForInput, now
        self._touch(r)
        self._send_pages(r, now, out)
        return out

    def resolve_failed(self, room: int, inc: int, failure: RoomFailure,
                       now: float) -> list[Effect]:
        """The bootstrap lookup or the registration failed."""
        r = self._current(room, inc)
        out: list[Effect] = []
        if r is not None:
            self._fail(r, failure, now, out)
        return out

    def send_failed(self, room: int, inc: int, endpoint: str, failure: RoomFailure,
                    now: float) -> list[Effect]:
        """The room's pages could not be delivered to ``endpoint`` (the send failed or was
        abandoned; nothing reached the peer): the room fails now, not at its deadline
        (K32), and that target cannot hold its pages back from being releasable."""
        r = self._current(room, inc)
        out: list[Effect] = []
        if r is None:
            return out
        # Only RoomPages name their room: that message never left, so this target has no
        # pages to write into and need not confirm anything before they are releasable.
        r.sent.discard(endpoint)
        if not r.done:
            r.told.add(endpoint)  # it did not take our messages; do not queue more
            self._fail(r, failure, now, out)
        elif r.status == KVPoll.Failed and not r.release_seen and \
                r.releasable(now, self.timeouts):
            r.release_seen = True
            out.append(Wake())
        self._touch(r)  # one target fewer to wait for: maybe releasable sooner
        return out

    # ---- peer events ------------------------------------------------------------------

    def on_status(self, msg: control.RoomStatus, now: float) -> list[Effect]:
        """A prefill rank's final word (or quiescence confirmation) on the room."""
        out: list[Effect] = []
        r = self._current(msg.room, msg.inc)
        if r is None:
            self.dropped["stale"] += 1
            return out
        target = next((t for t in r.targets or () if t.endpoint == msg.endpoint), None)
        if target is None:
            self.dropped["unbound"] += 1
            return out
        if target.instance != msg.instance_id:
            # Not trusted (nor as quiescence), but telling: the pages went to whatever
            # instance listens at that endpoint, so the one this room was sent to is gone.
            self.dropped["stale_instance"] += 1
            self._fail(r, RoomFailure(FailureKind.PEER, f"room {r.room}: prefill rank "
                                      f"{msg.endpoint} answered as instance {msg.instance_id}"
                                      f", not {target.instance}: it restarted", ORIGIN),
                       now, out)
            return out
        status = KVPoll(msg.status) if msg.status in (0, 4) else None
        if status is None:
            self.dropped["malformed"] += 1
            return out
        if msg.quiesced or status == KVPoll.Success:
            self._confirm(r, msg.endpoint, now, out)
        if r.done:
            return out
        r.told.add(msg.endpoint)
        if status == KVPoll.Failed:
            kind = FailureKind.parse(msg.kind)
            reason = msg.reason or f"room {r.room}: failed on {msg.endpoint}"
            self._fail(r, RoomFailure(kind, reason, "prefill"), now, out)
            return out
        if msg.aux:  # counted as a success once the slot is written (aux_written)
            self._aux(r, msg, now, out)
            return out
        self._succeeded(r, msg.endpoint, now, out)
        return out

    def aux_written(self, room: int, inc: int, endpoint: str, failure: RoomFailure | None,
                    now: float) -> list[Effect]:
        """The :class:`WriteAux` of ``endpoint``'s Success for incarnation ``inc`` returned
        (``failure`` None: every aux buffer holds the payload). A refused write fails the
        room (case S16: the engine shrank its aux memory): a decode never reports Success
        for a room whose aux it could not write."""
        out: list[Effect] = []
        r = self._current(room, inc)
        if r is None or r.done:
            return out
        if failure is not None:
            self._fail(r, failure, now, out)
        else:
            self._succeeded(r, endpoint, now, out)
        return out

    def _succeeded(self, r: ReceiverRoom, endpoint: str, now: float,
                   out: list[Effect]) -> None:
        """Target ``endpoint``'s bytes (and aux) landed; Success once every target's did."""
        r.successes.add(endpoint)
        if {t.endpoint for t in r.targets or ()} <= r.successes:
            r.status, r.since = KVPoll.Success, now
            self._touch(r)
            out.append(Ended(r.room, r.inc, KVPoll.Success, None, self._peer(r), r.created))
            out.append(Wake())

    def peer_lost(self, bootstrap_addr: str, failure: RoomFailure, now: float,
                  keep: str | None = None, endpoint: str | None = None) -> list[Effect]:
        """Fail every unfinished room fed by ``bootstrap_addr`` (it stopped answering, or
        it restarted: rooms resolved before that are bound to an instance that is gone).
        Its prefill ranks are still told (queued behind the pages), so a frozen prefill
        that resumes drops them.

        ``keep`` (a restart, the new instance): rooms still resolving and rooms resolved
        from a lookup naming ``keep`` are spared -- they are not bound to the old
        instance (K37). ``endpoint``: only rooms with a target at that rank endpoint
        whose instance is not ``keep`` (one rank restarted)."""
        return self.fail_rooms(self.lost_rooms(bootstrap_addr, keep, endpoint), failure, now)

    def lost_rooms(self, bootstrap_addr: str, keep: str | None = None,
                   endpoint: str | None = None) -> list[Key]:
        """The incarnations :meth:`peer_lost` fails (a read: nothing changes), found
        through the index of rooms by bootstrap address (work per room of that address,
        not per room held). The daemon fails them with :meth:`fail_rooms` a slice per loop
        turn (K41)."""
        out: list[Key] = []
        for room in sorted(self._by_addr.get(bootstrap_addr, ())):
            r = self.rooms[room]
            if r.done:
                continue
            if (keep is not None or endpoint is not None) and not _bound_elsewhere(
                    r, keep, endpoint):
                continue
            out.append((r.room, r.inc))
        return out

    def fail_rooms(self, keys: list[Key], failure: RoomFailure, now: float) -> list[Effect]:
        """Fail each incarnation of ``keys`` that is still current and unfinished (one
        that ended, or was created again, since they were chosen is left alone)."""
        out: list[Effect] = []
        for room, inc in keys:
            r = self._current(room, inc)
            if r is not None:
                self._fail(r, failure, now, out)
        return out

    def target_lost(self, endpoint: str, instance: str, failure: RoomFailure,
                    now: float) -> list[Effect]:
        """Fail every unfinished room resolved to prefill rank ``endpoint`` as
        ``instance`` (it refused this rank's registration: K16). Rooms resolved to another
        instance at the same endpoint, and rooms not resolved yet, are untouched: a
        room that resolves after the change is known never fails because of the old
        instance."""
        out: list[Effect] = []
        for r in list(self.rooms.values()):
            if not r.done and any(t.endpoint == endpoint and t.instance == instance
                                  for t in r.targets or ()):
                self._fail(r, failure, now, out)
        return out

    def resend_to(self, endpoint: str, instance: str, now: float) -> list[Effect]:
        """Prefill rank ``endpoint`` (``instance``) dropped this rank's messages because it
        held no registration of it (a typed ``unregistered`` refusal, K16): once the
        daemon registered again, the pages of every unfinished room bound to that
        instance are sent again (the prefill takes a repeated page message of a room
        it already bound as a duplicate). Rooms past their deadline fail instead."""
        out: list[Effect] = []
        for r in list(self.rooms.values()):
            if r.done or not any(t.endpoint == endpoint and t.instance == instance
                                 for t in r.targets or ()) or endpoint not in r.sent:
                continue
            if self._overdue(r, now, out):
                continue
            deadline = r.deadline(self.timeouts)
            assert deadline is not None and r.dst_pages is not None
            for t in r.targets or ():
                if t.endpoint == endpoint:
                    out.append(Send(t.endpoint, t.instance, self._pages_msg(r, t, deadline, now),
                                    r.room, r.inc))
        return out

    # ---- time and reads ---------------------------------------------------------------

    def tick(self, now: float) -> list[Effect]:
        """Deadlines; wake waiters when a failed room's pages free up; drop finished
        rooms the engine never cleared."""
        out: list[Effect] = []
        for room, inc in self.deadlines.due(now):
            r = self._current(room, inc)
            if r is not None:
                self.look(r, now, out)
        return out

    def look(self, r: ReceiverRoom, now: float, out: list[Effect]) -> None:
        """The sweep's rule for one room at ``now``: fail it past its deadline; wake
        waiters once a failed room's pages are releasable; forget a finished room the
        engine left uncleared for ``finished_ttl``. :meth:`tick` applies it to the rooms
        :meth:`_next_look` said may be due; applied to every room it changes nothing more
        (tested)."""
        self.looked += 1
        if self._overdue(r, now, out):
            return
        if r.done:
            releasable = r.releasable(now, self.timeouts)
            if releasable and not r.release_seen and r.status == KVPoll.Failed:
                r.release_seen = True
                self.changed.add(r.room)  # releasable by time: the table must show it
                out.append(Wake())
            if releasable and now > r.since + self.timeouts.finished_ttl:
                self._forget(r)
                return
        self.deadlines.schedule(r.room, r.inc, self._next_look(r))

    def _next_look(self, r: ReceiverRoom) -> float | None:
        """The earliest instant at which :meth:`look` may change ``r`` without another
        event: its state's deadline; for a failed room, when its pages turn releasable
        by time (at once if nothing is in flight: the next sweep notes it); else when
        ``finished_ttl`` passed (ending rules are strict: ``now >`` a bound)."""
        t = self.timeouts
        if not r.done:
            deadline = r.deadline(t)
            return None if deadline is None else after(deadline)
        if r.status == KVPoll.Failed and not r.release_seen:
            if not r.sent or r.sent <= r.quiesced:
                return r.since
            bound = r.write_deadline if r.write_deadline is not None else r.since
            return max(bound, r.since) + t.release
        return after(r.since + t.finished_ttl)

    def take_changed(self) -> set[int]:
        """The rooms whose :meth:`poll` answer may have changed since the last call
        (each step adds the rooms it touched; a tick adds rooms whose pages turned
        releasable by time), and start a new set."""
        out, self.changed = self.changed, set()
        return out

    def poll(self, room: int, now: float) -> Poll | None:
        """The room's status for the engine, or None if this rank does not know it."""
        r = self.rooms.get(room)
        if r is None:
            return None
        return Poll(r.status, r.failure, r.releasable(now, self.timeouts))

    def table_sizes(self) -> dict[str, int]:
        return {"rooms": len(self.rooms)}

    # ---- internals --------------------------------------------------------------------

    def _room(self, room: int) -> ReceiverRoom:
        r = self.rooms.get(room)
        if r is None:
            raise RoomError(f"unknown room {room} on this decode rank")
        return r

    def _regions(self, pages: Pages, aux_index: int, state_index: int,
                 window_pages: bytes) -> dict[str, Pages]:
        """Every destination region a room names, by kind (int64 indices each)."""
        one = np.array([aux_index, state_index], dtype=np.int64)
        return {PAGE: pages, AUX: one[:1], STATE: one[1:] if state_index >= 0 else one[:0],
                WINDOW: unpack_indices(window_pages) if window_pages else one[:0]}

    def _claim(self, r: ReceiverRoom, regions: dict[str, Pages], now: float) -> None:
        """Record ``r`` as the writer of ``regions``; RoomError naming the first region
        that is named twice or that a room whose pages are not releasable still holds (two
        rooms writing one region: one room's KV, state or first token silently lost, K42)."""
        sizes = {PAGE: self.num_pages, AUX: self.num_aux_slots, STATE: self.num_state_slots,
                 WINDOW: self.num_window_pages}
        if self.claims.sizes != {k: n for k, n in sizes.items() if n > 0}:
            self.claims.reset(sizes)  # (re)registered: a fresh table

        def live(room: int, inc: int) -> bool:
            other = self.rooms.get(room)
            return other is not None and other.inc == inc and other is not r and \
                not other.releasable(now, self.timeouts)

        self.claims.claim((r.room, r.inc), regions, live)
        r.regions = regions

    def _touch(self, r: ReceiverRoom) -> None:
        """``r`` changed: its poll may answer otherwise, and its next look may be due
        sooner."""
        self.changed.add(r.room)
        self.deadlines.schedule(r.room, r.inc, self._next_look(r))

    def _unindex(self, r: ReceiverRoom) -> None:
        rooms = self._by_addr.get(r.bootstrap_addr)
        if rooms is not None:
            rooms.discard(r.room)
            if not rooms:
                del self._by_addr[r.bootstrap_addr]

    def _forget(self, r: ReceiverRoom) -> None:
        """Drop ``r`` from the table and free the regions it still names."""
        del self.rooms[r.room]
        self._unindex(r)
        self.deadlines.forget(r.room, r.inc)
        self.changed.add(r.room)
        self.claims.free((r.room, r.inc), r.regions)

    def _current(self, room: int, inc: int) -> ReceiverRoom | None:
        r = self.rooms.get(room)
        return r if r is not None and r.inc == inc else None

    @staticmethod
    def _peer(r: ReceiverRoom) -> str:
        return ",".join(t.endpoint for t in r.targets or ()) or r.bootstrap_addr

    def _overdue(self, r: ReceiverRoom, now: float, out: list[Effect]) -> bool:
        """Fail ``r`` if it is past its state's deadline. Checked by the sweep and before
        any move to a later state, so a room never outlives its deadlines because the
        sweep ran late."""
        deadline = r.deadline(self.timeouts)
        if deadline is None or now <= deadline:
            return False
        limit = self.timeouts.limit(r.status) or 0.0
        self._fail(r, RoomFailure(FailureKind.TIMEOUT, f"room {r.room}: timed out in "
                                  f"{r.status.name} after {now - r.since:.1f}s (limit "
                                  f"{limit:.1f}s; prefill {r.bootstrap_addr})", ORIGIN), now, out)
        return True

    def _send_pages(self, r: ReceiverRoom, now: float, out: list[Effect]) -> None:
        if r.done or r.targets is None or r.dst_pages is None or r.sent or \
                self._overdue(r, now, out):
            return
        deadline = r.deadline(self.timeouts)
        assert deadline is not None
        r.write_deadline = deadline
        for t in r.targets:
            r.sent.add(t.endpoint)
            out.append(Send(t.endpoint, t.instance, self._pages_msg(r, t, deadline, now),
                            r.room, r.inc))

    def _pages_msg(self, r: ReceiverRoom, t: Target, deadline: float,
                   now: float) -> control.RoomPages:
        assert r.dst_pages is not None
        return control.RoomPages(room=r.room, inc=r.inc, endpoint=self.endpoint,
                                 instance_id=self.instance, dst_pages=r.dst_pages,
                                 aux_index=r.aux_index, write_within=deadline - now,
                                 required_dst_info_num=t.required, is_dummy=t.is_dummy,
                                 first_page=r.first_page, state_index=r.state_index,
                                 window_pages=r.window_pages)

    def _confirm(self, r: ReceiverRoom, endpoint: str, now: float, out: list[Effect]) -> None:
        was = r.releasable(now, self.timeouts)
        r.quiesced.add(endpoint)
        if r.done and not was and r.releasable(now, self.timeouts):
            r.release_seen = True
            out.append(Wake())
        self._touch(r)

    def _aux(self, r: ReceiverRoom, msg: control.RoomStatus, now: float,
             out: list[Effect]) -> bool:
        """Aux over the control plane: sizes must match the local aux buffers exactly;
        then the slot is written (:class:`WriteAux`, answered by :meth:`aux_written`)."""
        sizes = [len(a) for a in msg.aux]
        if sizes != list(self.aux_sizes) or not 0 <= r.aux_index < self.num_aux_slots:
            self._fail(r, RoomFailure(FailureKind.LAYOUT, f"room {r.room}: aux payload of "
                                      f"{sizes} bytes does not match the aux slots "
                                      f"({list(self.aux_sizes)} bytes)", ORIGIN), now, out)
            return False
        out.append(WriteAux(r.room, r.aux_index, tuple(msg.aux), r.inc, msg.endpoint))
        return True

    def _fail(self, r: ReceiverRoom, failure: RoomFailure, now: float,
              out: list[Effect]) -> None:
        """Failed is sticky; every target that does not know yet is told."""
        if r.done:
            return
        r.status, r.since, r.failure = KVPoll.Failed, now, failure
        self._touch(r)
        self._abort_targets(r, out)
        out.append(Ended(r.room, r.inc, KVPoll.Failed, failure, self._peer(r), r.created))
        out.append(Wake())

    def _abort_targets(self, r: ReceiverRoom, out: list[Effect]) -> None:
        assert r.failure is not None
        for t in r.targets or ():
            if t.endpoint in r.told:
                continue
            r.told.add(t.endpoint)
            msg = control.RoomAbort(room=r.room, inc=r.inc, kind=r.failure.kind.value,
                                    reason=r.failure.reason, endpoint=self.endpoint,
                                    instance_id=self.instance)
            out.append(Send(t.endpoint, t.instance, msg))


def _bound_elsewhere(r: ReceiverRoom, keep: str | None, endpoint: str | None) -> bool:
    """Is resolved room ``r`` bound to something other than ``keep``: at rank ``endpoint``
    (when given) or to the lookup's instance?"""
    if r.targets is None:
        return False  # still resolving: judged when its lookup returns
    if endpoint is not None:
        return any(t.endpoint == endpoint and t.instance != keep for t in r.targets)
    return r.via is None or r.via != keep
