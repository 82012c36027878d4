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

from kvd.transfer.engine import TransferEngine
from kvd.transfer.plan import Descriptors


class TransferExecutor:
    """``shards`` single-thread executors in front of one :class:`TransferEngine`."""

    def __init__(self, engine: TransferEngine, shards: int = 1) -> None:
        self.engine = engine
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"kvd-xfer-{i}")
                       for i in range(max(1, shards))]
        self.busy = 0

    def _pool(self, session: str) -> ThreadPoolExecutor:
        return self._pools[zlib.crc32(session.encode()) % len(self._pools)]

    async def write(self, session: str, desc: Descriptors, deadline: float | None = None) -> None:
        """Write ``desc`` to ``session`` (retrying refusals until ``deadline``, monotonic s);
        raises TransportError from the engine."""
        if len(desc) == 0:
            return
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool(session), self.engine.write, session, desc,
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
