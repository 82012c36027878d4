"""ZMQ control sockets: one ROUTER socket bound by each daemon, one DEALER per peer.

All sockets are ``zmq.asyncio`` sockets owned by the daemon's loop. Sends are
bounded: a high-water mark, ``IMMEDIATE`` (nothing queued for a peer that is not
connected), a short linger on close (:data:`DROP_LINGER_S`) and a send timeout, so a
dead or frozen peer costs at most ``send_timeout`` seconds per message and never
blocks the loop.

Every frame is sealed for its recipient's instance id (case S09): the one the
sender names (a room's messages go to the instance the room is bound to), else
the one in a bounded directory ``endpoint -> instance id``, filled from the
bootstrap table (:meth:`Addressing.learn`) and from authenticated messages.
The inbound side is :class:`kvd.control.inbound.Inbound` (case S02); the bound
socket is a ROUTER (senders are DEALERs) so that it can tell connections apart, and
refuses frames larger than the largest real message before they are read (S19).
An authentic frame this daemon will not act on (for a previous instance of it, or
sealed outside its freshness window) may be answered with a typed refusal
(:meth:`Addressing.refusal`); every authenticated frame measures its sender's clock
offset (:meth:`Addressing.clock_offset`, K40).
Wire history: PUSH -> PULL with seal version 1 until seal version 2.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from kvd.addr import format_host
from kvd.control.inbound import (
    Answer,
    Inbound,
    InboundStats,
    Misaddressed,
    Received,
    Refusals,
    SourceLimiter,
)
from kvd.errors import KvdError, PeerUnreachable
from kvd.protocol import control
from kvd.security import SEAL_OVERHEAD, Authenticator

log = logging.getLogger(__name__)


PeerSendError = PeerUnreachable  # the name this module's callers use


#: Peers whose instance id (and clock offset) is remembered (least recently learned
#: forgotten first).
MAX_KNOWN_PEERS = 4096
#: A connection must finish the ZMTP handshake within this many seconds (libzmq's
#: default is 30 s): idle half-open connections do not hold file descriptors long.
HANDSHAKE_S = 5.0
#: A socket this daemon closes keeps what it already accepted for at most this long
#: (s, ZMQ_LINGER) so that a frame counted as sent is not thrown away by our own close;
#: with ``IMMEDIATE`` nothing is queued to a peer that is not connected, so a dead peer's
#: socket closes at once. Shutdown closes with no linger.
DROP_LINGER_S = 0.5


class Addressing:
    """Sealing and the instance directory, whatever carries the frames.

    Every outgoing frame is sealed for one instance: the one the caller names (the
    instance a room is bound to), else the one last learned for the endpoint. The
    directory ``endpoint -> instance id`` is bounded and filled from the bootstrap
    table (:meth:`learn`) and from authenticated messages. :class:`ControlPlane` is
    the ZMQ one; the in-process test tier has one over in-memory queues.
    """

    def __init__(self, auth: Authenticator | None = None) -> None:
        self.auth = auth if auth is not None else Authenticator(None)
        self.endpoint = ""
        self._instances: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._offsets: OrderedDict[str, float] = OrderedDict()  # endpoint -> offset (s)
        self._refusals: Refusals | None = None

    def observe_offset(self, endpoint: str, offset_s: float) -> None:
        """Record ``endpoint``'s clock minus this daemon's (s), as last measured."""
        if not endpoint:
            return
        self._offsets[endpoint] = offset_s
        self._offsets.move_to_end(endpoint)
        if len(self._offsets) > MAX_KNOWN_PEERS:
            self._offsets.popitem(last=False)

    def clock_offset(self, endpoint: str) -> float | None:
        """``endpoint``'s wall clock minus this daemon's (s) when its last authentic frame
        was sealed and received (the time in transit, usually under a millisecond, counts
        against it); None if none was measured (K40)."""
        return self._offsets.get(endpoint)

    def offsets(self) -> dict[str, float]:
        """Every measured clock offset, by endpoint (s, see :meth:`clock_offset`)."""
        return dict(self._offsets)

    def refusal(self, m: Misaddressed) -> Answer | None:
        """The typed refusal to send back for ``m`` (rate-limited, never larger than the
        frame, never to a refusal: :class:`~kvd.control.inbound.Refusals`), or None."""
        if self._refusals is None:
            self._refusals = Refusals(self.endpoint, self.auth.instance_id, self.auth.max_skew)
        return self._refusals.answer(m)

    @property
    def refusal_stats(self) -> dict[str, int]:
        """Refusals sent and not sent (``limited``, ``oversize``, ``unanswerable``)."""
        return vars(self._refusals.stats).copy() if self._refusals is not None else {}

    def learn(self, endpoint: str, instance_id: str | None, at: float = 0.0) -> None:
        """Remember that ``endpoint`` is served by ``instance_id`` (frames to it are
        sealed for that instance), as claimed at ``at`` (s since the epoch).

        The most recent claim wins: a message's claim dates from its seal, so a late
        frame of a dead instance does not undo what its successor said. A claim without
        a date (0, the bootstrap table's) only fills a gap. None is ignored.
        """
        if not instance_id:
            return
        known = self._instances.get(endpoint)
        if known is not None and known[1] > at:
            return
        self._instances[endpoint] = (instance_id, at)
        self._instances.move_to_end(endpoint)
        if len(self._instances) > MAX_KNOWN_PEERS:
            self._instances.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """Drop what is known of ``endpoint`` (its instance, its clock offset): the peer's
        entry ended (K39); a later message or lookup teaches them again."""
        self._instances.pop(endpoint, None)
        self._offsets.pop(endpoint, None)
        self.drop(endpoint)

    def drop(self, endpoint: str, linger_s: float = DROP_LINGER_S) -> None:
        """Close whatever carries frames to ``endpoint`` (nothing here)."""

    def instance_of(self, endpoint: str) -> str | None:
        """The instance id last learned for ``endpoint``, if any."""
        known = self._instances.get(endpoint)
        return known[0] if known is not None else None

    def seal(self, endpoint: str, frame: bytes, instance: str | None = None,
             at: float | None = None) -> bytes:
        """``frame`` sealed for ``instance``, else for the instance learned for
        ``endpoint``, dated ``at`` (None: now; see :meth:`Authenticator.seal`); raises
        :class:`PeerSendError` when neither is known (with a secret, nothing can be
        addressed to it)."""
        instance = instance or self.instance_of(endpoint)
        if instance is None and self.auth.enabled:
            raise PeerSendError(f"control send to {endpoint}: its instance id is unknown "
                                f"(not learned from the bootstrap table or a message)")
        return self.auth.seal(frame, instance or "", at)

    async def _learning(self, source: AsyncIterator[Received]
                        ) -> AsyncIterator[control.ControlMessage | Misaddressed]:
        async for got in source:
            msg = got.message
            if isinstance(msg, control.Refused):
                # dated in this daemon's own clock (the refused frame's time): its seal
                # says nothing of the peer's clock, its offset does (theirs minus ours)
                self.observe_offset(msg.endpoint, -msg.offset_s)
            else:
                self.observe_offset(msg.endpoint, got.offset_s)
            if got.refused != "clock_skew":  # a skewed date would outrank later claims
                self.learn(msg.endpoint, msg.instance_id, got.sent_at)
            yield (Misaddressed(msg, got.refused, got.sent_at, got.offset_s, got.size)
                   if got.refused else msg)


class ControlPlane(Addressing):
    """The daemon's authenticated control sockets.

    ``bind(host, port)`` opens the ROUTER socket (port 0 picks a free one);
    ``send(endpoint, frame, instance)`` seals a frame for the recipient's instance and
    pushes it; ``messages()`` yields authenticated inbound messages (see
    :class:`Inbound`).
    """

    def __init__(self, auth: Authenticator | None = None, send_timeout: float = 5.0,
                 hwm: int = 10000, max_frame: int = 64 << 20,
                 limiter: SourceLimiter | None = None) -> None:
        super().__init__(auth)
        self.ctx = zmq.asyncio.Context()
        self.send_timeout = send_timeout
        self.hwm = hwm
        # no real message is larger (S19): the socket drops anything bigger unread
        self.max_frame = min(max_frame, control.max_frame())
        self._limiter = limiter
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self.inbound: Inbound | None = None

    @property
    def stats(self) -> InboundStats:
        """Counts of the inbound pipeline (all zero before :meth:`bind`)."""
        return self.inbound.stats if self.inbound is not None else InboundStats()

    def bind(self, host: str, port: int) -> str:
        """Bind the inbound socket; returns its ``tcp://host:port`` endpoint."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame + SEAL_OVERHEAD)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        addr = f"tcp://{format_host(host)}"
        try:
            if port:
                sock.bind(f"{addr}:{port}")
            else:
                port = sock.bind_to_random_port(addr)
        except zmq.ZMQError as exc:
            sock.close()
            raise KvdError(f"cannot bind control socket {addr}:{port}: {exc}") from exc
        self._pull = sock
        self.inbound = Inbound(sock, self.auth, self.max_frame, self._limiter)
        self.endpoint = f"{addr}:{port}"
        return self.endpoint

    def messages(self) -> AsyncIterator[control.ControlMessage | Misaddressed]:
        """Authenticated inbound messages, forever; an authentic message sealed for
        another instance comes as :class:`Misaddressed` (not to be acted on). Each one
        teaches the directory its sender's instance (:meth:`learn`)."""
        assert self.inbound is not None, "bind() first"
        return self._learning(self.inbound.messages())

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._push[endpoint] = self._new_socket(endpoint)
        return sock

    def _new_socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock

    async def send(self, endpoint: str, frame: bytes, instance: str | None = None,
                   at: float | None = None) -> None:
        """Seal ``frame`` for ``instance`` (else the instance learned for ``endpoint``,
        see :meth:`seal`), dated ``at`` (None: now), and push it there.

        Raises :class:`PeerSendError` after the send timeout, or at once when the
        recipient's instance is unknown.
        """
        frame = self.seal(endpoint, frame, instance, at)
        sock = self._socket(endpoint)
        try:
            await asyncio.wait_for(sock.send(frame, copy=False), self.send_timeout)
        except (TimeoutError, zmq.ZMQError) as exc:
            self.drop(endpoint)
            raise PeerSendError(f"control send to {endpoint} failed: "
                                f"{exc or f'timed out after {self.send_timeout:.1f}s'}") from exc

    async def send_once(self, endpoint: str, frame: bytes, instance: str | None = None,
                        at: float | None = None) -> None:
        """:meth:`send` to an endpoint that need not be a peer (a refusal's recipient):
        over the peer's socket when one is open (in order with the rest), else over a
        socket of its own, closed once the frame left (lingering at most
        :data:`DROP_LINGER_S`), so answering a stranger keeps nothing open (K39, S08).
        Raises as :meth:`send`."""
        if endpoint in self._push:
            await self.send(endpoint, frame, instance, at)
            return
        frame = self.seal(endpoint, frame, instance, at)
        sock = self._new_socket(endpoint)
        try:
            await asyncio.wait_for(sock.send(frame, copy=False), self.send_timeout)
        except (TimeoutError, zmq.ZMQError) as exc:
            raise PeerSendError(f"control send to {endpoint} failed: "
                                f"{exc or f'timed out after {self.send_timeout:.1f}s'}") from exc
        finally:
            sock.close(linger=int(DROP_LINGER_S * 1000))

    def drop(self, endpoint: str, linger_s: float = DROP_LINGER_S) -> None:
        """Close the socket to ``endpoint`` (it is re-created on the next send); frames it
        already accepted may still leave for ``linger_s`` seconds."""
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=int(linger_s * 1000))

    def close(self) -> None:
        """Close every socket (no linger) and the context."""
        for ep in list(self._push):
            self.drop(ep, linger_s=0.0)
        if self._pull is not None:
            self._pull.close(linger=0)
        self.ctx.term()
