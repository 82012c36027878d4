"""kvd.engine_rpc.socket_path: one daemon per engine socket; refusals are one line with a fix;
a daemon unlinks only its own socket file; systemd's LISTEN_FDS socket is taken as is."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from kvd import notify
from kvd.engine_rpc.socket_path import (
    SocketClaim,
    SocketPathError,
    default_engine_socket,
    default_socket_dir,
    folder_trust_problem,
    preflight,
    probe,
)
from kvd.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def test_absent_path_passes_and_preflight_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "run" / "kvd.sock"
    preflight(path)
    assert not (tmp_path / "run").exists()


def test_claim_binds_0600_and_releases(tmp_path: Path) -> None:
    path = tmp_path / "run" / "kvd.sock"
    claim = SocketClaim(path)
    sock = claim.bind()
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        assert probe(path) == ("live", os.getpid())
    finally:
        sock.close()
        claim.release()
    assert not path.exists()
    claim.release()  # idempotent


def test_second_claim_on_a_served_path_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "kvd.sock"
    first = SocketClaim(path)
    sock = first.bind()
    try:
        with pytest.raises(SocketPathError, match=f"locked by pid {os.getpid()}"):
            SocketClaim(path).bind()
        with pytest.raises(SocketPathError, match="another kvd"):
            preflight(path)
        assert probe(path)[0] == "live"  # the first daemon's socket is untouched
    finally:
        sock.close()
        first.release()


def test_a_live_socket_of_a_daemon_without_the_lock_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvd.sock"
    with socket.socket(socket.AF_UNIX) as other:  # e.g. a kvd from before the lock file
        other.bind(str(path))
        other.listen()
        with pytest.raises(SocketPathError, match=f"already served by pid {os.getpid()}"):
            SocketClaim(path).bind()
        assert probe(path)[0] == "live"


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "kvd.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never listening: what a SIGKILLed daemon leaves
    assert probe(path) == ("stale", None)
    claim = SocketClaim(path)
    sock = claim.bind()
    sock.close()
    claim.release()


def _parent_is_a_file(p: Path) -> None:
    p.parent.rmdir()
    p.parent.write_text("")


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p.write_text(""), "exists and is not a socket"),
    (lambda p: p.mkdir(), "exists and is not a socket"),
    (_parent_is_a_file, "is not a folder"),
])
def test_refusals_name_the_path_and_the_fix(tmp_path: Path, make, message: str) -> None:
    path = tmp_path / "run" / "kvd.sock"
    path.parent.mkdir()
    make(path)
    with pytest.raises(SocketPathError) as err:
        SocketClaim(path).bind()
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text
    assert isinstance(err.value, ConfigError)  # the CLI's exit 2
    assert err.value.fix


def test_release_leaves_a_file_that_is_not_ours(tmp_path: Path) -> None:
    path = tmp_path / "kvd.sock"
    claim = SocketClaim(path)
    sock = claim.bind()
    sock.close()
    path.unlink()  # someone removed ours and put another socket there
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(path))
        claim.release()
        assert path.exists()


_HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvd.engine_rpc.socket_path import SocketClaim
    SocketClaim(Path(sys.argv[1])).bind()
    print("bound", flush=True)
    time.sleep(60)
""")


def test_a_killed_daemon_does_not_block_the_next(tmp_path: Path) -> None:
    path = tmp_path / "kvd.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "bound"
        with pytest.raises(SocketPathError, match=f"locked by pid {child.pid}"):
            SocketClaim(path).bind()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    claim = SocketClaim(path)  # the kernel dropped the lock; the file left behind is stale
    claim.bind().close()
    claim.release()


# ---- as a user who may not write the folder (root may write anywhere) -------------------------

_AS_USER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kvd.engine_rpc.socket_path import SocketClaim, SocketPathError, preflight
    for p in sys.argv[1:]:
        try:
            preflight(Path(p))
            SocketClaim(Path(p)).bind()
            print("ok")
        except SocketPathError as exc:
            print(exc)
