"""The decode side of a daemon: performs what :class:`kvd.rooms.receiver.ReceiverRooms`
decides — bootstrap lookups, registering this rank's KV args with prefill ranks,
control messages, aux copies — and heartbeats the prefill instances in use.

Prefill instances are named by their bootstrap address. Lookups are cached per
address; a heartbeat that sees a new instance id (a restart) or a new bootstrap
epoch drops the cache, so new rooms resolve and register again.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvd.addr import http_url, join_hostport, parse_hostport
from kvd.bootstrap.table import ParallelInfo, RankInfo
from kvd.control.routing import Target as RouteTarget
from kvd.control.routing import resolve_targets
from kvd.core import Core
from kvd.errors import (
    BootstrapError,
    ClockSkew,
    KvdError,
    PeerUnreachable,
    RegistrationError,
    RoomError,
)
from kvd.hostid import host_identity
from kvd.logs import fields
from kvd.protocol import control, rpc
from kvd.rooms.effects import AbortUnknown, Effect, Resolve, Send, WriteAux
from kvd.rooms.receiver import ReceiverRooms, Target
from kvd.rooms.state import UNKNOWN_ROOM, FailureKind, KVPoll, RoomFailure
from kvd.schemas import Peer, Room
from kvd.security import CLOCK_HEADER
from kvd.side import RoomView, Side, Snapshot, not_available, skew_reason
from kvd.transfer.kvargs import RankArgs

log = logging.getLogger("kvd.decode")

#: How long a prefill rank that refused this daemon's frames for clock skew fails new
#: rooms at once (s); after that a room tries again (and is refused again if still off).
SKEW_MEMORY_S = 10.0
#: Prefill ranks remembered as skewed (oldest forgotten first).
MAX_SKEWED = 1024


class BootstrapClient:
    """Cached, bounded lookups on prefill bootstrap servers (one loop, async httpx).

    503 (not every rank registered yet) and connection errors are retried with
    backoff for up to ``budget`` seconds; other 4xx answers fail at once.
    Concurrent lookups of the same key share one request.
    """

    def __init__(self, core: Core, budget: float) -> None:
        self.core = core
        self.budget = budget
        self.info: dict[str, ParallelInfo] = {}
        self.ranks: dict[tuple[str, int, int, int], RankInfo] = {}
        self._inflight: dict[tuple[object, ...], asyncio.Future[dict[str, object]]] = {}

    def forget(self, addr: str) -> set[str]:
        """Drop everything cached for bootstrap ``addr``; returns its rank endpoints."""
        self.info.pop(addr, None)
        endpoints = set()
        for key in [k for k in self.ranks if k[0] == addr]:
            endpoints.add(endpoint_of(self.ranks.pop(key)))
        return endpoints

    async def _get_shared(self, addr: str, params: dict[str, int]) -> dict[str, object]:
        key = (addr, *sorted(params.items()))
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._get(addr, params))
            self._inflight[key] = fut
            fut.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(fut)

    async def _get(self, addr: str, params: dict[str, int]) -> dict[str, object]:
        loop = asyncio.get_running_loop()
        url, deadline, delay = http_url(addr, "/route"), loop.time() + self.budget, 0.05
        last = ""
        while True:
            try:
                resp = await self.core.http("GET", url, params=params)
                if resp.status_code == 200:
                    result: dict[str, object] = resp.json()
                    return result
                last = f"{resp.status_code} {resp.text.strip()}"
                skew = _skew_of(resp)
                if skew is not None:
                    raise ClockSkew(skew_reason(f"bootstrap {addr}", -skew,
                                                self.core.settings.auth_max_skew))
                if resp.status_code != 503:
                    raise BootstrapError(f"bootstrap {addr} answered {last}")
            except httpx.HTTPError as exc:
                last = f"bootstrap unreachable ({type(exc).__name__})"
            except ValueError as exc:  # a 200 whose body is not JSON
                raise BootstrapError(f"bootstrap {addr} sent a malformed answer: {exc}") from exc
            if loop.time() + delay > deadline:
                raise BootstrapError(f"bootstrap {addr}: {last} after {self.budget:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def parallel_info(self, addr: str) -> ParallelInfo:
        """The prefill instance's sizes (cached per bootstrap address)."""
        if addr not in self.info:
            data = await self._get_shared(addr, {"engine_rank": -1, "target_dp_group": -1,
                                                 "target_pp_rank": -1})
            self.info[addr] = ParallelInfo.model_validate(data)
        return self.info[addr]

    async def rank(self, addr: str, t: RouteTarget) -> RankInfo:
        """Where prefill rank (tp, dp, pp) listens (cached)."""
        key = (addr, t.tp_rank, t.dp_group, t.pp_rank)
        if key not in self.ranks:
            data = await self._get_shared(addr, {"engine_rank": t.tp_rank, "target_dp_group":
                                                 t.dp_group, "target_pp_rank": t.pp_rank})
            self.ranks[key] = RankInfo.model_validate(data)
        return self.ranks[key]


