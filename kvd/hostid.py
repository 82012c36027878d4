"""Which host am I on? A value two daemons compare to prove they share one machine.

``host_identity()`` is ``<machine-id>/<boot-id>``: ``/etc/machine-id`` (or D-Bus's copy)
names the installation, ``/proc/sys/kernel/random/boot_id`` (random per boot, shared
by every container on the kernel) the running kernel. Equal values mean one kernel,
so one physical memory: the ``local`` backend may copy directly. An IP address
proves nothing of the kind (NAT, shared addresses, loopback everywhere).
Containers whose machine-id differs read as different hosts: safe (the transfer
engine is used), never wrong.
"""

from __future__ import annotations

from pathlib import Path

MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def _first_line(paths: tuple[Path, ...]) -> str:
    for p in paths:
        try:
            text = p.read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return ""


def host_identity() -> str:
    """``machine-id/boot-id`` of this host ("" parts when a file is missing)."""
    return f"{_first_line(MACHINE_ID_FILES)}/{_first_line((BOOT_ID_FILE,))}"


def same_host(a: str, b: str) -> bool:
    """True when two identities name one running kernel (boot ids present and equal)."""
    return bool(a) and a == b and not a.endswith("/")
