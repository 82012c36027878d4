"""CLI paths that need no daemon: unreachable daemons, addresses, version, doctor's checks."""

from __future__ import annotations

import json
import socket
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
    assert c.status == "warn" and "already serving" in c.detail


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
