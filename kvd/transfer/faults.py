"""Fault injection around the real transfer engine, for tests and drills only.

A :class:`FaultPlan` (JSON in the ``fault_injection`` setting) is consulted before
every native batch submission of :class:`~kvd.transfer.backends.mooncake.MooncakeEngine`.
It can delay submissions, refuse the first N submissions of every batch
(transient "queue full"), or fail chosen batches permanently. Batches are
numbered from 0 in submission order, per daemon. The real engine still moves
every byte that is not refused.
"""

from __future__ import annotations

import threading
import time

from pydantic import BaseModel, ConfigDict, Field


class FaultPlan(BaseModel):
    """What to inject. Times in seconds; batch numbers count from 0."""

    model_config = ConfigDict(extra="forbid")

    delay_s: float = Field(0.0, ge=0, description="sleep before every submission")
    transient_per_batch: int = Field(0, ge=0,
                                     description="refuse the first N attempts of every batch")
    fail_batches: list[int] = Field(default_factory=list,
                                    description="batches refused on every attempt")
    peers: list[str] = Field(default_factory=list,
                             description="only batches to these sessions (empty: all)")
    aux_delay_s: float = Field(0.0, ge=0, description="delay of aux sent over the control "
                                                      "plane (aux_transport = control)")


class FaultInjector:
    """Callable hook ``(peer, batch_no, attempt) -> forced rc or None``; thread-safe."""

    REFUSED = -1

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._lock = threading.Lock()
        self.injected = 0

    def __call__(self, peer: str, batch_no: int, attempt: int) -> int | None:
        p = self.plan
        if p.peers and peer not in p.peers:
            return None
        if p.delay_s:
            time.sleep(p.delay_s)
        if batch_no in p.fail_batches or attempt < p.transient_per_batch:
            with self._lock:
                self.injected += 1
            return self.REFUSED
        return None
