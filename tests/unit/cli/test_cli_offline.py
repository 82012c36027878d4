"""CLI paths that need no daemon: unreachable daemons, addresses, version, doctor's checks."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.cli import doctor
from kvd.cli.client import DEFAULT_ADDR, resolve_addr
from kvd.cli.main import main
from kvd.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", [["status"], ["rooms", "--json"], ["peers"]])
def test_daemon_not_running_is_one_line_and_exit_1(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    addr = f"127.0.0.1:{free_port()}"
    assert main([*command, "--addr", addr]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"kvd: no kvd daemon answering at {addr} (connection refused)")


def test_bad_address_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--addr", "no-port-here"]) == 2
    assert "bad address" in capsys.readouterr().err


def test_address_comes_from_flag_then_config_then_default(tmp_path: Path) -> None:
    assert resolve_addr("10.0.0.1:9000", None) == "10.0.0.1:9000"
    assert resolve_addr(None, None) == DEFAULT_ADDR
    cfg = tmp_path / "kvd.toml"
    cfg.write_text('role = "decode"\nhttp_host = "0.0.0.0"\nhttp_port = 8123\n')
    assert resolve_addr(None, cfg) == "127.0.0.1:8123"
    cfg.write_text('role = "decode"\nhttp_host = "::"\nhttp_port = 8123\n')
    assert resolve_addr(None, cfg) == "[::1]:8123"
    cfg.write_text('role = "decode"\n')
    with pytest.raises(ConfigError, match="http_port = 0"):
        resolve_addr(None, cfg)


def test_status_with_config_of_port_0_exits_2(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "kvd.toml"
    cfg.write_text('role = "decode"\n')
    assert main(["status", "-c", str(cfg)]) == 2
    assert "pass --addr" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvd import __version__

    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == __version__
    assert main(["version", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == __version__


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "No such command" in capsys.readouterr().err


# ---- doctor checks (the transfer-engine probe runs in the integration tests) -----------------

def test_port_in_use_fails_with_a_fix() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        c = doctor.check_port("http port", "127.0.0.1", port)
    assert c.status == "fail" and "in use" in c.detail and "kvd status" in c.fix
    assert doctor.check_port("http port", "127.0.0.1", free_port()).status == "ok"
    assert doctor.check_port("zmq port", "127.0.0.1", 0).status == "ok"
    bad = doctor.check_port("http port", "192.0.2.1", free_port())  # TEST-NET: not ours
    assert bad.status == "fail" and "cannot bind" in bad.detail


def test_socket_checks(tmp_path: Path) -> None:
    ok = doctor.check_socket(tmp_path / "run" / "kvd.sock")
    assert ok.status == "ok" and "will be created" in ok.detail
    plain = tmp_path / "file.sock"
    plain.write_text("")
    assert doctor.check_socket(plain).status == "fail"
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # bound, never listening: connect is refused -> stale file
    assert doctor.check_socket(stale).status == "ok"
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(live))
        s.listen()
        c = doctor.check_socket(live)
    assert c.status == "fail" and "already served by pid" in c.detail  # serve refuses it


def test_doctor_beside_its_running_kvd_reads_its_socket_and_ports_as_its_own(
        tmp_path: Path) -> None:
    """A new user runs ``kvd doctor -c same.toml`` while that kvd runs: its socket (served
    and locked by one pid) and its listening ports are that daemon's, not 'in use' FAILs;
    a socket served without the lock, or a port of some other process, still fails."""
    import fcntl
    import os

    sock_path = tmp_path / "kvd.sock"
    lock = tmp_path / "kvd.sock.lock"
    with socket.socket(socket.AF_UNIX) as srv, socket.socket() as tcp, socket.socket() as other:
        srv.bind(str(sock_path))
        srv.listen()
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        other.bind(("127.0.0.1", 0))
        port = tcp.getsockname()[1]
        assert doctor.running_kvd(sock_path, doctor.daemon_pid(sock_path)) is None  # no lock
        with open(lock, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            f.write(f"{os.getpid()}\n")
            f.flush()
            own = doctor.running_kvd(sock_path, doctor.daemon_pid(sock_path))
            assert own is not None and own.pid == os.getpid() and port in own.ports
            c = doctor.check_socket(sock_path, own)
            assert c.status == "ok" and "served by this kvd" in c.detail
            c = doctor.check_port("http port", "127.0.0.1", port, own)
            assert c.status == "ok" and "held by this kvd" in c.detail
            other.listen()  # listening now, after `own` was read: not the daemon's port
            busy = doctor.check_port("zmq port", "127.0.0.1", other.getsockname()[1], own)
            assert busy.status == "fail"
            lock.write_text("1\n")  # the lock names another pid: not this daemon
            assert doctor.running_kvd(sock_path, doctor.daemon_pid(sock_path)) is None


def test_shm_and_memlock_and_rdma_checks(tmp_path: Path) -> None:
    assert doctor.check_shm(tmp_path / "nope").status == "fail"
    assert doctor.check_shm(Path("/dev/shm")).status in ("ok", "warn")
    assert doctor.check_memlock(rdma=False).status == "ok"
    assert doctor.check_rdma({}).status == "warn"
    assert doctor.check_rdma({"mlx5_0": "4: ACTIVE"}).status == "ok"
    assert doctor.check_rdma({"mlx5_0": "1: DOWN"}).status == "warn"


def test_doctor_reports_bad_config_and_still_checks(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "check_transfer_engine",
                        lambda host: doctor.Check("transfer engine", "ok", "skipped"))
    assert main(["doctor", "--json", "--set", "transfer_threads=0"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["config"]["status"] == "fail"
    assert "transfer_threads" in checks["config"]["detail"]
    assert {"transfer engine", "rdma devices", "memlock limit", "shared memory", "http port",
            "zmq port", "engine socket"} <= set(checks)


# ---- every option a user types is validated: one line, exit 2 ---------------------------------

@pytest.mark.parametrize(("argv", "says"), [
    (["status", "--timeout", "-1"], "-1 is not a positive number of seconds"),
    (["status", "--timeout", "0"], "0 is not a positive number of seconds"),
    (["peers", "--timeout", "nan"], "'--timeout'"),
    (["rooms", "--limit", "0"], "'--limit'"),
    (["rooms", "--limit", "100001"], "'--limit'"),
    (["serve", "--http-port", "70000"], "'--http-port'"),
    (["status", "-c", "/nonexistent/kvd.toml"], "does not exist"),
    (["doctor", "-c", "/"], "is a directory"),
    (["demo", "--prompts", "0"], "'--prompts'"),
    (["demo", "--chunk-pages", "-3"], "'--chunk-pages'"),
])
def test_bad_options_are_one_line_and_exit_2(argv: list[str], says: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert err.startswith(f"kvd {argv[0]}: ") and "Traceback" not in err


def test_every_numeric_and_file_option_is_validated() -> None:
    """The kind, not the instances: a new numeric option without a range (or a checking
    callback), or a settings-file option that does not check its file, fails here."""
    import typing

    import typer.models

    from kvd.cli.main import app

    def callbacks(t: typer.Typer) -> Iterator[tuple[str, typing.Any]]:
        for c in t.registered_commands:
            yield c.name or c.callback.__name__, c.callback  # type: ignore[union-attr]
        for g in t.registered_groups:
            assert g.typer_instance is not None
            yield from callbacks(g.typer_instance)

    seen = 0
    for name, fn in callbacks(app):
        for param, hint in typing.get_type_hints(fn, include_extras=True).items():
            if typing.get_origin(hint) is not typing.Annotated:
                continue
            base, *meta = typing.get_args(hint)
            info = next(m for m in meta if isinstance(m, typer.models.ParameterInfo))
            types = set(typing.get_args(base)) or {base}
            where = f"kvd {name} {param}"
            if types & {int, float}:
                seen += 1
                assert info.min is not None or info.callback is not None, f"{where}: no range"
            if Path in types and param == "config":
                seen += 1
                assert info.exists and info.readable and not info.dir_okay, where
    assert seen >= 10, seen


def test_a_daemon_error_answer_is_shown_not_called_not_a_kvd(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from kvd.cli import client

    def fake_request(*args: object, **kw: object) -> httpx.Response:  # the signed GET
        return httpx.Response(400, json={"error": "bad request",
                                         "detail": ["query.limit: must be >= 1"]})

    monkeypatch.setattr(client.signed_http, "request_sync", fake_request)
    with pytest.raises(client.DaemonUnreachable, match=r"answered 400 .*query.limit: must be"):
        client.get("127.0.0.1:1", "/v1/rooms")
    monkeypatch.setattr(client.signed_http, "request_sync",
                        lambda *a, **kw: httpx.Response(404, text="nope"))
    with pytest.raises(client.DaemonUnreachable, match="not a kvd daemon"):
        client.get("127.0.0.1:1", "/v1/rooms")


def test_cli_ignores_proxy_settings(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A dead proxy in the environment does not stand between the CLI and a local daemon."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'[{"endpoint": "tcp://x:1", "kind": "prefill", "state": "ok"}]'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dead = f"http://127.0.0.1:{free_port()}"
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, dead)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    try:
        assert main(["rooms", "--json", "-a", f"127.0.0.1:{server.server_port}"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["endpoint"] == "tcp://x:1"
    finally:
        server.shutdown()
        server.server_close()


# ---- serve refuses, before anything starts, what doctor reports -----------------------------

def _no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "check_transfer_engine",
                        lambda host: doctor.Check("transfer engine", "ok", "skipped"))


def _serve_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvd.daemon

    def run(settings: object) -> int:
        raise AssertionError("serve started a daemon despite a refusal")

    monkeypatch.setattr(kvd.daemon, "serve", run)


@pytest.mark.parametrize("case", ["no-secret", "empty-secret-file", "short-secret",
                                  "live-socket", "file-in-the-way", "parent-is-a-file",
                                  "no-such-group"])
def test_doctor_fails_whatever_serve_refuses(case: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVD_CLUSTER_SECRET", raising=False)
    secret = tmp_path / "cluster.secret"
    secret.write_text("0123456789abcdef0123\n")
    secret.chmod(0o600)  # a secret file others may read is a refusal of its own (S15)
    sock_path = tmp_path / "run" / "kvd.sock"
    sock_path.parent.mkdir()
    settings = {"cluster_secret_file": str(secret), "engine_socket": str(sock_path)}
    listener = None
    if case == "no-secret":
        del settings["cluster_secret_file"]
    elif case == "empty-secret-file":
        secret.write_text("")
    elif case == "short-secret":
        secret.write_text("short\n")
    elif case == "live-socket":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(sock_path))
        listener.listen()
    elif case == "file-in-the-way":
        sock_path.write_text("")
    elif case == "parent-is-a-file":
        sock_path.parent.rmdir()
        sock_path.parent.write_text("")
    elif case == "no-such-group":
        settings["engine_socket_group"] = "kvd-no-such-group"
    argv = [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")]
    _no_engine(monkeypatch)
    _serve_never_runs(monkeypatch)
    try:
        assert main(["serve", "--role", "decode", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvd: ") and "Traceback" not in err
        assert main(["doctor", "--json", "--role", "decode", *argv]) == 1
        failed = [c for c in json.loads(capsys.readouterr().out) if c["status"] == "fail"]
    finally:
        if listener is not None:
            listener.close()
    assert len(failed) == 1 and failed[0]["fix"], failed
    assert failed[0]["name"] in ("cluster secret", "engine socket", "engine socket group")


def test_doctor_passes_what_serve_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVD_CLUSTER_SECRET", "0123456789abcdef0123")
    _no_engine(monkeypatch)
    sock = tmp_path / "new" / "kvd.sock"
    assert main(["doctor", "--json", "--role", "decode", "--set", f"engine_socket={sock}"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["cluster secret"]["status"] == "ok"
    assert checks["engine socket"]["status"] == "ok"
    assert "will be created" in checks["engine socket"]["detail"]


def test_socket_path_too_long_is_a_setting_error(capsys: pytest.CaptureFixture[str]) -> None:
    long_path = "/tmp/" + "x" * 110 + ".sock"
    assert main(["serve", "--role", "decode", "--engine-socket", long_path]) == 2
    err = capsys.readouterr().err
    assert "too long for a Unix socket path (at most 107)" in err and "Traceback" not in err


# ---- kvd secret -------------------------------------------------------------------------------

def test_secret_command_writes_a_0600_secret_kvd_accepts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvd.config import Settings, read_secret

    path = tmp_path / "cluster.secret"
    assert main(["secret", str(path)]) == 0
    assert path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    assert len(first.strip()) == 64 and int(first, 16) >= 0
    settings = Settings(role="decode", cluster_secret_file=path)
    assert read_secret(settings) == first.strip().encode()
    assert main(["secret", str(path)]) == 2  # never overwritten by accident
    assert "--force" in capsys.readouterr().err and path.read_text() == first
    assert main(["secret", str(path), "--force"]) == 0
    assert path.read_text() != first and path.stat().st_mode & 0o777 == 0o600
    assert main(["secret", str(tmp_path / "missing" / "x")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_secret_command_names_the_file_by_its_absolute_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """README runs ``kvd secret cluster.secret``: the hint it printed,
    ``cluster_secret_file = "cluster.secret"``, only works for a daemon started in the same
    folder (not under systemd, whose working directory is /)."""
    monkeypatch.chdir(tmp_path)
    assert main(["secret", "cluster.secret"]) == 0
    err = capsys.readouterr().err
    assert f'cluster_secret_file = "{tmp_path / "cluster.secret"}"' in err
