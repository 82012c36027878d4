"""The ``fake`` transfer backend: copies between buffers of one process (test tier 2).

Every :class:`FakeEngine` of a :class:`FakeFabric` gets an address
(``fake:N``); :meth:`FakeEngine.write` checks each descriptor against the
memory the destination registered (as the real receiving side does) and the
source against this engine's own registrations, then copies with
``ctypes.memmove``. Scripting, for tests:

* ``gate`` (a :class:`threading.Event` per destination) holds writes until set,
  which stands in for a slow or frozen peer without any sleep;
* ``hook`` (a :data:`~kvd.transfer.backends.base.SubmitHook`, e.g. a
  :class:`~kvd.transfer.faults.FaultInjector`) forces a submission's return code;
  refusals are retried like the real backend does (``retry_budget`` s, never past
  the write's deadline), then the write fails with a TransportError and no byte of
  the refused batch moves;
* ``writes`` records ``(src_address, dst_address, nbytes)`` of every write.

It never imports ``mooncake`` and needs no network.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass, field

import numpy as np

from kvd.errors import TransportError
from kvd.transfer.backends.base import SubmitHook, submit_with_retry
from kvd.transfer.plan import Descriptors


@dataclass
class FakeFabric:
    """The in-process "network": every fake engine, by address."""

    engines: dict[str, FakeEngine] = field(default_factory=dict)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    hook: SubmitHook | None = None
    retry_budget: float = 0.2
    writes: list[tuple[str, str, int]] = field(default_factory=list)
    running: int = 0  # writes inside write() now (held ones included)
    waiting: dict[str, int] = field(default_factory=dict)  # at a gate, by destination
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _batches: itertools.count[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def engine(self) -> FakeEngine:
        """A new engine on this fabric."""
        eng = FakeEngine(self, f"fake:{next(self._ids)}")
        self.engines[eng.session_id] = eng
        return eng

    def hold(self, address: str) -> threading.Event:
        """Hold writes to ``address`` until the returned event is set."""
        gate = threading.Event()
        self.gates[address] = gate
        return gate

    @property
    def held(self) -> int:
        """Writes waiting at a gate that is still closed."""
        with self._lock:
            return sum(n for a, n in self.waiting.items()
                       if a in self.gates and not self.gates[a].is_set())

    def release(self, address: str) -> None:
        """Let writes to ``address`` through again."""
        gate = self.gates.pop(address, None)
        if gate is not None:
            gate.set()


class FakeEngine:
    """One in-process transfer backend; see the module docstring."""

    def __init__(self, fabric: FakeFabric, address: str) -> None:
        self.fabric = fabric
        self._address = address
        self.regions: dict[int, int] = {}  # start address -> length (bytes)
        self.closed = False

    @property
    def session_id(self) -> str:
        return self._address

    def register(self, addr: int, length: int, device: str = "cpu",
                 stable: bool = False) -> None:
        if length <= 0:
            raise TransportError(f"register({addr:#x}, {length}): empty region")
        self.regions[addr] = length

    def unregister(self, addr: int) -> None:
        if self.regions.pop(addr, None) is None:
            raise TransportError(f"unregister({addr:#x}): not registered")

    def _inside(self, addr: int, n: int) -> bool:
        return any(a <= addr and addr + n <= a + ln for a, ln in self.regions.items())

    def write(self, peer_session: str, desc: Descriptors, deadline: float | None = None) -> None:
        fabric = self.fabric
        with fabric._lock:
            fabric.running += 1
        try:
            self._write(peer_session, desc, deadline)
        finally:
            with fabric._lock:
                fabric.running -= 1

    def _write(self, peer_session: str, desc: Descriptors, deadline: float | None) -> None:
        fabric = self.fabric
        with fabric._lock:
            batch_no = next(fabric._batches)
        gate = fabric.gates.get(peer_session)
        if gate is not None:
            with fabric._lock:
                fabric.waiting[peer_session] = fabric.waiting.get(peer_session, 0) + 1
            try:
                gate.wait()
            finally:
                with fabric._lock:
                    fabric.waiting[peer_session] -= 1
        peer = fabric.engines.get(peer_session)
        if peer is None or peer.closed:
            raise TransportError(f"write to {peer_session}: no such peer", -1)
        hook = fabric.hook
        if hook is not None:
            rc, attempts = submit_with_retry(lambda a: hook(peer_session, batch_no, a) or 0,
                                             fabric.retry_budget, deadline)
            if rc:
                raise TransportError(f"batch to {peer_session} refused (queue full or peer "
                                     f"unreachable) after {attempts} attempts: rc={rc}", rc)
        src, dst, ln = (np.asarray(a, dtype=np.uint64).tolist()
                        for a in (desc.src, desc.dst, desc.length))
        for s, d, n in zip(src, dst, ln, strict=True):
            if not self._inside(s, n):
                raise TransportError(f"source [{s:#x}, +{n}) is not registered here", -1)
            if not peer._inside(d, n):
                raise TransportError(f"destination [{d:#x}, +{n}) is not registered at "
                                     f"{peer_session}", -1)
        for s, d, n in zip(src, dst, ln, strict=True):
            ctypes.memmove(d, s, n)
        with fabric._lock:
            fabric.writes.append((self._address, peer_session, int(sum(ln))))
