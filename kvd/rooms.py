"""Per-room transfer states: SGLang's KVPoll numbering and the monotonic state rule.

PURE: no I/O. The daemon's loop owns every :class:`RoomState`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class KVPoll(enum.IntEnum):
    """Room status, numbered exactly as SGLang's ``disaggregation.base.KVPoll``."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


#: Sentinel returned by ``poll`` for a room kvd does not know (never raised).
UNKNOWN_ROOM = -1


@dataclass
class RoomState:
    """State of one room on one side, with the time it entered that state.

    Rules (mirrors SGLang's connector, made strict): ``Failed`` is sticky and
    carries a reason; every other state only moves up; ``Success`` is terminal.
    Times are ``time.monotonic()`` seconds.
    """

    room: int
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    since: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        """True once the room is Success or Failed."""
        return self.status in (KVPoll.Success, KVPoll.Failed)

    def advance(self, status: KVPoll) -> bool:
        """Move up to ``status``; returns False (and changes nothing) if not an upgrade.

        Failed must go through :meth:`fail` so that it always has a reason.
        """
        if status == KVPoll.Failed:
            raise ValueError("use fail(reason) to fail a room")
        if self.done or status <= self.status:
            return False
        self.status = status
        self.since = time.monotonic()
        return True

    def fail(self, reason: str) -> bool:
        """Mark Failed with ``reason``; returns False if the room already ended."""
        if self.done:
            return False
        self.status = KVPoll.Failed
        self.reason = reason
        self.since = time.monotonic()
        return True
