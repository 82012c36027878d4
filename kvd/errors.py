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
    ├── LayoutError            KV layout math refused the request
    │   ├── IndexLengthMismatch  src/dst page counts disagree
    │   └── BoundsError          a descriptor would touch unregistered bytes
    ├── RegistrationError      KV args / memory handles refused
    ├── RoomError              unknown room, duplicate room, wrong state
    ├── TransportError         the transfer engine failed (init, register, write)
    ├── BootstrapError         bootstrap registration or lookup failed
    ├── RpcError               engine <-> kvd RPC failed
    │   └── KvdUnreachable       the local kvd cannot be reached
    └── KVTransferError        a room ended Failed (what the engine sees)
"""

from __future__ import annotations


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

    def __init__(self, message: str, frame: bytes | None = None, sent_at: float = 0.0) -> None:
        super().__init__(message)
        self.frame = frame
        self.sent_at = sent_at


class StaleMessage(AuthError):
    """A message outside the ``auth_max_skew`` window, or whose nonce was seen before."""


class LayoutError(KvdError):
    """The layout planner refused to build descriptors for a request."""


class IndexLengthMismatch(LayoutError):
    """Source and destination page index arrays have different lengths."""


class BoundsError(LayoutError):
    """A descriptor range falls outside every registered buffer."""


class RegistrationError(KvdError):
    """KV args, memory handles or a rank registration were refused."""


class RoomError(KvdError):
    """A room operation is invalid: unknown room, room already active, wrong state."""


class TransportError(KvdError):
    """The transfer engine failed; carries the Mooncake return code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class BootstrapError(KvdError):
    """Registration with, or lookup on, the bootstrap server failed."""


class RpcError(KvdError):
    """The engine <-> kvd RPC failed; ``kind`` names the remote error class."""

    def __init__(self, message: str, kind: str = "RpcError") -> None:
        super().__init__(message)
        self.kind = kind


class KvdUnreachable(RpcError):
    """The local kvd daemon's engine socket cannot be reached."""


class KVTransferError(KvdError):
    """A room ended in ``KVPoll.Failed``; carries the room id and the reason."""

    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.reason = reason
