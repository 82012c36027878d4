"""What both sides of a daemon share: settings, transfer engine, control plane, local KV args.

Everything here is owned by the daemon's one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from kvd.bootstrap import client as signed_http
from kvd.config import Settings
from kvd.control.inbound import Answer, Misaddressed
from kvd.control.peers import ControlPlane, PeerSendError
from kvd.errors import ProtocolError, RegistrationError
from kvd.hostid import host_identity
from kvd.logs import fields
from kvd.memory import EngineMemory, Importer, import_engine
from kvd.metrics import RoomEvents
from kvd.protocol import codec, control
from kvd.protocol.control import Compat, ControlMessage, GroupWire, KVArgsWire, StateWire
from kvd.protocol.memory import ExportedPool
from kvd.protocol.rpc import RegisterKV
from kvd.ranks import Ranks
from kvd.security import Authenticator
from kvd.transfer.backends.base import TransferEngine
from kvd.transfer.compat import aux_layout
from kvd.transfer.executor import TransferExecutor
from kvd.transfer.faults import FaultPlan
from kvd.transfer.kvargs import RankArgs, check_aux_for_control

log = logging.getLogger("kvd")


def http_client(settings: Settings) -> httpx.AsyncClient:
    """The daemon's HTTP client (bootstrap lookups and registration, heartbeats).

    ``trust_env=False``: kvd<->kvd traffic stays inside the cluster, so ``HTTP_PROXY``,
    ``ALL_PROXY``, ``NO_PROXY``, ``.netrc`` and ``SSL_CERT_*`` from the environment are
    not used (a proxy set for the engine's model downloads must not carry heartbeats).
    Timeouts: ``http_timeout`` seconds per request.
    """
    return httpx.AsyncClient(timeout=settings.http_timeout, trust_env=False,
                             limits=httpx.Limits(max_keepalive_connections=32))


@dataclass
class Counters:
    """Daemon-wide totals (bytes, rooms)."""

    bytes_sent: int = 0
    # K43: writes stopped because their room attempt ended; bytes of them that still
    # landed (in flight when it ended) and bytes never written (dropped unstarted)
    writes_cancelled: int = 0
    cancelled_bytes_landed: int = 0
    cancelled_bytes_dropped: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    protocol_errors: int = 0
    stale_messages: int = 0
    loop_errors: int = 0
    auth_failures: int = 0
    session_failures: int = 0
    session_recoveries: int = 0
    heartbeat_misses: int = 0
    # K45/K46: rooms named by POST /v1/rooms/release, by outcome (the route is unsigned:
    # outcomes are counted, not logged per room)
    releases_released: int = 0
    releases_ended: int = 0
    releases_refused: int = 0
    releases_unknown: int = 0


#: Control frames at least this long (bytes) are decoded once before they leave: in a room
#: message only a bulk field (page lists, aux payloads) can break one of the protocol's
#: field bounds (S19) -- its integers come bounded from the engine RPC (``rpc.RoomId``,
#: ``rpc.I64``, the same types) or from this daemon's own counters -- and any such break
#: makes the frame this long. A registration is decoded whatever its length (``whole``):
#: its integers are the engine's ``RegisterKV`` ones, which the RPC does not bound.
CHECK_FRAMES_FROM = 64 << 10


def undeliverable(frame: bytes, cap: int, whole: bool = False) -> str | None:
    """Why no peer would act on control ``frame`` (None: it would). Every peer drops a
    frame longer than ``cap`` bytes unread (ZMQ ``MAXMSGSIZE``) and refuses one with a
    field past its bound as malformed (case S19; an integer outside its wire bound too),
    without answering either: a room whose message it is would wait for its deadline
    (K16), so the sender checks first. ``whole``: decode the frame whatever its length
    (else only from :data:`CHECK_FRAMES_FROM` bytes)."""
    if len(frame) > cap:
        return (f"the {len(frame)}-byte control frame exceeds the {cap}-byte frame every "
                f"peer accepts (the protocol's largest real message, S19)")
    if whole or len(frame) >= CHECK_FRAMES_FROM:
        try:
            control.decode_many(frame, cap)
        except ProtocolError as exc:
            return f"a peer would refuse the control frame as malformed: {exc}"
    return None


@dataclass
class Outbox:
    """Control messages waiting for one peer, sent in order by one task."""

    endpoint: str
    queue: deque[tuple[ControlMessage, str | None, Callable[[str], None] | None]] = field(
        default_factory=deque)  # (message, recipient instance, on_fail)
    task: asyncio.Task[None] | None = None


@dataclass
class Core:
    """Shared daemon state. ``local`` is set once the engine registered its KV args."""

    settings: Settings
    engine: TransferEngine
    executor: TransferExecutor
    control: ControlPlane
    memory: Importer
    http_client: httpx.AsyncClient
    local: RankArgs | None = None
    counters: Counters = field(default_factory=Counters)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    engine_memory: EngineMemory | None = None
    auth: Authenticator = field(default_factory=lambda: Authenticator(None))
    recipients: signed_http.Recipients = field(default_factory=signed_http.Recipients)
    faults: FaultPlan | None = None
    _auth_logged: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    events: RoomEvents = field(default_factory=RoomEvents)  # metrics + recent failures hooks
    clock: Callable[[], float] = time.monotonic
    outboxes: dict[str, Outbox] = field(default_factory=dict)
    ranks: Ranks | None = None  # the engine's position, resolved at its registration
    peer_channel: str = ""  # this decode's peer channel socket name (S18), "" without one
    # called after room state may have changed (effects performed): the status table's
    # writer re-publishes (kvd.engine_rpc.channel); a no-op without one
    on_change: Callable[[], None] = field(default=lambda: None)
    # called with the reason when the engine's memory no longer stands (S16): the daemon
    # drops the registration (Daemon.drop_registration); a no-op without a daemon
    on_memory_lost: Callable[[str], None] = field(default=lambda reason: None)

    def position(self) -> Ranks:
        """This rank's resolved :class:`~kvd.ranks.Ranks`. Raises RegistrationError before
        an engine registered (the ranks come from it, or from the settings with it)."""
        if self.ranks is None:
            raise RegistrationError("no engine has registered with this kvd (its ranks are "
                                    "not known yet)")
        return self.ranks

    def notify(self) -> None:
        """Wake every :meth:`wait_changed` caller (a room reached Success or Failed)."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_changed(self, seconds: float) -> None:
        """Return at the next :meth:`notify` or after ``seconds``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), seconds)

    @property
    def instance_id(self) -> str:
        return self.settings.instance_id

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task the daemon keeps a reference to (and cancels on shutdown)."""
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s crashed", task.get_name(), exc_info=task.exception())

    async def send(self, endpoint: str, msg: ControlMessage, instance: str | None = None
                   ) -> bool:
        """Send a control message now, sealed for ``instance`` (else the instance learned
        for ``endpoint``); returns False (logged) if the peer is unreachable or its
        instance is unknown. Raises :class:`ProtocolError` naming why, sending nothing, for
        a message no peer would act on (:func:`undeliverable`, K16)."""
        frame = control.encode(msg)
        why = undeliverable(frame, self.frame_cap(), whole=True)  # rare: a registration
        if why is not None:
            raise ProtocolError(f"{type(msg).__name__} to {endpoint} not sent: {why}")
        try:
            await self.control.send(endpoint, frame, instance)
            return True
        except PeerSendError as exc:
            log.warning("%s", exc, extra=fields(peer=endpoint))
            self.events.peer_error(endpoint, str(exc))
            return False

    def refuse(self, m: Misaddressed) -> None:
        """Answer an authentic message this daemon does not act on with a typed
        :class:`~kvd.protocol.control.Refused` (the one refusal path: frames the seal
        refused, and messages a room machine dropped, K16): rate-limited per peer and in
        all, never larger than what it answers, never to a refusal
        (:class:`~kvd.control.inbound.Refusals`); sent best effort, keeping no socket
        open to a sender that is not a peer (:meth:`ControlPlane.send_once`)."""
        answer = self.control.refusal(m)
        if answer is not None:
            self.spawn(self._send_refusal(answer), f"refuse-{answer.endpoint}")

    async def _send_refusal(self, a: Answer) -> None:
        with contextlib.suppress(PeerSendError):  # best effort: the sender may be gone
            await self.control.send_once(a.endpoint, a.frame, a.instance, at=a.at)

    def post(self, endpoint: str, msg: ControlMessage,
             on_fail: Callable[[str], None] | None = None, instance: str | None = None) -> None:
        """Queue ``msg`` for ``endpoint``, sealed for ``instance`` (the instance a room is
        bound to; else the one learned for ``endpoint``); messages to one peer leave in
        order. If it cannot be delivered within the send timeout, ``on_fail(reason)`` is
        called (on the loop) — also when the daemon stops first: a queued message never
        vanishes silently."""
        box = self.outboxes.get(endpoint)
        if box is None:
            box = self.outboxes[endpoint] = Outbox(endpoint)
        box.queue.append((msg, instance, on_fail))
        if box.task is None:
            box.task = self.spawn(self._drain(box), f"outbox-{endpoint}")

    async def _drain(self, box: Outbox) -> None:
        """Send what is queued for one peer, in order: everything queued when the previous
        send returned leaves as ONE frame (a :class:`~kvd.protocol.control.Batch` of up to
        ``MAX_BATCH``, split where the recipient instance changes, see :meth:`_batch`), so
        a busy peer costs one seal and one send per batch, not per room."""
        try:
            while box.queue:
                instance = box.queue[0][1]
                n, frame, why = self._batch(box, instance)
                if why is not None:  # one message no peer would take: its room hears why
                    self._undeliverable(box, why)
                    continue
                try:
                    await self.control.send(box.endpoint, frame, instance)
                except PeerSendError as exc:
                    log.warning("%s (%d queued messages dropped)", exc, len(box.queue),
                                extra=fields(peer=box.endpoint))
                    self.events.peer_error(box.endpoint, str(exc))
                    self._fail_queue(box, str(exc))
                    return
                for _ in range(n):
                    box.queue.popleft()
        finally:
            self._fail_queue(box, f"control send to {box.endpoint} abandoned (kvd stopping)")
            box.task = None
            if self.outboxes.get(box.endpoint) is box:
                del self.outboxes[box.endpoint]

    def frame_cap(self) -> int:
        """The longest control frame (bytes) a peer accepts: ``max_frame_bytes``, which the
        configuration keeps at or above the protocol's largest real message, and that
        message (:func:`kvd.protocol.control.max_frame`, the same on every peer of a wire
        version)."""
        return min(self.settings.max_frame_bytes, control.max_frame())

    def _batch(self, box: Outbox, instance: str | None) -> tuple[int, bytes, str | None]:
        """``(n, frame, why)``: the first ``n`` messages of ``box`` as one frame -- those
        sealed for the same ``instance`` (one seal per frame), at most ``MAX_BATCH``, and no
        more than a peer takes (:meth:`frame_cap`; a batch of long page lists is split: a
        peer refuses a larger frame unread, S19). ``why``: None, or why no peer would take
        the first message alone (``n`` is 1 then, :func:`undeliverable`)."""
        msgs: list[ControlMessage] = []
        for msg, inst, _ in itertools.islice(box.queue, control.MAX_BATCH):
            if inst != instance:
                break
            msgs.append(msg)
        frame = control.encode_many(msgs)
        cap = self.frame_cap()
        why = undeliverable(frame, cap)
        while len(msgs) > 1 and why is not None:
            msgs = msgs[:len(msgs) // 2]
            frame = control.encode_many(msgs)
            why = undeliverable(frame, cap)
        return len(msgs), frame, why

    def _undeliverable(self, box: Outbox, why: str) -> None:
        """Drop the first message of ``box`` (no peer would act on it) and tell whoever
        queued it, at once (its room fails naming why, K16), not at its deadline."""
        msg, _, on_fail = box.queue.popleft()
        reason = f"{type(msg).__name__} to {box.endpoint} not sent: {why}"
        log.error("%s", reason, extra=fields(peer=box.endpoint))
        if on_fail is not None:
            on_fail(reason)

    @staticmethod
    def _fail_queue(box: Outbox, reason: str) -> None:
        while box.queue:
            _, _, on_fail = box.queue.popleft()
            if on_fail is not None:
                on_fail(reason)

    def supervise(self, body: Callable[[], Awaitable[None]], name: str,
                  interval: float) -> asyncio.Task[Any]:
        """Run ``body()`` every ``interval`` s for the daemon's life. An unexpected
        exception is logged and counted (``loop_errors``) and the loop goes on (K31)."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await body()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.counters.loop_errors += 1
                    log.exception("%s: unexpected error (the loop goes on)", name)

        return self.spawn(loop(), name)

    def register_local(self, req: RegisterKV, fds: Sequence[int] = (),
                       engine_uid: int | None = None) -> RankArgs:
        """Map the engine's buffers, check the KV args, register each buffer with the
        transfer engine -- all or nothing (case S12). ``fds``: descriptors received with
        the request (``fd`` handles index them); ``engine_uid``: the engine's uid
        (``SO_PEERCRED``), which must own any ``shm`` file it names (case S10).

        Raises :class:`RegistrationError` (incl. HandleError) on a bad handle or args.
        """
        if self.local is not None:
            raise RegistrationError("an engine is already registered with this kvd")
        uid = os.getuid() if engine_uid is None else engine_uid
        mem = import_engine(self.memory, req.kv_buffers, req.aux_buffers, fds, uid,
                            [*req.state_buffers, *req.group_buffers])
        try:
            args = RankArgs.of(self._wire(req, mem))
            if self.settings.role == "prefill" and self.settings.aux_transport == "control":
                check_aux_for_control(args)
            mem.register(self.engine)
        except BaseException:
            mem.release()
            raise
        self.local, self.engine_memory = args, mem
        log.info("engine registered: %d KV buffers (%s), %d pages of %d tokens, %d aux slots",
                 len(mem.kv), mem.kv[0].device if mem.kv else "-", args.num_pages,
                 req.page_size, args.num_aux_slots)
        return args

    def _wire(self, req: RegisterKV, mem: EngineMemory) -> KVArgsWire:
        if req.state is None and req.state_buffers:
            raise RegistrationError(f"{len(req.state_buffers)} state buffers without a state "
                                    f"spec (RegisterKV.state says what they hold)")
        state, groups = split_extra(req, mem.state)
        return KVArgsWire(
            session_id=self.engine.session_id, kv_data_ptrs=[b.address for b in mem.kv],
            kv_data_lens=[b.length for b in mem.kv], kv_item_lens=list(req.kv_item_lens),
            aux_data_ptrs=[b.address for b in mem.aux],
            aux_data_lens=[b.length for b in mem.aux],
            aux_item_lens=list(req.aux_item_lens), page_size=req.page_size,
            num_kv_heads=req.num_kv_heads, head_dim=req.head_dim, dtype_size=req.dtype_size,
            num_layers=req.num_layers, layer_start=req.layer_start, is_mla=req.is_mla,
            layout=req.layout, total_kv_heads=req.total_kv_heads, fused_kv=req.fused_kv,
            compat=msgspec.structs.replace(req.compat or Compat(), wire_version=codec.VERSION,
                                           page_size=req.page_size,
                                           aux_layout=aux_layout(req)),
            state=None if req.state is None else StateWire(
                req.state, [b.address for b in state], [b.length for b in state]),
            groups=groups)

    def export(self) -> tuple[ExportedPool, list[int]] | None:
        """The engine's memory for a same-host prefill's ``local`` backend, and the
        descriptors the peer channel passes (this daemon's own, not dups); None before
        an engine registered."""
        mem = self.engine_memory
        return None if mem is None else mem.export(host_identity(), self.peer_channel)

    def export_snapshot(self) -> tuple[ExportedPool, list[int]] | None:
        """:meth:`export` with dups of the descriptors, for the peer channel's thread."""
        out = self.export()
        return None if out is None else (out[0], [os.dup(fd) for fd in out[1]])

    def check_memory(self) -> str | None:
        """Does the engine's registered host memory still stand (one ``fstat`` per
        unsealed buffer, :meth:`kvd.memory.EngineMemory.lost`)? If not, :attr:`on_memory_lost`
        runs with the reason (which buffer, its file's size, the buffer's end) and the
        reason is returned. Called at the sweep (at most once a second), when a transfer
        or an aux access failed, and when a prefill reports a room Failed (case S16)."""
        mem = self.engine_memory
        why = None if mem is None else mem.lost()
        if why is not None:
            self.on_memory_lost(why)
        return why

    def unregister_all(self) -> None:
        """Unregister the engine's buffers from the transfer engine (errors are logged)."""
        if self.engine_memory is not None:
            self.engine_memory.unregister(self.engine)

    def release_local(self, unmap_after: float) -> None:
        """Forget the engine's registration: unregister its memory from the transfer engine
        now (remote writes into it are refused from here on) and unmap it after
        ``unmap_after`` seconds (a write the transport already accepted may still land)."""
        self.unregister_all()
        mem, self.engine_memory, self.local = self.engine_memory, None, None
        if mem is not None:
            asyncio.get_running_loop().call_later(unmap_after, mem.release)

    def totals(self) -> dict[str, int]:
        """Daemon-wide counters, with the inbound control pipeline's drops folded in
        (``misaddressed``: authentic frames sealed for a previous instance of this
        daemon; ``skewed``: authentic frames sealed outside its freshness window; neither
        acted on; ``refusals_sent``: typed refusals that answered them)."""
        inbound = self.control.stats
        out = dict(vars(self.counters))
        out["auth_failures"] += inbound.auth_failures
        out["protocol_errors"] += inbound.protocol_errors
        out["control_dropped"] = inbound.dropped
        out["control_penalized"] = inbound.penalized
        out["misaddressed"] = inbound.misaddressed
        out["skewed"] = inbound.skewed
        out["refusals_sent"] = self.control.refusal_stats.get("sent", 0)
        return out

    def _log_auth_once(self, key: str, exc: Exception) -> None:
        """Unauthenticated requests are logged once per kind (the sender is unknown: an
        unverified request's claims are not trusted), then only counted."""
        self.log_once(key, f"refused request: {exc}")

    def log_once(self, key: str, message: str) -> None:
        """Log ``message`` (WARNING) the first time ``key`` is seen (at most 64 keys),
        then nothing: what anyone who reaches a port can cause is counted, not logged per
        request (S20, K45)."""
        if key not in self._auth_logged and len(self._auth_logged) < 64:
            self._auth_logged.add(key)
            log.warning("%s (further ones only counted)", message)

    async def http(self, method: str, url: str, *, params: Mapping[str, Any] | None = None,
                   json: Any = None, limit_s: float | None = None) -> httpx.Response:
        """An HTTP request to another kvd, signed for the instance serving ``url``
        (raises httpx errors)."""
        return await signed_http.request(self.http_client, self.auth, self.recipients, method,
                                         url, params=params, json=json,
                                         limit_s=limit_s or self.settings.http_timeout)


def split_extra(req: RegisterKV, extra: Sequence[Any]) -> tuple[list[Any], list[GroupWire]]:
    """The engine's buffers after KV and aux (``extra``: its ``state_buffers`` then its
    ``group_buffers``, imported) split into the state ones and one :class:`GroupWire` per
    paged cache group (``req.groups``, in order, each taking as many buffers as it has item
    lengths). Raises :class:`RegistrationError` when the counts do not add up."""
    n_state = len(req.state_buffers)
    want = sum(len(g.item_lens) for g in req.groups)
    if len(req.group_buffers) != want:
        raise RegistrationError(f"{len(req.group_buffers)} group buffers for paged cache "
                                f"groups of {want} buffers in all (RegisterKV.groups)")
    groups, at = [], n_state
    for g in req.groups:
        bufs = extra[at:at + len(g.item_lens)]
        at += len(g.item_lens)
        groups.append(GroupWire(g, [b.address for b in bufs], [b.length for b in bufs]))
    return list(extra[:n_state]), groups

