"""Drives non-blocking single-entry writes for every destination from ONE thread.

The Mooncake binding's batch calls busy-wait in C++ until the whole batch
landed (a core per caller, one batch in flight per thread); its non-blocking
pair ``transfer_submit_write`` (one entry, returns a batch id) and
``transfer_check_status`` (0 pending, 1 done, -1 failed, -2 timed out) lets one
thread keep many entries in flight for many destinations and sleep between
polls (design.md, "Facts about the Mooncake TCP transport": 64-256 entries in
flight is the fastest way to drive the TCP transport here).

:class:`WritePump` owns that thread. Each :meth:`WritePump.start` is one *job*
(a planned write to one destination); ``done(error)`` is called from the pump
thread exactly once, when every entry the job submitted has landed, failed or
timed out -- never earlier, so the room protocol's release rules hold as with
a blocking write. Jobs of one destination start in FIFO order. The window per
destination:

* at most ``per_peer`` entries in flight (the TCP transport refuses more than 1024
  queued per peer, shared by every caller);
* beyond the first ``min_entries`` entries in flight (default 8), which always may go
  whatever their size, at most ``per_peer_bytes`` bytes (default 2 MiB; counted in
  entry lengths, an entry that crosses the bound still goes).

What is in flight is what a cancelled room may still write, and how long a fresh room
waits behind a queue of cancelled ones (K43): at most ``max(min_entries entries,
per_peer_bytes + one entry)``. The byte bound is small so that this wait is short (2 MiB
is 1-2 ms at the 1-3 GB/s of Mooncake TCP on loopback; the old 32 MiB made a fresh room
7-11x its baseline in ``benchmarks/cancel_bench.py``); ``min_entries`` keeps a pipe of
big entries full (8 x 1 MiB entries in flight, not 2). See docs/transfer.md.

A frozen destination only holds its own window: the thread keeps polling and serving the
others (K24, P8), and isolation does not depend on hashing peers onto threads.

Rules, same as the blocking path (:func:`kvd.transfer.backends.base.submit_with_retry`):

* a job is split into sub-batches of ``batch_entries``; the fault hook
  (``hook(peer, batch_no, attempt)``, tests only) is asked before each sub-batch
  starts, and a refusal it forces is retried like a refused submission;
* a refused or failed entry is submitted again (the same bytes: idempotent) with
  backoff from ``retry_backoff`` doubling to 50 ms, for at most ``retry_budget``
  seconds since the first refusal or failure with no entry landed since, and never past
  the job's deadline; time a job due to retry waits for its destination's window (other
  rooms' entries in flight) is not counted: that is this daemon's queue, not the peer
  refusing (K18: under load a room behind 49 others failed after three refusals);
* no entry starts after the job's ``deadline`` (monotonic s): the job then fails
  once its entries in flight have returned;
* no entry starts once the job's cancellation token (:class:`~kvd.transfer.backends.
  base.CancelToken`: its room attempt ended) is cancelled, checked before every
  submission -- also while the destination's window is full, so a queued job of an
  ended room finishes in the next round instead of waiting for the jobs ahead of it;
  the entries in flight return as usual and ``done`` gets a
  :class:`~kvd.errors.WriteCancelled` naming the bytes that landed and those dropped
  (K43);
* an entry still pending ``timeout_s + length/1 GB/s`` after it was submitted
  (the binding's own sync timeout, ``MC_TRANSFER_TIMEOUT``) is given up: the job
  fails. Its batch id cannot be freed while busy and is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.errors import TransportError, WriteCancelled
from kvd.transfer.backends.base import CancelToken
from kvd.transfer.plan import Descriptors

log = logging.getLogger(__name__)

#: ``(peer, src, dst, length) -> batch id`` (> 0) or a negative refusal code.
Submit = Callable[[str, int, int, int], int]
#: ``batch id -> 0 pending, 1 done (id freed), -1 failed (id freed), -2 timed out``.
Check = Callable[[int], int]
#: Called once per job from the pump thread: None on success, else the TransportError.
Done = Callable[[TransportError | None], None]

MAX_BACKOFF = 0.05
#: Sleep between polls while entries are in flight (s): short first, doubling while nothing
#: moves. Each wake-up takes the GIL from the daemon's loop: not shorter than this.
POLL_MIN, POLL_MAX = 50e-6, 250e-6
#: Sleep pacing for big entries: up to their expected time at this rate, at most PACE_MAX.
PACE_BPS, PACE_MAX = 2e9, 2e-3
#: Entries of a job polled per round, oldest first: at most POLL_HEAD, and the round stops
#: at the POLL_PENDING-th entry found still pending. Entries finish about in submission
#: order (Mooncake's TCP transport runs four lanes per peer), so the ones behind the pending
#: ones are most likely pending too, and every check is a native call that releases and
#: retakes the GIL. P1's 12 KiB bulk, in process: 17 checks per entry with the 32 oldest
#: polled every round, about 4 with this rule (docs/performance.md, P1).
POLL_HEAD, POLL_PENDING = 32, 4
#: Default window per destination beyond the entry count (module doc, K43): bytes in
#: flight, and the entries that always may go whatever their size.
DEFAULT_INFLIGHT_BYTES, DEFAULT_MIN_ENTRIES = 2 << 20, 8


@dataclass(eq=False)
class _Job:
    peer: str
    src: list[int]
    dst: list[int]
    length: list[int]
    deadline: float | None
    done: Done
    cancel: CancelToken | None = None
    next: int = 0                       # first entry not submitted yet
    batch_end: int = 0                  # end of the sub-batch being submitted
    inflight: list[tuple[int, int, float]] = field(default_factory=list)  # (id, entry, t)
    retry: deque[int] = field(default_factory=deque)  # entries to submit again
    retry_at: float = 0.0               # no submission before this (backoff)
    retry_since: float | None = None    # first refusal of the current streak
    held_since: float | None = None     # due to retry, but the window was full (not counted)
    backoff: float = 0.0
    batch_no: int | None = None         # number of the sub-batch about to start
    attempt: int = 0                    # hook attempts of the current sub-batch
    error: TransportError | None = None
    stopped: bool = False               # no further submissions
    cancelled: bool = False             # stopped by its token (its room attempt ended)
    landed: int = 0                     # bytes of entries that landed

    @property
    def unsubmitted(self) -> bool:
        return not self.stopped and (self.next < len(self.src) or bool(self.retry))

    @property
    def finished(self) -> bool:
        return not self.inflight and not self.unsubmitted


@dataclass
class _Peer:
    jobs: deque[_Job] = field(default_factory=deque)
    inflight: int = 0
    inflight_bytes: int = 0


class WritePump:
    """One thread keeping writes in flight to every destination (see module doc).

    ``submit``/``check`` wrap the native calls; ``hook`` is the fault injector
    (``(peer, batch_no, attempt) -> forced rc or None``). Thread-safe: :meth:`start`
    may be called from any thread (the daemon calls it from its loop).
    """

    def __init__(self, submit: Submit, check: Check, per_peer: int = 256,
                 batch_entries: int = 512, retry_budget: float = 1.0,
                 retry_backoff: float = 0.001, timeout_s: float = 30.0,
                 hook: Callable[[str, int, int], int | None] | None = None,
                 name: str = "kvd-xfer-pump", per_peer_bytes: int = DEFAULT_INFLIGHT_BYTES,
                 min_entries: int = DEFAULT_MIN_ENTRIES) -> None:
        self._submit, self._check = submit, check
        self.per_peer = max(1, per_peer)
        self.per_peer_bytes = max(1, per_peer_bytes)
        self.min_entries = max(1, min_entries)
        self.batch_entries = max(1, batch_entries)
        self.retry_budget, self.retry_backoff = retry_budget, retry_backoff
        self.timeout_s = timeout_s
        self.hook = hook
        self.name = name
        self._cond = threading.Condition()
        self._incoming: list[_Job] = []
        self._peers: dict[str, _Peer] = {}
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits on the condition (nothing in flight)
        self._closing = False
        self._batch_no = 0
        self.retried = 0
        self.abandoned = 0  # entries given up after the engine's timeout
        self.cancelled = 0  # jobs stopped by their token

    # ---- any thread -------------------------------------------------------------------

    def start(self, peer: str, desc: Descriptors, deadline: float | None, done: Done,
              cancel: CancelToken | None = None) -> None:
        """Queue a write of ``desc`` to ``peer``; ``done`` is called once, from the pump.
        Once ``cancel`` is cancelled no further entry of it is submitted."""
        job = _Job(peer, desc.src.tolist(), desc.dst.tolist(), desc.length.tolist(),
                   deadline, done, cancel)
        with self._cond:
            if self._closing:
                raise TransportError(f"write to {peer}: the transfer engine is closing")
            self._incoming.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            elif self._idle:
                self._cond.notify()

    @property
    def active(self) -> int:
        """Jobs queued or in flight."""
        with self._cond:
            return len(self._incoming) + sum(len(p.jobs) for p in self._peers.values())

    def close(self, timeout: float | None = None) -> None:
        """Fail jobs not started yet, wait up to ``timeout`` s for entries in flight,
        stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ---- the pump thread --------------------------------------------------------------

    def _run(self) -> None:
        delay = POLL_MIN
        while True:
            with self._cond:
                while not self._incoming and not self._peers and not self._closing:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                for job in self._incoming:
                    self._peers.setdefault(job.peer, _Peer()).jobs.append(job)
                self._incoming.clear()
                closing = self._closing
                if closing and not self._peers:
                    self._thread = None
                    return
            if closing:
                self._stop_all("the transfer engine is closing")
            progressed = self._round(time.monotonic())
            if progressed:
                delay = POLL_MIN
                continue
            time.sleep(delay)
            delay = min(delay * 2, self._pace())

    def _pace(self) -> float:
        """Longest sleep between polls: about the time the smallest entry in flight takes
        at ``PACE_BPS`` (big entries: fewer wake-ups, more CPU left to the transport)."""
        smallest = min((job.length[job.inflight[0][1]] for peer in self._peers.values()
                        for job in peer.jobs if job.inflight), default=0)
        return min(max(POLL_MAX, smallest / PACE_BPS), PACE_MAX)

    def _round(self, now: float) -> bool:
        """Submit what the windows allow, poll what is in flight; True if anything moved."""
        progressed = False
        for name, peer in list(self._peers.items()):
            for job in list(peer.jobs):
                progressed |= self._fill(peer, job, now)
                progressed |= self._poll(peer, job, now)
                if job.finished:
                    peer.jobs.remove(job)
                    self._finish(job)
                    progressed = True
            if not peer.jobs:
                del self._peers[name]
        return progressed

    def _fill(self, peer: _Peer, job: _Job, now: float) -> bool:
        if job.cancel is not None and job.cancel.cancelled and job.unsubmitted:
            job.stopped = job.cancelled = True  # before the window check: see module doc
            job.retry.clear()
            self.cancelled += 1
            return True
        if not job.unsubmitted or now < job.retry_at:
            return False
        if not self._room(peer):
            if job.retry_since is not None and job.held_since is None:
                job.held_since = now  # waiting for its own window is not being refused
            return False
        if job.held_since is not None:
            if job.retry_since is not None:
                job.retry_since += now - job.held_since
            job.held_since = None
        if job.deadline is not None and now > job.deadline:
            left = len(job.src) - job.next + len(job.retry)
            self._stop(job, TransportError(
                f"write to {job.peer}: deadline passed with {left} of {len(job.src)} "
                f"entries not started"))
            return True
        moved = False
        cancel = job.cancel
        while self._room(peer) and job.unsubmitted:
            if cancel is not None and cancel.cancelled:  # per entry: the next round stops it
                break
            i = job.retry[0] if job.retry else self._next_entry(job, now)
            if i is None:
                break
            bid = self._submit(job.peer, job.src[i], job.dst[i], job.length[i])
            if bid <= 0:
                if not job.retry or job.retry[0] != i:
                    job.retry.appendleft(i)  # submit this entry again after the backoff
                self._refused(job, now, bid)
                break
            if job.retry and job.retry[0] == i:
                job.retry.popleft()
            # An accepted submission does not end a streak of failures: a peer that
            # accepts every entry and then rejects it (a restarted decode on the same
            # transfer address) would be retried forever. Only a landed entry does.
            job.inflight.append((bid, i, now))
            peer.inflight += 1
            peer.inflight_bytes += job.length[i]
            moved = True
        return moved

    def _room(self, peer: _Peer) -> bool:
        """May one more entry go to ``peer``? Below ``min_entries`` in flight always (up to
        ``per_peer``), beyond them while under ``per_peer_bytes`` (see module doc)."""
        return peer.inflight < self.per_peer and (
            peer.inflight < self.min_entries or peer.inflight_bytes < self.per_peer_bytes)

    def _next_entry(self, job: _Job, now: float) -> int | None:
        """The next fresh entry; at a sub-batch boundary the fault hook is asked first."""
        if job.next == job.batch_end:
            if job.batch_no is None:  # numbered once, whatever its attempts
                job.batch_no, job.attempt = self._batch_no, 0
                self._batch_no += 1
            if self.hook is not None:
                forced = self.hook(job.peer, job.batch_no, job.attempt)
                if forced is not None and forced != 0:
                    job.attempt += 1
                    self._refused(job, now, forced)
                    return None
            if job.attempt:
                log.info("batch %d to %s accepted after %d retries", job.batch_no, job.peer,
                         job.attempt)
            job.batch_no = None
            job.batch_end = min(job.next + self.batch_entries, len(job.src))
        i = job.next
        job.next += 1
        return i

    def _refused(self, job: _Job, now: float, rc: int) -> None:
        """A refused submission: back off, or stop the job once the budget is spent."""
        self.retried += 1
        if job.retry_since is None:
            job.retry_since, job.backoff = now, self.retry_backoff
        stop = job.retry_since + self.retry_budget
        if job.deadline is not None:
            stop = min(stop, job.deadline)
        if now + job.backoff > stop:
            self._stop(job, TransportError(
                f"write to {job.peer} refused (queue full or peer unreachable) for "
                f"{now - job.retry_since:.1f}s: rc={rc}", rc))
            return
        job.retry_at = now + job.backoff
        job.backoff = min(job.backoff * 2, MAX_BACKOFF)

    def _poll(self, peer: _Peer, job: _Job, now: float) -> bool:
        """Check the job's oldest entries in flight (:data:`POLL_HEAD`,
        :data:`POLL_PENDING`); the others are checked once they reach the head. True if
        any returned."""
        inflight = job.inflight
        if not inflight:
            return False
        keep: list[tuple[int, int, float]] = []
        check, length = self._check, job.length
        polled = pending = freed = 0
        for entry in inflight:
            if polled == POLL_HEAD or pending == POLL_PENDING:
                break
            polled += 1
            rc = check(entry[0])
            if rc == 0:
                pending += 1
                if now - entry[2] <= self.timeout_s + length[entry[1]] * 1e-9:
                    keep.append(entry)
                    continue
                self.abandoned += 1  # busy: the id cannot be freed
                self._stop(job, TransportError(
                    f"write to {job.peer}: an entry timed out after {now - entry[2]:.1f}s"))
            elif rc == 1:
                job.retry_since = None  # progress: a later failure starts a new budget
                job.landed += length[entry[1]]
            elif rc == -1 and not job.stopped:  # failed: the same bytes again, bounded
                job.retry.append(entry[1])
                self._refused(job, now, rc)
            else:
                self._stop(job, TransportError(f"write to {job.peer}: entry failed "
                                               f"(rc={rc})", rc))
            freed += length[entry[1]]
        if len(keep) == polled:
            return False
        peer.inflight -= polled - len(keep)
        peer.inflight_bytes -= freed
        job.inflight = keep + inflight[polled:]
        return True

    @staticmethod
    def _stop(job: _Job, error: TransportError) -> None:
        if job.error is None:
            job.error = error
        job.stopped = True
        job.retry.clear()

    def _stop_all(self, reason: str) -> None:
        for peer in self._peers.values():
            for job in peer.jobs:
                if job.unsubmitted:
                    self._stop(job, TransportError(f"write to {job.peer}: {reason}"))

    @staticmethod
    def _finish(job: _Job) -> None:
        error = job.error
        if error is None and job.cancelled:
            total = sum(job.length)
            error = WriteCancelled(f"write to {job.peer}: cancelled (its room attempt ended) "
                                   f"after {job.landed} of {total} bytes", job.landed,
                                   total - job.landed)
        try:
            job.done(error)
        except Exception:  # a callback bug must not stop every other write
            log.exception("write completion callback failed")
