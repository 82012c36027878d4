"""The room status table both processes map (issue 21, step A). PURE: numpy over a buffer.

kvd's loop is the table's only writer; the engine reads it with numpy gathers and no
syscall, and falls back to the socket's ``Poll`` for every room the table does not answer.
The table is a *view*: kvd never reads a decision from it.

Layout (little-endian ``uint64`` words, :data:`VERSION` 3)::

    header   8 words: MAGIC, VERSION, nslots, heartbeat_ns, closed, writer pid, 0, 0
    heads    nslots words: slot s's head = gen << 32 | word
    rooms    nslots words: slot s's room

``nslots`` is a power of two, at least :data:`WAYS`; slots form buckets of
:data:`WAYS` consecutive slots (their heads side by side, their rooms side by side),
and room ``r`` may live only in a slot of bucket ``r & (nslots / WAYS - 1)`` (a room
whose bucket is full of other known rooms is simply not in the table). With random
64-bit ids and ``n`` live rooms in ``b`` buckets, about ``n**3 / (6 * b**2)`` of them
miss: 0.002 of 1 000 rooms in kvd's default 262 144-slot table, where one slot per room
would miss about 2 of them.
``word`` (the head's low 32 bits) packs ``code = status + 1`` (0 = ``UNKNOWN_ROOM``) in bits 0-7,
``releasable`` in bit 8 and ``OCCUPIED`` in bit 9; ``gen`` is the high 32 bits.

Per-slot seqlock: the writer makes ``gen`` odd (head rewritten, word kept), writes
``room``, then writes the head with ``gen`` even again and the new word. A reader
gathers every way of each room's bucket at once, whichever way the room landed in: the
heads (h1), the rooms, the heads again (h2), three whole-bucket gathers; it takes a
slot only if ``h1 == h2`` (so ``gen`` did not move: wrapping 2**31 writes between two
loads of one poll is out of reach), ``gen`` is even, the slot is occupied and names the
room asked, and prefers the bucket's first such slot: a torn slot or one reused by
another room reads as a miss, never as a wrong status. The order of those loads and
stores is the program order of the numpy copies below (a gather's loads all come before
the next gather's); x86-64 keeps loads ordered with loads and stores with stores (TSO),
which is what the seqlock needs without fences, and loads an aligned 8-byte word whole
(the gathers copy 16-byte rows of two such words; the heads start 64 bytes into the
page-aligned map). A poll of up to :data:`FEW` rooms
reads the same slots in plain Python instead, the seqlock slot by slot (:meth:`read_one`).
``heartbeat_ns`` is the writer's ``CLOCK_MONOTONIC`` (``time.monotonic_ns``, shared by
every process on the host) at its last beat: a reader treats a table older than its
``stale_ns`` (or one marked ``closed``) as absent.
"""

from __future__ import annotations

import array

import numpy as np
import numpy.typing as npt

from kvd.errors import ProtocolError

MAGIC = 0x6B76645F73746174  # b"kvd_stat" read as a big-endian integer
#: History: 1 -- first layout (issue 21), one slot per room; 2 -- two-way buckets;
#: 3 -- heads and rooms in two regions, so one gather reads a whole bucket's heads.
VERSION = 3
#: Slots a room may live in (its bucket). The readers are written for two (``hits``,
#: ``read_few``).
WAYS = 2
HEADER_WORDS = 8
SLOT_WORDS = 2
WORD = 8  # bytes
#: Most slots a table may have (2**24 slots = 512 MiB would be absurd; bounded for readers).
MAX_SLOTS = 1 << 22
#: A table whose writer has not beaten for this long is treated as absent (ns): how late,
#: at most, an engine reading only the table learns that its kvd died without a word
#: (SIGKILL); kvd beats at every sweep (0.1 s) and every publish.
DEFAULT_STALE_NS = 1_000_000_000
#: Most rooms :meth:`StatusTable.read_statuses` reads in plain Python rather than numpy:
#: a scheduler step's poll, on a thread back from a sleep (a poll_array of 32 rooms after
#: a 1 ms sleep, in process: 17.8 us of CPU in Python against 21.8 us with numpy, 16
#: rooms 11.8 against 21.6; in a tight loop 14.4 against 11.5 us).
FEW = 32

_H_MAGIC, _H_VERSION, _H_NSLOTS, _H_BEAT, _H_CLOSED, _H_PID = range(6)
CODE_MASK = 0xFF
RELEASABLE = 1 << 8
OCCUPIED = 1 << 9
GEN_SHIFT = 32
_GEN_ODD = 1 << GEN_SHIFT
_LOW = (1 << GEN_SHIFT) - 1
_HIT = _GEN_ODD | OCCUPIED  # the head bits of a slot a reader takes: gen even, occupied
_OCCUPIED = np.uint64(OCCUPIED)
_EVEN = np.uint64(~_GEN_ODD & (1 << 64) - 1)  # every bit but gen's lowest
_RELEASABLE = np.uint64(RELEASABLE)