""")


def _unprivileged() -> tuple[list[str], dict[str, object]]:
    """How to run Python as a user that is not root: (command, Popen keywords)."""
    if os.geteuid() != 0:
        return [sys.executable], {}
    python = "/usr/bin/python3"
    if shutil.which("useradd") is None or not os.access(python, os.X_OK):
        pytest.skip("needs useradd and a system python3 to run as a second user")
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", "kvdsock"], capture_output=True,
                   check=False)
    try:
        return [python], {"user": pwd.getpwnam("kvdsock").pw_uid}
    except KeyError:
        pytest.skip("could not create a second local user")


def test_folders_this_user_cannot_write() -> None:
    cmd, kw = _unprivileged()
    work = Path(tempfile.mkdtemp(prefix="kvd-sock-", dir="/tmp"))
    try:
        work.chmod(0o755)
        (work / "ro").mkdir(mode=0o755)
        paths = [work / "ro" / "kvd.sock", work / "ro" / "sub" / "kvd.sock"]
        out = subprocess.run([*cmd, "-c", _AS_USER, *map(str, paths)], capture_output=True,
                             text=True, timeout=60, check=False, cwd="/",
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, **kw)
        lines = out.stdout.splitlines()
        assert len(lines) == 2, out.stdout + out.stderr
        assert "is not writable by uid" in lines[0] and "XDG_RUNTIME_DIR" in lines[0]
        assert "cannot create" in lines[1] and f"{work / 'ro'} is not writable" in lines[1]
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- systemd socket activation ------------------------------------------------------------------

def test_listen_fds_reads_and_unsets_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
    monkeypatch.setenv("LISTEN_FDS", "2")
    monkeypatch.setenv("LISTEN_FDNAMES", "engine:other")
    monkeypatch.setattr(os, "set_inheritable", lambda fd, flag: None)  # fds 3, 4 are pytest's
    assert notify.socket_activated()
    assert notify.listen_fds() == {"engine": 3, "other": 4}
    assert "LISTEN_FDS" not in os.environ and not notify.socket_activated()
    monkeypatch.setenv("LISTEN_PID", "1")  # meant for another process
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert notify.listen_fds() == {}


_ACTIVATED = textwrap.dedent("""
    import asyncio, os, socket, sys
    from pathlib import Path
    from kvd.engine_rpc.server import EngineRpcServer
    from kvd.errors import ConfigError

    path = Path(sys.argv[1])
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sys.argv[2] if len(sys.argv) > 2 else str(path))
    listener.listen()
    os.dup2(listener.fileno(), 3)  # where systemd puts the first socket
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="engine")

    async def dispatch(call, conn):
        return None

    async def main():
        server = EngineRpcServer(path, dispatch, 1 << 20)
        try:
            await server.start()
        except ConfigError as exc:
            print("refused:", exc)
            return
        print("serving", "LISTEN_FDS" in os.environ)
        await server.stop()
        print("after stop", path.exists())

    asyncio.run(main())
""")


def test_engine_server_takes_the_socket_systemd_passes(tmp_path: Path) -> None:
    path = tmp_path / "kvd.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _ACTIVATED, str(path)], capture_output=True,
                         text=True, timeout=60, check=False, env=env)
    assert out.stdout.splitlines() == ["serving False", "after stop True"], out.stderr
    other = tmp_path / "other.sock"
    out = subprocess.run([sys.executable, "-c", _ACTIVATED, str(path), str(other)],
                         capture_output=True, text=True, timeout=60, check=False, env=env)
    assert out.stdout.startswith("refused:") and "ListenStream=" in out.stdout, out.stderr


# ---- S17: the socket's folder is kvd's own -------------------------------------------------------

def test_s17_the_daemon_creates_its_socket_folder_0750(tmp_path: Path) -> None:
    path = tmp_path / "run" / "kvd" / "kvd.sock"
    claim = SocketClaim(path)
    sock = claim.bind()
    try:
        assert path.parent.stat().st_mode & 0o777 == 0o750
        assert folder_trust_problem(path.parent) is None
    finally:
        sock.close()
        claim.release()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o757])
def test_s17_the_daemon_refuses_a_folder_others_can_write(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    for attempt in (lambda: preflight(folder / "kvd.sock"),
                    lambda: SocketClaim(folder / "kvd.sock").bind()):
        with pytest.raises(SocketPathError, match="writable by group or others"):
            attempt()
    assert list(folder.iterdir()) == []  # no lock file, no socket left behind


def test_s17_the_daemon_refuses_a_folder_of_another_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o755)
    os.chown(folder, 65534, 65534)
    with pytest.raises(SocketPathError, match="belongs to uid 65534"):
        SocketClaim(folder / "kvd.sock").bind()


def test_s17_default_socket_folder_is_never_a_shared_one() -> None:
    assert default_socket_dir(0) == Path("/run/kvd")
    assert default_socket_dir(1000, {"XDG_RUNTIME_DIR": "/run/user/1000"}) == \
        Path("/run/user/1000/kvd")
    assert default_socket_dir(1000, {}) == Path("/tmp/kvd-1000")  # made 0750 and checked
    assert default_engine_socket().name == "kvd.sock"
