"""The inbound control pipeline: ZMQ frames in, authenticated control messages out.

Case S02: one process sending tiny frames to the control port froze the daemon,
because the receive loop awaited one frame at a time and an await on a frame that
is already there never yields to the event loop. Here the loop:

1. waits until the socket is readable, then reads at most ``batch`` frames or
   messages (a ``Batch`` frame counts its messages; or ``budget_s`` seconds' worth)
   without awaiting, and yields to the event loop
   after every batch — HTTP, the engine RPC, heartbeats and timers get a turn
   however fast frames arrive;
2. names the source of every frame by its ZMQ connection: the control socket is a
   ROUTER, which prefixes every message with the routing id of the connection it
   came on. ``Frame.get("Peer-Address")`` names only the peer's IP (verified with
   pyzmq 27 / libzmq 4.3), which every daemon on one host shares, so it could not
   tell a flooder from a healthy peer on loopback;
3. drops frames from a source in the penalty box before any work, and
   unauthenticated frames after the O(1) seal check (:meth:`Authenticator.open`)
   and before any parsing; a source whose unauthenticated frames exceed its
   :class:`SourceLimiter` budget goes into the penalty box;
4. decodes what is left with the versioned codec (a ``Batch`` frame, one seal over
   several messages, yields each of them in order). A frame that a holder of the
   secret sealed for another instance (this daemon restarted since the sender
   looked it up, or a replay to another server) is not a message to act on: it is
   handed on as :class:`Misaddressed`, which the daemon only counts (it never
   answers one: a decode learns of a prefill's restart from its heartbeat).

Every drop is counted in :class:`InboundStats` and logged at most once per kind.
ZMQ itself fair-queues between connections, so a flooding connection gets no more
than its share of each batch and a healthy peer's frames are not stuck behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvd.errors import AuthError, ProtocolError, StaleMessage, WrongRecipient
from kvd.protocol import control
from kvd.security import Authenticator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Received:
    """An authenticated control message and its seal time (s since the epoch, by the
    sender's clock). ``misaddressed``: sealed for another instance of this address."""

    message: control.ControlMessage
    sent_at: float
    misaddressed: bool = False


@dataclass(frozen=True)
class Misaddressed:
    """An authentic control message sealed for another instance of this address: never
    acted on nor answered, only counted (``misaddressed`` in the daemon's totals)."""

    message: control.ControlMessage


@dataclass
class InboundStats:
    """Counts of the inbound pipeline (frames, since start)."""

    received: int = 0
    accepted: int = 0
    misaddressed: int = 0        # authentic, sealed for another instance (also counted below)
    auth_failures: int = 0       # seal missing, forged, stale, replayed or misaddressed
    protocol_errors: int = 0     # authenticated but not a valid control message
    penalized: int = 0           # dropped unread: the source is in the penalty box
    penalties: int = 0           # times a source was put in the penalty box

    @property
    def dropped(self) -> int:
        """Every frame that did not become a message."""
        return self.auth_failures + self.protocol_errors + self.penalized


@dataclass
class _Source:
    tokens: float
    last: float
    blocked_until: float = 0.0
    offences: int = 0


class SourceLimiter:
    """Per-source budget of unauthenticated frames, with a penalty box. PURE.

    Each source starts with ``burst`` strikes; one strike comes back every
    ``1 / refill_per_s`` seconds. A source out of strikes is blocked for
    ``penalty_s`` seconds, doubled for each further offence up to ``max_penalty_s``.
    Only sources that misbehaved are tracked, at most ``max_sources`` of them (the
    least recently seen is forgotten first: forgetting a source only gives it a
    fresh budget). Times are seconds of ``clock`` (monotonic).
    """

    def __init__(self, burst: int = 16, refill_per_s: float = 1.0, penalty_s: float = 10.0,
                 max_penalty_s: float = 300.0, max_sources: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or refill_per_s < 0 or penalty_s <= 0 or max_sources < 1:
            raise ValueError("burst >= 1, refill_per_s >= 0, penalty_s > 0, max_sources >= 1")
        self.burst, self.refill, self.penalty = burst, refill_per_s, penalty_s
        self.max_penalty, self.max_sources, self.clock = max_penalty_s, max_sources, clock
        self._sources: OrderedDict[bytes, _Source] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sources)

    def blocked(self, source: bytes) -> bool:
        """True while ``source`` is in the penalty box (its frames are dropped unread)."""
        s = self._sources.get(source)
        return s is not None and s.blocked_until > self.clock()

    def strike(self, source: bytes) -> bool:
        """Record one unauthenticated frame from ``source``; True if this put it in the
        penalty box."""
        now = self.clock()
        s = self._sources.get(source)
        if s is None:
            s = self._sources[source] = _Source(float(self.burst), now)
            if len(self._sources) > self.max_sources:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(source)
        s.tokens = min(float(self.burst), s.tokens + (now - s.last) * self.refill)
        s.last = now
        s.tokens -= 1.0
        if s.tokens >= 0:
            return False
        s.blocked_until = now + min(self.penalty * 2 ** s.offences, self.max_penalty)
        s.offences += 1
        s.tokens = 0.0
        return True


#: Failures a healthy peer produces too (a peer that has not seen this daemon restart,
#: frames queued while one side was frozen): dropped and counted, but no strike, so
#: that its next, well-addressed frames are not penalised.
_NO_STRIKE = (WrongRecipient, StaleMessage)


class Admission:
    """What happens to one frame once read, whatever carried it: the penalty box, the
    seal, the codec; every drop counted in :attr:`stats` and logged at most once per kind.

    :class:`Inbound` feeds it from a ROUTER socket; the in-process test tier feeds it
    from in-memory queues, so both run the same checks.
    """

    def __init__(self, auth: Authenticator, max_frame: int,
                 limiter: SourceLimiter | None = None) -> None:
        self.auth, self.max_frame = auth, max_frame
        self.limiter = limiter if limiter is not None else SourceLimiter()
        self.stats = InboundStats()
        self._logged: set[str] = set()

    def admit(self, source: bytes, frame: bytes, single: bool = True) -> list[Received]:
        """The messages in ``frame`` from connection ``source`` (one, or a
        :class:`~kvd.protocol.control.Batch`'s in order: the whole batch is one sealed
        frame, admitted or dropped as one), or none (counted) if it is dropped;
        ``single``: the frame was a one-part message. Counts are per frame."""
        self.stats.received += 1
        if self.limiter.blocked(source):
            self.stats.penalized += 1
            return []
        try:
            if not single:
                raise AuthError("multi-part message (a control frame is one part)")
            opened = self.auth.open_sealed(frame)
        except WrongRecipient as exc:
            self._refused(source, exc)
            if exc.frame is None:
                return []
            self.stats.misaddressed += 1
            return self._decode(exc.frame, exc.sent_at, misaddressed=True)
        except AuthError as exc:
            self._refused(source, exc)
            return []
        return self._decode(opened.frame, opened.sent_at)

    def _decode(self, frame: bytes, sent_at: float, misaddressed: bool = False
                ) -> list[Received]:
        try:
            msgs = control.decode_many(frame, self.max_frame)
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            log.warning("dropped control frame: %s", exc)
            return []
        if not misaddressed:
            self.stats.accepted += 1
        return [Received(msg, sent_at, misaddressed) for msg in msgs]

    def _refused(self, source: bytes, exc: AuthError) -> None:
        self.stats.auth_failures += 1
        kind = str(exc).split(" (")[0]
        if not isinstance(exc, _NO_STRIKE) and self.limiter.strike(source):
            self.stats.penalties += 1
            kind = "penalty"
            exc = AuthError(f"a source ({self._peer_address()}) sent too many unauthenticated "
                            f"frames: its frames are dropped unread for a while")
        if kind not in self._logged and len(self._logged) < 64:
            self._logged.add(kind)
            # The sender is unknown: an unverified frame's claims are not repeated here.
            log.warning("dropped control frame: %s (further ones only counted)", exc)

    def _peer_address(self) -> str:
        """Where the frame last admitted came from, for the log only ("?": unknown)."""
        return "?"


class Inbound(Admission):
    """Reads one ROUTER socket in bounded batches and yields authenticated messages.

    ``batch`` (frames, and messages: see :meth:`read_batch`) and ``budget_s`` (seconds)
    bound the work between two yields to the event loop; ``max_frame`` (bytes) bounds a
    decoded frame.
    """

    def __init__(self, sock: zmq.asyncio.Socket, auth: Authenticator, max_frame: int,
                 limiter: SourceLimiter | None = None, batch: int = 256,
                 budget_s: float = 0.002) -> None:
        super().__init__(auth, max_frame, limiter)
        self._async = sock
        # Non-blocking reads on the same socket without a future per frame.
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self.batch, self.budget_s = batch, budget_s
        self._last: zmq.Frame | None = None

    async def messages(self) -> AsyncIterator[Received]:
        """Authenticated control messages, forever (cancel the consumer to stop)."""
        while True:
            await self._async.poll()  # POLLIN
            for msg in self.read_batch():
                yield msg
            await asyncio.sleep(0)  # the point of the batch: let everything else run

    def read_batch(self) -> list[Received]:
        """Read what is there, up to the batch bounds, without blocking: at most ``batch``
        frames, and no further frame once ``batch`` messages were read (a Batch frame counts
        its messages, so one read hands the loop at most ``batch - 1 + MAX_BATCH``), nor
        once ``budget_s`` passed (checked every 32 frames, and after each Batch frame)."""
        out: list[Received] = []
        deadline = time.perf_counter() + self.budget_s
        for i in range(self.batch):
            parts = self._recv()
            if parts is None:
                break
            got = self.admit(*parts)
            out += got
            if len(out) >= self.batch:
                break
            if (i % 32 == 31 or len(got) > 1) and time.perf_counter() > deadline:
                break
        return out

    def _recv(self) -> tuple[bytes, bytes, bool] | None:
        """(source, frame, well_formed) of the next message, or None if none is there.

        The routing id is copied (it is a dict key); the payload is received as a
        ``Frame`` because ``Frame.more`` is the cheap way to see a multi-part message
        (``getsockopt(RCVMORE)`` costs more than the receive itself) and because the
        log needs its ``Peer-Address``.
        """
        try:
            source = self._sync.recv(zmq.NOBLOCK)
            frame = self._sync.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self._last = frame
        single = not frame.more
        while not single and self._sync.recv(zmq.NOBLOCK, copy=False).more:
            pass  # drain the rest of a multi-part message: it is no control frame
        return source, frame.bytes, single

    def _peer_address(self) -> str:
        """The IP address of the connection last read from (for the log only)."""
        try:
            return str(self._last.get("Peer-Address")) if self._last is not None else "?"
        except (zmq.ZMQError, TypeError):
            return "?"
