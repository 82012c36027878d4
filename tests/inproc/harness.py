"""Tier 2: kvd daemons on one event loop over fakes.

Every daemon is a real :class:`kvd.daemon.Daemon` (real sides, room machines,
planner, executor and authentication) with its outside world replaced:

* the transfer backend is :class:`kvd.transfer.backends.fake.FakeEngine`
  (bytes really move between in-process shared-memory pools, bounds checked;
  writes can be held or refused per destination);
* the control plane is a :class:`Bus` of in-memory queues (peers can be frozen,
  killed or cut off);
* HTTP (bootstrap lookups, registration, heartbeats) goes through
  :class:`Router`, an httpx transport that calls each daemon's ASGI app
  directly (addresses can be made unreachable or hung);
* time is a :class:`FakeClock` the test advances; deadlines run when the test
  calls :meth:`Node.tick` (there is no sweep loop) and heartbeats when it calls
  :meth:`Node.heartbeat` (the heartbeat loop's period is an hour).

Engine calls go straight to :meth:`Daemon.dispatch`. Nothing sleeps except
:func:`settle`, which polls until the daemons are idle within a generous bound.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
from pydantic import SecretStr

from kvd.addr import join_hostport
from kvd.config import Settings
from kvd.control.inbound import Admission, InboundStats, Misaddressed, Received
from kvd.control.peers import Addressing, PeerSendError
from kvd.daemon import Daemon
from kvd.engine_rpc.server import Connection
from kvd.protocol import control, rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import StandInPool
from kvd.rooms.state import KVPoll
from kvd.transfer.backends.fake import FakeFabric

SECRET = "inproc-test-secret-0123456789abcdef"
LOOPS = ("control-recv", "sweeper", "watchdog", "heartbeats", "bootstrap-check",
         "bootstrap-put")  # registration retries until the bootstrap answers


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Bus:
    """The in-memory control network: one :class:`LocalControl` per daemon."""

    def __init__(self) -> None:
        self.sockets: dict[str, LocalControl] = {}
        self.frozen: set[str] = set()      # messages to it wait (a SIGSTOPped process)
        self.dead: set[str] = set()        # sends to it fail (nobody listens)
        self.drop: Callable[[str, str, bytes], bool] | None = None  # (src, dst, frame)
        self._ports = itertools.count(41000)

    def control(self) -> LocalControl:
        return LocalControl(self)

    def freeze(self, endpoint: str) -> None:
        self.frozen.add(endpoint)

    def thaw(self, endpoint: str) -> None:
        self.frozen.discard(endpoint)
        sock = self.sockets.get(endpoint)
        if sock is not None:
            for item in sock.held:
                sock.queue.put_nowait(item)
            sock.held.clear()

    def idle(self) -> bool:
        return all(s.queue.empty() for s in self.sockets.values()
                   if s.endpoint not in self.frozen)


class LocalControl(Addressing):
    """The ZMQ control plane's interface over :class:`Bus` queues.

    Frames are sealed and opened as on the real control plane: the daemon hands its
    :class:`~kvd.security.Authenticator` over at startup (``auth``), sends are sealed for
    the recipient's instance (:meth:`Addressing.seal`) and every inbound frame goes
    through the same :class:`~kvd.control.inbound.Admission` as a ZMQ one.
    """

    def __init__(self, bus: Bus, max_frame: int = 64 << 20) -> None:
        super().__init__()
        self.bus = bus
        self.max_frame = max_frame
        self.endpoint = ""
        self.queue: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()  # (source, frame)
        self.held: list[tuple[bytes, bytes]] = []
        self._push: dict[str, object] = {}
        self.sent: list[tuple[str, bytes]] = []
        self.inbound: Admission | None = None

    @property
    def stats(self) -> InboundStats:
        return self.inbound.stats if self.inbound is not None else InboundStats()

    def bind(self, host: str, port: int) -> str:
        self.endpoint = f"tcp://{join_hostport(host, port or next(self.bus._ports))}"
        self.bus.sockets[self.endpoint] = self
        return self.endpoint

    def messages(self) -> AsyncIterator[control.ControlMessage | Misaddressed]:
        self.inbound = Admission(self.auth, self.max_frame)
        return self._learning(self._received(self.inbound))

    async def _received(self, inbound: Admission) -> AsyncIterator[Received]:
        while True:
            for got in inbound.admit(*await self.queue.get()):  # a Batch: each message
                yield got

    async def send(self, endpoint: str, frame: bytes, instance: str | None = None,
                   at: float | None = None) -> None:
        frame = self.seal(endpoint, frame, instance, at)
        peer = self.bus.sockets.get(endpoint)
        if peer is None or endpoint in self.bus.dead:
            raise PeerSendError(f"control send to {endpoint} failed: timed out after 5.0s")
        self.sent.append((endpoint, frame))
        if self.bus.drop is not None and self.bus.drop(self.endpoint, endpoint, frame):
            return
        item = (self.endpoint.encode(), frame)
        if endpoint in self.bus.frozen:
            peer.held.append(item)
        else:
            peer.queue.put_nowait(item)

    async def send_once(self, endpoint: str, frame: bytes, instance: str | None = None,
                        at: float | None = None) -> None:
        await self.send(endpoint, frame, instance, at)

    def drop(self, endpoint: str, linger_s: float = 0.0) -> None:
        self._push.pop(endpoint, None)

    def close(self) -> None:
        if self.bus.sockets.get(self.endpoint) is self:
            del self.bus.sockets[self.endpoint]


class Router(httpx.AsyncBaseTransport):
    """HTTP to in-process daemons by ``host:port``; addresses can be down or hung."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}
        self.down: set[str] = set()
        self.hung: set[str] = set()
        self.requests: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        addr = join_hostport(request.url.host, request.url.port or 80)
        self.requests.append(f"{request.method} {addr}{request.url.path}")
        if addr in self.hung:
            raise httpx.ReadTimeout("timed out (hung bootstrap)", request=request)
        app = self.apps.get(addr)
        if app is None or addr in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await app.handle_async_request(request)


