"""REST schemas of ``/ready``, ``/v1/status`` and ``/v1/rooms``. A leaf module.

FastAPI puts them in the OpenAPI docs; ``kvd status`` / ``kvd rooms`` /
``kvd peers`` render them. They import nothing from kvd, so the HTTP app, the
status reader and the sides can all use them without import cycles.

A decode kvd heartbeats each prefill bootstrap address; a peer's
``heartbeat`` is ``ok``, ``missed N``, ``down`` or ``unknown`` (not probed
yet), and ``last_heartbeat`` the time of the last answered one. A prefill kvd
is heartbeated, not heartbeating (``n/a``): its liveness view of a decode peer
is ``last_message``, when that peer's last control message arrived. Both sides
report each peer's ``last_error`` (a failed room, send or heartbeat) and its
time. Times are unix seconds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


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
    last_message: float | None = None  # unix s: last control message from this peer
    last_heartbeat: float | None = None  # unix s: last answered heartbeat (decode side)
    last_error: str = ""
    last_error_time: float | None = None
    # s: the peer's wall clock minus this daemon's, from its last authentic frame (K40)
    clock_offset_s: float | None = None


class Room(BaseModel):
    """One room held by this daemon (``kind``: the failure kind, when Failed)."""

    room: int
    state: str
    age_s: float
    state_age_s: float
    peer: str
    reason: str = ""
    kind: str = ""


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