#: Positions of the rooms a read does not answer (:meth:`StatusTable.read_statuses`).
Misses = list[int] | npt.NDArray[np.intp]


def table_bytes(nslots: int) -> int:
    """Bytes a table of ``nslots`` slots takes. Raises ValueError for a bad ``nslots``."""
    check_nslots(nslots)
    return (HEADER_WORDS + SLOT_WORDS * nslots) * WORD


def check_nslots(nslots: int) -> None:
    """Raise ValueError unless ``nslots`` is a power of two in ``[WAYS, MAX_SLOTS]``."""
    if not WAYS <= nslots <= MAX_SLOTS or nslots & (nslots - 1):
        raise ValueError(f"a status table has a power of two of slots in [{WAYS}, "
                         f"{MAX_SLOTS}], got {nslots}")


def pack(status: int, releasable: bool) -> int:
    """The occupied ``word`` of a room with KVPoll ``status`` (or -1: unknown)."""
    if not -1 <= status <= 4:
        raise ValueError(f"status {status} is none of KVPoll's values or UNKNOWN_ROOM")
    return (status + 1) | (RELEASABLE if releasable else 0) | OCCUPIED


class StatusTable:
    """A status table over ``buf`` (a writable buffer: ``mmap`` or ``bytearray``).

    Open an existing table with :meth:`open` (checks the header; raises ProtocolError) or
    lay a new one out with :meth:`create`. Reads: :meth:`read`, :meth:`read_statuses`
(a poll's), :meth:`read_one`. Writes (kvd's loop only):
    :meth:`write`, :meth:`beat`, :meth:`close`.
    """

    def __init__(self, words: npt.NDArray[np.uint64], nslots: int) -> None:
        self.words = words
        self.header = words[:HEADER_WORDS]
        self.q = words.data.cast("B").cast("Q")  # the same words, read as Python ints
        self.heads = words[HEADER_WORDS:HEADER_WORDS + nslots]  # slot -> head
        self.rooms = words[HEADER_WORDS + nslots:HEADER_WORDS + SLOT_WORDS * nslots]
        self.nslots = nslots
        self.nbuckets = nslots // WAYS
        self.head_rows = self.heads.reshape(self.nbuckets, WAYS)  # bucket -> its heads
        self.room_rows = self.rooms.reshape(self.nbuckets, WAYS)  # bucket -> its rooms
        self.mask = np.uint64(self.nbuckets - 1)

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
        """The first slot of ``room``'s bucket."""
        return (room & (self.nbuckets - 1)) * WAYS

    def bucket(self, room: int) -> range:
        """The slots ``room`` may live in."""
        first = self.slot_of(room)
        return range(first, first + WAYS)

    def write(self, slot: int, room: int, word: int) -> None:
        """Publish ``word`` (:func:`pack`, or 0: empty) for ``room`` in ``slot``."""
        heads = self.heads
        head = int(heads[slot])  # gen even: only this writer makes it odd, only in here
        gen = (head >> GEN_SHIFT) + 1  # odd: being written
        heads[slot] = (gen & _LOW) << GEN_SHIFT | head & _LOW
        self.rooms[slot] = room
        heads[slot] = ((gen + 1) & _LOW) << GEN_SHIFT | word  # even again

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
        q, first = self.q, HEADER_WORDS + self.slot_of(room)
        for at in range(first, first + WAYS):
            head = q[at]
            held = q[at + self.nslots]
            if head == q[at] and held == room and head & _HIT == OCCUPIED:
                return (head & CODE_MASK) - 1, bool(head & RELEASABLE)
        return None

    def buckets_of(self, rooms: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Each room's bucket (int64: an index :meth:`numpy.take` uses as it is)."""
        return (rooms & self.mask).view(np.int64)

    def read(self, rooms: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.int8],
                                                            npt.NDArray[np.bool_],
                                                            npt.NDArray[np.bool_]]:
        """``(statuses int8, releasable bool, hit bool)`` for ``rooms`` (uint64, 1-D).

        Where ``hit`` is False the table does not answer that room (never in it, its slot
        taken by another room, or being written): ask the socket. ``statuses`` there is
        meaningless. The same work whichever way of its bucket each room landed in.
        """
        heads, held, after = self.gather(rooms)
        ok = self.check(rooms, heads, held, after)
        head = np.where(ok[:, 0], heads[:, 0], heads[:, 1])  # the first way that passed
        statuses = head.astype(np.int8)  # the low byte: the code
        statuses -= 1
        return statuses, (head & _RELEASABLE) != 0, hits(ok)

    def read_statuses(self, rooms: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.int8],
                                                                     Misses]:
        """``(statuses, misses)``: :meth:`read`'s statuses (int8; meaningless at a miss)
        and the positions of the rooms the table does not answer (empty when it answers
        all), without ``releasable`` (a poll's read). Up to :data:`FEW` rooms are read in
        plain Python (:meth:`read_few`), more in one vectorised pass."""
        if len(rooms) <= FEW:
            few, missed = self.read_few(rooms.tolist())
            return np.frombuffer(few, dtype=np.int8), missed
        heads, held, after = self.gather(rooms)
        ok = self.check(rooms, heads, held, after)
        codes = heads.view(np.int8)[:, ::WORD]  # each head's low byte (little-endian)
        statuses = np.where(ok[:, 0], codes[:, 0], codes[:, 1])
        statuses -= 1
        hit = hits(ok)
        return statuses, [] if hit.all() else np.flatnonzero(~hit)

    def read_few(self, rooms: list[int]) -> tuple[array.array[int], list[int]]:
        """``(statuses, misses)`` of :meth:`read_statuses` for a list of rooms (statuses a
        signed-byte ``array``, ``UNKNOWN_ROOM`` at a miss), each room read as
        :meth:`read_one` reads it: the seqlock per slot, the bucket's first slot that
        passes. No numpy call: on a thread back from a sleep each costs about 1 us."""
        q, nslots, mask = self.q, self.nslots, self.nbuckets - 1
        statuses = array.array("b")
        put = statuses.append
        misses: list[int] = []
        for i, room in enumerate(rooms):
            at = HEADER_WORDS + (room & mask) * WAYS  # the bucket's first slot (two ways)
            head = q[at]
            held = q[at + nslots]
            if head == q[at] and held == room and head & _HIT == OCCUPIED:
                put((head & CODE_MASK) - 1)
                continue
            at += 1
            head = q[at]
            held = q[at + nslots]
            if head == q[at] and held == room and head & _HIT == OCCUPIED:
                put((head & CODE_MASK) - 1)
                continue
            put(-1)
            misses.append(i)
        return statuses, misses

    def gather(self, rooms: npt.NDArray[np.uint64]) -> tuple[
            npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """The seqlock's loads for ``rooms``, every way of each room's bucket (each
        ``(len(rooms), WAYS)`` uint64): the heads, the rooms, the heads again, in this
        order (three gathers: each one's loads come after the one before's)."""
        at = self.buckets_of(rooms)
        head_rows = self.head_rows
        heads = head_rows.take(at, axis=0)
        held = self.room_rows.take(at, axis=0)
        return heads, held, head_rows.take(at, axis=0)

    @staticmethod
    def check(rooms: npt.NDArray[np.uint64], heads: npt.NDArray[np.uint64],
              held: npt.NDArray[np.uint64], after: npt.NDArray[np.uint64]
              ) -> npt.NDArray[np.bool_]:
        """The seqlock test of :meth:`read` over :meth:`gather`'s loads (split out so a
        test can write between them): which ways (bool, ``(len(rooms), WAYS)``) answer
        their room.

        A way answers if ``after == heads`` with gen's lowest bit cleared and OCCUPIED
        set -- that is ``heads == after``, gen even and the slot occupied (the two loads
        can differ in those two bits alone only if the slot moved by 2**32 - 1 writes:
        a word changes only with gen) -- and its room is the room asked.
        """
        want = heads & _EVEN
        want |= _OCCUPIED
        ok = after == want
        ok &= held == rooms.repeat(WAYS).reshape(-1, WAYS)
        return ok


def hits(ok: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """Which rooms some way answers (:meth:`StatusTable.check`'s ``ok``; two ways)."""
    return ok.view(np.uint16)[:, 0] != 0


class SlotMap:
    """The writer's record of which room holds which slot (kvd's loop; no I/O).

    A slot is free when empty or when its room reads as unknown (cleared, or forgotten
    by kvd): :meth:`place` puts a room in a free slot of its bucket; a room whose bucket
    is full of known rooms stays out of the table (its readers ask the socket). A room
    holds at most one slot.
    """

    def __init__(self, table: StatusTable) -> None:
        self.table = table
        self.holder: dict[int, int] = {}  # slot -> room that holds it
        self.where: dict[int, int] = {}  # room -> its slot
        self.known: set[int] = set()  # rooms placed whose status is not unknown

    def place(self, room: int) -> bool:
        """Give ``room`` a slot of its bucket if it has none and one is free; whether it
        holds one now."""
        if room in self.where:
            return True
        for slot in self.table.bucket(room):
            other = self.holder.get(slot)
            if other is None or other not in self.known:
                if other is not None:  # its (unknown) status is no longer answered
                    del self.where[other]
                self.table.write(slot, room, 0)
                self.holder[slot], self.where[room] = room, slot
                return True
        return False

    def holds(self, room: int) -> bool:
        return room in self.where

    def publish(self, room: int, status: int, releasable: bool) -> None:
        """Write ``room``'s status if it holds a slot (``status`` -1: unknown, which
        frees the slot for another room while still answering this one until then)."""
        slot = self.where.get(room)
        if slot is None:
            return
        self.table.write(slot, room, pack(status, releasable))
        if status == -1:
            self.known.discard(room)
        else:
            self.known.add(room)
