"""What ``/ready``, ``/v1/status``, ``/v1/rooms`` and ``/metrics`` report, read from a daemon.

:class:`DaemonOps` builds the REST schemas (:mod:`kvd.schemas`) from the core
and the side's :meth:`~kvd.daemon.side.Side.snapshot` — never from a side's tables.
It runs on the daemon's loop (the HTTP handlers and the metrics scrape are
coroutines on that loop), so it reads without locks.

Peers carry their liveness as the side sees it (``last_message``,
``last_heartbeat``, ``last_error`` and its time, unix seconds): see
:class:`~kvd.schemas.Peer`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from kvd import __version__
from kvd.daemon.side import Snapshot
from kvd.metrics import StateSample
from kvd.schemas import FailureRow, Peer, Readiness, Room, Status
from kvd.transfer.backends import handshake_counts

if TYPE_CHECKING:
    from kvd.daemon import Daemon
    from kvd.daemon.core import Core


class DaemonOps:
    """Builds the reports above from a started :class:`~kvd.daemon.Daemon`."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.core.events.metrics.add_state(self.sample)

    @property
    def core(self) -> Core:
        assert self.daemon.core is not None
        return self.daemon.core

    def _snap(self) -> Snapshot:
        assert self.daemon.side is not None
        return self.daemon.side.snapshot()

    def rooms_by_state(self) -> dict[str, int]:
        """Rooms held now, by KVPoll state name (every state present)."""
        return self._snap().by_state

    def readiness(self) -> Readiness:
        """Transfer engine up, engine registered, bootstrap registration done (prefill),
        and not draining."""
        d = self.daemon
        boot = self._snap().bootstrap_registered
        engine_up = d.core is not None and bool(d.core.engine.session_id)
        registered = d.core is not None and d.core.local is not None
        ready = engine_up and registered and boot is not False and not d.draining
        return Readiness(ready=ready, transfer_engine=engine_up, engine_registered=registered,
                         bootstrap_registered=boot, draining=d.draining)

    def peers(self) -> list[Peer]:
        """Decode peers (on prefill) or prefill peers (on decode)."""
        return self._snap().peers

    def rooms(self, include_done: bool = False, limit: int = 1000) -> list[Room]:
        """Rooms held now (in flight only, unless ``include_done``), oldest first."""
        rows = [r for r in self._snap().rooms
                if include_done or r.state not in ("Success", "Failed")]
        rows.sort(key=lambda x: -x.age_s)
        return rows[:limit]

    def status(self, failures: int = 20) -> Status:
        """The full ``/v1/status`` report."""
        d, core, s = self.daemon, self.core, self.daemon.settings
        snap = self._snap()
        rooms_s, bytes_s = core.events.rate.rates()
        http = d.http_server
        local = core.local
        totals = core.totals()  # counters, the inbound control pipeline's drops folded in
        totals |= {f"dropped_{k}": v for k, v in snap.dropped.items()}
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
            peers=snap.peers, rooms=snap.by_state, rooms_per_s=round(rooms_s, 3),
            bytes_per_s=round(bytes_s, 1), rate_window_s=core.events.rate.span,
            totals=totals,
            recent_failures=[FailureRow(**f) for f in core.events.recent_failures(failures)])

    def sample(self) -> StateSample:
        """Scrape-time values for the metrics collector."""
        core, s = self.core, self.daemon.settings
        snap, totals = self._snap(), self.core.totals()
        return StateSample(
            role=s.role, version=__version__, instance_id=s.instance_id,
            uptime_s=time.time() - self.daemon.started_at, rooms_by_state=snap.by_state,
            queue_depth=snap.queue_depth, executor_busy=core.executor.busy,
            executor_threads=core.executor.threads,
            protocol_errors=totals["protocol_errors"],
            peers=len(snap.peers), engine_registered=core.local is not None,
            ready=self.readiness().ready, auth_failures=totals["auth_failures"],
            handshake=handshake_counts(core.engine))

    def metrics(self) -> bytes:
        """Prometheus text for ``/metrics``."""
        return self.core.events.metrics.render()
