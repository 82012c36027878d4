"""kvd.notify: sd_notify datagrams to $NOTIFY_SOCKET (path and abstract), watchdog period."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from kvd import notify


def test_nothing_happens_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False


def test_path_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify.notify("READY=1\nSTATUS=up")
        assert rx.recv(4096) == b"READY=1\nSTATUS=up"


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"kvd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.notify("STOPPING=1")
        assert rx.recv(4096) == b"STOPPING=1"


def test_unreachable_socket_is_logged_not_raised(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody"))
    assert notify.notify("READY=1") is False


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert notify.watchdog_interval() is None


async def test_watchdog_loop_pings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind(str(path))
        rx.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        monkeypatch.setenv("WATCHDOG_USEC", "20000")
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        task = asyncio.create_task(notify.watchdog_loop())
        await asyncio.sleep(0.1)
        task.cancel()
        pings = []
        rx.setblocking(False)
        while True:
            try:
                pings.append(rx.recv(64))
            except BlockingIOError:
                break
    assert len(pings) >= 3 and set(pings) == {b"WATCHDOG=1"}
    monkeypatch.delenv("WATCHDOG_USEC")
    await asyncio.wait_for(notify.watchdog_loop(), 1)  # off: returns at once
