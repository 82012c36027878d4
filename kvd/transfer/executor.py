"""Runs transfer-backend writes off the loop.

Backends that start writes without a thread (:class:`~kvd.transfer.backends.base.
StartWrite`: ``mooncake``, driven by :class:`~kvd.transfer.pump.WritePump`) are called
directly: the write is started from the loop and its completion comes back through
``call_soon_threadsafe``; the pump bounds what is in flight per destination and a
frozen destination holds no shared thread (K24).

For blocking backends (``local``, ``fake``) each destination session gets its own
single-thread executor, created on first use, so one session's writes stay in
order and a slow or frozen destination delays only the rooms that go to it — whatever the number of
destinations (case K24: isolation must not depend on hashing peers onto a few
threads). A session's thread is stopped once it has been idle for
``idle_s`` seconds. At most ``queue_size`` writes per session are handed to its
thread at a time (SGLang's ``QUEUE_SIZE``); further writes wait on the loop.

A session whose peer is a new instance (a decode restarted on the same session name) is
renewed first (:meth:`TransferExecutor.renew`, backends that cache per session,
:class:`~kvd.transfer.backends.base.RenewSession`): the backend's blocking renewal runs
off the loop, and every write to that session started after the call waits for it, so
the first write to the new instance never uses what was cached for the old one (K39).

The loop awaits each result; cancelling the awaiting task does NOT stop a
write already inside a thread, so callers must not free or acknowledge pages
until :meth:`TransferExecutor.write` returns or raises.

Cancellation (K43) is by token, not by task: a write whose
:class:`~kvd.transfer.backends.base.CancelToken` is cancelled before it starts -- while
it waits for a lane slot, or in the lane's queue before its thread picks it up -- never
starts and raises :class:`~kvd.errors.WriteCancelled`; the pump drops the entries it
has not submitted. What already runs is waited out, as above.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvd.errors import WriteCancelled
from kvd.transfer.backends.base import CancelToken, RenewSession, StartWrite, TransferEngine
from kvd.transfer.plan import Descriptors

log = logging.getLogger(__name__)


@dataclass
class _Lane:
    """One destination's thread, its admission slots and its last use (monotonic s)."""

    pool: ThreadPoolExecutor
    slots: asyncio.Semaphore
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)


