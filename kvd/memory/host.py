"""Host memory the daemon maps: ``shm`` files by name, ``fd`` descriptors (the engine's,
or a same-host peer daemon's ``passed_fd`` from its peer channel).

Every file is opened ONCE and checked on the open descriptor (never by name
after the fact: case S10):

* ``shm``: the name must lie under ``shm_dir`` (lexically: absolute, no ``.``/``..``
  parts); each folder below ``shm_dir`` is opened with ``O_DIRECTORY|O_NOFOLLOW`` and
  the file with ``O_NOFOLLOW`` relative to it (``openat``), so neither a symlink nor a
  rename race leads outside. On the descriptor: a regular file, owned by the engine
  that registers it (``SO_PEERCRED`` uid: a member of ``engine_socket_group`` cannot
  make kvd map another user's file), not writable by others, not empty.
* ``fd``: the engine passed the descriptor itself (``SCM_RIGHTS``); possession is the
  proof of access. On the descriptor: a regular file opened read-write; a memfd must be
  sealed against shrinking (``F_SEAL_SHRINK``; :class:`kvd.client.FdPool` does), since a
  file that shrinks under a mapping kills the mapper with ``SIGBUS``.
* ``passed_fd`` (a peer daemon's export, same host): received over the authenticated
  peer channel (:mod:`kvd.transfer.backends.peerchannel`) and checked as an ``fd``
  descriptor plus its size; never opened by a name, pid or number (case S18).

kvd's own reads and writes of engine memory (aux slots over the control plane) go
through the kept descriptor (``pread``/``pwrite``, :meth:`HostBuffer.read` and
:meth:`HostBuffer.write`), never through the mapping: an engine that truncates its file
under kvd (case S16) then costs a :class:`HandleError`, where a load or store in the
mapping past the file's end would kill the daemon with ``SIGBUS``. The ``local``
backend's copies go through the kernel (:mod:`kvd.memory.hostcopy`) unless both files are
sealed against shrinking (:attr:`HostBuffer.stable`); :meth:`HostBuffer.shrunk` tells a
buffer whose file no longer holds it (the daemon then drops the registration).

Files are mapped whole with ``mmap`` (``MAP_SHARED``; not
``multiprocessing.shared_memory``, whose resource tracker would unlink the engine's
pool when kvd exits on Python < 3.13) and shared by every buffer inside them (keyed
by device and inode). The descriptor stays open while a buffer uses the file, so that
a same-host peer can be passed it (:meth:`kvd.memory.EngineMemory.export`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from kvd.errors import HandleError


@dataclass
class MappedFile:
    """One open, mapped file: ``fd`` (kept open), ``base`` address of the mapping in this
    process, ``size`` bytes, ``dev``/``ino`` identity, ``refs`` buffers using it."""

    fd: int
    mm: mmap.mmap
    base: int
    size: int
    dev: int
    ino: int
    what: str
    refs: int = 0
    #: sealed against shrinking (``F_SEAL_SHRINK``, for the life of the file): a load or
    #: store through the mapping can never fault
    sealed: bool = False

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view is alive: the OS unmaps at exit
            self.mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


@dataclass
class HostBuffer:
    """``length`` bytes at ``address`` of a mapped file (offset ``offset`` in it)."""

    file: MappedFile
    offset: int
    length: int
    owner: HostFiles
    released: bool = False

    @property
    def address(self) -> int:
        return self.file.base + self.offset

    @property
    def device(self) -> str:
        return "cpu"

    @property
    def host_addressable(self) -> bool:
        return True

    @property
    def stable(self) -> bool:
        """The file is sealed against shrinking: this buffer stays backed for good (S16)."""
        return self.file.sealed

    def shrunk(self) -> str | None:
        """None while the file still holds the whole buffer; otherwise why not (its
        current size, the buffer's end, the registered size). One ``fstat`` (case S16)."""
        end = self.offset + self.length
        try:
            size = os.fstat(self.file.fd).st_size
        except OSError as exc:
            return f"{self.file.what} cannot be checked: {exc.strerror}"
        if size >= end:
            return None
        return (f"{self.file.what} now ends at byte {size}, before the buffer's end at byte "
                f"{end} (registered {self.file.size} bytes)")

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` of this buffer, read through the file's descriptor
        (never the mapping: a file shrunk under kvd cannot raise ``SIGBUS`` here).
        Raises :class:`HandleError` if the range is outside the buffer or the file now
        ends before it (case S16)."""
        pos = self._span(offset, n)
        try:
            data = os.pread(self.file.fd, n, pos)
        except OSError as exc:
            raise HandleError(f"cannot read {self.file.what}: {exc.strerror}") from exc
        if len(data) != n:
            raise self._shrunk(pos, n)
        return data

    def write(self, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of this buffer through the file's descriptor
        (never the mapping). Raises :class:`HandleError` if the range is outside the
        buffer or the file now ends before its end (case S16).

        The size check and the write are two calls: a file truncated between them is
        extended again by the write (sparse, zeros below the range). kvd neither faults
        nor writes outside the file, and the engine that truncated its pool reads zeros
        where it dropped its own data."""
        pos = self._span(offset, len(data))
        try:
            if os.fstat(self.file.fd).st_size < pos + len(data):
                raise self._shrunk(pos, len(data))
            written = os.pwrite(self.file.fd, data, pos)
        except OSError as exc:
            raise HandleError(f"cannot write {self.file.what}: {exc.strerror}") from exc
        if written != len(data):
            raise HandleError(f"short write to {self.file.what}: {written} of {len(data)} "
                              f"bytes at {pos}")

    def _span(self, offset: int, n: int) -> int:
        """The file offset of ``[offset, +n)`` of this buffer; HandleError if outside."""
        if self.released or offset < 0 or n < 0 or offset + n > self.length:
            raise HandleError(f"[{offset}, +{n}) is outside this buffer of {self.length} "
                              f"bytes of {self.file.what}" + (" (released)" if self.released
                                                              else ""))
        return self.offset + offset

    def _shrunk(self, pos: int, n: int) -> HandleError:
        size = os.fstat(self.file.fd).st_size
        return HandleError(f"{self.file.what} shrank under kvd: it now ends at byte {size}, "
                           f"before [{pos}, +{n}) (registered {self.file.size} bytes); the "
                           f"engine changed memory it registered")

    def release(self) -> None:
        """Drop this buffer; the file is unmapped and closed with its last buffer."""
        if not self.released:
            self.released = True
            self.owner.unref(self.file)


@dataclass
class HostFiles:
    """The files mapped by this daemon, keyed by ``(st_dev, st_ino)``."""

    files: dict[tuple[int, int], MappedFile] = field(default_factory=dict)

    def buffer(self, fd: int, offset: int, length: int, what: str) -> HostBuffer:
        """A buffer of the file open at ``fd`` (which this call takes over: it is closed
        here unless it becomes the file's kept descriptor). Raises :class:`HandleError`
        for a bad range; the caller has checked the descriptor."""
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            mapped = self.files.get(key)
            if mapped is None:
                mapped = self._map(fd, st, what)
                fd = -1  # kept by the mapping
        finally:
            if fd >= 0:
                os.close(fd)
        if offset < 0 or length <= 0 or offset + length > mapped.size:
            if mapped.refs == 0:
                self._drop(mapped)
            raise HandleError(f"buffer [{offset}, +{length}) is outside {what} "
                              f"({mapped.size} bytes)")
        mapped.refs += 1
        return HostBuffer(mapped, offset, length, self)

    def _map(self, fd: int, st: os.stat_result, what: str) -> MappedFile:
        try:
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise HandleError(f"cannot map {what}: {exc}") from exc
        base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        mapped = MappedFile(fd, mm, base, st.st_size, st.st_dev, st.st_ino, what,
                            sealed=_shrink_sealed(fd))
        self.files[(st.st_dev, st.st_ino)] = mapped
        return mapped

    def unref(self, mapped: MappedFile) -> None:
        mapped.refs -= 1
        if mapped.refs <= 0:
            self._drop(mapped)

    def _drop(self, mapped: MappedFile) -> None:
        self.files.pop((mapped.dev, mapped.ino), None)
        mapped.close()


def open_shm(path: str, shm_dir: Path, engine_uid: int) -> int:
    """Open ``path`` (a name under ``shm_dir``) read-write, following no link; returns the
    descriptor after :func:`check_shm_file`. Raises :class:`HandleError` (case S10)."""
    parts = _parts_under(path, shm_dir)
    dir_fd = _open_dir(shm_dir)
    try:
        for part in parts[:-1]:
            nxt = _openat(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd, path)
            os.close(dir_fd)
            dir_fd = nxt
        fd = _openat(parts[-1], os.O_RDWR | os.O_NONBLOCK, dir_fd, path)
    finally:
        os.close(dir_fd)
    try:
        check_shm_file(fd, path, engine_uid)
    except HandleError:
        os.close(fd)
        raise
    return fd


def _parts_under(path: str, shm_dir: Path) -> list[str]:
    p = PurePosixPath(path)
    roots = {PurePosixPath(os.path.normpath(shm_dir)), PurePosixPath(os.path.realpath(shm_dir))}
    if not p.is_absolute() or any(part in (".", "..") for part in path.split("/")):
        raise HandleError(f"{path!r} must be an absolute path without . or .. parts")
    for root in roots:
        if p != root and p.is_relative_to(root):
            return list(p.relative_to(root).parts)
    raise HandleError(f"{path} is not under the shared-memory folder {shm_dir}")


def _open_dir(shm_dir: Path) -> int:
    try:
        return os.open(os.path.realpath(shm_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise HandleError(f"cannot open shm_dir {shm_dir}: {exc.strerror}") from exc


def _openat(name: str, flags: int, dir_fd: int, path: str) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        hint = " (a symbolic link: refused)" if exc.errno in (40, 20) else ""  # ELOOP, ENOTDIR
        raise HandleError(f"cannot open {path}: {exc.strerror}{hint}") from exc


def check_shm_file(fd: int, path: str, engine_uid: int) -> None:
    """On the open descriptor: a non-empty regular file owned by ``engine_uid`` and not
    writable by others. Raises :class:`HandleError`."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise HandleError(f"{path} is not a regular file")
    if st.st_uid != engine_uid:
        raise HandleError(f"{path} is owned by uid {st.st_uid}, not by the engine (uid "
                          f"{engine_uid}) that registers it")
    if st.st_mode & stat.S_IWOTH:
        raise HandleError(f"{path} is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
                          f": create the KV pool with mode 0600 or 0660")
    if st.st_size == 0:
        raise HandleError(f"{path} is empty")


def check_passed_fd(fd: int, what: str) -> None:
    """On a descriptor passed with ``SCM_RIGHTS``: a non-empty regular file opened
    read-write; a memfd sealed against shrinking. Raises :class:`HandleError`."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise HandleError(f"{what} is not a regular file (a memfd or a shared-memory file)")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise HandleError(f"{what} was not opened read-write (O_RDWR)")
    if st.st_size == 0:
        raise HandleError(f"{what} is empty")
    if _is_memfd(fd) and not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
        raise HandleError(f"{what} is a memfd that may shrink under kvd's mapping (SIGBUS): "
                          f"seal it with F_SEAL_SHRINK (kvd.client.FdPool does)")


def _shrink_sealed(fd: int) -> bool:
    """Is the file sealed against shrinking (a seal is never removed)?"""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:  # not a file that takes seals (EINVAL)
        return False


def _is_memfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False
