"""kvd's side of the shared room status table (issue 21, step A): a memfd and its writer.

One table per daemon, in a memfd handed to every engine connection that asks
(:class:`~kvd.protocol.rpc.OpenTable`). kvd's loop is its only writer
(:class:`~kvd.protocol.table.StatusTable`); what it writes is what ``Side.poll``
answers, read back after every change, so the table can only ever be a view:

- an engine call on a room (create, init, send, abort, clear) publishes that room at
  once, before its reply, so a read right after the call sees what a ``Poll`` would;
- any other change (a control message, effects performed, a wake-up) marks the table
  dirty, and callbacks on the loop re-publish every unsettled room, at most
  :data:`PUBLISH_SLICE` rooms per loop turn (K41: thousands of rooms failing one a turn
  made every turn re-publish all of them, and ``/health`` waited behind each);
- the sweep re-publishes every room held (deadlines, expiry of finished rooms) and
  beats the heartbeat readers check.

A room is *settled* once it ended and is releasable, or is unknown: only the sweep
looks at it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import mmap
import os
import time
from collections.abc import Callable, Iterable

from kvd.protocol import rpc
from kvd.protocol.table import SlotMap, StatusTable, table_bytes
from kvd.rooms.state import TERMINAL

Poll = Callable[[list[int]], rpc.PollResult]

#: ``F_SEAL_FUTURE_WRITE`` (Linux 5.1, not in Python's fcntl module before 3.12): no new
#: writable mapping and no ``write`` after it, while kvd's own mapping stays writable.
F_SEAL_FUTURE_WRITE = 0x0010
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def seal(fd: int) -> None:
    """Seal the table's memfd once kvd mapped it: it can neither shrink (no SIGBUS in
    kvd's writer) nor grow, and an engine holding the descriptor cannot map it writable
    or write it (where the kernel has ``F_SEAL_FUTURE_WRITE``; older ones get the size
    seals only). A table is a view either way: kvd never reads it."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | F_SEAL_FUTURE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)


#: Rooms the dirty re-publish writes in one loop turn (about 5 us each): a turn never
#: costs more than ~2.5 ms of it, however many rooms are unsettled (K41).
PUBLISH_SLICE = 512


class TableWriter:
    """The table, its memfd (``fd``, close-on-exec) and which rooms it holds.

    ``poll`` is the side's ``poll`` (the one source of every status written).
    Raises OSError if the memfd cannot be made or mapped.
    """

    def __init__(self, poll: Poll, nslots: int,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.poll, self.clock_ns = poll, clock_ns
        self.size = table_bytes(nslots)
        self.fd = os.memfd_create("kvd-status", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
            seal(self.fd)
        except OSError:
            os.close(self.fd)
            raise
        self.table = StatusTable.create(self.map, nslots, os.getpid())
        self.slots = SlotMap(self.table)
        self.unsettled: set[int] = set()
        self.held: set[int] = set()
        self._dirty = False  # a change came since the round in progress began
        self._round: list[int] = []  # unsettled rooms this round has yet to re-publish
        self._scheduled = False
        self.slice = PUBLISH_SLICE
        self.turns = 0  # loop turns that re-published a slice (tests)
        self.table.beat(clock_ns())

    @property
    def nslots(self) -> int:
        return self.table.nslots

    def track(self, room: int) -> None:
        """An engine call touched ``room``: place it if it is new, publish it now."""
        if room not in self.held and self.slots.place(room):
            self.held.add(room)
        if room in self.held:
            self.publish([room])

    def touch(self) -> None:
        """Something may have changed: re-publish the unsettled rooms soon, in slices of at
        most :attr:`slice` rooms, one slice per loop turn; changes that come meanwhile
        start one more round when this one ends (K41)."""
        if self._dirty or not self.unsettled:
            return
        self._dirty = True
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the sweep catches up
            asyncio.get_running_loop().call_soon(self._step)
            self._scheduled = True
            return
        self._dirty, self._round = False, []

    def _step(self) -> None:
        """One loop turn's share of the re-publish: the next :attr:`slice` rooms of the
        round (a new round of every unsettled room when the last one ended dirty)."""
        self._scheduled = False
        if not self._round and self._dirty:
            self._dirty, self._round = False, list(self.unsettled)
        if not self._round:
            return
        batch, self._round = self._round[:self.slice], self._round[self.slice:]
        self.turns += 1
        self.publish([r for r in batch if r in self.held])
        if self._round or self._dirty:
            self._schedule()

    def flush(self) -> None:
        """Re-publish every unsettled room now, if a change asked for it (explicit callers:
        a reply that must not go out before the table shows it)."""
        if self._dirty or self._round:
            self._dirty, self._round = False, []
            self.publish(list(self.unsettled))

    def sweep(self) -> None:
        """Re-publish every room held and beat (from the daemon's sweep)."""
        self.publish(list(self.held))

    def publish(self, rooms: list[int]) -> None:
        """Write what ``poll`` answers now for ``rooms`` (each held by this table)."""
        if rooms:
            result = self.poll(rooms)
            self._write(rooms, result.statuses, set(result.releasable))
        self.table.beat(self.clock_ns())

    def _write(self, rooms: Iterable[int], statuses: list[int], free: set[int]) -> None:
        for room, status in zip(rooms, statuses, strict=True):
            releasable = room in free
            self.slots.publish(room, status, releasable)
            if status == -1:
                self.held.discard(room)
                self.unsettled.discard(room)
            elif status in TERMINAL and releasable:
                self.unsettled.discard(room)
            else:
                self.unsettled.add(room)

    def close(self) -> None:
        """Mark the table closed (readers fall back at once) and unmap it."""
        self.table.close()
        del self.table, self.slots
        with contextlib.suppress(BufferError):  # a numpy view still alive: the GC unmaps
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
