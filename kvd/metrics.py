"""Prometheus metrics and the room-event hooks that feed them.

Each daemon has its own :class:`~prometheus_client.CollectorRegistry` (never
the global one), so several daemons in one process (tests) do not mix. The
prefill and decode sides report through :class:`RoomEvents`
(``core.events``); every call happens on the daemon's loop.

Label cardinality is bounded and stable: a ``peer`` label is the peer's
*host* for a ZMQ endpoint (``tcp://10.0.0.5:41234`` -> ``10.0.0.5``: the port is
picked anew at every restart with ``zmq_port = 0``, and a label per port would
grow without end) and ``host:port`` for a bootstrap address (a fixed port);
the first ``max_peers`` distinct labels are kept, the rest count as
``"other"``. Failure ``reason`` labels are a fixed set of categories (the full
text goes to the logs and to the recent-failures list of ``/v1/status``).
``state`` labels are lower_snake KVPoll names (``waiting_for_input``). Room
latency is a histogram observed once per room, never a label per room.
Counters have no ``_created`` series (the exposition is filtered per registry,
so other registries in the process, e.g. vLLM's, are untouched).

Metric names (all prefixed ``kvd_``)::

    rooms{state}                    gauge      rooms held now, by KVPoll state
    rooms_finished_total{status}    counter    success | failed
    room_failures_total{reason}     counter    by category (see classify_failure)
    transfers_total{peer}           counter    chunk writes to a decode peer
    transfer_bytes_total{peer}      counter    bytes written to a decode peer
    room_latency_seconds            histogram  room creation -> Success, per room
    room_transfer_seconds           histogram  time inside transfer-engine writes, per room
    room_bytes                      histogram  KV + aux bytes moved, per room
    heartbeat_misses_total{peer}    counter    missed heartbeats, by prefill peer
    auth_failures_total             counter    unauthenticated control frames and HTTP requests
    transfer_queue_depth            gauge      chunks queued and not yet written
    executor_busy                   gauge      writes submitted to transfer threads, not returned
    executor_threads                gauge      transfer threads (shards)
    protocol_errors_total           counter    malformed control frames dropped
    peers                           gauge      peers known
    engine_registered, ready        gauge      0/1
    info{role,version,instance_id}  gauge      1
    uptime_seconds                  gauge

:class:`RoomEvents` also keeps, per peer (bounded), when it was last heard from
and its last error, for ``/v1/status`` (:class:`PeerRecord`).
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvd.logs import fields
from kvd.rooms.state import RoomFailure
from kvd.text import clean

log = logging.getLogger("kvd.rooms")

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BYTES_BUCKETS = tuple(float(4096 * 4 ** i) for i in range(12))  # 4 KiB .. 16 GiB
OTHER = "other"
MAX_PEER_LABELS = 64
FAILURE_HISTORY = 100
MAX_TRACKED_ROOMS = 100_000

def classify_failure(failure: RoomFailure) -> str:
    """The bounded label of a failure: its :class:`FailureKind` value."""
    return failure.kind.value


def peer_identity(peer: str) -> str:
    """The stable part of a peer's address, for labels: the host of a ZMQ endpoint
    (``tcp://h:port`` -> ``h``; ``tcp://[v6]:port`` -> ``[v6]``), anything else as is
    (bootstrap addresses ``host:port`` have a fixed port)."""
    if not peer.startswith("tcp://"):
        return peer
    hostport = peer[len("tcp://"):]
    host, sep, port = hostport.rpartition(":")
    return host if sep and port.isdigit() else hostport


#: The most UTF-8 bytes of one peer label value.
MAX_LABEL_BYTES = 256


class PeerLabels:
    """Bounded, stable peer label values: :func:`peer_identity`, the first ``limit`` of
    them, then ``other``."""

    def __init__(self, limit: int = MAX_PEER_LABELS) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, peer: str) -> str:
        label = clean(peer_identity(peer), MAX_LABEL_BYTES)  # a peer's text (S21)
        if label in self._seen:
            return label
        if len(self._seen) < self.limit:
            self._seen.add(label)
            return label
        return OTHER


def state_label(name: str) -> str:
    """``WaitingForInput`` -> ``waiting_for_input`` (Prometheus label values are snake)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass
class StateSample:
    """Values read from the daemon's state at scrape time (on the loop)."""

    role: str
    version: str
    instance_id: str
    uptime_s: float
    rooms_by_state: dict[str, int]
    queue_depth: int
    executor_busy: int
    executor_threads: int
    protocol_errors: int
    peers: int
    engine_registered: bool
    ready: bool
    auth_failures: int = 0
    handshake: dict[str, int] = field(default_factory=dict)


class _StateCollector(Collector):
    """Turns a :class:`StateSample` into gauge families at each scrape."""

    def __init__(self, sample: Callable[[], StateSample]) -> None:
        self.sample = sample

    def describe(self) -> Iterable[Metric]:
        return []  # nothing to check at registration: the daemon is not up yet

    def collect(self) -> Iterable[Metric]:
        s = self.sample()
        rooms = GaugeMetricFamily("kvd_rooms", "Rooms held now, by state", labels=["state"])
        for state, n in s.rooms_by_state.items():
            rooms.add_metric([state_label(state)], n)
        yield rooms
        info = GaugeMetricFamily("kvd_info", "This daemon",
                                 labels=["role", "version", "instance_id"])
        info.add_metric([s.role, s.version, s.instance_id], 1)
        yield info
        yield from self._gauges(s)
        yield CounterMetricFamily("kvd_protocol_errors", "Malformed control frames dropped",
                                  value=s.protocol_errors)
        front = CounterMetricFamily("kvd_handshake_connections", "Connections to the "
                                    "transfer engine's handshake port, by outcome (relayed, "
                                    "idle, malformed, evicted, unanswered)", labels=["outcome"])
        for outcome, n in sorted(s.handshake.items()):
            front.add_metric([outcome], n)
        yield front
        yield CounterMetricFamily("kvd_auth_failures", "Control frames and HTTP requests "
                                  "refused for missing or bad authentication",
                                  value=s.auth_failures)

    @staticmethod
    def _gauges(s: StateSample) -> Iterator[Metric]:
        for name, doc, value in (
            ("uptime_seconds", "Seconds since the daemon started", s.uptime_s),
            ("transfer_queue_depth", "Chunks queued and not yet written", s.queue_depth),
            ("executor_busy", "Writes submitted to transfer threads and not returned "
             "(running or queued)", s.executor_busy),
            ("executor_threads", "Transfer executor threads", s.executor_threads),
            ("peers", "Peers known", s.peers),
            ("engine_registered", "1 once the engine registered its KV buffers",
             int(s.engine_registered)),
            ("ready", "1 when /ready answers 200", int(s.ready)),
        ):
            yield GaugeMetricFamily(f"kvd_{name}", doc, value=value)


class Metrics:
    """The Prometheus objects of one daemon, in their own registry."""

    def __init__(self, max_peers: int = MAX_PEER_LABELS) -> None:
        self.registry = CollectorRegistry()
        self.peer = PeerLabels(max_peers)
        r = self.registry
        self.rooms_finished = Counter("kvd_rooms_finished", "Rooms that ended, by status",
                                      ["status"], registry=r)
        self.failures = Counter("kvd_room_failures", "Failed rooms, by reason category",
                                ["reason"], registry=r)
        self.transfers = Counter("kvd_transfers", "Chunk writes to a peer", ["peer"], registry=r)
        self.transfer_bytes = Counter("kvd_transfer_bytes", "Bytes written to a peer", ["peer"],
                                      registry=r)
        self.room_latency = Histogram("kvd_room_latency_seconds",
                                      "Room creation to Success, observed once per room",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.room_transfer = Histogram("kvd_room_transfer_seconds",
                                       "Time inside transfer-engine writes, once per room",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.room_bytes = Histogram("kvd_room_bytes", "Bytes moved, once per room",
                                    buckets=BYTES_BUCKETS, registry=r)
        self.heartbeat_misses = Counter("kvd_heartbeat_misses", "Missed heartbeats, by peer",
                                        ["peer"], registry=r)
        for status in ("success", "failed"):
            self.rooms_finished.labels(status)
        ProcessCollector(registry=r)

    def add_state(self, sample: Callable[[], StateSample]) -> None:
        """Report ``sample()`` at every scrape (called on the loop by the HTTP handler)."""
        self.registry.register(_StateCollector(sample))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (without ``_created`` series)."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry view without the ``*_created`` samples prometheus_client adds to every
    counter and histogram: they double the series and carry nothing a scrape needs.
    ``prometheus_client.disable_created_metrics()`` would do it for the whole process,
    including an engine's own registry when kvd runs inside it (the vLLM adapter)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [x for x in metric.samples if not x.name.endswith("_created")]
            yield metric


class RateWindow:
    """Rooms and bytes per second over the last ``span`` seconds (1-second buckets)."""

    def __init__(self, span: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.span = span
        self.clock = clock
        self.start = clock()
        self._buckets: deque[list[int]] = deque()  # [second, rooms, bytes]

    def add(self, rooms: int = 0, nbytes: int = 0) -> None:
        sec = int(self.clock())
        if not self._buckets or self._buckets[-1][0] != sec:
            self._buckets.append([sec, 0, 0])
        self._buckets[-1][1] += rooms
        self._buckets[-1][2] += nbytes
        while self._buckets and self._buckets[0][0] < sec - self.span - 1:
            self._buckets.popleft()

    def rates(self) -> tuple[float, float]:
        """(rooms/s, bytes/s) over the window (or the uptime, if shorter)."""
        now = self.clock()
        recent = [b for b in self._buckets if b[0] > now - self.span - 1]
        seconds = max(1.0, min(self.span, now - self.start))
        return (sum(b[1] for b in recent) / seconds, sum(b[2] for b in recent) / seconds)


@dataclass
class Failure:
    """One failed room, as ``/v1/status`` lists it."""

    time: float
    side: str
    room: int
    peer: str
    reason: str
    category: str


MAX_PEER_RECORDS = 1024


@dataclass
class PeerRecord:
    """What this daemon last saw of one peer (unix seconds; None: never)."""

    last_message: float | None = None
    last_error: str = ""
    last_error_time: float | None = None


@dataclass
class RoomEvents:
    """Hooks the prefill and decode sides call when rooms start, move bytes and end.

    Keeps the metrics, the recent failures (bounded) and a rate window; the
    one-line calls in ``prefill.py`` / ``decode.py`` are the only producers.
    """

    metrics: Metrics = field(default_factory=Metrics)
    failures: deque[Failure] = field(default_factory=lambda: deque(maxlen=FAILURE_HISTORY))
    rate: RateWindow = field(default_factory=RateWindow)
    started: dict[int, float] = field(default_factory=dict)
    peers: dict[str, PeerRecord] = field(default_factory=dict)  # bounded, newest kept

    def room_started(self, side: str, room: int, peer: str = "") -> None:
        """A room was created (its latency is measured from here)."""
        if len(self.started) >= MAX_TRACKED_ROOMS:
            self.started.pop(next(iter(self.started)))
        self.started[room] = time.monotonic()

    def room_done(self, side: str, room: int, failure: RoomFailure | None, nbytes: int = 0,
                  seconds: float | None = None, peer: str = "") -> None:
        """A room ended: Success when ``failure`` is None; ``nbytes``/``seconds`` are what
        this side moved and how long its writes took (None: not measured); ``peer`` one
        endpoint or several (joined with commas)."""
        began = self.started.pop(room, None)
        m = self.metrics
        m.rooms_finished.labels("success" if failure is None else "failed").inc()
        if failure is None:
            self._observe(began, nbytes, seconds)
            self.rate.add(rooms=1)
            log.debug("room done", extra=fields(room=room, peer=peer or None))
        else:
            category = classify_failure(failure)
            m.failures.labels(category).inc()
            self.failures.append(Failure(time.time(), side, room, peer, failure.reason,
                                         category))
            for one in filter(None, peer.split(",")):
                self.peer_error(one.strip(), failure.reason)

    def _observe(self, began: float | None, nbytes: int, seconds: float | None) -> None:
        m = self.metrics
        if began is not None:
            m.room_latency.observe(time.monotonic() - began)
        if seconds is not None:
            m.room_transfer.observe(seconds)
        if nbytes:
            m.room_bytes.observe(nbytes)

    def bytes_sent(self, peer: str, n: int) -> None:
        """One chunk write of ``n`` bytes to ``peer`` landed."""
        label = self.metrics.peer(peer)
        self.metrics.transfers.labels(label).inc()
        self.metrics.transfer_bytes.labels(label).inc(n)
        self.rate.add(nbytes=n)

    def chunks_sent(self, writes: Iterable[tuple[str, int]]) -> None:
        """:meth:`bytes_sent` for each ``(peer, n)``; zero-byte (dummy) writes are skipped."""
        for peer, n in writes:
            if n:
                self.bytes_sent(peer, n)

    def heartbeat_missed(self, peer: str, error: str = "heartbeat unanswered") -> None:
        """A heartbeat to ``peer`` went unanswered (``error``: why, for its peer record)."""
        self.metrics.heartbeat_misses.labels(self.metrics.peer(peer)).inc()
        self.peer_error(peer, error)

    def _record(self, peer: str) -> PeerRecord:
        rec = self.peers.pop(peer, None) or PeerRecord()
        self.peers[peer] = rec  # most recent last
        while len(self.peers) > MAX_PEER_RECORDS:
            self.peers.pop(next(iter(self.peers)))
        return rec

    def peer_message(self, peer: str, now: float | None = None) -> None:
        """An authenticated control message from ``peer`` (its endpoint) arrived."""
        self._record(peer).last_message = time.time() if now is None else now

    def peer_error(self, peer: str, error: str, now: float | None = None) -> None:
        """Something about ``peer`` failed (a room, a send, a heartbeat)."""
        rec = self._record(peer)
        rec.last_error, rec.last_error_time = error, time.time() if now is None else now

    def peer_record(self, peer: str) -> PeerRecord:
        """What is known of ``peer`` (an empty record if nothing)."""
        return self.peers.get(peer) or PeerRecord()

    def recent_failures(self, limit: int = 20) -> list[dict[str, Any]]:
        """The last ``limit`` failures, newest first."""
        return [vars(f) for f in list(self.failures)[::-1][:limit]]
