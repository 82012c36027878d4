"""kvd's transfer statistics in vLLM's own metrics (``KVConnectorStats`` and Prometheus).

The worker records each room it finishes (:meth:`KvdConnectorStats.record`); vLLM takes
the stats every step (``get_kv_connector_stats``), aggregates them across workers, logs
a summary ("KV Transfer metrics: ...") and feeds :class:`KvdPromMetrics`, whose series
appear on the engine's ``/metrics``:

* ``vllm:kvd_transfers_total{role,outcome}`` -- rooms finished (outcome ``success`` or a
  kvd failure kind: ``timeout``, ``aborted``, ``transport``, ...);
* ``vllm:kvd_bytes_transferred_total`` -- KV bytes kvd wrote (prefill side);
* ``vllm:kvd_transfer_seconds`` -- histogram of kvd's time inside writes per room
  (prefill), and ``vllm:kvd_room_seconds`` of each room from its start in the engine to
  its end (both sides).

The data dict holds plain lists (vLLM pickles it between processes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

_KEYS = ("role", "outcome", "room_s", "transfer_s", "nbytes")
_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


@dataclass
class KvdConnectorStats(KVConnectorStats):
    """Rooms finished since the last collection, one entry per room in parallel lists:
    ``role`` ("send"/"recv"), ``outcome``, ``room_s`` (s, engine start to end),
    ``transfer_s`` (s inside writes; 0 on decode), ``nbytes`` (bytes written; 0 on decode)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[Any]] = {k: [] for k in _KEYS}

    def record(self, role: str, outcome: str, room_s: float, transfer_s: float = 0.0,
               nbytes: int = 0) -> None:
        """One finished room."""
        for key, value in zip(_KEYS, (role, outcome, room_s, transfer_s, nbytes),
                              strict=True):
            self.data[key].append(value)

    def clone_and_reset(self) -> KvdConnectorStats:
        """The stats so far (a copy); this object starts empty again."""
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not self.data["outcome"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _KEYS:
            self.data[key].extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's log line."""
        outcomes = self.data["outcome"]
        ok = [i for i, o in enumerate(outcomes) if o == "success"]
        room_s = [self.data["room_s"][i] for i in ok]
        return {"kvd rooms": len(outcomes), "kvd failed rooms": len(outcomes) - len(ok),
                "kvd MB written": round(sum(self.data["nbytes"]) / 2**20, 3),
                "kvd avg room ms": round(1e3 * sum(room_s) / len(room_s), 3) if room_s else 0}


class KvdPromMetrics(KVConnectorPromMetrics):
    """kvd's series on vLLM's ``/metrics`` (per engine, vLLM's labels plus ours)."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labels = [*labelnames, "role", "outcome"]
        self.transfers = self._counter_cls(
            name="vllm:kvd_transfers_total", labelnames=labels,
            documentation="KV transfers (kvd rooms) finished, by role and outcome "
                          "(success or kvd's failure kind).")
        self.nbytes = create_metric_per_engine(self._counter_cls(
            name="vllm:kvd_bytes_transferred_total", labelnames=labelnames,
            documentation="KV bytes written by kvd for this engine (prefill side)."),
            per_engine_labelvalues)
        self.transfer_s = create_metric_per_engine(self._histogram_cls(
            name="vllm:kvd_transfer_seconds", labelnames=labelnames, buckets=_BUCKETS,
            documentation="Seconds kvd spent inside writes, per room (prefill side)."),
            per_engine_labelvalues)
        self.room_s = create_metric_per_engine(self._histogram_cls(
            name="vllm:kvd_room_seconds", labelnames=labelnames, buckets=_BUCKETS,
            documentation="Seconds from a room's start in the engine to its end."),
            per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        base = self.per_engine_labelvalues[engine_idx]
        for i, outcome in enumerate(data.get("outcome", [])):
            self.transfers.labels(*base, data["role"][i], outcome).inc()
            self.room_s[engine_idx].observe(data["room_s"][i])
            if data["role"][i] == "send" and outcome == "success":
                self.nbytes[engine_idx].inc(data["nbytes"][i])
                self.transfer_s[engine_idx].observe(data["transfer_s"][i])
