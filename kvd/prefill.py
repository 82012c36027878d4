"""Prefill side of a daemon: senders, decode peers, the chunk pump.

Room R on a prefill rank: ``Bootstrapping`` until every decode rank that
targets this rank sent its destination pages (``RoomPages``), then
``WaitingForInput``; ``Transferring`` while chunks are written; ``Success``
after the last chunk and the aux data landed, reported to every decode
destination with ``RoomStatus``. Any failure is reported the same way.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from kvd.addr import http_url
from kvd.core import Core
from kvd.errors import KvdError, LayoutError, RegistrationError, RoomError
from kvd.protocol import control
from kvd.protocol.codec import unpack_indices
from kvd.rooms import KVPoll, RoomState
from kvd.transfer.kvargs import RankArgs
from kvd.transfer.layout import RankLayout, check_pair, plan_transfer
from kvd.transfer.plan import Descriptors, Pages, check_page_range, check_plan_bounds, plan_aux

log = logging.getLogger("kvd.prefill")


@dataclass
class DecodePeer:
    """A decode rank that registered its KV args with this prefill rank."""

    endpoint: str
    instance_id: str
    attn_tp_rank: int
    attn_tp_size: int
    args: RankArgs | None
    rejected: str = ""
    layout: RankLayout | None = None


@dataclass
class Destination:
    """Where room R goes on one decode rank."""

    peer: DecodePeer
    pages: Pages
    aux_index: int
    is_dummy: bool


@dataclass
class SenderRoom:
    """Prefill-side state of one room."""

    state: RoomState
    num_pages: int | None = None
    aux_index: int | None = None
    required: int | None = None
    dsts: dict[str, Destination] = field(default_factory=dict)
    chunks: deque[tuple[Pages, bool]] = field(default_factory=deque)
    offset: int = 0
    pump: asyncio.Task[None] | None = None
    writing: bool = False
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def peers(self) -> str:
        """Decode endpoints of the room, for messages."""
        return ", ".join(self.dsts) or "no decode rank yet"


class PrefillSide:
    """Senders of one prefill rank. Every method runs on the daemon's loop."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.peers: dict[str, DecodePeer] = {}
        self.rooms: dict[int, SenderRoom] = {}
        self.pending: dict[int, list[tuple[control.RoomPages, float]]] = {}
        self.pending_by_peer: Counter[str] = Counter()  # limits buffered rooms per peer
        self._registrations: dict[str, control.RegisterRank] = {}
        self._layout: RankLayout | None = None
        self.failing_sessions: dict[str, int] = {}  # session -> rooms failed since last success
        self.bootstrap_registered = False

    # ---- engine calls -------------------------------------------------------------------

    def create(self, room: int) -> None:
        """``Sender(room)``. Raises RoomError if the room is active."""
        old = self.rooms.get(room)
        if old is not None and not old.state.done:
            raise RoomError(f"room {room} already active")
        self.rooms[room] = SenderRoom(RoomState(room))
        self.core.events.room_started("prefill", room)
        for msg, _ in self._take_pending(room):
            self._add_destination(self.rooms[room], msg)

    def init(self, room: int, num_pages: int, aux_index: int) -> None:
        """``sender.init``: total pages of the room and its aux slot."""
        r = self._room(room)
        local = self._local()
        if num_pages < 0 or num_pages > local.num_pages:
            raise RoomError(f"room {room}: num_pages {num_pages} outside [0, {local.num_pages}]")
        if local.num_aux_slots and not 0 <= aux_index < local.num_aux_slots:
            raise RoomError(f"room {room}: aux_index {aux_index} outside "
                            f"[0, {local.num_aux_slots})")
        r.num_pages, r.aux_index = num_pages, aux_index

    def send(self, room: int, pages_bytes: bytes, is_last: bool) -> None:
        """``sender.send``: queue one chunk. A page outside the pool fails the room.

        A chunk for a room that already ended is dropped: the engine learns the outcome
        from ``poll`` (aborts race with sends; that is not the engine's error).
        """
        r = self._room(room)
        pages = unpack_indices(pages_bytes)
        if r.state.done:
            return
        try:
            check_page_range(pages, self._local().num_pages, f"room {room} source")
        except LayoutError as exc:
            self._fail(room, r, str(exc))
            raise RoomError(str(exc)) from exc
        r.chunks.append((pages, is_last))
        self._kick(room, r)

    def abort(self, room: int, reason: str) -> None:
        """Fail the room and tell its decode destinations; no further chunk is scheduled."""
        r = self.rooms.get(room)
        if r is not None:
            self._fail(room, r, f"room {room} aborted on prefill ({r.peers}): {reason}")

    def clear(self, room: int) -> None:
        """Forget a room; an unfinished one is aborted first. A write still in flight
        keeps running in its thread and reports to the decode side when it returns."""
        r = self.rooms.get(room)
        if r is None:
            return
        if not r.state.done:
            self.abort(room, "cleared before it finished")
        del self.rooms[room]

    # ---- control messages ---------------------------------------------------------------

    def revalidate_peers(self) -> None:
        """The engine (re-)registered: check every known decode rank against the new args."""
        self.peers, self._layout = {}, None
        for msg in list(self._registrations.values()):
            self.on_register_rank(msg)

    def on_register_rank(self, msg: control.RegisterRank) -> None:
        """A decode rank's KV args; incompatible ones are remembered as rejected (K12).
        Registrations past ``max_peers`` distinct decode ranks are dropped (logged)."""
        if msg.endpoint not in self.peers and len(self.peers) >= self.core.settings.max_peers:
            log.warning("refused decode rank %s: %d peers registered (max_peers)", msg.endpoint,
                        len(self.peers))
            return
        self._registrations[msg.endpoint] = msg
        peer = DecodePeer(msg.endpoint, msg.instance_id, msg.attn_tp_rank, msg.attn_tp_size, None)
        try:
            peer.args = RankArgs.of(msg.kv_args)
            peer.layout = RankLayout.from_wire(msg.kv_args, msg.attn_tp_rank, msg.attn_tp_size)
            check_pair(self._local_layout(), peer.layout)
            _check_aux(self._local().wire, msg.kv_args)
        except KvdError as exc:
            peer.rejected = str(exc)
            log.warning("refused decode rank %s: %s", msg.endpoint, exc)
        self.peers[msg.endpoint] = peer

    def on_room_pages(self, msg: control.RoomPages) -> None:
        """Destination pages for a room (buffered if the sender does not exist yet)."""
        r = self.rooms.get(msg.room)
        if r is None:
            if self.pending_by_peer[msg.endpoint] >= self.core.settings.max_rooms_per_peer:
                self._refuse(msg, f"room {msg.room}: refused, {msg.endpoint} already has "
                                  f"{self.pending_by_peer[msg.endpoint]} rooms waiting for "
                                  f"a sender (max_rooms_per_peer)")
                return
            self.pending.setdefault(msg.room, []).append((msg, time.monotonic()))
            self.pending_by_peer[msg.endpoint] += 1
            return
        self._add_destination(r, msg)

    def on_misaddressed_pages(self, msg: control.RoomPages) -> None:
        """Pages sealed for a previous instance of this rank (it restarted since the decode
        rank looked it up): not used; the decode rank is told to register again (case S09:
        a message is acted on only by the instance it was sealed for)."""
        self._refuse(msg, f"room {msg.room}: sent to a previous instance of prefill rank "
                          f"{self.core.control.endpoint}", unregistered=True)

    def on_room_abort(self, msg: control.RoomAbort) -> None:
        """The decode side aborted the room: stop it, and confirm once no write is in flight.

        An abort for a room this rank does not know (never created, or cleared) is
        confirmed at once and creates nothing (case K05).
        """
        self._drop_pending(msg.room, msg.endpoint)
        r = self.rooms.get(msg.room)
        if r is None:
            self._status_to(msg.endpoint, msg.room, KVPoll.Failed, msg.reason, quiesced=True)
            return
        if r.state.fail(msg.reason):
            r.chunks.clear()
            self.core.counters.rooms_failed += 1
            self.core.events.room_done("prefill", msg.room, "failed", msg.reason, peer=msg.endpoint)
            self.core.notify()
        if not r.writing:  # otherwise the pump confirms when the write returns
            self._status_to(msg.endpoint, msg.room, KVPoll.Failed, msg.reason, quiesced=True)
            self.core.notify()

    # ---- internals ----------------------------------------------------------------------

    def _local(self) -> RankArgs:
        if self.core.local is None:
            raise RegistrationError("no engine has registered KV buffers with this kvd")
        return self.core.local

    def _local_layout(self) -> RankLayout:
        if self._layout is None:
            s = self.core.settings
            self._layout = RankLayout.from_wire(self._local().wire, s.attn_tp_rank,
                                                s.attn_tp_size)
        return self._layout

    def _room(self, room: int) -> SenderRoom:
        r = self.rooms.get(room)
        if r is None:
            raise RoomError(f"unknown room {room}")
        return r

    def _status_to(self, endpoint: str, room: int, status: KVPoll, reason: str,
                   quiesced: bool, aux: list[bytes] | None = None) -> None:
        msg = control.RoomStatus(room, int(status), reason, self.core.control.endpoint,
                                 self.core.instance_id, quiesced, aux or [])
        delay = self.core.faults.aux_delay_s if aux and self.core.faults else 0.0
        self.core.spawn(self._send_later(endpoint, msg, delay), f"status-{room}")

    async def _send_later(self, endpoint: str, msg: control.RoomStatus, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)  # fault injection (tests): a slow aux path
        await self.core.send(endpoint, msg)

    def _refuse(self, msg: control.RoomPages, reason: str, unregistered: bool = False) -> None:
        status = control.RoomStatus(msg.room, int(KVPoll.Failed), reason,
                                    self.core.control.endpoint, self.core.instance_id,
                                    quiesced=True, unregistered=unregistered)
        self.core.spawn(self.core.send(msg.endpoint, status), f"status-{msg.room}")

    def _take_pending(self, room: int) -> list[tuple[control.RoomPages, float]]:
        entries = self.pending.pop(room, [])
        for m, _ in entries:
            self.pending_by_peer[m.endpoint] -= 1
            if self.pending_by_peer[m.endpoint] <= 0:
                del self.pending_by_peer[m.endpoint]
        return entries

    def _drop_pending(self, room: int, endpoint: str) -> None:
        entries = self._take_pending(room)
        kept = [(m, t) for m, t in entries if m.endpoint != endpoint]
        if kept:
            self.pending[room] = kept
            self.pending_by_peer.update(m.endpoint for m, _ in kept)

    def _add_destination(self, r: SenderRoom, msg: control.RoomPages) -> None:
        room = msg.room
        peer = self.peers.get(msg.endpoint)
        if r.state.done:
            return self._refuse(msg, f"room {room}: duplicate room (already "
                                     f"{r.state.status.name} on prefill)")
        if msg.endpoint in r.dsts or (r.required is not None and len(r.dsts) >= r.required):
            return self._refuse(msg, f"room {room}: duplicate room (already bound to "
                                     f"{r.peers}; refused {msg.endpoint})")
        if peer is None:  # e.g. this kvd restarted: the decode rank registers again, retries
            return self._refuse(msg, f"room {room}: decode rank {msg.endpoint} not registered "
                                     f"with this prefill", unregistered=True)
        if peer.args is None or peer.rejected:
            return self._refuse(msg, f"room {room}: {peer.rejected}")
        try:
            pages = unpack_indices(msg.dst_pages)
            check_page_range(pages, peer.args.num_pages, f"room {room} destination")
            if peer.args.num_aux_slots and not 0 <= msg.aux_index < peer.args.num_aux_slots:
                raise LayoutError(f"room {room}: aux_index {msg.aux_index} outside the decode "
                                  f"rank's {peer.args.num_aux_slots} slots")
        except KvdError as exc:
            self._refuse(msg, str(exc))
            self._fail(room, r, str(exc))
            return None
        r.dsts[msg.endpoint] = Destination(peer, pages, msg.aux_index, msg.is_dummy)
        r.required = msg.required_dst_info_num
        if len(r.dsts) >= r.required:
            r.state.advance(KVPoll.WaitingForInput)
            self._kick(room, r)
        return None

    def _kick(self, room: int, r: SenderRoom) -> None:
        ready = r.state.status in (KVPoll.WaitingForInput, KVPoll.Transferring)
        if ready and r.chunks and (r.pump is None or r.pump.done()):
            r.pump = self.core.spawn(self._pump(room, r), f"pump-{room}")

    async def _pump(self, room: int, r: SenderRoom) -> None:
        while r.chunks and not r.state.done:
            pages, is_last = r.chunks.popleft()
            r.state.advance(KVPoll.Transferring)
            r.writing = True
            try:
                await self._write_chunk(room, r, pages, is_last)
            except KvdError as exc:
                r.writing = False
                self._session_failed(r)
                self._fail(room, r, f"room {room}: transfer to {r.peers} failed: {exc}")
                return
            finally:
                r.writing = False
            self._session_ok(r)
            if r.state.done:  # failed (abort, deadline) while the write was in flight
                self._notify(room, r, KVPoll.Failed, r.state.reason)
                return
            if is_last:
                self._succeed(room, r)

    def _session_failed(self, r: SenderRoom) -> None:
        """A failed write is evidence against its session, not a verdict: no blacklist."""
        for d in r.dsts.values():
            if d.peer.args is not None:
                session = d.peer.args.wire.session_id
                self.failing_sessions[session] = self.failing_sessions.get(session, 0) + 1
                self.core.counters.session_failures += 1

    def _session_ok(self, r: SenderRoom) -> None:
        for d in r.dsts.values():
            session = d.peer.args.wire.session_id if d.peer.args is not None else ""
            failed = self.failing_sessions.pop(session, 0)
            if failed:
                self.core.counters.session_recoveries += 1
                log.info("transfers to session %s recovered after %d failed room(s)", session,
                         failed)

    async def _write_chunk(self, room: int, r: SenderRoom, pages: Pages, is_last: bool) -> None:
        start = time.perf_counter()
        plans = [(d, self._plan(room, r, d, pages, is_last)) for d in r.dsts.values()]
        r.offset += int(pages.size)
        deadline = r.state.since + self.core.settings.transfer_timeout
        await asyncio.gather(*(self.core.executor.write(d.peer.args.wire.session_id, desc,
                                                        deadline)
                               for d, desc in plans if d.peer.args is not None))
        moved = sum(desc.nbytes for _, desc in plans)
        r.nbytes += moved
        r.seconds += time.perf_counter() - start
        self.core.counters.bytes_sent += moved
        self.core.events.chunks_sent((d.peer.endpoint, desc.nbytes) for d, desc in plans)

    def _plan(self, room: int, r: SenderRoom, d: Destination, pages: Pages,
              is_last: bool) -> Descriptors:
        local, dst, dst_layout = self._local(), d.peer.args, d.peer.layout
        assert dst is not None and dst_layout is not None
        if d.is_dummy:
            return Descriptors.empty()
        dst_pages = d.pages[r.offset:r.offset + pages.size]
        if dst_pages.size != pages.size or (is_last and r.offset + pages.size != d.pages.size):
            remaining = d.pages.size - r.offset
            raise LayoutError(f"index length mismatch {pages.size} vs {max(remaining, 0)}")
        desc = plan_transfer(self._local_layout(), dst_layout, pages, dst_pages)
        s = self.core.settings
        last_stage = s.pp_rank == s.pp_size - 1  # only the last PP stage has the outputs
        by_transfer = s.aux_transport == "mooncake"
        if is_last and last_stage and by_transfer and local.aux_ptrs.size and \
                r.aux_index is not None:
            desc = desc.concat(plan_aux(local.aux_ptrs, dst.aux_ptrs, local.aux_item_lens,
                                        r.aux_index, d.aux_index))
        check_plan_bounds(desc, local.regions, dst.regions, f"room {room}")
        return desc

    def _succeed(self, room: int, r: SenderRoom) -> None:
        if r.state.advance(KVPoll.Success):
            self.core.counters.rooms_succeeded += 1
            self.core.events.room_done("prefill", room, "success", "", r.nbytes, r.seconds, r.dsts)
            self.core.notify()
            self._notify(room, r, KVPoll.Success, "", self._aux_payload(r))

    def _fail(self, room: int, r: SenderRoom, reason: str) -> None:
        if r.state.fail(reason):
            r.chunks.clear()
            self.core.counters.rooms_failed += 1
            self.core.events.room_done("prefill", room, "failed", reason, peer=r.dsts)
            self.core.notify()
            log.warning("%s", reason)
            self._notify(room, r, KVPoll.Failed, reason)

    def _notify(self, room: int, r: SenderRoom, status: KVPoll, reason: str,
                aux: list[bytes] | None = None) -> None:
        """Tell every decode destination; ``quiesced`` says whether a write is in flight."""
        for endpoint, d in r.dsts.items():
            self._status_to(endpoint, room, status, reason, quiesced=not r.writing,
                            aux=None if d.is_dummy else aux)

    def _aux_payload(self, r: SenderRoom) -> list[bytes] | None:
        """The room's aux slot, read from the engine's aux buffers (aux_transport = control,
        last PP stage only); None when aux travels with the transfer."""
        s, local = self.core.settings, self.core.local
        if s.aux_transport != "control" or s.pp_rank != s.pp_size - 1 or local is None or \
                r.aux_index is None or not local.aux_ptrs.size:
            return None
        return [ctypes.string_at(int(p) + r.aux_index * int(n), int(n))
                for p, n in zip(local.aux_ptrs, local.aux_item_lens, strict=True)]

    def sweep(self, now: float) -> None:
        """Deadlines: fail rooms stuck in a state; drop stale buffered destinations."""
        s = self.core.settings
        limits = {KVPoll.Bootstrapping: s.bootstrap_timeout, KVPoll.WaitingForInput:
                  s.waiting_timeout, KVPoll.Transferring: s.transfer_timeout}
        for room, r in list(self.rooms.items()):
            limit = limits.get(r.state.status)
            if limit is not None and now - r.state.since > limit:
                self._fail(room, r, f"room {room}: timed out in {r.state.status.name} "
                                    f"after {limit:.1f}s on prefill (decode: {r.peers})")
            elif r.state.done and not r.writing and now - r.state.since > s.finished_room_ttl:
                del self.rooms[room]  # the engine never cleared it
        for room, entries in list(self.pending.items()):
            if any(now - t > s.bootstrap_timeout for _, t in entries):
                kept = [(m, t) for m, t in self._take_pending(room)
                        if now - t <= s.bootstrap_timeout]
                if kept:
                    self.pending[room] = kept
                    self.pending_by_peer.update(m.endpoint for m, _ in kept)

    async def register_with_bootstrap(self) -> None:
        """PUT this rank to the bootstrap server, retrying with capped backoff until accepted."""
        s = self.core.settings
        assert s.bootstrap_addr is not None
        host, port = self.core.control.endpoint.removeprefix("tcp://").rsplit(":", 1)
        body = {"role": "Prefill", "attn_tp_size": s.attn_tp_size, "attn_tp_rank": s.attn_tp_rank,
                "attn_dp_size": s.attn_dp_size, "attn_dp_rank": s.attn_dp_rank,
                "pp_size": s.pp_size, "pp_rank": s.pp_rank, "rank_ip": host.strip("[]"),
                "rank_port": int(port), "instance_id": s.instance_id,
                "page_size": self._local().wire.page_size}
        url, delay = http_url(s.bootstrap_addr, "/route"), 0.05
        while True:
            try:
                resp = await self.core.http("PUT", url, json=body)
                if resp.status_code == 200:
                    self.bootstrap_registered = True
                    log.info("registered with bootstrap %s", s.bootstrap_addr)
                    return
                log.warning("bootstrap %s refused registration: %d %s", s.bootstrap_addr,
                            resp.status_code, resp.text)
            except Exception as exc:  # httpx errors: server not up yet
                log.info("bootstrap %s not reachable yet (%s); retrying", s.bootstrap_addr,
                         type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def deregister_from_bootstrap(self) -> None:
        """Remove this rank from the bootstrap table (best effort, one bounded request)."""
        s = self.core.settings
        assert s.bootstrap_addr is not None
        params: dict[str, str | int] = {"engine_rank": s.attn_tp_rank,
                                        "target_dp_group": s.attn_dp_rank,
                                        "target_pp_rank": s.pp_rank, "instance_id": s.instance_id}
        try:
            await self.core.http("DELETE", http_url(s.bootstrap_addr, "/route"), params=params)
            self.bootstrap_registered = False
        except Exception as exc:  # httpx errors: the bootstrap server may be gone already
            log.info("could not deregister from bootstrap %s: %s", s.bootstrap_addr, exc)

    def stats(self, room: int) -> tuple[int, float] | None:
        """(bytes, seconds) moved for a finished room, if known."""
        r = self.rooms.get(room)
        return (r.nbytes, r.seconds) if r is not None and r.state.done else None



def _check_aux(local: control.KVArgsWire, peer: control.KVArgsWire) -> None:
    """Aux buffers must pair one to one with equal item lengths (bytes)."""
    if local.aux_item_lens != peer.aux_item_lens:
        raise RegistrationError(f"aux item lens mismatch {local.aux_item_lens} vs "
                                f"{peer.aux_item_lens}")
