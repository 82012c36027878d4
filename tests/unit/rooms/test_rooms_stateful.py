"""The room protocol under random interleavings (tier 1, pure): a hypothesis stateful test.

One or two prefill machines (:class:`SenderRooms`) and one or two decode machines
(:class:`ReceiverRooms`) — TP 1→1, 2→1 or 1→2 — run against a simulated network,
transfer backend, bootstrap lookup and clock. Rules are engine calls on both sides
(create/init/send/abort/clear, retries that reuse a room id, a busy prefill engine,
engine disconnects), network faults (deliver in any order, a failed send, a silent
loss, a duplicate), write results (land a write's pages, complete or fail it), races
(an engine ends a room while its write is in flight; the write lands as late as it
may), lookups (resolve or fail), restarts (a new decode or prefill instance at the
same endpoint, a decode the prefill refuses, a decode registering again), heartbeat
loss, and time (with the sweep on time or late).

The simulated decode pool stamps every page a write lands on with
``(room, incarnation, index in the room)`` (the incarnation the prefill machine had
bound the destination to when it started the write). The decode engine frees a
room's pages the moment the machine says they are releasable (the most adversarial
engine) and hands them to the next room it initialises.

Environment assumptions (what the protocol's bounds rest on, enforced here):
a control message is delivered or lost within ``MAX_DELAY`` of being sent; a write
lands only up to ``SUB_BATCH`` after its deadline (a sub-batch that started in time
cannot be stopped); ``MAX_DELAY + SUB_BATCH < release``.

Checked after every step:

(a) a write lands only on pages owned by the room and incarnation it was started for
    (never on pages the decode reported releasable, whether or not reused since);
(b) every non-terminal room is within its state's deadline and its total lifetime
    bound, as of the last sweep;
(c) the decode reports Success only when every page of the room holds, from every
    prefill rank it needs, the bytes of that incarnation at the right position;
(d) a prefill rank never tells a decode both Success and Failed for one incarnation,
    and the decode's Success implies every target told it Success;
(e) at teardown, after every room is cleared and time passed the expiries, every
    per-room table is back to empty (tombstones stay within their capacity before);
(g) the status table, written only with the rooms each machine says its steps changed
    (``take_changed``, K41), answers what the machine's ``poll`` answers for every room
    (a failed decode room's pages turning releasable by time show from the first sweep
    past that time on);
(h) a decode sweep (``tick``: only the rooms its deadline heap says are due) decides
    exactly what a walk over every room would at the same ``now`` (K41);

and, whenever the ``calm`` rule runs (everything in flight delivered, no time passing):

(f) fast failure: for every binding none of whose messages was lost, a prefill attempt
    that ended has told the decode incarnation, and one still running is bound to a
    decode room still running — nobody learns of an end from a deadline.

The default run is sized for ``make test`` (about 18 000 steps); ``test_rooms_world_long``
(marked slow) runs more, ``KVD_STATEFUL_EXAMPLES`` examples of up to 100 steps.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from roomkit import live_regions

from kvd.control.routing import resolve_targets
from kvd.errors import RoomError
from kvd.protocol import control
from kvd.protocol.codec import pack_indices, unpack_indices
from kvd.rooms.claims import AUX
from kvd.rooms.effects import (
    AbortUnknown,
    CancelWrites,
    Effect,
    Ended,
    ForgetPeer,
    Refuse,
    Report,
    Resolve,
    Send,
    Wake,
    Write,
    WriteAux,
)
from kvd.rooms.receiver import ReceiverRooms, Target
from kvd.rooms.sender import Limits, RankPosition, SenderRooms
from kvd.rooms.state import FailureKind, KVPoll, RoomFailure, Timeouts

TIMEOUTS = Timeouts(bootstrap=8.0, waiting=10.0, transfer=10.0, release=3.0, tombstone=30.0,
                    finished_ttl=25.0)
LIMITS = Limits(peer_ttl=40.0, tombstones=4)
MAX_DELAY = 1.0   # a control message is delivered or lost within this (s)
SUB_BATCH = 0.5   # a write may still land this long after its deadline (s)
SWEEP_STEP = 0.5  # the sides sweep at least this often while time passes (s)
assert TIMEOUTS.release > MAX_DELAY + SUB_BATCH

ROOMS = (1, 2, 3)  # few room ids, so retries and reuse happen all the time
D_POOL = 6         # decode pool pages: every room fits, three rooms fill it
P_POOL = 16
AUX_SLOTS = 2
BOOT = "p-boot:8998"
TOPOLOGIES = {"tp1->1": (1, 1), "tp2->1": (2, 1), "tp1->2": (1, 2)}
KV_ARGS = control.KVArgsWire(session_id="s", kv_data_ptrs=[0], kv_data_lens=[D_POOL * 16],
                             kv_item_lens=[16], aux_data_ptrs=[], aux_data_lens=[],
                             aux_item_lens=[], page_size=16, num_kv_heads=1, head_dim=8,
                             dtype_size=2, num_layers=1)
INDEX = st.integers(0, 63)  # picks one of a list (modulo its length)


def length(room: int) -> int:
    """Pages of the request behind room id ``room`` (both engines agree on it)."""
    return room


# ---- the simulated world --------------------------------------------------------------------

@dataclass(eq=False)
class Pool:
    """One registration of a decode engine's KV pool. ``owner[page]``: the (room, inc) the
    engine gave the page to (None: free); ``stamps[page][prefill rank]``: what landed."""

    name: str
    alive: bool = True
    owner: list[tuple[int, int] | None] = field(default_factory=lambda: [None] * D_POOL)
    stamps: list[dict[int, tuple[int, int, int]]] = field(
        default_factory=lambda: [{} for _ in range(D_POOL)])


@dataclass
class Held:
    """A decode engine's allocation for one room incarnation."""

    inc: int
    pages: list[int]


