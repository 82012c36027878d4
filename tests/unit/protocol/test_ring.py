"""The shared-memory ring's layout (issue 21 step B, layout only): records in order,
bounds, sequence checks, half-written records, and any bytes fuzzed into it."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvd.errors import ProtocolError
from kvd.protocol import ring as r
from kvd.protocol.ring import Ring, ring_bytes

PAYLOADS = st.binary(max_size=48)


def new(capacity: int = 4, record: int = 64) -> Ring:
    return Ring.create(bytearray(ring_bytes(capacity, record)), capacity, record)


class RingMachine(RuleBasedStateMachine):
    """Pushes and pops against a deque: every record comes out once, in order, byte for
    byte; a full ring refuses; the consumer sees what was published and nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.ring = new()
        self.model: deque[tuple[int, bytes]] = deque()
        self.next = 0

    @rule(payload=PAYLOADS)
    def push(self, payload: bytes) -> None:
        seq = self.ring.push(payload)
        if len(self.model) == self.ring.capacity:
            assert seq is None
            return
        assert seq == self.next
        self.model.append((seq, payload))
        self.next += 1

    @rule()
    def pop(self) -> None:
        got = self.ring.pop()
        assert got == (self.model.popleft() if self.model else None)

    @precondition(lambda self: len(self.model) < self.ring.capacity)
    @rule(payload=PAYLOADS)
    def half_write(self, payload: bytes) -> None:
        """A producer that died after writing a record, before publishing it."""
        self.ring.write_record(self.ring.head, payload)

    @invariant()
    def pending_matches(self) -> None:
        assert self.ring.pending() == len(self.model)


TestRingMachine = RingMachine.TestCase


def test_a_payload_over_the_record_is_refused_by_the_producer() -> None:
    ring = new(record=32)
    assert ring.max_payload == 16
    ring.push(b"x" * 16)
    with pytest.raises(ValueError, match="at most 16"):
        ring.push(b"x" * 17)


def test_a_record_with_the_wrong_seq_is_corrupt_and_not_consumed() -> None:
    ring = new()
    ring.push(b"abc")
    ring.bytes[r.HEADER_WORDS * r.WORD] ^= 1  # record 0 now says seq 1
    with pytest.raises(ProtocolError, match="carries seq"):
        ring.pop()
    assert ring.tail == 0


def test_a_record_claiming_more_than_it_holds_is_corrupt() -> None:
    ring = new(record=32)
    ring.push(b"abc")
    at = r.HEADER_WORDS * r.WORD + 8
    ring.bytes[at:at + 4].view("<u4")[0] = 17
    with pytest.raises(ProtocolError, match="at most 16"):
        ring.pop()


@pytest.mark.parametrize("head", [5, 2**63, 2**64 - 1])
def test_a_head_beyond_the_ring_is_corrupt(head: int) -> None:
    ring = new()
    ring.header[4] = head  # more published than the ring holds (or a wrapped value)
    with pytest.raises(ProtocolError, match="apart"):
        ring.pop()


@pytest.mark.parametrize(("word", "value"), [(0, 0), (1, r.VERSION + 1), (2, 3), (2, 0), (3, 12),
                                             (3, 8), (2, 1 << 20), (3, 1 << 20)])
def test_open_refuses_a_header_out_of_bounds(word: int, value: int) -> None:
    buf = bytearray(ring_bytes(4, 64))
    Ring.create(buf, 4, 64)
    np.frombuffer(buf, dtype="<u8")[word] = value
    with pytest.raises(ProtocolError):
        Ring.open(buf)


@settings(max_examples=300)
@given(noise=st.binary(min_size=1, max_size=ring_bytes(4, 64)), at=st.integers(0, 319),
       pushed=st.lists(PAYLOADS, max_size=4))
def test_any_bytes_written_over_a_ring_read_as_records_or_protocol_errors(
        noise: bytes, at: int, pushed: list[bytes]) -> None:
    """A hostile producer may write anything anywhere in the ring, header included: the
    consumer opens it or refuses it, and pops bounded payloads or raises ProtocolError
    -- never another exception, never more records than the ring holds."""
    buf = bytearray(ring_bytes(4, 64))
    producer = Ring.create(buf, 4, 64)
    for p in pushed:
        producer.push(p)
    end = min(len(buf), at + len(noise))
    buf[at:end] = noise[:end - at]
    try:
        ring = Ring.open(buf)
        for _ in range(ring.capacity + 1):
            got = ring.pop()
            if got is None:
                break
            assert len(got[1]) <= ring.max_payload
            dep = ring.depends(got[0])
            assert dep is None or 0 <= dep < got[0]
    except ProtocolError:
        pass


