"""The decode side of a daemon: performs what :class:`kvd.rooms.receiver.ReceiverRooms`
decides — bootstrap lookups, registering this rank's KV args with prefill ranks,
control messages, aux copies — and what :class:`kvd.membership.machine.Members`
decides about the prefill peers: heartbeat probes, closing cached lookups,
registrations and sockets, failing the rooms of a lost or restarted peer.

Prefill instances are named by their bootstrap address. This module only does I/O:
which peer is alive, which instance it is and what is held for it is the
membership machine's, fed by heartbeats, ``/route`` answers and control messages.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpx

from kvd.addr import http_url, parse_hostport
from kvd.control.routing import Target as RouteTarget
from kvd.control.routing import resolve_targets
from kvd.daemon.core import Core
from kvd.daemon.side import RoomView, Side, Snapshot, not_available
from kvd.discovery.base import Lookups
from kvd.discovery.bootstrap import BootstrapClient, endpoint_of
from kvd.discovery.events import PeerEvent, PeerPut
from kvd.errors import (
    BootstrapError,
    ClockSkew,
    KvdError,
    PeerUnreachable,
    ProtocolError,
    RegistrationError,
    RoomError,
)
from kvd.logs import fields
from kvd.membership.effects import (
    Close,
    FailRooms,
    Forget,
    Measure,
    Probe,
    Resource,
    ResourceKind,
    Verify,
)
from kvd.membership.effects import Effect as MemberEffect
from kvd.membership.machine import Limits, Members
from kvd.membership.machine import Peer as Member
from kvd.protocol import control, rpc
from kvd.rooms.effects import AbortUnknown, Effect, Resolve, Send, WriteAux
from kvd.rooms.receiver import ReceiverRooms, Target
from kvd.rooms.state import UNKNOWN_ROOM, FailureKind, KVPoll, RoomFailure
from kvd.schemas import Peer, Room
from kvd.transfer.kvargs import RankArgs, state_region_counts

log = logging.getLogger("kvd.decode")

#: Rooms a mass failure (a lost peer, a restarted one) fails in one loop turn; the rest
#: on the next turns (K41: a lost peer's 4 096 rooms held ``/health`` for one turn).
FAIL_SLICE = 256
#: Lookups (``Resolve`` effects) started as tasks in one loop turn; the rest on the next
#: turns (K41: one ``Many`` of 4 096 creates started 4 096 tasks that all ran in the next
#: turn, while at most ``bootstrap_max_lookups`` can be in flight anyway).
RESOLVE_SLICE = 128


class PeerRestarted(KvdError):
    """A room's lookup named an instance of the prefill that is not its current one."""


class PeerDown(KvdError):
    """The prefill is down (heartbeats missed) and was looked up moments ago."""


