"""The prefill side of a daemon: performs what :class:`kvd.rooms.sender.SenderRooms`
decides — planning and writing chunks, reporting room status to decode ranks,
registering this rank with the bootstrap server.

The protocol (states, deadlines, incarnations, tombstones, release rules) lives
in the pure machine; this module only does I/O and planning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from kvd.addr import http_url, parse_hostport
from kvd.control.inbound import Misaddressed
from kvd.daemon.core import Core
from kvd.daemon.side import RoomView, Side, Snapshot, not_available
from kvd.discovery.base import Registrar
from kvd.errors import (
    ConfigError,
    KvdError,
    LayoutError,
    RegistrationError,
    RoomError,
    TransportError,
    WriteCancelled,
)
from kvd.logs import fields
from kvd.membership.machine import skew_reason
from kvd.protocol import control, rpc
from kvd.protocol.codec import unpack_indices
from kvd.protocol.release import DIGEST_BYTES, ReleaseAnswer, ReleaseOutcome, ReleaseRequest
from kvd.rooms.effects import CancelWrites, Effect, Refuse, Report, StateRef, Write, WriteDest
from kvd.rooms.sender import Limits, RankPosition, SenderRooms
from kvd.rooms.state import UNKNOWN_ROOM, FailureKind, KVPoll, RoomFailure
from kvd.schemas import Peer, Room
from kvd.security import SEAL_OVERHEAD
from kvd.transfer.backends.base import CancelToken, PeerAttach
from kvd.transfer.compat import check_compat
from kvd.transfer.groups import GroupPairPlan, group_layouts, pair_groups, plan_room_groups
from kvd.transfer.kvargs import RankArgs
from kvd.transfer.layout import PairPlan, RankLayout, check_coverage, check_pair, prefill_targets
from kvd.transfer.plan import Descriptors, check_plan_bounds, plan_aux
from kvd.transfer.state import (
    StatePairPlan,
    check_state_coverage,
    plan_room_state,
    state_layout,
)

log = logging.getLogger("kvd.prefill")


@dataclass(frozen=True)
class PeerPlan:
    """What planning needs of a registered decode rank (the machine's opaque payload)."""

    args: RankArgs
    layout: RankLayout
    state: StatePairPlan | None = None  # hybrid models: state slots and window pages
    groups: tuple[GroupPairPlan, ...] = ()  # extra paged caches: draft KV, indexer K


class PrefillSide(Side):
    """Senders of one prefill rank."""

    role = "prefill"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        s = core.settings
        self.rooms = SenderRooms(  # its position is the engine's, set at registration
            self.timeouts, RankPosition(),
            Limits(max_peers=s.max_peers, max_rooms_per_peer=s.max_rooms_per_peer,
                   peer_ttl=s.peer_ttl))
        self._registrations: dict[str, control.RegisterRank] = {}
        self._sessions: dict[str, str] = {}  # decode endpoint -> its transfer address
        # transfer address -> the decode instance the backend's cache of it is renewed for
        self._session_instances: dict[str, str] = {}
        self._layout: RankLayout | None = None
        self._pairs: dict[str, PairPlan] = {}  # decode endpoint -> its planning constants
        self._writes: set[asyncio.Task[None]] = set()
        # the token of each write in flight, by (room, attempt): the machine's CancelWrites
        # cancels it (K43); at most one write per attempt is in flight
        self._tokens: dict[tuple[int, int], CancelToken] = {}
        self.failing_sessions: dict[str, int] = {}
        self.bootstrap_registered = False
        self.bootstrap_instance: str | None = None
        self.etcd: Registrar | None = None  # discovery = etcd: this rank's lease keeper
        self._etcd_options = None
        if s.discovery == "etcd":  # read the password file now: a bad one stops startup
            from kvd.discovery.etcd import etcd_options
            self._etcd_options = etcd_options(s)
        self._skew_logged: set[str] = set()

    # ---- engine calls -----------------------------------------------------------------

    def call(self, call: rpc.Call) -> Any:
        now = self.core.clock()
        match call:
            case rpc.SenderCreate():
                if call.release_digest and len(call.release_digest) != DIGEST_BYTES:
                    raise RoomError(f"room {call.room}: release_digest must be "
                                    f"{DIGEST_BYTES} bytes, got {len(call.release_digest)}")
                effects = self.rooms.create(call.room, now, call.release_digest)
                self.core.events.room_started(self.role, call.room)
            case rpc.SenderInit():
                effects = self.rooms.init(call.room, call.num_pages, call.aux_index, now,
                                          _state_ref(call))
            case rpc.SenderSend():
                pages = unpack_indices(call.pages)
                send = call  # a bad chunk fails the room (its peers hear it), then raises
                self.run_call(lambda: self.rooms.send(send.room, pages, send.is_last, now))
                return None
            case rpc.SenderSendLayers():
                pages = unpack_indices(call.pages)
                part = call  # as a chunk: a bad layer send fails the room, then raises
                self.run_call(lambda: self.rooms.send(part.room, pages, part.is_last, now,
                                                      (part.layer_start, part.layer_end)))
                return None
            case _:
                raise not_available(call, self.role)
        self.run(effects)
        return None

    def view(self, room: int) -> RoomView | None:
        p = self.rooms.poll(room)
        if p is None:
            return None
        done = p.status in (KVPoll.Success, KVPoll.Failed)
        return RoomView(p.status, p.failure, True, (p.nbytes, p.seconds) if done else None)

    def poll(self, rooms: Iterable[int]) -> rpc.PollResult:
        """Like :meth:`Side.poll` (same answer), in one loop over the machine's table."""
        rooms = list(rooms)
        table = self.rooms.rooms
        statuses: list[int] = []
        reasons: dict[int, str] = {}
        kinds: dict[int, str] = {}
        stats: dict[int, tuple[int, float]] = {}
        # per room, no enum lookups: KVPoll.X and .value cost 90-140 ns each (P5)
        success, failed = KVPoll.Success, KVPoll.Failed
        for room in rooms:
            r = table.get(room)
            if r is None:
                statuses.append(UNKNOWN_ROOM)
                continue
            status = r.status
            statuses.append(status._value_)
            if status is success or status is failed:
                stats[room] = (r.nbytes, r.seconds)
            if r.failure is not None:
                reasons[room], kinds[room] = r.failure.reason, r.failure.kind.value
        return rpc.PollResult(statuses=statuses, reasons=reasons, kinds=kinds, stats=stats,
                              releasable=rooms)  # a prefill never holds pages back

    def take_changed(self) -> set[int]:
        return self.rooms.take_changed()

    def abort(self, room: int, reason: str, bootstrap_addr: str | None = None,
              dp_rank: int | None = None) -> None:
        self.run(self.rooms.abort(room, reason, self.core.clock()))

    def clear(self, room: int) -> None:
        self.run(self.rooms.clear(room, self.core.clock()))

    def release(self, req: ReleaseRequest) -> ReleaseAnswer:
        """``POST /v1/rooms/release``: each room of ``req`` ended if ``req.token`` is its
        opener's (:meth:`SenderRooms.release`); one answer per room, never an error for
        one room's refusal. The route is unsigned, so outcomes are counted
        (``releases_*`` totals) and a refused token is logged once, not per room (a
        released room logs its failure as any ended room does)."""
        now, answers = self.core.clock(), {}
        counters = self.core.counters
        for room in dict.fromkeys(req.rooms):
            outcome, effects = self.rooms.release(room, req.token, req.reason, now)
            self.run(effects)
            answers[str(room)] = outcome.value
            name = f"releases_{outcome.value}"
            setattr(counters, name, getattr(counters, name) + 1)
            if outcome is ReleaseOutcome.REFUSED:
                self.core.log_once("release-refused", f"release of room {room} refused: "
                                   "the token is not its opener's (releases_refused)")
        return ReleaseAnswer(rooms=answers)

    def unfinished(self) -> list[int]:
        return [k for k, r in self.rooms.rooms.items() if not r.done]

    # ---- control messages -------------------------------------------------------------

    def on_control(self, msg: control.ControlMessage) -> None:
        now = self.core.clock()
        match msg:
            case control.RegisterRank():
                self._registrations[msg.endpoint] = msg
                self.run(self._register(msg, now))
                if msg.endpoint not in self.rooms.peers:  # refused outright (max_peers):
                    self.forget_peer(msg.endpoint)  # keep nothing, not its session claim
            case control.RoomPages():
                self.run(self.rooms.on_pages(msg, now))
            case control.RoomAbort():
                self.run(self.rooms.on_abort(msg, now))
            case control.Refused():
                self.peer_refused(msg.endpoint, msg.instance_id, msg.why, -msg.offset_s,
                                  msg.window_s)
            case _:
                self.core.counters.protocol_errors += 1
                log.warning("prefill kvd ignores %s from %s", type(msg).__name__,
                            getattr(msg, "endpoint", "?"))

    def peer_refused(self, endpoint: str, instance: str, why: str, offset_s: float,
                     window_s: float) -> None:
        """``instance``: decode rank ``endpoint`` restarted (rooms bound to its old instance
        fail, K28). ``clock_skew``: logged once per peer; its rooms end on the decode side,
        which can tell too (its frames to this rank are refused and answered)."""
        if why == "instance":
            self.run(self.rooms.peer_refused(endpoint, instance, self.core.clock()))
        elif endpoint not in self._skew_logged and len(self._skew_logged) < 1024:
            self._skew_logged.add(endpoint)
            log.warning("%s", skew_reason(f"decode rank {endpoint}", offset_s,
                                          window_s or self.core.settings.auth_max_skew),
                        extra=fields(peer=endpoint))

    def _register(self, msg: control.RegisterRank, now: float) -> list[Effect]:
        """Check a decode rank's KV args against ours; the machine remembers the verdict."""
        rejected: RoomFailure | None = None
        plan: PeerPlan | None = None
        num_pages = num_slots = 0
        try:
            self._check_session(msg)
            args = RankArgs.of(msg.kv_args)
            layout = RankLayout.from_wire(msg.kv_args, msg.attn_tp_rank, msg.attn_tp_size)
            num_pages, num_slots = args.num_pages, args.num_aux_slots
            local = self._local()
            check_compat(local.wire.compat, msg.kv_args.compat)
            check_pair(self._local_layout(), layout, retile=True)  # page sizes may differ
            ranks = self.core.position()
            check_coverage(self._local_layout(), layout, ranks.pp_rank, ranks.pp_size)
            _check_aux(local.wire, msg.kv_args)
            state = self._state_pair(msg)
            groups = self._group_pairs(msg, layout)
            self._attach(msg)
            plan = PeerPlan(args, layout, state, groups)
        except KvdError as exc:
            rejected = RoomFailure(FailureKind.REGISTRATION, f"decode rank {msg.endpoint} "
                                   f"refused: {exc}", self.role)
            log.warning("refused decode rank %s: %s", msg.endpoint, exc)
        return self.rooms.on_register(msg, num_pages, num_slots, rejected, plan, now)

    def _state_pair(self, msg: control.RegisterRank) -> StatePairPlan | None:
        """The pair's state planning constants (None: neither side registered state);
        RegistrationError, with one reason, when only one side did or they differ."""
        r = self.core.position()
        mine = state_layout(self._local().wire, r.attn_tp_rank, r.attn_tp_size)
        peer = state_layout(msg.kv_args, msg.attn_tp_rank, msg.attn_tp_size)
        if mine is None and peer is None:
            return None
        if mine is None or peer is None:
            who = "decode" if mine is None else "prefill"
            raise RegistrationError(f"incompatible state layouts (prefill vs decode): only "
                                    f"the {who} registers state buffers (a hybrid model)")
        pair = StatePairPlan.of(mine, peer)
        check_state_coverage(mine, peer, r.pp_rank, r.pp_size)
        return pair

    def _group_pairs(self, msg: control.RegisterRank,
                     layout: RankLayout) -> tuple[GroupPairPlan, ...]:
        """The pair's paged cache groups (draft KV, indexer K), paired by name; one
        RegistrationError naming the group when they differ (:func:`pair_groups`)."""
        r, local = self.core.position(), self._local_layout()
        dummy = local.is_mla and r.attn_tp_size > msg.attn_tp_size and r.attn_tp_rank != \
            prefill_targets(msg.attn_tp_rank, msg.attn_tp_size, r.attn_tp_size).start
        return pair_groups(group_layouts(self._local().wire, r.attn_tp_rank, r.attn_tp_size),
                           group_layouts(msg.kv_args, msg.attn_tp_rank, msg.attn_tp_size),
                           r.pp_rank, r.pp_size, dummy)

    def _check_session(self, msg: control.RegisterRank) -> None:
        """A decode rank's transfer address must be its own (S11): never this rank's own
        (it would make this rank write into its own pool), never one another registered
        decode endpoint claims."""
        session = msg.kv_args.session_id
        if session == self.core.engine.session_id:
            raise RegistrationError(f"transfer address {session} is this prefill rank's own")
        other = next((ep for ep, sess in self._sessions.items()
                      if sess == session and ep != msg.endpoint), None)
        if other is not None:
            raise RegistrationError(f"transfer address {session} is registered by {other}")

    def _attach(self, msg: control.RegisterRank) -> None:
        """Tell a backend that can copy on this host about the decode rank's exported pool
        (``local``/``auto``); raises RegistrationError/HandleError when ``local`` is
        required and the pool cannot be imported. A previous session of the same
        endpoint is detached once the writes in flight now have returned."""
        engine, session = self.core.engine, msg.kv_args.session_id
        old = self._sessions.get(msg.endpoint)
        if isinstance(engine, PeerAttach):
            engine.attach_peer(session, msg.pool, msg.instance_id, msg.endpoint)
            if old is not None and old != session:
                self.core.spawn(self._detach_later(old), f"detach-{old}")
        self._sessions[msg.endpoint] = session
        self._renew(session, msg.instance_id)

    def _renew(self, session: str, instance: str) -> None:
        """K39: a transfer address registered by an instance the backend's cache of it was
        not renewed for (a decode restarted on the same address, or any first
        registration) is renewed before the first write to it (the executor holds the
        writes): the backend never writes to a new instance through what it cached for a
        dead one (Mooncake: the old data port and buffers)."""
        if self._session_instances.get(session) != instance:
            self._session_instances[session] = instance
            self.core.executor.renew(session)

    async def _detach_later(self, session: str) -> None:
        if self._writes:
            await asyncio.wait(list(self._writes))
        engine = self.core.engine
        if isinstance(engine, PeerAttach) and session not in self._sessions.values():
            engine.detach_peer(session)

    def forget_peer(self, endpoint: str) -> None:
        super().forget_peer(endpoint)
        self._registrations.pop(endpoint, None)
        self._pairs.pop(endpoint, None)
        session = self._sessions.pop(endpoint, None)
        if session is not None:
            if session not in self._sessions.values():  # a later one renews it again
                self._session_instances.pop(session, None)
            self.core.spawn(self._detach_later(session), f"detach-{session}")

    # ---- effects ----------------------------------------------------------------------

    def perform(self, eff: Effect) -> None:
        match eff:
            case Report():
                self._report(eff)
            case Write():
                token = self._tokens[(eff.room, eff.attempt)] = CancelToken(
                    (eff.room, eff.attempt))
                task = self.core.spawn(self._write(eff, token), f"write-{eff.room}")
                self._writes.add(task)
                task.add_done_callback(self._writes.discard)
            case CancelWrites():
                queued = self._tokens.get((eff.room, eff.attempt))
                if queued is not None:
                    queued.cancel()
            case Refuse():  # a dropped message is answered (K16), like a misaddressed one
                size = len(control.encode(eff.message)) + SEAL_OVERHEAD
                self.core.refuse(Misaddressed(eff.message, eff.why, size=size))
            case _:
                raise TypeError(f"prefill cannot perform {eff!r}")

    def _report(self, eff: Report) -> None:
        f, status = eff.failure, eff.status
        try:
            aux = self._aux_payload(eff.aux_index) if eff.aux_index is not None else None
        except RegistrationError as exc:  # the engine changed its aux memory (S16)
            aux, status = None, KVPoll.Failed
            f = RoomFailure(FailureKind.LAYOUT, f"room {eff.room}: the prefill's aux slot "
                            f"{eff.aux_index} cannot be read: {exc}", "prefill")
            log.error("%s", f.reason)
            self.core.spawn(self._check_memory_soon(), "memory-check")
        msg = control.RoomStatus(room=eff.room, inc=eff.inc, status=int(status),
                                 kind=f.kind.value if f else "", reason=f.reason if f else "",
                                 endpoint=self.core.control.endpoint,
                                 instance_id=self.core.instance_id, quiesced=eff.quiesced,
                                 aux=aux or [])
        delay = self.core.faults.aux_delay_s if aux and self.core.faults else 0.0
        if delay:  # fault injection (tests): a slow aux path
            self.core.spawn(self._post_later(eff.to, eff.to_instance, msg, delay),
                            f"status-{eff.room}")
        else:
            self.core.post(eff.to, msg, instance=eff.to_instance)

    async def _check_memory_soon(self) -> None:
        """:meth:`Core.check_memory` after the report in hand went out (it may fail the
        room's siblings, which report too)."""
        self.core.check_memory()

    async def _post_later(self, to: str, instance: str, msg: control.RoomStatus,
                          delay: float) -> None:
        await asyncio.sleep(delay)
        self.core.post(to, msg, instance=instance)

    async def _write(self, eff: Write, token: CancelToken) -> None:
        """Plan and write one chunk to every destination; report exactly once."""
        start = time.perf_counter()
        failure: RoomFailure | None = RoomFailure(
            FailureKind.ABORTED, f"room {eff.room}: write cancelled (kvd stopping)", self.role)
        moved = 0
        # The machine's clock may not be the backend's (time.monotonic): pass the bound on.
        deadline = time.monotonic() + (eff.deadline - self.core.clock())
        try:
            plans = [(d, self._plan(eff, d)) for d in eff.dests]
            results = await asyncio.gather(
                *(self.core.executor.write(d.peer.args.wire.session_id, desc, deadline, token)
                  for d, desc in plans if len(desc)), return_exceptions=True)
            self._raise_first(results)
            moved = sum(desc.nbytes for _, desc in plans)
            self.core.counters.bytes_sent += moved
            self.core.events.chunks_sent((d.endpoint, desc.nbytes) for d, desc in plans)
            self._session_ok(eff.dests)
            failure = None
        except LayoutError as exc:
            failure = RoomFailure(FailureKind.LAYOUT, f"room {eff.room}: {exc}", self.role)
        except WriteCancelled as exc:  # the attempt already ended: nothing to decide
            failure = RoomFailure(FailureKind.ABORTED, f"room {eff.room}: {exc}", self.role)
        except TransportError as exc:
            self._session_failed(eff.dests)
            failure = RoomFailure(FailureKind.TRANSPORT, f"room {eff.room}: transfer to "
                                  f"{', '.join(d.endpoint for d in eff.dests)} failed: {exc}",
                                  self.role)
            self.core.check_memory()  # was it our memory (S16)? fails the room first
        except KvdError as exc:
            failure = RoomFailure(FailureKind.TRANSPORT, f"room {eff.room}: {exc}", self.role)
        finally:
            if self._tokens.get((eff.room, eff.attempt)) is token:
                del self._tokens[(eff.room, eff.attempt)]
            self.run(self.rooms.write_done(eff.room, eff.attempt, failure, moved,
                                           time.perf_counter() - start, self.core.clock()))

    def _raise_first(self, results: list[BaseException | None]) -> None:
        """Count what cancelled writes left behind (K43), then raise the first error
        (a real failure before a cancellation), if any."""
        errors = [r for r in results if isinstance(r, BaseException)]
        c = self.core.counters
        for e in errors:
            if isinstance(e, WriteCancelled):
                c.writes_cancelled += 1
                c.cancelled_bytes_landed += e.landed
                c.cancelled_bytes_dropped += e.dropped
        if errors:
            raise next((e for e in errors if not isinstance(e, WriteCancelled)), errors[0])

    def _plan(self, eff: Write, d: WriteDest) -> Descriptors:
        """Descriptors of one chunk (and, last chunk, the aux slot and the room's hybrid
        caches) to one destination, every range checked against the buffer it was planned
        from, and proved to write exactly this source's share of the decode's pages
        (PlanRefused: kind layout). An MLA dummy writes no KV, but its state heads."""
        peer: PeerPlan = d.peer
        if d.is_dummy:
            return self._plan_state(eff, d, peer, Descriptors.empty())
        local = self._local()
        pair, src_pages = self._pair(d.endpoint, peer), eff.src_pages[d.src_from:]
        # extra paged caches (draft KV, indexer K) ride with the write of the pool's last
        # layer: each (page or token, last layer) is written once, so each group byte is
        pool_end = eff.layers is None or eff.layers[1] == pair.src.num_layers
        if eff.layers is not None:  # layer streaming: this write's layers, planned and proved
            pair = pair.layers(*eff.layers)
        s, ranks = self.core.settings, self.core.position()
        last_stage = ranks.pp_rank == ranks.pp_size - 1  # only the last stage has outputs
        aux = None
        if eff.is_last and last_stage and s.aux_transport == "mooncake" and \
                local.aux_ptrs.size and eff.aux_index is not None and pair.writes_aux:
            aux = (plan_aux(local.aux_ptrs, peer.args.aux_ptrs, local.aux_item_lens,
                            eff.aux_index, d.aux_index),
                   (peer.args.aux_ptrs, peer.args.aux_item_lens, d.aux_index))
        what = f"room {eff.room} to {d.endpoint}"
        # pages, or (re-tiled, issue 22 item 3) the room's tokens [lo, hi) to this decode
        desc = pair.plan_chunk(src_pages, d.dst_pages, d.tokens, eff.src_first, d.dst_first,
                               aux, what)
        check_plan_bounds(desc, local.regions, peer.args.regions, f"room {eff.room}")
        if peer.groups and pool_end:  # draft KV, indexer K: the same pages (items 1, 2)
            extra = plan_room_groups(peer.groups, src_pages, d.dst_pages, d.tokens,
                                     eff.src_first, d.dst_first, what)
            check_plan_bounds(extra, local.regions, peer.args.regions, f"room {eff.room}")
            desc = desc.concat(extra)
        return self._plan_state(eff, d, peer, desc)

    def _plan_state(self, eff: Write, d: WriteDest, peer: PeerPlan,
                    desc: Descriptors) -> Descriptors:
        """``desc`` followed, on the last chunk of a hybrid model's room, by its state slot
        and window pages (planned, bounds-checked and proved: :func:`plan_room_state`)."""
        if not eff.is_last or peer.state is None:
            return desc
        mine, theirs = eff.state or StateRef(), d.state or StateRef()
        # a re-tiled room's last write ends at its token count T: its window in tokens
        extra = plan_room_state(peer.state, mine.index, theirs.index, mine.window,
                                theirs.window, f"room {eff.room} to {d.endpoint}",
                                None if d.tokens is None else d.tokens[1])
        check_plan_bounds(extra, self._local().regions, peer.args.regions, f"room {eff.room}")
        return desc.concat(extra)

    def _pair(self, endpoint: str, peer: PeerPlan) -> PairPlan:
        """The pair's planning constants (kept while both layouts are the same objects)."""
        local = self._local_layout()
        pair = self._pairs.get(endpoint)
        if pair is None or pair.src is not local or pair.dst is not peer.layout:
            pair = self._pairs[endpoint] = PairPlan.of(local, peer.layout, retile=True)
        return pair

    def _session_failed(self, dests: tuple[WriteDest, ...]) -> None:
        """A failed write is evidence against its session, not a verdict: no blacklist."""
        for d in dests:
            if not d.is_dummy:
                session = d.peer.args.wire.session_id
                self.failing_sessions[session] = self.failing_sessions.get(session, 0) + 1
                self.core.counters.session_failures += 1

    def _session_ok(self, dests: tuple[WriteDest, ...]) -> None:
        for d in dests:
            if d.is_dummy:
                continue
            failed = self.failing_sessions.pop(d.peer.args.wire.session_id, 0)
            if failed:
                self.core.counters.session_recoveries += 1
                log.info("transfers to session %s recovered after %d failed room(s)",
                         d.peer.args.wire.session_id, failed)

    def _aux_payload(self, aux_index: int) -> list[bytes] | None:
        """The room's aux slot read from the engine's aux buffers (aux_transport =
        control, last PP stage only); None when aux travels with the transfer. Raises
        :class:`~kvd.errors.HandleError` if a buffer no longer holds the slot."""
        s, local, ranks = self.core.settings, self.core.local, self.core.ranks
        if s.aux_transport != "control" or ranks is None or \
                ranks.pp_rank != ranks.pp_size - 1 or local is None or not local.aux_ptrs.size:
            return None
        mem = self.core.engine_memory
        if mem is None:
            return None
        # through each buffer's descriptor, never the mapping: a pool the engine shrank
        # raises HandleError instead of killing the daemon with SIGBUS (case S16)
        return [b.read(aux_index * int(n), int(n))
                for b, n in zip(mem.aux, local.aux_item_lens, strict=True)]

    # ---- time and lifecycle -----------------------------------------------------------

    def tick(self) -> None:
        self.run(self.rooms.tick(self.core.clock()))

    def start(self) -> None:
        s = self.core.settings
        if s.discovery == "etcd" and s.bootstrap_addr is not None and \
                parse_hostport(s.bootstrap_addr)[0] in ("0.0.0.0", "::"):
            raise ConfigError(f"discovery = etcd registers this rank under its bootstrap_addr, "
                              f"which is {s.bootstrap_addr} (a wildcard bind address): set "
                              f"bootstrap_addr to the address engines advertise (e.g. "
                              f"KVD_BOOTSTRAP_ADDR=$(KVD_HOST):8998 in Kubernetes)")
        self.core.supervise(self._bootstrap_check, "bootstrap-check",
                            self.core.settings.heartbeat_interval)

    def engine_registered(self, args: RankArgs) -> None:
        """New local buffers: check every known decode rank against them again, and
        register with the bootstrap server (once). Rooms a dropped registration left
        are cleared first."""
        self._clear_all()
        self.rooms.num_pages, self.rooms.num_aux_slots = args.num_pages, args.num_aux_slots
        self.rooms.page_size = args.wire.page_size
        self.rooms.num_layers = args.wire.num_layers
        r = self.core.position()
        self.rooms.position = RankPosition(r.attn_tp_rank, r.attn_tp_size, r.attn_dp_rank,
                                           r.attn_dp_size, r.pp_rank, r.pp_size)
        self._layout = None
        now = self.core.clock()
        for msg in list(self._registrations.values()):
            self.run(self._register(msg, now))
        s = self.core.settings
        if s.discovery == "etcd":
            self._register_etcd()
        # with etcd, only a rank that serves /route itself also registers there (for
        # SGLang-native decodes); the others' bootstrap_addr may be a name only
        if not self.bootstrap_registered and (s.discovery == "bootstrap" or s.serve_bootstrap):
            self.core.spawn(self.register_with_bootstrap(), "bootstrap-put")

    def _register_etcd(self) -> None:
        """Hand this rank's registration to its etcd lease keeper (started once)."""
        if self.etcd is None:
            from kvd.discovery.etcd import EtcdClient, EtcdRegistrar
            s = self.core.settings
            # the instance name: set, or this daemon's own bootstrap listener (config check)
            assert s.bootstrap_addr is not None and self._etcd_options is not None
            keeper = EtcdRegistrar(EtcdClient(self._etcd_options), s.etcd_prefix,
                                   s.bootstrap_addr, s.etcd_lease_ttl)
            self.etcd = keeper
            self.core.spawn(keeper.run(), "etcd-registration")
        self.etcd.set_registration(self._registration())

    def engine_lost(self, failure: RoomFailure) -> None:
        self.run(self.rooms.engine_lost(failure, self.core.clock()))

    async def engine_released(self, failure: RoomFailure | None = None) -> None:
        if failure is not None:
            self.engine_lost(failure)
        for room in self.unfinished():
            self.abort(room, "engine disconnected")
        if self._writes:  # our own writes read this memory: let them return
            await asyncio.wait(list(self._writes))
        if failure is None:  # a dropped registration's rooms stay readable (S16) until
            self._clear_all()  # the next registration
        self.rooms.num_pages = self.rooms.num_aux_slots = 0

    def _clear_all(self) -> None:
        for room in list(self.rooms.rooms):
            with contextlib.suppress(RoomError):
                self.clear(room)

    async def drain_done(self) -> None:
        if self.etcd is not None:
            await self.etcd.deregister()
        if self.bootstrap_registered:
            await self.deregister_from_bootstrap()

    def _local(self) -> RankArgs:
        if self.core.local is None:
            raise RegistrationError("no engine has registered KV buffers with this kvd")
        return self.core.local

    def _local_layout(self) -> RankLayout:
        if self._layout is None:
            r = self.core.position()
            self._layout = RankLayout.from_wire(self._local().wire, r.attn_tp_rank,
                                                r.attn_tp_size)
        return self._layout

    # ---- bootstrap registration -------------------------------------------------------

    def _registration(self) -> dict[str, Any]:
        s, r = self.core.settings, self.core.position()
        host, port = self.core.control.endpoint.removeprefix("tcp://").rsplit(":", 1)
        return {"role": "Prefill", "attn_tp_size": r.attn_tp_size, "attn_tp_rank": r.attn_tp_rank,
                "attn_dp_size": r.attn_dp_size, "attn_dp_rank": r.attn_dp_rank,
                "pp_size": r.pp_size, "pp_rank": r.pp_rank, "rank_ip": host.strip("[]"),
                "rank_port": int(port), "instance_id": s.instance_id,
                "page_size": self._local().wire.page_size}

    async def register_with_bootstrap(self) -> None:
        """PUT this rank to the bootstrap server, retrying with capped backoff until
        accepted; remembers the bootstrap server's instance (S06)."""
        s = self.core.settings
        assert s.bootstrap_addr is not None
        url, delay = http_url(s.bootstrap_addr, "/route"), 0.05
        while True:
            try:
                instance = await self._bootstrap_instance()
                resp = await self.core.http("PUT", url, json=self._registration())
                if resp.status_code == 200:
                    self.bootstrap_registered, self.bootstrap_instance = True, instance
                    log.info("registered with bootstrap %s", s.bootstrap_addr)
                    return
                log.warning("bootstrap %s refused registration: %d %s", s.bootstrap_addr,
                            resp.status_code, resp.text)
            except httpx.HTTPError as exc:  # the server is not up yet
                log.info("bootstrap %s not reachable yet (%s); retrying", s.bootstrap_addr,
                         type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _bootstrap_instance(self) -> str | None:
        s = self.core.settings
        assert s.bootstrap_addr is not None
        resp = await self.core.http("GET", http_url(s.bootstrap_addr, "/health"))
        data = resp.json() if resp.status_code == 200 else None
        return data.get("instance_id") if isinstance(data, dict) else None

    async def _bootstrap_check(self) -> None:
        """A restarted bootstrap server forgot this rank: register again (S06)."""
        if not self.bootstrap_registered or self.core.local is None:
            return
        try:
            instance = await self._bootstrap_instance()
        except httpx.HTTPError:
            return
        if instance is not None and instance != self.bootstrap_instance:
            log.warning("bootstrap %s restarted (instance %s -> %s): registering again",
                        self.core.settings.bootstrap_addr, self.bootstrap_instance, instance)
            self.bootstrap_registered = False
            await self.register_with_bootstrap()

    async def deregister_from_bootstrap(self) -> None:
        """Remove this rank from the bootstrap table (best effort, one bounded request)."""
        s, r = self.core.settings, self.core.ranks
        assert s.bootstrap_addr is not None
        if r is None:  # never registered: nothing to remove
            return
        params: dict[str, str | int] = {"engine_rank": r.attn_tp_rank,
                                        "target_dp_group": r.attn_dp_rank,
                                        "target_pp_rank": r.pp_rank, "instance_id": s.instance_id}
        try:
            await self.core.http("DELETE", http_url(s.bootstrap_addr, "/route"), params=params)
            self.bootstrap_registered = False
        except httpx.HTTPError as exc:  # the bootstrap server may be gone already
            log.info("could not deregister from bootstrap %s: %s", s.bootstrap_addr, exc)

    # ---- status -----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        now, started = self.core.clock(), self.core.events.started
        by_state = {s.name: 0 for s in KVPoll}
        rooms = []
        for room, r in self.rooms.rooms.items():
            by_state[r.status.name] += 1
            rooms.append(Room(room=room, state=r.status.name,
                              age_s=round(now - started.get(room, r.created), 3),
                              state_age_s=round(now - r.since, 3), peer=",".join(r.dests) or "-",
                              reason=r.failure.reason if r.failure else "",
                              kind=r.failure.kind.value if r.failure else ""))
        peers = []
        control_plane = self.core.control
        for p in self.rooms.peers.values():
            error, error_time = self.last_error(p.endpoint)
            peers.append(Peer(endpoint=p.endpoint, kind="decode", instance_id=p.instance,
                              state="rejected" if p.rejected else "registered",
                              heartbeat="n/a",
                              detail=p.rejected.reason if p.rejected else
                              f"attn_tp {p.tp_rank}/{p.tp_size}",
                              last_message=self.wall(p.last_seen), last_error=error,
                              last_error_time=error_time,
                              clock_offset_s=control_plane.clock_offset(p.endpoint)))
        peers += self._skewed_peers()
        queue = sum(len(r.chunks) for r in self.rooms.rooms.values())
        return Snapshot(self.role, rooms, peers, by_state, queue, self.rooms.table_sizes(),
                        dict(self.rooms.dropped), self.bootstrap_registered or
                        (self.etcd is not None and self.etcd.registered))

    def _skewed_peers(self) -> list[Peer]:
        """Rows for decode endpoints whose frames are refused for clock skew: they never
        registered, so only the measured offset tells an operator why (K40)."""
        window, rows = self.core.settings.auth_max_skew, []
        for endpoint, offset in self.core.control.offsets().items():
            if abs(offset) > window and endpoint not in self.rooms.peers:
                rows.append(Peer(endpoint=endpoint, kind="decode", state="refused",
                                 heartbeat="n/a", clock_offset_s=round(offset, 3),
                                 instance_id=self.core.control.instance_of(endpoint) or "",
                                 detail=skew_reason(f"decode rank {endpoint}", offset,
                                                   window)))
        return rows


def _check_aux(local: control.KVArgsWire, peer: control.KVArgsWire) -> None:
    """Aux buffers must pair one to one with equal item lengths (bytes)."""
    if local.aux_item_lens != peer.aux_item_lens:
        raise RegistrationError(f"aux item lens mismatch {local.aux_item_lens} vs "
                                f"{peer.aux_item_lens}")


def _state_ref(call: rpc.SenderInit) -> StateRef | None:
    """The room's state slot and window pages as the engine named them (None: neither)."""
    if call.state_index < 0 and not call.window_pages:
        return None
    return StateRef(call.state_index, unpack_indices(call.window_pages))
