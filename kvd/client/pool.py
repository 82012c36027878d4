"""Host-memory KV pools an engine registers with its kvd (stdlib + numpy).

``ShmPool`` creates one file under ``/dev/shm`` (kvd opens it by name: ``shm`` handles);
``FdPool`` creates an anonymous memfd whose DESCRIPTOR is sent to kvd with the
registration (``fd`` handles, ``SCM_RIGHTS``: no file name anywhere, for engines whose
allocator cannot use a ``/dev/shm`` path). Both hand out 64-byte aligned numpy views
and handles of slices (:meth:`alloc`). The engine owns the memory: :meth:`close`
drops it (and unlinks ShmPool's file).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import uuid
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvd.protocol.memory import FdHandle, ShmHandle


class _Pool:
    """``nbytes`` of shared memory mapped read-write from ``fd`` (not kept by the base)."""

    ALIGN = 64

    def _map(self, fd: int, nbytes: int) -> None:
        self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.nbytes = nbytes
        self.bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self._next = 0

    def _reserve(self, length: int) -> tuple[npt.NDArray[np.uint8], int]:
        start = -(-self._next // self.ALIGN) * self.ALIGN
        if length <= 0 or start + length > self.nbytes:
            raise MemoryError(f"pool of {self.nbytes} bytes full: need {length} bytes at {start}")
        self._next = start + length
        return self.bytes[start:start + length], start

    def _unmap(self) -> None:
        self.bytes = np.zeros(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mm.close()

    @staticmethod
    def size_for(lengths: list[int]) -> int:
        """Bytes needed to :meth:`alloc` every length in order, with alignment."""
        total = 0
        for n in lengths:
            total = -(-total // _Pool.ALIGN) * _Pool.ALIGN + n
        return total


class ShmPool(_Pool):
    """A shared-memory file of ``nbytes`` bytes (mode 0600), mapped read-write here.

    Raises ``OSError`` if the file cannot be created.
    """

    def __init__(self, nbytes: int, name: str | None = None, shm_dir: str = "/dev/shm") -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        self.path = str(Path(shm_dir) / (name or f"kvd-pool-{uuid.uuid4().hex[:12]}"))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map(fd, nbytes)
        finally:
            os.close(fd)

    def alloc(self, length: int) -> tuple[npt.NDArray[np.uint8], ShmHandle]:
        """Reserve ``length`` bytes; returns (uint8 view, handle). Raises MemoryError if full."""
        view, start = self._reserve(length)
        return view, ShmHandle(self.path, start, length)

    def close(self, unlink: bool = True) -> None:
        """Drop this process's views and optionally remove the file."""
        self._unmap()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class FdPool(_Pool):
    """An anonymous memfd of ``nbytes`` bytes, sealed against resizing, mapped here.

    Its handles (:class:`~kvd.protocol.memory.FdHandle`) carry this process's descriptor
    number; :class:`~kvd.client.KvdClient` sends the descriptor with the registration.
    Keep the pool open while kvd uses it (kvd keeps its own reference to the memory
    until it unregisters). Raises ``OSError`` if the memfd cannot be created.
    """

    SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

    def __init__(self, nbytes: int, name: str = "kvd-pool") -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, self.SEALS)  # kvd refuses shrinkable memfds
            self._map(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise

    def alloc(self, length: int) -> tuple[npt.NDArray[np.uint8], FdHandle]:
        """Reserve ``length`` bytes; returns (uint8 view, handle). Raises MemoryError if full."""
        view, start = self._reserve(length)
        return view, FdHandle(self.fd, start, length)

    def close(self) -> None:
        """Drop this process's views and descriptor (the memory goes with kvd's last use)."""
        self._unmap()
        with contextlib.suppress(OSError):
            os.close(self.fd)
