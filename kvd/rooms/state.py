"""Leaf value types of the room protocol. PURE; imports nothing from kvd but the leaf
:mod:`kvd.text`.

``KVPoll`` numbers states exactly as SGLang's ``disaggregation.base.KVPoll``.
``FailureKind`` is set where a failure happens and travels unchanged to the
other side, the metrics, the logs, ``/v1/status`` and ``KVTransferError``;
nothing recovers a kind from message text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvd.text import clean


class KVPoll(enum.IntEnum):
    """Room status, numbered exactly as SGLang's ``disaggregation.base.KVPoll``."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


#: What ``poll`` answers for a room kvd does not know (never raised).
UNKNOWN_ROOM = -1

TERMINAL = (KVPoll.Success, KVPoll.Failed)


class FailureKind(enum.StrEnum):
    """Why a room failed; the label of ``kvd_room_failures_total{reason}``.

    Each value is produced by exactly the code paths its docstring names.
    """

    TIMEOUT = "timeout"            # a state's deadline passed (Bootstrapping, Waiting, ...)
    ABORTED = "aborted"            # an engine, a peer or a shutdown ended the room
    HEARTBEAT = "heartbeat"        # the decode missed the prefill's heartbeats
    UNREACHABLE = "unreachable"    # a control message could not be delivered
    BOOTSTRAP = "bootstrap"        # the bootstrap lookup failed or was refused
    REGISTRATION = "registration"  # the pair's KV args were refused (layout, coverage)
    LAYOUT = "layout"              # page/aux indices or a plan refused for this room
    TRANSPORT = "transport"        # the transfer backend failed a write
    DUPLICATE = "duplicate"        # a second party claimed a bound room
    PEER = "peer"                  # the peer restarted (new instance) or forgot us

    @classmethod
    def parse(cls, value: str) -> FailureKind:
        """The kind named ``value`` (from the wire); unknown names read as ABORTED."""
        try:
            return cls(value)
        except ValueError:
            return cls.ABORTED


@dataclass(frozen=True)
class RoomFailure:
    """A room's failure: its kind, a human reason naming room/peer/phase, and where it
    was decided (``origin``: ``"prefill"`` or ``"decode"``)."""

    kind: FailureKind
    reason: str
    origin: str = ""

    def __post_init__(self) -> None:  # every reason kvd keeps: escaped and bounded (S21)
        object.__setattr__(self, "reason", clean(self.reason))


@dataclass(frozen=True)
class Timeouts:
    """The deadline table, in seconds (one place for every non-terminal state).

    * ``bootstrap``: Bootstrapping (decode: resolving prefill ranks; prefill:
      waiting for every decode rank's pages);
    * ``waiting``: WaitingForInput (decode: until the prefill reports; prefill:
      until the engine sends the first chunk);
    * ``transfer``: Transferring (prefill: chunks being written);
    * ``release``: decode-side margin after a room's write deadline before its pages
      are releasable without the prefill's confirmation (must exceed one transfer
      sub-batch and the control-plane delay: a sub-batch in flight cannot be stopped);
    * ``tombstone``: how long an ended room is remembered after it was cleared.
    """

    bootstrap: float = 300.0
    waiting: float = 300.0
    transfer: float = 120.0
    release: float = 10.0
    tombstone: float = 600.0
    finished_ttl: float = 600.0

    def limit(self, status: KVPoll) -> float | None:
        """Seconds a room may stay in ``status`` (None for terminal states)."""
        return {KVPoll.Bootstrapping: self.bootstrap, KVPoll.WaitingForInput: self.waiting,
                KVPoll.Transferring: self.transfer}.get(status)
