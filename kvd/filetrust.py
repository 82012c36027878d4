"""Whether a path could have been made or swapped by someone kvd does not trust, and
reading secret files as OpenSSH reads keys (cases S17, S22). Stdlib only.

:func:`walk` resolves a path one entry at a time (symlinks followed) and records every
folder looked in; :func:`path_problem` says why a user outside ``trusted`` could have put
something else there: a folder on the way owned by someone else, or writable by group or
others -- unless it is sticky (``/tmp``) and the entry found there is owned by a trusted
uid (a sticky folder lets only an entry's owner rename or delete it).

:func:`read_secret_file` (and :func:`check_secret_file`) refuse a secret file unless,
checked on the descriptor that is read: it is a regular file owned by kvd's effective
user or root, open to nobody else (or only warned about), and :func:`path_problem` finds
nothing on the way to it. A file root reads for another user is theirs to swap or read
(S22); a folder others may write lets them point the path at any file kvd can read, e.g.
a root-owned key whose first line is well known.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvd.errors import ConfigError

_MAX_LINKS = 40  # as the kernel's path walk (ELOOP)
#: The most bytes a secret file may hold.
MAX_SECRET_FILE_BYTES = 64 << 10


@dataclass(frozen=True)
class Lookup:
    """One step of a path walk: the folder looked in, its stat, and the entry's lstat."""

    folder: str
    folder_stat: os.stat_result
    entry: os.stat_result


def walk(path: str) -> tuple[list[Lookup], str]:
    """Resolve ``path`` (absolute, or relative to the working folder) one entry at a
    time: every lookup, and the resolved path. Raises OSError (ELOOP past 40 links)."""
    todo = [p for p in os.path.abspath(path).split("/") if p][::-1]  # next component last
    cur, looked = "/", list[Lookup]()
    links = 0
    while todo:
        name = todo.pop()
        if name in (".", ""):
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        entry = os.path.join(cur, name)
        st_entry = os.lstat(entry)
        looked.append(Lookup(cur, os.stat(cur), st_entry))
        if stat.S_ISLNK(st_entry.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(40, "too many levels of symbolic links", path)
            target = os.readlink(entry)
            if target.startswith("/"):
                cur = "/"
            todo.extend([p for p in target.split("/") if p][::-1])
        else:
            cur = entry
    return looked, cur


def path_problem(path: str, trusted: Collection[int],
                 sticky_owners: Collection[int] | None = None) -> str | None:
    """Why a user outside ``trusted`` could have made or swapped what ``path`` names
    (see the module docstring), or None. In a sticky folder the entry must be owned by
    one of ``sticky_owners`` (default: ``trusted``). Raises OSError from :func:`walk`."""
    owners = trusted if sticky_owners is None else sticky_owners
    looked, _ = walk(path)
    for step in looked:
        st = step.folder_stat
        if st.st_uid not in trusted:
            return f"{step.folder} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX
                                       and step.entry.st_uid in owners):
            return f"{step.folder} is writable by others (mode {st.st_mode & 0o7777:04o})"
    return None


def read_secret_file(path: Path, what: str = "secret file",
                     check: Literal["refuse", "warn"] = "refuse", hint: str = "") -> bytes:
    """The bytes of the secret file ``path`` (at most :data:`MAX_SECRET_FILE_BYTES`),
    checked as the module docstring says. ``what`` names the file in messages (e.g.
    ``"cluster_secret_file"``); ``check = "warn"`` only logs a file open to group or
    others (for mounts that cannot set modes); ``hint`` is added to that refusal.
    Raises :class:`~kvd.errors.ConfigError`; no message carries the file's content."""
    euid = os.geteuid()
    try:
        problem = path_problem(str(path), (0, euid))
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: "
                          f"{exc.strerror or type(exc).__name__}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file")
        if st.st_uid not in (0, euid):
            raise ConfigError(f"{what} {path} belongs to uid {st.st_uid}, not to kvd's user "
                              f"(uid {euid}) or root: chown {euid} it (as OpenSSH, kvd "
                              f"takes secrets only from files its own user or root owns)")
        if problem is not None:
            raise ConfigError(f"{what} {path}: {problem}, so another user could swap the "
                              f"file: keep secrets in a folder only root or uid {euid} "
                              f"can write")
        _check_mode(path, what, st.st_mode, check, hint)
        return _read(fd)
    finally:
        os.close(fd)


def _check_mode(path: Path, what: str, mode: int, check: str, hint: str) -> None:
    if not mode & 0o077:
        return
    problem = f"{what} {path} is open to group or others (mode {mode & 0o777:04o}): chmod 600 it"
    if check == "refuse":
        raise ConfigError(f"{problem}{hint}")
    logging.getLogger("kvd").warning("%s (%s check = warn)", problem, what)


def _read(fd: int) -> bytes:
    chunks, size = [], 0
    while size < MAX_SECRET_FILE_BYTES:
        chunk = os.read(fd, MAX_SECRET_FILE_BYTES - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def check_secret_file(path: Path, what: str = "secret file",
                      check: Literal["refuse", "warn"] = "refuse") -> None:
    """Raise :class:`~kvd.errors.ConfigError` unless :func:`read_secret_file` would
    accept ``path`` (for ``kvd doctor`` and settings checks; readers should call
    :func:`read_secret_file` itself, which checks the descriptor it reads)."""
    read_secret_file(path, what, check)
