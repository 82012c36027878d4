"""The ``mooncake`` transfer backend: the ONLY module that imports ``mooncake``.

:class:`MooncakeEngine` implements :class:`~kvd.transfer.backends.base.TransferEngine`
with the real engine (``tcp`` protocol, ``P2PHANDSHAKE`` metadata: no etcd, no RDMA
NIC needed). Mooncake's integer
return codes become :class:`~kvd.errors.TransportError` here.

Facts this module relies on (measured on the CPU machines, see design.md):
one batch call accepts at most 1024 queued + 1024 waiting entries per peer, so
writes are split into sub-batches of ``max_batch_entries`` (<= 1024); a refused
sub-batch may have partly landed, and a retry rewrites the same bytes, which
is idempotent. The binding releases the GIL; callers run it in an executor.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable

from kvd.addr import format_host
from kvd.errors import TransportError
from kvd.transfer.backends.base import submit_with_retry
from kvd.transfer.plan import Descriptors

log = logging.getLogger(__name__)


class MooncakeEngine:
    """A real Mooncake Transfer Engine, TCP transport, P2P handshake.

    Create one per daemon and keep it: destroying an engine takes about 1 s.
    ``max_batch_entries`` bounds each batch call (<= 1024, the TCP transport's
    per-peer queue). A refused sub-batch (a full queue answers like a dead peer:
    rc -1) is retried with backoff from ``retry_backoff`` doubling up to 50 ms,
    for at most ``retry_budget`` seconds and never past the caller's deadline.
    ``submit_hook`` (fault injection, tests only) may force a submission's rc.
    """

    def __init__(self, host: str, max_batch_entries: int = 512, retry_budget: float = 1.0,
                 retry_backoff: float = 0.001,
                 submit_hook: Callable[[str, int, int], int | None] | None = None) -> None:
        os.environ.setdefault("GLOG_minloglevel", "1")
        try:
            from mooncake.engine import TransferEngine as _Native
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise TransportError(
                "the Mooncake transfer engine is not installed: pip install "
                "'kvd[cpu]' (mooncake-transfer-engine-non-cuda) or 'kvd[cuda]'") from exc
        self._native = _Native()
        rc = self._native.initialize(format_host(host), "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransportError(f"transfer engine initialize({host}, tcp) failed: rc={rc}", rc)
        self._session_id = f"{format_host(host)}:{self._native.get_rpc_port()}"
        self.max_batch_entries = max_batch_entries
        self.retry_budget = retry_budget
        self.retry_backoff = retry_backoff
        self.submit_hook = submit_hook
        self._batch_no = itertools.count()
        self.retried = 0

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, addr: int, length: int) -> None:
        rc = self._native.register_memory(addr, length)
        if rc != 0:
            raise TransportError(f"register_memory({addr:#x}, {length}) failed: rc={rc}", rc)

    def unregister(self, addr: int) -> None:
        rc = self._native.unregister_memory(addr)
        if rc != 0:
            raise TransportError(f"unregister_memory({addr:#x}) failed: rc={rc}", rc)

    def write(self, peer_session: str, desc: Descriptors, deadline: float | None = None) -> None:
        for batch in desc.batches(self.max_batch_entries):
            self._write_batch(peer_session, batch, deadline)

    def _submit(self, peer: str, batch_no: int, attempt: int, src: list[int], dst: list[int],
                ln: list[int]) -> int:
        if self.submit_hook is not None:
            forced = self.submit_hook(peer, batch_no, attempt)
            if forced is not None:
                return forced
        return int(self._native.batch_transfer_sync_write(peer, src, dst, ln))

    def _write_batch(self, peer: str, batch: Descriptors, deadline: float | None) -> None:
        src, dst, ln = batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()
        batch_no, start = next(self._batch_no), time.monotonic()
        rc, attempts = submit_with_retry(
            lambda attempt: self._submit(peer, batch_no, attempt, src, dst, ln),
            self.retry_budget, deadline, self.retry_backoff)
        self.retried += attempts - 1
        if rc == 0:
            if attempts > 1:
                log.info("batch %d to %s accepted after %d retries", batch_no, peer,
                         attempts - 1)
            return
        raise TransportError(
            f"batch of {len(src)} entries to {peer} refused (queue full or peer unreachable) "
            f"for {time.monotonic() - start:.1f}s after {attempts} attempts: rc={rc}", rc)
