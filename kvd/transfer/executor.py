"""Runs blocking transfer-engine writes off the loop, sharded by destination session.

Each shard is a one-thread executor, so one session's writes stay in order
and a slow session only delays rooms that share its shard. The loop awaits
the result; cancelling the awaiting task does NOT stop a write already
inside a thread, so callers must not free or acknowledge pages until
:meth:`TransferExecutor.write` returns or raises.
"""

from __future__ import annotations

import asyncio
import zlib
from concurrent.futures import ThreadPoolExecutor

from kvd.transfer.backends.base import TransferEngine
from kvd.transfer.plan import Descriptors


class TransferExecutor:
    """``shards`` single-thread executors in front of one :class:`TransferEngine`.

    At most ``queue_size`` writes are handed to each shard at a time (SGLang's
    ``QUEUE_SIZE``); further writes wait on the loop, in order, without holding a
    thread or memory in the executor's queue.
    """

    def __init__(self, engine: TransferEngine, shards: int = 1, queue_size: int = 4) -> None:
        self.engine = engine
        n = max(1, shards)
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"kvd-xfer-{i}")
                       for i in range(n)]
        self._slots = [asyncio.Semaphore(max(1, queue_size)) for _ in range(n)]
        self.busy = 0

    def _shard(self, session: str) -> int:
        return zlib.crc32(session.encode()) % len(self._pools)

    async def write(self, session: str, desc: Descriptors, deadline: float | None = None) -> None:
        """Write ``desc`` to ``session`` (retrying refusals until ``deadline``, monotonic s);
        raises TransportError from the engine."""
        if len(desc) == 0:
            return
        shard = self._shard(session)
        async with self._slots[shard]:
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._pools[shard], self.engine.write, session, desc,
                                       deadline)
            self.busy += 1
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                # The write is still running in its thread: wait it out before unwinding.
                await asyncio.wait([fut])
                raise
            finally:
                self.busy -= 1

    def shutdown(self) -> None:
        """Wait for running writes, then stop the threads."""
        for pool in self._pools:
            pool.shutdown(wait=True)
