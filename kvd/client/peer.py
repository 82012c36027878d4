"""Which local user may serve this engine's kvd socket, and proving it (case S17).

Before the engine sends its first byte (``RegisterKV`` hands over its KV memory, FD
pools included), :class:`~kvd.client.KvdClient` reads the server's credentials from the
connected socket (``SO_PEERCRED``: the uid of the process that called ``listen``, set by
the kernel, not by the server) and refuses any uid it does not trust
(:class:`~kvd.errors.UntrustedDaemon`). Trusted, as OpenSSH trusts key files:

* root (it can read the engine's memory anyway) and the engine's own euid (so can
  that user);
* the expected uid: the ``expected_uid`` argument, else ``KVD_EXPECTED_UID``, else the
  owner of the socket's folder -- but only when that folder could have been made by
  nobody else: every folder looked in while resolving it (symlinks followed) is owned
  by root or that owner and writable by neither group nor others, except a sticky
  folder (``/tmp``) whose entry is owned by root. A folder a squatter made in ``/tmp``
  vouches for nobody; ``/run/kvd`` (root's ``/run``) or ``$XDG_RUNTIME_DIR/kvd`` vouch for
  their owner.

The folder's own mode does not matter here: whoever replaced a socket in a writable
folder still has their own uid, which the check sees. The daemon refuses such folders
anyway (:mod:`kvd.engine_rpc.socket_path`). Stdlib only.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

from kvd.errors import UntrustedDaemon
from kvd.filetrust import path_problem

EXPECTED_UID_ENV = "KVD_EXPECTED_UID"
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Trust:
    """The uids allowed to serve the socket and, for an error, why each one."""

    uids: dict[int, str]
    note: str = ""  # why the folder's owner was not trusted, when it was not

    def describe(self) -> str:
        return ", ".join(f"{uid} ({why})" for uid, why in sorted(self.uids.items()))


def parse_expected_uid(value: int | str | None) -> int | None:
    """``expected_uid`` as given (an int, a decimal string, or None/"" for unset).
    Raises ValueError for anything else."""
    if value is None or value == "":
        return None
    try:
        uid = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected uid {value!r} is not a number (set {EXPECTED_UID_ENV} "
                         f"to kvd's numeric uid)") from None
    if uid < 0:
        raise ValueError(f"expected uid must be >= 0, got {uid}")
    return uid


def trust_for(path: str, expected_uid: int | None) -> Trust:
    """Who may serve ``path`` (see the module docstring); ``expected_uid`` None: derived."""
    uids = {0: "root"}
    uids.setdefault(os.geteuid(), "this engine's user")
    if expected_uid is not None:
        uids.setdefault(expected_uid, "the expected uid")
        return Trust(uids)
    owner, note = folder_owner(os.path.dirname(os.path.abspath(path)) or "/")
    if owner is not None:
        uids.setdefault(owner, "owner of the socket's folder")
    return Trust(uids, note)


def folder_owner(folder: str) -> tuple[int | None, str]:
    """(owner uid of ``folder``, "") when only that user or root could have made it and
    what leads to it, else (None, why not)."""
    try:
        owner = os.stat(folder).st_uid
        if owner in (0, os.geteuid()):
            return owner, ""  # trusted anyway: nothing to prove
        # in a sticky folder only a root-owned entry counts: anyone may make a new one
        problem = path_problem(folder, (0, owner), sticky_owners=(0,))
    except OSError as exc:
        return None, f"cannot inspect {folder}: {exc.strerror or exc}"
    if problem is not None:
        return None, f"{problem}, so another user could have made {folder}"
    return owner, ""


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process serving a connected Unix socket (``SO_PEERCRED``)."""
    pid, uid, _ = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _CREDS.size))
    return pid, uid


def check_peer(sock: socket.socket, path: str, trust: Trust) -> None:
    """Raise :class:`UntrustedDaemon` unless the server of ``sock`` runs as a trusted uid.
    Reads the kernel's record only: nothing is sent or received."""
    pid, uid = peer_uid(sock)
    if uid in trust.uids:
        return
    note = f"; the folder's owner is not trusted: {trust.note}" if trust.note else ""
    raise UntrustedDaemon(
        f"refusing the kvd at {path}: it runs as uid {uid} (pid {pid}), and this engine "
        f"trusts uid {trust.describe()}{note}. Nothing was sent. If that is your kvd, set "
        f"{EXPECTED_UID_ENV}={uid} (or expected_uid); otherwise another user holds the "
        f"socket path: serve kvd from a folder only its user can write (/run/kvd, "
        f"$XDG_RUNTIME_DIR/kvd)", found_uid=uid, trusted=sorted(trust.uids))
