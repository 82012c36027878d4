"""Host-memory KV pools an engine registers with its kvd (stdlib + numpy).

``ShmPool`` creates one file under ``/dev/shm`` (kvd opens it by name: ``shm`` handles);
``FdPool`` creates an anonymous memfd whose DESCRIPTOR is sent to kvd with the
registration (``fd`` handles, ``SCM_RIGHTS``: no file name anywhere, for engines whose
allocator cannot use a ``/dev/shm`` path). Both hand out 64-byte aligned numpy views
and handles of slices (:meth:`alloc`). The engine owns the memory: :meth:`close`
drops it (and unlinks ShmPool's file).

A ``ShmPool`` file never outlives the engine for long:

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
because the file exists as long as the engine's mapping does. (An ``FdPool``
has no name: its memory goes with the last descriptor or mapping, kvd's included.)
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import uuid
import weakref
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvd.protocol.memory import FdHandle, ShmHandle

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

    ``name`` (default :func:`owner_name`) is the file's name in ``shm_dir``; creating a
    pool with the default name first runs :func:`sweep_stale`. Raises ``OSError`` if the
    file cannot be created (``FileExistsError`` if ``name`` exists), ``ValueError`` if
    ``nbytes`` is not positive.
    """

    def __init__(self, nbytes: int, name: str | None = None, shm_dir: str = "/dev/shm") -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        if name is None:
            sweep_stale(shm_dir)
        self.path = str(Path(shm_dir) / (name or owner_name()))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map(fd, nbytes)
        except BaseException:
            _unlink(self.path)
            raise
        finally:
            os.close(fd)
        # the file lives as long as the mapping: until close(), the last view, or exit
        self._finalizer = weakref.finalize(self._mm, _unlink, self.path)

    def alloc(self, length: int) -> tuple[npt.NDArray[np.uint8], ShmHandle]:
        """Reserve ``length`` bytes; returns (uint8 view, handle). Raises MemoryError if full."""
        view, start = self._reserve(length)
        return view, ShmHandle(self.path, start, length)

    def close(self, unlink: bool = True) -> None:
        """Drop this process's views and remove the file (``unlink=False``: keep the file,
        and it is then not removed at exit either: the caller owns it from here)."""
        self._unmap()
        if unlink:
            self._finalizer()
        else:
            self._finalizer.detach()


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
