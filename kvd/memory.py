"""Mapping the engine's shared-memory buffers into the daemon.

The engine owns the KV pool; kvd maps the same file with ``mmap`` (not
``multiprocessing.shared_memory``, whose resource tracker would unlink the
engine's pool when kvd exits on Python < 3.13) and registers each mapping
once with the transfer engine. Only files under the configured ``shm_dir``
are accepted.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvd.errors import RegistrationError
from kvd.protocol.rpc import ShmHandle


@dataclass
class Mapping:
    """One mapped file: its base address in this process and length in bytes."""

    path: str
    mm: mmap.mmap
    addr: int
    length: int


@dataclass
class MemoryMap:
    """The shared-memory files this daemon has mapped, keyed by resolved path."""

    shm_dir: Path
    mappings: dict[str, Mapping] = field(default_factory=dict)

    def resolve(self, handle: ShmHandle) -> int:
        """Map ``handle``'s file if needed; return the buffer's address in this process.

        Raises :class:`RegistrationError` if the kind is unsupported, the path is
        outside ``shm_dir``, the file is missing, or the range exceeds the file.
        """
        if handle.kind != "shm":
            raise RegistrationError(f"unsupported buffer handle kind {handle.kind!r}")
        if handle.offset < 0 or handle.length <= 0:
            raise RegistrationError(f"bad range offset={handle.offset} length={handle.length}")
        mapping = self._map(handle.path)
        if handle.offset + handle.length > mapping.length:
            raise RegistrationError(
                f"buffer [{handle.offset}, +{handle.length}) exceeds {handle.path} "
                f"({mapping.length} bytes)")
        return mapping.addr + handle.offset

    def _map(self, path: str) -> Mapping:
        real = os.path.realpath(path)
        root = os.path.realpath(self.shm_dir)
        if os.path.commonpath([real, root]) != root:
            raise RegistrationError(f"{path} is not under the shared-memory folder {root}")
        if real in self.mappings:
            return self.mappings[real]
        try:
            fd = os.open(real, os.O_RDWR)
        except OSError as exc:
            raise RegistrationError(f"cannot open {path}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise RegistrationError(f"{path} is empty")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        mapping = Mapping(real, mm, addr, size)
        self.mappings[real] = mapping
        return mapping

    def close(self) -> None:
        """Unmap everything (callers unregister from the transfer engine first)."""
        for m in self.mappings.values():
            with contextlib.suppress(BufferError):  # a view is alive; the OS unmaps at exit
                m.mm.close()
        self.mappings.clear()
