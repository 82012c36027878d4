"""Fleet discovery on a real etcd with real daemons: prefill ranks register under
leases, decodes resolve from etcd and watch it (docs/discovery.md)."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender, poll_many, wait_many
from kvd.launch import DaemonProcess, start_daemon
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import eventually_transfers, free_port, signed
from tests.helpers.etcd import EtcdServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 2.0


def _opts(etcd: EtcdServer, prefix: str) -> dict[str, object]:
    return {"discovery": "etcd", "etcd_endpoints": etcd.url, "etcd_prefix": prefix,
            "etcd_lease_ttl": TTL}


def _registrations(etcd: EtcdServer, prefix: str) -> list[dict]:
    key = f"{prefix}/prefill/"
    end = key[:-1] + chr(ord(key[-1]) + 1)
    kvs = etcd.call("/v3/kv/range", {"key": base64.b64encode(key.encode()).decode(),
                                     "range_end": base64.b64encode(end.encode()).decode()})
    return [json.loads(base64.b64decode(kv["value"])) for kv in kvs.get("kvs", [])]


def _until(what: str, cond, within: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        time.sleep(0.05)


def _prefill(tmp: Path, name: str, etcd: EtcdServer, prefix: str,
             **kw: object) -> tuple[DaemonProcess, EngineStandIn]:
    daemon = start_daemon("prefill", tmp, bootstrap_addr=name, **(_opts(etcd, prefix) | kw))
    return daemon, EngineStandIn(daemon.socket, seed=1)


def test_etcd_registers_resolves_and_follows_death_and_restart(tmp_path: Path,
                                                               etcd: EtcdServer) -> None:
    prefix, name = "/kvd/it-a", f"prefill-a.example:{free_port()}"  # a name: nothing listens
    zmq = free_port()
    prefill, p = _prefill(tmp_path, name, etcd, prefix, zmq_port=zmq)
    decode = start_daemon("decode", tmp_path, **_opts(etcd, prefix))
    d = EngineStandIn(decode.socket, seed=2)
    try:
        _until("the prefill rank registers in etcd", lambda: _registrations(etcd, prefix))
        [reg] = _registrations(etcd, prefix)
        assert reg["instance_id"] == prefill.ready["instance_id"]
        assert reg["rank_port"] == zmq
        transfer_room(p, d, name, 1, [1, 2, 3], [4, 5, 6], chunk=2)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        assert d.pages_equal(p, [1, 2, 3], [4, 5, 6])

        rooms = list(range(10, 30))
        for room in rooms:  # bound to the prefill instance, never sent: in flight
            Receiver(d.client, room, name).init([room], room)
        _until("rooms bound", lambda: wait_many(d.client, rooms, 0.1) ==
               [KVPoll.WaitingForInput] * len(rooms))
        prefill.kill(signal.SIGKILL)
        t0 = time.monotonic()
        _until("rooms fail after the lease expires",
               lambda: KVPoll.WaitingForInput not in poll_many(d.client, rooms))
        learned = time.monotonic() - t0
        assert poll_many(d.client, rooms) == [KVPoll.Failed] * len(rooms)
        kind, reason = Receiver.attach(d.client, rooms[0]).failure()
        assert kind == "peer" and "left discovery" in reason and name in reason
        assert not _registrations(etcd, prefix)  # the lease expired: the key is gone
        print(f"death learned {learned:.2f}s after SIGKILL (lease ttl {TTL}s)")

        p.close()
        prefill, p = _prefill(tmp_path, name, etcd, prefix, zmq_port=zmq)  # same port
        # pages the failed rooms 10-29 do not hold (theirs wait for the release bound, K42)
        room = eventually_transfers(p, d, name, 100, [7, 8], [40, 41])
        assert d.pages_equal(p, [7, 8], [40, 41])
        assert wait_rooms(d.client, [room]) == [KVPoll.Success]
        assert prefill.stop() == 0
        assert not _registrations(etcd, prefix)  # a clean stop revokes its lease at once
    finally:
        p.close()
        d.close()
        prefill.stop()
        decode.stop()


def test_etcd_outage_keeps_rooms_and_registrations_return(tmp_path: Path,
                                                          etcd: EtcdServer) -> None:
    prefix, name = "/kvd/it-b", f"prefill-b:{free_port()}"
    prefill, p = _prefill(tmp_path, name, etcd, prefix)
    view_ttl = 5.0
    decode = start_daemon("decode", tmp_path, etcd_view_ttl=view_ttl, **_opts(etcd, prefix))
    d = EngineStandIn(decode.socket, seed=2)
    try:
        _until("registered", lambda: _registrations(etcd, prefix))
        transfer_room(p, d, name, 1, [1], [2], chunk=1)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        Receiver(d.client, 50, name).init([20, 21], 20)  # in flight across the outage
        _until("room 50 bound", lambda: wait_many(d.client, [50], 0.1) ==
               [KVPoll.WaitingForInput])

        etcd.stop(signal.SIGKILL)
        shutil.rmtree(etcd.data)  # the worst case: etcd comes back without its data
        t_down = time.monotonic()
        transfer_room(p, d, name, 2, [3, 4], [5, 6], chunk=1)  # from the last known view
        assert wait_rooms(d.client, [2]) == [KVPoll.Success]
        assert d.pages_equal(p, [3, 4], [5, 6])
        time.sleep(max(0.0, t_down + view_ttl + 1.0 - time.monotonic()))  # view too old now
        Receiver(d.client, 3, name).init([9], 9)  # a new lookup: refused, named
        assert wait_rooms(d.client, [3]) == [KVPoll.Failed]
        kind, reason = Receiver.attach(d.client, 3).failure()
        assert kind == "bootstrap" and "etcd unreachable" in reason and \
            "etcd_view_ttl = 5s" in reason, reason

        etcd.start()
        _until("the registration comes back without a restart",
               lambda: [r["instance_id"] for r in _registrations(etcd, prefix)] ==
               [prefill.ready["instance_id"]])
        eventually_transfers(p, d, name, 4, [7], [8])
        assert d.pages_equal(p, [7], [8])
        sender = Sender(p.client, 50)  # the room bound before the outage still completes
        sender.init(2, 0)
        sender.send(np.array([30, 31]))
        assert wait_rooms(d.client, [50]) == [KVPoll.Success]
        assert d.pages_equal(p, [30, 31], [20, 21])
    finally:
        p.close()
        d.close()
        prefill.stop()
        decode.stop()


def _view_instances(decode: DaemonProcess, name: str) -> set[str]:
    """Instances the decode's etcd view holds for ``name`` (its /v1/status peers)."""
    peers = signed("GET", f"http://{decode.http_addr}/v1/status").json()["peers"]
    return {p["instance_id"] for p in peers if p["bootstrap"] == name and p["instance_id"]}


