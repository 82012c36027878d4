"""The engine socket's path: can this daemon own it, and holding it while it runs.

One daemon per engine socket. :func:`preflight` says why a path cannot be
used (no side effects: ``kvd doctor`` and ``kvd serve`` share it);
:class:`SocketClaim` takes the path for the daemon's lifetime:

1. create the folder if missing (mode 0750: only this user may create entries, the
   socket's group may reach it) and refuse a folder owned by another user or writable
   by group or others (:func:`folder_trust_problem`): there another user could replace
   the socket (case S17);
2. take an exclusive ``flock`` on ``<socket>.lock`` (held until stop; the kernel
   drops it if the process dies, so a SIGKILLed daemon never blocks the next);
3. refuse a socket file that still answers (a daemon from before locks, or one
   of another user) — a file that refuses connections is stale and replaced;
4. bind (mode 0600, or 0660 for a group); at stop, unlink the socket only if it is
   still the file this daemon bound (same inode and change time), so a daemon never
   deletes another one's socket.

The default path (:func:`default_engine_socket`) is ``/run/kvd/kvd.sock`` for root and
``$XDG_RUNTIME_DIR/kvd/kvd.sock`` for another user (systemd's per-user 0700 runtime
folder; ``/tmp/kvd-<uid>/kvd.sock`` where it is unset), never a file directly in a
shared folder such as ``/tmp``. The engine side proves its daemon too
(:mod:`kvd.client.peer`).

Every refusal is a :class:`SocketPathError`: one line naming the path, what is
wrong and what to do (the CLI prints it and exits 2).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
from pathlib import Path

from kvd.errors import ConfigError

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: Mode of a socket folder kvd creates: entries by its user only, reachable by its group.
SOCKET_DIR_MODE = 0o750
SOCKET_NAME = "kvd.sock"
NON_ROOT_HINT = ("as a non-root user choose a folder you own, e.g. "
                 "$XDG_RUNTIME_DIR/kvd/<rank>.sock, or under systemd RuntimeDirectory=")


class SocketPathError(ConfigError):
    """The engine socket path cannot be used; ``detail`` says why, ``fix`` what to do."""

    def __init__(self, path: Path, detail: str, fix: str) -> None:
        super().__init__(f"engine_socket {path}: {detail} ({fix})")
        self.path, self.detail, self.fix = path, detail, fix


def default_socket_dir(euid: int | None = None,
                       env: dict[str, str] | None = None) -> Path:
    """The folder of the default engine socket: ``/run/kvd`` for root (euid 0), else
    ``$XDG_RUNTIME_DIR/kvd`` (a per-user 0700 folder), else ``/tmp/kvd-<uid>`` (kvd
    creates it 0750 and refuses it if another user made it first)."""
    uid = os.geteuid() if euid is None else euid
    if uid == 0:
        return Path("/run/kvd")
    runtime = (os.environ if env is None else env).get("XDG_RUNTIME_DIR", "")
    if runtime.startswith("/"):
        return Path(runtime) / "kvd"
    return Path(f"/tmp/kvd-{uid}")


def default_engine_socket() -> Path:
    """The default engine socket path: :func:`default_socket_dir` / ``kvd.sock``."""
    return default_socket_dir() / SOCKET_NAME


def folder_trust_problem(folder: Path, uid: int | None = None) -> str | None:
    """Why ``folder`` (an existing folder, links followed) must not hold a socket of
    ``uid`` (default: this process's euid), or None: it must be owned by that user or
    root and writable by neither group nor others -- else someone else could unlink the
    socket and bind their own in its place (S17)."""
    uid = os.geteuid() if uid is None else uid
    st = folder.stat()
    if st.st_uid not in (uid, 0):
        return f"{folder} belongs to uid {st.st_uid}, not to uid {uid} (kvd's user) or root"
    if st.st_mode & 0o022:
        return (f"{folder} is writable by group or others (mode {st.st_mode & 0o7777:04o}): "
                f"another user could replace the socket")
    return None


def lock_path(path: Path) -> Path:
    """The lock file next to the socket: ``<socket>.lock``."""
    return path.with_name(path.name + ".lock")


def _uid() -> int:
    return os.geteuid()


def _folder_problem(path: Path) -> SocketPathError | None:
    parent = path.parent
    ancestor = next(p for p in (parent, *parent.parents) if p.exists() or p.is_symlink())
    if not ancestor.is_dir():
        return SocketPathError(path, f"{ancestor} is not a folder",
                               "choose an engine_socket under a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        what = f"cannot create {parent}: " if ancestor != parent else ""
        return SocketPathError(path, f"{what}{ancestor} is not writable by uid {_uid()}",
                               f"install -d -o $USER {parent} as root; {NON_ROOT_HINT}")
    return _trust_error(path) if ancestor == parent else None


def _trust_error(path: Path) -> SocketPathError | None:
    problem = folder_trust_problem(path.parent)
    if problem is None:
        return None
    return SocketPathError(path, problem, f"give the socket a folder of its own, e.g. "
                           f"install -d -m 0750 -o $USER {path.parent / 'kvd'}; "
                           f"{NON_ROOT_HINT}")


def probe(path: Path) -> tuple[str, int | None]:
    """What is at ``path``: ``absent``, ``not-socket``, ``stale`` (a socket file nobody
    serves), ``live`` (something accepts; its pid when known) or ``forbidden`` (this
    user may not connect)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return "absent", None
    if not stat.S_ISSOCK(mode):
        return "not-socket", None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except PermissionError:
            return "forbidden", None
        except OSError:
            return "stale", None
        pid, _, _ = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _CREDS.size))
        return "live", pid or None


