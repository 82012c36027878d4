"""A single-producer single-consumer ring of records in shared memory (issue 21, step B).
PURE: numpy over a buffer.

The engine produces room calls into a submission ring and kvd its refusals into a
completion ring (:mod:`kvd.engine_rpc.ring`, :mod:`kvd.client.rpc`); each side trusts
nothing the other wrote. Layout (little-endian ``uint64`` words, :data:`VERSION` 3)::

    header   8 words: MAGIC, VERSION, capacity, record_bytes, head, tail, sleeping, closed
    records  capacity x record_bytes: seq (u64), length (u32), after (u32), payload

``after`` is 0, or how many records back lies the record this one depends on
(:meth:`Ring.depends`): the consumer runs a record only if the one it depends on
succeeded. The ring carries the number; what "succeeded" means is its user's (kvd: the
call was not refused, :mod:`kvd.engine_rpc.ring`).

``capacity`` is a power of two; record ``seq`` lives at ``seq & (capacity - 1)``. The
producer writes the payload and length, then the record's ``seq``, then ``head = seq +
1``: a record is visible only once ``head`` passed it, so a producer that dies half way
through a record leaves nothing the consumer reads (its half record is simply never
published). The consumer reads ``head``, checks ``0 <= head - tail <= capacity``, and
for each record checks ``seq == tail`` and ``length <= record_bytes - 16`` before it
copies the payload out; anything else raises :class:`~kvd.errors.ProtocolError` (a
corrupt or hostile producer: the caller fails that producer's work only). ``sleeping``
is the consumer's "wake me" flag (the caller's eventfd protocol); ``tail`` is the
consumer's, ``head`` the producer's, and each side writes only its own. ``closed`` is
set by whichever side stops serving the ring for good (kvd, when it gives up on a
corrupt ring or shuts down): the other side stops using it.

Two processes that share a ring each keep their own cursor privately (:class:`Producer`:
``head``; :class:`Consumer`: ``tail``) and only *publish* it in the header: what the
other side wrote into the header is checked against the private cursor, never taken
as it is, so a hostile peer that rewrites the whole ring can make the other side read
only records it then checks (sequence, length) or a :class:`~kvd.errors.ProtocolError`.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from kvd.errors import ProtocolError

MAGIC = 0x6B76645F72696E67  # b"kvd_ring" read as a big-endian integer
#: History: 1 -- first layout (issue 21); 2 -- header word 7 is ``closed``; 3 -- a
#: record's reserved word is ``after`` (the record it depends on, counted back).
VERSION = 3
HEADER_WORDS = 8
WORD = 8
RECORD_HEAD = 16  # seq + length + after
#: Bounds a reader enforces on any header it opens.
MAX_CAPACITY = 1 << 16
MAX_RECORD_BYTES = 1 << 16
_MAGIC, _VERSION, _CAPACITY, _RECORD, _HEAD, _TAIL, _SLEEPING, _CLOSED = range(8)
_RECORD_HEAD = struct.Struct("<QII")  # seq, length, after
#: The farthest back a record may depend on (``after`` is a u32).
MAX_AFTER = (1 << 32) - 1
_AFTER = struct.Struct("<I")
_U64 = (1 << 64) - 1


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier: a store before it is visible to other CPUs before any load
    after it. x86-64 (TSO) may let a load pass an earlier store to another address, which
    is exactly the wake-up handshake ("publish ``head``, then read ``sleeping``" against
    "set ``sleeping``, then read ``head``"): without a barrier on both sides each could
    read the other's old word and the record would wait for a wake-up nobody sends. An
    uncontended lock taken and released is a locked read-modify-write, a full barrier on
    x86-64 (about 0.1 us)."""
    _FENCE.acquire()
    _FENCE.release()


def ring_bytes(capacity: int, record_bytes: int) -> int:
    """Bytes a ring takes; ValueError for a capacity that is no power of two in
    ``[1, MAX_CAPACITY]`` or a record size not a multiple of 8 in ``(16, MAX_RECORD_BYTES]``."""
    if not 1 <= capacity <= MAX_CAPACITY or capacity & (capacity - 1):
        raise ValueError(f"ring capacity must be a power of two in [1, {MAX_CAPACITY}], "
                         f"got {capacity}")
    if not RECORD_HEAD < record_bytes <= MAX_RECORD_BYTES or record_bytes % WORD:
        raise ValueError(f"record_bytes must be a multiple of 8 in ({RECORD_HEAD}, "
                         f"{MAX_RECORD_BYTES}], got {record_bytes}")
    return HEADER_WORDS * WORD + capacity * record_bytes


