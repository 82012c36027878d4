"""WritePump: non-blocking single-entry writes for every destination from one thread.

A fake native layer stands in for ``transfer_submit_write``/``transfer_check_status``:
an entry lands (memmove) when a destination's ``open`` event is set, so tests can
freeze one destination and watch the others go on. No wall-clock thresholds.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvd.errors import TransportError
from kvd.transfer.plan import Descriptors
from kvd.transfer.pump import POLL_PENDING, WritePump


class FakeNative:
    """Entries land in submission order per destination once its gate is open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gates: dict[str, threading.Event] = {}
        self.entries: dict[int, tuple[str, int, int, int]] = {}
        self.landed: set[int] = set()
        self.failed_once: set[int] = set()
        self.fail_first: set[tuple[int, int]] = set()  # (src, dst) failing on first try
        self.refuse: Callable[[str], bool] = lambda peer: False
        self.max_inflight: dict[str, int] = {}
        self._next = 1

    def gate(self, peer: str) -> threading.Event:
        return self.gates.setdefault(peer, threading.Event())

    def submit(self, peer: str, src: int, dst: int, length: int) -> int:
        if self.refuse(peer):
            return -1
        with self.lock:
            bid, self._next = self._next, self._next + 1
            self.entries[bid] = (peer, src, dst, length)
            n = sum(1 for b, e in self.entries.items() if e[0] == peer and b not in self.landed)
            self.max_inflight[peer] = max(self.max_inflight.get(peer, 0), n)
        return bid

    def check(self, bid: int) -> int:
        peer, src, dst, length = self.entries[bid]
        if not self.gate(peer).is_set():
            return 0
        if (src, dst) in self.fail_first and (src, dst) not in self.failed_once:
            self.failed_once.add((src, dst))
            self.landed.add(bid)
            return -1
        ctypes.memmove(dst, src, length)
        with self.lock:
            self.landed.add(bid)
        return 1


def _desc(src: np.ndarray, dst: np.ndarray, item: int, pages_src: list[int],
          pages_dst: list[int]) -> Descriptors:
    s = np.array([src.ctypes.data + p * item for p in pages_src], dtype=np.uint64)
    d = np.array([dst.ctypes.data + p * item for p in pages_dst], dtype=np.uint64)
    return Descriptors(s, d, np.full(len(s), item, dtype=np.uint64))


class Waiter:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.calls = 0

    def __call__(self, error: BaseException | None) -> None:
        self.error = error
        self.calls += 1
        self.event.set()

    def wait(self) -> BaseException | None:
        assert self.event.wait(30)
        return self.error


@pytest.fixture
def native() -> FakeNative:
    return FakeNative()


def _pump(native: FakeNative, **kw: object) -> WritePump:
    return WritePump(native.submit, native.check, **kw)  # type: ignore[arg-type]


