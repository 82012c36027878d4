"""What ``/ready``, ``/v1/status``, ``/v1/rooms`` and ``/metrics`` report, read from a daemon.

The models are the REST schema (FastAPI puts them in the OpenAPI docs) and
what ``kvd status`` / ``kvd rooms`` / ``kvd peers`` render. :class:`DaemonOps`
reads the daemon's state; it runs on the daemon's loop (the HTTP handlers
and the metrics scrape are coroutines on that loop), so it reads without locks.

A decode kvd heartbeats each prefill bootstrap address; a peer's
``heartbeat`` is ``ok``, ``missed N``, ``down`` or ``unknown`` (not probed
yet). A prefill kvd is heartbeated, not heartbeating: ``n/a``.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from kvd import __version__
from kvd.addr import join_hostport
from kvd.metrics import StateSample
from kvd.rooms import KVPoll

if TYPE_CHECKING:
    from kvd.core import Core
    from kvd.daemon import Daemon
    from kvd.decode import DecodeSide, PeerHealth


class Readiness(BaseModel):
    """``/ready``: ready only when every check passes."""

    ready: bool
    transfer_engine: bool
    engine_registered: bool
    bootstrap_registered: bool | None  # None: not applicable (decode kvd)
    draining: bool  # SIGTERM received: no new rooms


class Peer(BaseModel):
    """A remote kvd rank this daemon talks to."""

    endpoint: str
    kind: Literal["prefill", "decode"]
    instance_id: str = ""
    state: str
    heartbeat: str
    bootstrap: str = ""
    detail: str = ""


class Room(BaseModel):
    """One room held by this daemon."""

    room: int
    state: str
    age_s: float
    state_age_s: float
    peer: str
    reason: str = ""


class FailureRow(BaseModel):
    """A recently failed room."""

    time: float
    side: str
    room: int
    peer: str
    category: str
    reason: str


class Status(BaseModel):
    """``/v1/status``: everything ``kvd status`` shows."""

    role: str
    version: str
    instance_id: str
    pid: int
    uptime_s: float
    readiness: Readiness
    endpoints: dict[str, str | None]
    engine: dict[str, Any] | None
    peers: list[Peer]
    rooms: dict[str, int]
    rooms_per_s: float
    bytes_per_s: float
    rate_window_s: float
    totals: dict[str, int]
    recent_failures: list[FailureRow]


class DaemonOps:
    """Builds the reports above from a started :class:`~kvd.daemon.Daemon`."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.core.events.metrics.add_state(self.sample)

    @property
    def core(self) -> Core:
        assert self.daemon.core is not None
        return self.daemon.core

    def _rooms(self) -> dict[int, Any]:
        d = self.daemon
        return d.prefill.rooms if d.prefill else d.decode.rooms if d.decode else {}

    def rooms_by_state(self) -> dict[str, int]:
        """Rooms held now, by KVPoll state name (every state present)."""
        out = {s.name: 0 for s in KVPoll}
        for r in self._rooms().values():
            out[r.state.status.name] += 1
        return out

    def readiness(self) -> Readiness:
        """Transfer engine up, engine registered, bootstrap registration done (prefill),
        and not draining."""
        d = self.daemon
        boot = d.prefill.bootstrap_registered if d.prefill is not None else None
        engine_up = d.core is not None and bool(d.core.engine.session_id)
        registered = d.core is not None and d.core.local is not None
        ready = engine_up and registered and boot is not False and not d.draining
        return Readiness(ready=ready, transfer_engine=engine_up, engine_registered=registered,
                         bootstrap_registered=boot, draining=d.draining)

    def peers(self) -> list[Peer]:
        """Decode peers (on prefill) or prefill peers (on decode)."""
        d = self.daemon
        if d.prefill is not None:
            return [Peer(endpoint=p.endpoint, kind="decode", instance_id=p.instance_id,
                         state="rejected" if p.rejected else "registered", heartbeat="n/a",
                         detail=p.rejected or f"attn_tp {p.attn_tp_rank}/{p.attn_tp_size}")
                    for p in d.prefill.peers.values()]
        return _decode_peers(d.decode) if d.decode is not None else []

    def room_peer(self, r: Any) -> str:
        """Where a room goes (prefill: decode endpoints) or comes from (decode)."""
        if self.daemon.prefill is not None:
            return ",".join(r.dsts) or "-"
        return ",".join(ep for _, ep in r.targets or []) or r.bootstrap_addr

    def rooms(self, include_done: bool = False, limit: int = 1000) -> list[Room]:
        """Rooms held now (in flight only, unless ``include_done``), oldest first."""
        now, started = time.monotonic(), self.core.events.started
        out = []
        for room, r in self._rooms().items():
            if r.state.done and not include_done:
                continue
            since = r.state.since
            out.append(Room(room=room, state=r.state.status.name,
                            age_s=round(now - started.get(room, since), 3),
                            state_age_s=round(now - since, 3), peer=self.room_peer(r),
                            reason=r.state.reason))
        out.sort(key=lambda x: -x.age_s)
        return out[:limit]

    def status(self, failures: int = 20) -> Status:
        """The full ``/v1/status`` report."""
        d, core, s = self.daemon, self.core, self.daemon.settings
        rooms_s, bytes_s = core.events.rate.rates()
        http = d.http_server
        local = core.local
        return Status(
            role=s.role, version=__version__, instance_id=s.instance_id, pid=os.getpid(),
            uptime_s=round(time.time() - d.started_at, 3), readiness=self.readiness(),
            endpoints={"http": f"{s.http_host}:{http.port}" if http else None,
                       "control": core.control.endpoint, "session": core.engine.session_id,
                       "engine_socket": str(s.engine_socket),
                       "bootstrap_addr": s.bootstrap_addr},
            engine=None if local is None else {
                "num_pages": local.num_pages, "num_aux_slots": local.num_aux_slots,
                "page_size": local.wire.page_size, "layout": str(local.wire.layout),
                "is_mla": local.wire.is_mla},
            peers=self.peers(), rooms=self.rooms_by_state(), rooms_per_s=round(rooms_s, 3),
            bytes_per_s=round(bytes_s, 1), rate_window_s=core.events.rate.span,
            totals=core.totals(),
            recent_failures=[FailureRow(**f) for f in core.events.recent_failures(failures)])

    def queue_depth(self) -> int:
        """Chunks queued on prefill rooms and not yet handed to a write."""
        p = self.daemon.prefill
        return sum(len(r.chunks) for r in p.rooms.values()) if p is not None else 0

    def sample(self) -> StateSample:
        """Scrape-time values for the metrics collector."""
        core, s = self.core, self.daemon.settings
        return StateSample(
            role=s.role, version=__version__, instance_id=s.instance_id,
            uptime_s=time.time() - self.daemon.started_at, rooms_by_state=self.rooms_by_state(),
            queue_depth=self.queue_depth(), executor_busy=core.executor.busy,
            executor_threads=s.transfer_threads, protocol_errors=core.totals()["protocol_errors"],
            peers=len(self.peers()), engine_registered=core.local is not None,
            ready=self.readiness().ready)

    def metrics(self) -> bytes:
        """Prometheus text for ``/metrics``."""
        return self.core.events.metrics.render()