class TransferExecutor:
    """Per-destination threads in front of one :class:`TransferEngine`.

    ``shards`` is kept for configuration compatibility and bounds nothing: the
    thread count follows the destinations in use (idle threads are stopped).
    """

    def __init__(self, engine: TransferEngine, shards: int = 1, queue_size: int = 4,
                 idle_s: float = 60.0) -> None:
        self.engine = engine
        # isinstance against a runtime-checkable Protocol walks its members (~10 us):
        # once here, not per write.
        self._starts = engine if isinstance(engine, StartWrite) else None
        self.queue_size = max(1, queue_size)
        self.idle_s = idle_s
        self._renews = engine if isinstance(engine, RenewSession) else None
        self._lanes: dict[str, _Lane] = {}
        self._retired: list[ThreadPoolExecutor] = []
        self._renewing: dict[str, asyncio.Task[None]] = {}  # session -> its last renewal
        self.busy = 0
        self.renewals = 0  # renewals that ran (tests, /health)

    @property
    def threads(self) -> int:
        """Destination threads alive now."""
        return len(self._lanes)

    def _lane(self, session: str) -> _Lane:
        lane = self._lanes.get(session)
        if lane is None:
            self._reap()
            name = f"kvd-xfer-{len(self._lanes)}"
            lane = _Lane(ThreadPoolExecutor(1, thread_name_prefix=name),
                         asyncio.Semaphore(self.queue_size))
            self._lanes[session] = lane
        return lane

    def _reap(self) -> None:
        now = time.monotonic()
        for session, lane in list(self._lanes.items()):
            if lane.active == 0 and now - lane.last_used > self.idle_s:
                del self._lanes[session]
                lane.pool.shutdown(wait=False)
                self._retired.append(lane.pool)

    async def write(self, session: str, desc: Descriptors, deadline: float | None = None,
                    cancel: CancelToken | None = None) -> None:
        """Write ``desc`` to ``session`` (retrying refusals until ``deadline``, monotonic s);
        raises TransportError from the backend, WriteCancelled once ``cancel`` stopped it
        (see the module doc)."""
        if len(desc) == 0:
            return
        renewal = self._renewing.get(session)
        if renewal is not None:
            await asyncio.wait([renewal])
        engine = self._starts
        if engine is not None and engine.can_start(session):
            await self._started(engine, session, desc, deadline, cancel)
            return
        lane = self._lane(session)
        lane.active += 1
        try:
            await self._admit(lane, desc, cancel)
            try:
                await self._in_lane(lane, session, desc, deadline, cancel)
            finally:
                lane.slots.release()
        finally:
            lane.active -= 1
            lane.last_used = time.monotonic()

    def renew(self, session: str) -> None:
        """The peer behind ``session`` is a new instance: renew what the backend cached
        for it (off the loop, after any renewal of it still running); writes to
        ``session`` started from now on wait for it (K39). A backend that caches nothing
        per session: nothing to do. Loop thread only."""
        if self._renews is None:
            return
        task = asyncio.get_running_loop().create_task(
            self._renew(session, self._renewing.get(session)), name=f"renew-{session}")
        self._renewing[session] = task
        task.add_done_callback(lambda t: self._renewed(session, t))

    async def _renew(self, session: str, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await asyncio.wait([before])
        assert self._renews is not None
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self._renews.renew_session, session)
            self.renewals += 1
        except Exception as exc:  # the writes that wait for it go ahead (and may fail)
            log.warning("could not renew transfer session %s: %s", session, exc)

    def _renewed(self, session: str, task: asyncio.Task[None]) -> None:
        if self._renewing.get(session) is task:
            del self._renewing[session]

    async def _in_lane(self, lane: _Lane, session: str, desc: Descriptors,
                       deadline: float | None, cancel: CancelToken | None) -> None:
        """Run the write on the lane's thread. Cancelled while it still waits in the lane's
        queue, it is taken out (never runs: WriteCancelled); once running it is waited out."""
        cf = lane.pool.submit(_blocking, self.engine, session, desc, deadline, cancel)
        undo = cancel.on_cancel(cf.cancel) if cancel is not None else None
        try:
            await self._wait_out(asyncio.wrap_future(cf))
        except asyncio.CancelledError:
            if cf.cancelled():  # taken out of the queue, not this task cancelled
                raise _cancelled(desc) from None
            raise
        finally:
            if undo is not None:
                undo()

    @staticmethod
    async def _admit(lane: _Lane, desc: Descriptors, cancel: CancelToken | None) -> None:
        """Take one of the lane's slots, unless ``cancel`` is cancelled first (then raise
        WriteCancelled: a queued write of an ended room does not wait for the writes
        ahead of it)."""
        if cancel is None or not lane.slots.locked():
            if cancel is not None and cancel.cancelled:
                raise _cancelled(desc)
            await lane.slots.acquire()
            return
        slot: asyncio.Future[bool] = asyncio.ensure_future(lane.slots.acquire())
        undo = cancel.on_cancel(slot.cancel)
        admitted = False
        try:
            await asyncio.wait([slot])
            admitted = not cancel.cancelled
        finally:
            undo()
            if not slot.done():  # this task was cancelled
                slot.cancel()
                await asyncio.wait([slot])
            if not admitted and slot.done() and not slot.cancelled():
                lane.slots.release()  # got a slot it will not use
        if not admitted:
            raise _cancelled(desc)

    async def _started(self, engine: StartWrite, session: str, desc: Descriptors,
                       deadline: float | None, cancel: CancelToken | None) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def done(error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, fut, error)

        engine.start_write(session, desc, deadline, done, cancel)
        await self._wait_out(fut)

    async def _wait_out(self, fut: asyncio.Future[None]) -> None:
        """Await a write running outside the loop (a thread, or entries in the pump),
        counted in ``busy``. Cancelled, it still waits the write out before unwinding: the
        pages it reads stay in use until it returns. Raises what the write raised."""
        self.busy += 1
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise
        finally:
            self.busy -= 1

    def shutdown(self) -> None:
        """Wait for running writes, then stop the threads."""
        for lane in self._lanes.values():
            lane.pool.shutdown(wait=True)
        for pool in self._retired:
            pool.shutdown(wait=True)
        self._lanes.clear()
        self._retired.clear()
        if isinstance(self.engine, StartWrite):  # entries in flight get a bounded wait
            self.engine.close_writes(5.0)


def _cancelled(desc: Descriptors) -> WriteCancelled:
    return WriteCancelled(f"write of {desc.nbytes} bytes cancelled before it started (its "
                          f"room attempt ended)", 0, desc.nbytes)


def _blocking(engine: TransferEngine, session: str, desc: Descriptors, deadline: float | None,
              cancel: CancelToken | None) -> None:
    """A lane thread's write: a cancelled one waiting in the lane's queue never starts."""
    if cancel is not None and cancel.cancelled:
        raise _cancelled(desc)
    engine.write(session, desc, deadline)


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
