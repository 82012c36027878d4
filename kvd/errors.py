"""The kvd exception tree.

Every error kvd raises derives from :class:`KvdError`. Errors from the outside
world (Mooncake integer codes, ZMQ errors, pydantic validation errors, socket
errors) are translated into this tree at the boundary where they occur, chained
with ``raise ... from exc``, and carry the room and peer in their message::

    KvdError
    ├── ConfigError            invalid settings (every problem listed at once)
    ├── ProtocolError          malformed, oversized or unknown-version frame
    │   └── AuthError            missing or forged authentication
    │       ├── WrongRecipient         addressed to another daemon instance
    │       └── StaleMessage           outside the time window, or a replay
    │           └── Skewed                 authentic, but sealed outside the window
    ├── LayoutError            KV layout math refused the request
    │   ├── IndexLengthMismatch  src/dst page counts disagree
    │   └── BoundsError          a descriptor would touch unregistered bytes
    ├── RegistrationError      KV args / memory handles refused
    │   └── HandleError          a memory handle cannot be imported (file, fd, CUDA IPC)
    │       └── CudaUnavailable    no CUDA bindings, driver or device for a cuda_ipc handle
    ├── RoomError              unknown room, duplicate room, wrong state
    ├── TransportError         the transfer engine failed (init, register, write)
    ├── PeerUnreachable        a peer kvd did not take a control message in time
    ├── ClockSkew              a peer's clock is beyond the freshness window (K40)
    ├── BootstrapError         bootstrap registration or lookup failed
    │   ├── NotReady             fewer ranks registered than the instance needs (503)
    │   ├── NotFound             no rank under the requested key (404)
    │   ├── Conflict             a registration contradicts the instance (409)
    │   └── DiscoveryError       the discovery store (etcd) failed or refused
    │       ├── DiscoveryUnavailable  no etcd endpoint answered
    │       └── DiscoveryAuthError    etcd refused the credentials
    ├── RpcError               engine <-> kvd RPC failed
    │   ├── KvdUnreachable       the local kvd cannot be reached
    │   └── UntrustedDaemon      the socket is served by a user the engine does not trust
    ├── DaemonUnreachable      no kvd answered at an HTTP address (CLI)
    └── KVTransferError        a room ended Failed (what the engine sees)
"""

from __future__ import annotations

from collections.abc import Sequence


class KvdError(Exception):
    """Base of every error raised by kvd."""


class ConfigError(KvdError):
    """Settings are invalid; the message lists every problem found."""


class ProtocolError(KvdError):
    """A frame could not be decoded: bad magic, unknown version, wrong shape or size."""


class AuthError(ProtocolError):
    """A message's authentication is missing, wrong, too old, or a replay."""


class WrongRecipient(AuthError):
    """A message addressed to another daemon instance: a replay to another server, or a
    sender that has not yet seen this daemon restart (case S09).

    ``frame`` is the inner frame when the message was otherwise authentic (a holder of
    the secret sealed it, fresh and not replayed), else None; ``sent_at`` is its seal
    time (s since the epoch).
    """

    def __init__(self, message: str, frame: bytes | memoryview | None = None,
                 sent_at: float = 0.0) -> None:
        super().__init__(message)
        self.frame = frame
        self.sent_at = sent_at


class StaleMessage(AuthError):
    """A message outside the ``auth_max_skew`` window, or whose nonce was seen before."""


class Skewed(StaleMessage):
    """An authentic frame (MAC and body good) sealed outside the ``auth_max_skew`` window:
    its sender's clock disagrees with this daemon's (case K40), or it is an old capture.

    ``frame`` is the inner frame (None when its body was not checked: see
    :meth:`kvd.security.Authenticator.open_sealed`), ``sent_at`` its seal time and
    ``offset_s`` the sender's clock minus this daemon's at receipt (seconds; includes the
    frame's time in transit).
    """

    def __init__(self, message: str, frame: bytes | memoryview | None, sent_at: float,
                 offset_s: float) -> None:
        super().__init__(message)
        self.frame = frame
        self.sent_at = sent_at
        self.offset_s = offset_s


