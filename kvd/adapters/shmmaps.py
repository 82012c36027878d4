"""Turn raw buffer pointers of this process into kvd shared-memory handles.

Engines that describe their KV pool by raw pointers (SGLang's ``KVArgs.kv_data_ptrs``)
can use kvd only if that memory is a mapping of a file under ``/dev/shm``: kvd maps the
same file (:class:`~kvd.protocol.rpc.ShmHandle`). ``/proc/self/maps`` says, for every
address, which file (and which offset of it) backs it, so a pointer becomes
``(path, file_offset + (ptr - mapping_start), length)`` without the engine having to
remember how it allocated the pool. :func:`parse_maps` and :func:`handle_for` are pure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvd.protocol.rpc import ShmHandle


class NotSharedMemory(ValueError):
    """The buffer is not (entirely) inside one mapping of a file under the shm folder."""


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/<pid>/maps``: ``[start, end)`` maps ``path`` from ``offset``."""

    start: int
    end: int
    offset: int
    path: str


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
        out.append(Mapping(int(start, 16), int(end, 16), int(parts[2], 16), path))
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


def read_maps(pid: int | str = "self") -> list[Mapping]:
    """The current mappings of process ``pid`` (Linux)."""
    return parse_maps(Path(f"/proc/{pid}/maps").read_text())