def _heartbeat(h: PeerHealth | None) -> str:
    if h is None or (h.misses == 0 and not h.last_ok):
        return "unknown"
    if h.down:
        return "down"
    return f"missed {h.misses}" if h.misses else "ok"


def _decode_peers(side: DecodeSide) -> list[Peer]:
    """One row per prefill rank endpoint; a bootstrap address with none gets its own row."""
    rows: dict[str, Peer] = {}
    for (addr, tp, dp, pp), info in side.bootstrap.ranks.items():
        ep = f"tcp://{join_hostport(info.rank_ip.strip('[]'), info.rank_port)}"
        rows[ep] = Peer(endpoint=ep, kind="prefill", bootstrap=addr,
                        state="registered" if ep in side.registered else "resolved",
                        heartbeat=_heartbeat(side.health.get(addr)),
                        instance_id=info.instance_id or "",
                        detail=f"tp {tp} dp {dp} pp {pp}")
    for ep in side.registered - rows.keys():
        rows[ep] = Peer(endpoint=ep, kind="prefill", state="registered", heartbeat="unknown")
    known = {p.bootstrap for p in rows.values()}
    for addr in (set(side.bootstrap.info) | set(side.health)) - known:
        h = side.health.get(addr)
        rows[addr] = Peer(endpoint=addr, kind="prefill", bootstrap=addr, state="bootstrap",
                          heartbeat=_heartbeat(h), instance_id=(h.instance_id or "") if h else "")
    return sorted(rows.values(), key=lambda p: (p.bootstrap, p.endpoint))