class Ring:
    """A ring over ``buf``: lay one out with :meth:`create`, open one with :meth:`open`
    (header checked: ProtocolError). Producer: :meth:`push`; consumer: :meth:`pop`."""

    def __init__(self, buf: object, capacity: int, record_bytes: int) -> None:
        size = ring_bytes(capacity, record_bytes)
        self.bytes = np.frombuffer(buf, dtype=np.uint8, count=size)  # type: ignore[call-overload]
        self.header = self.bytes[:HEADER_WORDS * WORD].view("<u8")
        # the same bytes as Python ints and a byte view: a word or a record without a numpy
        # call (about 0.1 us a word instead of 0.3; x86-64 is little-endian, as the layout)
        self.mv = memoryview(buf).cast("B")[:size]  # type: ignore[arg-type]
        self.q = self.mv[:HEADER_WORDS * WORD].cast("Q")
        self.capacity, self.record_bytes = capacity, record_bytes
        self.max_payload = record_bytes - RECORD_HEAD

    @classmethod
    def create(cls, buf: object, capacity: int, record_bytes: int) -> Ring:
        ring = cls(buf, capacity, record_bytes)
        ring.bytes[:] = 0
        ring.header[[_MAGIC, _VERSION, _CAPACITY, _RECORD]] = [MAGIC, VERSION, capacity,
                                                               record_bytes]
        return ring

    @classmethod
    def open(cls, buf: object) -> Ring:
        """The ring in ``buf``; ProtocolError unless its header is this version's and its
        sizes are within bounds and fit ``buf``."""
        size = len(memoryview(buf))  # type: ignore[arg-type]
        if size < HEADER_WORDS * WORD:
            raise ProtocolError(f"ring of {size} bytes is shorter than its header")
        head = np.frombuffer(buf, dtype="<u8", count=HEADER_WORDS)  # type: ignore[call-overload]
        if int(head[_MAGIC]) != MAGIC or int(head[_VERSION]) != VERSION:
            raise ProtocolError(f"not a version {VERSION} kvd ring")
        capacity, record = int(head[_CAPACITY]), int(head[_RECORD])
        try:
            need = ring_bytes(capacity, record)
        except ValueError as exc:
            raise ProtocolError(f"ring header: {exc}") from exc
        if need > size:
            raise ProtocolError(f"ring needs {need} bytes, the buffer has {size}")
        return cls(buf, capacity, record)

    def _at(self, seq: int) -> int:
        return HEADER_WORDS * WORD + (seq & (self.capacity - 1)) * self.record_bytes

    @property
    def head(self) -> int:
        return self.q[_HEAD]

    @property
    def tail(self) -> int:
        return self.q[_TAIL]

    @property
    def sleeping(self) -> bool:
        return bool(self.q[_SLEEPING])

    @sleeping.setter
    def sleeping(self, value: bool) -> None:
        self.q[_SLEEPING] = int(value)

    @property
    def closed(self) -> bool:
        return bool(self.q[_CLOSED])

    def close(self) -> None:
        """This ring is served no more (the other side stops using it)."""
        self.q[_CLOSED] = 1

    def publish_head(self, head: int) -> None:
        self.q[_HEAD] = head & _U64

    def publish_tail(self, tail: int) -> None:
        self.q[_TAIL] = tail & _U64

    # ---- producer -------------------------------------------------------------------

    def push(self, payload: bytes, after: int = 0) -> int | None:
        """Publish ``payload`` (depending on the record ``after`` records back, 0: none);
        its seq, or None when the ring is full. ValueError for a payload over
        ``max_payload`` bytes (send it another way) or ``after`` out of bounds."""
        if len(payload) > self.max_payload:
            raise ValueError(f"a record carries at most {self.max_payload} bytes, got "
                             f"{len(payload)}")
        seq = self.head
        if seq - self.tail >= self.capacity:
            return None
        self.write_record(seq, payload, after)
        self.publish_head(seq + 1)
        return seq

    def write_record(self, seq: int, payload: bytes, after: int = 0) -> None:
        """The record's bytes without publishing it (``head`` unchanged): what a producer
        that dies half way leaves behind. ValueError for ``after`` outside
        ``[0, min(seq, MAX_AFTER)]``."""
        if not 0 <= after <= min(seq, MAX_AFTER):
            raise ValueError(f"record {seq} cannot depend on the record {after} back")
        at = self._at(seq)
        self.mv[at + RECORD_HEAD:at + RECORD_HEAD + len(payload)] = payload
        _RECORD_HEAD.pack_into(self.mv, at, seq & _U64, len(payload), after)

    # ---- consumer -------------------------------------------------------------------

    def pending(self) -> int:
        """Published records not yet consumed; ProtocolError if the header says more
        than the ring holds (or fewer than none)."""
        n = self.head - self.tail
        if not 0 <= n <= self.capacity:
            raise ProtocolError(f"ring head {self.head} and tail {self.tail} are "
                                f"{n} records apart (capacity {self.capacity})")
        return n

    def pop(self) -> tuple[int, bytes] | None:
        """The next published record ``(seq, payload)``, consumed; None when there is
        none. ProtocolError for a corrupt record (wrong seq, length out of bounds) or
        header; a corrupt record is not consumed."""
        if not self.pending():
            return None
        seq = self.tail
        payload = self.record(seq)
        self.publish_tail(seq + 1)
        return seq, payload

    def record(self, seq: int) -> bytes:
        """The payload of record ``seq`` (a copy), whether published or not: the caller
        checked that it is. ProtocolError if the record carries another seq or a length
        over ``max_payload``."""
        at = self._at(seq)
        got, length, _ = _RECORD_HEAD.unpack_from(self.mv, at)
        if got != seq:
            raise ProtocolError(f"ring record {seq} carries seq {got}")
        if length > self.max_payload:
            raise ProtocolError(f"ring record {seq} says {length} bytes, at most "
                                f"{self.max_payload}")
        return bytes(self.mv[at + RECORD_HEAD:at + RECORD_HEAD + length])

    def depends(self, seq: int) -> int | None:
        """The seq of the record that record ``seq`` depends on, or None (it depends on
        none). ProtocolError for one before the ring's first record (a producer that
        wrote nonsense). Read after :meth:`record` checked the record's seq."""
        (after,) = _AFTER.unpack_from(self.mv, self._at(seq) + 12)
        if not after:
            return None
        if after > seq:
            raise ProtocolError(f"ring record {seq} depends on the record {after} back, "
                                f"before the first")
        return seq - after