def test_etcd_restart_within_the_ttl_is_one_watch_event(tmp_path: Path,
                                                        etcd: EtcdServer) -> None:
    """A prefill restarted at the same port before its lease expires: its new put
    replaces the key, the decode fails the old instance's rooms at once (kind peer,
    not after a TTL) and the first room after the decode saw the new instance succeeds."""
    prefix, name, zmq = "/kvd/it-c", f"prefill-c:{free_port()}", free_port()
    ttl = {"etcd_lease_ttl": 30.0}  # a death would take 30 s: only the put can tell
    prefill, p = _prefill(tmp_path, name, etcd, prefix, zmq_port=zmq, **ttl)
    decode = start_daemon("decode", tmp_path, **(_opts(etcd, prefix) | ttl))
    d = EngineStandIn(decode.socket, seed=2)
    try:
        transfer_room(p, d, name, 1, [1], [2], chunk=1)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        old = prefill.ready["instance_id"]
        rooms = list(range(10, 20))
        for room in rooms:
            Receiver(d.client, room, name).init([room], room)
        _until("rooms bound", lambda: wait_many(d.client, rooms, 0.1) ==
               [KVPoll.WaitingForInput] * len(rooms))
        prefill.kill(signal.SIGKILL)
        prefill.proc.wait(10)
        p.close()
        prefill, p = _prefill(tmp_path, name, etcd, prefix, zmq_port=zmq, **ttl)
        new, t0 = prefill.ready["instance_id"], time.monotonic()
        _until("the old instance's rooms fail",
               lambda: KVPoll.WaitingForInput not in poll_many(d.client, rooms), within=20)
        assert poll_many(d.client, rooms) == [KVPoll.Failed] * len(rooms)
        kind, reason = Receiver.attach(d.client, rooms[0]).failure()
        assert kind == "peer" and f"restarted (instance {old} -> {new})" in reason
        _until("the decode's view has the new instance",
               lambda: _view_instances(decode, name) == {new})
        transfer_room(p, d, name, 100, [5, 6], [7, 8], chunk=1)  # first try, no retry
        assert wait_rooms(d.client, [100]) == [KVPoll.Success]
        assert d.pages_equal(p, [5, 6], [7, 8])
        print(f"restart -> first successful room {time.monotonic() - t0:.3f}s after the new "
              f"prefill's engine registered (lease ttl 30s)")
    finally:
        p.close()
        d.close()
        prefill.stop()
        decode.stop()