@dataclass(eq=False)
class DRank:
    """A decode rank: its daemon's machine (one instance), engine pool and allocations."""

    tp_rank: int
    tp_size: int
    endpoint: str
    instance: str
    machine: ReceiverRooms
    pool: Pool
    rejected: RoomFailure | None = None  # the prefill refuses this instance's KV args
    gen: int = 0
    registered: dict[int, str] = field(default_factory=dict)  # prefill rank -> its instance
    held: dict[int, Held] = field(default_factory=dict)
    releasing: bool = False  # its engine went: the pool stays until the machine is quiet
    table: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # the status table


@dataclass
class EngineRoom:
    """A prefill engine's progress on the current attempt of one room."""

    offset: int = 0
    last: bool = False


@dataclass(eq=False)
class PRank:
    """A prefill rank: its machine and what it told each decode incarnation."""

    index: int
    endpoint: str
    instance: str
    machine: SenderRooms
    eng: dict[int, EngineRoom] = field(default_factory=dict)
    word: dict[tuple[str, int, int], set[KVPoll]] = field(default_factory=dict)
    table: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # the status table


@dataclass
class Msg:
    """A control message in flight. ``sender``/``room``/``inc``: the decode machine to tell
    ``send_failed`` when it is lost (a Send with a room set)."""

    to: str
    msg: control.ControlMessage
    sent_at: float
    sender: ReceiverRooms | None = None
    room: int | None = None
    inc: int = 0


@dataclass
class Landing:
    pool: Pool
    page: int
    p_rank: int
    stamp: tuple[int, int, int]  # (room, decode incarnation, index in the room's pages)


@dataclass(eq=False)
class InWrite:
    p: PRank
    eff: Write
    landings: list[Landing]
    landed: int = 0
    dead: bool = False  # its prefill daemon died: it may still land, nobody hears its end
    cancelled: bool = False  # its attempt ended: only what was in flight may still land

    @property
    def landable(self) -> bool:
        return self.landed < len(self.landings)


