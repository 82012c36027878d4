"""Decode side of a daemon: receivers, bootstrap lookups, prefill registration.

Room R on a decode rank: ``Bootstrapping`` while kvd resolves the prefill
ranks it needs (parallel info and rank endpoints from the bootstrap server,
cached per address) and registers its KV args with each of them once;
then ``WaitingForInput`` (as in SGLang's receiver) while the engine gives its
destination pages (``receiver.init``), kvd sends them to every target and the
prefill side writes; ``Success`` when every target reported Success (their
last chunk and the aux data have landed by then).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from dataclasses import dataclass, field

import httpx

from kvd.addr import http_url, join_hostport, parse_hostport
from kvd.bootstrap.table import ParallelInfo, RankInfo
from kvd.control.routing import Target, resolve_targets
from kvd.core import Core
from kvd.errors import BootstrapError, KvdError, LayoutError, RegistrationError, RoomError
from kvd.protocol import control
from kvd.protocol.codec import unpack_indices
from kvd.rooms import KVPoll, RoomState
from kvd.transfer.plan import check_page_range

log = logging.getLogger("kvd.decode")


@dataclass
class ReceiverRoom:
    """Decode-side state of one room."""

    state: RoomState
    bootstrap_addr: str
    dp_rank: int | None
    dst_pages: bytes | None = None
    aux_index: int = 0
    targets: list[tuple[Target, str]] | None = None
    successes: set[str] = field(default_factory=set)
    quiesced: set[str] = field(default_factory=set)
    retried: set[str] = field(default_factory=set)
    pages_sent: bool = False
    created: float = field(default_factory=time.monotonic)
    release_seen: bool = False

    def releasable(self, now: float, release_timeout: float) -> bool:
        """May the engine reuse this room's pages? Only once it ended and no prefill rank
        can still write into them: every target confirmed (``quiesced``), or the pages
        never left this rank, or ``release_timeout`` s passed since it failed."""
        if self.state.status == KVPoll.Success:
            return True
        if self.state.status != KVPoll.Failed:
            return False
        if not self.pages_sent or self.targets is None:
            return True
        if {ep for _, ep in self.targets} <= self.quiesced:
            return True
        return now - self.state.since > release_timeout


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

    def forget(self, addr: str) -> None:
        """Drop everything cached for bootstrap ``addr`` (peer died or restarted)."""
        self.info.pop(addr, None)
        for key in [k for k in self.ranks if k[0] == addr]:
            del self.ranks[key]

    async def _get_shared(self, addr: str, params: dict[str, int]) -> dict[str, object]:
        key = (addr, *sorted(params.items()))
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._get(addr, params))
            self._inflight[key] = fut
            fut.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(fut)

    async def _get(self, addr: str, params: dict[str, int]) -> dict[str, object]:
        url, deadline, delay = http_url(addr, "/route"), time.monotonic() + self.budget, 0.05
        last = ""
        while True:
            try:
                resp = await self.core.http("GET", url, params=params)
                if resp.status_code == 200:
                    result: dict[str, object] = resp.json()
                    return result
                last = f"{resp.status_code} {resp.text.strip()}"
                if resp.status_code != 503:
                    raise BootstrapError(f"bootstrap {addr} answered {last}")
            except httpx.HTTPError as exc:
                last = f"bootstrap unreachable ({type(exc).__name__})"
            except ValueError as exc:  # a 200 whose body is not JSON
                raise BootstrapError(f"bootstrap {addr} sent a malformed answer: {exc}") from exc
            if time.monotonic() + delay > deadline:
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

    async def rank(self, addr: str, t: Target) -> RankInfo:
        """Where prefill rank (tp, dp, pp) listens (cached)."""
        key = (addr, t.tp_rank, t.dp_group, t.pp_rank)
        if key not in self.ranks:
            data = await self._get_shared(addr, {"engine_rank": t.tp_rank, "target_dp_group":
                                                 t.dp_group, "target_pp_rank": t.pp_rank})
            self.ranks[key] = RankInfo.model_validate(data)
        return self.ranks[key]


HEALTH_MEMORY_S = 600.0  # how long an unused prefill address's heartbeat state is kept


@dataclass
class PeerHealth:
    """Heartbeat state of one prefill bootstrap address."""

    misses: int = 0
    last_used: float = 0.0
    instance_id: str | None = None
    epoch: int | None = None
    last_ok: float = 0.0
    down: bool = False


class DecodeSide:
    """Receivers of one decode rank. Every method runs on the daemon's loop."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.rooms: dict[int, ReceiverRoom] = {}
        self.bootstrap = BootstrapClient(core, core.settings.bootstrap_retry_budget)
        self.registered: set[str] = set()
        self.health: dict[str, PeerHealth] = {}

    # ---- heartbeats ---------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        """Probe every prefill bootstrap address in use, every ``heartbeat_interval`` s."""
        while True:
            await asyncio.sleep(self.core.settings.heartbeat_interval)
            now = time.monotonic()
            addrs = {r.bootstrap_addr for r in self.rooms.values() if not r.state.done}
            addrs |= set(self.bootstrap.info) | {a for a, h in self.health.items() if h.down}
            for addr in addrs:
                self.health.setdefault(addr, PeerHealth()).last_used = now
            await asyncio.gather(*(self.probe(a) for a in addrs))
            # Forget an address only after it has been unused for a while: its instance id
            # is how a restart between two heartbeats is recognised.
            for addr, h in list(self.health.items()):
                if now - h.last_used > HEALTH_MEMORY_S:
                    del self.health[addr]

    async def probe(self, addr: str) -> None:
        """One heartbeat of ``addr``'s ``/health`` (bounded by the heartbeat interval)."""
        s = self.core.settings
        h = self.health.setdefault(addr, PeerHealth())
        try:
            resp = await self.core.http("GET", http_url(addr, "/health"),
                                        limit_s=min(s.http_timeout, s.heartbeat_interval))
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        if not isinstance(data, dict):
            self._missed(addr, h)
            return
        if h.down:
            log.info("prefill %s is back after %d missed heartbeats", addr, h.misses)
        prev_ok = h.last_ok
        h.misses, h.down, h.last_ok = 0, False, time.monotonic()
        instance, epoch = data.get("instance_id"), data.get("bootstrap_epoch")
        if h.instance_id is not None and instance != h.instance_id:
            # Rooms created while the old instance was last seen alive were bound to it;
            # rooms created since may already be bound to the new one: leave those.
            self.peer_lost(addr, f"prefill {addr} restarted (instance {h.instance_id} -> "
                                 f"{instance})", created_before=prev_ok)
        elif h.epoch is not None and epoch != h.epoch:
            self._forget(addr)  # a rank re-registered: refresh endpoints for new rooms
        h.instance_id, h.epoch = instance, epoch

    def _missed(self, addr: str, h: PeerHealth) -> None:
        h.misses += 1
        self.core.counters.heartbeat_misses += 1
        self.core.events.heartbeat_missed(addr)
        if h.misses >= self.core.settings.heartbeat_max_failures and not h.down:
            h.down = True
            self.peer_lost(addr, f"prefill {addr} unreachable: {h.misses} heartbeats missed")

    def _forget(self, addr: str, drop_sockets: bool = True) -> set[str]:
        endpoints = {f"tcp://{join_hostport(info.rank_ip.strip('[]'), info.rank_port)}"
                     for key, info in self.bootstrap.ranks.items() if key[0] == addr}
        self.bootstrap.forget(addr)
        for ep in endpoints:
            self.registered.discard(ep)
            if drop_sockets:
                self.core.control.drop(ep)
        return endpoints

    def peer_lost(self, addr: str, reason: str, created_before: float | None = None) -> None:
        """Fail every unfinished room fed by ``addr``; drop its cached endpoints and sockets.

        Each failed room that had sent its pages is also aborted on the prefill side
        (queued behind its RoomPages, so a frozen prefill that resumes drops them) before
        the sockets are closed. With ``created_before`` (monotonic s) only rooms created by
        then are failed (a restart: newer rooms may be bound to the new instance).
        """
        log.warning("%s", reason)
        aborts = []
        for room, r in list(self.rooms.items()):
            if r.bootstrap_addr != addr or r.state.done:
                continue
            if created_before is None or r.created <= created_before:
                self._fail(room, r, f"room {room}: {reason}")
                if r.pages_sent and r.targets:
                    aborts += [(ep, room) for _, ep in r.targets]
        endpoints = self._forget(addr, drop_sockets=False)
        self.core.spawn(self._abandon(endpoints, aborts, reason), f"abandon-{addr}")

    async def _abandon(self, endpoints: set[str], aborts: list[tuple[str, int]],
                       reason: str) -> None:
        for endpoint, room in aborts:
            msg = control.RoomAbort(room, f"room {room}: {reason}", self.core.control.endpoint,
                                    self.core.instance_id)
            if not await self.core.send(endpoint, msg):
                break  # the peer does not take messages: the rest would time out too
        for ep in endpoints:
            if ep not in self.registered:  # not re-registered meanwhile
                self.core.control.drop(ep)

    # ---- engine calls -------------------------------------------------------------------

    def create(self, room: int, bootstrap_addr: str, dp_rank: int | None) -> None:
        """``Receiver(room, bootstrap_addr)``; raises RoomError if the room is active."""
        old = self.rooms.get(room)
        if old is not None and not old.state.done:
            raise RoomError(f"room {room} already active")
        parse_hostport(bootstrap_addr)
        if self.core.local is None:
            raise RegistrationError("no engine has registered KV buffers with this kvd")
        r = ReceiverRoom(RoomState(room), bootstrap_addr, dp_rank)
        self.rooms[room] = r
        self.core.events.room_started("decode", room, bootstrap_addr)
        self.core.spawn(self._bootstrap(room, r), f"bootstrap-{room}")

    def init(self, room: int, dst_pages: bytes, aux_index: int) -> None:
        """``receiver.init``: destination pages and aux slot; sent once targets are known."""
        r = self._room(room)
        local = self.core.local
        assert local is not None
        pages = unpack_indices(dst_pages)
        try:
            check_page_range(pages, local.num_pages, f"room {room} destination")
            if local.num_aux_slots and not 0 <= aux_index < local.num_aux_slots:
                raise LayoutError(f"aux_index {aux_index} outside [0, {local.num_aux_slots})")
        except LayoutError as exc:
            raise RoomError(f"room {room}: {exc}") from exc
        if r.dst_pages is not None:
            raise RoomError(f"room {room}: init called twice")
        r.dst_pages, r.aux_index = dst_pages, aux_index
        if r.targets is not None and not r.state.done:
            self.core.spawn(self._send_pages(room, r), f"pages-{room}")

    def abort(self, room: int, reason: str) -> None:
        """Fail the room and tell its prefill ranks."""
        r = self.rooms.get(room)
        if r is None or r.state.done:
            return
        self._fail(room, r, f"room {room} aborted on decode: {reason}")
        msg = control.RoomAbort(room, f"room {room} aborted on decode: {reason}",
                                self.core.control.endpoint, self.core.instance_id)
        for _, endpoint in r.targets or []:
            self.core.spawn(self.core.send(endpoint, msg), f"abort-{room}")

    def releasable(self, room: int) -> bool:
        """True if the room's pages may be reused (see :meth:`ReceiverRoom.releasable`)."""
        r = self.rooms.get(room)
        return r is None or r.releasable(time.monotonic(), self.core.settings.release_timeout)

    def clear(self, room: int) -> None:
        """Forget a room. An unfinished one is aborted first; a room whose pages a prefill
        rank may still write is NOT forgotten: RoomError says to retry (case K06)."""
        if room not in self.rooms:
            return
        self.abort(room, "cleared before it finished")
        if not self.releasable(room):
            raise RoomError(f"room {room}: pages not releasable yet (a prefill write may be "
                            f"in flight); wait for the room, then clear")
        del self.rooms[room]

    # ---- control messages ---------------------------------------------------------------

    def on_room_status(self, msg: control.RoomStatus) -> None:
        """A prefill rank's final word on a room; late or unknown reports are ignored
        (they never re-create a room), except that they may confirm quiescence."""
        r = self.rooms.get(msg.room)
        if r is None:
            return
        if r.targets is None or msg.endpoint not in {ep for _, ep in r.targets}:
            log.warning("room %d: status from unexpected peer %s ignored", msg.room, msg.endpoint)
            return
        if msg.quiesced or msg.status == KVPoll.Success:
            r.quiesced.add(msg.endpoint)
            if r.state.done:
                self.core.notify()  # a waiter may be waiting for releasable pages
        if r.state.done:
            return
        if msg.status == KVPoll.Failed and msg.unregistered and msg.endpoint not in r.retried:
            # The prefill rank lost our registration (it restarted, or the registration went
            # into a connection that was dying): register again and resend once.
            r.retried.add(msg.endpoint)
            self.registered.discard(msg.endpoint)
            log.info("room %d: prefill %s does not know this rank: registering again",
                     msg.room, msg.endpoint)
            self.core.spawn(self._resend(msg.room, r, msg.endpoint), f"resend-{msg.room}")
        elif msg.status == KVPoll.Failed:
            self._fail(msg.room, r, msg.reason or f"room {msg.room}: failed on {msg.endpoint}")
        elif msg.status == KVPoll.Success:
            if msg.aux and not self._write_aux(msg.room, r, msg.aux):
                return
            r.successes.add(msg.endpoint)
            if len(r.successes) == len(r.targets) and r.state.advance(KVPoll.Success):
                self.core.counters.rooms_succeeded += 1
                self.core.events.room_done("decode", msg.room, "success", peer=msg.endpoint)
                self.core.notify()

    async def _resend(self, room: int, r: ReceiverRoom, endpoint: str) -> None:
        try:
            await self._ensure_registered(endpoint)
        except KvdError as exc:
            self._fail(room, r, f"room {room}: {exc}")
            return
        for t, ep in r.targets or []:
            if ep == endpoint and not r.state.done and r.dst_pages is not None:
                msg = control.RoomPages(room, self.core.control.endpoint, self.core.instance_id,
                                        r.dst_pages, r.aux_index, t.required_dst_info_num,
                                        t.is_dummy)
                if not await self.core.send(endpoint, msg):
                    self._fail(room, r, f"room {room}: cannot reach prefill rank {endpoint}")

    def _write_aux(self, room: int, r: ReceiverRoom, aux: list[bytes]) -> bool:
        """Write aux received over the control plane into the room's slot; a payload that
        does not match the registered aux buffers fails only this room."""
        local = self.core.local
        if local is None:
            return False
        sizes = [int(n) for n in local.aux_item_lens]
        if [len(a) for a in aux] != sizes or not 0 <= r.aux_index < local.num_aux_slots:
            self._fail(room, r, f"room {room}: aux payload of {[len(a) for a in aux]} bytes "
                                f"does not match the aux slots ({sizes} bytes)")
            return False
        for ptr, n, data in zip(local.aux_ptrs, sizes, aux, strict=True):
            ctypes.memmove(int(ptr) + r.aux_index * n, data, n)
        return True

    def on_room_abort(self, msg: control.RoomAbort) -> None:
        """The prefill side aborted the room."""
        r = self.rooms.get(msg.room)
        if r is not None:
            self._fail(msg.room, r, msg.reason)

    # ---- internals ----------------------------------------------------------------------

    def _room(self, room: int) -> ReceiverRoom:
        r = self.rooms.get(room)
        if r is None:
            raise RoomError(f"unknown room {room}")
        return r

    def _fail(self, room: int, r: ReceiverRoom, reason: str) -> None:
        if r.state.fail(reason):
            self.core.counters.rooms_failed += 1
            self.core.events.room_done("decode", room, "failed", reason, peer=r.bootstrap_addr)
            self.core.notify()
            log.warning("%s", reason)

    async def _bootstrap(self, room: int, r: ReceiverRoom) -> None:
        health = self.health.get(r.bootstrap_addr)
        if health is not None and health.down:
            self._fail(room, r, f"room {room}: prefill {r.bootstrap_addr} is down "
                                f"({health.misses} heartbeats missed)")
            return
        try:
            targets = await self._resolve(room, r)
        except KvdError as exc:
            self._fail(room, r, f"room {room}: {exc}")
            return
        if r.state.done:
            return
        r.targets = targets
        r.state.advance(KVPoll.WaitingForInput)
        if r.dst_pages is not None:
            await self._send_pages(room, r)

    async def _resolve(self, room: int, r: ReceiverRoom) -> list[tuple[Target, str]]:
        s, addr = self.core.settings, r.bootstrap_addr
        info = await self.bootstrap.parallel_info(addr)
        local = self.core.local
        assert local is not None
        targets = resolve_targets(room, s.attn_tp_rank, s.attn_tp_size, info.prefill_attn_tp_size,
                                  info.prefill_dp_size, info.prefill_pp_size, local.wire.is_mla,
                                  r.dp_rank)
        out = []
        for t in targets:
            rank = await self.bootstrap.rank(addr, t)
            endpoint = f"tcp://{join_hostport(rank.rank_ip.strip('[]'), rank.rank_port)}"
            self.core.control.learn(endpoint, rank.instance_id)  # frames are sealed for it
            await self._ensure_registered(endpoint)
            out.append((t, endpoint))
        return out

    async def _ensure_registered(self, endpoint: str) -> None:
        if endpoint in self.registered:
            return
        local, s = self.core.local, self.core.settings
        assert local is not None
        self.registered.add(endpoint)  # before the await: concurrent rooms must not re-send
        msg = control.RegisterRank(self.core.instance_id, self.core.control.endpoint,
                                   s.attn_tp_rank, s.attn_tp_size, local.wire)
        if not await self.core.send(endpoint, msg):
            self.registered.discard(endpoint)
            raise BootstrapError(f"cannot reach prefill rank {endpoint}")

    async def _send_pages(self, room: int, r: ReceiverRoom) -> None:
        if r.pages_sent or r.targets is None or r.dst_pages is None:
            return
        r.pages_sent = True
        for t, endpoint in r.targets:
            msg = control.RoomPages(room, self.core.control.endpoint, self.core.instance_id,
                                    r.dst_pages, r.aux_index, t.required_dst_info_num, t.is_dummy)
            if not await self.core.send(endpoint, msg):
                self._fail(room, r, f"room {room}: cannot reach prefill rank {endpoint}")
                return
        # Like SGLang's receiver, the room stays WaitingForInput until the prefill side
        # reports: the waiting_timeout covers the whole transfer.

    def sweep(self, now: float) -> None:
        """Deadlines for Bootstrapping, WaitingForInput and Transferring; release deadlines;
        finished rooms the engine never cleared."""
        s = self.core.settings
        limits = {KVPoll.Bootstrapping: s.bootstrap_timeout, KVPoll.WaitingForInput:
                  s.waiting_timeout, KVPoll.Transferring: s.transfer_timeout}
        wake = False
        for room, r in list(self.rooms.items()):
            limit = limits.get(r.state.status)
            if limit is not None and now - r.state.since > limit:
                self._fail(room, r, f"room {room}: timed out in {r.state.status.name} after "
                                    f"{limit:.1f}s (prefill {r.bootstrap_addr})")
            elif r.state.status == KVPoll.Failed and r.pages_sent and not r.release_seen and \
                    r.releasable(now, s.release_timeout):
                r.release_seen = wake = True  # wake waiters once, when the pages free up
            if r.state.done and now - r.state.since > s.finished_room_ttl and \
                    r.releasable(now, s.release_timeout):
                del self.rooms[room]
        if wake:
            self.core.notify()
