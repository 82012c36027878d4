"""What a room state machine asks its daemon to do. PURE value types.

A machine method returns a list of effects; the daemon performs them in
order and feeds the results back as events (``write_done``, ``send_failed``,
``resolved``, ``resolve_failed``). Effects never carry a callback: the event
that reports an effect's result names the room and its incarnation, so a late
result of an old incarnation is recognised and cannot decide a newer one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvd.protocol.control import ControlMessage, RefusedWhy
from kvd.rooms.state import KVPoll, RoomFailure
from kvd.transfer.plan import Pages


@dataclass(frozen=True)
class Send:
    """Send ``msg`` to the peer control endpoint ``to`` (instance ``to_instance``).

    When ``room`` is set and the send fails, the daemon reports
    ``send_failed(room, inc, to, failure)`` (a room must not wait for its
    deadline because its message was never delivered)."""

    to: str
    to_instance: str
    msg: ControlMessage
    room: int | None = None
    inc: int = 0


@dataclass(frozen=True)
class Report:
    """Prefill: tell decode rank ``to`` the final word on ``room`` incarnation ``inc``.

    ``quiesced`` is True when no write for the room is in flight on this rank;
    ``aux_index`` (Success only, aux over the control plane) names the local aux
    slot whose bytes ride along."""

    to: str
    to_instance: str
    room: int
    inc: int
    status: KVPoll
    failure: RoomFailure | None
    quiesced: bool
    aux_index: int | None = None


def _no_pages() -> Pages:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class StateRef:
    """Where a room's hybrid caches are on one side: ``index``, its state slot (-1: none)
    and ``window``, int64 window-pool pages holding its last window of tokens (the room
    names them: :mod:`kvd.transfer.state`). They move with the room's last chunk."""

    index: int = -1
    window: Pages = field(default_factory=_no_pages)

    @property
    def empty(self) -> bool:
        return self.index < 0 and self.window.size == 0


@dataclass(frozen=True)
class WriteDest:
    """One destination of a chunk: its pages (``dst_pages``, int64 page indices, one per
    chunk page from ``src_from`` on; empty for an MLA dummy) and the peer's registration
    (``peer``: opaque to the machine, what the daemon plans with). ``src_from``: leading
    pages of the chunk this destination already holds (decode-side prefix caching):
    ``src_pages[src_from:]`` go to ``dst_pages``.

    Re-tiled rooms (the decode's page size differs, :attr:`Write.tokens` set): this
    destination receives room tokens ``tokens = (lo, hi)`` (token positions; ``lo == hi``:
    nothing) into ``dst_pages``, decode room pages from ``dst_first`` on (decode pages);
    ``src_from`` is 0."""

    endpoint: str
    dst_pages: Pages
    aux_index: int
    is_dummy: bool
    peer: Any
    src_from: int = 0
    state: StateRef | None = None  # the decode's state slot / window pages (last chunk)
    dst_first: int = 0
    tokens: tuple[int, int] | None = None


@dataclass(frozen=True)
class Write:
    """Prefill: write one chunk of ``room`` (attempt ``attempt``) to every destination.

    ``src_pages``: int64 source page indices. ``is_last``: the chunk that carries aux
    (local slot ``aux_index``). ``deadline``: monotonic s; no sub-batch may start
    after it. The daemon answers with ``write_done(room, attempt, ...)`` exactly once,
    whatever happens to the task that performs it.

    ``tokens``: None when every destination has this rank's page size (whole pages, as
    the engine sent them); else the room tokens ``(lo, hi)`` this write moves (re-tiled,
    issue 22 item 3): ``src_pages`` are the sender room pages from ``src_first`` on that
    hold them, and each destination says its own part (:class:`WriteDest`).

    ``layers``: None for every layer; else ``(lo, hi)``, the local layers ``[lo, hi)`` of
    this rank's pool this write moves of its pages (layer streaming, issue 22 item 4;
    with ``tokens``, those layers of the room tokens ``tokens``)."""

    room: int
    attempt: int
    src_pages: Pages
    dests: tuple[WriteDest, ...]
    is_last: bool
    aux_index: int | None
    deadline: float
    state: StateRef | None = None  # the prefill's state slot / window pages (last chunk)
    src_first: int = 0
    tokens: tuple[int, int] | None = None
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class CancelWrites:
    """Prefill: attempt ``attempt`` of ``room`` ended while its write was in flight: drop
    every part of that write not started yet (the pump's queued entries, a lane's
    queued write). What is in flight still returns, and its ``write_done`` still
    comes (then the room reports ``quiesced``): K43."""

    room: int
    attempt: int


@dataclass(frozen=True)
class Resolve:
    """Decode: find the prefill ranks of ``room`` (bootstrap lookup, registration of this
    rank's KV args with each); answered by ``resolved`` or ``resolve_failed``."""

    room: int
    inc: int
    bootstrap_addr: str
    dp_rank: int | None


@dataclass(frozen=True)
class AbortUnknown:
    """Decode: the engine aborted a room this daemon does not know (e.g. it restarted):
    resolve the prefill ranks of ``bootstrap_addr`` and send them an abort that applies
    to any incarnation (K34)."""

    room: int
    bootstrap_addr: str
    dp_rank: int | None
    failure: RoomFailure


@dataclass(frozen=True)
class WriteAux:
    """Decode: copy an aux payload received over the control plane into local slot
    ``aux_index`` (one bytes object per aux buffer, sizes already checked), from prefill
    rank ``endpoint``'s Success for incarnation ``inc``; the side answers with
    :meth:`~kvd.rooms.receiver.ReceiverRooms.aux_written` (S16)."""

    room: int
    aux_index: int
    payload: tuple[bytes, ...]
    inc: int = 0
    endpoint: str = ""


@dataclass(frozen=True)
class ForgetPeer:
    """Drop everything held for peer ``endpoint`` outside the machine (its socket)."""

    endpoint: str


@dataclass(frozen=True)
class Refuse:
    """Prefill: answer ``message`` (authentic, from decode rank ``message.endpoint``) with
    a typed refusal saying why the machine dropped it (``unregistered``: no registration
    of that instance is held; ``full``: ``max_peers`` decode ranks are held), so its
    rooms act now instead of waiting for a deadline (K16). The daemon rate-limits it."""

    message: ControlMessage
    why: RefusedWhy


@dataclass(frozen=True)
class Ended:
    """A room reached Success or Failed (for metrics and logs; emitted once per
    incarnation). ``nbytes``/``seconds``: bytes moved and time inside writes."""

    room: int
    inc: int
    status: KVPoll
    failure: RoomFailure | None
    peer: str
    created: float
    nbytes: int = 0
    seconds: float | None = None  # None: this side does not write (decode)


@dataclass(frozen=True)
class Wake:
    """Something a ``wait`` may be waiting for changed (a room ended, pages freed up)."""


Effect = (Send | Report | Write | CancelWrites | Resolve | AbortUnknown | WriteAux | ForgetPeer
          | Refuse | Ended | Wake)