def test_writes_are_byte_exact_and_windows_bounded(native: FakeNative) -> None:
    item, pages = 64, 300
    src = np.random.default_rng(0).integers(0, 256, pages * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    perm = np.random.default_rng(1).permutation(pages).tolist()
    native.gate("a").set()
    pump = _pump(native, per_peer=16, batch_entries=50)
    w = Waiter()
    pump.start("a", _desc(src, dst, item, list(range(pages)), perm), None, w)
    assert w.wait() is None and w.calls == 1
    assert np.array_equal(dst.reshape(pages, item)[perm], src.reshape(pages, item))
    assert native.max_inflight["a"] <= 16
    pump.close(5)


def test_frozen_destination_holds_only_its_own_window(native: FakeNative) -> None:
    item = 32
    src = np.arange(64 * item, dtype=np.uint8)
    frozen_dst, ok_dst = np.zeros_like(src), np.zeros_like(src)
    native.gate("ok").set()  # "frozen" stays closed
    pump = _pump(native, per_peer=8)
    frozen = Waiter()
    pump.start("frozen", _desc(src, frozen_dst, item, list(range(64)), list(range(64))),
               None, frozen)
    for _ in range(5):  # rooms to the healthy destination finish while one is frozen
        w = Waiter()
        pump.start("ok", _desc(src, ok_dst, item, list(range(64)), list(range(64))), None, w)
        assert w.wait() is None
    assert np.array_equal(ok_dst, src)
    assert not frozen.event.is_set() and native.max_inflight["frozen"] <= 8
    native.gate("frozen").set()
    assert frozen.wait() is None and np.array_equal(frozen_dst, src)
    pump.close(5)


def test_deadline_stops_new_entries_and_waits_for_those_in_flight(native: FakeNative) -> None:
    item = 16
    src = np.arange(40 * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    pump = _pump(native, per_peer=4)
    w = Waiter()
    pump.start("p", _desc(src, dst, item, list(range(40)), list(range(40))), 0.0, w)
    # The deadline (monotonic 0.0) has passed: nothing may start, the job fails at once.
    assert isinstance(w.wait(), TransportError)
    assert "deadline passed" in str(w.error) and not native.entries
    # A deadline that passes while entries are in flight: done only once they returned.
    import time

    w2 = Waiter()
    pump.start("q", _desc(src, dst, item, list(range(40)), list(range(40))),
               time.monotonic() + 0.2, w2)
    while not native.entries:
        time.sleep(0.001)
    assert not w2.event.wait(0.4)  # past the deadline, 4 entries still in flight
    native.gate("q").set()
    error = w2.wait()
    assert isinstance(error, TransportError) and "deadline passed" in str(error)
    assert len(native.entries) == 4  # nothing started after the deadline
    pump.close(5)


def test_failed_entry_is_written_again(native: FakeNative) -> None:
    item = 8
    src = np.arange(10 * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    native.fail_first.add((src.ctypes.data + 3 * item, dst.ctypes.data + 3 * item))
    native.gate("p").set()
    pump = _pump(native)
    w = Waiter()
    pump.start("p", _desc(src, dst, item, list(range(10)), list(range(10))), None, w)
    assert w.wait() is None and np.array_equal(dst, src) and pump.retried == 1
    pump.close(5)


def test_refusals_past_the_budget_fail_the_job(native: FakeNative) -> None:
    item = 8
    src = np.arange(4 * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    native.refuse = lambda peer: peer == "dead"
    pump = _pump(native, retry_budget=0.02)
    w = Waiter()
    pump.start("dead", _desc(src, dst, item, [0, 1], [0, 1]), None, w)
    error = w.wait()
    assert isinstance(error, TransportError) and "refused" in str(error)
    pump.close(5)


def test_entries_accepted_then_always_failing_fail_the_job_within_the_budget(
        native: FakeNative) -> None:
    """A destination that accepts every submission and then rejects the write (a decode
    restarted on the same transfer address: "WRITE rejected by server") must not be
    retried forever: an accepted resubmission does not reset the failure streak, only a
    landed entry does (found by tests/integration/test_second_round.py k28)."""
    item = 8
    src = np.arange(4 * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    native.gate("restarted").set()
    plain_check = native.check

    def rejecting(bid: int) -> int:
        if native.entries[bid][0] == "restarted":
            native.landed.add(bid)
            return -1
        return plain_check(bid)

    native.check = rejecting  # type: ignore[method-assign]
    pump = WritePump(native.submit, rejecting, retry_budget=0.05)
    w = Waiter()
    pump.start("restarted", _desc(src, dst, item, [0, 1, 2, 3], [0, 1, 2, 3]), None, w)
    error = w.wait()
    assert isinstance(error, TransportError) and "rc=-1" in str(error)
    assert not dst.any()
    pump.close(5)


def test_hook_numbers_sub_batches_once_and_retries_them(native: FakeNative) -> None:
    item = 8
    src = np.arange(10 * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    native.gate("p").set()
    seen: list[tuple[int, int]] = []

    def hook(peer: str, batch_no: int, attempt: int) -> int | None:
        seen.append((batch_no, attempt))
        return -1 if batch_no == 0 else (-1 if attempt < 2 else None)

    pump = _pump(native, batch_entries=5, retry_budget=0.02, hook=hook)
    w = Waiter()
    pump.start("p", _desc(src, dst, item, list(range(10)), list(range(10))), None, w)
    assert isinstance(w.wait(), TransportError)  # batch 0 is refused on every attempt
    assert {b for b, _ in seen} == {0}
    seen.clear()
    w2 = Waiter()
    pump.start("p", _desc(src, dst, item, list(range(10)), list(range(10))), None, w2)
    pump.retry_budget = 1.0
    assert w2.wait() is None and np.array_equal(dst, src)
    assert [b for b, a in seen if a == 2] == [1, 2]  # each sub-batch: two refusals, then on
    pump.close(5)


def test_k18_time_waiting_for_the_window_is_not_counted_against_the_retry_budget(
        native: FakeNative) -> None:
    """K18: job B's sub-batch is refused (transient queue full); while it backs off, job C
    to the same destination fills the window, and the destination holds C's entries far
    longer than the retry budget. Once C lands B is refused once more and then accepted:
    it succeeds, because the time it waited for the window was this pump's queue, not
    the peer refusing (it used to fail 'refused ... for 0.5s' under load)."""
    item, per_peer = 8, 4
    src = np.arange(16 * item, dtype=np.uint8)
    dst_b, dst_c = np.zeros_like(src), np.zeros_like(src)
    b_attempts: list[int] = []

    def hook(peer: str, batch_no: int, attempt: int) -> int | None:
        if batch_no != 0:  # C's sub-batch
            return None
        b_attempts.append(attempt)
        return -1 if attempt < 2 else None  # once before the wait, once after

    pump = _pump(native, per_peer=per_peer, min_entries=per_peer, retry_budget=0.05,
                 hook=hook)
    b, c = Waiter(), Waiter()
    with pump._cond:  # both queued before the pump's first round: B is refused first
        pump.start("p", _desc(src, dst_b, item, list(range(4)), list(range(4))), None, b)
        pump.start("p", _desc(src, dst_c, item, list(range(16)), list(range(16))), None, c)
    deadline = time.monotonic() + 30
    while native.max_inflight.get("p", 0) < per_peer:  # C holds the whole window
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(0.5)  # ten budgets pass with B due to retry and no room for it
    assert not b.event.is_set() and b_attempts == [0]
    native.gate("p").set()
    assert b.wait() is None and np.array_equal(dst_b[:4 * item], src[:4 * item])
    assert c.wait() is None and np.array_equal(dst_c, src)
    assert b_attempts == [0, 1, 2]
    pump.close(5)


def test_close_fails_jobs_not_started(native: FakeNative) -> None:
    item = 8
    src = np.arange(4 * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    pump = _pump(native, per_peer=1)
    w1, w2 = Waiter(), Waiter()
    pump.start("p", _desc(src, dst, item, [0], [0]), None, w1)
    pump.start("p", _desc(src, dst, item, [1], [1]), None, w2)
    while not native.entries:  # the first write is in flight
        threading.Event().wait(0.001)
    closer = threading.Thread(target=pump.close, args=(5,))
    closer.start()
    assert isinstance(w2.wait(), TransportError)  # never started
    native.gate("p").set()
    assert w1.wait() is None  # the one in flight was waited for
    closer.join()
    with pytest.raises(TransportError):
        pump.start("p", _desc(src, dst, item, [2], [2]), None, Waiter())


# ---- K43: cancellation tokens ----------------------------------------------------------------

def _submitted(native: FakeNative, dst: np.ndarray, item: int, pages: int) -> int:
    """Entries ever submitted whose destination lies in ``dst``'s first ``pages`` pages."""
    lo, hi = dst.ctypes.data, dst.ctypes.data + pages * item
    return sum(1 for _, _, d, _ in native.entries.values() if lo <= d < hi)


def test_k43_queued_entries_of_a_cancelled_token_are_never_submitted(
        native: FakeNative) -> None:
    """A frozen destination with a job in flight and two queued behind it: cancelling
    the running job's token and a queued one's drops every entry they had not
    submitted; the queued one reports at once (nothing of it in flight), the running
    one once its in-flight window returned, with WriteCancelled naming the bytes landed
    and dropped; the job not cancelled is written byte for byte."""
    from kvd.errors import WriteCancelled
    from kvd.transfer.backends.base import CancelToken

    item, pages, window = 64, 100, 8
    src = np.random.default_rng(3).integers(0, 256, pages * item, dtype=np.uint8)
    dsts = [np.zeros_like(src) for _ in range(3)]
    pump = _pump(native, per_peer=window, batch_entries=16)
    tokens = [CancelToken((r, 1)) for r in range(3)]
    waiters = [Waiter() for _ in range(3)]
    for dst, tok, w in zip(dsts, tokens, waiters, strict=True):
        pump.start("a", _desc(src, dst, item, list(range(pages)), list(range(pages))), None,
                   w, tok)
    _until(lambda: _submitted(native, dsts[0], item, pages) == window)
    tokens[1].cancel()  # queued behind job 0: not one entry submitted, done at once
    err = waiters[1].wait()
    assert isinstance(err, WriteCancelled) and (err.landed, err.dropped) == (0, pages * item)
    assert not waiters[0].event.is_set()  # job 0 still holds its window, gate closed
    tokens[0].cancel()
    native.gate("a").set()
    err = waiters[0].wait()
    assert isinstance(err, WriteCancelled)
    assert (err.landed, err.dropped) == (window * item, (pages - window) * item)
    assert waiters[2].wait() is None
    assert np.array_equal(dsts[2], src)
    assert _submitted(native, dsts[0], item, pages) == window
    assert _submitted(native, dsts[1], item, pages) == 0
    assert not dsts[1].any() and not dsts[0][window * item:].any()
    assert np.array_equal(dsts[0][:window * item], src[:window * item])
    assert pump.cancelled == 2 and all(w.calls == 1 for w in waiters)
    pump.close(5)


def _until(cond: Callable[[], bool], bound: float = 30.0) -> None:
    """Poll ``cond`` until true, within a generous bound (no wall-clock thresholds)."""
    import time

    stop = time.monotonic() + bound
    while not cond():
        assert time.monotonic() < stop, "condition not met within the bound"
        time.sleep(0.001)


def test_k43_bytes_in_flight_per_destination_are_bounded(native: FakeNative) -> None:
    """Big entries: at most ``per_peer_bytes`` in flight per destination beyond the first
    ``min_entries`` (here 1: one entry always may go, whatever its size), so a cancelled
    queue leaves at most that much to land."""
    item, pages = 1024, 40
    src = np.random.default_rng(5).integers(0, 256, pages * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    pump = _pump(native, per_peer=100, per_peer_bytes=3 * item, min_entries=1)
    w = Waiter()
    pump.start("a", _desc(src, dst, item, list(range(pages)), list(range(pages))), None, w)
    _until(lambda: _submitted(native, dst, item, pages) == 3)
    native.gate("a").set()
    assert w.wait() is None and np.array_equal(dst, src)
    assert native.max_inflight["a"] == 3
    big = _pump(native, per_peer=100, per_peer_bytes=1, min_entries=1)
    w2 = Waiter()
    dst2 = np.zeros_like(src)
    big.start("a", _desc(src, dst2, item, list(range(pages)), list(range(pages))), None, w2)
    assert w2.wait() is None and np.array_equal(dst2, src)
    pump.close(5)
    big.close(5)


class FifoLink:
    """Fake submit/check without memory: entries land in submission order per destination
    (as on one TCP connection) once ``open`` is set; ``checks`` counts polls per id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = threading.Event()
        self.submitted: list[tuple[int, str, int]] = []  # (id, peer, dst) in order
        self.landed: list[int] = []
        self.checks: dict[int, int] = {}

    def submit(self, peer: str, src: int, dst: int, length: int) -> int:
        with self.lock:
            bid = len(self.submitted) + 1
            self.submitted.append((bid, peer, dst))
        return bid

    def check(self, bid: int) -> int:
        with self.lock:
            self.checks[bid] = self.checks.get(bid, 0) + 1
            peer = self.submitted[bid - 1][1]
            ahead = [b for b, p, _ in self.submitted[:bid - 1] if p == peer]
            if not self.open.is_set() or not set(ahead) <= set(self.landed):
                return 0
            self.landed.append(bid)
        return 1

    def window_full(self) -> bool:
        """The first entry was polled twice: a whole round passed since it was submitted,
        in which every queued job had its turn to fill the (closed) destination's window."""
        return self.checks.get(1, 0) >= 2


def _fake_desc(first_dst: int, entries: int, length: int) -> Descriptors:
    dst = np.arange(entries, dtype=np.uint64) * np.uint64(length) + np.uint64(first_dst)
    return Descriptors(dst + np.uint64(1 << 44), dst, np.full(entries, length, np.uint64))


def test_k43_a_fresh_write_queued_behind_cancelled_ones_waits_only_for_the_window() -> None:
    """The cancel bench's shape at the pump's defaults: 40 queued writes of 16 x 256 KiB
    entries to one (closed) destination, all cancelled, then a fresh 1-entry write. On a
    link that lands entries in submission order, the fresh entry lands after at most the
    window's entries: 8 (2 MiB of 256 KiB entries), counted by submissions, not time. The
    old default window (32 MiB) let 128 cancelled entries in flight ahead of it."""
    from kvd.errors import WriteCancelled
    from kvd.transfer.backends.base import CancelToken

    link, entry, fresh_dst = FifoLink(), 256 << 10, 1 << 40
    pump = WritePump(link.submit, link.check)  # the defaults under test
    tokens = [CancelToken((r, 1)) for r in range(40)]
    waiters = [Waiter() for _ in tokens]
    for r, (tok, w) in enumerate(zip(tokens, waiters, strict=True)):
        pump.start("d", _fake_desc(r << 30, 16, entry), None, w, tok)
    _until(link.window_full)
    for tok in tokens:
        tok.cancel()
    fresh = Waiter()
    pump.start("d", _fake_desc(fresh_dst, 1, 4096), None, fresh)
    link.open.set()
    assert fresh.wait() is None
    fresh_id = next(b for b, _, dst in link.submitted if dst == fresh_dst)
    ahead = link.landed.index(fresh_id)  # cancelled entries that landed before the fresh one
    assert ahead <= 8, f"the fresh write waited behind {ahead} cancelled entries"
    assert len(link.submitted) - 1 <= 8  # all that the 40 cancelled writes still wrote
    for w in waiters:
        assert isinstance(w.wait(), WriteCancelled)
    pump.close(5)


def _in_flight_when_full(length: int, **kw: int) -> int:
    """Entries of ``length`` bytes in flight to one closed destination once its window is
    full (one job of 64 entries), at the pump's defaults overridden by ``kw``."""
    link = FifoLink()
    pump = WritePump(link.submit, link.check, **kw)  # type: ignore[arg-type]
    w = Waiter()
    pump.start("d", _fake_desc(1 << 30, 64, length), None, w)
    _until(link.window_full)
    n = len(link.submitted)
    link.open.set()
    assert w.wait() is None and len(link.landed) == 64
    pump.close(5)
    return n


def test_k43_min_entries_go_whatever_their_size() -> None:
    """At the defaults 8 entries may be in flight per destination however big they are
    (before: one, once the byte bound was reached), so a bulk write of big entries keeps
    the link busy; the byte bound applies beyond them and ``per_peer`` caps both."""
    mib = 1 << 20
    assert _in_flight_when_full(mib, per_peer_bytes=1) == 8  # default min_entries
    assert _in_flight_when_full(mib) == 8  # default byte bound (2 MiB) below 8 x 1 MiB
    assert _in_flight_when_full(mib, per_peer_bytes=1, min_entries=3) == 3
    assert _in_flight_when_full(mib, per_peer_bytes=5 * mib, min_entries=3) == 5
    assert _in_flight_when_full(64 << 10) == 32  # 2 MiB of 64 KiB entries
    assert _in_flight_when_full(mib, per_peer=4) == 4


class CountingNative(FakeNative):
    """FakeNative that counts the checks of each entry and lands only the entries
    ``lands`` allows (by submission position, from 0), whatever their order."""

    def __init__(self) -> None:
        super().__init__()
        self.checks: dict[int, int] = {}
        self.lands: Callable[[int], bool] = lambda position: True

    def check(self, bid: int) -> int:
        with self.lock:
            self.checks[bid] = self.checks.get(bid, 0) + 1
        return super().check(bid) if self.lands(bid - 1) else 0


def test_a_round_stops_polling_at_the_pending_entries_it_may_skip() -> None:
    """Checks are native calls taking the GIL: a round polls the oldest entries and stops
    at the POLL_PENDING-th one still pending; the younger ones are not checked until the
    older ones returned (P1: 17 checks per entry before, about 4 after)."""
    native = CountingNative()
    item, pages = 64, 16
    src = np.random.default_rng(2).integers(0, 256, pages * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    pump = _pump(native, per_peer=pages)
    w = Waiter()
    pump.start("a", _desc(src, dst, item, list(range(pages)), list(range(pages))), None, w)
    deadline = time.monotonic() + 30
    while native.checks.get(1, 0) < 50:  # many rounds over a closed gate
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert len(native.entries) == pages
    assert all(native.checks.get(bid, 0) == 0 for bid in range(POLL_PENDING + 1, pages + 1))
    native.gate("a").set()
    assert w.wait() is None
    assert np.array_equal(dst, src)
    pump.close(5)


def test_entries_landing_out_of_order_are_all_collected() -> None:
    """The younger half of a job lands while the older half stays pending: nothing is lost
    or double-counted; the job ends once the older half lands too, byte for byte, and the
    window is empty afterwards (a second job runs through it)."""
    native = CountingNative()
    item, pages = 64, 24
    src = np.random.default_rng(3).integers(0, 256, pages * item, dtype=np.uint8)
    dst = np.zeros_like(src)
    old_ok = threading.Event()
    native.lands = lambda position: position >= pages // 2 or old_ok.is_set()
    native.gate("a").set()
    pump = _pump(native, per_peer=pages)
    w = Waiter()
    pump.start("a", _desc(src, dst, item, list(range(pages)), list(range(pages))), None, w)
    deadline = time.monotonic() + 30
    while native.checks.get(1, 0) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not w.event.is_set()
    old_ok.set()
    assert w.wait() is None and w.calls == 1
    assert np.array_equal(dst, src)
    dst2 = np.zeros_like(src)
    w2 = Waiter()
    pump.start("a", _desc(src, dst2, item, list(range(pages)), list(range(pages))), None, w2)
    assert w2.wait() is None and np.array_equal(dst2, src)
    pump.close(5)
