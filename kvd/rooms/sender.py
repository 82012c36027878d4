"""The prefill side of the room protocol (senders) as a pure state machine.

A room on a prefill rank moves ``Bootstrapping`` (waiting for the destination
pages of every decode rank that targets this rank) → ``WaitingForInput``
(waiting for the engine's first chunk) → ``Transferring`` (chunks being
written) → ``Success``; any state may move to ``Failed``. Failed is sticky;
Success and Failed are terminal.

Rules this module guarantees (tested in ``tests/unit/rooms``):

* **Incarnations.** A room is bound, per decode rank, to the incarnation that
  rank chose (``RoomPages.inc``); messages naming another incarnation, or sent
  by another instance of the peer than the one that registered, never change it
  (K26, K28); a rank that registers other KV args (a new pool) ends the rooms bound
  to its previous pool (K44). Engine-side re-creation of a room id makes a new
  *attempt*; write results name their attempt, so an old write cannot decide a new
  attempt.
* **One word per incarnation.** The final status this rank tells a decode
  incarnation (endpoint, instance, ``inc``) is remembered (bounded in time and
  count) and never taken back: a late or repeated message about it is answered
  with the same word, and no later attempt binds it (K05, K26).
* **Release safety.** No write starts for a room that ended, nor for a
  destination after its ``write_within`` bound (K22). Every destination hears
  the final status; a failure while a write is in flight is reported twice:
  at once (``quiesced=False``) and again when the write returned (``quiesced``).
* **Cancellation.** An attempt that ends while its write is in flight emits
  :class:`~kvd.rooms.effects.CancelWrites` in the same step as its end, whatever
  ended it (every ending goes through one place): the daemon drops the write's
  parts not started yet, so the write returns (and ``quiesced`` is reported) once
  what was already in flight returned, not when the transfer queue drained (K43).
* **Release by the opener.** A room created with a release digest ends when its
  opener presents the token (K45, K46): the same ending as an abort; without the token
  (any other holder of the cluster secret included, S11) nothing changes.
* **Work per change (K41).** Every status change goes through one place and records
  its room (:meth:`SenderRooms.take_changed`): the daemon re-publishes only those rooms
  to the status table.
* **Termination.** Every non-terminal room has a deadline (:class:`Timeouts`);
  :meth:`SenderRooms.tick` fails it when passed, whatever happened to the tasks
  that perform its effects (K32).
* **Early and late messages.** Pages for a room the engine has not created yet are
  buffered (bounded per peer and in bytes, S13); an abort that arrives first is kept
  and applied when the room appears (K34); an ended room leaves a tombstone that
  answers late decode ranks with the original outcome (K21, K30).
* **Binding.** Only a registered decode rank can bind, and only a rank bound to a
  room (or one that routing says feeds this rank, before it bound) may abort it
  (K29, S11). Messages from unregistered endpoints are dropped and counted, never
  answered: kvd does not connect to an endpoint it learned only from a message.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvd.control.routing import resolve_targets
from kvd.errors import LayoutError, RegistrationError, RoomError
from kvd.protocol import control
from kvd.protocol.codec import unpack_indices
from kvd.protocol.release import ReleaseOutcome, token_matches
from kvd.rooms.effects import (
    CancelWrites,
    Effect,
    Ended,
    ForgetPeer,
    Refuse,
    Report,
    StateRef,
    Wake,
    Write,
    WriteDest,
)
from kvd.rooms.layers import Coverage, Runs, layer_mask, positions_of, runs_of
from kvd.rooms.state import TERMINAL, FailureKind, KVPoll, RoomFailure, Timeouts
from kvd.rooms.tombstones import Bounded
from kvd.transfer.plan import Pages, check_distinct, check_page_range

ORIGIN = "prefill"


@dataclass(frozen=True)
class RankPosition:
    """This prefill rank's place in its instance (attention TP/DP, PP)."""

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1


@dataclass(frozen=True)
class Limits:
    """Bounds on what peers can make this rank hold (counts, bytes, seconds)."""

    max_peers: int = 256
    max_rooms_per_peer: int = 100_000
    max_pending_bytes: int = 64 << 20
    peer_ttl: float = 600.0
    tombstones: int = 65_536


@dataclass
class DecodePeer:
    """A decode rank that registered its KV args with this prefill rank.

    ``payload`` is opaque here (the daemon's planning data for this peer);
    ``rejected`` is set when the pair's KV args were refused (K12, K25, K30)."""

    endpoint: str
    instance: str
    tp_rank: int
    tp_size: int
    is_mla: bool
    num_pages: int
    num_aux_slots: int
    rejected: RoomFailure | None
    payload: Any
    last_seen: float
    kv_args: control.KVArgsWire | None = None  # what it registered (its pool)

    @property
    def page_size(self) -> int:
        """Tokens per page of its KV pool (0: not registered)."""
        return self.kv_args.page_size if self.kv_args is not None else 0


@dataclass
class Dest:
    """Room R on one decode rank: its incarnation, pages and write bound (monotonic s).
    ``first``: the room page ``pages[0]`` receives (the decode holds those before it)."""

    peer: DecodePeer
    inc: int
    pages: Pages
    aux_index: int
    is_dummy: bool
    write_deadline: float
    first: int = 0
    state: StateRef | None = None


@dataclass(frozen=True)
class Piece:
    """One engine send as the pump takes it: source ``pages`` (int64, in room order) at
    room positions ``first + i`` (``pos`` None) or ``pos`` (int64, ascending), their
    layers ``[lo, hi)`` (local layers of this rank's pool; None: every layer), whether it
    is the room's last (it carries aux). Re-tiled rooms do not take pieces: they write
    what the room's (page, layer) cells allow (:meth:`SenderRooms._next_tokens`)."""

    pages: Pages
    is_last: bool
    first: int = 0
    pos: Pages | None = None
    layers: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        """One past its last room position."""
        return self.first + int(self.pages.size) if self.pos is None else \
            int(self.pos[-1]) + 1 if self.pos.size else 0


@dataclass(frozen=True)
class TokenStep:
    """One re-tiled write: room tokens ``[lo, hi)`` of local layers ``[l0, l1)``, whether
    it is the room's last, and ``room_end``: the room's token count ``T`` once the last
    send was accepted (None before)."""

    lo: int
    hi: int
    l0: int
    l1: int
    is_last: bool
    room_end: int | None


@dataclass
class SenderRoom:
    """Prefill-side state of one attempt of one room (times are monotonic s)."""

    room: int
    attempt: int
    created: float
    since: float
    status: KVPoll = KVPoll.Bootstrapping
    failure: RoomFailure | None = None
    num_pages: int | None = None
    aux_index: int | None = None
    required: int | None = None
    dests: dict[str, Dest] = field(default_factory=dict)
    chunks: deque[Piece] = field(default_factory=deque)
    offset: int = 0  # sender pages handed to writes (re-tiled: with every layer named)
    written: Pages | None = None  # re-tiled rooms: room tokens written so far, per layer
    writing: bool = False
    last_sent: bool = False  # the chunk with is_last was handed to a write
    last_named: bool = False  # the engine's last send (is_last) was accepted
    nbytes: int = 0
    seconds: float = 0.0
    src_pages: list[Pages] = field(default_factory=list)  # every chunk's, for K42
    cover: Coverage | None = None  # (page, layer) cells named so far (layer streaming)
    _index: tuple[Pages, Pages] | None = None  # (sorted pages, their positions), lazily
    release_digest: bytes = b""  # the opener's release token, hashed (K45/K46); b"": none
    state: StateRef | None = None  # hybrid models: the room's state slot and window pages

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @property
    def peers(self) -> str:
        """Decode endpoints of the room, for messages."""
        return ", ".join(self.dests) or "no decode rank yet"

    def deadline(self, timeouts: Timeouts) -> float | None:
        """When the current state times out (None once terminal)."""
        limit = timeouts.limit(self.status)
        if limit is None:
            return None
        own = self.since + limit
        if self.dests:  # past a decode's write bound the room can never succeed
            own = min(own, min(d.write_deadline for d in self.dests.values()))
        return own


