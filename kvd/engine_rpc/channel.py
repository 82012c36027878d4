"""kvd's side of the shared room status table (issue 21, step A): a memfd and its writer.

One table per daemon, in a memfd handed to every engine connection that asks
(:class:`~kvd.protocol.rpc.OpenTable`). kvd's loop is its only writer
(:class:`~kvd.protocol.table.StatusTable`); what it writes is what ``Side.poll``
answers, read back after every change, so the table can only ever be a view:

- an engine call on a room (create, init, send, abort, clear) publishes that room at
  once, before its reply, so a read right after the call sees what a ``Poll`` would;
- any other change (a control message, effects performed, a wake-up) asks for a
  re-publish of the rooms the room machine says it changed (``changed``: the machine's
  ``take_changed``), at most :data:`PUBLISH_SLICE` rooms per loop turn: the work is per
  change, not per room held (K41: re-publishing every unsettled room after each change
  made N rooms that fail one a turn cost N**2 slot writes, and ``/health`` waited);
- the sweep publishes what changed too, beats the heartbeat readers check, and once a
  :data:`NET_PERIOD_S` starts a re-publish of every room held, a slice per loop turn (a
  safety net: the table is a view even if a change went unrecorded).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import mmap
import os
import time
from collections.abc import Callable, Iterable

from kvd.protocol import rpc
from kvd.protocol.table import SlotMap, StatusTable, table_bytes

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


#: Rooms one loop turn re-publishes (about 5 us each): a turn never costs more than
#: ~2.5 ms of it, however many rooms changed or are held (K41).
PUBLISH_SLICE = 512
#: Seconds between the sweep's re-publishes of every room held (the safety net).
NET_PERIOD_S = 1.0


class TableWriter:
    """The table, its memfd (``fd``, close-on-exec) and which rooms it holds.

    ``poll`` is the side's ``poll`` (the one source of every status written);
    ``changed`` returns, and forgets, the rooms whose poll answer may have changed
    since it was last called (the room machine's ``take_changed``).
    Raises OSError if the memfd cannot be made or mapped.
    """

    def __init__(self, poll: Poll, nslots: int,
                 clock_ns: Callable[[], int] = time.monotonic_ns,
                 changed: Callable[[], set[int]] = set) -> None:
        self.poll, self.clock_ns, self.changed = poll, clock_ns, changed
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
        self.held: set[int] = set()
        self.pending: set[int] = set()  # changed rooms not re-published yet
        self._net: list[int] = []  # the safety net's round: held rooms yet to re-publish
        self._net_at: int | None = None  # when (clock_ns) the last round started
        self._scheduled = False
        self.slice = PUBLISH_SLICE
        self.net_period_ns = int(NET_PERIOD_S * 1e9)
        self.turns = 0  # loop turns (and sweeps) that re-published a slice (tests)
        self.written = 0  # slots written, all publishes together (tests count work)
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
        """Something may have changed: re-publish the rooms the machine changed soon, in
        slices of at most :attr:`slice` rooms, one slice per loop turn (K41)."""
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the sweep catches up
            asyncio.get_running_loop().call_soon(self._step)
            self._scheduled = True

    def _step(self) -> None:
        """One loop turn's share: up to :attr:`slice` changed rooms, then up to what is
        left of the slice from the safety net's round; more next turn if any remain."""
        self._scheduled = False
        self.pending |= self.changed()
        if not self.pending and not self._net:
            return
        batch = list(itertools.islice(self.pending, self.slice))
        self.pending.difference_update(batch)
        room_left = self.slice - len(batch)
        if room_left > 0 and self._net:
            batch += self._net[:room_left]
            del self._net[:room_left]
        self.turns += 1
        self.publish([r for r in batch if r in self.held])
        if self.pending or self._net:
            self._schedule()

    def flush(self) -> None:
        """Re-publish every changed room now (explicit callers: a reply that must not go
        out before the table shows it)."""
        self.pending |= self.changed()
        rooms, self.pending = [r for r in self.pending if r in self.held], set()
        self.publish(rooms)

    def sweep(self) -> None:
        """From the daemon's sweep: publish what changed (one slice; the rest on the next
        turns), start the safety net's round once a :data:`NET_PERIOD_S`, and beat."""
        now = self.clock_ns()
        if not self._net and (self._net_at is None or
                              now - self._net_at >= self.net_period_ns):
            self._net, self._net_at = list(self.held), now
        self._step()
        self.table.beat(now)

    def publish(self, rooms: list[int]) -> None:
        """Write what ``poll`` answers now for ``rooms`` (each held by this table)."""
        if rooms:
            result = self.poll(rooms)
            self._write(rooms, result.statuses, set(result.releasable))
        self.table.beat(self.clock_ns())

    def _write(self, rooms: Iterable[int], statuses: list[int], free: set[int]) -> None:
        n = 0
        for room, status in zip(rooms, statuses, strict=True):
            self.slots.publish(room, status, room in free)
            if status == -1:
                self.held.discard(room)
            n += 1
        self.written += n

    def close(self) -> None:
        """Mark the table closed (readers fall back at once) and unmap it."""
        self.table.close()
        del self.table, self.slots
        with contextlib.suppress(BufferError):  # a numpy view still alive: the GC unmaps
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