class DecodeSide(Side):
    """Receivers of one decode rank."""

    role = "decode"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.rooms = ReceiverRooms(core.control.endpoint, core.instance_id, self.timeouts)
        self.bootstrap: Lookups = BootstrapClient(core.http, core.settings.bootstrap_retry_budget,
                                                  core.settings.auth_max_skew,
                                                  core.settings.bootstrap_max_lookups)
        self.etcd = None
        if core.settings.discovery == "etcd":  # watched leases replace heartbeats
            from kvd.discovery.etcd import EtcdClient, EtcdLookups, etcd_options
            s = core.settings
            self.etcd = self.bootstrap = EtcdLookups(
                EtcdClient(etcd_options(s)), s.etcd_prefix, s.bootstrap_retry_budget,
                s.etcd_view_ttl, s.etcd_lease_ttl, self.on_discovery, core.clock)
        self.registered: dict[str, str] = {}  # prefill endpoint -> instance registered with
        #: prefill endpoint -> when this rank last sent it a message (registered ones only)
        self.last_sent: dict[str, float] = {}
        self._registering: dict[tuple[str, str], asyncio.Future[None]] = {}
        #: (prefill endpoint, instance) whose rooms' pages are about to be sent again (K16)
        self._resending: set[tuple[str, str]] = set()
        #: prefill endpoint -> (instance, reason) whose last registration of this rank it
        #: refused ``full`` (K16); cleared when this rank registers there again
        self.refused_full: dict[str, tuple[str, str]] = {}
        st = core.settings
        self.members = Members(Limits(
            max_failures=st.heartbeat_max_failures, peer_ttl=st.peer_ttl,
            fresh_for=st.heartbeat_interval,
            max_probes=max(1, int(st.heartbeat_max_probes_per_s * st.heartbeat_interval)),
            down_retry=min(1.0, st.heartbeat_interval), max_skew=st.auth_max_skew))
        self.last_round_probes = 0
        self.fail_slices = 0  # loop turns that failed a slice of a mass failure (tests)
        self._resolves: deque[Resolve] = deque()  # lookups not started yet
        self.resolve_turns = 0  # loop turns that started lookups (tests)

    # ---- engine calls -----------------------------------------------------------------

    def call(self, call: rpc.Call) -> Any:
        now = self.core.clock()
        match call:
            case rpc.ReceiverCreate():
                parse_hostport(call.bootstrap_addr)
                if self.core.local is None:
                    raise RegistrationError("no engine has registered KV buffers with this kvd")
                effects = self.rooms.create(call.room, call.bootstrap_addr, call.dp_rank, now)
                self.members.used(call.bootstrap_addr, now)
                self.core.events.room_started(self.role, call.room, call.bootstrap_addr)
            case rpc.ReceiverInit():
                effects = self.rooms.init(call.room, call.dst_pages, call.aux_index, now,
                                          call.first_page, call.state_index,
                                          call.window_pages)
            case _:
                raise not_available(call, self.role)
        self.run(effects)
        return None

    def view(self, room: int) -> RoomView | None:
        p = self.rooms.poll(room, self.core.clock())
        return None if p is None else RoomView(p.status, p.failure, p.releasable)

    def poll(self, rooms: Iterable[int]) -> rpc.PollResult:
        """Like :meth:`Side.poll` (same answer), in one loop over the machine's table: a
        poll of 1 000 rooms is one call per engine scheduler step."""
        table, now, timeouts = self.rooms.rooms, self.core.clock(), self.timeouts
        statuses: list[int] = []
        releasable: list[int] = []
        reasons: dict[int, str] = {}
        kinds: dict[int, str] = {}
        # per room, no enum lookups: KVPoll.X and .value cost 90-140 ns each (P5)
        success, failed = KVPoll.Success, KVPoll.Failed
        for room in rooms:
            r = table.get(room)
            if r is None:
                statuses.append(UNKNOWN_ROOM)
                releasable.append(room)
                continue
            status = r.status
            statuses.append(status._value_)
            if status is success or (status is failed and r.releasable(now, timeouts)):
                releasable.append(room)
            if r.failure is not None:
                reasons[room], kinds[room] = r.failure.reason, r.failure.kind.value
        return rpc.PollResult(statuses=statuses, reasons=reasons, kinds=kinds,
                              releasable=releasable)

    def take_changed(self) -> set[int]:
        return self.rooms.take_changed()

    def abort(self, room: int, reason: str, bootstrap_addr: str | None = None,
              dp_rank: int | None = None) -> None:
        if bootstrap_addr is not None:  # refused as ReceiverCreate refuses it, not dropped
            parse_hostport(bootstrap_addr)  # later by the task that tells the prefill ranks
        self.run(self.rooms.abort(room, reason, self.core.clock(), bootstrap_addr, dp_rank))

    def clear(self, room: int) -> None:
        self.run_call(lambda: self.rooms.clear(room, self.core.clock()))

    def unfinished(self) -> list[int]:
        return [k for k, r in self.rooms.rooms.items() if not r.done]

    # ---- control messages -------------------------------------------------------------

    def on_control(self, msg: control.ControlMessage) -> None:
        if isinstance(msg, control.RoomStatus):
            if msg.status == KVPoll.Failed:  # was it our memory (S16)? before the room
                self.core.check_memory()   # takes the prefill's word for its failure
            now = self.core.clock()
            self.apply(self.members.control_seen(msg.endpoint, msg.instance_id, now))
            self.run(self.rooms.on_status(msg, now))
        elif isinstance(msg, control.Refused) and msg.why in ("unregistered", "full"):
            self._dropped_by(msg.endpoint, msg.instance_id, msg.why)
        elif isinstance(msg, control.Refused):
            self.peer_refused(msg.endpoint, msg.instance_id, msg.why, -msg.offset_s,
                              msg.window_s)
        else:
            self.core.counters.protocol_errors += 1
            log.warning("decode kvd ignores %s from %s", type(msg).__name__,
                        getattr(msg, "endpoint", "?"))

    def peer_refused(self, endpoint: str, instance: str, why: str, offset_s: float,
                     window_s: float) -> None:
        """A signed refusal from prefill rank ``endpoint`` (kvd/control/inbound.py), or a
        frame of it sealed outside the window (``clock_skew``, kvd/daemon.py). Sealed with
        the cluster secret every member holds, so a claim, translated for the membership
        machine, which decides (S11):

        * ``instance`` (the rank says it restarted): ``Verify``; only a fresh lookup naming
          the new instance fails the rooms bound to the old one (kind ``peer``) and drops
          the registration (``rank_verified``);
        * ``clock_skew`` (``offset_s``: the claimed offset, s; ``window_s``: the claimed
          window, s; both logged, neither believed): rooms fail only on this side's own
          measurement of the peer's clock beyond ``auth_max_skew`` (``clock_claimed``,
          ``Measure``, K40).

        A refusal the machine does not confirm leaves the registration and the rooms."""
        now = self.core.clock()
        if why == "clock_skew":
            log.info("prefill rank %s: clock skew claimed (%+.1fs, window %.0fs); measuring "
                     "its clock", endpoint, offset_s, window_s, extra=fields(peer=endpoint))
            self.apply(self.members.clock_claimed(endpoint, now))
            return
        self.apply(self.members.refused(endpoint, instance, now))

    def _dropped_by(self, endpoint: str, instance: str, why: str) -> None:
        """Prefill rank ``endpoint`` (instance ``instance``, authentic: the refusal is
        sealed for this rank's instance) dropped a message of this rank (K16):

        * ``unregistered``: it holds no registration of this rank (forgot it after
          ``peer_ttl``, S08, or never got it): register again, then send the pages of
          the unfinished rooms bound to that instance again;
        * ``full``: it holds ``max_peers`` decode ranks and dropped this rank's
          registration: the rooms bound to that instance fail now (kind
          ``registration``), and the next room registers afresh.

        Rooms bound to another instance at that endpoint are untouched (that refusal
        says nothing of them). A ``full`` refusal is also kept until this rank registers
        there again: a room whose lookup sent the refused registration but had not bound
        its targets when the answer came fails as it binds (:meth:`_resolve`), instead of
        sending pages the prefill drops unanswered until ``waiting_timeout``."""
        now = self.core.clock()
        bound = [r for r in self.rooms.rooms.values() if not r.done and any(
            t.endpoint == endpoint and t.instance == instance for t in r.targets or ())]
        if self.registered.get(endpoint) == instance:
            del self.registered[endpoint]  # the prefill does not hold it: never trust it
        if why == "full":  # a room resolving now to it fails when it binds (_resolve)
            self.refused_full[endpoint] = (instance, f"prefill rank {endpoint} refused this "
                                           f"decode rank's registration: it holds max_peers "
                                           f"decode ranks already")
        if not bound:
            return
        if why == "full":
            failure = RoomFailure(FailureKind.REGISTRATION, self.refused_full[endpoint][1],
                                  self.role)
            log.warning("%s (%d rooms fail)", failure.reason, len(bound),
                        extra=fields(peer=endpoint))
            self.run(self.rooms.target_lost(endpoint, instance, failure, now))
            return
        key = (endpoint, instance)
        if key in self._resending:  # one resend per burst of refusals: it sends them all
            return
        log.info("prefill rank %s holds no registration of this rank: registering again "
                 "and sending the pages of %d rooms again", endpoint, len(bound),
                 extra=fields(peer=endpoint))
        self._resending.add(key)
        self.core.spawn(self._register_and_resend(endpoint, instance),
                        f"reregister-{endpoint}")

    async def _register_and_resend(self, endpoint: str, instance: str) -> None:
        try:
            await self._ensure_registered(endpoint, instance)
        except KvdError as exc:  # the rooms' deadlines and the send failures still hold
            log.warning("prefill rank %s: registering again failed: %s", endpoint, exc,
                        extra=fields(peer=endpoint))
            return
        finally:
            self._resending.discard((endpoint, instance))
        self.run(self.rooms.resend_to(endpoint, instance, self.core.clock()))

    async def _verify_rank(self, addr: str, endpoint: str,
                           keys: list[tuple[str, int, int, int]]) -> None:
        """Look rank ``endpoint`` of ``addr`` (its lookup ``keys``: address, tp, dp, pp) up
        afresh and tell the membership machine which instance it is now (the answer to
        its ``Verify``)."""
        for key in keys:
            self.bootstrap.ranks.pop(key, None)  # a live view (etcd) has nothing to drop
        for _, tp, dp, pp in keys:
            try:
                info = await self.bootstrap.rank(addr, RouteTarget(tp, dp, pp, False, 1))
            except KvdError as exc:  # the heartbeat and the rooms' deadlines still hold
                log.info("prefill %s: rank %s could not be looked up again: %s", addr,
                         endpoint, exc, extra=fields(peer=addr))
                continue
            self.apply(self.members.rank_verified(addr, endpoint_of(info),
                                                  info.instance_id or "", self.core.clock()))

    # ---- effects ----------------------------------------------------------------------

    def perform(self, eff: Effect) -> None:
        match eff:
            case Send():
                self._sent_to(eff.to)
                self.core.post(eff.to, eff.msg, self._on_send_fail(eff), eff.to_instance)
            case Resolve():
                self._resolves.append(eff)
                if len(self._resolves) == 1:
                    self._start_resolves_soon()
            case AbortUnknown():
                self.core.spawn(self._abort_unknown(eff), f"abort-{eff.room}")
            case WriteAux():
                self._write_aux(eff)
            case _:
                raise TypeError(f"decode cannot perform {eff!r}")

    def _start_resolves_soon(self) -> None:
        try:
            asyncio.get_running_loop().call_soon(self._start_resolves)
        except RuntimeError:  # no loop (a direct caller): start them now
            self._start_resolves()

    def _start_resolves(self) -> None:
        """Start at most :data:`RESOLVE_SLICE` queued lookups; the rest next turn."""
        self.resolve_turns += 1
        for _ in range(min(RESOLVE_SLICE, len(self._resolves))):
            eff = self._resolves.popleft()
            self.core.spawn(self._resolve(eff), f"resolve-{eff.room}")
        if self._resolves:
            self._start_resolves_soon()

    def _on_send_fail(self, eff: Send) -> Callable[[str], None] | None:
        room = eff.room
        if room is None:
            return None

        def failed(reason: str) -> None:
            failure = RoomFailure(FailureKind.UNREACHABLE, f"room {room}: cannot reach prefill "
                                  f"rank {eff.to}: {reason}", self.role)
            self.run(self.rooms.send_failed(room, eff.inc, eff.to, failure, self.core.clock()))

        return failed

    async def _resolve(self, eff: Resolve) -> None:
        """Targets of a room; reports ``resolved`` or ``resolve_failed`` exactly once."""
        failure: RoomFailure | None = RoomFailure(
            FailureKind.ABORTED, f"room {eff.room}: lookup cancelled (kvd stopping)", self.role)
        targets: list[Target] = []
        via: str | None = None
        try:
            targets, via = await self._current_targets(eff.room, eff.bootstrap_addr,
                                                       eff.dp_rank)
            skew = self.members.skewed(eff.bootstrap_addr, (t.endpoint for t in targets),
                                       self.core.clock())
            failure = None if skew is None else RoomFailure(
                FailureKind.PEER, f"room {eff.room}: {skew}", self.role)
            full = next((self.refused_full[t.endpoint][1] for t in targets
                         if self.refused_full.get(t.endpoint, ("", ""))[0] == t.instance), None)
            if failure is None and full is not None:  # refused while the lookup ran (K16)
                failure = RoomFailure(FailureKind.REGISTRATION, f"room {eff.room}: {full}",
                                      self.role)
        except KvdError as exc:
            failure = RoomFailure(_kind_of(exc), f"room {eff.room}: {exc}", self.role)
        finally:
            now = self.core.clock()
            self.run(self.rooms.resolved(eff.room, eff.inc, targets, now, via)
                     if failure is None
                     else self.rooms.resolve_failed(eff.room, eff.inc, failure, now))

    async def _current_targets(self, room: int, addr: str,
                               dp_rank: int | None) -> tuple[list[Target], str | None]:
        """:meth:`_targets`, resolved again while discovery replaced one of them meanwhile:
        a room resolved after a restart is known is never bound to the old instance."""
        for _ in range(3):
            targets, via = await self._targets(room, addr, dp_rank)
            if self.etcd is None or self.etcd.all_current(addr, targets):
                return targets, via
        raise BootstrapError(f"prefill {addr}: its ranks kept changing instance during lookup")

    async def _targets(self, room: int, addr: str,
                       dp_rank: int | None) -> tuple[list[Target], str | None]:
        """The room's targets and the instance the lookup they came from names. Looked up
        as the membership machine says (:class:`~kvd.membership.effects.Lookup`): fresh
        when nothing recent is known of the peer, one try while it is down."""
        local, ranks = self.core.local, self.core.ranks
        if local is None or ranks is None:
            raise RegistrationError("the engine released its KV buffers")
        plan = self.members.lookup(addr, self.core.clock())
        if plan.refuse:
            p = self.members.peers[addr]
            raise PeerDown(f"prefill {addr} is down ({p.misses} heartbeats missed; "
                           f"looked up again at most every "
                           f"{self.members.limits.down_retry:g}s)")
        if plan.refresh:
            self._close(Resource(ResourceKind.LOOKUP, addr))
        info = await self.bootstrap.parallel_info(
            addr, plan.retry, lambda i: self.apply(self.members.route_answered(
                addr, i.instance_id, self.core.clock())))
        self.apply(self.members.hold(addr, Resource(ResourceKind.LOOKUP, addr)))
        routes = resolve_targets(room, ranks.attn_tp_rank, ranks.attn_tp_size,
                                 info.prefill_attn_tp_size,
                                 info.prefill_dp_size, info.prefill_pp_size, local.wire.is_mla,
                                 dp_rank)
        out = []
        for t in routes:
            rank = await self.bootstrap.rank(addr, t)
            endpoint, instance = endpoint_of(rank), rank.instance_id or ""
            self.core.control.learn(endpoint, instance)  # fills the directory's gaps (S09)
            self.apply(self.members.hold(addr, Resource(ResourceKind.SOCKET, endpoint),
                                         rank.instance_id))
            await self._ensure_registered(endpoint, instance)
            self.apply(self.members.hold(addr, Resource(ResourceKind.REGISTRATION, endpoint)))
            out.append(Target(endpoint, instance, t.required_dst_info_num, t.is_dummy))
        if not self.members.bound_to(addr, info.instance_id):  # it restarted meanwhile
            raise PeerRestarted(f"prefill {addr} restarted while the room resolved (lookup "
                                f"named instance {info.instance_id})")
        return out, info.instance_id

    async def _ensure_registered(self, endpoint: str, instance: str) -> None:
        """Register this rank's KV args with prefill rank ``endpoint`` (its instance
        ``instance``) once, and again when this rank sent it nothing for half of
        ``peer_ttl``; concurrent rooms share the one message.

        The prefill forgets a decode rank that sent it nothing for ``peer_ttl`` s (S08)
        and drops its later messages unanswered (S13): a room whose pages went to a
        registration the prefill had forgotten waited until ``waiting_timeout``. The
        decode cannot see the prefill forget it, so it stops trusting a registration well
        before then (it assumes the prefill's ``peer_ttl`` is no shorter than its own)."""
        last = self.last_sent.get(endpoint)
        if self.registered.get(endpoint) == instance and last is not None and \
                self.core.clock() - last <= self.core.settings.peer_ttl / 2:
            return
        key = (endpoint, instance)
        fut = self._registering.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._register(endpoint, instance))
            self._registering[key] = fut
            fut.add_done_callback(lambda _: self._registering.pop(key, None))
        await asyncio.shield(fut)

    async def _register(self, endpoint: str, instance: str) -> None:
        local, ranks = self.core.local, self.core.ranks
        if local is None or ranks is None:
            raise RegistrationError("the engine released its KV buffers")
        pool = None
        exported = self.core.export()
        if self.core.peer_channel and exported is not None:
            # a same-host prefill may copy directly, fetching the descriptors from the
            # peer channel (S18): the message names regions, never what to open
            pool = exported[0]
        msg = control.RegisterRank(self.core.instance_id, self.core.control.endpoint,
                                   ranks.attn_tp_rank, ranks.attn_tp_size, local.wire, pool)
        self.refused_full.pop(endpoint, None)  # this registration may be held: its answer says
        try:
            sent = await self.core.send(endpoint, msg, instance)  # sealed for that instance
        except ProtocolError as exc:  # no peer would take it: the rooms fail now (K16)
            raise RegistrationError(f"this rank's registration cannot go to {endpoint}: "
                                    f"{exc}") from exc
        if not sent:
            raise PeerUnreachable(f"cannot reach prefill rank {endpoint}")
        self.registered[endpoint] = instance
        self.last_sent[endpoint] = self.core.clock()

    def _sent_to(self, endpoint: str) -> None:
        """Note a message to prefill rank ``endpoint`` (it keeps the registration alive
        there, see :meth:`_ensure_registered`)."""
        if endpoint in self.registered:
            self.last_sent[endpoint] = self.core.clock()

    async def _abort_unknown(self, eff: AbortUnknown) -> None:
        """Tell the prefill ranks of a room this daemon does not know (K34)."""
        self.members.used(eff.bootstrap_addr, self.core.clock())
        try:
            targets, _ = await self._targets(eff.room, eff.bootstrap_addr, eff.dp_rank)
        except KvdError as exc:
            log.warning("room %d: abort could not reach the prefill ranks of %s: %s", eff.room,
                        eff.bootstrap_addr, exc,
                        extra=fields(room=eff.room, peer=eff.bootstrap_addr))
            return
        for t in targets:
            self._sent_to(t.endpoint)
            self.core.post(t.endpoint, control.RoomAbort(
                room=eff.room, inc=0, kind=eff.failure.kind.value, reason=eff.failure.reason,
                endpoint=self.core.control.endpoint, instance_id=self.core.instance_id),
                instance=t.instance)

    def _write_aux(self, eff: WriteAux) -> None:
        """Copy the room's aux payload into slot ``aux_index`` of each aux buffer, through
        the buffer's descriptor (:meth:`kvd.memory.host.HostBuffer.write`): an engine that
        shrank its pool under kvd costs an error line, never a SIGBUS (case S16). The
        outcome goes back to the machine (``aux_written``): a refused write fails the room
        (kind ``layout``), and the engine's memory is checked (a shrunk pool drops the
        registration, :meth:`~kvd.daemon.core.Core.check_memory`)."""
        failure = self._aux_failure(eff)
        self.run(self.rooms.aux_written(eff.room, eff.inc, eff.endpoint, failure,
                                        self.core.clock()))
        if failure is not None:
            self.core.check_memory()

    def _aux_failure(self, eff: WriteAux) -> RoomFailure | None:
        """Write each aux buffer's part; the first refusal as a failure (logged)."""
        mem = self.core.engine_memory
        if mem is None:
            return RoomFailure(FailureKind.LAYOUT, f"room {eff.room}: aux not written: the "
                               f"engine's registration is gone", self.role)
        for i, (buf, data) in enumerate(zip(mem.aux, eff.payload, strict=True)):
            try:
                buf.write(eff.aux_index * len(data), data)
            except RegistrationError as exc:
                log.error("room %d: aux slot %d of aux buffer %d not written: %s", eff.room,
                          eff.aux_index, i, exc, extra=fields(room=eff.room))
                return RoomFailure(FailureKind.LAYOUT, f"room {eff.room}: aux slot "
                                   f"{eff.aux_index} of aux buffer {i} not written: {exc}",
                                   self.role)
        return None

    # ---- heartbeats -------------------------------------------------------------------

    def start(self) -> None:
        self.core.supervise(self.heartbeat_round, "heartbeats",
                            self.core.settings.heartbeat_interval)
        if self.etcd is not None:
            self.core.spawn(self.etcd.run(), "etcd-watch")

    def on_discovery(self, ev: PeerEvent) -> None:
        """A watch event, translated for the membership machine (``rank_put`` /
        ``rank_deleted``), which decides: a rank that left etcd (lease expired,
        deregistered) or came back as another instance fails the rooms bound to the
        instance that is gone and drops what was kept for it (registration; the socket of
        an endpoint gone). This side performs the effects."""
        now, rank = self.core.clock(), f"rank dp {ev.rank.dp} tp {ev.rank.tp} pp {ev.rank.pp}"
        if isinstance(ev, PeerPut):
            self.apply(self.members.rank_put(ev.addr, ev.endpoint, ev.instance, now,
                                             ev.previous, ev.previous_endpoint, rank))
        else:
            self.apply(self.members.rank_deleted(ev.addr, ev.endpoint, ev.instance, now,
                                                 rank))

    async def heartbeat_round(self) -> None:
        """One round of the membership machine's probes (peers with a live room first,
        at most ``heartbeat_max_probes_per_s`` x ``heartbeat_interval``); idle peers that
        no longer earn their entry are forgotten (no probes, sockets or log lines for
        them any more, K31, K41)."""
        now = self.core.clock()
        live = {r.bootstrap_addr for r in self.rooms.rooms.values() if not r.done}
        probes = self.apply(self.members.heartbeat_round(now, live))
        if self.etcd is not None:  # liveness comes from leases: the name may not listen
            probes = []
        self.last_round_probes = len(probes)
        await asyncio.gather(*(self._guarded(self.probe, p.addr) for p in probes))

    async def _guarded(self, probe: Callable[[str], Awaitable[None]], addr: str) -> None:
        try:
            await probe(addr)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an HTTP client bug must not stop the other probes
            self.core.counters.loop_errors += 1
            log.exception("heartbeat of %s failed unexpectedly", addr, extra=fields(peer=addr))
            self._missed(addr, f"{type(exc).__name__}: {exc}")

    async def probe(self, addr: str) -> None:
        """One heartbeat of ``addr``'s ``/health`` (bounded by the heartbeat interval); an
        answer naming the peer's clock also measures it (:meth:`_health`)."""
        if addr not in self.members.peers:
            return
        data, error, offset = await self._health(addr)
        via = http_url(addr, "/health")
        if data is None:
            self._missed(addr, error)
            return
        p = self.members.peers.get(addr)
        if p is not None and p.down:
            log.info("prefill %s is back after %d missed heartbeats", addr, p.misses,
                     extra=fields(peer=addr))
        instance, epoch = data.get("instance_id"), data.get("bootstrap_epoch")
        self.apply(self.members.heartbeat_answered(
            addr, instance if isinstance(instance, str) else None,
            epoch if isinstance(epoch, int) else None, self.core.clock()))
        if offset is not None:
            self.apply(self.members.clock_measured(addr, offset, self.core.clock(), via))

    async def measure(self, addr: str) -> None:
        """The answer to :class:`~kvd.membership.effects.Measure`: read ``addr``'s clock
        once. Unanswered, nothing is fed back (no heartbeat miss: with etcd discovery the
        name may not listen); the claims wait for the next measurement."""
        _, error, offset = await self._health(addr)
        if offset is None:
            log.info("prefill %s: clock not measured (%s); a claimed skew fails nothing",
                     addr, error or "no clock_s in /health", extra=fields(peer=addr))
            return
        self.apply(self.members.clock_measured(addr, offset, self.core.clock(),
                                               http_url(addr, "/health")))

    async def _health(self, addr: str) -> tuple[dict[str, Any] | None, str, float | None]:
        """``GET /health`` of ``addr`` (bounded by the heartbeat interval): the answer
        (None when there is none: the error says why), and ``addr``'s clock minus this
        daemon's wall clock (s; its ``clock_s`` against the request's midpoint, so the
        error is at most half the round trip; None without ``clock_s``)."""
        s, wall = self.core.settings, self.core.auth.clock
        sent = wall()
        try:
            resp = await self.core.http("GET", http_url(addr, "/health"),
                                        limit_s=min(s.http_timeout, s.heartbeat_interval))
            data = resp.json() if resp.status_code == 200 else None
            error = "" if resp.status_code == 200 else f"HTTP {resp.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            data, error = None, f"{type(exc).__name__}"
        if not isinstance(data, dict):
            return None, error or "malformed /health answer", None
        clock = data.get("clock_s")
        if not isinstance(clock, int | float) or isinstance(clock, bool):
            return data, "", None
        return data, "", float(clock) - (sent + wall()) / 2

    def _missed(self, addr: str, error: str) -> None:
        if addr not in self.members.peers:
            return
        self.core.counters.heartbeat_misses += 1
        self.core.events.heartbeat_missed(addr, f"heartbeat unanswered: {error}")
        self.apply(self.members.heartbeat_missed(addr, error, self.core.clock()))

    # ---- membership effects -----------------------------------------------------------

    def apply(self, effects: list[MemberEffect]) -> list[Probe]:
        """Perform the membership machine's effects in order; returns the probes (the
        heartbeat round runs them)."""
        probes: list[Probe] = []
        for eff in effects:
            match eff:
                case Probe():
                    probes.append(eff)
                case Verify():  # which ranks, read now: a Close after it drops the cache
                    keys = [k for k, info in self.bootstrap.ranks.items()
                            if k[0] == eff.addr and endpoint_of(info) == eff.endpoint]
                    self.core.spawn(self._verify_rank(eff.addr, eff.endpoint, keys),
                                    f"verify-{eff.endpoint}")
                case Measure():
                    self.core.spawn(self.measure(eff.addr), f"measure-{eff.addr}")
                case Close():
                    self._close(eff.resource)
                case FailRooms():
                    failure = RoomFailure(eff.kind, eff.reason, self.role)
                    lost = self.rooms.lost_rooms(eff.addr, eff.keep, eff.endpoint)
                    log.warning("%s (%d rooms fail)", eff.reason, len(lost),
                                extra=fields(peer=eff.addr))
                    self.fail_rooms(lost, failure)
                case Forget():
                    log.debug("prefill %s forgotten", eff.addr, extra=fields(peer=eff.addr))
        return probes

    def fail_rooms(self, keys: list[tuple[int, int]], failure: RoomFailure) -> None:
        """Fail the room incarnations ``keys`` (chosen by the machine) :data:`FAIL_SLICE`
        a loop turn, the first slice now (K41); one that ended or was created again
        meanwhile is left alone (:meth:`ReceiverRooms.fail_rooms`)."""
        self.fail_slices += 1
        self.run(self.rooms.fail_rooms(keys[:FAIL_SLICE], failure, self.core.clock()))
        rest = keys[FAIL_SLICE:]
        if not rest:
            return
        try:
            asyncio.get_running_loop().call_soon(self.fail_rooms, rest, failure)
        except RuntimeError:  # no loop (a direct caller): all now
            self.fail_rooms_now(rest, failure)

    def fail_rooms_now(self, keys: list[tuple[int, int]], failure: RoomFailure) -> None:
        self.run(self.rooms.fail_rooms(keys, failure, self.core.clock()))

    def _close(self, r: Resource) -> None:
        """Drop what this side holds: a bootstrap address's cached lookups, the record of
        a registration with a rank (the next room registers again), a control socket."""
        match r.kind:
            case ResourceKind.LOOKUP:
                self.bootstrap.forget(r.key)
            case ResourceKind.REGISTRATION:
                self.registered.pop(r.key, None)
                self.refused_full.pop(r.key, None)
                self.last_sent.pop(r.key, None)
            case ResourceKind.SOCKET:
                self.core.control.drop(r.key)

    # ---- lifecycle --------------------------------------------------------------------

    def tick(self) -> None:
        self.run(self.rooms.tick(self.core.clock()))

    def engine_registered(self, args: RankArgs) -> None:
        """New local buffers: register them again with every prefill rank. Rooms a
        dropped registration left (ended, releasable) are forgotten first."""
        if self.rooms.released:
            self.rooms.forget_rooms()
        self.registered.clear()
        self.last_sent.clear()
        slots, window = state_region_counts(args.wire)
        self.rooms.engine_registered(args.num_pages, args.num_aux_slots,
                                     tuple(int(n) for n in args.aux_item_lens), slots, window)

    async def drain_done(self) -> None:
        """Nothing to deregister: a decode rank is not in any bootstrap table."""

    def engine_lost(self, failure: RoomFailure) -> None:
        self.run(self.rooms.engine_released(self.core.clock(), failure))

    async def engine_released(self, failure: RoomFailure | None = None) -> None:
        """The machine's rule (:meth:`ReceiverRooms.engine_released`, K44): abort the rooms
        (or fail them with ``failure``: a dropped registration, S16), return once nothing
        can still be written into the pool (every room releasable: quiesced, or past its
        write bound plus the release margin), forget them -- after a dropped registration
        only at the next one, so that the engine, still connected, reads why each room
        failed until then."""
        self.run(self.rooms.engine_released(self.core.clock(), failure))
        while not self.rooms.quiet(self.core.clock()):
            await self.core.wait_changed(self.timeouts.release)  # Wake, or the next sweep
        if failure is None:
            self.rooms.forget_rooms()

    # ---- status -----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        now, started = self.core.clock(), self.core.events.started
        by_state = {s.name: 0 for s in KVPoll}
        rooms = []
        for room, r in self.rooms.rooms.items():
            by_state[r.status.name] += 1
            peer = ",".join(t.endpoint for t in r.targets or ()) or r.bootstrap_addr
            rooms.append(Room(room=room, state=r.status.name,
                              age_s=round(now - started.get(room, r.created), 3),
                              state_age_s=round(now - r.since, 3), peer=peer,
                              reason=r.failure.reason if r.failure else "",
                              kind=r.failure.kind.value if r.failure else ""))
        return Snapshot(self.role, rooms, self._peers(), by_state, 0, self._tables(),
                        dict(self.rooms.dropped))

    def summary(self) -> tuple[dict[str, int], dict[str, int]]:
        """Rooms by state and table sizes without a row per room or peer (K41)."""
        by_state = {s.name: 0 for s in KVPoll}
        for r in self.rooms.rooms.values():
            by_state[r.status.name] += 1
        return by_state, self._tables()

    def _tables(self) -> dict[str, int]:
        return {**self.rooms.table_sizes(), "registered": len(self.registered),
                "health": len(self.members.peers), "rank_cache": len(self.bootstrap.ranks),
                "heartbeat_targets": self.last_round_probes,
                "peers_down": self.members.table_sizes()["peers_down"]}

    def _peers(self) -> list[Peer]:
        """One row per prefill rank endpoint; a bootstrap address with none gets its own."""
        rows: dict[str, Peer] = {}
        how = self.core.settings.discovery
        for (addr, tp, dp, pp), info in self.bootstrap.ranks.items():
            ep = endpoint_of(info)
            h = self.members.peers.get(addr)
            rows[ep] = Peer(endpoint=ep, kind="prefill", bootstrap=addr,
                            state="registered" if ep in self.registered else "resolved",
                            heartbeat=heartbeat_of(h, how), instance_id=info.instance_id or "",
                            detail=f"tp {tp} dp {dp} pp {pp}{health_detail(h, how)}",
                            **self._liveness(ep, addr, h))
        known = {p.bootstrap for p in rows.values()}
        for addr in (set(self.bootstrap.info) | set(self.members.peers)) - known:
            h = self.members.peers.get(addr)
            rows[addr] = Peer(endpoint=addr, kind="prefill", bootstrap=addr, state="bootstrap",
                              heartbeat=heartbeat_of(h, how),
                              detail=health_detail(h, how).lstrip("; "),
                              instance_id=(h.instance or "") if h else "",
                              **self._liveness("", addr, h))
        return sorted(rows.values(), key=lambda p: (p.bootstrap, p.endpoint))

    def _liveness(self, endpoint: str, addr: str, h: Member | None) -> dict[str, Any]:
        """A prefill peer's liveness fields: its last control message (from ``endpoint``),
        last answered heartbeat (of ``addr``) and newest error (a failed room, send or
        heartbeat, recorded under either name; it stays after the peer recovers)."""
        error, error_time = self.last_error(endpoint, addr)
        last_message = self.core.events.peer_record(endpoint).last_message if endpoint else None
        offset = self.core.control.clock_offset(endpoint) if endpoint else None
        return {"last_message": last_message, "clock_offset_s": offset,
                "last_heartbeat": self.wall(h.last_ok) if h else None,
                "last_error": error, "last_error_time": error_time, **self._measured(h)}

    def _measured(self, h: Member | None) -> dict[str, Any]:
        """The ``clock_measured_*`` fields: the membership machine's own newest reading
        of the peer's clock (none yet: no fields)."""
        c = h.clock if h else None
        if c is None:
            return {}
        return {"clock_measured_s": round(c.offset, 3), "clock_measured_at": self.wall(c.at),
                "clock_measured_from": c.via}