@dataclass(frozen=True)
class EarlyAbort:
    """An abort (or refusal) that reached this rank before the engine created the room."""

    endpoint: str
    inc: int
    failure: RoomFailure


@dataclass(frozen=True)
class Tombstone:
    """What is left of an ended room after the engine cleared it (``dests``: how many
    decode ranks its last attempt had bound)."""

    room: int
    status: KVPoll
    failure: RoomFailure | None
    dests: int


#: A decode incarnation as this rank knows it: (endpoint, instance, inc).
Incarnation = tuple[str, str, int]
#: What this rank said about one: its final status and failure.
Word = tuple[KVPoll, RoomFailure | None]
#: Words kept per room (retries reusing one room id add more).
MAX_WORDS = 16


@dataclass(frozen=True)
class Pending:
    """Destination pages that arrived before the room (monotonic arrival time)."""

    msg: control.RoomPages
    pages: Pages
    at: float


@dataclass(frozen=True)
class Poll:
    """What the engine sees of a room."""

    status: KVPoll
    failure: RoomFailure | None
    nbytes: int
    seconds: float


class SenderRooms:
    """Every sender of one prefill rank, and the decode ranks it knows.

    Engine events: :meth:`create`, :meth:`init`, :meth:`send`, :meth:`abort`,
    :meth:`clear`. Peer events: :meth:`on_register`, :meth:`on_pages`,
    :meth:`on_abort`. Results: :meth:`write_done`. Time: :meth:`tick`. Each
    returns the effects to perform, in order. Engine events raise
    :class:`RoomError` for calls the engine got wrong (with the effects of whatever the
    call still changed, e.g. a room it failed); peer events never raise.
    ``num_pages``/``num_aux_slots`` describe the local KV pool (0 until the engine
    registered), ``page_size`` its tokens per page (0: unknown, every pair is taken as
    equal).

    **Page sizes** (issue 22 item 3). A room whose decode ranks all have this rank's page
    size moves whole pages as the engine sent them. Otherwise it moves tokens: the
    engine's chunks are re-cut so every write but the last ends on a page boundary of
    every destination (a (decode page, layer) is written by one write only; the rest of a
    chunk waits for the next), layer by layer: a layer range moves as soon as the pages
    it was named for reach such a boundary (layer streaming), and the last ends at the
    room's token count ``T``: the largest both sides' pages hold, ``min(prefill pages x
    Ps, decode pages x Pd)`` (the engines name pages, not tokens; slots past the
    request's last token lie in the room's own pages on both sides). A decode whose pages
    do not fit ``T`` -- a page it would get no token in, or too few for a chunk -- fails
    the room, kind ``layout``, as an index length mismatch does with equal pages.
    """

    def __init__(self, timeouts: Timeouts | None = None, position: RankPosition | None = None,
                 limits: Limits | None = None) -> None:
        self.timeouts = timeouts or Timeouts()
        self.position = position or RankPosition()
        self.limits = limits or Limits()
        self.num_pages = 0
        self.num_aux_slots = 0
        self.page_size = 0
        self.num_layers = 0  # layers of the local pool (0: unknown, no layer ranges)
        self.peers: dict[str, DecodePeer] = {}
        self.rooms: dict[int, SenderRoom] = {}
        self.retired: dict[tuple[int, int], SenderRoom] = {}  # ended attempts still writing
        self.pending: dict[int, list[Pending]] = {}
        self.pending_by_peer: Counter[str] = Counter()
        self.pending_bytes = 0
        self.early: Bounded[int, list[EarlyAbort]] = Bounded(self.timeouts.bootstrap,
                                                              self.limits.tombstones)
        self.tombstones: Bounded[int, Tombstone] = Bounded(self.timeouts.tombstone,
                                                           self.limits.tombstones)
        # every final word said to a decode incarnation, per room: never taken back
        self.words: Bounded[int, dict[Incarnation, Word]] = Bounded(self.timeouts.tombstone,
                                                                    self.limits.tombstones)
        self.dropped: Counter[str] = Counter()  # stale / unbound / unregistered messages
        # decode ranks forgotten after peer_ttl (endpoint -> instance), for peer_ttl: only
        # they are told they are unregistered (a stranger is dropped unanswered, S13)
        self.former: Bounded[str, str] = Bounded(self.limits.peer_ttl, self.limits.max_peers)
        self._attempts = 0
        #: rooms whose :meth:`poll` status may have changed since :meth:`take_changed`
        #: (the daemon re-publishes only those to the status table, K41)
        self.changed: set[int] = set()

    # ---- engine events ----------------------------------------------------------------

    def create(self, room: int, now: float, release_digest: bytes = b"") -> list[Effect]:
        """``Sender(room)``: a new attempt, bound to its opener's ``release_digest``
        (:func:`kvd.protocol.release.token_digest`, 32 bytes; empty: no release by token).
        Raises RoomError if the room is in flight."""
        old = self.rooms.get(room)
        if old is not None and not old.done:
            raise RoomError(f"room {room} already active on this prefill rank")
        out: list[Effect] = []
        if old is not None:
            self._retire(old, now)
        self._attempts += 1
        r = SenderRoom(room, self._attempts, created=now, since=now,
                       release_digest=release_digest)
        self.rooms[room] = r
        self.changed.add(room)
        for early in self.early.pop(room) or []:  # already answered when it arrived
            self._fail(r, early.failure, now, out)
        for p in self._take_pending(room):
            self._bind(r, p.msg, p.pages, now, out, arrived=p.at)
        return out

    def init(self, room: int, num_pages: int, aux_index: int, now: float,
             state: StateRef | None = None) -> list[Effect]:
        """``sender.init``: the room's total pages and its aux slot (validated against the
        local pool), and (hybrid models) its state slot and window pages, which move with
        the last chunk. Raises RoomError for an unknown room or an index out of range.

        An init may come again before the room's last send (an engine that learns the
        room's state slot only with its last chunk, as SGLang's scheduler does): it must
        repeat ``num_pages`` and ``aux_index``, and may name the state once (a state named
        before is kept, and naming another raises); anything else raises RoomError and
        changes nothing. An init after the last send raises; one for a room that already
        ended is dropped (the engine learns the outcome from ``poll``)."""
        r = self._room(room)
        new = None if state is None or state.empty else state
        if r.num_pages is not None:  # init again
            if r.done:
                return []
            if r.last_named:
                raise RoomError(f"room {room}: init after the room's last send")
            if (num_pages, aux_index) != (r.num_pages, r.aux_index):
                raise RoomError(f"room {room}: init again with num_pages {num_pages}, "
                                f"aux_index {aux_index}; it was inited with num_pages "
                                f"{r.num_pages}, aux_index {r.aux_index}")
            if new is not None and r.state is not None and not _same_state(new, r.state):
                raise RoomError(f"room {room}: init again names state slot {new.index} "
                                f"and {new.window.size} window pages; the room already "
                                f"named slot {r.state.index} and {r.state.window.size}")
            r.state = r.state or new
            return []
        r.state = new
        if not 0 <= num_pages <= self.num_pages:
            raise RoomError(f"room {room}: num_pages {num_pages} outside [0, {self.num_pages}]")
        if self.num_aux_slots and not 0 <= aux_index < self.num_aux_slots:
            raise RoomError(f"room {room}: aux_index {aux_index} outside "
                            f"[0, {self.num_aux_slots})")
        r.num_pages, r.aux_index = num_pages, aux_index
        return []

    def send(self, room: int, pages: Pages, is_last: bool, now: float,
             layers: tuple[int, int] | None = None) -> list[Effect]:
        """``sender.send``: queue one chunk of source pages (int64), every layer of them;
        with ``layers = (lo, hi)``, only local layers ``[lo, hi)`` of this rank's pool
        (layer streaming, issue 22 item 4): of new ``pages`` (a chunk, named for the
        first time), of ``pages`` named before, or, with no pages, of every page named so
        far that misses a layer. Each (page, layer) may be named once; the last send
        (``is_last``, it carries aux) must leave every layer of every page named. A last
        send of no layers (``lo == hi``) and no pages finishes a room whose every layer
        was named (aux and state only).

        A chunk for a room that already ended is dropped (the engine learns the outcome
        from ``poll``: aborts race with sends); a chunk after the room's last one raises
        RoomError (it used to be dropped silently). A page outside the local pool, one
        this room already named (in this chunk or an earlier one: K42) without a layer
        range, a layer range that is empty (but on a finishing send), reversed or outside
        ``[0, num_layers)``, a layer named twice for a page, pages that mix new and named
        ones, a range of no page before the room named any, a finishing send naming pages,
        or a last send that leaves a layer unnamed (the message names which pages miss
        which layers) fail the room, kind ``layout``, and raise RoomError (the reports to
        its decode ranks leave with the next :meth:`tick`)."""
        r = self._room(room)
        if r.done:
            return []
        if r.last_sent or r.last_named:
            what = f"a chunk of {pages.size} pages" if layers is None else \
                f"layers [{layers[0]}, {layers[1]}) of {pages.size} pages"
            raise RoomError(f"room {room}: {what} sent after the room's last send (is_last) "
                            f"was refused: none of it is written (the room goes on)")
        out: list[Effect] = []
        try:
            piece = self._piece(r, pages, is_last, layers)
        except LayoutError as exc:
            self._fail(r, RoomFailure(FailureKind.LAYOUT, str(exc), ORIGIN), now, out)
            raise RoomError(str(exc), out) from exc  # the failure's effects still happen
        r.last_named = is_last
        r.chunks.append(piece)
        self._kick(r, now, out)
        return out

    def _piece(self, r: SenderRoom, pages: Pages, is_last: bool,
               layers: tuple[int, int] | None) -> Piece:
        """Check one send against the room's (page, layer) cells, name them, and make its
        :class:`Piece`. Raises LayoutError (the room fails)."""
        what = f"room {r.room} source"
        nl = max(self.num_layers, 1)
        if r.cover is None:
            r.cover = Coverage(nl)
        cover = r.cover
        if layers is not None and layers[0] == layers[1] and is_last:
            if pages.size:  # the finishing send: aux (and state) only, once all was named
                raise LayoutError(f"room {r.room}: a last send of no layers ([{layers[0]}, "
                                  f"{layers[1]})) names {pages.size} pages: it may name none")
            layers = None
        mask = cover.full if layers is None else self._layer_mask(r, layers)
        known = self._named(r, pages) if layers is not None else None
        if known is None:
            piece = self._new_pages(r, pages, is_last, layers, mask, what)
        else:
            piece = self._named_pages(r, pages, known, is_last, layers, mask)
        if is_last and cover.first_gap() is not None:
            raise LayoutError(f"room {r.room}: the last send leaves layers unnamed: "
                              f"{cover.gaps()} (every layer of every page must be sent by "
                              f"the last send)")
        return piece

    def _layer_mask(self, r: SenderRoom, layers: tuple[int, int]) -> int:
        """The mask of a send's layer range ``[lo, hi)``. Raises LayoutError for a range
        that is empty (only a last send may name no layers), reversed, or ends outside this
        rank's pool."""
        lo, hi = layers
        if lo >= hi:
            raise LayoutError(f"room {r.room}: layers [{lo}, {hi}) name no layer: a layer "
                              f"range is lo < hi (only the room's last send, is_last, may "
                              f"name no layers, and then no pages)")
        if not 0 <= lo < hi <= self.num_layers:
            raise LayoutError(f"room {r.room}: layers [{lo}, {hi}) end outside the "
                              f"{self.num_layers} layers of this rank's pool")
        return layer_mask(lo, hi)

    def _new_pages(self, r: SenderRoom, pages: Pages, is_last: bool,
                   layers: tuple[int, int] | None, mask: int, what: str) -> Piece:
        """A chunk of pages named for the first time: appended to the room."""
        assert r.cover is not None
        check_page_range(pages, self.num_pages, what)
        # A source page named twice sends one page's KV to two decode pages and the
        # page meant for one of them nowhere (K42's sender-side sibling): refused.
        check_distinct(np.concatenate([*r.src_pages, pages]) if r.src_pages else pages, what)
        first = r.cover.size
        r.cover.add(int(pages.size), mask)
        r.src_pages.append(pages)
        r._index = None
        return Piece(pages, is_last, first, None, layers)

    def _named_pages(self, r: SenderRoom, pages: Pages, pos: Pages, is_last: bool,
                     layers: tuple[int, int] | None, mask: int) -> Piece:
        """Layers of pages the room named before (``pos``: their room positions; with no
        pages, the pages that miss a layer)."""
        assert r.cover is not None
        cover = r.cover
        if pages.size:
            order = np.argsort(pos, kind="stable")
            pos = pos[order]
            runs: Runs = runs_of(pos)
        else:
            runs = cover.open_runs()
            pos = positions_of(runs)
            if not cover.size:
                raise LayoutError(f"room {r.room}: layers {layers} of no page: the room "
                                  f"named no page yet (a first layer range names its pages)")
            if not pos.size:
                raise LayoutError(f"room {r.room}: layers {layers} of no page: every page "
                                  f"named so far has every layer")
        clash = cover.clash(runs, mask)
        if clash is not None:
            raise LayoutError(f"room {r.room}: layer {clash[1]} of room page {clash[0]} is "
                              f"named twice")
        cover.mark(runs, mask)
        src = np.concatenate(r.src_pages)[pos]
        return Piece(src, is_last, int(pos[0]), None if runs and len(runs) == 1 else pos,
                     layers)

    def _named(self, r: SenderRoom, pages: Pages) -> Pages | None:
        """Room positions of ``pages`` if the room named every one of them before (int64;
        empty pages: an empty array), None if it named none of them. Raises LayoutError
        for a mix, or a page named twice in ``pages``."""
        if not pages.size:
            return pages
        if not r.src_pages:
            return None
        if r._index is None:
            allp = np.concatenate(r.src_pages)
            order = np.argsort(allp, kind="stable")
            r._index = (allp[order], order.astype(np.int64))
        keys, where = r._index
        at = np.minimum(np.searchsorted(keys, pages), max(keys.size - 1, 0))
        hit = keys[at] == pages if keys.size else np.zeros(pages.size, dtype=bool)
        if not hit.any():
            return None
        if not hit.all():
            raise LayoutError(f"room {r.room}: a layer send names pages the room named "
                              f"before and new ones (page {int(pages[~hit][0])} is new)")
        check_distinct(pages, f"room {r.room} source")
        return where[at]

    def abort(self, room: int, reason: str, now: float) -> list[Effect]:
        """The engine aborts the room: Failed (aborted) on both sides; no chunk is
        scheduled any more. Unknown or ended rooms: nothing happens."""
        r = self.rooms.get(room)
        out: list[Effect] = []
        if r is not None:
            failure = RoomFailure(FailureKind.ABORTED,
                                  f"room {room} aborted on prefill ({r.peers}): {reason}", ORIGIN)
            self._fail(r, failure, now, out)
        return out

    def engine_lost(self, failure: RoomFailure, now: float) -> list[Effect]:
        """The engine's registration is dropped because its memory no longer stands
        (case S16): every unfinished room fails with ``failure`` (kind ``layout``); writes
        in flight are cancelled where they have not started, as for any ending."""
        out: list[Effect] = []
        for r in [r for r in self.rooms.values() if not r.done]:
            self._fail(r, failure, now, out)
        return out

    def release(self, room: int, token: str, reason: str,
                now: float) -> tuple[ReleaseOutcome, list[Effect]]:
        """The room's opener ends it (K45, K46): only with the token whose digest the
        engine bound to this attempt at :meth:`create` (constant-time compare). A match on
        an unfinished room fails it as an abort would (queued writes cancelled, every
        destination told, K43); an ended room, a wrong or missing token and an unknown
        room change nothing (:class:`ReleaseOutcome` says which). A replayed release
        finds the room ended; a new attempt of the room has its own digest."""
        r = self.rooms.get(room)
        if r is None:
            return ReleaseOutcome.UNKNOWN, []
        if not token_matches(token, r.release_digest):
            return ReleaseOutcome.REFUSED, []
        if r.done:
            return ReleaseOutcome.ENDED, []
        out: list[Effect] = []
        why = f": {reason}" if reason else ""
        failure = RoomFailure(FailureKind.ABORTED, f"room {room} released by its opener on "
                              f"prefill ({r.peers}){why}", ORIGIN)
        self._fail(r, failure, now, out)
        return ReleaseOutcome.RELEASED, out

    def clear(self, room: int, now: float) -> list[Effect]:
        """Forget a room (an unfinished one is aborted first). A write in flight keeps
        running and reports quiescence to the decode side when it returns."""
        r = self.rooms.get(room)
        if r is None:
            return []
        out = [] if r.done else self.abort(room, "cleared before it finished", now)
        self._retire(r, now)
        return out

    # ---- peer events ------------------------------------------------------------------

    def on_register(self, msg: control.RegisterRank, num_pages: int, num_aux_slots: int,
                    rejected: RoomFailure | None, payload: Any, now: float) -> list[Effect]:
        """A decode rank's KV args, already checked by the daemon (``rejected`` says why
        not). A new instance at a known endpoint is a restart: rooms bound to the old
        instance fail and are never written again (K28). Past ``max_peers`` live peers
        the registration is dropped (counted) and answered ``full`` (:class:`Refuse`)."""
        out: list[Effect] = []
        self.former.pop(msg.endpoint)
        old = self.peers.get(msg.endpoint)
        if old is None and len(self.peers) >= self.limits.max_peers:
            self.dropped["max_peers"] += 1
            out.append(Refuse(msg, "full"))  # its rooms fail now, not at a deadline (K16)
            return out
        if old is not None and old.instance != msg.instance_id:
            self._peer_restarted(old, now, out)
        elif old is not None and old.kv_args is not None and old.kv_args != msg.kv_args:
            self._pool_replaced(old, msg.kv_args, now, out)
        self.peers[msg.endpoint] = DecodePeer(
            msg.endpoint, msg.instance_id, msg.attn_tp_rank, msg.attn_tp_size,
            msg.kv_args.is_mla, num_pages, num_aux_slots, rejected, payload, now, msg.kv_args)
        return out

    def peer_refused(self, endpoint: str, instance: str, now: float) -> list[Effect]:
        """Decode rank ``endpoint`` refused a frame sealed for another instance of it: it
        is ``instance`` now. If it registered as another one, that one restarted: as on a
        new registration, rooms bound to it fail and are never written again (K28)."""
        out: list[Effect] = []
        old = self.peers.get(endpoint)
        if old is not None and old.instance != instance:
            self._peer_restarted(old, now, out)
        return out

    def on_pages(self, msg: control.RoomPages, now: float) -> list[Effect]:
        """Destination pages of room ``msg.room`` on decode rank ``msg.endpoint``."""
        out: list[Effect] = []
        peer = self._peer(msg, now, out)
        if peer is None:
            return out
        try:
            pages = unpack_indices(msg.dst_pages)
        except Exception:  # ProtocolError: a malformed field fails only this room
            pages = None
        r = self.rooms.get(msg.room)
        if r is None:
            self._pages_before_room(peer, msg, pages, now, out)
            return out
        if pages is None:
            failure = RoomFailure(FailureKind.LAYOUT, f"room {msg.room}: malformed page "
                                  f"indices from {msg.endpoint}", ORIGIN)
            out.append(self._answer(peer, msg, failure, now))
            return out
        self._bind(r, msg, pages, now, out)
        return out

    def on_abort(self, msg: control.RoomAbort, now: float) -> list[Effect]:
        """A decode rank ends the room (its incarnation ``msg.inc``; 0 means any)."""
        out: list[Effect] = []
        peer = self._peer(msg, now, out)
        if peer is None:
            return out
        failure = RoomFailure(FailureKind.parse(msg.kind), msg.reason, "decode")
        r = self.rooms.get(msg.room)
        d = r.dests.get(msg.endpoint) if r is not None else None
        if d is not None and d.peer.instance != peer.instance:
            d = None  # bound to an earlier instance at that endpoint, not to this one
        if r is not None and d is not None:
            if msg.inc not in (0, d.inc):
                self.dropped["stale"] += 1
                return out
            self._fail(r, failure, now, out)
            if not r.writing:  # _fail told the others; confirm to this one too
                out.append(self._report(r, msg.endpoint, d.inc, now))
            return out
        word = self._ended_word(msg.room, peer, msg.inc)
        if word is not None:  # late: that incarnation's attempt ended; say how, again
            self.dropped["late"] += 1
            out.append(word)
            return out
        full = r is not None and r.required is not None and len(r.dests) >= r.required
        if full or not self._routes_here(peer, msg.room):
            self.dropped["unbound"] += 1  # not a party to this room, and cannot become one
            return out
        self._drop_pending(msg.room, msg.endpoint)
        inc = msg.inc
        if r is not None:  # the room exists but this decode rank never bound: it never will
            self._fail(r, failure, now, out)
        else:
            early = self.early.get(msg.room) or []
            if len(early) < 16:
                self.early.put(msg.room, [*early, EarlyAbort(msg.endpoint, inc, failure)], now)
        out.append(self._say(Report(msg.endpoint, peer.instance, msg.room, inc, KVPoll.Failed,
                                    failure, quiesced=True), now))
        return out

    # ---- results and time -------------------------------------------------------------

    def write_done(self, room: int, attempt: int, failure: RoomFailure | None, nbytes: int,
                   seconds: float, now: float) -> list[Effect]:
        """The write of the room's current chunk returned (``failure`` None: every byte
        landed). Exactly one call per :class:`Write` effect."""
        out: list[Effect] = []
        r = self.rooms.get(room)
        if r is None or r.attempt != attempt:
            r = self.retired.pop((room, attempt), None)
            if r is None:
                return out
        r.writing = False
        r.nbytes += nbytes
        r.seconds += seconds
        if r.done:  # ended while the write was in flight: now it is quiet
            self._report_all(r, now, out)
            return out
        if failure is not None:
            self._fail(r, failure, now, out)
            return out
        if r.last_sent:
            self._succeed(r, now, out)
        else:
            self._kick(r, now, out)
        return out

    def tick(self, now: float) -> list[Effect]:
        """Deadlines: fail rooms past their state's deadline; expire buffered pages,
        early aborts, tombstones, unclaimed finished rooms and idle peers."""
        out: list[Effect] = []
        for r in list(self.rooms.values()):
            if self._overdue(r, now, out):
                continue
            if r.done and not r.writing and now - r.since > self.timeouts.finished_ttl:
                self._retire(r, now)
        self._expire_pending(now, out)
        self.early.expire(now)
        self.tombstones.expire(now)
        self.words.expire(now)
        self.former.expire(now)
        self._forget_idle_peers(now, out)
        return out

    # ---- reads ------------------------------------------------------------------------

    def poll(self, room: int) -> Poll | None:
        """The room's status for the engine, or None if this rank does not know it."""
        r = self.rooms.get(room)
        if r is None:
            return None
        return Poll(r.status, r.failure, r.nbytes, r.seconds)

    def take_changed(self) -> set[int]:
        """The rooms whose :meth:`poll` status may have changed since the last call (every
        status change goes through ``_advance``; a room created or retired counts too), and
        start a new set."""
        out, self.changed = self.changed, set()
        return out

    def table_sizes(self) -> dict[str, int]:
        """Sizes of every per-room and per-peer table (leak checks)."""
        return {"rooms": len(self.rooms), "retired": len(self.retired),
                "pending": len(self.pending), "pending_bytes": self.pending_bytes,
                "early_aborts": len(self.early), "tombstones": len(self.tombstones),
                "words": len(self.words),
                "peers": len(self.peers)}

    # ---- internals: binding -----------------------------------------------------------

    def _room(self, room: int) -> SenderRoom:
        r = self.rooms.get(room)
        if r is None:
            raise RoomError(f"unknown room {room} on this prefill rank")
        return r

    def _peer(self, msg: control.RoomPages | control.RoomAbort, now: float,
              out: list[Effect]) -> DecodePeer | None:
        """The registered peer that sent ``msg``, or None: dropped (counted) and, when
        the sender is a decode rank this rank forgot after ``peer_ttl`` (S08) or another
        instance at a registered peer's endpoint, answered ``unregistered``
        (:class:`Refuse`), so the decode registers again and its rooms go on instead of
        waiting for their deadline (K16). The refusal is sealed for the sender's
        instance: only it acts on it. An endpoint that never registered gets no answer
        (this rank connects to no endpoint a room message names, S13)."""
        peer = self.peers.get(msg.endpoint)
        if peer is None or peer.instance != msg.instance_id:
            self.dropped["unregistered" if peer is None else "stale_instance"] += 1
            if peer is not None or self.former.get(msg.endpoint) == msg.instance_id:
                out.append(Refuse(msg, "unregistered"))
            return None
        peer.last_seen = now
        return peer

    def _ended_word(self, room: int, peer: DecodePeer, inc: int) -> Report | None:
        """What this rank already said about incarnation ``inc`` of ``room`` on ``peer``
        (this instance), said again — quiesced unless a write bound to it is still in
        flight (its return reports again) — or None if nothing was said."""
        word = (self.words.get(room) or {}).get((peer.endpoint, peer.instance, inc))
        if word is None:
            return None
        attempts = [self.rooms.get(room), *(r for r in self.retired.values() if r.room == room)]
        writing = any(r is not None and r.writing and (d := r.dests.get(peer.endpoint))
                      is not None and (d.peer.instance, d.inc) == (peer.instance, inc)
                      for r in attempts)
        return Report(peer.endpoint, peer.instance, room, inc, *word, quiesced=not writing)

    def _say(self, rep: Report, now: float) -> Report:
        """Remember a final word (this rank never binds that incarnation afterwards)."""
        words = dict(self.words.get(rep.room) or {})
        words[(rep.to, rep.to_instance, rep.inc)] = (rep.status, rep.failure)
        for key in list(words)[:-MAX_WORDS]:
            del words[key]
        self.words.put(rep.room, words, now)
        return rep

    def _routes_here(self, peer: DecodePeer, room: int) -> bool:
        """Could ``peer`` target this rank for ``room``? (TP and PP; the decode may name
        any DP group explicitly, so DP is not checked.)"""
        pos = self.position
        try:
            targets = resolve_targets(room, peer.tp_rank, peer.tp_size, pos.tp_size, 1,
                                      pos.pp_size, peer.is_mla, 0)
        except RegistrationError:
            return False
        return any(t.tp_rank == pos.tp_rank and t.pp_rank == pos.pp_rank for t in targets)

    def _pages_before_room(self, peer: DecodePeer, msg: control.RoomPages,
                           pages: Pages | None, now: float, out: list[Effect]) -> None:
        word = self._ended_word(msg.room, peer, msg.inc)
        if word is not None:  # pages this rank already used: the same answer again
            out.append(word)
            return
        tomb = self.tombstones.get(msg.room)
        if tomb is not None and not tomb.dests:  # ended before any decode rank bound (K21)
            assert tomb.failure is not None  # no destination: it cannot have succeeded
            out.append(self._answer(peer, msg, tomb.failure, now))
            return
        for early in self.early.get(msg.room) or []:
            if early.endpoint == msg.endpoint and early.inc in (0, msg.inc):
                out.append(self._answer(peer, msg, early.failure, now))
                return
        if peer.rejected is not None:  # K30: refuse now, and fail the room when it appears
            out.append(self._answer(peer, msg, peer.rejected, now))
            self.early.put(msg.room, [*(self.early.get(msg.room) or []),
                                      EarlyAbort(msg.endpoint, msg.inc, peer.rejected)], now)
            return
        if any((q.msg.endpoint, q.msg.instance_id, q.msg.inc) == (msg.endpoint,
               msg.instance_id, msg.inc) for q in self.pending.get(msg.room, ())):
            self.dropped["duplicate"] += 1  # sent again (a resend, K16): buffered once
            return
        size = len(msg.dst_pages)
        if pages is None or self.pending_by_peer[msg.endpoint] >= self.limits.max_rooms_per_peer \
                or self.pending_bytes + size > self.limits.max_pending_bytes:
            failure = RoomFailure(FailureKind.REGISTRATION if pages is not None
                                  else FailureKind.LAYOUT,
                                  f"room {msg.room}: refused, {msg.endpoint} has "
                                  f"{self.pending_by_peer[msg.endpoint]} rooms ("
                                  f"{self.pending_bytes} bytes) waiting for a sender on this "
                                  f"prefill rank" if pages is not None else
                                  f"room {msg.room}: malformed page indices", ORIGIN)
            out.append(self._answer(peer, msg, failure, now))
            return
        self.pending.setdefault(msg.room, []).append(Pending(msg, pages, now))
        self.pending_by_peer[msg.endpoint] += 1
        self.pending_bytes += size

    def _bind(self, r: SenderRoom, msg: control.RoomPages, pages: Pages, now: float,
              out: list[Effect], arrived: float | None = None) -> None:
        """Add a destination to a live (or ended) room, or answer why not. The write bound
        counts from when the pages ``arrived`` (buffered pages waited for the room), never
        from when they were bound: the decode's release margin starts at its send."""
        peer = self.peers[msg.endpoint]
        existing = r.dests.get(msg.endpoint)
        if existing is not None and existing.peer.instance == peer.instance and \
                existing.inc == msg.inc:  # the same pages again: nothing changes
            self.dropped["duplicate"] += 1
            if r.done:
                out.append(self._report(r, msg.endpoint, msg.inc, now))  # the outcome again
            return
        word = self._ended_word(r.room, peer, msg.inc)
        if word is not None:  # this rank already gave its final word on that incarnation
            self.dropped["late"] += 1
            out.append(word)
            return
        if not r.done:
            self._overdue(r, now, out)  # too late to bind: answered as an ended room
        if r.done:
            out.append(self._answer(peer, msg, r.failure or RoomFailure(
                FailureKind.DUPLICATE, f"room {r.room}: duplicate room (already ended: "
                f"Success on prefill for {r.peers})", ORIGIN), now))
            return
        if existing is not None or (r.required is not None and len(r.dests) >= r.required):
            out.append(self._answer(peer, msg, RoomFailure(
                FailureKind.DUPLICATE, f"room {r.room}: duplicate room (already bound to "
                f"{r.peers}; refused {msg.endpoint})", ORIGIN), now))
            return
        if r.dests and msg.required_dst_info_num != r.required:
            # The parties disagree on how many they are (S11): taking the later count would
            # let whoever bound first with a larger one stay on as an extra destination.
            conflict = RoomFailure(FailureKind.DUPLICATE, f"room {r.room}: destinations "
                                   f"disagree: {r.peers} said {r.required} decode ranks, "
                                   f"{msg.endpoint} says {msg.required_dst_info_num}", ORIGIN)
            out.append(self._answer(peer, msg, conflict, now))
            self._fail(r, conflict, now, out)
            return
        write_deadline = (now if arrived is None else arrived) + msg.write_within
        problem = self._check_dest(peer, msg, pages, write_deadline > now)
        if problem is not None:
            out.append(self._answer(peer, msg, problem, now))
            self._fail(r, problem, now, out)
            return
        state = StateRef(msg.state_index, unpack_indices(msg.window_pages))
        r.dests[msg.endpoint] = Dest(peer, msg.inc, pages, msg.aux_index, msg.is_dummy,
                                     write_deadline, msg.first_page,
                                     None if state.empty else state)
        r.required = msg.required_dst_info_num
        if len(r.dests) >= r.required and r.status == KVPoll.Bootstrapping:
            self._advance(r, KVPoll.WaitingForInput, now)
            self._kick(r, now, out)

    def _check_dest(self, peer: DecodePeer, msg: control.RoomPages, pages: Pages,
                    in_time: bool) -> RoomFailure | None:
        room = msg.room
        if peer.rejected is not None:
            return peer.rejected
        if not in_time:
            return RoomFailure(FailureKind.TIMEOUT, f"room {room}: the decode's write "
                               f"deadline already passed", ORIGIN)
        if msg.first_page < 0:
            return RoomFailure(FailureKind.LAYOUT, f"room {room}: first_page "
                               f"{msg.first_page} < 0", ORIGIN)
        if len(msg.window_pages) % 4:
            return RoomFailure(FailureKind.LAYOUT, f"room {room}: malformed window pages "
                               f"({len(msg.window_pages)} bytes)", ORIGIN)
        if msg.required_dst_info_num < 1:
            return RoomFailure(FailureKind.LAYOUT, f"room {room}: required_dst_info_num "
                               f"{msg.required_dst_info_num} < 1", ORIGIN)
        try:
            check_page_range(pages, peer.num_pages, f"room {room} destination")
            check_distinct(pages, f"room {room} destination")  # K42: never trust the peer
        except LayoutError as exc:
            return RoomFailure(FailureKind.LAYOUT, str(exc), ORIGIN)
        if not 0 <= msg.aux_index < max(peer.num_aux_slots, 1) or (
                peer.num_aux_slots == 0 and msg.aux_index):
            return RoomFailure(FailureKind.LAYOUT, f"room {room}: aux_index {msg.aux_index} "
                               f"outside the decode rank's {peer.num_aux_slots} slots", ORIGIN)
        return None

    # ---- internals: the chunk pump ----------------------------------------------------

    def _kick(self, r: SenderRoom, now: float, out: list[Effect]) -> None:
        """Start writing the next chunk if the room can."""
        if r.writing or r.status not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            return
        retiled = self._retiled(r)
        step = self._next_tokens(r) if retiled else None
        if (step is None) if retiled else not r.chunks:
            return
        if now > min(d.write_deadline for d in r.dests.values()):
            self._fail(r, RoomFailure(FailureKind.TIMEOUT, f"room {r.room}: the decode's "
                                      f"write deadline passed before chunk at page "
                                      f"{r.offset} (decode: {r.peers})", ORIGIN), now, out)
            return
        if self._overdue(r, now, out):
            return
        if step is not None:
            self._write_tokens(r, step, now, out)
            return
        piece = r.chunks.popleft()
        dests = []
        for endpoint, d in r.dests.items():
            dest = self._chunk_dest(r, d, endpoint, piece)
            if dest is None:
                self._fail(r, RoomFailure(FailureKind.LAYOUT, f"room {r.room}: index length "
                                          f"mismatch {piece.pages.size} vs "
                                          f"{max(d.first + d.pages.size - piece.first, 0)} "
                                          f"(decode {endpoint}, from room page {d.first})",
                                          ORIGIN), now, out)
                return
            dests.append(dest)
        r.offset = max(r.offset, piece.end)
        self._start_write(r, piece.pages, tuple(dests), piece.is_last, now, out,
                          layers=piece.layers)

    def _retiled(self, r: SenderRoom) -> bool:
        """Does a destination of ``r`` (not a dummy) have another page size than this rank?"""
        return self.page_size > 0 and any(
            not d.is_dummy and d.peer.page_size and d.peer.page_size != self.page_size
            for d in r.dests.values())

    def _next_tokens(self, r: SenderRoom) -> TokenStep | None:
        """The re-tiled pump's next write (see the class docstring), or None while nothing
        new is writable. Per layer ``l`` the room's tokens written so far (``r.written``)
        and those its pages allow: up to the last boundary of every destination's pages
        (the lcm of their page sizes) that the leading pages with layer ``l`` named reach,
        or, once the last send was accepted, the room's token count ``T``. The next write
        moves one token range of the first run of consecutive layers that agree on both,
        so layer ranges of re-tiled pages move as they are named (layer streaming), and
        each (decode page, layer) is named by one write only. The write that leaves
        nothing more to write after the last send is the last (aux rides on it; it moves
        no tokens when every token was written before)."""
        if r.cover is None:
            return None
        r.chunks.clear()  # what they named is in r.cover
        cover, ps = r.cover, self.page_size
        if r.written is None:
            r.written = np.zeros(cover.num_layers, dtype=np.int64)
        done = r.written
        r.offset = cover.complete_prefix()
        if r.last_named:
            room_end = self._room_tokens(r)
            target = np.full(done.size, room_end, dtype=np.int64)
        else:
            room_end = None
            step = self._lcm(r)
            target = np.maximum(cover.layer_prefixes() * ps // step * step, done)
        todo = np.flatnonzero(target > done)
        if not todo.size:
            return None if room_end is None else TokenStep(room_end, room_end, 0, done.size,
                                                           True, room_end)
        l0 = int(todo[0])
        lo, hi = int(done[l0]), int(target[l0])
        same = (done[l0:] == lo) & (target[l0:] == hi)
        l1 = l0 + (int(np.argmin(same)) if not same.all() else int(same.size))
        last = room_end is not None and not (target[l1:] > done[l1:]).any()
        return TokenStep(lo, hi, l0, l1, last, room_end)

    def _write_tokens(self, r: SenderRoom, step: TokenStep, now: float,
                      out: list[Effect]) -> None:
        """Start the re-tiled write ``step``; fail the room (kind ``layout``) when the
        room's pages on either side hold no common token count."""
        ps = self.page_size
        if step.room_end is not None and (r.offset - 1) * ps >= step.room_end:
            self._fail(r, RoomFailure(FailureKind.LAYOUT, f"room {r.room}: index length "
                                      f"mismatch: the prefill's last page gets no token of "
                                      f"the room's {step.room_end} ({r.offset} pages of {ps} "
                                      f"tokens; decode: {r.peers})", ORIGIN), now, out)
            return
        dests = []
        for endpoint, d in r.dests.items():
            dest = self._token_dest(r, d, endpoint, step)
            if isinstance(dest, str):
                self._fail(r, RoomFailure(FailureKind.LAYOUT, f"room {r.room}: index length "
                                          f"mismatch: {dest} (decode {endpoint})", ORIGIN),
                           now, out)
                return
            dests.append(dest)
        assert r.written is not None and r.cover is not None
        first, end = step.lo // ps, -(-step.hi // ps)
        src = np.concatenate(r.src_pages)[first:end] if r.src_pages else np.zeros(0, np.int64)
        r.written[step.l0:step.l1] = step.hi
        whole = step.l1 - step.l0 == r.cover.num_layers
        self._start_write(r, src, tuple(dests), step.is_last, now, out, first,
                          (step.lo, step.hi), None if whole else (step.l0, step.l1))

    def _lcm(self, r: SenderRoom) -> int:
        """The lcm of every destination's page size: re-tiled writes but the last end on
        a multiple of it (a page boundary of every destination)."""
        step = 1
        for d in r.dests.values():
            if not d.is_dummy and d.peer.page_size:
                step = int(np.lcm(step, d.peer.page_size))
        return step

    def _room_tokens(self, r: SenderRoom) -> int:
        """``T``: the most tokens both this rank's pages and every destination's hold."""
        ends = [(d.first + d.pages.size) * d.peer.page_size for d in r.dests.values()
                if not d.is_dummy]
        return min([r.offset * self.page_size, *ends])

    def _token_dest(self, r: SenderRoom, d: Dest, endpoint: str,
                    step: TokenStep) -> WriteDest | str:
        """What destination ``d`` receives of room tokens ``[step.lo, step.hi)``: the part
        from its first page on; or why its pages do not fit (a message)."""
        state = d.state if step.is_last else None
        hi = step.hi
        if d.is_dummy:
            return WriteDest(endpoint, d.pages[:0], d.aux_index, True, d.peer.payload,
                             state=state, tokens=(hi, hi))
        pd, n = d.peer.page_size, d.pages.size
        end = (d.first + n) * pd
        room_end = step.room_end
        if hi > end or (room_end is not None and end - pd >= room_end):
            have = f"{r.offset} pages of {self.page_size} tokens here, {d.first} + {n} pages " \
                f"of {pd} there"
            return f"tokens up to {hi} do not fit ({have})" if hi > end else \
                f"its last page gets no token of the room's {room_end} ({have})"
        lo = max(step.lo, d.first * pd)
        if lo >= hi:
            return WriteDest(endpoint, d.pages[:0], d.aux_index, False, d.peer.payload,
                             state=state, dst_first=d.first + n, tokens=(hi, hi))
        a, b = lo // pd, -(-hi // pd)
        return WriteDest(endpoint, d.pages[a - d.first:b - d.first], d.aux_index, False,
                         d.peer.payload, state=state, dst_first=a, tokens=(lo, hi))

    def _start_write(self, r: SenderRoom, src: Pages, dests: tuple[WriteDest, ...],
                     is_last: bool, now: float, out: list[Effect], src_first: int = 0,
                     tokens: tuple[int, int] | None = None,
                     layers: tuple[int, int] | None = None) -> None:
        """Hand one chunk to a :class:`Write` (Transferring; the last chunk ends the queue)."""
        if r.status != KVPoll.Transferring:
            self._advance(r, KVPoll.Transferring, now)
        deadline = min(r.since + self.timeouts.transfer,
                       min(d.write_deadline for d in r.dests.values()))
        r.writing = True
        if is_last:
            r.last_sent = True
            r.chunks.clear()  # nothing after the last chunk is ever written
        out.append(Write(r.room, r.attempt, src, dests, is_last,
                         r.aux_index if is_last else None, deadline,
                         r.state if is_last else None, src_first, tokens, layers))

    @staticmethod
    def _chunk_dest(r: SenderRoom, d: Dest, endpoint: str, piece: Piece) -> WriteDest | None:
        """Where the piece's room pages go on ``d``: the part from ``d.first`` on (the
        decode holds the pages before it). None when the decode's pages do not match (too
        few, or the room's pages, at its last send, do not end where the decode's pages
        end; case K10)."""
        n = int(piece.pages.size)
        total = r.cover.size if r.cover is not None else piece.end
        end_ok = not piece.is_last or total == d.first + d.pages.size
        if piece.pos is None:
            lo, hi = max(piece.first, d.first), piece.first + n
            need = max(hi - lo, 0)
            dst = d.pages[lo - d.first:hi - d.first] if need else d.pages[:0]
            skip = min(lo - piece.first, n)
            fits = dst.size == need
        else:  # ascending positions: those the decode holds lead
            skip = int(np.searchsorted(piece.pos, d.first))
            idx = piece.pos[skip:] - d.first
            fits = not idx.size or int(idx[-1]) < d.pages.size
            dst = d.pages[idx] if fits else d.pages[:0]
        if d.is_dummy:
            return WriteDest(endpoint, dst, d.aux_index, True, d.peer.payload, skip,
                             d.state if piece.is_last else None)
        if not fits or not end_ok:
            return None
        return WriteDest(endpoint, dst, d.aux_index, False, d.peer.payload, skip,
                         d.state if piece.is_last else None)

    # ---- internals: endings -----------------------------------------------------------

    def _advance(self, r: SenderRoom, status: KVPoll, now: float) -> None:
        """Every change of a room's status goes through here."""
        r.status, r.since = status, now
        self.changed.add(r.room)

    def _succeed(self, r: SenderRoom, now: float, out: list[Effect]) -> None:
        self._advance(r, KVPoll.Success, now)
        self._report_all(r, now, out)
        out.append(Ended(r.room, r.attempt, KVPoll.Success, None, r.peers, r.created,
                         r.nbytes, r.seconds))
        out.append(Wake())

    def _fail(self, r: SenderRoom, failure: RoomFailure, now: float, out: list[Effect]) -> None:
        """Failed is sticky: the first failure wins; every destination is told."""
        if r.done:
            return
        self._advance(r, KVPoll.Failed, now)
        r.failure = failure
        r.chunks.clear()
        if r.writing:  # its write is no longer wanted: what has not started never will
            out.append(CancelWrites(r.room, r.attempt))
        self._report_all(r, now, out)
        out.append(Ended(r.room, r.attempt, KVPoll.Failed, failure, r.peers, r.created,
                         r.nbytes, r.seconds))
        out.append(Wake())

    def _report_all(self, r: SenderRoom, now: float, out: list[Effect]) -> None:
        """The room's status to every destination still registered as the instance the
        room is bound to (a restarted decode does not know the room; the same instance
        registering again, e.g. after a new bootstrap epoch, still does)."""
        for endpoint, d in r.dests.items():
            peer = self.peers.get(endpoint)
            if peer is not None and peer.instance == d.peer.instance:
                out.append(self._report(r, endpoint, d.inc, now))

    def _report(self, r: SenderRoom, endpoint: str, inc: int, now: float) -> Report:
        d = r.dests.get(endpoint)
        peer = d.peer if d is not None else self.peers[endpoint]
        aux = r.aux_index if r.status == KVPoll.Success and d is not None and \
            not d.is_dummy else None
        return self._say(Report(endpoint, peer.instance, r.room, inc, r.status, r.failure,
                                quiesced=not r.writing, aux_index=aux), now)

    def _answer(self, peer: DecodePeer, msg: control.RoomPages, failure: RoomFailure,
                now: float) -> Report:
        """Refuse ``msg`` (nothing was or will be written for it)."""
        return self._say(Report(peer.endpoint, peer.instance, msg.room, msg.inc,
                                KVPoll.Failed, failure, quiesced=True), now)

    def _overdue(self, r: SenderRoom, now: float, out: list[Effect]) -> bool:
        """Fail ``r`` if it is past its state's deadline. Checked by the sweep and before
        any move to a later state, so a room never outlives its deadlines because the
        sweep ran late."""
        deadline = r.deadline(self.timeouts)
        if deadline is None or now <= deadline:
            return False
        self._fail(r, self._timeout(r, now), now, out)
        return True

    def _timeout(self, r: SenderRoom, now: float) -> RoomFailure:
        limit = self.timeouts.limit(r.status) or 0.0
        return RoomFailure(FailureKind.TIMEOUT, f"room {r.room}: timed out in {r.status.name} "
                           f"after {now - r.since:.1f}s on prefill (limit {limit:.1f}s; decode: "
                           f"{r.peers})", ORIGIN)

    def _retire(self, r: SenderRoom, now: float) -> None:
        """Move an ended attempt out of the engine-visible table into a tombstone (and,
        while a write is in flight, into ``retired`` so its result finds it)."""
        if self.rooms.get(r.room) is r:
            del self.rooms[r.room]
            self.changed.add(r.room)
        if r.writing:
            self.retired[(r.room, r.attempt)] = r
        self.tombstones.put(r.room, Tombstone(r.room, r.status, r.failure, len(r.dests)), now)

    def _pool_replaced(self, old: DecodePeer, args: control.KVArgsWire, now: float,
                       out: list[Effect]) -> None:
        """The same instance registered other KV args (its engine registered a new pool,
        K44): rooms bound to the previous registration were planned for memory that is
        gone; they fail and are never written again (their queued writes are cancelled)."""
        failure = RoomFailure(FailureKind.PEER, f"decode rank {old.endpoint} registered "
                              f"another KV pool: rooms bound to its previous pool end",
                              ORIGIN)
        for r in list(self.rooms.values()):
            d = r.dests.get(old.endpoint)
            if d is not None and d.peer.instance == old.instance and d.peer.kv_args != args:
                self._fail(r, failure, now, out)
        self.dropped["replaced_pool"] += 1

    def _peer_restarted(self, old: DecodePeer, now: float, out: list[Effect]) -> None:
        failure = RoomFailure(FailureKind.PEER, f"decode rank {old.endpoint} restarted "
                              f"(instance {old.instance} is gone)", ORIGIN)
        del self.peers[old.endpoint]  # reports skip destinations bound to the old instance
        for r in list(self.rooms.values()):
            d = r.dests.get(old.endpoint)
            if d is not None and d.peer.instance == old.instance:
                self._fail(r, failure, now, out)
        self._drop_pending_of(old.endpoint)
        self.dropped["restarted_peer"] += 1

    # ---- internals: buffers -----------------------------------------------------------

    def _take_pending(self, room: int) -> list[Pending]:
        entries = self.pending.pop(room, [])
        for p in entries:
            self._unbuffer(p)
        return entries

    def _unbuffer(self, p: Pending) -> None:
        self.pending_by_peer[p.msg.endpoint] -= 1
        if self.pending_by_peer[p.msg.endpoint] <= 0:
            del self.pending_by_peer[p.msg.endpoint]
        self.pending_bytes -= len(p.msg.dst_pages)

    def _drop_pending(self, room: int, endpoint: str) -> None:
        entries = self.pending.pop(room, [])
        kept = []
        for p in entries:
            if p.msg.endpoint == endpoint:
                self._unbuffer(p)
            else:
                kept.append(p)
        if kept:
            self.pending[room] = kept

    def _drop_pending_of(self, endpoint: str) -> None:
        for room in [k for k, v in self.pending.items() if any(p.msg.endpoint == endpoint
                                                                for p in v)]:
            self._drop_pending(room, endpoint)

    def _expire_pending(self, now: float, out: list[Effect]) -> None:
        limit = self.timeouts.bootstrap
        for room in [k for k, v in self.pending.items() if any(now - p.at > limit for p in v)]:
            for p in self._take_pending(room):
                if now - p.at <= limit:
                    self.pending.setdefault(room, []).append(p)
                    self.pending_by_peer[p.msg.endpoint] += 1
                    self.pending_bytes += len(p.msg.dst_pages)
                    continue
                peer = self.peers.get(p.msg.endpoint)
                if peer is not None and peer.instance == p.msg.instance_id:
                    out.append(self._answer(peer, p.msg, RoomFailure(
                        FailureKind.TIMEOUT, f"room {room}: no sender appeared on this "
                        f"prefill rank within {limit:.1f}s", ORIGIN), now))

    def _forget_idle_peers(self, now: float, out: list[Effect]) -> None:
        """Peers unused for ``peer_ttl`` (no message, no room bound) are forgotten (S08)."""
        bound = {ep for r in self.rooms.values() if not r.done for ep in r.dests}
        bound |= {ep for r in self.retired.values() for ep in r.dests}
        for endpoint, peer in list(self.peers.items()):
            if endpoint not in bound and now - peer.last_seen > self.limits.peer_ttl and \
                    endpoint not in self.pending_by_peer:
                del self.peers[endpoint]
                self.former.put(endpoint, peer.instance, now)
                out.append(ForgetPeer(endpoint))


def _same_state(a: StateRef, b: StateRef) -> bool:
    """Whether two state references name the same slot and window pages."""
    return a.index == b.index and np.array_equal(a.window, b.window)