@dataclass
class Engine:
    """A stand-in engine rank in process: pools plus async calls into its daemon."""

    node: Node
    pool: StandInPool
    conn: Connection

    async def call(self, call: rpc.Call) -> Any:
        return await self.node.daemon.dispatch(call, self.conn)

    async def sender(self, room: int, pages: list[int], aux: int = 0,
                     chunks: int = 1, send: bool = True) -> None:
        """``Sender(room)``, ``init`` and (``send``) its pages in ``chunks`` chunks."""
        await self.call(rpc.SenderCreate(room=room))
        await self.call(rpc.SenderInit(room=room, num_pages=len(pages), aux_index=aux))
        if send:
            await self.send(room, pages, chunks)

    async def send(self, room: int, pages: list[int], chunks: int = 1,
                   last: bool = True) -> None:
        """``pages`` in ``chunks`` sends; the final one is the room's last unless
        ``last`` is False."""
        step = max(1, -(-len(pages) // chunks))
        for i in range(0, len(pages), step):
            part = pages[i:i + step]
            await self.call(rpc.SenderSend(room=room, pages=pack_indices(part),
                                           is_last=last and i + step >= len(pages)))

    async def receiver(self, room: int, pages: list[int] | None, bootstrap: str,
                       aux: int | None = None, dp_rank: int | None = None) -> None:
        await self.call(rpc.ReceiverCreate(room=room, bootstrap_addr=bootstrap, dp_rank=dp_rank))
        if pages is not None:
            await self.init(room, pages, aux)

    async def init(self, room: int, pages: list[int], aux: int | None = None) -> None:
        """``receiver.init``; ``aux`` None: the room's own aux slot, ``room`` modulo the
        pool's slots (as a real engine, which gives each live request its own, K42)."""
        await self.call(rpc.ReceiverInit(room=room, dst_pages=pack_indices(pages),
                                         aux_index=self.aux_slot(room) if aux is None else aux))

    def aux_slot(self, room: int) -> int:
        """The aux slot room ``room`` gets by default: ``room`` modulo the pool's slots."""
        aux = getattr(self.pool, "aux", None)
        return room % max(1, len(aux) if aux is not None else 1)

    async def poll(self, room: int) -> rpc.PollResult:
        return await self.call(rpc.Poll(rooms=[room]))

    async def status(self, room: int) -> int:
        return (await self.poll(room)).statuses[0]

    async def failure(self, room: int) -> tuple[str, str]:
        res = await self.poll(room)
        return res.kinds.get(room, ""), res.reasons.get(room, "")

    async def releasable(self, room: int) -> bool:
        return room in (await self.poll(room)).releasable

    def disconnect(self) -> None:
        """The engine's connection drops."""
        for cb in self.conn.on_close:
            cb()

    async def reconnect(self) -> None:
        """The connection drops and the engine connects again, registering again as a
        reconnecting :class:`~kvd.client.KvdClient` does."""
        self.disconnect()
        self.conn = Connection(next(self.node.cluster._conns))
        await self.call(self.pool.registration)


@dataclass
class Node:
    """One in-process daemon and its address."""

    daemon: Daemon
    http_addr: str
    cluster: Cluster
    engines: list[Engine] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        assert self.daemon.core is not None
        return self.daemon.core.control.endpoint

    @property
    def session(self) -> str:
        assert self.daemon.core is not None
        return self.daemon.core.engine.session_id

    @property
    def side(self) -> Any:
        return self.daemon.side

    @property
    def core(self) -> Any:
        return self.daemon.core

    def tick(self) -> None:
        """The daemon's sweep: deadlines, then its status table re-published."""
        self.daemon.sweep()

    async def heartbeat(self) -> None:
        """One heartbeat round of a decode daemon."""
        await self.side.heartbeat_round()
        await settle(self.cluster)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of this daemon's /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.core.events.metrics.render().decode()
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    return float(sample.value)
        return 0.0

    async def stop(self) -> None:
        """Stop the daemon (its control endpoint stops taking messages)."""
        session = self.session
        await self.daemon.shutdown()
        self.cluster.router.down.add(self.http_addr)
        self.cluster.fabric.engines[session].closed = True

    async def shard_engine(self, spec: Any, tp_rank: int = 0, tp_size: int = 1,
                           ranks: rpc.EngineRanks | None = None, **shard: Any) -> Engine:
        """Register a TP/PP shard of ``spec`` (see :class:`ShardPool`); ``ranks``: what the
        engine says about its position (None: nothing, kvd's settings decide)."""
        from kvd.refengine.standin import ShardPool

        sp = ShardPool(spec, tp_rank, tp_size, shm_dir=str(self.cluster.shm_dir), **shard)
        if ranks is not None:
            sp.registration = msgspec.structs.replace(sp.registration, ranks=ranks)
        self.cluster.shards.append(sp)
        eng = Engine(self, sp, Connection(next(self.cluster._conns)))  # type: ignore[arg-type]
        await eng.call(sp.registration)
        self.engines.append(eng)
        return eng

    async def engine(self, seed: int = 0, engine_id: str = "", **pool: Any) -> Engine:
        """Register a stand-in engine (pools in the cluster's shm dir)."""
        opts = {"num_layers": 2, "num_pages": 32, "item_len": 1024, "aux_slots": 64,
                "aux_item_len": 16, "page_size": 4, "head_dim": 64} | pool
        sp = StandInPool(seed=seed, shm_dir=str(self.cluster.shm_dir), **opts)
        if engine_id:
            sp.registration = msgspec.structs.replace(sp.registration, engine_id=engine_id)
        self.cluster.pools.append(sp)
        eng = Engine(self, sp, Connection(next(self.cluster._conns)))
        await eng.call(sp.registration)
        self.engines.append(eng)
        return eng


class Cluster:
    """In-process daemons sharing one fake fabric, bus, router and clock."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.shm_dir = workdir / "shm"
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.clock = FakeClock()
        self.fabric = FakeFabric()
        self.bus = Bus()
        self.router = Router()
        self.nodes: list[Node] = []
        self.pools: list[StandInPool] = []
        self.shards: list[Any] = []
        self._ports = itertools.count(18000)
        self._conns = itertools.count(1)

    async def node(self, role: str, bootstrap: Node | None = None, http_addr: str | None = None,
                   endpoint: str | None = None, **settings: Any) -> Node:
        """Start a daemon; a prefill serves bootstrap unless ``bootstrap`` names one.
        ``http_addr``/``endpoint`` reuse a stopped daemon's addresses (a restart)."""
        http_addr = http_addr or f"127.0.0.1:{next(self._ports)}"
        self.router.down.discard(http_addr)
        opts: dict[str, Any] = {
            "role": role, "cluster_secret": SecretStr(SECRET),
            "engine_socket": self.workdir / f"{role}-{len(self.nodes)}.sock",
            "shm_dir": self.shm_dir, "heartbeat_interval": 3600.0, "http_timeout": 1.0,
            "bootstrap_retry_budget": 0.5, "release_timeout": 1.0}
        if role == "prefill":
            if bootstrap is None:
                opts |= {"serve_bootstrap": True, "bootstrap_addr": http_addr}
            else:
                opts["bootstrap_addr"] = bootstrap.http_addr
        opts |= settings
        client = httpx.AsyncClient(transport=self.router, timeout=5.0)
        control = self.bus.control()
        if endpoint is not None:
            host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
            control.bind(host.strip("[]"), int(port))
        d = Daemon(Settings(**opts), engine=self.fabric.engine(), control=control,
                   http_client=client, clock=self.clock, sweep_interval=None)
        await d.startup(listen=False)
        self.router.apps[http_addr] = httpx.ASGITransport(app=d.app())
        node = Node(d, http_addr, self)
        self.nodes.append(node)
        return node

    def tick(self) -> None:
        for n in self.nodes:
            if n.endpoint not in self.bus.frozen:
                n.tick()

    async def advance(self, seconds: float) -> None:
        """Move time, run every daemon's deadlines, let the effects play out."""
        self.clock.advance(seconds)
        self.tick()
        await settle(self)

    async def stop(self) -> None:
        for gate in list(self.fabric.gates):
            self.fabric.release(gate)
        for n in self.nodes:
            await n.daemon.shutdown()
            if n.daemon.core is not None:
                await n.daemon.core.http_client.aclose()
        for sp in [*self.pools, *self.shards]:
            sp.close()


def busy_tasks(cluster: Cluster) -> list[asyncio.Task[Any]]:
    """Tasks doing room work now (not the daemons' long-lived loops)."""
    out = []
    for n in cluster.nodes:
        core = n.daemon.core
        if core is None:
            continue
        out += [t for t in core.tasks if not t.done() and not t.get_name().startswith(LOOPS)]
    return out


async def settle(cluster: Cluster, bound: float = 20.0) -> None:
    """Poll until no message is queued and every room task finished (writes held by a
    gate excepted), within a generous bound; raises AssertionError otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    quiet = 0
    while loop.time() < deadline:
        fabric = cluster.fabric
        tasks = busy_tasks(cluster)
        writes = [t for t in tasks if t.get_name().startswith("write-")]
        others = len(tasks) - len(writes)
        gated = fabric.running == fabric.held and len(writes) <= fabric.held
        if cluster.bus.idle() and not others and gated:
            quiet += 1
            if quiet >= 3:
                return
        else:
            quiet = 0
        await asyncio.sleep(0 if quiet else 0.001)
    names = [t.get_name() for t in busy_tasks(cluster)]
    raise AssertionError(f"not idle after {bound}s: {names}")


async def until(predicate: Callable[[], Any], bound: float = 20.0) -> None:
    """Poll ``predicate`` (sync or async) until true, within a generous bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while loop.time() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not met within the bound")


SUCCESS, FAILED, UNKNOWN = int(KVPoll.Success), int(KVPoll.Failed), -1


def same_pages(dst: Engine, src: Engine, src_pages: list[int], dst_pages: list[int]) -> bool:
    """Byte-for-byte: ``dst``'s pages equal ``src``'s pages in every KV buffer."""
    return dst.pool.pages_equal(src.pool, np.asarray(src_pages), np.asarray(dst_pages))
