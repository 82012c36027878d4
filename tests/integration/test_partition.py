"""A real network partition between a prefill host and a decode host: two network
namespaces joined by a veth pair that the test creates and removes itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import KVPoll, Receiver, poll_many
from kvd.launch import start_daemon
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NS_P, NS_D = f"kvdp{os.getpid()}", f"kvdd{os.getpid()}"
IP_P, IP_D = "10.213.7.1", "10.213.7.2"  # inside the test's own namespaces only


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[None]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    try:
        _ip("netns", "add", NS_P)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr!r}")
    try:
        _ip("netns", "add", NS_D)
        _ip("link", "add", "vkp", "netns", NS_P, "type", "veth", "peer", "name", "vkd",
            "netns", NS_D)
        for ns, dev, addr in ((NS_P, "vkp", IP_P), (NS_D, "vkd", IP_D)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (NS_P, NS_D):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_partition_is_detected_fails_rooms_and_recovers(two_hosts: None, tmp_path: Path) -> None:
    hb = {"heartbeat_interval": 0.5, "heartbeat_max_failures": 2, "http_timeout": 0.5,
          "control_send_timeout": 1.0, "bootstrap_retry_budget": 2.0}
    prefill = start_daemon("prefill", tmp_path, prefix=["ip", "netns", "exec", NS_P],
                           host=IP_P, http_host=IP_P, serve_bootstrap=True)
    decode = start_daemon("decode", tmp_path, prefix=["ip", "netns", "exec", NS_D],
                          host=IP_D, http_host=IP_D, **hb)
    p, d = EngineStandIn(prefill.socket, seed=1), EngineStandIn(decode.socket, seed=2)
    bootstrap = f"{IP_P}:{prefill.ready['http_port']}"
    try:
        transfer_room(p, d, bootstrap, 1, [1, 2], [3, 4], chunk=1)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        assert d.pages_equal(p, [1, 2], [3, 4])
        rooms = list(range(10, 30))
        for room in rooms:
            Receiver(d.client, room, bootstrap).init([room], room)
        _ip("-n", NS_P, "link", "set", "vkp", "down")  # the partition
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and KVPoll.Failed not in poll_many(d.client, rooms):
            time.sleep(0.05)
        detect = time.monotonic() - t0
        states = poll_many(d.client, rooms)
        assert states == [KVPoll.Failed] * len(rooms)
        assert detect < 0.5 * 2 + 2.5
        reason = Receiver.attach(d.client, rooms[0])
        assert bootstrap in reason.failure_reason()
        _ip("-n", NS_P, "link", "set", "vkp", "up")  # the link is back
        deadline, room, ok = time.monotonic() + 20, 100, False
        while time.monotonic() < deadline and not ok:
            transfer_room(p, d, bootstrap, room, [5], [6], chunk=1)
            ok = wait_rooms(d.client, [room], timeout=8) == [KVPoll.Success]
            room += 1
        assert ok, "no room succeeded after the link came back"
        assert d.pages_equal(p, [5], [6])
    finally:
        p.close()
        d.close()
        prefill.stop()
        decode.stop()
