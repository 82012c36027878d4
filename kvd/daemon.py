"""The kvd daemon lifecycle: startup -> serve -> drain -> shutdown, on one uvloop loop.

Startup opens, in order: the transfer engine, the ZMQ control socket, the
HTTP server (``/health``, and ``/route`` when serving bootstrap), and the
engine RPC socket; then prints one JSON "ready" line on stdout. Signals only
set a flag; shutdown closes the engine socket (unlinking it), stops HTTP,
cancels tasks, waits for in-flight writes, and unregisters memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from typing import Any

import httpx

from kvd import __version__, logs, notify
from kvd.addr import join_hostport
from kvd.bootstrap.app import create_app
from kvd.bootstrap.guard import is_loopback
from kvd.bootstrap.server import ConnectionGuard, HttpLimits, HttpServer, bind_socket
from kvd.bootstrap.table import BootstrapTable
from kvd.config import Settings, effective_transfer_host, read_secret
from kvd.control.inbound import Misaddressed
from kvd.control.peers import ControlPlane
from kvd.core import Core
from kvd.decode import DecodeSide
from kvd.engine_rpc.server import Connection, EngineRpcServer
from kvd.errors import ConfigError, RoomError
from kvd.memory import MemoryMap
from kvd.prefill import PrefillSide
from kvd.protocol import control, rpc
from kvd.rooms import UNKNOWN_ROOM, KVPoll
from kvd.security import Authenticator
from kvd.status import DaemonOps
from kvd.transfer.backends.base import TransferEngine
from kvd.transfer.backends.mooncake import MooncakeEngine
from kvd.transfer.executor import TransferExecutor
from kvd.transfer.faults import FaultInjector, FaultPlan

log = logging.getLogger("kvd")

SWEEP_INTERVAL = 0.1


class Daemon:
    """One kvd: serves one engine rank in ``settings.role``."""

    def __init__(self, settings: Settings, engine: TransferEngine | None = None) -> None:
        self.settings = settings
        self._engine = engine
        self.stop_event = asyncio.Event()
        self.started_at = time.time()
        self.table = BootstrapTable() if settings.serve_bootstrap else None
        self.core: Core | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.http_server: HttpServer | None = None
        self.bootstrap_server: HttpServer | None = None
        self.rpc_server: EngineRpcServer | None = None
        self.http_guard = ConnectionGuard(HttpLimits(
            settings.http_max_connections, settings.http_fd_reserve,
            settings.http_header_timeout))  # one budget for every HTTP listener
        self.draining = False
        self.engine_conn: int | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self) -> int:
        """Start, serve until a stop signal, shut down. Returns the exit code."""
        await self.startup()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        try:
            await self.stop_event.wait()
            notify.notify("STOPPING=1")
            await self.drain()
        finally:
            await self.shutdown()
        return 0

    async def startup(self) -> None:
        """Open every listener; raises ConfigError/TransportError if one cannot start."""
        s = self.settings
        auth = self._authenticator()  # before anything opens: no secret, no daemon
        engine = self._engine or self._make_engine()
        ctl = ControlPlane(auth, s.control_send_timeout, max_frame=s.max_frame_bytes)
        ctl.bind(s.host, s.zmq_port)
        http = httpx.AsyncClient(timeout=s.http_timeout,
                                 limits=httpx.Limits(max_keepalive_connections=32))
        executor = TransferExecutor(engine, s.transfer_threads, s.transfer_queue_size)
        self.core = Core(s, engine, executor, ctl,
                         MemoryMap(s.shm_dir), http, auth=auth,
                         faults=FaultPlan.model_validate_json(s.fault_injection)
                         if s.fault_injection else None)
        separate = s.serve_bootstrap and s.bootstrap_port is not None
        sock = bind_socket(s.http_host, s.http_port)
        app = create_app(self.health, None if separate else self.table, DaemonOps(self),
                         auth=auth, on_auth_failure=self._http_auth_failed,
                         loopback=is_loopback(s.http_host), body_timeout=s.http_body_timeout)
        self.http_server = HttpServer(app, sock, self.http_guard)
        await self.http_server.start()
        if separate:
            await self._start_bootstrap_listener(auth)
        elif s.serve_bootstrap and s.bootstrap_addr is None:
            s.bootstrap_addr = join_hostport(s.http_host, self.http_server.port)
        if s.role == "prefill":
            self.prefill = PrefillSide(self.core)
        else:
            self.decode = DecodeSide(self.core)
        self.rpc_server = EngineRpcServer(s.engine_socket, self.dispatch, s.max_frame_bytes,
                                          s.engine_socket_group)
        await self.rpc_server.start()
        self.core.spawn(self._recv_loop(), "control-recv")
        self.core.spawn(self._sweep_loop(), "sweeper")
        self.core.spawn(notify.watchdog_loop(), "watchdog")
        if self.decode is not None:
            self.core.spawn(self.decode.heartbeat_loop(), "heartbeats")
        self._announce()

    async def _start_bootstrap_listener(self, auth: Authenticator) -> None:
        """/route (and /health) on their own listener: bootstrap_host:bootstrap_port."""
        s = self.settings
        host = s.bootstrap_host or s.http_host
        app = create_app(self.health, self.table, None, auth=auth,
                         on_auth_failure=self._http_auth_failed, loopback=is_loopback(host),
                         body_timeout=s.http_body_timeout)
        self.bootstrap_server = HttpServer(app, bind_socket(host, s.bootstrap_port or 0),
                                           self.http_guard)
        await self.bootstrap_server.start()
        if s.bootstrap_addr is None:
            s.bootstrap_addr = join_hostport(host.strip("[]"), self.bootstrap_server.port)

    def _http_auth_failed(self, exc: Exception) -> None:
        if self.core is not None:
            self.core.counters.auth_failures += 1
            self.core._log_auth_once(f"http: {str(exc).split(' (')[0]}", exc)

    def _authenticator(self) -> Authenticator:
        """The cluster-secret authenticator; refuses to start without a secret unless
        ``insecure`` is set (then it warns)."""
        s = self.settings
        secret = read_secret(s)
        if secret is None and not s.insecure:
            raise ConfigError("no cluster secret: set KVD_CLUSTER_SECRET or cluster_secret_file "
                              "(or insecure = true to run without authentication)")
        if secret is None:
            log.warning("INSECURE: no cluster secret; bootstrap and control messages are NOT "
                        "authenticated (insecure = true)")
        return Authenticator(secret, s.instance_id, s.auth_max_skew)

    def _make_engine(self) -> MooncakeEngine:
        s, hook = self.settings, None
        if s.fault_injection:
            hook = FaultInjector(FaultPlan.model_validate_json(s.fault_injection))
            log.warning("FAULT INJECTION ACTIVE (testing only): %s", hook.plan)
        return MooncakeEngine(effective_transfer_host(s), s.max_batch_entries,
                              retry_budget=s.transient_retry_s,
                              submit_hook=hook)

    def _announce(self) -> None:
        assert self.core is not None and self.http_server is not None
        ready = {"event": "ready", "role": self.settings.role, "version": __version__,
                 "instance_id": self.settings.instance_id, "http_port": self.http_server.port,
                 "control_endpoint": self.core.control.endpoint,
                 "session_id": self.core.engine.session_id,
                 "engine_socket": str(self.settings.engine_socket),
                 "bootstrap_addr": self.settings.bootstrap_addr}
        print(json.dumps(ready), flush=True)
        log.info("kvd %s ready: %s", self.settings.role, ready)
        notify.notify(f"READY=1\nSTATUS=kvd {self.settings.role} on port {ready['http_port']}")

    def _rooms(self) -> dict[int, Any]:
        if self.prefill is not None:
            return self.prefill.rooms
        return self.decode.rooms if self.decode is not None else {}

    async def drain(self) -> None:
        """SIGTERM: refuse new rooms, let in-flight rooms finish for up to ``drain_timeout``
        s, fail the rest with a reason, and deregister from the bootstrap server."""
        core, s = self.core, self.settings
        if core is None:
            return
        self.draining = True
        log.info("draining: %d rooms in flight", self._unfinished())
        deadline = time.monotonic() + s.drain_timeout
        while self._unfinished() and time.monotonic() < deadline:
            await core.wait_changed(deadline - time.monotonic())
        for room in [k for k, r in self._rooms().items() if not r.state.done]:
            self._side_abort(room, "kvd shutting down")
        pending = [t for t in core.tasks if t.get_name().startswith(("status-", "abort-"))]
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        if self.prefill is not None and self.prefill.bootstrap_registered:
            await self.prefill.deregister_from_bootstrap()

    def _unfinished(self) -> int:
        return sum(1 for r in self._rooms().values() if not r.state.done)

    async def shutdown(self) -> None:
        """Close listeners, cancel tasks, wait for transfers, release memory."""
        core = self.core
        if self.rpc_server is not None:
            await self.rpc_server.stop()
        for server in (self.http_server, self.bootstrap_server):
            if server is not None:
                await server.stop()
        if core is None:
            return
        for task in list(core.tasks):
            task.cancel()
        await asyncio.gather(*core.tasks, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, core.executor.shutdown)
        await core.http_client.aclose()
        core.control.close()
        core.unregister_all()
        core.memory.close()
        log.info("kvd stopped")

    # ---- loops --------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self.core is not None
        async for msg in self.core.control.messages():  # bounded batches (case S02)
            self._on_control(msg)

    def _on_control(self, msg: control.ControlMessage | Misaddressed) -> None:
        if isinstance(msg, Misaddressed):  # sealed for a previous instance of this daemon
            if self.prefill is not None and isinstance(msg.message, control.RoomPages):
                self.prefill.on_misaddressed_pages(msg.message)
            return
        if self.prefill is not None:
            if isinstance(msg, control.RegisterRank):
                self.prefill.on_register_rank(msg)
            elif isinstance(msg, control.RoomPages):
                self.prefill.on_room_pages(msg)
            elif isinstance(msg, control.RoomAbort):
                self.prefill.on_room_abort(msg)
            else:
                log.warning("prefill kvd ignores %s", type(msg).__name__)
        elif self.decode is not None:
            if isinstance(msg, control.RoomStatus):
                self.decode.on_room_status(msg)
            elif isinstance(msg, control.RoomAbort):
                self.decode.on_room_abort(msg)
            else:
                log.warning("decode kvd ignores %s", type(msg).__name__)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            now = time.monotonic()
            if self.prefill is not None:
                self.prefill.sweep(now)
            if self.decode is not None:
                self.decode.sweep(now)

    # ---- engine RPC ---------------------------------------------------------------------

    async def dispatch(self, call: rpc.Call, conn: Connection) -> Any:
        """Run one engine call; kvd errors propagate to the RPC server as error replies."""
        assert self.core is not None
        match call:
            case rpc.RegisterKV():
                args = self.core.register_local(call)
                self.engine_conn = conn.id
                conn.on_close.append(lambda: self._engine_disconnected(conn.id))
                if self.decode is not None:
                    self.decode.registered.clear()  # new buffers: re-register with prefills
                if self.prefill is not None:
                    self.prefill.revalidate_peers()
                    if not self.prefill.bootstrap_registered:
                        self.core.spawn(self.prefill.register_with_bootstrap(), "bootstrap-put")
                return {"num_pages": args.num_pages, "num_aux_slots": args.num_aux_slots,
                        "session_id": self.core.engine.session_id}
            case rpc.Poll():
                return self._poll(call.rooms)
            case rpc.Wait():
                return await self._wait(call.rooms, call.timeout)
            case rpc.Info():
                return self.health()
            case rpc.Abort():
                self._side_abort(call.room, call.reason)
                return None
            case rpc.Clear():
                self._side_clear(call.room)
                return None
        if self.draining and isinstance(call, rpc.SenderCreate | rpc.ReceiverCreate):
            raise RoomError(f"room {call.room}: kvd is draining (shutting down); "
                            f"no new rooms")
        if self.prefill is not None:
            return self._prefill_call(self.prefill, call)
        assert self.decode is not None
        return self._decode_call(self.decode, call)

    def _prefill_call(self, side: PrefillSide, call: rpc.Call) -> Any:
        match call:
            case rpc.SenderCreate():
                side.create(call.room)
            case rpc.SenderInit():
                side.init(call.room, call.num_pages, call.aux_index)
            case rpc.SenderSend():
                side.send(call.room, call.pages, call.is_last)
            case _:
                raise RoomError(f"{type(call).__name__} is not available on a prefill kvd")
        return None

    def _decode_call(self, side: DecodeSide, call: rpc.Call) -> Any:
        match call:
            case rpc.ReceiverCreate():
                side.create(call.room, call.bootstrap_addr, call.dp_rank)
            case rpc.ReceiverInit():
                side.init(call.room, call.dst_pages, call.aux_index)
            case _:
                raise RoomError(f"{type(call).__name__} is not available on a decode kvd")
        return None

    def _poll(self, rooms: list[int]) -> dict[str, Any]:
        table: dict[int, Any] = (self.prefill.rooms if self.prefill is not None
                                 else self.decode.rooms if self.decode is not None else {})
        statuses, reasons, stats, releasable = [], {}, {}, []
        for room in rooms:
            r = table.get(room)
            if self.decode is None or self.decode.releasable(room):
                releasable.append(room)
            if r is None:
                statuses.append(UNKNOWN_ROOM)
                continue
            statuses.append(int(r.state.status))
            if r.state.status == KVPoll.Failed:
                reasons[room] = r.state.reason
            if self.prefill is not None and (st := self.prefill.stats(room)) is not None:
                stats[room] = st
        return {"statuses": statuses, "reasons": reasons, "stats": stats,
                "releasable": releasable}

    async def _wait(self, rooms: list[int], seconds: float) -> dict[str, Any]:
        assert self.core is not None
        deadline = time.monotonic() + min(max(seconds, 0.0), 3600.0)
        while True:
            result = self._poll(rooms)
            releasable = set(result["releasable"])
            pending = [room for room, s in zip(rooms, result["statuses"], strict=True)
                       if s not in (UNKNOWN_ROOM, KVPoll.Success, KVPoll.Failed)
                       or room not in releasable]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                return result
            await self.core.wait_changed(remaining)

    def _side_abort(self, room: int, reason: str) -> None:
        if self.prefill is not None:
            self.prefill.abort(room, reason)
        if self.decode is not None:
            self.decode.abort(room, reason)

    def _engine_disconnected(self, conn_id: int) -> None:
        """The engine that registered KV buffers went away: fail its rooms and release its
        memory before anything could write into it (sync callback from the RPC server)."""
        if self.core is None or conn_id != self.engine_conn or self.core.local is None:
            return
        self.engine_conn = None
        log.warning("engine disconnected: failing %d rooms and unregistering its memory",
                    self._unfinished())
        for room in list(self._rooms()):
            self._side_abort(room, "engine disconnected")
        self.core.spawn(self._release_engine(), "release-engine")

    async def _release_engine(self) -> None:
        assert self.core is not None
        if self.prefill is not None:  # our own writes read this memory: let them return
            pumps = [r.pump for r in self.prefill.rooms.values() if r.pump and not r.pump.done()]
            if pumps:
                await asyncio.wait(pumps)
            self.prefill.rooms.clear()
        else:
            assert self.decode is not None
            self.decode.rooms.clear()
        self.core.release_local(self.settings.release_timeout)

    def _side_clear(self, room: int) -> None:
        if self.prefill is not None:
            self.prefill.clear(room)
        if self.decode is not None:
            self.decode.clear(room)

    # ---- status -------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Liveness JSON: role, instance id, uptime (s), room counts, totals."""
        core = self.core
        rooms = (self.prefill.rooms if self.prefill else self.decode.rooms if self.decode
                 else {})
        by_state: dict[str, int] = {}
        for r in rooms.values():
            by_state[r.state.status.name] = by_state.get(r.state.status.name, 0) + 1
        return {"status": "ok", "role": self.settings.role,
                "instance_id": self.settings.instance_id,
                "uptime_s": round(time.time() - self.started_at, 3),
                "engine_registered": bool(core and core.local),
                "draining": self.draining,
                "bootstrap_epoch": self.table.epoch if self.table is not None else None,
                "tables": self.table_sizes(),
                "rooms": by_state,
                "counters": core.totals() if core else {}}


    def table_sizes(self) -> dict[str, int]:
        """Sizes of every per-room and per-peer table (leak checks)."""
        core = self.core
        sizes = {"tasks": len(core.tasks) if core else 0,
                 "control_sockets": len(core.control._push) if core else 0}
        if self.prefill is not None:
            sizes |= {"rooms": len(self.prefill.rooms), "pending": len(self.prefill.pending),
                      "peers": len(self.prefill.peers)}
        if self.decode is not None:
            sizes |= {"rooms": len(self.decode.rooms), "registered": len(self.decode.registered),
                      "health": len(self.decode.health),
                      "rank_cache": len(self.decode.bootstrap.ranks)}
        return sizes


def serve(settings: Settings) -> int:
    """Run a daemon on a fresh uvloop loop until SIGTERM/SIGINT; returns the exit code."""
    import uvloop

    logs.setup(settings.log_level, settings.log_format)
    return uvloop.run(Daemon(settings).run())
