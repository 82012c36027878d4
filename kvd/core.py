"""What both sides of a daemon share: settings, transfer engine, control plane, local KV args.

Everything here is owned by the daemon's one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvd.bootstrap import client as signed_http
from kvd.config import Settings
from kvd.control.peers import ControlPlane, PeerSendError
from kvd.errors import RegistrationError
from kvd.memory import MemoryMap
from kvd.metrics import RoomEvents
from kvd.protocol import control
from kvd.protocol.control import ControlMessage, KVArgsWire
from kvd.protocol.rpc import RegisterKV
from kvd.security import Authenticator
from kvd.transfer.backends.base import TransferEngine
from kvd.transfer.executor import TransferExecutor
from kvd.transfer.faults import FaultPlan
from kvd.transfer.kvargs import RankArgs

log = logging.getLogger("kvd")


@dataclass
class Counters:
    """Daemon-wide totals (bytes, rooms)."""

    bytes_sent: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    protocol_errors: int = 0
    auth_failures: int = 0
    session_failures: int = 0
    session_recoveries: int = 0
    heartbeat_misses: int = 0


@dataclass
class Core:
    """Shared daemon state. ``local`` is set once the engine registered its KV args."""

    settings: Settings
    engine: TransferEngine
    executor: TransferExecutor
    control: ControlPlane
    memory: MemoryMap
    http_client: httpx.AsyncClient
    local: RankArgs | None = None
    counters: Counters = field(default_factory=Counters)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    registered_addrs: list[int] = field(default_factory=list)
    auth: Authenticator = field(default_factory=lambda: Authenticator(None))
    recipients: signed_http.Recipients = field(default_factory=signed_http.Recipients)
    faults: FaultPlan | None = None
    _auth_logged: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    events: RoomEvents = field(default_factory=RoomEvents)  # metrics + recent failures hooks

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

    async def send(self, endpoint: str, msg: ControlMessage) -> bool:
        """Send a control message, sealed for the instance serving ``endpoint``; returns
        False (logged) if the peer is unreachable or its instance is unknown."""
        try:
            await self.control.send(endpoint, control.encode(msg))
            return True
        except PeerSendError as exc:
            log.warning("%s", exc)
            return False

    def register_local(self, req: RegisterKV) -> RankArgs:
        """Map the engine's buffers, register them with the transfer engine, build KV args.

        Raises :class:`RegistrationError` on a bad handle or inconsistent args.
        """
        if self.local is not None:
            raise RegistrationError("an engine is already registered with this kvd")
        kv_ptrs = [self.memory.resolve(h) for h in req.kv_buffers]
        aux_ptrs = [self.memory.resolve(h) for h in req.aux_buffers]
        wire = KVArgsWire(
            session_id=self.engine.session_id, kv_data_ptrs=kv_ptrs,
            kv_data_lens=[h.length for h in req.kv_buffers], kv_item_lens=list(req.kv_item_lens),
            aux_data_ptrs=aux_ptrs, aux_data_lens=[h.length for h in req.aux_buffers],
            aux_item_lens=list(req.aux_item_lens), page_size=req.page_size,
            num_kv_heads=req.num_kv_heads, head_dim=req.head_dim, dtype_size=req.dtype_size,
            num_layers=req.num_layers, layer_start=req.layer_start, is_mla=req.is_mla,
            layout=req.layout, total_kv_heads=req.total_kv_heads)
        args = RankArgs.of(wire)
        for m in self.memory.mappings.values():
            if m.addr not in self.registered_addrs:
                self.engine.register(m.addr, m.length)
                self.registered_addrs.append(m.addr)
        self.local = args
        log.info("engine registered: %d KV buffers, %d pages of %d tokens, %d aux slots",
                 len(kv_ptrs), args.num_pages, req.page_size, args.num_aux_slots)
        return args

    def unregister_all(self) -> None:
        """Unregister every mapped region from the transfer engine (errors are logged)."""
        for addr in self.registered_addrs:
            try:
                self.engine.unregister(addr)
            except Exception as exc:
                log.warning("unregister %#x: %s", addr, exc)
        self.registered_addrs.clear()

    def release_local(self, unmap_after: float) -> None:
        """Forget the engine's registration: unregister its memory from the transfer engine
        now (remote writes into it are refused from here on) and unmap it after
        ``unmap_after`` seconds (a write the transport already accepted may still land)."""
        self.unregister_all()
        self.local = None
        old, self.memory = self.memory, MemoryMap(self.settings.shm_dir)
        asyncio.get_running_loop().call_later(unmap_after, old.close)

    def totals(self) -> dict[str, int]:
        """Daemon-wide counters, with the inbound control pipeline's drops folded in."""
        inbound = self.control.stats
        out = dict(vars(self.counters))
        out["auth_failures"] += inbound.auth_failures
        out["protocol_errors"] += inbound.protocol_errors
        out["control_dropped"] = inbound.dropped
        out["control_penalized"] = inbound.penalized
        return out

    def _log_auth_once(self, key: str, exc: Exception) -> None:
        """Unauthenticated requests are logged once per kind (the sender is unknown: an
        unverified request's claims are not trusted), then only counted."""
        if key not in self._auth_logged and len(self._auth_logged) < 64:
            self._auth_logged.add(key)
            log.warning("refused request: %s (further ones only counted)", exc)

    async def http(self, method: str, url: str, *, params: Mapping[str, Any] | None = None,
                   json: Any = None, limit_s: float | None = None) -> httpx.Response:
        """An HTTP request to another kvd, signed for the instance serving ``url``
        (raises httpx errors)."""
        return await signed_http.request(self.http_client, self.auth, self.recipients, method,
                                         url, params=params, json=json,
                                         limit_s=limit_s or self.settings.http_timeout)
