"""The kvd daemon lifecycle: startup -> serve -> drain -> shutdown, on one uvloop loop.

Startup opens, in order: the transfer engine, the ZMQ control socket, the
HTTP server (``/health``, and ``/route`` when serving bootstrap), and the
engine RPC socket; then prints one JSON "ready" line on stdout. Signals only
set a flag; shutdown closes the engine socket (unlinking it), stops HTTP,
cancels tasks, waits for in-flight writes, and unregisters memory.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import stat
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI

from kvd import __version__, logs, notify
from kvd.addr import join_hostport
from kvd.bootstrap.app import create_app
from kvd.bootstrap.guard import is_loopback
from kvd.bootstrap.server import ConnectionGuard, HttpLimits, HttpServer, bind_socket
from kvd.bootstrap.table import BootstrapTable
from kvd.config import Settings, read_secret
from kvd.control.inbound import Misaddressed
from kvd.control.peers import ControlPlane
from kvd.daemon.core import Core, http_client
from kvd.daemon.side import Side, make_side
from kvd.daemon.status import DaemonOps
from kvd.engine_rpc.channel import TableWriter
from kvd.engine_rpc.ring import Backlog, RingChannel
from kvd.engine_rpc.server import LATER, Connection, EngineRpcServer
from kvd.errors import ConfigError, KvdError, ProtocolError, RegistrationError, RoomError, RpcError
from kvd.launch import LIFELINE_ENV
from kvd.memory import Importer
from kvd.protocol import control, rpc
from kvd.protocol.release import ReleaseAnswer, ReleaseRequest
from kvd.ranks import PAIRS, Ranks, resolve
from kvd.rooms.state import FailureKind, RoomFailure
from kvd.security import Authenticator
from kvd.transfer.backends import make_engine
from kvd.transfer.backends.base import TransferEngine
from kvd.transfer.executor import TransferExecutor
from kvd.transfer.faults import FaultInjector, FaultPlan

log = logging.getLogger("kvd")

SWEEP_INTERVAL = 0.1
#: Seconds between two sweeps' checks that the engine's memory still stands (S16).
MEMORY_CHECK_INTERVAL = 1.0


def _wall_clock(offset_s: float) -> Callable[[], float]:
    """The wall clock seals are dated by: the host's, or ``offset_s`` off it (a test knob)."""
    if not offset_s:
        return time.time
    return lambda: time.time() + offset_s