class ClockSkew(KvdError):
    """A peer's wall clock is further from this daemon's than the freshness window
    (``auth_max_skew``): neither can trust the other's seals (case K40). Rooms that need
    the peer fail with kind ``peer`` and this message, which names the measured offset."""


class LayoutError(KvdError):
    """The layout planner refused to build descriptors for a request."""


class IndexLengthMismatch(LayoutError):
    """Source and destination page index arrays have different lengths."""


class BoundsError(LayoutError):
    """A descriptor range falls outside every registered buffer."""


class RegistrationError(KvdError):
    """KV args, memory handles or a rank registration were refused."""


class HandleError(RegistrationError):
    """A memory handle was refused: bad file, descriptor, range or CUDA IPC handle."""


class CudaUnavailable(HandleError):
    """A ``cuda_ipc`` handle cannot be imported here: no CUDA bindings, driver or device."""


class RoomError(KvdError):
    """A room operation is invalid: unknown room, room already active, wrong state.

    ``effects``: what a room machine decided before it refused the call (e.g. the room
    failed, its peers must hear it); the daemon performs them all the same."""

    def __init__(self, message: str, effects: Sequence[object] = ()) -> None:
        super().__init__(message)
        self.effects = list(effects)


class TransportError(KvdError):
    """The transfer engine failed; carries the Mooncake return code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class WriteCancelled(TransportError):
    """A write stopped because the room attempt it belonged to ended (K43): its entries
    not started were dropped, those in flight returned. ``landed``/``dropped``: bytes
    written before it stopped, and bytes never written."""

    def __init__(self, message: str, landed: int = 0, dropped: int = 0) -> None:
        super().__init__(message)
        self.landed, self.dropped = landed, dropped


class PeerUnreachable(KvdError):
    """A control message could not be handed to a peer kvd within the send timeout."""


class BootstrapError(KvdError):
    """Registration with, or lookup on, the bootstrap server failed."""


class NotReady(BootstrapError):
    """Fewer ranks registered than the instance needs (HTTP 503)."""


class NotFound(BootstrapError):
    """No rank registered under the requested key (HTTP 404)."""


class DiscoveryError(BootstrapError):
    """The discovery store (etcd) refused a request or answered something unusable."""


class DiscoveryUnavailable(DiscoveryError):
    """No configured etcd endpoint answered in time."""


class DiscoveryAuthError(DiscoveryError):
    """etcd refused the configured user/password or client certificate."""


class Conflict(BootstrapError):
    """A registration contradicts the instance's sizes (HTTP 409)."""


class RpcError(KvdError):
    """The engine <-> kvd RPC failed; ``kind`` names the remote error class."""

    def __init__(self, message: str, kind: str = "RpcError") -> None:
        super().__init__(message)
        self.kind = kind


class KvdUnreachable(RpcError):
    """The local kvd daemon's engine socket cannot be reached."""


class UntrustedDaemon(RpcError):
    """The engine socket is served by a process whose uid (``SO_PEERCRED``) the engine
    does not trust: another local user holds the path (case S17). Nothing was sent.
    ``found_uid``: the server's uid; ``trusted``: the uids the client accepts."""

    def __init__(self, message: str, found_uid: int = -1,
                 trusted: Sequence[int] = ()) -> None:
        super().__init__(message, "UntrustedDaemon")
        self.found_uid = found_uid
        self.trusted = list(trusted)


class DaemonUnreachable(KvdError):
    """No kvd answered at the address (not running, wrong port, or not a kvd)."""


class KVTransferError(KvdError):
    """A room ended in ``KVPoll.Failed``; carries the room id, the failure ``kind`` (a
    :class:`~kvd.rooms.state.FailureKind` value, e.g. ``"timeout"``) and the reason."""

    def __init__(self, room: int, reason: str, kind: str = "") -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.reason = reason
        self.kind = kind
