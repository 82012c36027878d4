"""Pin the wildcard ``bind()`` calls of a loaded native library to one address.

Why (case S01): the Mooncake transfer engine binds its two listeners to every
interface and has no setting to change that (docs/transfer.md cites the lines):
``findAvailableTcpPort`` binds ``INADDR_ANY`` (the P2P handshake port, and a probe of
the TCP data port), and the TCP transport's ``TcpContext`` binds an IPv6 dual-stack
``::`` acceptor. Its ``MC_TCP_BIND_ADDRESS`` only changes the ADVERTISED address, and
only outside P2P-handshake mode.

How: for the duration of a call (the engine's ``initialize``), the ``bind`` entry of
the global offset table of every loaded shared object whose path matches is pointed
at a function that rewrites a wildcard address (``0.0.0.0``, or ``::`` which becomes
the IPv4-mapped ``::ffff:a.b.c.d`` so a dual-stack socket still accepts IPv4) into
``host`` and calls the real ``bind``; afterwards the table is restored. Specific
addresses and other libraries' binds are untouched. Linux/glibc, x86-64 and aarch64
ELF only; :func:`pinned_binds` reports how many slots it patched (0: nothing pinned,
the caller warns).

This is a workaround until the engine takes a bind address (upstream change: pass
the configured host to ``findAvailableTcpPort`` and ``TcpContext``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import mmap
import platform
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_BIND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32,
                         use_errno=True)
_real_bind = _BIND(ctypes.cast(_libc.bind, ctypes.c_void_p).value or 0)
_lock = threading.Lock()

# ELF: relocation types that fill a GOT slot with a symbol's address.
_GOT_RELOCS = {"x86_64": (6, 7), "aarch64": (1025, 1026)}  # GLOB_DAT, JUMP_SLOT
_PT_DYNAMIC = 2
_DT = {"strtab": 5, "symtab": 6, "rela": 7, "relasz": 8, "jmprel": 23, "pltrelsz": 2}


class _PhdrInfo(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint64), ("name", ctypes.c_char_p),
                ("phdr", ctypes.c_void_p), ("phnum", ctypes.c_uint16)]


_ITER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t,
                         ctypes.c_void_p)


def _loaded_objects() -> list[tuple[int, str, int, int]]:
    """(load base, path, program headers address, count) of every loaded object."""
    out: list[tuple[int, str, int, int]] = []

    def visit(info: ctypes._Pointer[_PhdrInfo], _size: int, _data: int) -> int:
        i = info.contents
        out.append((int(i.addr), (i.name or b"").decode(errors="replace"), int(i.phdr or 0),
                    int(i.phnum)))
        return 0

    _libc.dl_iterate_phdr(_ITER(visit), None)
    return out


def _u64(a: int) -> int:
    return int(ctypes.c_uint64.from_address(a).value)


def _u32(a: int) -> int:
    return int(ctypes.c_uint32.from_address(a).value)


def got_slots(base: int, phdr: int, phnum: int, symbol: bytes) -> list[int]:
    """Addresses of the GOT slots through which an object calls ``symbol``."""
    types = _GOT_RELOCS.get(platform.machine())
    if types is None or not phdr:
        return []
    dyn = next((base + _u64(phdr + 56 * k + 16) for k in range(phnum)
                if _u32(phdr + 56 * k) == _PT_DYNAMIC), None)
    if dyn is None:
        return []
    tags: dict[int, int] = {}
    while (tag := ctypes.c_int64.from_address(dyn).value) != 0:
        tags[tag] = _u64(dyn + 8)
        dyn += 16

    def ptr(v: int) -> int:  # glibc relocates most d_ptr entries in place; some loaders not
        return v if v >= base else base + v

    if _DT["symtab"] not in tags or _DT["strtab"] not in tags:
        return []
    symtab, strtab = ptr(tags[_DT["symtab"]]), ptr(tags[_DT["strtab"]])
    slots = []
    for table, size in (("jmprel", "pltrelsz"), ("rela", "relasz")):
        if _DT[table] not in tags:
            continue
        start = ptr(tags[_DT[table]])
        for j in range(tags.get(_DT[size], 0) // 24):
            info = _u64(start + 24 * j + 8)
            sym = info >> 32
            if info & 0xFFFFFFFF in types and sym and \
                    ctypes.string_at(strtab + _u32(symtab + 24 * sym)) == symbol:
                slots.append(base + _u64(start + 24 * j))
    return slots


#: Decides one wildcard bind: ``policy(port, bind_to)`` calls ``bind_to(ipv4_host)`` (the
#: real bind, rewritten to that host; 0 or ``-errno``) as it sees fit and returns 0 or
#: ``-errno`` (e.g. ``-EADDRINUSE`` to make the caller try another port).
BindPolicy = Callable[[int, Callable[[str], int]], int]


def _rewriter(policy: BindPolicy) -> Any:
    def bind(fd: int, addr: int, alen: int) -> int:
        family = ctypes.c_uint16.from_address(addr).value if addr else -1
        raw = ctypes.string_at(addr, alen) if addr else b""
        if family == socket.AF_INET and alen >= 16 and raw[4:8] == b"\0\0\0\0":
            def place(host: str) -> bytes:
                return raw[:4] + socket.inet_aton(host) + raw[8:]
        elif family == socket.AF_INET6 and alen >= 24 and raw[8:24] == b"\0" * 16:
            def place(host: str) -> bytes:  # IPv4-mapped: a dual-stack socket keeps IPv4
                return raw[:8] + b"\0" * 10 + b"\xff\xff" + socket.inet_aton(host) + raw[24:]
        else:
            return int(_real_bind(fd, addr, alen))

        def bind_to(host: str) -> int:
            buf = ctypes.create_string_buffer(place(host), alen)
            if int(_real_bind(fd, ctypes.addressof(buf), alen)) == 0:
                return 0
            return -(ctypes.get_errno() or errno.EADDRINUSE)

        try:
            rc = policy(int.from_bytes(raw[2:4], "big"), bind_to)
        except Exception:  # never unwind into native code
            log.exception("bind policy failed")
            rc = -errno.EADDRINUSE
        if rc == 0:
            return 0
        ctypes.set_errno(-rc)
        return -1

    return _BIND(bind)


@contextlib.contextmanager
def pinned_binds(host: str | BindPolicy, path_part: str) -> Iterator[int]:
    """Within the block, wildcard binds of loaded objects whose path contains
    ``path_part`` bind to IPv4 ``host`` instead (or as the policy ``host`` decides, see
    :data:`BindPolicy`); yields the number of GOT slots patched. Raises ValueError if
    ``host`` is not an IPv4 address."""
    policy: BindPolicy
    if isinstance(host, str):
        ipaddress.IPv4Address(host)
        fixed = host

        def policy(port: int, bind_to: Callable[[str], int]) -> int:
            return bind_to(fixed)
    else:
        policy = host
    hook = _rewriter(policy)
    target = ctypes.cast(hook, ctypes.c_void_p).value
    page = mmap.PAGESIZE
    saved: list[tuple[int, int]] = []
    with _lock:
        try:
            for base, name, phdr, phnum in _loaded_objects():
                if path_part not in name:
                    continue
                for slot in got_slots(base, phdr, phnum, b"bind"):
                    start = slot & ~(page - 1)
                    if _libc.mprotect(start, 2 * page if slot + 8 > start + page else page,
                                      mmap.PROT_READ | mmap.PROT_WRITE) != 0:
                        continue
                    saved.append((slot, _u64(slot)))
                    ctypes.c_uint64.from_address(slot).value = target or 0
            yield len(saved)
        finally:
            for slot, value in saved:  # left writable: RELRO protection is not restored
                ctypes.c_uint64.from_address(slot).value = value
            del hook
