"""The room status table both processes map (issue 21, step A). PURE: numpy over a buffer.

kvd's loop is the table's only writer; the engine reads it with a numpy gather and no
syscall, and falls back to the socket's ``Poll`` for every room the table does not answer.
The table is a *view*: kvd never reads a decision from it.

Layout (little-endian ``uint64`` words, :data:`VERSION` 1)::

    header   8 words: MAGIC, VERSION, nslots, heartbeat_ns, closed, writer pid, 0, 0
    slots    nslots x 2 words: head = gen << 32 | word, room

``nslots`` is a power of two; room ``r`` may live only in slot ``r & (nslots - 1)``
(a room whose slot holds another room is simply not in the table). ``word`` (the head's
low 32 bits) packs ``code = status + 1`` (0 = ``UNKNOWN_ROOM``) in bits 0-7,
``releasable`` in bit 8 and ``OCCUPIED`` in bit 9; ``gen`` is the high 32 bits.

Per-slot seqlock: the writer makes ``gen`` odd (head rewritten, word kept), writes
``room``, then writes the head with ``gen`` even again and the new word. A reader
gathers the heads (h1), the rooms, the heads again (h2), and takes a slot only if
``h1 == h2`` (so ``gen`` did not move: wrapping 2**31 writes between two loads of one
poll is out of reach), ``gen`` is even, the slot is occupied and names the room asked:
a torn slot or one reused by another room reads as a miss, never as a wrong status.
The order of those loads and stores is the program order of the numpy copies below;
x86-64 keeps loads ordered with loads and stores with stores (TSO), which is what the
seqlock needs without fences. ``heartbeat_ns`` is the writer's ``CLOCK_MONOTONIC``
(``time.monotonic_ns``, shared by every process on the host) at its last beat: a reader
treats a table older than its ``stale_ns`` (or one marked ``closed``) as absent.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvd.errors import ProtocolError

MAGIC = 0x6B76645F73746174  # b"kvd_stat" read as a big-endian integer
#: History: 1 -- first layout (issue 21).
VERSION = 1
HEADER_WORDS = 8
SLOT_WORDS = 2
WORD = 8  # bytes
#: Most slots a table may have (2**24 slots = 512 MiB would be absurd; bounded for readers).
MAX_SLOTS = 1 << 22
#: A table whose writer has not beaten for this long is treated as absent (ns): how late,
#: at most, an engine reading only the table learns that its kvd died without a word
#: (SIGKILL); kvd beats at every sweep (0.1 s) and every publish.
DEFAULT_STALE_NS = 1_000_000_000

_H_MAGIC, _H_VERSION, _H_NSLOTS, _H_BEAT, _H_CLOSED, _H_PID = range(6)
_HEAD, _ROOM = 0, 1
CODE_MASK = 0xFF
RELEASABLE = 1 << 8
OCCUPIED = 1 << 9
GEN_SHIFT = 32
_GEN_ODD = 1 << GEN_SHIFT
_LOW = (1 << GEN_SHIFT) - 1
_HIT_MASK = np.uint64(_GEN_ODD | OCCUPIED)
_OCCUPIED = np.uint64(OCCUPIED)
_RELEASABLE = np.uint64(RELEASABLE)
_ONE = np.uint64(1)


def table_bytes(nslots: int) -> int:
    """Bytes a table of ``nslots`` slots takes. Raises ValueError for a bad ``nslots``."""
    check_nslots(nslots)
    return (HEADER_WORDS + SLOT_WORDS * nslots) * WORD


def check_nslots(nslots: int) -> None:
    """Raise ValueError unless ``nslots`` is a power of two in ``[1, MAX_SLOTS]``."""
    if not 1 <= nslots <= MAX_SLOTS or nslots & (nslots - 1):
        raise ValueError(f"a status table has a power of two of slots in [1, {MAX_SLOTS}], "
                         f"got {nslots}")


def pack(status: int, releasable: bool) -> int:
    """The occupied ``word`` of a room with KVPoll ``status`` (or -1: unknown)."""
    if not -1 <= status <= 4:
        raise ValueError(f"status {status} is none of KVPoll's values or UNKNOWN_ROOM")
    return (status + 1) | (RELEASABLE if releasable else 0) | OCCUPIED


class StatusTable:
    """A status table over ``buf`` (a writable buffer: ``mmap`` or ``bytearray``).

    Open an existing table with :meth:`open` (checks the header; raises ProtocolError) or
    lay a new one out with :meth:`create`. Reads: :meth:`read`. Writes (kvd's loop only):
    :meth:`write`, :meth:`beat`, :meth:`close`.
    """

    def __init__(self, words: npt.NDArray[np.uint64], nslots: int) -> None:
        self.words = words
        self.header = words[:HEADER_WORDS]
        self.q = words.data.cast("B").cast("Q")  # the same words, read as Python ints
        self.flat = words[HEADER_WORDS:HEADER_WORDS + SLOT_WORDS * nslots]
        self.slots = self.flat.reshape(nslots, SLOT_WORDS)
        self.nslots = nslots
        self.mask = np.uint64(nslots - 1)

    @classmethod
    def create(cls, buf: object, nslots: int, pid: int = 0) -> StatusTable:
        """Lay out an empty table in ``buf`` (at least :func:`table_bytes` bytes)."""
        size = table_bytes(nslots)
        words = np.frombuffer(buf, dtype="<u8", count=size // WORD)  # type: ignore[call-overload]
        words[:] = 0
        words[[_H_MAGIC, _H_VERSION, _H_NSLOTS, _H_PID]] = [MAGIC, VERSION, nslots, pid]
        return cls(words, nslots)

    @classmethod
    def open(cls, buf: object) -> StatusTable:
        """The table in ``buf``; raises ProtocolError if its header is not one of this
        version or its size does not fit ``buf``."""
        size = len(memoryview(buf))  # type: ignore[arg-type]
        if size < HEADER_WORDS * WORD:
            raise ProtocolError(f"status table of {size} bytes is shorter than its header")
        head = np.frombuffer(buf, dtype="<u8", count=HEADER_WORDS)  # type: ignore[call-overload]
        if int(head[_H_MAGIC]) != MAGIC or int(head[_H_VERSION]) != VERSION:
            raise ProtocolError(f"not a version {VERSION} status table (magic "
                                f"{int(head[_H_MAGIC]):#x}, version {int(head[_H_VERSION])})")
        nslots = int(head[_H_NSLOTS])
        try:
            need = table_bytes(nslots)
        except ValueError as exc:
            raise ProtocolError(f"status table header: {exc}") from exc
        if need > size:
            raise ProtocolError(f"status table of {nslots} slots needs {need} bytes, the "
                                f"buffer has {size}")
        words = np.frombuffer(buf, dtype="<u8", count=need // WORD)  # type: ignore[call-overload]
        return cls(words, nslots)

    # ---- the writer (kvd's loop) --------------------------------------------------------

    def slot_of(self, room: int) -> int:
        """The one slot ``room`` may live in."""
        return room & (self.nslots - 1)

    def write(self, slot: int, room: int, word: int) -> None:
        """Publish ``word`` (:func:`pack`, or 0: empty) for ``room`` in ``slot``."""
        row = self.slots[slot]
        head = int(row[_HEAD])  # gen even: only this writer makes it odd, only in here
        gen = (head >> GEN_SHIFT) + 1  # odd: being written
        row[_HEAD] = (gen & _LOW) << GEN_SHIFT | head & _LOW
        row[_ROOM] = room
        row[_HEAD] = ((gen + 1) & _LOW) << GEN_SHIFT | word  # even again

    def beat(self, now_ns: int) -> None:
        """The writer is alive at ``now_ns`` (``time.monotonic_ns``)."""
        self.header[_H_BEAT] = now_ns

    def close(self) -> None:
        """The writer is gone for good: readers fall back to the socket at once."""
        self.header[_H_CLOSED] = 1

    # ---- readers -------------------------------------------------------------------------

    def fresh(self, now_ns: int, stale_ns: int = DEFAULT_STALE_NS) -> bool:
        """Whether the writer beat within ``stale_ns`` of ``now_ns`` and is not closed."""
        q = self.q
        return not q[_H_CLOSED] and now_ns - q[_H_BEAT] <= stale_ns

    def read_one(self, room: int) -> tuple[int, bool] | None:
        """``(status, releasable)`` of one room, or None where the table does not answer
        it (as :meth:`read`, in plain Python: no array built for one room)."""
        q, at = self.q, HEADER_WORDS + SLOT_WORDS * (room & (self.nslots - 1))
        head = q[at]
        held = q[at + 1]
        if head != q[at] or held != room or head & (_GEN_ODD | OCCUPIED) != OCCUPIED:
            return None
        return (head & CODE_MASK) - 1, bool(head & RELEASABLE)

    def heads_of(self, rooms: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        """Index in :attr:`flat` of each room's slot head (uint64, rooms' shape)."""
        return (rooms & self.mask) << _ONE

    def read(self, rooms: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.int8],
                                                            npt.NDArray[np.bool_],
                                                            npt.NDArray[np.bool_]]:
        """``(statuses int8, releasable bool, hit bool)`` for ``rooms`` (uint64, 1-D).

        Where ``hit`` is False the table does not answer that room (never in it, its slot
        taken by another room, or being written): ask the socket. ``statuses`` there is
        meaningless.
        """
        idx = self.heads_of(rooms)
        flat = self.flat
        heads = flat.take(idx)  # loads in this order: heads, rooms, heads again
        held = flat.take(idx + _ONE)
        return self.check(rooms, heads, held, flat.take(idx))

    @staticmethod
    def check(rooms: npt.NDArray[np.uint64], heads: npt.NDArray[np.uint64],
              held: npt.NDArray[np.uint64], after: npt.NDArray[np.uint64]) -> tuple[
                  npt.NDArray[np.int8], npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        """The seqlock test of :meth:`read`: the slots' heads, their rooms, and the heads
        loaded again after them (split out so a test can write between the loads)."""
        hit = heads == after
        hit &= held == rooms
        hit &= (heads & _HIT_MASK) == _OCCUPIED  # gen even, slot occupied
        statuses = heads.astype(np.int8)  # the low byte: the code
        statuses -= 1
        return statuses, (heads & _RELEASABLE) != 0, hit


class SlotMap:
    """The writer's record of which room holds which slot (kvd's loop; no I/O).

    A slot is free when empty or when its room reads as unknown (cleared, or forgotten
    by kvd): :meth:`place` puts a room there; a room whose slot another known room holds
    stays out of the table (its readers ask the socket).
    """

    def __init__(self, table: StatusTable) -> None:
        self.table = table
        self.holder: dict[int, int] = {}  # slot -> room that holds it
        self.known: set[int] = set()  # rooms placed whose status is not unknown

    def place(self, room: int) -> bool:
        """Take ``room``'s slot if free (or already its own); whether it holds it now."""
        slot = self.table.slot_of(room)
        other = self.holder.get(slot)
        if other is not None and other != room and other in self.known:
            return False
        if other != room:  # the previous room's (unknown) status no longer answered
            self.table.write(slot, room, 0)
        self.holder[slot] = room
        return True

    def holds(self, room: int) -> bool:
        return self.holder.get(self.table.slot_of(room)) == room

    def publish(self, room: int, status: int, releasable: bool) -> None:
        """Write ``room``'s status if it holds its slot (``status`` -1: unknown, which
        frees the slot for another room while still answering this one until then)."""
        if not self.holds(room):
            return
        self.table.write(self.table.slot_of(room), room, pack(status, releasable))
        if status == -1:
            self.known.discard(room)
        else:
            self.known.add(room)