class RoomsWorld(RuleBasedStateMachine):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.p: list[PRank] = []
        self.p_all: list[PRank] = []  # every prefill instance there ever was
        self.d: list[DRank] = []
        self.net: list[Msg] = []
        self.writes: list[InWrite] = []
        self.resolves: list[tuple[DRank, ReceiverRooms, Resolve]] = []
        self.serial = 0
        self.successes = 0
        self.lost: set[tuple[int, int]] = set()  # (room, inc) some message of which was lost
        self.swept = 0.0  # when the sides last swept (ticked)
        self.later: list[tuple[float, PRank, int]] = []  # prefill creates due at a time

    @initialize(topology=st.sampled_from(sorted(TOPOLOGIES)))
    def start(self, topology: str) -> None:
        p_tp, d_tp = TOPOLOGIES[topology]
        for i in range(p_tp):
            m = SenderRooms(TIMEOUTS, RankPosition(tp_rank=i, tp_size=p_tp), LIMITS)
            m.num_pages, m.num_aux_slots = P_POOL, AUX_SLOTS
            self.p.append(PRank(i, f"tcp://p{i}:1", f"p{i}-a", m))
        self.p_all = list(self.p)
        self.d = [self._new_decode(j, d_tp, None) for j in range(d_tp)]

    def _new_decode(self, tp_rank: int, tp_size: int, rejected: RoomFailure | None) -> DRank:
        self.serial += 1
        endpoint, instance = f"tcp://d{tp_rank}:1", f"d{tp_rank}-{self.serial}"
        m = ReceiverRooms(endpoint, instance, TIMEOUTS)
        m.num_pages, m.num_aux_slots = D_POOL, AUX_SLOTS
        return DRank(tp_rank, tp_size, endpoint, instance, m, Pool(f"{instance}/0"), rejected)

    # ---- performing effects (what kvd/daemon/prefill.py and kvd/daemon/decode.py do) ------

    def run_p(self, p: PRank, effects: list[Effect]) -> None:
        for e in effects:
            match e:
                case Report():
                    self._prefill_word(p, e)
                    f = e.failure
                    msg = control.RoomStatus(room=e.room, inc=e.inc, status=int(e.status),
                                             kind=f.kind.value if f else "",
                                             reason=f.reason if f else "",
                                             endpoint=p.endpoint, instance_id=p.instance,
                                             quiesced=e.quiesced)
                    self.net.append(Msg(e.to, msg, self.now))
                case Write():
                    self._start_write(p, e)
                case CancelWrites():
                    self._cancel_write(p, e)
                case Ended() | Wake() | ForgetPeer():
                    pass
                case Refuse():  # a dropped message is answered (K16): only the dropped kinds
                    assert isinstance(e.message, control.RoomPages | control.RoomAbort
                                      | control.RegisterRank), e
                case _:
                    raise AssertionError(f"the prefill machine emitted {e!r}")

    def run_d(self, d: DRank, effects: list[Effect]) -> None:
        for e in effects:
            match e:
                case Send():
                    self.net.append(Msg(e.to, e.msg, self.now, d.machine, e.room, e.inc))
                case Resolve():
                    self.resolves.append((d, d.machine, e))
                case AbortUnknown():
                    for t in self._targets(d, e.room, e.dp_rank):
                        self.net.append(Msg(t.endpoint, control.RoomAbort(
                            room=e.room, inc=0, kind=e.failure.kind.value,
                            reason=e.failure.reason, endpoint=d.endpoint,
                            instance_id=d.instance), self.now))
                case Ended(status=KVPoll.Success):
                    self._check_success(d, e)
                case WriteAux():  # written at once (a refused write: unit tests)
                    self.run_d(d, d.machine.aux_written(e.room, e.inc, e.endpoint, None,
                                                        self.now))
                case Ended() | Wake():
                    pass
                case _:
                    raise AssertionError(f"the decode machine emitted {e!r}")

    def _prefill_word(self, p: PRank, e: Report) -> None:
        """(d): one incarnation never hears both Success and Failed from one prefill rank."""
        word = p.word.setdefault((e.to_instance, e.room, e.inc), set())
        word.add(e.status)
        assert not {KVPoll.Success, KVPoll.Failed} <= word, (
            f"(d) prefill rank {p.index} told {e.to} both Success and Failed for room "
            f"{e.room} incarnation {e.inc}")

    def _start_write(self, p: PRank, e: Write) -> None:
        assert e.deadline >= self.now, f"write of room {e.room} started after its deadline"
        r = p.machine.rooms[e.room]
        assert r.attempt == e.attempt and not r.done
        offset = r.offset - len(e.src_pages)
        landings = []
        for dest in e.dests:
            bind = r.dests[dest.endpoint]
            peer = p.machine.peers.get(dest.endpoint)
            assert peer is not None and peer.instance == bind.peer.instance, (
                f"K28: room {e.room} written to {dest.endpoint} instance "
                f"{bind.peer.instance}, which is no longer the registered one")
            pool: Pool = dest.peer
            landings += [Landing(pool, int(pg), p.index, (e.room, bind.inc, offset + k))
                         for k, pg in enumerate(dest.dst_pages)]
        self.writes.append(InWrite(p, e, landings))

    def _cancel_write(self, p: PRank, e: CancelWrites) -> None:
        """K43: the machine cancels exactly the write in flight of an attempt that ended;
        the pump drops what it has not submitted (modelled: one page may be in flight)."""
        ws = [w for w in self.writes if w.p is p and not w.dead and
              (w.eff.room, w.eff.attempt) == (e.room, e.attempt)]
        assert len(ws) == 1, f"CancelWrites({e.room}, {e.attempt}) names {len(ws)} writes"
        r = p.machine.rooms.get(e.room)
        assert r is None or r.attempt != e.attempt or r.done, "cancelled a live attempt"
        w = ws[0]
        w.cancelled = True
        del w.landings[w.landed + 1:]

    def _land(self, w: InWrite, upto: int) -> None:
        """(a): a write lands only on pages its room's incarnation still owns."""
        for ld in w.landings[w.landed:upto]:
            if not ld.pool.alive:  # that registration is gone: nothing can land there
                continue
            owner = ld.pool.owner[ld.page]
            assert owner == ld.stamp[:2], (
                f"(a) a write of room {ld.stamp[0]} incarnation {ld.stamp[1]} (prefill rank "
                f"{ld.p_rank}) landed at t={self.now} on page {ld.page} of {ld.pool.name}, "
                f"owned by {owner}")
            ld.pool.stamps[ld.page][ld.p_rank] = ld.stamp
        w.landed = max(w.landed, upto)

    def _check_success(self, d: DRank, e: Ended) -> None:
        """(c) and (d) at the moment the decode machine declares Success."""
        r = d.machine.rooms[e.room]
        assert r.inc == e.inc and r.dst_pages is not None
        held = d.held.get(e.room)
        assert held is not None and held.inc == e.inc
        pages = [int(x) for x in unpack_indices(r.dst_pages)]
        for t in r.targets or ():
            p = next(p for p in self.p_all if (p.endpoint, p.instance) ==
                     (t.endpoint, t.instance))
            word = p.word.get((d.instance, e.room, e.inc))
            assert word == {KVPoll.Success}, (
                f"(d) decode {d.endpoint} Success for room {e.room} incarnation {e.inc} but "
                f"prefill rank {p.index} said {word}")
            for j, pg in enumerate(pages):
                got = d.pool.stamps[pg].get(p.index)
                assert got == (e.room, e.inc, j), (
                    f"(c) decode {d.endpoint} Success for room {e.room} incarnation {e.inc} "
                    f"but page {pg} holds {got} from prefill rank {p.index}")
        self.successes += 1

    def _prefill_at(self, endpoint: str) -> PRank:
        return next(p for p in self.p if p.endpoint == endpoint)

    def _targets(self, d: DRank, room: int, dp_rank: int | None) -> list[Target]:
        """The bootstrap lookup: routing, plus this rank's registration with each target."""
        out = []
        for t in resolve_targets(room, d.tp_rank, d.tp_size, len(self.p), 1, 1, False, dp_rank):
            p = self.p[t.tp_rank]
            if d.registered.get(p.index) != p.instance:
                msg = control.RegisterRank(instance_id=d.instance, endpoint=d.endpoint,
                                           attn_tp_rank=d.tp_rank, attn_tp_size=d.tp_size,
                                           kv_args=KV_ARGS)
                self.run_p(p, p.machine.on_register(msg, D_POOL, AUX_SLOTS, d.rejected,
                                                    d.pool, self.now))
                d.registered[p.index] = p.instance
            out.append(Target(p.endpoint, p.instance, t.required_dst_info_num, t.is_dummy))
        return out

    def _deliver(self, m: Msg) -> None:
        match m.msg:
            case control.RoomPages():
                p = self._prefill_at(m.to)
                self.run_p(p, p.machine.on_pages(m.msg, self.now))
            case control.RoomAbort():
                p = self._prefill_at(m.to)
                self.run_p(p, p.machine.on_abort(m.msg, self.now))
            case control.RoomStatus():
                d = next(d for d in self.d if d.endpoint == m.to)  # whatever instance is there
                self.run_d(d, d.machine.on_status(m.msg, self.now))
            case _:
                raise AssertionError(f"unexpected message {m.msg!r}")

    def _lost(self, m: Msg) -> None:
        if isinstance(m.msg, control.RoomPages | control.RoomAbort | control.RoomStatus):
            self.lost.add((m.msg.room, m.msg.inc))

    def _send_failed(self, m: Msg) -> None:
        if m.sender is None or m.room is None:
            return  # nobody is told: a lost status or abort
        d = next((d for d in self.d if d.machine is m.sender), None)
        if d is not None:
            f = RoomFailure(FailureKind.UNREACHABLE, f"cannot reach {m.to}", "decode")
            self.run_d(d, d.machine.send_failed(m.room, m.inc, m.to, f, self.now))

    def _complete(self, w: InWrite, ok: bool) -> None:
        self.writes.remove(w)
        if w.dead:
            return
        if ok and self.now <= w.eff.deadline + SUB_BATCH:
            self._land(w, len(w.landings))
        failure = None
        if w.cancelled:
            failure = RoomFailure(FailureKind.ABORTED, f"room {w.eff.room}: cancelled",
                                  "prefill")
        elif not ok or w.landable or any(not ld.pool.alive for ld in w.landings):
            failure = RoomFailure(FailureKind.TRANSPORT, f"room {w.eff.room}: write failed",
                                  "prefill")
        self.run_p(w.p, w.p.machine.write_done(w.eff.room, w.eff.attempt, failure, w.landed,
                                               0.0, self.now))

    def _settle(self) -> None:
        """The decode engines free a room's pages as soon as the machine allows it; a
        released pool goes as soon as the machine is quiet."""
        for d in self.d:
            if d.releasing and d.machine.quiet(self.now):
                self._finish_release(d)
            for room, h in list(d.held.items()):
                r = d.machine.rooms.get(room)
                if r is None or r.inc != h.inc or r.releasable(self.now, TIMEOUTS):
                    for pg in h.pages:
                        if d.pool.owner[pg] == (room, h.inc):
                            d.pool.owner[pg] = None
                    del d.held[room]

    def _tick(self) -> None:
        self.swept = self.now
        for p in self.p:
            self.run_p(p, p.machine.tick(self.now))
        for d in self.d:
            self.run_d(d, self._tick_d(d.machine))
        self._settle()

    def _tick_d(self, m: ReceiverRooms) -> list[Effect]:
        """(h): the heap's tick against the walk over every room, on a copy."""
        walked = copy.deepcopy(m)
        want: list[Effect] = []
        for r in list(walked.rooms.values()):
            walked.look(r, self.now, want)
        got = m.tick(self.now)
        assert Counter(map(repr, got)) == Counter(map(repr, want)), (
            f"(h) at t={self.now} the sweep decided {got}, the walk {want}")
        assert _decode_rooms(m) == _decode_rooms(walked), f"(h) at t={self.now}"
        return got

    # ---- rules: engines ------------------------------------------------------------------

    @rule(room=st.sampled_from(ROOMS), p_delay=st.sampled_from([0.0, 0.0, 0.0, 2.0, 5.0]))
    def request(self, room: int, p_delay: float = 0.0) -> None:
        """A request reaches both legs: every decode rank creates and initialises the
        room, every prefill rank creates it (a retry when the room id was used before) —
        ``p_delay`` s later when the prefill engine is busy (the pages wait for it)."""
        for d in self.d:
            self._d_create(d, room)
            self._d_init(d, room, room % AUX_SLOTS)
        for p in self.p:
            if p_delay:
                self.later.append((self.now + p_delay, p, room))
            else:
                self._p_create(p, room)
        self._settle()

    @rule(k=INDEX, room=st.sampled_from(ROOMS), aux=st.integers(0, AUX_SLOTS - 1))
    def p_create(self, k: int, room: int, aux: int) -> None:
        """One prefill rank alone (its peers may come later, K22 B)."""
        self._p_create(self.p[k % len(self.p)], room, aux)
        self._settle()

    def _p_create(self, p: PRank, room: int, aux: int = 0) -> None:
        try:
            effects = p.machine.create(room, self.now)
        except RoomError:
            return  # an attempt is still active: refused (K03)
        p.eng[room] = EngineRoom()
        effects += p.machine.init(room, length(room), aux, self.now)
        self.run_p(p, effects)

    @rule(k=INDEX, room=st.sampled_from(ROOMS), n=st.integers(1, 3),
          variant=st.sampled_from(["ok", "ok", "ok", "mismatch", "bad_source"]))
    def p_send(self, k: int, room: int, n: int, variant: str = "ok") -> None:
        """Send the next chunk. ``mismatch``: a last chunk one page too long (K10);
        ``bad_source``: a source page outside the pool (the engine's mistake)."""
        p = self.p[k % len(self.p)]
        e = p.eng.get(room)
        if e is None or e.last or room not in p.machine.rooms:
            return
        n = min(n, length(room) - e.offset)
        e.last = e.offset + n == length(room)
        if e.last and variant == "mismatch" and n == 1:
            n += 1
        src = np.arange(e.offset, e.offset + n, dtype=np.int64)
        if variant == "bad_source":
            src[-1] = P_POOL
        e.offset += n
        try:
            self.run_p(p, p.machine.send(room, src, e.last, self.now))
        except RoomError as refused:  # the room failed: its decode ranks must hear it
            assert variant == "bad_source"
            self.run_p(p, refused.effects)
        self._settle()

    @rule(k=INDEX, room=st.sampled_from(ROOMS))
    def d_create(self, k: int, room: int) -> None:
        self._d_create(self.d[k % len(self.d)], room)
        self._settle()

    def _d_create(self, d: DRank, room: int) -> None:
        try:
            effects = d.machine.create(room, BOOT, None, self.now)
        except RoomError:
            return  # active, or the previous incarnation's pages are not releasable (K06)
        self.run_d(d, effects)

    @rule(k=INDEX, room=st.sampled_from(ROOMS), aux=st.integers(0, AUX_SLOTS - 1))
    def d_init(self, k: int, room: int, aux: int) -> None:
        self._d_init(self.d[k % len(self.d)], room, aux)
        self._settle()

    def _d_init(self, d: DRank, room: int, aux: int) -> None:
        r = d.machine.rooms.get(room)
        if d.releasing or r is None or r.dst_pages is not None or room in d.held:
            return
        free = [pg for pg in range(D_POOL) if d.pool.owner[pg] is None]
        if len(free) < length(room):
            return
        pages = free[:length(room)]  # lowest first: freed pages are reused at once
        if aux in live_regions(d.machine, self.now, TIMEOUTS)[AUX]:
            # an engine naming an aux slot a live room holds is refused, nothing claimed (K42)
            with pytest.raises(RoomError, match=rf"aux slot {aux} .*held by room"):
                d.machine.init(room, pack_indices(pages), aux, self.now)
            assert r.dst_pages is None
            return
        for pg in pages:
            d.pool.owner[pg] = (room, r.inc)
        d.held[room] = Held(r.inc, pages)
        self.run_d(d, d.machine.init(room, pack_indices(pages), aux, self.now))

    @rule(prefill=st.booleans(), k=INDEX, room=st.sampled_from(ROOMS), unknown=st.booleans())
    def abort(self, prefill: bool, k: int, room: int, unknown: bool) -> None:
        """An engine aborts (decode, ``unknown``: naming the bootstrap address, K34)."""
        if prefill:
            p = self.p[k % len(self.p)]
            self.run_p(p, p.machine.abort(room, "client gone", self.now))
        else:
            d = self.d[k % len(self.d)]
            addr = BOOT if unknown else None
            self.run_d(d, d.machine.abort(room, "engine abort", self.now, bootstrap_addr=addr))
        self._settle()

    @rule(prefill=st.booleans(), k=INDEX, room=st.sampled_from(ROOMS))
    def clear(self, prefill: bool, k: int, room: int) -> None:
        if prefill:
            p = self.p[k % len(self.p)]
            p.eng.pop(room, None)
            self.run_p(p, p.machine.clear(room, self.now))
        else:
            d = self.d[k % len(self.d)]
            try:
                effects = d.machine.clear(room, self.now)
            except RoomError as refused:  # pages not releasable yet: the engine keeps them
                self.run_d(d, refused.effects)  # (an unfinished room was aborted all the same)
                return
            assert d.machine.rooms.get(room) is None
            self.run_d(d, effects)
        self._settle()

    @rule(kind=st.sampled_from(["p_engine", "d_engine", "d_restart", "d_restart_refused",
                                "d_reregister", "p_restart", "heartbeat"]), k=INDEX)
    def fault(self, kind: str, k: int) -> None:
        """Engine disconnects, decode restarts (possibly with refused KV args, K30), a
        decode that registers again (same instance: it saw the bootstrap epoch change), a
        prefill daemon restart (its writes in flight may still land), missed heartbeats."""
        match kind:
            case "p_restart":
                i = k % len(self.p)
                old = self.p[i]
                self.serial += 1
                m = SenderRooms(TIMEOUTS, old.machine.position, LIMITS)
                m.num_pages, m.num_aux_slots = P_POOL, AUX_SLOTS
                self.p[i] = PRank(i, old.endpoint, f"p{i}-{self.serial}", m)
                self.p_all.append(self.p[i])
                for w in self.writes:
                    w.dead = w.dead or w.p is old
            case "d_reregister":
                self.d[k % len(self.d)].registered.clear()
            case "p_engine":
                self._p_engine_disconnect(self.p[k % len(self.p)])
            case "d_engine":
                self._d_engine_disconnect(self.d[k % len(self.d)])
            case "d_restart" | "d_restart_refused":
                i = k % len(self.d)
                old = self.d[i]
                old.pool.alive = False
                rejected = RoomFailure(FailureKind.REGISTRATION, "kv item len mismatch",
                                       "prefill") if kind == "d_restart_refused" else None
                self.d[i] = self._new_decode(old.tp_rank, old.tp_size, rejected)
            case "heartbeat":
                d = self.d[k % len(self.d)]
                f = RoomFailure(FailureKind.HEARTBEAT, "prefill missed heartbeats", "decode")
                self.run_d(d, d.machine.peer_lost(BOOT, f, self.now))
        self._settle()

    def _p_engine_disconnect(self, p: PRank) -> None:
        """kvd/daemon/prefill.py engine_released: abort, wait for its own writes, clear."""
        for room in [x for x, r in p.machine.rooms.items() if not r.done]:
            self.run_p(p, p.machine.abort(room, "engine disconnected", self.now))
        for w in [w for w in self.writes if w.p is p]:
            self._complete(w, ok=True)  # it waits for them: they may still land
        for room in list(p.machine.rooms):
            self.run_p(p, p.machine.clear(room, self.now))
        p.eng.clear()

    def _d_engine_disconnect(self, d: DRank) -> None:
        """The decode engine goes and comes back (kvd/daemon/decode.py engine_released, then
        engine_registered, K44): the machine aborts its rooms; the pool is unregistered,
        and a new one registered under the same instance, only once the machine is quiet
        (:meth:`_finish_release`)."""
        if d.releasing:
            return
        self.run_d(d, d.machine.engine_released(self.now))
        d.releasing = True

    def _finish_release(self, d: DRank) -> None:
        """Nothing can be written into the old pool any more: it goes, a new one comes (the
        model cannot express the same addresses; that is the in-process test's part)."""
        d.machine.forget_rooms()
        d.pool.alive = False
        d.gen += 1
        d.pool = Pool(f"{d.instance}/{d.gen}")
        d.held.clear()
        d.registered.clear()
        d.machine.engine_registered(D_POOL, AUX_SLOTS, ())
        d.releasing = False

    # ---- rules: lookups, network, writes, time ----------------------------------------------

    @rule(action=st.sampled_from(["deliver", "deliver", "deliver", "resolve", "resolve",
                                  "land", "complete", "complete", "lose", "duplicate"]),
          i=INDEX, flag=st.booleans())
    def network(self, action: str, i: int, flag: bool) -> None:
        """One thing happens to what is in flight (nothing, if there is nothing):

        * ``deliver`` message ``i`` (any order);
        * ``resolve`` lookup ``i``: resolved, or (``i`` % 5 == 0) failed;
        * ``land`` write ``i``'s pages (``flag``: one page only), if not too late;
        * ``complete`` write ``i``: returns ok, or (``i`` % 4 == 0) failed;
        * ``lose`` message ``i``: its send fails (nothing reached the peer; a decode room
          whose pages it carried is told), or (``flag``) it is lost silently (a socket
          dropped with messages queued in it);
        * ``duplicate`` message ``i``.
        """
        match action:
            case "deliver" if self.net:
                self._deliver(self.net.pop(i % len(self.net)))
            case "resolve" if self.resolves:
                self._resolve(self.resolves.pop(i % len(self.resolves)), ok=i % 5 != 0)
            case "land":
                ws = [w for w in self.writes
                      if w.landable and self.now <= w.eff.deadline + SUB_BATCH]
                if ws:
                    w = ws[i % len(ws)]
                    self._land(w, w.landed + 1 if flag else len(w.landings))
            case "complete" if self.writes:
                self._complete(self.writes[i % len(self.writes)], ok=i % 4 != 0)
            case "lose" if self.net:
                m = self.net.pop(i % len(self.net))
                self._lost(m)
                if not flag:
                    self._send_failed(m)
            case "duplicate" if self.net:
                # A copy exists only of a message that was sent: neither copy can come back
                # as a failed send any more (losing one is silent), K32's rule is for sends
                # that never left.
                k = i % len(self.net)
                self.net[k] = replace(self.net[k], sender=None, room=None)
                self.net.append(replace(self.net[k]))
        self._settle()

    @rule(i=INDEX, kind=st.sampled_from(["d_abort", "d_clear", "p_abort", "p_clear", "none",
                                         "skip", "skip", "skip", "skip", "skip"]),
          late=st.booleans(), lost=st.booleans())
    def race(self, i: int, kind: str, late: bool, lost: bool) -> None:
        """Something happens to the room of write ``i`` while the write is in flight: an
        engine aborts or clears it on either side (K06, K07); then (``late``) the write
        lands as late as it may — its deadline plus a sub-batch — after time passed and
        both sides swept (``lost``: the messages due meanwhile are lost), K22. With no
        write in flight, things first go well until one is. (``skip``: nothing; every
        race ends its room, and rooms must also get the chance to succeed.)"""
        if kind == "skip":
            return
        for _ in range(3):
            if self.writes:
                break
            self.progress(1)
        if not self.writes:
            return
        w = self.writes[i % len(self.writes)]
        room = w.eff.room
        match kind:
            case "d_abort" | "d_clear":
                for d in self.d:
                    if not any(ld.pool is d.pool for ld in w.landings):
                        continue
                    if kind == "d_abort":
                        self.run_d(d, d.machine.abort(room, "client gone", self.now))
                    else:
                        try:
                            self.run_d(d, d.machine.clear(room, self.now))
                        except RoomError as refused:  # pages still out: aborted, kept
                            self.run_d(d, refused.effects)
            case "p_abort" | "p_clear" if not w.dead:
                if kind == "p_abort":
                    self.run_p(w.p, w.p.machine.abort(room, "client gone", self.now))
                else:
                    w.p.eng.pop(room, None)
                    self.run_p(w.p, w.p.machine.clear(room, self.now))
        self._settle()
        if late:
            end = w.eff.deadline + SUB_BATCH
            if end > self.now:
                self.advance(end - self.now, lost)
            if w in self.writes and self.now <= end:
                self._land(w, len(w.landings))

    def _resolve(self, pending: tuple[DRank, ReceiverRooms, Resolve], ok: bool) -> None:
        d, machine, e = pending
        if machine is not d.machine or self.d[d.tp_rank] is not d:
            return  # that daemon restarted: the lookup died with it
        if ok:
            effects = machine.resolved(e.room, e.inc, self._targets(d, e.room, e.dp_rank),
                                       self.now)
        else:
            effects = machine.resolve_failed(e.room, e.inc, RoomFailure(
                FailureKind.BOOTSTRAP, "bootstrap answered 503", "decode"), self.now)
        self.run_d(d, effects)

    @rule(rounds=st.integers(1, 4))
    def progress(self, rounds: int) -> None:
        """Everything goes well for a while: writes in flight return, lookups succeed,
        messages arrive, prefill engines send their next chunk (whose write stays in
        flight: it returns at a later step, so other rules can race with it)."""
        earlier = list(self.writes)
        for _ in range(rounds):
            for w in [w for w in earlier if w in self.writes]:
                self._complete(w, ok=True)
            for pending in list(self.resolves):
                self.resolves.remove(pending)
                self._resolve(pending, ok=True)
            for m in list(self.net):
                self.net.remove(m)
                self._deliver(m)
            for p in self.p:
                for room in list(p.eng):
                    r = p.machine.rooms.get(room)
                    if r is not None and r.status in (KVPoll.WaitingForInput,
                                                      KVPoll.Transferring):
                        self.p_send(p.index, room, 3)
            self._settle()

    @rule(dt=st.sampled_from([0.1, 0.3, 0.6, 1.2, 3.5, 9.0]), lost=st.booleans(),
          sweep=st.sampled_from([True, True, True, False]))
    def advance(self, dt: float, lost: bool, sweep: bool = True) -> None:
        """Time passes, in steps of at most ``SWEEP_STEP`` after each of which every side
        sweeps (``sweep`` False: one step and no sweep — the sweep is late, and engine calls
        and messages meet rooms past their deadline). A message cannot outlive
        ``MAX_DELAY``: older ones arrive before time moves on (or, ``lost``, their sends
        fail)."""
        end = self.now + dt
        while self.now < end:
            step = min(end - self.now, SWEEP_STEP) if sweep else end - self.now
            self._flush(self.now + step, lost)
            self.now = end if end - self.now <= step else self.now + step
            for due in [x for x in self.later if x[0] <= self.now]:
                self.later.remove(due)
                if due[1] in self.p:  # not restarted since
                    self._p_create(due[1], due[2])
            if sweep:
                self._tick()

    def _flush(self, until: float, lost: bool) -> None:
        for _ in range(100):
            overdue = [m for m in self.net if m.sent_at + MAX_DELAY < until]
            if not overdue:
                return
            for m in overdue:
                self.net.remove(m)
                if lost:
                    self._lost(m)
                    self._send_failed(m)
                else:
                    self._deliver(m)
            self._settle()
        raise AssertionError("messages keep causing messages")

    @rule(now=st.sampled_from([True, False, False, False]))
    def calm(self, now: bool) -> None:
        """Fast failure: once nothing is in flight (lookups answered, messages delivered,
        writes returned; no time passes), both sides of every binding whose messages were
        never lost know of every end: a prefill attempt that ended has told its decode
        rank, and a prefill attempt still running is bound to a decode room still running
        (K08, K21, K29, K30, K32, K34: nobody learns an end from a deadline). Settling
        everything costs the other rules their interleavings, so it runs one time in
        four it is drawn (and at teardown)."""
        if not now:
            return
        self._settle_network(ok=True)
        for p in self.p:
            for r in p.machine.rooms.values():
                for ep, dest in r.dests.items():
                    d = next(d for d in self.d if d.endpoint == ep)
                    if d.instance != dest.peer.instance or (r.room, dest.inc) in self.lost:
                        continue  # a restarted decode; or a lost message: the deadlines rule
                    rr = d.machine.rooms.get(r.room)
                    live = rr is not None and rr.inc == dest.inc and not rr.done
                    if r.done:
                        assert not live or (r.status == KVPoll.Success and
                                            p.endpoint in rr.successes), (
                            f"prefill rank {p.index} ended room {r.room} ({r.status.name}) "
                            f"but decode {ep} incarnation {dest.inc} was not told")
                    else:
                        assert live, (f"prefill rank {p.index} still runs room {r.room} for "
                                      f"decode {ep} incarnation {dest.inc}, which ended")

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def every_room_within_its_deadline(self) -> None:
        """(b): as of the last sweep (a late sweep is allowed for)."""
        for p in self.p:
            for r in p.machine.rooms.values():
                if r.done:
                    continue
                deadline = r.deadline(TIMEOUTS)
                assert deadline is not None and self.swept <= deadline, (
                    f"prefill room {r.room} in {r.status.name} past its deadline {deadline}")
                assert self.swept - r.created <= (TIMEOUTS.bootstrap + TIMEOUTS.waiting
                                                  + TIMEOUTS.transfer)
        for d in self.d:
            for rr in d.machine.rooms.values():
                if rr.done:
                    continue
                deadline = rr.deadline(TIMEOUTS)
                assert deadline is not None and self.swept <= deadline, (
                    f"decode room {rr.room} in {rr.status.name} past its deadline {deadline}")
                assert self.swept - rr.created <= TIMEOUTS.bootstrap + TIMEOUTS.waiting

    @invariant()
    def no_two_live_rooms_share_a_region(self) -> None:
        """K42: no page, aux slot, state slot or window page is named by two rooms of one
        decode rank whose writes may still land."""
        for d in self.d:
            live_regions(d.machine, self.now, TIMEOUTS)  # raises on a shared region

    @invariant()
    def status_table_is_the_machines_poll(self) -> None:
        """(g): publish what each machine says changed, then compare every room."""
        for p in self.p:
            for room in p.machine.take_changed():
                q = p.machine.poll(room)
                p.table[room] = (q.status, q.failure) if q else None  # type: ignore[assignment]
            for room in set(p.table) | set(p.machine.rooms):
                q = p.machine.poll(room)
                assert p.table.get(room) == ((q.status, q.failure) if q else None), (
                    f"(g) prefill rank {p.index} table shows room {room} stale")
        for d in self.d:
            for room in d.machine.take_changed():
                q = d.machine.poll(room, self.now)
                d.table[room] = (q.status, q.failure, q.releasable) if q else None  # type: ignore
            for room in set(d.table) | set(d.machine.rooms):
                q = d.machine.poll(room, self.now)
                want = (q.status, q.failure, q.releasable) if q else None
                shown = d.table.get(room)
                if shown != want and want is not None and shown == (*want[:2], False):
                    r = d.machine.rooms[room]  # releasable by time: not before a sweep
                    assert r.releasable(self.now, TIMEOUTS) and not \
                        r.releasable(self.swept, TIMEOUTS), f"(g) decode room {room}"
                    continue
                assert shown == want, (f"(g) decode {d.endpoint} table shows room {room} "
                                       f"as {shown}, poll says {want}")

    @invariant()
    def tables_are_consistent_and_bounded(self) -> None:
        for p in self.p:
            m = p.machine
            assert max(len(m.tombstones), len(m.early), len(m.words)) <= LIMITS.tombstones
            assert m.pending_bytes == sum(len(x.msg.dst_pages) for v in m.pending.values()
                                          for x in v)
            assert all(r.done and r.writing for r in m.retired.values())

    # ---- teardown: quiesce, clear everything, let time pass: (e) -------------------------

    def teardown(self) -> None:
        if not self.p:
            return
        self.later.clear()  # no new rooms from here on
        self.calm(now=True)
        self._drain()
        for p in self.p:
            for room in list(p.machine.rooms):
                self.run_p(p, p.machine.clear(room, self.now))
        for d in self.d:
            for room in list(d.machine.rooms):
                self.run_d(d, d.machine.abort(room, "teardown", self.now))
        self._drain()
        self.advance(TIMEOUTS.waiting + TIMEOUTS.release + MAX_DELAY, lost=False)  # bounds pass
        self._drain()
        for d in self.d:
            for room in list(d.machine.rooms):
                self.run_d(d, d.machine.clear(room, self.now))  # must not raise now
        self._drain()
        for p in self.p:
            assert not p.machine.retired
            assert len(p.machine.tombstones) <= LIMITS.tombstones
        horizon = max(TIMEOUTS.tombstone, TIMEOUTS.bootstrap, TIMEOUTS.finished_ttl,
                      LIMITS.peer_ttl) + 1.0
        self.advance(horizon, lost=False)
        for p in self.p:
            sizes = p.machine.table_sizes()
            assert sizes == {"rooms": 0, "retired": 0, "pending": 0, "pending_bytes": 0,
                             "early_aborts": 0, "tombstones": 0, "words": 0, "peers": 0}, (
                f"(e) prefill rank {p.index} tables after clear: {sizes}")
            assert not p.machine.pending_by_peer
        for d in self.d:
            assert d.machine.table_sizes() == {"rooms": 0}, "(e) decode rooms after clear"
            assert not d.held and all(o is None for o in d.pool.owner)

    def _drain(self) -> None:
        self._settle_network(ok=False)

    def _settle_network(self, ok: bool) -> None:
        """Until nothing is in flight: answer every lookup (``ok``: resolved, else failed),
        return every write (landing what still can), deliver every message."""
        self._tick()
        for _ in range(1000):
            if not (self.resolves or self.writes or self.net):
                return
            for pending in list(self.resolves):
                self.resolves.remove(pending)
                self._resolve(pending, ok)
            for w in list(self.writes):
                self._complete(w, ok=True)
            for m in list(self.net):
                self.net.remove(m)
                self._deliver(m)
            self._tick()  # the daemons' sweep runs too (no time passes)
        raise AssertionError("the protocol does not settle")


def _decode_rooms(m: ReceiverRooms) -> dict[int, tuple[Any, ...]]:
    return {k: (r.inc, r.status, r.failure, r.since, r.release_seen)
            for k, r in m.rooms.items()}


TestRoomsWorld = RoomsWorld.TestCase
TestRoomsWorld.settings = settings(max_examples=400, stateful_step_count=50, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
def test_rooms_world_long() -> None:
    run_state_machine_as_test(RoomsWorld, settings=settings(
        max_examples=int(os.environ.get("KVD_STATEFUL_EXAMPLES", "600")),
        stateful_step_count=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
