"""deploy/systemd/kvd@.service and kvd@.socket pass ``systemd-analyze verify``, have the
settings they need, and the service's exposure score stays where the hardening puts it.

``systemd-analyze`` comes with Debian's ``systemd`` package: the test installs it once (as
root, bounded in time) when missing, and skips with the reason when it cannot.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
UNIT = REPO / "deploy" / "systemd" / "kvd@.service"
SOCKET = REPO / "deploy" / "systemd" / "kvd@.socket"
INSTALL_TIMEOUT = 240


def _install_systemd() -> str | None:
    """Path of systemd-analyze, installing the Debian package if needed; None if impossible."""
    found = shutil.which("systemd-analyze")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "systemd"]):
        try:
            subprocess.run(cmd, env=env, capture_output=True, timeout=INSTALL_TIMEOUT,
                           check=True)
        except (subprocess.SubprocessError, OSError):
            return None
    return shutil.which("systemd-analyze")


@pytest.fixture(scope="session")
def systemd_analyze() -> str:
    path = _install_systemd()
    if path is None:
        pytest.skip("systemd-analyze is missing and the Debian package 'systemd' could not be "
                    "installed (needs root and apt); install it to run this check")
    return path


def _unit_for_test(tmp_path: Path) -> Path:
    """The unit with ExecStart= naming this venv's kvd (verify wants an existing binary)."""
    kvd = Path(sys.executable).with_name("kvd")
    assert kvd.exists(), f"{kvd}: install the project into its venv first"
    text = UNIT.read_text()
    assert "/opt/kvd/venv/bin/kvd" in text
    out = tmp_path / "kvd@.service"
    out.write_text(text.replace("/opt/kvd/venv/bin/kvd", str(kvd)))
    (tmp_path / SOCKET.name).write_text(SOCKET.read_text())
    return out


def _ini(path: Path) -> configparser.ConfigParser:
    ini = configparser.ConfigParser(interpolation=None, strict=False)
    ini.optionxform = str  # type: ignore[assignment,method-assign]
    ini.read_string(path.read_text())
    return ini


def test_unit_verifies(systemd_analyze: str, tmp_path: Path) -> None:
    unit = _unit_for_test(tmp_path)
    proc = subprocess.run([systemd_analyze, "verify", str(unit.with_name("kvd@gpu0.service")),
                           str(unit.with_name("kvd@gpu0.socket"))],
                          capture_output=True, text=True, timeout=60, check=False)
    problems = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                if "kvd@" in ln or "Unknown" in ln or "ignoring" in ln]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def test_verify_catches_a_broken_unit(systemd_analyze: str, tmp_path: Path) -> None:
    unit = _unit_for_test(tmp_path)
    unit.write_text(unit.read_text().replace(str(Path(sys.executable).with_name("kvd")),
                                             "/nonexistent/kvd"))
    proc = subprocess.run([systemd_analyze, "verify", str(unit.with_name("kvd@x.service"))],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "/nonexistent/kvd" in proc.stderr


def test_exposure_score(systemd_analyze: str, tmp_path: Path) -> None:
    """``systemd-analyze security`` (offline): 2.4 with this unit, 3.9 before the syscall
    filter and ProtectProc; a change that loosens it shows here."""
    unit = _unit_for_test(tmp_path)
    proc = subprocess.run([systemd_analyze, "security", "--offline=true",
                           str(unit.with_name("kvd@gpu0.service"))],
                          capture_output=True, text=True, timeout=60, check=False)
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", proc.stdout)
    if match is None:
        pytest.skip(f"this systemd-analyze cannot score units offline: {proc.stderr.strip()}")
    assert float(match.group(1)) <= 2.5, proc.stdout


def test_unit_settings() -> None:
    ini = _ini(UNIT)
    svc = ini["Service"]
    assert svc["Type"] == "notify"
    assert svc["WatchdogSec"] and svc["Restart"] == "on-failure"
    assert svc["RuntimeDirectory"] == "kvd/%i"
    assert svc["LimitMEMLOCK"] == "infinity"
    assert "--config /etc/kvd/%i.toml" in svc["ExecStart"]
    assert "--engine-socket %t/kvd/%i/kvd.sock" in svc["ExecStart"]
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    for breaks_kvd in ("PrivateDevices", "PrivateIPC", "MemoryDenyWriteExecute"):
        assert breaks_kvd not in svc, breaks_kvd
    assert ini["Install"]["WantedBy"] == "multi-user.target"
    assert svc["RestartPreventExitStatus"] == "2"  # config errors exit 2: never loop
    assert svc["SystemCallFilter"] == "@system-service"
    assert svc["ProtectProc"] == "invisible"
    assert svc["RuntimeDirectoryPreserve"] == "yes"  # the .socket's file survives restarts


def test_config_errors_exit_2_so_systemd_does_not_restart(tmp_path: Path) -> None:
    """What RestartPreventExitStatus=2 relies on: kvd serve's refusals exit with 2."""
    from kvd.cli.main import main

    cfg = tmp_path / "gpu0.toml"
    cfg.write_text('role = "decode"\nhttp_port = 99999\n')
    assert main(["serve", "--config", str(cfg)]) == 2


def test_socket_unit_matches_the_service() -> None:
    svc, sock = _ini(UNIT)["Service"], _ini(SOCKET)["Socket"]
    path = sock["ListenStream"]
    assert f"--engine-socket {path}" in svc["ExecStart"]
    assert sock["FileDescriptorName"] == "engine"  # kvd takes the fd with this name
    assert sock["SocketMode"] == "0600" and sock["SocketUser"] == svc["User"]
    assert _ini(SOCKET)["Install"]["WantedBy"] == "sockets.target"
