"""REST schemas of ``/ready``, ``/v1/status`` and ``/v1/rooms``. A leaf module.

FastAPI puts them in the OpenAPI docs; ``kvd status`` / ``kvd rooms`` /
``kvd peers`` render them. They import nothing from kvd but the leaf :mod:`kvd.text`, so
the HTTP app, the status reader and the sides can all use them without import cycles.

Every text a peer or an engine could have put there (endpoints, instance ids, reasons,
errors) is a :data:`Foreign` string: escaped (no newline, no ANSI escape reaches a
terminal through ``kvd status``) and bounded to :data:`~kvd.text.MAX_REASON_BYTES`, when
the daemon builds the report and again when the CLI reads it (S21).

A decode kvd heartbeats each prefill bootstrap address; a peer's
``heartbeat`` is ``ok``, ``missed N``, ``down`` or ``unknown`` (not probed
yet; ``n/a (etcd)`` with etcd discovery, where leases replace heartbeats), and
``last_heartbeat`` the time of the last answered one. A prefill kvd is heartbeated,
not heartbeating (``n/a``): its liveness view of a decode peer is ``last_message``,
when that peer's last control message arrived. Both sides report each peer's
``last_error`` (a failed room, send or heartbeat) and its time. Times are unix seconds.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel

from kvd.text import clean

#: Text from outside kvd, as a report shows it: escaped and bounded (:func:`kvd.text.clean`).
Foreign = Annotated[str, AfterValidator(clean)]


class Readiness(BaseModel):
    """``/ready``: ready only when every check passes."""

    ready: bool
    transfer_engine: bool
    engine_registered: bool
    bootstrap_registered: bool | None  # None: not applicable (decode kvd)
    draining: bool  # SIGTERM received: no new rooms


class Peer(BaseModel):
    """A remote kvd rank this daemon talks to."""

    endpoint: Foreign
    kind: Literal["prefill", "decode"]
    instance_id: Foreign = ""
    state: Foreign
    heartbeat: Foreign
    bootstrap: Foreign = ""
    detail: Foreign = ""
    last_message: float | None = None  # unix s: last control message from this peer
    last_heartbeat: float | None = None  # unix s: last answered heartbeat (decode side)
    last_error: Foreign = ""
    last_error_time: float | None = None
    # s: the peer's wall clock minus this daemon's as its last authentic frame's seal
    # dates it (K40): the peer's claim, what `kvd peers` and `kvd doctor` show
    clock_offset_s: float | None = None
    # decode side: this daemon's own reading of the peer's clock (its /health clock_s
    # against the request's midpoint; what confirms or contradicts a skew claim, K40):
    # the peer's minus this daemon's (s), when it was read (unix s) and the URL read
    clock_measured_s: float | None = None
    clock_measured_at: float | None = None
    clock_measured_from: Foreign = ""


class Room(BaseModel):
    """One room held by this daemon (``kind``: the failure kind, when Failed)."""

    room: int
    state: str
    age_s: float
    state_age_s: float
    peer: Foreign
    reason: Foreign = ""
    kind: Foreign = ""


class FailureRow(BaseModel):
    """A recently failed room."""

    time: float
    side: str
    room: int
    peer: Foreign
    category: Foreign
    reason: Foreign


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
