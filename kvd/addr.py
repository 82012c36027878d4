"""Address parsing: ``host:port`` with IPv4, hostnames and bracketed IPv6 (zone ids kept)."""

from __future__ import annotations

from kvd.errors import ConfigError


def parse_hostport(addr: str) -> tuple[str, int]:
    """Split ``addr`` into (host, port); IPv6 hosts are returned without brackets.

    Accepts ``127.0.0.1:8998``, ``localhost:8998``, ``[::1]:8998``,
    ``[fe80::1%lo]:8998``. Raises :class:`ConfigError` for a missing or
    invalid port, or an unbracketed IPv6 literal (``::1`` is ambiguous).
    """
    addr = addr.strip()
    if addr.startswith("["):
        host, sep, rest = addr[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"bad address {addr!r}: expected [ipv6]:port")
        port_s = rest[1:]
    else:
        if addr.count(":") != 1:
            raise ConfigError(f"bad address {addr!r}: expected host:port "
                              f"(write IPv6 as [addr]:port)")
        host, _, port_s = addr.partition(":")
    if not host:
        raise ConfigError(f"bad address {addr!r}: empty host")
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"bad address {addr!r}: port {port_s!r} is not a number") from None
    if not 0 < port < 65536:
        raise ConfigError(f"bad address {addr!r}: port {port} out of range")
    return host, port


def join_hostport(host: str, port: int) -> str:
    """Inverse of :func:`parse_hostport` (brackets IPv6 literals)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_url(addr: str, path: str) -> str:
    """``http://`` URL for ``path`` on the server at ``addr`` (host:port)."""
    host, port = parse_hostport(addr)
    return f"http://{join_hostport(host, port)}{path}"


def format_host(host: str) -> str:
    """Host as it appears before ``:port`` (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
