"""One interface for the two roles: the daemon holds one :class:`Side`.

A side owns its role's pure room machine (:mod:`kvd.rooms.sender` or
:mod:`kvd.rooms.receiver`) and performs the effects it returns: control
messages, transfer writes, bootstrap lookups, aux copies, wake-ups, metrics.
Everything runs on the daemon's loop; blocking transfer work goes through the
executor. The daemon never asks which role it has: it calls the methods
below, and :func:`make_side` picks the class once, by name.

Status and metrics read :meth:`Side.snapshot`, never a side's tables.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvd.daemon.core import Core
from kvd.errors import ProtocolError, RoomError
from kvd.logs import fields
from kvd.protocol import control, rpc
from kvd.protocol.release import ReleaseAnswer, ReleaseRequest
from kvd.rooms.effects import Effect, Ended, ForgetPeer, Wake
from kvd.rooms.state import UNKNOWN_ROOM, KVPoll, RoomFailure, Timeouts
from kvd.schemas import Peer, Room
from kvd.transfer.kvargs import RankArgs

log = logging.getLogger("kvd.rooms")

#: Longest single ``Wait`` the server honours (s); clients loop for longer waits.
MAX_WAIT_S = 3600.0
#: Seconds the failures of one cause after its first are gathered into one log line (K41).
FAILURE_LOG_S = 1.0
#: Room ids an aggregated failure line names.
FAILURE_LOG_ROOMS = 5


@dataclass
class _Burst:
    """Failures of one cause since its last line: how many, the first rooms, one reason."""

    count: int = 0
    rooms: list[int] = field(default_factory=list)
    reason: str = ""


class FailureLog:
    """Room failures as log lines, one line per cause (failure kind) a second at most
    after the first (K41: 4 096 rooms failing together were 4 096 warnings).

    The first failure of a kind is logged at once with its reason, room and peer, as
    before; the next ones within :data:`FAILURE_LOG_S` are counted and logged as one line
    when that second ends (the count, the first :data:`FAILURE_LOG_ROOMS` room ids, one
    reason). Metrics count every room regardless (:class:`~kvd.metrics.RoomEvents`).
    Without a running loop every failure is logged on its own.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger
        self._open: dict[str, _Burst] = {}
        self.lines = 0  # lines logged (tests count them)

    def add(self, room: int, peer: str, failure: RoomFailure) -> None:
        kind = failure.kind.value
        burst = self._open.get(kind)
        if burst is not None:
            burst.count += 1
            if len(burst.rooms) < FAILURE_LOG_ROOMS:
                burst.rooms.append(room)
            burst.reason = burst.reason or failure.reason
            return
        self.lines += 1
        self.log.warning("%s", failure.reason,
                         extra=fields(room=room, peer=peer or None, kind=kind))
        try:
            asyncio.get_running_loop().call_later(FAILURE_LOG_S, self._close, kind)
        except RuntimeError:
            return
        self._open[kind] = _Burst()

    def _close(self, kind: str) -> None:
        burst = self._open.pop(kind, None)
        if burst is None or not burst.count:
            return
        more = ", ..." if burst.count > len(burst.rooms) else ""
        self.lines += 1
        self.log.warning("%d more rooms failed (kind %s) in %gs: rooms %s%s; e.g. %s",
                         burst.count, kind, FAILURE_LOG_S,
                         ", ".join(map(str, burst.rooms)), more, burst.reason,
                         extra=fields(kind=kind))


@dataclass
class Snapshot:
    """What status and metrics may read of a side (values, not live tables)."""

    role: str
    rooms: list[Room]
    peers: list[Peer]
    by_state: dict[str, int]
    queue_depth: int
    tables: dict[str, int]
    dropped: dict[str, int]
    bootstrap_registered: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoomView:
    """One room as the engine sees it: status, failure, releasable, (bytes, seconds)."""

    status: KVPoll
    failure: RoomFailure | None
    releasable: bool
    stats: tuple[int, float] | None = None


