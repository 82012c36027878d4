"""Listening TCP sockets of a process, from ``/proc`` (what ``ss -ltnp`` shows).

:func:`listeners` matches the socket inodes among ``/proc/<pid>/fd`` with the LISTEN
rows of ``/proc/net/tcp`` and ``/proc/net/tcp6`` (of that process's network
namespace: ``/proc/<pid>/net/...``). Addresses are returned as text; an IPv4-mapped
IPv6 address (``::ffff:127.0.0.1``) is given as its IPv4 form. :func:`wider_than`
says which listeners accept more than the configured hosts; :func:`connections` lists a
process's other TCP sockets (connected, closing: what a forgotten peer must not leave,
K39).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    """One listening socket: ``host`` (text), ``port``, ``family`` (4 or 6)."""

    host: str
    port: int
    family: int

    @property
    def wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::")

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _decode(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))
    words = struct.unpack("<4I", raw)  # each 32-bit word in host (little-endian) order
    addr = ipaddress.IPv6Address(struct.pack(">4I", *words))
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def _inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def listeners(pid: int) -> list[Listener]:
    """Listening TCP sockets of ``pid``, sorted by port (raises OSError if unreadable)."""
    inodes = _inodes(pid)
    out = []
    for name, family in (("tcp", 4), ("tcp6", 6)):
        try:
            rows = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == _LISTEN and f[9] in inodes:
                host_hex, port_hex = f[1].split(":")
                out.append(Listener(_decode(host_hex), int(port_hex, 16), family))
    return sorted(out, key=lambda x: (x.port, x.host))


@dataclass(frozen=True)
class Connection:
    """One non-listening TCP socket: local port, remote host and port, state (``/proc``
    hex code: ``01`` ESTABLISHED, ``08`` CLOSE_WAIT, ...)."""

    port: int
    remote: str
    remote_port: int
    state: str


def connections(pid: int) -> list[Connection]:
    """Every TCP socket of ``pid`` that is not listening (raises OSError if unreadable)."""
    inodes = _inodes(pid)
    out = []
    for name in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] != _LISTEN and f[9] in inodes:
                port_hex = f[1].split(":")[1]
                host_hex, rport_hex = f[2].split(":")
                out.append(Connection(int(port_hex, 16), _decode(host_hex),
                                      int(rport_hex, 16), f[3]))
    return out


def wider_than(found: list[Listener], allowed: set[str]) -> list[Listener]:
    """Listeners bound anywhere but the ``allowed`` hosts and loopback (wildcards always
    count; a loopback listener, such as the transfer engine's handshake listener behind
    kvd's front, is reachable from this host only)."""
    norm = {h.strip("[]") for h in allowed}
    return [x for x in found if x.wildcard or (x.host not in norm and not _loopback(x.host))]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