def _holder(lock: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(lock.read_text().strip() or "0")
        if pid:
            return f"pid {pid}"
    return "another process"


def _lock_held(lock: Path) -> bool:
    """Is ``lock`` flock-ed by a live process? (Opens it read-only, creates nothing.)"""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we took it
    return False


def _existing_problem(path: Path) -> SocketPathError | None:
    kind, pid = probe(path)
    if kind == "not-socket":
        return SocketPathError(path, "exists and is not a socket",
                               "remove it or choose another engine_socket")
    if kind == "live":
        who = f"pid {pid}" if pid else "another process"
        return SocketPathError(path, f"already served by {who} (another kvd?)",
                               "stop it first (kvd status; systemctl status 'kvd@*'), or give "
                               "this kvd its own engine_socket")
    if kind == "forbidden":
        owner = path.lstat().st_uid
        return SocketPathError(path, f"exists, belongs to uid {owner} and refuses uid "
                               f"{_uid()}", "another user's kvd? stop it, remove the file, "
                               "or choose another engine_socket")
    return None


def preflight(path: Path) -> None:
    """Raise :class:`SocketPathError` if a daemon could not serve on ``path`` now.

    Checks the folder (exists or can be created, is writable), the lock (no other kvd
    holds it) and any file at the path (a stale socket is fine). No side effects.
    """
    problem = _folder_problem(path)
    if problem is None and _lock_held(lock_path(path)):
        problem = SocketPathError(path, f"locked by {_holder(lock_path(path))} (another "
                                  f"kvd serves this socket)", "stop it first, or give this "
                                  "kvd its own engine_socket")
    problem = problem or _existing_problem(path)
    if problem is not None:
        raise problem


def _translate(path: Path, exc: OSError, doing: str) -> SocketPathError:
    if isinstance(exc, PermissionError):
        return SocketPathError(path, f"cannot {doing}: permission denied for uid {_uid()}",
                               NON_ROOT_HINT)
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return SocketPathError(path, f"cannot {doing}: a parent is not a folder",
                               "choose an engine_socket under a folder")
    return SocketPathError(path, f"cannot {doing}: {exc.strerror or exc}",
                           "check the path and its folder")


class SocketClaim:
    """This daemon's hold on its engine socket path (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._identity: tuple[int, int, int] | None = None

    def bind(self, backlog: int = 128, gid: int | None = None) -> socket.socket:
        """Take the lock and bind a listening socket at the path: mode 0600, or 0660 and
        group ``gid`` when given.

        Raises :class:`SocketPathError` (nothing is left behind: the lock is released).
        """
        preflight(self.path)  # the common refusals, with their specific message
        sock = None
        try:
            self._take_lock()
            problem = _existing_problem(self.path)  # re-checked under the lock
            if problem is not None:
                raise problem
            sock = self._bind(backlog)
            self._set_mode(gid)
            st = self.path.stat()
            self._identity = (st.st_dev, st.st_ino, st.st_ctime_ns)
            return sock
        except BaseException:
            if sock is not None:
                sock.close()
                self.path.unlink(missing_ok=True)
            self.release()
            raise

    def _set_mode(self, gid: int | None) -> None:
        try:
            if gid is not None:
                os.chown(self.path, -1, gid)
                os.chmod(self.path, 0o660)
        except PermissionError as exc:
            raise SocketPathError(self.path, f"cannot give it to group {gid}: "
                                  f"{exc.strerror}", "the daemon's user must be a member of "
                                  "engine_socket_group") from exc

    def _take_lock(self) -> None:
        lock = lock_path(self.path)
        folder = self.path.parent
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                folder.mkdir(mode=SOCKET_DIR_MODE)
        except OSError as exc:
            raise _translate(self.path, exc, f"create {folder}") from exc
        problem = _trust_error(self.path)  # checked again: the folder may be new, or swapped
        if problem is not None:
            raise problem
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _translate(self.path, exc, f"create {lock}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise SocketPathError(self.path, f"locked by {_holder(lock)} (another kvd "
                                  f"serves this socket)", "stop it first, or give this kvd "
                                  "its own engine_socket") from exc
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _bind(self, backlog: int) -> socket.socket:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # stale: nobody answered, and we hold the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        except OSError as exc:
            sock.close()
            raise _translate(self.path, exc, "bind") from exc
        finally:
            os.umask(old)
        sock.listen(backlog)
        return sock

    def release(self) -> None:
        """Unlink the socket if it is still ours, then drop the lock (idempotent)."""
        if self._identity is not None:
            with contextlib.suppress(OSError):
                st = self.path.stat()
                if (st.st_dev, st.st_ino, st.st_ctime_ns) == self._identity:
                    self.path.unlink()
            self._identity = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