class Producer:
    """One process's producing end of ``ring``, its ``head`` kept here (starting at
    ``head``, 0 for a new ring) and published after each record."""

    def __init__(self, ring: Ring, head: int = 0) -> None:
        self.ring, self.head = ring, head

    def free(self) -> int:
        """Records that may be pushed now; ProtocolError if the consumer's published
        ``tail`` is not within ``capacity`` records behind ``head`` (a corrupt or hostile
        consumer)."""
        used = self.head - self.ring.tail
        if not 0 <= used <= self.ring.capacity:
            raise ProtocolError(f"ring tail {self.ring.tail} is {used} records behind head "
                                f"{self.head} (capacity {self.ring.capacity})")
        return self.ring.capacity - used

    def push(self, payload: bytes, after: int = 0) -> int | None:
        """Publish ``payload`` (depending on the record ``after`` records back, 0: none);
        its seq, or None when the ring is full. ValueError for a payload over
        ``max_payload`` bytes or ``after`` out of bounds; ProtocolError as :meth:`free`.
        (:meth:`free` and :meth:`Ring.write_record` written out: an engine's every room
        call runs this, often on a thread just back from a wait, where each Python call
        costs about a microsecond.)"""
        ring = self.ring
        size = len(payload)
        if size > ring.max_payload:
            raise ValueError(f"a record carries at most {ring.max_payload} bytes, got {size}")
        seq = self.head
        used = seq - ring.q[_TAIL]
        if not 0 <= used <= ring.capacity:
            raise ProtocolError(f"ring tail {ring.q[_TAIL]} is {used} records behind head "
                                f"{seq} (capacity {ring.capacity})")
        if used == ring.capacity:
            return None
        if not 0 <= after <= min(seq, MAX_AFTER):
            raise ValueError(f"record {seq} cannot depend on the record {after} back")
        at = HEADER_WORDS * WORD + (seq & (ring.capacity - 1)) * ring.record_bytes
        mv = ring.mv
        mv[at + RECORD_HEAD:at + RECORD_HEAD + size] = payload
        _RECORD_HEAD.pack_into(mv, at, seq & _U64, size, after)
        self.head = seq + 1
        ring.q[_HEAD] = self.head & _U64
        return seq


class Consumer:
    """One process's consuming end of ``ring``, its ``tail`` kept here (starting at
    ``tail``) and published by :meth:`done`. :meth:`peek` reads the next record without
    consuming it, so a consumer publishes ``tail`` only once it acted on the record:
    a producer that sees ``tail`` past a record knows it was handled."""

    def __init__(self, ring: Ring, tail: int = 0) -> None:
        self.ring, self.tail = ring, tail

    def pending(self) -> int:
        """Published records not yet consumed; ProtocolError if the producer's ``head``
        is more than ``capacity`` records ahead of ``tail``, or behind it."""
        n = self.ring.head - self.tail
        if not 0 <= n <= self.ring.capacity:
            raise ProtocolError(f"ring head {self.ring.head} is {n} records ahead of tail "
                                f"{self.tail} (capacity {self.ring.capacity})")
        return n

    def peek(self) -> bytes | None:
        """The payload of record ``tail`` if it is published, else None; ProtocolError for
        a corrupt header or record (:meth:`Ring.record`)."""
        if not self.pending():
            return None
        return self.ring.record(self.tail)

    def done(self) -> None:
        """Record ``tail`` was handled: consume it and publish the new ``tail``."""
        self.tail += 1
        self.ring.publish_tail(self.tail)