def test_a_ring_reopened_by_the_consumer_reads_what_the_producer_wrote() -> None:
    buf = bytearray(ring_bytes(8, 128))
    producer = Ring.create(buf, 8, 128)
    for i in range(8):
        assert producer.push(bytes([i]) * i) == i
    assert producer.push(b"full") is None
    consumer = Ring.open(buf)
    assert [consumer.pop() for _ in range(3)] == [(i, bytes([i]) * i) for i in range(3)]
    assert producer.push(b"wraps") == 8
    consumer.sleeping = True
    assert producer.sleeping


def test_private_cursors_move_records_in_order_and_publish_progress() -> None:
    """Producer and Consumer keep their cursors to themselves: the consumer publishes
    ``tail`` only once it handled a record (``done``), so a producer reading ``tail`` past
    a record knows it was handled."""
    buf = bytearray(ring_bytes(4, 64))
    ring = Ring.create(buf, 4, 64)
    out, inbox = r.Producer(ring), r.Consumer(Ring.open(buf))
    assert [out.push(bytes([i])) for i in range(5)] == [0, 1, 2, 3, None]
    assert inbox.peek() == b"\x00" and ring.tail == 0  # read, not yet handled
    inbox.done()
    assert ring.tail == 1 and out.free() == 1
    assert out.push(b"wrap") == 4
    got = []
    while (p := inbox.peek()) is not None:
        got.append(p)
        inbox.done()
    assert got == [b"\x01", b"\x02", b"\x03", b"wrap"] and ring.tail == 5


@pytest.mark.parametrize("tail", [7, 2**64 - 1])
def test_a_producer_refuses_a_tail_the_consumer_could_not_have_written(tail: int) -> None:
    ring = new()
    out = r.Producer(ring)
    out.push(b"x")
    ring.header[5] = tail  # ahead of head, or far behind it
    with pytest.raises(ProtocolError, match="behind head"):
        out.push(b"y")


def test_a_consumer_ignores_a_tail_rewritten_by_the_producer() -> None:
    """A hostile producer rewriting the consumer's published ``tail`` cannot make it read
    a record twice or skip one: the consumer's cursor is its own."""
    ring = new()
    out, inbox = r.Producer(ring), r.Consumer(ring)
    out.push(b"a")
    out.push(b"b")
    assert inbox.peek() == b"a"
    inbox.done()
    ring.header[5] = 0
    assert inbox.peek() == b"b"


def test_closed_is_its_own_header_word() -> None:
    ring = new()
    assert not ring.closed
    ring.close()
    assert ring.closed and Ring.open(ring.bytes.data).closed
    assert ring.pending() == 0  # nothing else moved


@settings(max_examples=300)
@given(noise=st.binary(min_size=1, max_size=ring_bytes(4, 64)), at=st.integers(0, 319),
       pushed=st.lists(PAYLOADS, max_size=4), handled=st.integers(0, 4))
def test_any_bytes_over_a_ring_give_a_private_consumer_records_or_protocol_errors(
        noise: bytes, at: int, pushed: list[bytes], handled: int) -> None:
    """As the test above, for the cursor kvd uses (its ``tail`` private): at most
    ``capacity`` records a pass, each bounded, or ProtocolError."""
    buf = bytearray(ring_bytes(4, 64))
    ring = Ring.create(buf, 4, 64)
    out, inbox = r.Producer(ring), r.Consumer(ring)
    for p in pushed:
        out.push(p)
    for _ in range(min(handled, len(pushed))):
        inbox.done()
    end = min(len(buf), at + len(noise))
    buf[at:end] = noise[:end - at]
    try:
        for _ in range(ring.capacity + 1):
            got = inbox.peek()
            if got is None:
                break
            assert len(got) <= ring.max_payload
            inbox.done()
        else:
            raise AssertionError("more records than the ring holds")
    except ProtocolError:
        pass


def test_a_record_names_the_record_it_depends_on_counted_back() -> None:
    ring = new(capacity=8)
    assert ring.push(b"create") == 0
    assert ring.push(b"plain") == 1
    assert ring.push(b"init", after=2) == 2
    assert [ring.depends(s) for s in range(3)] == [None, None, 0]
    with pytest.raises(ValueError, match="depend"):
        ring.push(b"before the first", after=4)  # record 3 cannot name record -1
    with pytest.raises(ValueError, match="depend"):
        ring.push(b"itself", after=-1)
    assert ring.head == 3  # nothing published


def test_a_dependency_before_the_first_record_is_corrupt() -> None:
    ring = new()
    ring.push(b"x")
    at = r.HEADER_WORDS * r.WORD
    ring.mv[at + 12:at + 16] = (5).to_bytes(4, "little")  # record 0 "depends" 5 back
    assert ring.record(0) == b"x"
    with pytest.raises(ProtocolError, match="before the first"):
        ring.depends(0)