def heartbeat_of(h: Member | None, discovery: str) -> str:
    """A prefill peer's ``heartbeat`` field: the membership machine's reading
    (``unknown``, ``ok``, ``missed N``, ``down``); with ``discovery = "etcd"`` no heartbeat
    is ever sent (leases replace them), so a peer not seen down reads ``n/a (etcd)``
    rather than an ``unknown`` that never changes."""
    hb = "unknown" if h is None else h.heartbeat
    return "n/a (etcd)" if discovery == "etcd" and hb == "unknown" else hb


def health_detail(h: Member | None, discovery: str) -> str:
    """What the heartbeats say now, beyond the liveness fields: ``; never answered`` or
    ``; failing: <error>`` (empty while they are answered; with ``discovery = "etcd"``
    nothing is asked, so never ``never answered``)."""
    if h is None:
        return ""
    if h.misses and h.last_error:
        return f"; failing: {h.last_error}"
    return "" if h.last_ok or discovery == "etcd" else "; never answered"


def _kind_of(exc: KvdError) -> FailureKind:
    """The failure kind of an error raised while resolving a room's targets."""
    if isinstance(exc, ClockSkew):
        return FailureKind.PEER
    if isinstance(exc, PeerUnreachable):
        return FailureKind.UNREACHABLE
    if isinstance(exc, PeerRestarted):
        return FailureKind.PEER
    if isinstance(exc, PeerDown):
        return FailureKind.HEARTBEAT
    if isinstance(exc, RegistrationError):
        return FailureKind.REGISTRATION
    if isinstance(exc, RoomError):
        return FailureKind.ABORTED
    return FailureKind.BOOTSTRAP
