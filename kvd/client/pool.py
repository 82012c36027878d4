"""Shared-memory buffers an engine registers with its kvd.

``ShmPool`` creates one file under ``/dev/shm`` and hands out numpy views and
:class:`~kvd.protocol.rpc.ShmHandle` descriptions of slices of it. The engine
owns the file, and it never outlives the engine for long:

* :meth:`ShmPool.close` unlinks it;
* otherwise a finalizer unlinks it when the last view of the mapping is gone, or
  at interpreter exit (``weakref.finalize``), so an engine that exits without
  ``close()`` leaves nothing behind;
* an engine killed outright cannot clean up, so default file names carry the
  owner: ``kvd-pool-<pid>-<pidns>-<random>`` (``pidns``: the inode of the
  owner's pid namespace, so that containers sharing ``/dev/shm`` never judge
  each other's pids), and every new pool first removes the files of owners that
  no longer exist (:func:`sweep_stale`).

kvd keeps its own mapping of an unlinked file for as long as it uses it; a kvd
that restarts while the engine runs maps the file again by name, which works
because the file exists as long as the engine's mapping does.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
import weakref
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvd.protocol.rpc import ShmHandle

PREFIX = "kvd-pool"


def _pid_namespace() -> int:
    """Inode of this process's pid namespace (0 if /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_name(prefix: str = PREFIX) -> str:
    """A new file name that names this process as its owner:
    ``<prefix>-<pid>-<pidns>-<8 hex>``."""
    return f"{prefix}-{os.getpid()}-{_pid_namespace()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def sweep_stale(shm_dir: str | Path = "/dev/shm", prefix: str = PREFIX) -> list[str]:
    """Unlink ``<prefix>-<pid>-<pidns>-*`` files whose owner (``pid`` in this pid
    namespace) no longer runs; returns the removed paths.

    Files of another pid namespace are left alone (their pids mean nothing here), and
    so are names that do not parse. A reused pid keeps a dead owner's file (a leak, never
    a wrong removal) until that pid exits too.
    """
    ns, removed = str(_pid_namespace()), []
    for path in Path(shm_dir).glob(f"{prefix}-*-*-*"):
        pid, _, rest = path.name[len(prefix) + 1:].partition("-")
        file_ns = rest.partition("-")[0]
        if pid.isdigit() and file_ns == ns and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                path.unlink()
                removed.append(str(path))
    return removed


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ShmPool:
    """A shared-memory file of ``nbytes`` bytes, mapped read-write in this process.

    Slices are handed out with :meth:`alloc` (64-byte aligned). ``name`` (default
    :func:`owner_name`) is the file's name in ``shm_dir``; creating a pool with the
    default name first runs :func:`sweep_stale`. Raises ``OSError`` if the file cannot
    be created (``FileExistsError`` if ``name`` exists), ``ValueError`` if ``nbytes``
    is not positive.
    """

    ALIGN = 64

    def __init__(self, nbytes: int, name: str | None = None, shm_dir: str = "/dev/shm") -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        if name is None:
            sweep_stale(shm_dir)
        self.path = str(Path(shm_dir) / (name or owner_name()))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _unlink(self.path)
            raise
        finally:
            os.close(fd)
        # the file lives as long as the mapping: until close(), the last view, or exit
        self._finalizer = weakref.finalize(self._mm, _unlink, self.path)
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
        """Drop this process's views and remove the file (``unlink=False``: keep the file,
        and it is then not removed at exit either: the caller owns it from here)."""
        self.bytes = np.zeros(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mm.close()
        if unlink:
            self._finalizer()
        else:
            self._finalizer.detach()

    @staticmethod
    def size_for(lengths: list[int]) -> int:
        """Bytes needed to :meth:`alloc` every length in order, with alignment."""
        total = 0
        for n in lengths:
            total = -(-total // ShmPool.ALIGN) * ShmPool.ALIGN + n
        return total
