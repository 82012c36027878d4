"""systemd's notification protocol (``sd_notify``), without libsystemd.

Every function does nothing when ``NOTIFY_SOCKET`` is unset, so the daemon
calls them unconditionally. ``@name`` addresses the abstract namespace.
The socket is non-blocking: a full receiver queue drops the message rather
than stalling the event loop. See ``sd_notify(3)`` and ``systemd.service(5)``
(``Type=notify``, ``WatchdogSec=``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(message: str) -> bool:
    """Send ``message`` (e.g. ``READY=1``) to ``$NOTIFY_SOCKET``; False if not sent."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.connect(addr)
            sock.send(message.encode())
        return True
    except OSError as exc:
        log.warning("sd_notify %r to %s failed: %s", message, addr, exc)
        return False


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of ``WATCHDOG_USEC``), or None when off.

    ``WATCHDOG_PID``, when set, must name this process (systemd sets it to the
    main PID; a child must not ping on the parent's behalf).
    """
    usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def watchdog_loop() -> None:
    """Ping ``WATCHDOG=1`` every half watchdog period while the loop runs; returns if off.

    A blocked or dead event loop stops the pings, and systemd restarts the unit.
    """
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


SD_LISTEN_FDS_START = 3


def socket_activated() -> bool:
    """Did systemd pass sockets to this process? (Reads, does not consume, LISTEN_*.)"""
    return os.environ.get("LISTEN_PID") == str(os.getpid()) and \
        os.environ.get("LISTEN_FDS", "0") not in ("", "0")


def listen_fds(unset_environment: bool = True) -> dict[str, int]:
    """Sockets systemd passed to this process (socket activation), by name.

    ``sd_listen_fds(3)``: ``LISTEN_PID`` must be this process, ``LISTEN_FDS`` counts the
    descriptors from fd 3 on, ``LISTEN_FDNAMES`` (``FileDescriptorName=`` in the .socket
    unit, else the unit's name) names them, ``:``-separated. Returns ``{}`` when nothing
    was passed. The variables are removed (``unset_environment``) so that children do
    not take the sockets for theirs; each fd is marked close-on-exec.
    """
    pid, count = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    if unset_environment:
        for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(var, None)
    if pid != str(os.getpid()) or not count.isdigit():
        return {}
    out = {}
    for i in range(int(count)):
        fd = SD_LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        out[names[i] if i < len(names) and names[i] else f"fd{fd}"] = fd
    return out