class Side(abc.ABC):
    """A daemon's role. Subclasses: :class:`kvd.daemon.prefill.PrefillSide`,
    :class:`kvd.daemon.decode.DecodeSide`."""

    role: ClassVar[str]

    def __init__(self, core: Core) -> None:
        self.core = core
        self.failure_log = FailureLog(log)
        s = core.settings
        self.timeouts = Timeouts(bootstrap=s.bootstrap_timeout, waiting=s.waiting_timeout,
                                 transfer=s.transfer_timeout, release=s.release_timeout,
                                 tombstone=s.finished_room_ttl, finished_ttl=s.finished_room_ttl)

    # ---- engine calls -----------------------------------------------------------------

    @abc.abstractmethod
    def call(self, call: rpc.Call) -> Any:
        """A role-specific engine call (create/init/send); raises RoomError otherwise."""

    @abc.abstractmethod
    def view(self, room: int) -> RoomView | None:
        """The engine's view of ``room`` (None: unknown)."""

    @abc.abstractmethod
    def take_changed(self) -> set[int]:
        """The rooms whose poll answer may have changed since the last call (the room
        machine's record of what its steps touched; the status table re-publishes only
        those, K41)."""

    @abc.abstractmethod
    def abort(self, room: int, reason: str, bootstrap_addr: str | None = None,
              dp_rank: int | None = None) -> None:
        """The engine aborts ``room``."""

    @abc.abstractmethod
    def clear(self, room: int) -> None:
        """The engine forgets ``room`` (RoomError while its pages are not releasable)."""

    def release(self, req: ReleaseRequest) -> ReleaseAnswer:
        """``POST /v1/rooms/release``: the opener ends its rooms (K45/K46). Only a prefill
        holds rooms an opener can end: RoomError elsewhere (the HTTP answer's 404)."""
        raise RoomError(f"rooms are released on the prefill kvd, this one is {self.role}")

    def poll(self, rooms: Iterable[int]) -> rpc.PollResult:
        """Statuses of many rooms in one answer (unknown rooms: ``UNKNOWN_ROOM``,
        releasable)."""
        statuses, reasons, kinds, stats, releasable = [], {}, {}, {}, []
        for room in rooms:
            v = self.view(room)
            if v is None:
                statuses.append(UNKNOWN_ROOM)
                releasable.append(room)
                continue
            statuses.append(int(v.status))
            if v.releasable:
                releasable.append(room)
            if v.failure is not None:
                reasons[room] = v.failure.reason
                kinds[room] = v.failure.kind.value
            if v.stats is not None:
                stats[room] = v.stats
        return rpc.PollResult(statuses=statuses, reasons=reasons, kinds=kinds, stats=stats,
                              releasable=releasable)

    async def wait(self, rooms: list[int], seconds: float,
                   any_done: bool = False) -> rpc.PollResult:
        """Until every room ended (``any_done``: one room) -- and its pages are
        releasable -- or ``seconds`` passed (capped at :data:`MAX_WAIT_S`)."""
        if math.isnan(seconds):  # min/max would pass NaN through to the loop's timer
            raise ProtocolError("wait timeout is NaN: give seconds (capped at "
                                f"{MAX_WAIT_S:g})")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(seconds, 0.0), MAX_WAIT_S)
        while True:
            result = self.poll(rooms)
            free = set(result.releasable)
            pending = [r for r, s in zip(rooms, result.statuses, strict=True)
                       if s not in (UNKNOWN_ROOM, KVPoll.Success, KVPoll.Failed) or r not in free]
            remaining = deadline - loop.time()
            if not pending or remaining <= 0 or (any_done and len(pending) < len(rooms)):
                return result
            await self.core.wait_changed(remaining)

    # ---- peers and time ---------------------------------------------------------------

    @abc.abstractmethod
    def on_control(self, msg: control.ControlMessage) -> None:
        """A control message from a peer (already authenticated and decoded)."""

    @abc.abstractmethod
    def peer_refused(self, endpoint: str, instance: str, why: str, offset_s: float,
                     window_s: float) -> None:
        """Peer ``endpoint`` and this daemon cannot act on each other's frames: ``why``
        ``instance`` -- it refused a frame sealed for a previous instance of it (it is
        ``instance`` now); ``clock_skew`` -- its clock minus this daemon's is ``offset_s``
        seconds, beyond a ``window_s`` freshness window (it refused our frame, or we got
        one of its). The rooms that depend on it fail now with kind ``peer`` (S09, K40)."""

    @abc.abstractmethod
    def tick(self) -> None:
        """Deadlines (called by the daemon's sweep)."""

    # ---- lifecycle --------------------------------------------------------------------

    @abc.abstractmethod
    def start(self) -> None:
        """Start the side's background loops."""

    @abc.abstractmethod
    def engine_registered(self, args: RankArgs) -> None:
        """The engine registered its KV pool (again)."""

    @abc.abstractmethod
    async def engine_released(self, failure: RoomFailure | None = None) -> None:
        """The engine is gone: fail its rooms (aborted, or with ``failure``: its
        registration was dropped, S16); return once nothing reads its memory."""

    @abc.abstractmethod
    def engine_lost(self, failure: RoomFailure) -> None:
        """The engine's memory no longer stands (S16): fail every unfinished room with
        ``failure`` now; :meth:`engine_released` with the same failure follows."""

    @abc.abstractmethod
    def unfinished(self) -> list[int]:
        """Rooms that have not ended."""

    @abc.abstractmethod
    async def drain_done(self) -> None:
        """SIGTERM, after in-flight rooms had their chance: final clean-ups."""

    @abc.abstractmethod
    def snapshot(self) -> Snapshot:
        """Values for status and metrics."""

    def summary(self) -> tuple[dict[str, int], dict[str, int]]:
        """Rooms by state and table sizes (what /health shows): by default from
        :meth:`snapshot`; a side may answer without building every room and peer row
        (a /health with thousands of rooms and peers stays cheap, K41)."""
        snap = self.snapshot()
        return snap.by_state, snap.tables

    # ---- effects ----------------------------------------------------------------------

    def run_call(self, event: Callable[[], list[Effect]]) -> None:
        """Perform the effects of an engine event; if the machine refused the call, perform
        what it decided before refusing (``RoomError.effects``) and raise the error."""
        try:
            effects = event()
        except RoomError as exc:
            self.run(exc.effects)  # type: ignore[arg-type]
            raise
        self.run(effects)

    def run(self, effects: list[Effect]) -> None:
        """Perform effects in order (role-specific ones in :meth:`perform`)."""
        for eff in effects:
            match eff:
                case Wake():
                    self.core.notify()
                case Ended():
                    self._ended(eff)
                case ForgetPeer():
                    self.forget_peer(eff.endpoint)
                case _:
                    self.perform(eff)
        self.core.on_change()

    def forget_peer(self, endpoint: str) -> None:
        """A peer the machine forgot: drop what is held for it outside the machine (its
        control socket, instance and clock offset, K39)."""
        self.core.control.forget(endpoint)

    @abc.abstractmethod
    def perform(self, eff: Effect) -> None:
        """A role-specific effect."""

    def _ended(self, eff: Ended) -> None:
        events = self.core.events
        if eff.status == KVPoll.Success:
            self.core.counters.rooms_succeeded += 1
            events.room_done(self.role, eff.room, None, eff.nbytes, eff.seconds, eff.peer)
            return
        assert eff.failure is not None
        self.core.counters.rooms_failed += 1
        events.room_done(self.role, eff.room, eff.failure, eff.nbytes, eff.seconds, eff.peer)
        self.failure_log.add(eff.room, eff.peer, eff.failure)

    # ---- peer liveness (for snapshots) --------------------------------------------------

    def wall(self, t: float) -> float | None:
        """An instant of the daemon's clock (``core.clock``) as unix seconds; None for 0
        (never)."""
        return round(time.time() - (self.core.clock() - t), 3) if t else None

    def last_error(self, *names: str) -> tuple[str, float | None]:
        """The newest error known of a peer, as (text, unix s): what
        :class:`~kvd.metrics.RoomEvents` recorded under any of ``names`` (its endpoint,
        its bootstrap address: failed rooms, sends, heartbeats); ``("", None)`` if none."""
        found: list[tuple[str, float | None]] = []
        for name in filter(None, names):
            rec = self.core.events.peer_record(name)
            if rec.last_error_time is not None:
                found.append((rec.last_error, rec.last_error_time))
        return max(found, key=lambda e: e[1] or 0.0) if found else ("", None)


def not_available(call: rpc.Call, role: str) -> RoomError:
    """The error for an engine call the other role serves."""
    return RoomError(f"{type(call).__name__} is not available on a {role} kvd")


def make_side(role: str, core: Core) -> Side:
    """The side for ``role`` (``prefill`` or ``decode``)."""
    from kvd.daemon.decode import DecodeSide
    from kvd.daemon.prefill import PrefillSide

    sides: dict[str, type[Side]] = {"prefill": PrefillSide, "decode": DecodeSide}
    return sides[role](core)
