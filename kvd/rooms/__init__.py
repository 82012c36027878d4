"""The per-room protocol of both sides, as pure state machines.

* :mod:`kvd.rooms.state` — leaf value types: :class:`KVPoll`, :class:`FailureKind`,
  :class:`RoomFailure`, the deadline table :class:`Timeouts`.
* :mod:`kvd.rooms.effects` — what a machine asks its daemon to do.
* :mod:`kvd.rooms.sender` — the prefill side (senders).
* :mod:`kvd.rooms.receiver` — the decode side (receivers).
* :mod:`kvd.rooms.tombstones` — bounded memory of ended rooms.

No module here does I/O, reads a clock or creates a task: events come in as
method calls with ``now`` (monotonic seconds) as an argument, effects go out
as values. The daemon (:mod:`kvd.daemon.prefill`, :mod:`kvd.daemon.decode`) performs them.
Only :mod:`kvd.rooms.state` is imported here, so that the engine client can
use ``KVPoll`` without pulling in the machines.
"""

from kvd.rooms.state import UNKNOWN_ROOM, FailureKind, KVPoll, RoomFailure, Timeouts

__all__ = ["UNKNOWN_ROOM", "FailureKind", "KVPoll", "RoomFailure", "Timeouts"]