def endpoint_of(rank: RankInfo) -> str:
    """The control endpoint of a prefill rank from its bootstrap entry."""
    return f"tcp://{join_hostport(rank.rank_ip.strip('[]'), rank.rank_port)}"


@dataclass
class PeerHealth:
    """Heartbeat state of one prefill bootstrap address (times: monotonic s)."""

    last_used: float
    misses: int = 0
    instance_id: str | None = None
    epoch: int | None = None
    last_ok: float = 0.0
    last_error: str = ""
    down: bool = False
    # the cached lookup rooms are resolved from now; its instance is the one a heartbeat
    # must see, or the rooms resolved from it are bound to a process that is gone
    resolved_from: ParallelInfo | None = None
    # control endpoints resolved from this address whose sockets a soft forget (down,
    # restart, new epoch) kept: closed when the address itself is forgotten (K31)
    endpoints: set[str] = field(default_factory=set)


class DecodeSide(Side):
    """Receivers of one decode rank."""

    role = "decode"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.rooms = ReceiverRooms(core.control.endpoint, core.instance_id, self.timeouts)
        self.bootstrap = BootstrapClient(core, core.settings.bootstrap_retry_budget)
        self.registered: dict[str, str] = {}  # prefill endpoint -> instance registered with
        self.skewed: dict[str, tuple[str, float]] = {}  # endpoint -> (skew reason, when)
        self._registering: dict[tuple[str, str], asyncio.Future[None]] = {}
        self.health: dict[str, PeerHealth] = {}

    # ---- engine calls -----------------------------------------------------------------

    def call(self, call: rpc.Call) -> Any:
        now = self.core.clock()
        match call:
            case rpc.ReceiverCreate():
                parse_hostport(call.bootstrap_addr)
                if self.core.local is None:
                    raise RegistrationError("no engine has registered KV buffers with this kvd")
                effects = self.rooms.create(call.room, call.bootstrap_addr, call.dp_rank, now)
                self._used(call.bootstrap_addr, now)
                self.core.events.room_started(self.role, call.room, call.bootstrap_addr)
            case rpc.ReceiverInit():
                effects = self.rooms.init(call.room, call.dst_pages, call.aux_index, now,
                                          call.first_page)
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
            self.run(self.rooms.on_status(msg, self.core.clock()))
        elif isinstance(msg, control.Refused):
            self.peer_refused(msg.endpoint, msg.instance_id, msg.why, -msg.offset_s,
                              msg.window_s)
        else:
            self.core.counters.protocol_errors += 1
            log.warning("decode kvd ignores %s from %s", type(msg).__name__,
                        getattr(msg, "endpoint", "?"))

    def peer_refused(self, endpoint: str, instance: str, why: str, offset_s: float,
                     window_s: float) -> None:
        """MEMBERSHIP HOOK (issue 19: a refusal is one more liveness source; the membership
        machine takes this over). ``instance``: prefill rank ``endpoint`` restarted -- rooms
        bound to its old instance fail (kind ``peer``) and every lookup that named it is
        dropped, so the next room resolves and registers afresh. ``clock_skew``: every
        room bound to it fails naming the offset, and rooms resolved to it fail at once for
        :data:`SKEW_MEMORY_S` (its refusals are rate-limited: later ones may not come)."""
        now = self.core.clock()
        self.registered.pop(endpoint, None)
        if why == "clock_skew":
            reason = skew_reason(f"prefill rank {endpoint}", offset_s,
                                 window_s or self.core.settings.auth_max_skew)
            self.skewed[endpoint] = (reason, now)
            while len(self.skewed) > MAX_SKEWED:
                self.skewed.pop(next(iter(self.skewed)))
            gone: str | None = None
        else:
            reason = (f"prefill rank {endpoint} restarted: it refused a frame sealed for its "
                      f"previous instance (it is {instance} now)")
            stale = {k[0]: info.instance_id for k, info in self.bootstrap.ranks.items()
                     if endpoint_of(info) == endpoint and info.instance_id != instance}
            for addr, old in stale.items():
                h = self.health.get(addr)
                if h is not None and old and h.instance_id == old:
                    # that rank's daemon serves the address's bootstrap too: its restart is
                    # known now, and the next heartbeat must not fail the rooms resolving
                    # against its new instance as if it were news
                    h.instance_id = instance
                self._forget(addr, drop_sockets=False)
            gone = instance
        failure = RoomFailure(FailureKind.PEER, reason, self.role)
        self.run(self.rooms.peer_refused(endpoint, gone, failure, now))

    def _skew_refused(self, targets: list[Target]) -> str | None:
        """The skew reason of a target that refused this daemon's frames lately, if any."""
        now = self.core.clock()
        for t in targets:
            known = self.skewed.get(t.endpoint)
            if known is not None and now - known[1] < SKEW_MEMORY_S:
                return known[0]
        return None

    # ---- effects ----------------------------------------------------------------------

    def perform(self, eff: Effect) -> None:
        match eff:
            case Send():
                self.core.post(eff.to, eff.msg, self._on_send_fail(eff), eff.to_instance)
            case Resolve():
                self.core.spawn(self._resolve(eff), f"resolve-{eff.room}")
            case AbortUnknown():
                self.core.spawn(self._abort_unknown(eff), f"abort-{eff.room}")
            case WriteAux():
                self._write_aux(eff)
            case _:
                raise TypeError(f"decode cannot perform {eff!r}")

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
        try:
            h = self.health.get(eff.bootstrap_addr)
            if h is not None and h.down:
                failure = RoomFailure(FailureKind.HEARTBEAT, f"room {eff.room}: prefill "
                                      f"{eff.bootstrap_addr} is down ({h.misses} heartbeats "
                                      f"missed)", self.role)
                return
            targets = await self._targets(eff.room, eff.bootstrap_addr, eff.dp_rank)
            skew = self._skew_refused(targets)
            failure = None if skew is None else RoomFailure(
                FailureKind.PEER, f"room {eff.room}: {skew}", self.role)
        except KvdError as exc:
            failure = RoomFailure(_kind_of(exc), f"room {eff.room}: {exc}", self.role)
        finally:
            now = self.core.clock()
            self.run(self.rooms.resolved(eff.room, eff.inc, targets, now) if failure is None
                     else self.rooms.resolve_failed(eff.room, eff.inc, failure, now))

    async def _targets(self, room: int, addr: str, dp_rank: int | None) -> list[Target]:
        local, ranks = self.core.local, self.core.ranks
        if local is None or ranks is None:
            raise RegistrationError("the engine released its KV buffers")
        info = await self.bootstrap.parallel_info(addr)
        self._resolved_from(addr, info)
        routes = resolve_targets(room, ranks.attn_tp_rank, ranks.attn_tp_size,
                                 info.prefill_attn_tp_size,
                                 info.prefill_dp_size, info.prefill_pp_size, local.wire.is_mla,
                                 dp_rank)
        out = []
        for t in routes:
            rank = await self.bootstrap.rank(addr, t)
            endpoint, instance = endpoint_of(rank), rank.instance_id or ""
            self.core.control.learn(endpoint, instance)  # fills the directory's gaps (S09)
            await self._ensure_registered(endpoint, instance)
            out.append(Target(endpoint, instance, t.required_dst_info_num, t.is_dummy))
        return out

    async def _ensure_registered(self, endpoint: str, instance: str) -> None:
        """Register this rank's KV args with prefill rank ``endpoint`` (its instance
        ``instance``) once; concurrent rooms share the one message."""
        if self.registered.get(endpoint) == instance:
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
        mem = self.core.engine_memory
        if self.core.settings.transfer_backend != "mooncake" and mem is not None:
            # a same-host prefill may copy directly
            pool = mem.export(host_identity())
        msg = control.RegisterRank(self.core.instance_id, self.core.control.endpoint,
                                   ranks.attn_tp_rank, ranks.attn_tp_size, local.wire, pool)
        if not await self.core.send(endpoint, msg, instance):  # sealed for that instance
            raise PeerUnreachable(f"cannot reach prefill rank {endpoint}")
        self.registered[endpoint] = instance

    async def _abort_unknown(self, eff: AbortUnknown) -> None:
        """Tell the prefill ranks of a room this daemon does not know (K34)."""
        try:
            targets = await self._targets(eff.room, eff.bootstrap_addr, eff.dp_rank)
        except KvdError as exc:
            log.warning("room %d: abort could not reach the prefill ranks of %s: %s", eff.room,
                        eff.bootstrap_addr, exc,
                        extra=fields(room=eff.room, peer=eff.bootstrap_addr))
            return
        for t in targets:
            self.core.post(t.endpoint, control.RoomAbort(
                room=eff.room, inc=0, kind=eff.failure.kind.value, reason=eff.failure.reason,
                endpoint=self.core.control.endpoint, instance_id=self.core.instance_id),
                instance=t.instance)

    def _write_aux(self, eff: WriteAux) -> None:
        local = self.core.local
        if local is None:
            return
        for ptr, data in zip(local.aux_ptrs, eff.payload, strict=True):
            ctypes.memmove(int(ptr) + eff.aux_index * len(data), data, len(data))

    # ---- heartbeats -------------------------------------------------------------------

    def start(self) -> None:
        self.core.supervise(self.heartbeat_round, "heartbeats",
                            self.core.settings.heartbeat_interval)

    def _used(self, addr: str, now: float) -> None:
        h = self.health.get(addr)
        if h is None:
            self.health[addr] = PeerHealth(last_used=now)
        else:
            h.last_used = now

    def _resolved_from(self, addr: str, info: ParallelInfo) -> None:
        """Rooms of ``addr`` are being resolved from lookup ``info``: a freshly fetched one
        names the instance the next heartbeat must still see. Lookups are only dropped
        after the rooms resolved from them failed (restart, heartbeats missed) or when none
        is left (peer_ttl), so a fresh lookup's instance is the baseline; without it a
        restart before the first heartbeat went unseen and rooms resolved from the stale
        cache waited for their timeout."""
        h = self.health.get(addr)
        if h is None:
            h = self.health[addr] = PeerHealth(last_used=self.core.clock())
        if info is not h.resolved_from:
            h.resolved_from = info
            if info.instance_id is not None:
                h.instance_id = info.instance_id

    async def heartbeat_round(self) -> None:
        """Probe every prefill bootstrap address in use; forget those unused for
        ``peer_ttl`` (no probes, no sockets, no log lines for them any more, K31)."""
        now = self.core.clock()
        live = {r.bootstrap_addr for r in self.rooms.rooms.values() if not r.done}
        for addr in live:
            self._used(addr, now)
        for addr, h in list(self.health.items()):
            if addr not in live and now - h.last_used > self.core.settings.peer_ttl:
                self._forget(addr)
                del self.health[addr]
        await asyncio.gather(*(self._guarded(self.probe, addr) for addr in list(self.health)))

    async def _guarded(self, probe: Callable[[str], Awaitable[None]], addr: str) -> None:
        try:
            await probe(addr)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an HTTP client bug must not stop the other probes
            self.core.counters.loop_errors += 1
            log.exception("heartbeat of %s failed unexpectedly", addr, extra=fields(peer=addr))
            h = self.health.get(addr)
            if h is not None:
                self._missed(addr, h, f"{type(exc).__name__}: {exc}")

    async def probe(self, addr: str) -> None:
        """One heartbeat of ``addr``'s ``/health`` (bounded by the heartbeat interval)."""
        s = self.core.settings
        h = self.health.get(addr)
        if h is None:
            return
        try:
            resp = await self.core.http("GET", http_url(addr, "/health"),
                                        limit_s=min(s.http_timeout, s.heartbeat_interval))
            data = resp.json() if resp.status_code == 200 else None
            error = "" if resp.status_code == 200 else f"HTTP {resp.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            data, error = None, f"{type(exc).__name__}"
        if not isinstance(data, dict):
            self._missed(addr, h, error or "malformed /health answer")
            return
        self._answered(addr, h, data)

    def _answered(self, addr: str, h: PeerHealth, data: dict[str, Any]) -> None:
        if h.down:
            log.info("prefill %s is back after %d missed heartbeats", addr, h.misses,
                     extra=fields(peer=addr))
        now = self.core.clock()
        h.misses, h.down, h.last_ok, h.last_error = 0, False, now, ""
        instance, epoch = data.get("instance_id"), data.get("bootstrap_epoch")
        if h.instance_id is not None and instance != h.instance_id:
            # Every room in flight was resolved from the cache of the old instance: it is
            # bound to a process that is gone. New rooms resolve and register again.
            failure = RoomFailure(FailureKind.PEER, f"prefill {addr} restarted (instance "
                                  f"{h.instance_id} -> {instance})", self.role)
            self.run(self.rooms.peer_lost(addr, failure, now))
            self._forget(addr, drop_sockets=False)
        elif h.epoch is not None and epoch != h.epoch:
            self._forget(addr, drop_sockets=False)  # a rank re-registered: refresh endpoints
        h.instance_id, h.epoch = instance, epoch

    def _missed(self, addr: str, h: PeerHealth, error: str) -> None:
        h.misses += 1
        h.last_error = error
        self.core.counters.heartbeat_misses += 1
        self.core.events.heartbeat_missed(addr, f"heartbeat unanswered: {error}")
        if h.misses >= self.core.settings.heartbeat_max_failures and not h.down:
            h.down = True
            failure = RoomFailure(FailureKind.HEARTBEAT, f"prefill {addr} unreachable: "
                                  f"{h.misses} heartbeats missed ({error})", self.role)
            log.warning("%s", failure.reason, extra=fields(peer=addr))
            self.run(self.rooms.peer_lost(addr, failure, self.core.clock()))
            self._forget(addr, drop_sockets=False)

    def _forget(self, addr: str, drop_sockets: bool = True) -> None:
        """Drop the lookups and registrations of bootstrap ``addr``; with ``drop_sockets``
        also the control sockets to its ranks, including those an earlier forget without
        it kept (a dead prefill's sockets must not outlive its address, K31)."""
        endpoints = self.bootstrap.forget(addr)
        h = self.health.get(addr)
        if h is not None:
            endpoints |= h.endpoints
            h.endpoints = set() if drop_sockets else endpoints
        for ep in endpoints:
            self.registered.pop(ep, None)
            if drop_sockets:
                self.core.control.drop(ep)

    # ---- lifecycle --------------------------------------------------------------------

    def tick(self) -> None:
        self.run(self.rooms.tick(self.core.clock()))

    def engine_registered(self, args: RankArgs) -> None:
        """New local buffers: register them again with every prefill rank."""
        self.registered.clear()
        self.rooms.num_pages, self.rooms.num_aux_slots = args.num_pages, args.num_aux_slots
        self.rooms.aux_sizes = tuple(int(n) for n in args.aux_item_lens)

    async def drain_done(self) -> None:
        """Nothing to deregister: a decode rank is not in any bootstrap table."""

    async def engine_released(self) -> None:
        for room in self.unfinished():
            self.abort(room, "engine disconnected")
        self.rooms.rooms.clear()  # its memory is unregistered: nothing can land in it
        self.rooms.num_pages = self.rooms.num_aux_slots = 0

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
        tables = {**self.rooms.table_sizes(), "registered": len(self.registered),
                  "health": len(self.health), "rank_cache": len(self.bootstrap.ranks)}
        return Snapshot(self.role, rooms, self._peers(), by_state, 0, tables,
                        dict(self.rooms.dropped))

    def _peers(self) -> list[Peer]:
        """One row per prefill rank endpoint; a bootstrap address with none gets its own."""
        rows: dict[str, Peer] = {}
        for (addr, tp, dp, pp), info in self.bootstrap.ranks.items():
            ep = endpoint_of(info)
            h = self.health.get(addr)
            rows[ep] = Peer(endpoint=ep, kind="prefill", bootstrap=addr,
                            state="registered" if ep in self.registered else "resolved",
                            heartbeat=_heartbeat(h), instance_id=info.instance_id or "",
                            detail=f"tp {tp} dp {dp} pp {pp}{_health_detail(h)}",
                            **self._liveness(ep, addr, h))
        known = {p.bootstrap for p in rows.values()}
        for addr in (set(self.bootstrap.info) | set(self.health)) - known:
            h = self.health.get(addr)
            rows[addr] = Peer(endpoint=addr, kind="prefill", bootstrap=addr, state="bootstrap",
                              heartbeat=_heartbeat(h), detail=_health_detail(h).lstrip("; "),
                              instance_id=(h.instance_id or "") if h else "",
                              **self._liveness("", addr, h))
        return sorted(rows.values(), key=lambda p: (p.bootstrap, p.endpoint))

    def _liveness(self, endpoint: str, addr: str, h: PeerHealth | None) -> dict[str, Any]:
        """A prefill peer's liveness fields: its last control message (from ``endpoint``),
        last answered heartbeat (of ``addr``) and newest error (a failed room, send or
        heartbeat, recorded under either name; it stays after the peer recovers)."""
        error, error_time = self.last_error(endpoint, addr)
        last_message = self.core.events.peer_record(endpoint).last_message if endpoint else None
        offset = self.core.control.clock_offset(endpoint) if endpoint else None
        return {"last_message": last_message, "clock_offset_s": offset,
                "last_heartbeat": self.wall(h.last_ok) if h else None,
                "last_error": error, "last_error_time": error_time}


