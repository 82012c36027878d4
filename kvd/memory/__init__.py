"""The memory plane: buffers the engine (or a same-host peer daemon) gives kvd.

One interface, :class:`Buffer`, per imported buffer whatever its handle kind
(:mod:`kvd.protocol.memory`): ``address`` in this process, ``length`` bytes,
``device`` (``"cpu"`` or ``"cuda:N"``), ``host_addressable`` (may the CPU read it:
nothing in kvd assumes so unless this says it), ``read``/``write`` (kvd's own accesses,
SIGBUS-safe for host files: case S16), ``release()``. Importers by kind:
``shm``, ``fd`` and ``passed_fd`` -> :mod:`kvd.memory.host`, ``cuda_ipc`` ->
:mod:`kvd.memory.cuda` (the only module that imports the CUDA bindings, on first use).

:class:`EngineMemory` holds one engine's registration and makes it transactional
(case S12): every handle is imported, then the KV args are checked, then each BUFFER
(never a whole file: case S01) is registered with the transfer engine; if any step
fails, everything done so far is undone and nothing stays mapped or registered.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvd.errors import HandleError, KvdError
from kvd.memory import cuda as _cuda
from kvd.memory.host import HostBuffer, HostFiles, check_passed_fd, open_shm
from kvd.protocol.memory import (
    CudaIpcHandle,
    ExportedBuffer,
    ExportedPool,
    FdHandle,
    MemoryHandle,
    PassedFdHandle,
    PeerHandle,
    ShmHandle,
)
from kvd.transfer.backends.base import TransferEngine

log = logging.getLogger("kvd.memory")


class Buffer(Protocol):
    """One imported buffer (see the module docstring)."""

    @property
    def address(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def host_addressable(self) -> bool: ...

    @property
    def stable(self) -> bool:
        """Host memory that can never shrink under kvd (a file sealed with
        ``F_SEAL_SHRINK``): a copy through its mapping cannot fault (S16)."""
        ...

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset``, without touching memory that may have gone (S16).
        Raises :class:`HandleError`."""
        ...

    def write(self, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset``, likewise. Raises :class:`HandleError`."""
        ...

    def release(self) -> None: ...


@dataclass
class Importer:
    """Maps handles into this process; one per daemon (files and CUDA segments are shared
    by the buffers inside them)."""

    shm_dir: Path
    host: HostFiles = field(default_factory=HostFiles)
    gpu: _cuda.CudaImports = field(default_factory=_cuda.CudaImports)

    def engine_buffer(self, h: MemoryHandle, fds: Sequence[int], engine_uid: int) -> Buffer:
        """Import a handle from the local engine. ``fds``: descriptors that came with the
        request (``FdHandle.fd`` indexes them; they stay owned by the caller).
        Raises :class:`HandleError` (or :class:`~kvd.errors.CudaUnavailable`)."""
        if isinstance(h, ShmHandle):
            fd = open_shm(h.path, self.shm_dir, engine_uid)
            return self.host.buffer(fd, h.offset, h.length, h.path)
        if isinstance(h, FdHandle):
            if not 0 <= h.fd < len(fds):
                raise HandleError(f"fd handle names descriptor #{h.fd} of {len(fds)} passed")
            what = f"passed descriptor #{h.fd}"
            check_passed_fd(fds[h.fd], what)
            return self.host.buffer(os.dup(fds[h.fd]), h.offset, h.length, what)
        if isinstance(h, CudaIpcHandle):
            return self.gpu.buffer(h)
        raise HandleError(f"unsupported buffer handle {type(h).__name__}")

    def peer_buffer(self, h: PeerHandle, fds: Sequence[int] = ()) -> Buffer:
        """Import a same-host peer daemon's exported handle; ``fds``: the descriptors its
        peer channel passed (checked there; they stay owned by the caller). Raises
        :class:`HandleError`."""
        if isinstance(h, PassedFdHandle):
            if not 0 <= h.file < len(fds):
                raise HandleError(f"region names channel descriptor #{h.file} of {len(fds)}")
            what = f"peer channel descriptor #{h.file}"
            return self.host.buffer(os.dup(fds[h.file]), h.offset, h.length, what)
        if isinstance(h, CudaIpcHandle):
            return self.gpu.buffer(h)
        raise HandleError(f"unsupported peer handle {type(h).__name__}")

    def close(self) -> None:
        """Unmap every file and close every CUDA segment still open (shutdown)."""
        for mapped in list(self.host.files.values()):
            self.host._drop(mapped)
        for key, seg in list(self.gpu.opened.items()):
            with contextlib.suppress(KvdError):
                self.gpu._close(key, seg)


def import_all(make: Callable[[object], Buffer], handles: Sequence[object]) -> list[Buffer]:
    """``[make(h) for h in handles]``, all or nothing: on an error every buffer made so
    far is released before the error propagates."""
    out: list[Buffer] = []
    try:
        for h in handles:
            out.append(make(h))
    except BaseException:
        release_all(out)
        raise
    return out


def release_all(buffers: Sequence[Buffer]) -> None:
    """Release every buffer (errors are logged: release must not stop half-way)."""
    for b in buffers:
        try:
            b.release()
        except Exception as exc:
            log.warning("releasing buffer %#x: %s", b.address, exc)


def check_disjoint(buffers: Sequence[Buffer]) -> None:
    """Raise :class:`HandleError` if two buffers overlap (bounds are per buffer: two
    overlapping buffers would let a write planned for one land in the other)."""
    spans = sorted((b.address, b.address + b.length, i) for i, b in enumerate(buffers))
    for (_, end, i), (start, _, j) in itertools.pairwise(spans):
        if start < end:
            raise HandleError(f"buffers {min(i, j)} and {max(i, j)} overlap")


@dataclass
class EngineMemory:
    """One engine's registered buffers: KV, aux, then state (state slots and the window
    pool, hybrid models, then the buffers of paged cache groups: draft KV, indexer K), and
    what the transfer engine knows."""

    kv: list[Buffer]
    aux: list[Buffer]
    registered: list[int] = field(default_factory=list)
    state: list[Buffer] = field(default_factory=list)

    @property
    def buffers(self) -> list[Buffer]:
        return [*self.kv, *self.aux, *self.state]

    def register(self, engine: TransferEngine) -> None:
        """Register each buffer (not the files around them) with ``engine``; all or
        nothing. Raises the engine's TransportError after undoing what it did."""
        try:
            for b in self.buffers:
                engine.register(b.address, b.length, b.device, stable=b.stable)
                self.registered.append(b.address)
        except KvdError:
            self.unregister(engine)
            raise

    def lost(self) -> str | None:
        """None while every host buffer's file still holds the whole buffer; otherwise
        which buffer no longer does, with the sizes (one ``fstat`` per buffer not sealed
        against shrinking; case S16: the engine truncated memory it registered)."""
        for name, bufs in (("KV", self.kv), ("aux", self.aux), ("state", self.state)):
            for i, b in enumerate(bufs):
                why = b.shrunk() if isinstance(b, HostBuffer) and not b.stable else None
                if why is not None:
                    return f"{name} buffer {i}: {why}"
        return None

    def unregister(self, engine: TransferEngine) -> None:
        """Unregister from ``engine`` (errors logged)."""
        for addr in self.registered:
            try:
                engine.unregister(addr)
            except Exception as exc:
                log.warning("unregister %#x: %s", addr, exc)
        self.registered.clear()

    def release(self) -> None:
        """Unmap / close everything (call :meth:`unregister` first)."""
        release_all(self.buffers)

    def export(self, host_id: str, channel: str = "") -> tuple[ExportedPool, list[int]]:
        """This registration for a same-host peer daemon's ``local`` backend, and the
        descriptors its peer channel passes (``PassedFdHandle.file`` indexes them; this
        daemon's own, not dups: valid while the registration is). ``channel``: the
        channel socket's name (case S18)."""
        files: dict[int, int] = {}  # kept descriptor -> position
        out: list[ExportedBuffer] = []
        for b in self.buffers:
            handle: PeerHandle
            if isinstance(b, HostBuffer):
                i = files.setdefault(b.file.fd, len(files))
                handle = PassedFdHandle(i, b.offset, b.length)
            else:
                handle = b.export()  # type: ignore[attr-defined]
            out.append(ExportedBuffer(address=b.address, length=b.length, handle=handle))
        return (ExportedPool(host_id=host_id, buffers=out, channel=channel, pid=os.getpid()),
                list(files))


def import_engine(importer: Importer, kv: Sequence[MemoryHandle], aux: Sequence[MemoryHandle],
                  fds: Sequence[int], engine_uid: int,
                  state: Sequence[MemoryHandle] = ()) -> EngineMemory:
    """Import an engine's KV, aux and state handles, all or nothing (S12), and refuse
    overlaps."""
    bufs = import_all(lambda h: importer.engine_buffer(h, fds, engine_uid),  # type: ignore[arg-type]
                      [*kv, *aux, *state])
    try:
        check_disjoint(bufs)
    except HandleError:
        release_all(bufs)
        raise
    n = len(kv) + len(aux)
    return EngineMemory(bufs[:len(kv)], bufs[len(kv):n], state=bufs[n:])


def close_quietly(fds: Sequence[int]) -> None:
    """Close descriptors received with a request (they were dup'ed where kept)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
