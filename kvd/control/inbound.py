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
   looked it up, or a replay to another server), or sealed outside the freshness
   window (the sender's clock is off, K40), is not a message to act on: it is
   handed on as :class:`Misaddressed` (``why``), which the daemon counts and may
   answer with a typed refusal (:class:`Refusals`: rate-limited per peer, never
   larger than the frame, never to a refusal). A skewed frame's body is hashed only
   while :attr:`Admission.skew_gate` allows (its nonce cannot be remembered, so a
   captured one could be replayed at will: its O(n) check is budgeted per connection).

Case S19: frames are capped at the largest real message (the socket's ``MAXMSGSIZE``,
:func:`kvd.protocol.control.max_frame`), read without a copy (the seal is checked on
ZMQ's buffer), and the batch budget is checked after every frame, in seconds and bytes.

Every drop is counted in :class:`InboundStats` and logged at most once per kind; an
authentic frame that does not decode (a field past its bound: an integer outside its wire
bound, a list or text too long) is logged naming the field, at most once a second per
connection after a burst.
ZMQ itself fair-queues between connections, so a flooding connection gets no more
than its share of each batch and a healthy peer's frames are not stuck behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import typing
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvd.errors import AuthError, ProtocolError, Skewed, StaleMessage, WrongRecipient
from kvd.protocol import control
from kvd.security import SEAL_OVERHEAD, Authenticator, Buffer

log = logging.getLogger(__name__)

#: The reasons a :class:`~kvd.protocol.control.Refused` can give (its ``why``).
REFUSED_WHY: frozenset[str] = frozenset(typing.get_args(control.RefusedWhy))


@dataclass(frozen=True)
class Received:
    """An authenticated control message and its seal time (s since the epoch, by the
    sender's clock). ``refused``: why it is not to be acted on ("" if it is:
    ``instance``, sealed for another instance of this address; ``clock_skew``, sealed
    outside the freshness window); ``offset_s``: its seal time minus this daemon's clock
    at receipt (s); ``size``: bytes of the sealed frame it came in."""

    message: control.ControlMessage
    sent_at: float
    refused: str = ""
    offset_s: float = 0.0
    size: int = 0

    @property
    def misaddressed(self) -> bool:
        return bool(self.refused)


@dataclass(frozen=True)
class Misaddressed:
    """An authentic control message this daemon does not act on, perhaps answered with a
    :class:`~kvd.protocol.control.Refused` (:class:`Refusals`). ``why`` (one of
    :data:`REFUSED_WHY`): ``instance`` or ``clock_skew`` when the seal refused it (see
    :class:`Received`; counted as ``misaddressed``, ``skewed`` in the daemon's totals),
    ``unregistered`` or ``full`` when a room machine dropped it (K16). ``sent_at``,
    ``offset_s`` (s) and ``size`` (bytes) as in :class:`Received` (``sent_at`` 0: not
    known, the answer is dated now)."""

    message: control.ControlMessage
    why: str = "instance"
    sent_at: float = 0.0
    offset_s: float = 0.0
    size: int = 0


class Buckets:
    """Token buckets per key, bounded, plus one shared by all keys. PURE.

    Each key may pass ``burst`` times at once and ``per_s`` times a second after that;
    all keys together ``total_per_s`` a second (burst ``4 * burst``). At most ``max_keys``
    are tracked (the least recently seen forgotten first: forgetting one only gives it a
    fresh budget). Times are seconds of ``clock`` (monotonic).
    """

    def __init__(self, per_s: float, burst: int, total_per_s: float, max_keys: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if per_s < 0 or burst < 1 or total_per_s < 0 or max_keys < 1:
            raise ValueError("per_s >= 0, burst >= 1, total_per_s >= 0, max_keys >= 1")
        self.per_s, self.burst, self.total_per_s = per_s, burst, total_per_s
        self.max_keys, self.clock = max_keys, clock
        self._keys: OrderedDict[object, list[float]] = OrderedDict()  # key -> [tokens, at]
        self._total = [4.0 * burst, clock()]

    def __len__(self) -> int:
        return len(self._keys)

    def take(self, key: object) -> bool:
        """True (and one token spent from ``key``'s bucket and the shared one) if both
        have a token now."""
        now = self.clock()
        b = self._keys.get(key)
        if b is None:
            b = self._keys[key] = [float(self.burst), now]
            if len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        _refill(b, now, self.per_s, float(self.burst))
        _refill(self._total, now, self.total_per_s, 4.0 * self.burst)
        if b[0] < 1.0 or self._total[0] < 1.0:
            return False
        b[0] -= 1.0
        self._total[0] -= 1.0
        return True


def _refill(bucket: list[float], now: float, rate: float, cap: float) -> None:
    bucket[0] = min(cap, bucket[0] + max(0.0, now - bucket[1]) * rate)
    bucket[1] = now


@dataclass
class RefusalStats:
    """What :class:`Refusals` decided (refusals, since start)."""

    sent: int = 0
    limited: int = 0      # the peer (or all peers) had no budget left
    oversize: int = 0     # the answer would have been larger than the frame it answers
    unanswerable: int = 0  # a refusal, or no endpoint or instance to answer to


@dataclass(frozen=True)
class Answer:
    """A refusal to send: ``frame`` (encoded, unsealed) to ``endpoint``, sealed for
    ``instance`` and dated ``at`` (the refused frame's seal time, in its sender's clock;
    None: now, for a message a room machine dropped after it was admitted)."""

    endpoint: str
    instance: str
    frame: bytes
    at: float | None


class Refusals:
    """Which refused frames get an answer, and what it says. PURE (clock injected).

    Rules (issue 19's "push, don't wait", bounded and never amplifying): only an authentic
    frame is answered (the caller hands only :class:`Misaddressed`, which passed the MAC);
    never a refusal (no loops); at most ``per_s`` a second per peer endpoint (burst
    ``burst``) and ``total_per_s`` for all; the answer, sealed, is never larger than the
    frame it answers. ``endpoint``/``instance`` are this daemon's, ``window_s`` its
    freshness window (s).
    """

    def __init__(self, endpoint: str, instance: str, window_s: float, per_s: float = 2.0,
                 burst: int = 4, total_per_s: float = 64.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint, self.instance, self.window_s = endpoint, instance, window_s
        self.buckets = Buckets(per_s, burst, total_per_s, clock=clock)
        self.stats = RefusalStats()

    def answer(self, m: Misaddressed) -> Answer | None:
        """The refusal to send for ``m``, or None (counted in :attr:`stats`)."""
        msg = m.message
        if isinstance(msg, control.Refused) or not msg.endpoint or not msg.instance_id:
            self.stats.unanswerable += 1
            return None
        why = typing.cast(control.RefusedWhy, m.why if m.why in REFUSED_WHY else "instance")
        refusal = control.Refused(why=why, endpoint=self.endpoint, instance_id=self.instance,
                                  offset_s=round(m.offset_s, 3),
                                  window_s=self.window_s if why == "clock_skew" else 0.0)
        frame = control.encode(refusal)
        if len(frame) >= m.size - SEAL_OVERHEAD:  # sealed alike: compare what is inside
            self.stats.oversize += 1
            return None
        if not self.buckets.take(msg.endpoint):
            self.stats.limited += 1
            return None
        self.stats.sent += 1
        return Answer(msg.endpoint, msg.instance_id, frame, m.sent_at or None)


@dataclass
class InboundStats:
    """Counts of the inbound pipeline (frames, since start)."""

    received: int = 0
    accepted: int = 0
    misaddressed: int = 0        # authentic, sealed for another instance (also counted below)
    skewed: int = 0              # authentic, sealed outside the window (also counted below)
    bytes_read: int = 0          # bytes of every frame read
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
                 limiter: SourceLimiter | None = None,
                 skew_gate: Buckets | None = None) -> None:
        self.auth, self.max_frame = auth, max_frame
        self.limiter = limiter if limiter is not None else SourceLimiter()
        #: how often a skewed frame's body is checked (per connection, and in all)
        self.skew_gate = skew_gate if skew_gate is not None else Buckets(1.0, 2, 32.0)
        self.stats = InboundStats()
        self._logged: set[str] = set()
        #: how often a malformed authenticated frame is logged (per connection, and in all)
        self.malformed_log = Buckets(1.0, 8, 8.0, max_keys=256)

    def admit(self, source: bytes, frame: Buffer, single: bool = True) -> list[Received]:
        """The messages in ``frame`` from connection ``source`` (one, or a
        :class:`~kvd.protocol.control.Batch`'s in order: the whole batch is one sealed
        frame, admitted or dropped as one), or none (counted) if it is dropped;
        ``single``: the frame was a one-part message. ``frame`` may be a view of the
        transport's buffer: nothing is copied before the seal is checked (S19). Counts
        are per frame."""
        self.stats.received += 1
        self.stats.bytes_read += len(frame)
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
            return self._decode(exc.frame, exc.sent_at, "instance",
                                exc.sent_at - self.auth.clock(), len(frame), source)
        except Skewed as exc:
            self._refused(source, exc)
            return self._skewed(source, frame, exc)
        except AuthError as exc:
            self._refused(source, exc)
            return []
        return self._decode(opened.frame, opened.sent_at, source=source)

    def _skewed(self, source: bytes, frame: Buffer, exc: Skewed) -> list[Received]:
        """An authentic frame sealed outside the window: decoded (to learn whom to tell)
        only while the skew gate allows, since its O(n) body check can be replayed."""
        if not self.skew_gate.take(source):
            return []
        try:
            body = self.auth.skewed_body(frame)
        except AuthError as exc2:
            self._refused(source, exc2)
            return []
        self.stats.skewed += 1
        return self._decode(body, exc.sent_at, "clock_skew", exc.offset_s, len(frame), source)

    def _decode(self, frame: Buffer, sent_at: float, refused: str = "",
                offset_s: float = 0.0, size: int = 0, source: bytes = b"") -> list[Received]:
        """The messages of an authentic ``frame``, or none if it does not decode: a field
        past its bound (an integer outside its wire bound, a list or text too long, S19),
        an unknown tag, a frame of another wire version. Such a frame is refused whole --
        nothing in it reaches a room machine, and nothing else of its sender is touched:
        its other frames, and its rooms, go on (an authentic sender takes no strike) --
        counted in ``protocol_errors`` and logged naming the field (msgspec's path, e.g.
        ``$.messages[1].room``), at most :attr:`malformed_log` allows per connection."""
        try:
            msgs = control.decode_many(frame, self.max_frame)  # type: ignore[arg-type]
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            if self.malformed_log.take(source):
                log.warning("refused an authentic control frame from %s: %s (nothing in it "
                            "was acted on; further ones from it are counted, logged at most "
                            "once a second)", self._peer_address(), exc)
            return []
        if not refused:
            self.stats.accepted += 1
            offset_s = sent_at - self.auth.clock()
        return [Received(msg, sent_at, refused, offset_s, size) for msg in msgs]

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
                 budget_s: float = 0.002, budget_bytes: int = 8 << 20) -> None:
        super().__init__(auth, max_frame, limiter)
        self._async = sock
        # Non-blocking reads on the same socket without a future per frame.
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self.batch, self.budget_s, self.budget_bytes = batch, budget_s, budget_bytes
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
        once ``budget_s`` passed or ``budget_bytes`` were read (both checked after every
        frame: one frame is at most ``max_frame`` bytes, S19)."""
        out: list[Received] = []
        deadline = time.perf_counter() + self.budget_s
        start = self.stats.bytes_read
        for _ in range(self.batch):
            parts = self._recv()
            if parts is None:
                break
            out += self.admit(*parts)
            if len(out) >= self.batch or time.perf_counter() > deadline or \
                    self.stats.bytes_read - start >= self.budget_bytes:
                break
        return out

    def _recv(self) -> tuple[bytes, Buffer, bool] | None:
        """(source, frame, well_formed) of the next message, or None if none is there.

        The routing id is copied (it is a dict key); the payload is received as a
        ``Frame`` because ``Frame.more`` is the cheap way to see a multi-part message
        (``getsockopt(RCVMORE)`` costs more than the receive itself) and because the
        log needs its ``Peer-Address``; it is handed on as a view of ZMQ's buffer, so a
        forged frame is refused without a copy (S19).
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
        return source, frame.buffer, single

    def _peer_address(self) -> str:
        """The IP address of the connection last read from (for the log only)."""
        try:
            return str(self._last.get("Peer-Address")) if self._last is not None else "?"
        except (zmq.ZMQError, TypeError):
            return "?"
