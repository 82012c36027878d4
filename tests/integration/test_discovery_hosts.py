"""Three "hosts" as network namespaces the test creates (a bridge in the etcd host's
namespace, a veth pair to each of the others, private addresses inside the namespaces
only): prefill on one, decode on another, etcd on the third. A SIGKILLed prefill is
known to the decode within the lease TTL, its rooms fail, and a restarted one serves
rooms again, nothing restarted by hand."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import KVPoll, Receiver, poll_many, wait_many
from kvd.launch import DaemonProcess, start_daemon
from kvd.refengine.standin import EngineStandIn, wait_rooms
from tests.conftest import eventually_transfers
from tests.helpers.etcd import EtcdServer, etcd_binary

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TAG = os.getpid() % 100000
NS_P, NS_D, NS_E = f"kvep{TAG}", f"kved{TAG}", f"kvee{TAG}"
IP_P, IP_D, IP_E = "10.213.9.1", "10.213.9.2", "10.213.9.3"  # inside the namespaces only
TTL = 2.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def three_hosts() -> Iterator[None]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (scripts/system-deps.sh installs etcd-server)")
    made = []
    try:
        for ns in (NS_E, NS_P, NS_D):
            try:
                _ip("netns", "add", ns)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"cannot create network namespaces here: {exc.stderr!r}")
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", NS_E, "link", "add", "br0", "type", "bridge")
        _ip("-n", NS_E, "link", "set", "br0", "up")
        _ip("-n", NS_E, "addr", "add", f"{IP_E}/24", "dev", "br0")
        for ns, addr, end in ((NS_P, IP_P, "p"), (NS_D, IP_D, "d")):
            _ip("link", "add", f"kv{end}0", "netns", ns, "type", "veth", "peer", "name",
                f"kv{end}1", "netns", NS_E)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"kv{end}0")
            _ip("-n", ns, "link", "set", f"kv{end}0", "up")
            _ip("-n", NS_E, "link", "set", f"kv{end}1", "master", "br0")
            _ip("-n", NS_E, "link", "set", f"kv{end}1", "up")
        yield
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _start(role: str, tmp: Path, ns: str, ip: str, **kw: object) -> DaemonProcess:
    return start_daemon(role, tmp, prefix=["ip", "netns", "exec", ns], host=ip, http_host=ip,
                        **kw)


def test_three_hosts_death_and_restart_are_learned_through_etcd(three_hosts: None,
                                                                tmp_path: Path) -> None:
    binary = etcd_binary()
    assert binary is not None
    etcd = EtcdServer(tmp_path, binary, host=IP_E, netns=NS_E)
    etcd.start()
    opts = {"discovery": "etcd", "etcd_endpoints": etcd.url, "etcd_prefix": "/kvd/hosts",
            "etcd_lease_ttl": TTL}
    name = f"{IP_P}:8998"  # the address the prefill engine would advertise
    prefill = _start("prefill", tmp_path, NS_P, IP_P, bootstrap_addr=name, **opts)
    decode = _start("decode", tmp_path, NS_D, IP_D, **opts)
    p, d = EngineStandIn(prefill.socket, seed=1), EngineStandIn(decode.socket, seed=2)
    try:
        room = eventually_transfers(p, d, name, 1, [1, 2], [3, 4])  # once registered
        assert d.pages_equal(p, [1, 2], [3, 4])
        rooms = list(range(100, 120))
        for r in rooms:
            Receiver(d.client, r, name).init([r], r)
        deadline = time.monotonic() + 30
        while wait_many(d.client, rooms, 0.1) != [KVPoll.WaitingForInput] * len(rooms):
            assert time.monotonic() < deadline, "rooms not bound"
        prefill.kill(signal.SIGKILL)  # the prefill host's kvd dies
        deadline = time.monotonic() + 30  # generous: the bound is one lease TTL
        while KVPoll.WaitingForInput in poll_many(d.client, rooms):
            assert time.monotonic() < deadline, "the decode did not learn of the death"
            time.sleep(0.05)
        assert poll_many(d.client, rooms) == [KVPoll.Failed] * len(rooms)
        kind, reason = Receiver.attach(d.client, rooms[0]).failure()
        assert kind == "peer" and "left discovery" in reason
        p.close()
        prefill = _start("prefill", tmp_path, NS_P, IP_P, bootstrap_addr=name, **opts)
        p = EngineStandIn(prefill.socket, seed=1)
        room = eventually_transfers(p, d, name, room + 200, [5, 6], [7, 8])
        assert d.pages_equal(p, [5, 6], [7, 8])
        assert wait_rooms(d.client, [room]) == [KVPoll.Success]
    finally:
        p.close()
        d.close()
        prefill.stop()
        decode.stop()
        etcd.stop()
