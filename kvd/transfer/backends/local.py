"""The ``local`` transfer backend: both daemons on one host, bytes copied directly.

The decode daemon exports its registered buffers (:class:`~kvd.protocol.memory.
ExportedPool`: host memory as regions of descriptors that only its authenticated peer
channel passes (:mod:`.peerchannel`, case S18), GPU memory as CUDA IPC handles); the
prefill daemon imports them once per peer (:meth:`LocalEngine.attach_peer`) and
then "writes" by copying page runs: for host memory, through the kernel
(:func:`kvd.memory.hostcopy.copy_runs`: a pool file an engine shrank under kvd costs a
TransportError naming the buffer, never a ``SIGBUS``, case S16), or ``ctypes.memmove``
(releases the GIL) when every buffer of the copy is ``stable`` (sealed against
shrinking); ``cudaMemcpyAsync`` on a stream (:class:`kvd.memory.cuda.CudaCopier`, peer
access enabled) when either side is GPU memory (host memory there is read or written by
the CUDA driver through the mapping: not covered by S16). Same rules as over the wire:

* every descriptor's destination must lie inside ONE buffer the peer exported, and
  its source inside one buffer this daemon registered (as the transfer engine's
  receiving side checks, but per buffer), checked for the whole batch before any
  byte moves (:class:`~kvd.errors.BoundsError` wrapped in TransportError);
* addresses on the wire are the peer's; each is translated into this process's
  mapping of the same memory;
* a write returns once every byte landed (host copies are synchronous; GPU copies are
  synchronised per batch), so the release rules of the room protocol hold unchanged.

Peers are named by their transfer address (the ``session_id`` of their KV args).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvd.errors import BoundsError, HandleError, KvdError, TransportError
from kvd.hostid import host_identity, same_host
from kvd.memory import Buffer, Importer, import_all, release_all
from kvd.memory.host import HostBuffer
from kvd.memory.hostcopy import copy_runs
from kvd.protocol.memory import CudaIpcHandle, ExportedPool
from kvd.transfer.backends.peerchannel import (
    Claim,
    Identity,
    check_not_own,
    close_all,
    fetch_pool,
)
from kvd.transfer.plan import U64, Descriptors

log = logging.getLogger(__name__)


@dataclass
class _Table:
    """Buffers sorted by start: ``start``/``end`` (uint64, in the naming process),
    ``local`` (uint64, this process's address of each start), ``device`` per buffer,
    ``stable`` (bool: host memory that cannot shrink under kvd, S16)."""

    start: np.ndarray
    end: np.ndarray
    local: np.ndarray
    device: list[str]
    stable: np.ndarray

    @staticmethod
    def of(starts: list[int], lengths: list[int], local: list[int], devices: list[str],
           stable: list[bool] | None = None) -> _Table:
        order = np.argsort(np.asarray(starts, dtype=U64), kind="stable")
        s = np.asarray(starts, dtype=U64)[order]
        e = s + np.asarray(lengths, dtype=U64)[order]
        if s.size > 1 and np.any(s[1:] < e[:-1]):
            raise HandleError("exported buffers overlap")
        steady = np.asarray(stable if stable is not None else [False] * len(starts),
                            dtype=bool)
        return _Table(s, e, np.asarray(local, dtype=U64)[order], [devices[i] for i in order],
                      steady[order])

    def locate(self, addrs: np.ndarray, lengths: np.ndarray, what: str) -> np.ndarray:
        """Index of the ONE buffer holding each ``[addr, addr+len)``; BoundsError if none."""
        k = np.searchsorted(self.start, addrs, side="right") - 1
        safe = np.maximum(k, 0)
        ok = (k >= 0) & (addrs + lengths >= addrs)
        if self.start.size:
            ok &= addrs + lengths <= self.end[safe]
        else:
            ok[:] = False
        if not np.all(ok):
            i = int(np.flatnonzero(~ok)[0])
            raise BoundsError(f"{what} range [{int(addrs[i]):#x}, +{int(lengths[i])}) is "
                              f"outside every buffer")
        return safe


@dataclass(frozen=True)
class Channel:
    """How this daemon reaches same-host peers' channels: its ``folder``
    (``peer_channel_dir``) and who it is there."""

    folder: Path
    me: Identity
    timeout: float = 5.0
    #: ``(st_dev, st_ino)`` of this daemon's own engine files: never a peer's
    own_files: Callable[[], set[tuple[int, int]]] = set


@dataclass
class _Peer:
    buffers: list[Buffer]
    table: _Table


class LocalEngine:
    """Same-host copy backend (see the module docstring). ``importer`` maps peers'
    handles (a fresh one by default); ``address`` defaults to
    ``local:<host identity>:<pid>``."""

    def __init__(self, importer: Importer | None = None, address: str | None = None,
                 channel: Channel | None = None) -> None:
        self.importer = importer or Importer(shm_dir=Path("/nonexistent"))  # peers: no names
        self.channel = channel
        self.host_id = host_identity()
        self._address = address or f"local:{self.host_id}:{os.getpid()}"
        self._own: dict[int, tuple[int, str, bool]] = {}  # addr -> (length, device, stable)
        self._own_table: _Table | None = None
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._copier: object | None = None

    @property
    def session_id(self) -> str:
        return self._address

    def register(self, addr: int, length: int, device: str = "cpu",
                 stable: bool = False) -> None:
        if length <= 0:
            raise TransportError(f"register({addr:#x}, {length}): empty region")
        with self._lock:
            self._own[addr] = (length, device, stable)
            self._own_table = None

    def unregister(self, addr: int) -> None:
        with self._lock:
            if self._own.pop(addr, None) is None:
                raise TransportError(f"unregister({addr:#x}): not registered")
            self._own_table = None

    def attach_peer(self, address: str, pool: ExportedPool, peer_instance: str = "",
                    peer_endpoint: str = "") -> str:
        """Import every buffer of ``pool`` (all or nothing): host memory only as the
        descriptors the peer's channel passes after proving it is daemon
        ``peer_instance`` at control endpoint ``peer_endpoint`` with transfer session
        ``address`` (:func:`~.peerchannel.fetch_pool`). Raises HandleError when
        the pool is from another host, the channel refuses, or a buffer cannot be
        imported here."""
        if not same_host(pool.host_id, self.host_id):
            raise HandleError(f"peer {address} is on another host ({pool.host_id})")
        fds: list[int] = []
        if any(not isinstance(b.handle, CudaIpcHandle) for b in pool.buffers):
            if self.channel is None:
                raise HandleError("no peer channel configured: host memory of a peer is "
                                  "accepted only through it")
            fds = fetch_pool(self.channel.folder, pool, self.channel.me,
                             Claim(peer_instance, peer_endpoint, address), self.channel.timeout)
        try:
            if fds and self.channel is not None:
                check_not_own(fds, self.channel.own_files())
            bufs = import_all(lambda b: self.importer.peer_buffer(b.handle, fds),  # type: ignore[attr-defined]
                              pool.buffers)
        finally:
            close_all(fds)
        try:
            table = _Table.of([b.address for b in pool.buffers], [b.length for b in pool.buffers],
                              [m.address for m in bufs], [m.device for m in bufs],
                              [m.stable for m in bufs])
        except HandleError:
            release_all(bufs)
            raise
        with self._lock:
            old = self._peers.pop(address, None)
            self._peers[address] = _Peer(bufs, table)
        if old is not None:
            release_all(old.buffers)
        log.info("local backend: attached %d buffers of peer %s", len(bufs), address)
        return "local"

    def detach_peer(self, address: str) -> None:
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            release_all(peer.buffers)

    def has_peer(self, address: str) -> bool:
        return address in self._peers

    def write(self, peer_session: str, desc: Descriptors, deadline: float | None = None) -> None:
        """Copy every descriptor into the attached peer; raises TransportError (nothing
        moved) on an unknown peer or a descriptor outside one buffer."""
        if len(desc) == 0:
            return
        peer = self._peers.get(peer_session)
        if peer is None:
            raise TransportError(f"peer {peer_session} is not attached to the local backend "
                                 f"(not on this host, or its memory could not be imported)")
        src, dst, ln = desc.src, desc.dst, desc.length
        try:
            own = self._own_view()
            si = own.locate(src, ln, "source")
            di = peer.table.locate(dst, ln, f"destination at {peer_session}")
        except BoundsError as exc:
            raise TransportError(f"local write refused: {exc}") from exc
        src_local = own.local[si] + (src - own.start[si])
        dst_local = peer.table.local[di] + (dst - peer.table.start[di])
        gpu = [i for i in range(len(desc)) if own.device[si[i]] != "cpu"
               or peer.table.device[di[i]] != "cpu"] if _any_gpu(own, peer.table) else []
        if gpu:
            self._copy_gpu(src_local, dst_local, ln, si, di, own, peer.table)
            return
        if bool(np.all(own.stable[si])) and bool(np.all(peer.table.stable[di])):
            for d, s, n in zip(dst_local.tolist(), src_local.tolist(), ln.tolist(),
                               strict=True):
                ctypes.memmove(d, s, n)  # both files sealed: nothing can fault
            return
        try:
            copy_runs(dst_local, src_local, ln)
        except HandleError as exc:
            raise TransportError(f"local write to {peer_session} failed: {exc}"
                                 f"{_shrunk_in(peer.buffers)}") from exc

    def _own_view(self) -> _Table:
        with self._lock:
            if self._own_table is None:
                addrs = list(self._own)
                self._own_table = _Table.of(addrs, [self._own[a][0] for a in addrs], addrs,
                                            [self._own[a][1] for a in addrs],
                                            [self._own[a][2] for a in addrs])
            return self._own_table

    def _copy_gpu(self, src: np.ndarray, dst: np.ndarray, ln: np.ndarray, si: np.ndarray,
                  di: np.ndarray, own: _Table, peer: _Table) -> None:
        from kvd.memory.cuda import CudaCopier

        if self._copier is None:
            self._copier = CudaCopier()
        assert isinstance(self._copier, CudaCopier)
        groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for i, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), ln.tolist(),
                                          strict=True)):
            key = (_ordinal(peer.device[di[i]]), _ordinal(own.device[si[i]]))
            groups.setdefault(key, []).append((d, s, n))
        try:
            for (dst_dev, src_dev), runs in groups.items():
                self._copier.copy(runs, dst_dev, src_dev)
        except KvdError as exc:
            raise TransportError(f"local GPU copy failed: {exc}") from exc

    def close(self) -> None:
        """Release every peer's imported memory."""
        for address in list(self._peers):
            self.detach_peer(address)


def _shrunk_in(buffers: list[Buffer]) -> str:
    """``; the peer's <buffer> now ends ...`` for the first of the peer's host buffers whose
    file no longer holds it ("" if none: then it is this daemon's own memory)."""
    for i, b in enumerate(buffers):
        why = b.shrunk() if isinstance(b, HostBuffer) else None
        if why is not None:
            return f"; the peer's buffer {i}: {why}"
    return ""


def _any_gpu(a: _Table, b: _Table) -> bool:
    return any(d != "cpu" for d in a.device) or any(d != "cpu" for d in b.device)


def _ordinal(device: str) -> int:
    """``"cuda:N"`` -> N; host memory copies on device 0's stream (unified addressing)."""
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
