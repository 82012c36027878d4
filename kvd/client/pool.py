"""Shared-memory buffers an engine registers with its kvd.

``ShmPool`` creates one file under ``/dev/shm`` and hands out numpy views and
:class:`~kvd.protocol.rpc.ShmHandle` descriptions of slices of it. The engine
owns the file: it unlinks it on :meth:`ShmPool.close`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvd.protocol.rpc import ShmHandle


class ShmPool:
    """A shared-memory file of ``nbytes`` bytes, mapped read-write in this process.

    Slices are handed out with :meth:`alloc` (64-byte aligned). Raises
    ``OSError`` if the file cannot be created.
    """

    ALIGN = 64

    def __init__(self, nbytes: int, name: str | None = None, shm_dir: str = "/dev/shm") -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        self.path = str(Path(shm_dir) / (name or f"kvd-pool-{uuid.uuid4().hex[:12]}"))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self._next = 0

    def alloc(self, length: int) -> tuple[npt.NDArray[np.uint8], ShmHandle]:
        """Reserve ``length`` bytes; returns (uint8 view, handle). Raises MemoryError if full."""
        start = -(-self._next // self.ALIGN) * self.ALIGN
        if start + length > self.nbytes:
            raise MemoryError(f"pool {self.path} full: need {length} bytes at {start}")
        self._next = start + length
        return self.bytes[start:start + length], ShmHandle(self.path, start, length)

    def close(self, unlink: bool = True) -> None:
        """Drop this process's views and optionally remove the file."""
        self.bytes = np.zeros(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    @staticmethod
    def size_for(lengths: list[int]) -> int:
        """Bytes needed to :meth:`alloc` every length in order, with alignment."""
        total = 0
        for n in lengths:
            total = -(-total // ShmPool.ALIGN) * ShmPool.ALIGN + n
        return total