class Daemon:
    """One kvd: serves one engine rank in ``settings.role``.

    ``engine``, ``control``, ``http_client`` and ``clock`` replace the real transfer
    engine, ZMQ control plane, HTTP client and monotonic clock (the in-process test
    tier passes fakes); ``startup(listen=False)`` opens no HTTP or engine socket;
    ``sweep_interval`` None leaves deadlines to explicit ``side.tick()`` calls.
    """

    def __init__(self, settings: Settings, engine: TransferEngine | None = None,
                 control: ControlPlane | None = None,
                 http_client: httpx.AsyncClient | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sweep_interval: float | None = SWEEP_INTERVAL) -> None:
        self.settings = settings
        self._engine = engine
        self._control = control
        self._http_client = http_client
        self.clock = clock
        self.sweep_interval = sweep_interval
        self.stop_event = asyncio.Event()
        self.started_at = time.time()
        self.table = BootstrapTable() if settings.serve_bootstrap else None
        self.core: Core | None = None
        self.side: Side | None = None
        self.ops: DaemonOps | None = None
        self.http_server: HttpServer | None = None
        self.bootstrap_server: HttpServer | None = None
        self.rpc_server: EngineRpcServer | None = None
        self.http_guard = ConnectionGuard(HttpLimits(
            settings.http_max_connections, settings.http_fd_reserve,
            settings.http_header_timeout))  # one budget for every HTTP listener
        self.draining = False
        self.engine_conn: int | None = None
        self.engine_id = ""
        self._registered_call: rpc.RegisterKV | None = None
        self._release: asyncio.TimerHandle | None = None
        self._releasing: asyncio.Task[None] | None = None
        self._stopped = False
        self.dropped = ""  # why the engine's registration was dropped (S16); "" if not
        self._memory_checked = 0.0
        self.status_table: TableWriter | None = None  # the engine channel's (issue 21)
        self.rings: dict[int, RingChannel] = {}  # engine connection id -> its rings
        #: rings of the engine's connections that dropped, run before its later calls
        self.backlog = Backlog()

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self) -> int:
        """Start, serve until a stop signal, shut down. Returns the exit code."""
        await self.startup()
        # What start-up made (modules, the web app, the native library's wrappers) lives
        # as long as the daemon: keep it out of the cyclic collector's full passes, which
        # scanned it all again each time and held the loop 130-175 ms while thousands of
        # rooms failed (K41).
        gc.freeze()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        self._watch_lifeline(loop)
        try:
            await self.stop_event.wait()
            notify.notify("STOPPING=1")
            await self.drain()
        finally:
            await self.shutdown()
        return 0

    def _watch_lifeline(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop as at SIGTERM once the launcher's lifeline reads end of file (its launcher
        died without stopping this daemon: :data:`kvd.launch.LIFELINE_ENV`). The variable
        is taken out of the environment, so nothing this daemon starts inherits it. A
        value that names no pipe is logged and ignored: the daemon runs as without one."""
        value = os.environ.pop(LIFELINE_ENV, "")
        if not value:
            return
        try:
            fd = int(value)
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise OSError(f"descriptor {fd} is no pipe")
        except (ValueError, OSError) as exc:
            log.warning("%s=%r ignored: %s", LIFELINE_ENV, value, exc)
            return

        def readable() -> None:
            try:
                data = os.read(fd, 4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every write end closed: the launcher is gone
                loop.remove_reader(fd)
                os.close(fd)
                log.warning("the process that launched this daemon is gone (its lifeline "
                            "closed): stopping")
                self.stop_event.set()

        os.set_blocking(fd, False)
        loop.add_reader(fd, readable)

    async def startup(self, listen: bool = True) -> None:
        """Open every listener; raises ConfigError/TransportError if one cannot start."""
        s = self.settings
        auth = self._authenticator()  # before anything opens: no secret, no daemon
        engine = self._engine or self._make_engine()
        ctl = self._control or ControlPlane(auth, s.control_send_timeout,
                                            max_frame=s.max_frame_bytes)
        ctl.auth = auth  # an injected control plane seals and opens as this daemon too
        if not ctl.endpoint:
            ctl.bind(s.host, s.zmq_port)
        http = self._http_client or http_client(s)
        executor = TransferExecutor(engine, s.transfer_threads, s.transfer_queue_size)
        self.core = Core(s, engine, executor, ctl,
                         Importer(s.shm_dir), http, auth=auth,
                         faults=FaultPlan.model_validate_json(s.fault_injection)
                         if s.fault_injection else None, clock=self.clock)
        self.side = make_side(s.role, self.core)
        self.core.on_memory_lost = self.drop_registration
        if s.engine_channel:
            self.status_table = TableWriter(self.side.poll, s.status_table_slots,
                                            changed=self.side.take_changed)
            self.core.on_change = self.status_table.touch
        if s.transfer_backend != "mooncake":
            self._peer_channel(auth, engine)
        self.ops = DaemonOps(self)
        if listen:
            await self._listen(auth)
        self.core.spawn(self._recv_loop(), "control-recv")
        if self.sweep_interval is not None:
            self.core.spawn(self._sweep_loop(self.sweep_interval), "sweeper")
        if listen:
            self.core.spawn(notify.watchdog_loop(), "watchdog")
        self.side.start()
        if listen:
            self._announce()

    async def _listen(self, auth: Authenticator) -> None:
        """The REST listener (and a separate bootstrap one), then the engine socket."""
        s = self.settings
        assert self.ops is not None
        separate = s.serve_bootstrap and s.bootstrap_port is not None
        sock = bind_socket(s.http_host, s.http_port)
        self.http_server = HttpServer(self.app(with_route=not separate), sock, self.http_guard)
        await self.http_server.start()
        if separate:
            await self._start_bootstrap_listener(auth)
        elif s.serve_bootstrap and s.bootstrap_addr is None:
            s.bootstrap_addr = join_hostport(s.http_host, self.http_server.port)
        self.rpc_server = EngineRpcServer(s.engine_socket, self.dispatch, s.max_frame_bytes,
                                          s.engine_socket_group, self.dispatch_now)
        await self.rpc_server.start()

    def app(self, with_route: bool = True) -> FastAPI:
        """The REST app: /health, the operations API, and /route when serving bootstrap."""
        assert self.core is not None and self.ops is not None
        s = self.settings
        return create_app(self.health, self.table if with_route else None, self.ops,
                          auth=self.core.auth, on_auth_failure=self._http_auth_failed,
                          docs=s.http_docs, loopback=is_loopback(s.http_host),
                          body_timeout=s.http_body_timeout, release=self.release_rooms)

    async def _start_bootstrap_listener(self, auth: Authenticator) -> None:
        """/route (and /health) on their own listener: bootstrap_host:bootstrap_port."""
        s = self.settings
        host = s.bootstrap_host or s.http_host
        app = create_app(self.health, self.table, None, auth=auth,
                         on_auth_failure=self._http_auth_failed, loopback=is_loopback(host),
                         body_timeout=s.http_body_timeout, release=self.release_rooms)
        self.bootstrap_server = HttpServer(app, bind_socket(host, s.bootstrap_port or 0),
                                           self.http_guard)
        await self.bootstrap_server.start()
        if s.bootstrap_addr is None:
            s.bootstrap_addr = join_hostport(host.strip("[]"), self.bootstrap_server.port)

    def release_rooms(self, req: ReleaseRequest) -> ReleaseAnswer:
        """``POST /v1/rooms/release`` (K45/K46): the side's answer. The status table is
        re-published before the answer goes out, so an engine reading it after the
        opener heard ``released`` sees the room Failed (as after its own room call)."""
        assert self.side is not None
        answer = self.side.release(req)
        if self.status_table is not None:
            self.status_table.flush()
        return answer

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
        if s.test_clock_offset:
            log.warning("TEST CLOCK ACTIVE (testing only): this daemon's wall clock is "
                        "%+.1fs off the host's", s.test_clock_offset)
        return Authenticator(secret, s.instance_id, s.auth_max_skew,
                             clock=_wall_clock(s.test_clock_offset))

    def _peer_channel(self, auth: Authenticator, engine: TransferEngine) -> None:
        """The same-host peer channel (case S18): a decode serves its pool's descriptors
        there; a prefill's local backend fetches a decode's pool only from it."""
        from kvd.transfer.backends.choice import AutoEngine
        from kvd.transfer.backends.local import Channel
        from kvd.transfer.backends.peerchannel import ChannelServer, Claim, Identity

        assert self.core is not None
        s, core = self.settings, self.core
        uids = frozenset({os.geteuid()} | ({s.peer_channel_uid} if s.peer_channel_uid
                                              is not None else set()))
        me = Identity(s.instance_id, uids, auth.channel_mac)
        if s.role == "prefill" and isinstance(engine, AutoEngine):
            engine.local.channel = Channel(s.peer_channel_dir, me,
                                           own_files=lambda: set(core.memory.host.files))
        elif s.role == "decode":
            mine = Claim(s.instance_id, core.control.endpoint, engine.session_id)
            server = ChannelServer(s.peer_channel_dir, me, mine, core.export_snapshot)
            try:
                server.open()
            except (OSError, KvdError) as exc:
                if s.transfer_backend == "local":
                    raise ConfigError(f"peer channel in {s.peer_channel_dir}: {exc}") from exc
                log.warning("peer channel in %s: %s; same-host prefills copy through "
                            "mooncake (no pool exported)", s.peer_channel_dir, exc)
                return
            core.peer_channel = server.name
            core.spawn(server.run(), "peer-channel")

    def _make_engine(self) -> TransferEngine:
        s, hook = self.settings, None
        if s.fault_injection:
            hook = FaultInjector(FaultPlan.model_validate_json(s.fault_injection))
            log.warning("FAULT INJECTION ACTIVE (testing only): %s", hook.plan)
        return make_engine(s, hook)

    def _announce(self) -> None:
        assert self.core is not None and self.http_server is not None
        ready = {"event": "ready", "role": self.settings.role, "version": __version__,
                 "instance_id": self.settings.instance_id, "http_port": self.http_server.port,
                 "control_endpoint": self.core.control.endpoint,
                 "session_id": self.core.engine.session_id,
                 "engine_socket": str(self.settings.engine_socket),
                 "bootstrap_addr": self.settings.bootstrap_addr}
        print(json.dumps(ready), flush=True)
        log.info("kvd %s ready", self.settings.role, extra=logs.fields(**ready))
        notify.notify(f"READY=1\nSTATUS=kvd {self.settings.role} on port {ready['http_port']}")

    async def drain(self) -> None:
        """SIGTERM: refuse new rooms, let in-flight rooms finish for up to ``drain_timeout``
        s, fail the rest with a reason, and deregister from the bootstrap server."""
        core, side, s = self.core, self.side, self.settings
        if core is None or side is None:
            return
        self.draining = True
        log.info("draining: %d rooms in flight", len(side.unfinished()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.drain_timeout
        while side.unfinished() and loop.time() < deadline:
            await core.wait_changed(deadline - loop.time())
        for room in side.unfinished():
            side.abort(room, "kvd shutting down")
        pending = [t for t in core.tasks if t.get_name().startswith("outbox-")]
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        await side.drain_done()

    async def shutdown(self) -> None:
        """Close listeners, cancel tasks, wait for transfers, release memory (once)."""
        core = self.core
        if self._stopped:
            return
        self._stopped = True
        if self.rpc_server is not None:
            await self.rpc_server.stop()
        for server in (self.http_server, self.bootstrap_server):
            if server is not None:
                await server.stop()
        if core is None:
            return
        while core.tasks:  # a cancelled task may spawn a last one (a failure report)
            for task in list(core.tasks):
                task.cancel()
            await asyncio.gather(*core.tasks, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, core.executor.shutdown)
        if self._http_client is None:
            await core.http_client.aclose()
        core.control.close()
        core.unregister_all()
        core.memory.close()
        for ring in list(self.rings.values()):
            ring.close()
        self.rings.clear()
        self.backlog.close()
        if self.status_table is not None:
            self.status_table.close()
            self.status_table = None
        log.info("kvd stopped")

    # ---- loops --------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self.core is not None and self.side is not None
        async for msg in self.core.control.messages():  # bounded batches (case S02)
            if isinstance(msg, Misaddressed):
                # Sealed for a previous instance of this daemon, or outside its freshness
                # window: never acted on; its sender is told (rate-limited, never larger
                # than the frame), so it re-resolves or names the skew at once (S09, K40).
                self._refuse(msg)
                continue
            self.core.events.peer_message(msg.endpoint)  # (bounded: names are authentic)
            with logs.log_context(**logs.message_context(msg)):
                try:
                    self.side.on_control(msg)
                    self.core.on_change()
                except Exception:  # a bug must not stop the control plane (K31)
                    self.core.counters.loop_errors += 1
                    log.exception("control message %s failed", type(msg).__name__)

    def _refuse(self, m: Misaddressed) -> None:
        assert self.core is not None and self.side is not None
        if m.why == "clock_skew" and not isinstance(m.message, control.Refused):
            # this daemon can tell as well as the sender: the rooms bound to it end now
            msg = m.message
            self.side.peer_refused(msg.endpoint, msg.instance_id, m.why, m.offset_s,
                                   self.settings.auth_max_skew)
        self.core.refuse(m)

    async def _sweep_loop(self, interval: float) -> None:
        assert self.core is not None and self.side is not None
        while True:
            await asyncio.sleep(interval)
            try:
                self.sweep()
            except Exception:
                self.core.counters.loop_errors += 1
                log.exception("sweep failed (the loop goes on)")

    def sweep(self) -> None:
        """One sweep: the engine's memory (at most every ``MEMORY_CHECK_INTERVAL`` s), the
        side's deadlines, the engine rings drained (a bound on a lost wake-up), then the
        status table re-published."""
        assert self.side is not None and self.core is not None
        now = self.clock()
        if now - self._memory_checked >= MEMORY_CHECK_INTERVAL:
            self._memory_checked = now
            self.core.check_memory()
        self.side.tick()
        for ring in list(self.rings.values()):
            ring.drain()
        if self.status_table is not None:
            self.status_table.sweep()

    # ---- engine RPC ---------------------------------------------------------------------

    async def dispatch(self, call: rpc.Call, conn: Connection) -> Any:
        """Run one engine call; kvd errors propagate to the RPC server as error replies.
        The engine's calls run after the records of its connections that dropped
        (:class:`~kvd.engine_rpc.ring.Backlog`), then after its connection's ring."""
        assert self.core is not None and self.side is not None
        await self._in_order(call, conn)
        self._ring_first(conn)
        match call:
            case rpc.RegisterKV():
                return await self._register(call, conn)
            case rpc.Wait():
                return await self.side.wait(call.rooms, call.timeout, call.any_done)
            case rpc.Release():
                if conn.id == self.engine_conn:
                    self.engine_conn = None
                    await self._release_now()
                return None
        return self.run_now(call, conn)

    async def _in_order(self, call: rpc.Call, conn: Connection) -> None:
        """Return once ``call`` may run (and then run it without awaiting first): no
        dropped connection's ring holds records (:class:`~kvd.engine_rpc.ring.Backlog`;
        ``Info`` excepted), and at most BATCH records of its own connection's ring are
        left, which :meth:`run_now` runs first (the rest ran a batch a loop turn, K41)."""
        while True:
            if not isinstance(call, rpc.Info):
                await self.backlog.settled()
            ring = self.rings.get(conn.id)
            if ring is not None and ring.behind():
                await ring.caught_up()
                continue
            if isinstance(call, rpc.Info) or not self.backlog.rings:
                return

    def dispatch_now(self, call: rpc.Call, conn: Connection) -> Any:
        """The calls answered without awaiting (the RPC server's fast path); returns
        :data:`~kvd.engine_rpc.server.LATER` for the others (:meth:`dispatch`), for
        every engine call while records of a dropped connection's ring wait
        (:meth:`~kvd.engine_rpc.ring.Backlog.holds`), and for any call of a connection
        whose ring holds more than a batch of records (:meth:`dispatch` runs it after
        them, :meth:`_in_order`)."""
        if self.backlog.rings and self.backlog.holds(call):
            return LATER
        if self.rings:
            ring = self.rings.get(conn.id)
            if ring is not None and ring.behind():
                return LATER  # its records first, a batch a loop turn (K41)
        return self.run_now(call, conn)

    def run_now(self, call: rpc.Call, conn: Connection) -> Any:
        """:meth:`dispatch_now` past the backlog. The connection's submission ring is
        drained first: the engine's calls run in the order it made them, over the ring or
        the socket. The ring's records run through here too (one handler for both
        paths)."""
        assert self.core is not None and self.side is not None
        self._ring_first(conn)
        side = self.side
        match call:
            case rpc.RegisterKV() | rpc.Wait() | rpc.Release():
                return LATER
            case rpc.Poll():
                return side.poll(call.rooms)
            case rpc.Info():
                return self.health()
            case rpc.Many():
                return self._many(call, conn)
            case rpc.OpenTable():
                return self._open_table(conn)
            case rpc.OpenRing():
                return self._open_ring(call, conn)
        try:
            return self._room_call(call)
        finally:  # a refused call may have changed the room too (RoomError.effects)
            if self.status_table is not None:
                self.status_table.track(call.room)

    def _room_call(self, call: rpc.Call) -> Any:
        """An engine call on one room (create, init, send, abort, clear)."""
        assert self.side is not None
        side = self.side
        match call:
            case rpc.Abort():
                side.abort(call.room, call.reason, call.bootstrap_addr, call.dp_rank)
                return None
            case rpc.Clear():
                side.clear(call.room)
                for ring in self.rings.values():  # whichever way it went: a room of the
                    ring.cleared(call.room)  # id made later is not the rings' to abort
                return None
        if self.draining and isinstance(call, rpc.SenderCreate | rpc.ReceiverCreate):
            raise RoomError(f"room {call.room}: kvd is draining (shutting down); "
                            f"no new rooms")
        if self.dropped and isinstance(call, rpc.SenderCreate | rpc.ReceiverCreate):
            raise RegistrationError(f"room {call.room}: this engine's registration was "
                                    f"dropped ({self.dropped}): register the KV pool again")
        return side.call(call)

    def _open_table(self, conn: Connection) -> rpc.TableResult:
        """The status table's memfd rides with the reply (``conn.reply_fds``)."""
        if self.status_table is None:
            raise RpcError("this kvd runs with engine_channel off: poll over the socket",
                           "RpcError")
        conn.reply_fds = [self.status_table.fd]
        return rpc.TableResult(nslots=self.status_table.nslots, size=self.status_table.size)

    def _ring_first(self, conn: Connection) -> None:
        if self.rings:
            ring = self.rings.get(conn.id)
            if ring is not None:
                ring.catch_up()

    def _open_ring(self, call: rpc.OpenRing, conn: Connection) -> rpc.RingResult:
        """The connection's submission and completion rings (issue 21 step B): their memfd
        and both eventfds ride with the reply. Refused (RpcError) with the channel off,
        on a connection that did not register the engine, or a second time on one
        connection; ProtocolError for sizes out of bounds."""
        if not self.settings.engine_channel:
            raise RpcError("this kvd runs with engine_channel off: room calls go over the "
                           "socket", "RpcError")
        if conn.id != self.engine_conn:
            raise RpcError("a ring is opened by the connection that registered the engine, "
                           "after its registration", "RpcError")
        if conn.id in self.rings:
            raise RpcError("this connection has its ring already", "RpcError")
        side = self.side
        assert side is not None
        ring = RingChannel(call.capacity, call.record_bytes,
                           lambda c: self.run_now(c, conn), self._ring_failed,
                           lambda room: side.view(room) is not None)
        self.rings[conn.id] = ring
        conn.on_close.append(lambda: self._drop_ring(conn.id))
        ring.start()
        conn.reply_fds = ring.fds
        return ring.result()

    def _drop_ring(self, conn_id: int) -> None:
        """The connection dropped or registered again: its ring's published records run
        in slices, before any later call of the engine (their refusals fail their rooms),
        then the ring closes (:class:`~kvd.engine_rpc.ring.Backlog`)."""
        ring = self.rings.pop(conn_id, None)
        if ring is not None:
            self.backlog.add(ring)

    def _ring_failed(self, rooms: set[int], reason: str) -> None:
        """A connection's ring failed (corrupt or hostile): abort the rooms it carried, so
        the engine sees them Failed instead of waiting on calls kvd never ran."""
        assert self.side is not None
        for room in sorted(rooms):
            try:
                self.side.abort(room, f"engine ring failed: {reason}")
            except KvdError:
                continue
            finally:
                if self.status_table is not None:
                    self.status_table.track(room)

    def _many(self, many: rpc.Many, conn: Connection) -> rpc.ManyResult:
        """Each call of ``many`` in order, as :meth:`dispatch_now` answers it alone; a
        failed one becomes its own failed outcome (issue 14: one round trip, many rooms)."""
        if len(many.calls) > rpc.MAX_MANY:
            raise ProtocolError(f"Many carries {len(many.calls)} calls, at most "
                                f"{rpc.MAX_MANY}")
        if many.polled() > rpc.MAX_MANY_POLLED:
            raise ProtocolError(f"Many polls {many.polled()} rooms, at most "
                                f"{rpc.MAX_MANY_POLLED} (poll more alone)")
        outcomes = []
        for call in many.calls:
            try:
                with logs.log_context(**logs.message_context(call)):
                    outcomes.append(rpc.Outcome(ok=True, result=self.run_now(call, conn)))
            except Exception as exc:
                if not isinstance(exc, KvdError):
                    log.exception("engine call %s failed", type(call).__name__)
                kind, error = rpc.failure(exc)
                outcomes.append(rpc.Outcome(ok=False, error=error, kind=kind))
        return rpc.ManyResult(outcomes=outcomes)

    async def _register(self, call: rpc.RegisterKV, conn: Connection) -> rpc.RegisterResult:
        """The engine's KV pool. The same engine (``engine_id``, same buffers)
        reconnecting within ``engine_reconnect_grace`` keeps its registration and
        rooms (K27). Raises RegistrationError while another engine is connected."""
        core, side = self.core, self.side
        assert core is not None and side is not None
        if core.local is not None and call.engine_id and call.engine_id == self.engine_id \
                and call == self._registered_call and self._releasing is None:
            self._attach(conn)
            log.info("engine %s reconnected: registration and rooms kept", call.engine_id)
        else:
            if core.local is not None and self.engine_conn is not None:
                raise RegistrationError("an engine is already registered with this kvd")
            ranks = self._engine_ranks(call)
            if core.local is not None or self._releasing is not None:
                await self._release_now()  # an engine that left, in its grace period
            args = core.register_local(call, conn.fds, conn.uid)
            self.dropped = ""
            core.ranks = ranks
            self.engine_id, self._registered_call = call.engine_id, call
            self._attach(conn)
            side.engine_registered(args)
        await self.backlog.settled()  # rings _attach dropped: the engine's calls before
        local = core.local
        assert local is not None
        return rpc.RegisterResult(num_pages=local.num_pages, num_aux_slots=local.num_aux_slots,
                                  session_id=core.engine.session_id,
                                  instance_id=self.settings.instance_id)

    def _engine_ranks(self, call: rpc.RegisterKV) -> Ranks:
        """The engine's ranks checked against the settings (unset ones taken from the
        engine). A daemon keeps the ranks of its first engine for its whole life: peers
        and the bootstrap server know it under them. Raises RegistrationError."""
        names = [n for pair in PAIRS for n in pair]
        ranks = resolve({n: getattr(self.settings, n) for n in names}, call.ranks)
        first = self.core.ranks if self.core is not None else None
        if first is not None and ranks != first:
            raise RegistrationError(f"this kvd serves {first.describe()} (from its first "
                                    f"engine); the engine says {ranks.describe()}: restart "
                                    f"kvd to serve another rank")
        if self.core is not None and self.core.ranks is None:
            log.info("engine ranks: %s", ranks.describe())
        return ranks

    def _attach(self, conn: Connection) -> None:
        if self._release is not None:
            self._release.cancel()
            self._release = None
        self.engine_conn = conn.id
        # a ring serves one registration: the engine asks anew. A registration's ring on
        # another connection (a reconnect read before kvd noticed the old connection end,
        # K27) runs what it holds before this registration answers and before any later
        # call of the engine (the backlog): the engine made those calls first
        for conn_id in list(self.rings):
            self._drop_ring(conn_id)
        conn.on_close.append(lambda: self._engine_disconnected(conn.id))

    def _engine_disconnected(self, conn_id: int) -> None:
        """The engine's connection dropped: keep its rooms for the reconnect grace period,
        then fail them and release its memory (sync callback from the RPC server)."""
        if self.core is None or conn_id != self.engine_conn or self.core.local is None:
            return
        self.engine_conn = None
        grace = self.settings.engine_reconnect_grace if self.engine_id else 0.0
        core = self.core
        if grace > 0:
            log.info("engine connection dropped: waiting %.1fs for it to reconnect", grace)
            self._release = asyncio.get_running_loop().call_later(
                grace, lambda: core.spawn(self._release_now(), "release-engine"))
        else:
            core.spawn(self._release_now(), "release-engine")

    def drop_registration(self, reason: str) -> None:
        """The engine's memory no longer stands (``reason``: which buffer, its file's size
        and the buffer's end; case S16). The registration ends as when the engine goes
        (K44's rule, :meth:`_release_now`), but every room fails with kind ``layout`` and
        the reason at once, no reconnect keeps it, and the engine's next room call is
        refused naming it until it registers again. One error line; the daemon serves on."""
        core, side = self.core, self.side
        if core is None or side is None or core.local is None or self.dropped:
            return
        self.dropped = reason
        log.error("the engine's memory changed under kvd: %s; dropping its registration "
                  "(%d rooms fail, kind layout) until it registers again", reason,
                  len(side.unfinished()))
        failure = RoomFailure(FailureKind.LAYOUT, f"the engine's memory changed under kvd "
                              f"({reason}): its registration was dropped", side.role)
        side.engine_lost(failure)
        # no reconnect keeps it, and the same connection may register again
        self._registered_call, self.engine_id, self.engine_conn = None, "", None
        core.spawn(self._release_now(failure), "drop-registration")

    async def _release_now(self, failure: RoomFailure | None = None) -> None:
        """Fail the engine's rooms (aborted, or with ``failure``), wait until nothing reads
        its memory, release it. Concurrent callers share one release."""
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if self._releasing is None:
            if self.core is None or self.side is None or self.core.local is None:
                return
            self._releasing = asyncio.ensure_future(self._release_engine(self.core, self.side,
                                                                         failure))
        try:
            await asyncio.shield(self._releasing)
        finally:
            if self._releasing is not None and self._releasing.done():
                self._releasing = None

    async def _release_engine(self, core: Core, side: Side,
                              failure: RoomFailure | None = None) -> None:
        await self.backlog.settled()  # what the engine handed over before it went runs first
        if failure is None:
            log.warning("engine disconnected: failing %d rooms and unregistering its memory",
                        len(side.unfinished()))
        self._registered_call, self.engine_id = None, ""
        await side.engine_released(failure)
        core.release_local(self.settings.release_timeout)

    # ---- status -------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Liveness JSON: role, instance id, uptime (s), wall clock (``clock_s``, s since the
        epoch, as seals are dated), room counts, totals."""
        core, side = self.core, self.side
        by_state, tables = side.summary() if side is not None else ({}, {})
        return {"status": "ok", "role": self.settings.role,
                "instance_id": self.settings.instance_id,
                "uptime_s": round(time.time() - self.started_at, 3),
                # the wall clock seals are dated by: a decode measures its offset (K40)
                "clock_s": round(core.auth.clock() if core else time.time(), 3),
                "engine_registered": bool(core and core.local),
                "draining": self.draining,
                "bootstrap_epoch": self.table.epoch if self.table is not None else None,
                "tables": self.table_sizes(tables),
                "rooms": {k: v for k, v in by_state.items() if v},
                "counters": core.totals() if core else {}}

    def table_sizes(self, side_tables: dict[str, int] | None = None) -> dict[str, int]:
        """Sizes of every per-room and per-peer table (leak checks); ``side_tables``: the
        side's, when the caller has them already."""
        core, side = self.core, self.side
        sizes = {"tasks": len(core.tasks) if core else 0,
                 "control_sockets": len(core.control._push) if core else 0,
                 "outboxes": len(core.outboxes) if core else 0}
        if side_tables is None and side is not None:
            side_tables = side.summary()[1]
        return sizes | (side_tables or {})


def serve(settings: Settings) -> int:
    """Run a daemon on a fresh uvloop loop until SIGTERM/SIGINT; returns the exit code."""
    import uvloop

    logs.setup(settings.log_level, settings.log_format, capture_native=True)
    return uvloop.run(Daemon(settings).run())