def _heartbeat(h: PeerHealth | None) -> str:
    if h is None or (h.misses == 0 and not h.last_ok):
        return "unknown"
    if h.down:
        return "down"
    return f"missed {h.misses}" if h.misses else "ok"


def _health_detail(h: PeerHealth | None) -> str:
    """What the heartbeats say now, beyond the liveness fields: ``; never answered`` or
    ``; failing: <error>`` (empty while they are answered)."""
    if h is None:
        return ""
    if h.misses and h.last_error:
        return f"; failing: {h.last_error}"
    return "" if h.last_ok else "; never answered"


def _skew_of(resp: httpx.Response) -> float | None:
    """A 401's claim that our request was signed this far (s) ahead of the server's clock."""
    value = resp.headers.get(CLOCK_HEADER) if resp.status_code == 401 else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _kind_of(exc: KvdError) -> FailureKind:
    """The failure kind of an error raised while resolving a room's targets."""
    if isinstance(exc, ClockSkew):
        return FailureKind.PEER
    if isinstance(exc, PeerUnreachable):
        return FailureKind.UNREACHABLE
    if isinstance(exc, RegistrationError):
        return FailureKind.REGISTRATION
    if isinstance(exc, RoomError):
        return FailureKind.ABORTED
    return FailureKind.BOOTSTRAP
