"""Turn raw buffer pointers of this process into kvd shared-memory handles.

Engines that describe their KV pool by raw pointers (SGLang's ``KVArgs.kv_data_ptrs``)
can use kvd only if that memory is a mapping of a file under ``/dev/shm``: kvd maps the
same file (:class:`~kvd.protocol.rpc.ShmHandle`). ``/proc/self/maps`` says, for every
address, which file (and which offset of it) backs it, so a pointer becomes
``(path, file_offset + (ptr - mapping_start), length)`` without the engine having to
remember how it allocated the pool. :func:`parse_maps` and :func:`handle_for` are pure.

Memory that is a SHARED mapping of a file with no usable name -- a memfd
(``/memfd:... (deleted)``, e.g. :class:`kvd.client.FdPool`), a file unlinked after mapping
(torch's ``file_descriptor`` sharing), a file outside the shm folder -- is passed as a
descriptor instead (:func:`fd_handle_for`: ``/proc/self/map_files`` opens the very file
behind the mapping; :class:`~kvd.protocol.memory.FdHandle`, sent with ``SCM_RIGHTS``).
Anonymous and private memory cannot be shared at all and is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvd.protocol.rpc import FdHandle, ShmHandle


class NotSharedMemory(ValueError):
    """The buffer is not (entirely) inside one mapping of a file under the shm folder."""


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/<pid>/maps``: ``[start, end)`` maps ``path`` from ``offset``."""

    start: int
    end: int
    offset: int
    path: str
    shared: bool = True  # "s" in the permissions (a private mapping does not share writes)


def parse_maps(text: str) -> list[Mapping]:
    """Parse ``/proc/<pid>/maps`` text; anonymous mappings get ``path == ""``.

    Line format (proc(5)): ``start-end perms offset dev inode [path]``, hex numbers.
    """
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        start, _, end = parts[0].partition("-")
        path = parts[5].strip() if len(parts) == 6 else ""
        out.append(Mapping(int(start, 16), int(end, 16), int(parts[2], 16), path,
                           parts[1][3:4] == "s"))
    return out


def handle_for(addr: int, length: int, maps: list[Mapping], shm_dir: str = "/dev/shm"
               ) -> ShmHandle:
    """The handle of ``[addr, addr + length)``. Raises :class:`NotSharedMemory` naming what
    backs the address instead (anonymous memory, another file, a deleted file, or a range
    that runs past its mapping)."""
    root = os.path.realpath(shm_dir).rstrip("/") + "/"
    for m in maps:
        if not m.start <= addr < m.end:
            continue
        if not m.path.startswith(root) or m.path.endswith(" (deleted)"):
            what = m.path or "anonymous memory"
            raise NotSharedMemory(f"buffer {addr:#x} (+{length}) lives in {what}, not in a "
                                  f"file under {shm_dir}: allocate the KV pool in shared "
                                  f"memory (e.g. kvd.client.ShmPool)")
        if addr + length > m.end:
            raise NotSharedMemory(f"buffer {addr:#x} (+{length}) runs past the end of its "
                                  f"mapping of {m.path}")
        return ShmHandle(m.path, m.offset + (addr - m.start), length)
    raise NotSharedMemory(f"buffer {addr:#x} is not mapped in this process")


def fd_handle_for(addr: int, length: int, maps: list[Mapping], fds: dict[str, int]
                  ) -> FdHandle:
    """``[addr, addr + length)`` as a descriptor of the file behind its shared mapping
    (memfd, unlinked or unnamed file). ``fds`` caches one open descriptor per mapping range
    (the caller keeps them open while kvd uses the memory, then closes them). Raises
    :class:`NotSharedMemory` for anonymous or private memory, or a range past its mapping.
    """
    for m in maps:
        if not m.start <= addr < m.end:
            continue
        if not m.path or not m.shared or m.path.startswith("["):
            raise NotSharedMemory(f"buffer {addr:#x} (+{length}) is anonymous or private "
                                  f"memory ({m.path or 'no file'}): allocate the KV pool in "
                                  f"shared memory (kvd.client.ShmPool or FdPool)")
        if addr + length > m.end:
            raise NotSharedMemory(f"buffer {addr:#x} (+{length}) runs past the end of its "
                                  f"mapping of {m.path}")
        key = f"{m.start:x}-{m.end:x}"
        if key not in fds:
            try:
                fds[key] = os.open(f"/proc/self/map_files/{key}", os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise NotSharedMemory(f"cannot open the file behind {m.path} ({exc.strerror})"
                                      ) from exc
        return FdHandle(fds[key], m.offset + (addr - m.start), length)
    raise NotSharedMemory(f"buffer {addr:#x} is not mapped in this process")


def handle_or_fd(addr: int, length: int, maps: list[Mapping], fds: dict[str, int],
                 shm_dir: str = "/dev/shm") -> ShmHandle | FdHandle:
    """A named handle when the buffer is a live file under ``shm_dir``, else a descriptor
    (:func:`fd_handle_for`). Raises :class:`NotSharedMemory` for memory kvd cannot share."""
    try:
        return handle_for(addr, length, maps, shm_dir)
    except NotSharedMemory:
        return fd_handle_for(addr, length, maps, fds)


def read_maps(pid: int | str = "self") -> list[Mapping]:
    """The current mappings of process ``pid`` (Linux)."""
    return parse_maps(Path(f"/proc/{pid}/maps").read_text())
