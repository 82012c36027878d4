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
from tests.conftest import eventually_transfers, free_port
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
    daemon = start_daemon("prefill", tmp, bootstrap_addr=name, **_opts(etcd, prefix), **kw)
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
            Receiver(d.client, room, name).init([room], 0)
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
        room = eventually_transfers(p, d, name, 100, [7, 8], [9, 10])
        assert d.pages_equal(p, [7, 8], [9, 10])
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
    decode = start_daemon("decode", tmp_path, etcd_view_ttl=60.0, **_opts(etcd, prefix))
    d = EngineStandIn(decode.socket, seed=2)
    try:
        _until("registered", lambda: _registrations(etcd, prefix))
        transfer_room(p, d, name, 1, [1], [2], chunk=1)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        Receiver(d.client, 50, name).init([20, 21], 0)  # in flight across the outage
        _until("room 50 bound", lambda: wait_many(d.client, [50], 0.1) ==
               [KVPoll.WaitingForInput])

        etcd.stop(signal.SIGKILL)
        shutil.rmtree(etcd.data)  # the worst case: etcd comes back without its data
        time.sleep(TTL)  # longer than a lease: the prefill cannot renew meanwhile
        transfer_room(p, d, name, 2, [3, 4], [5, 6], chunk=1)  # from the last known view
        assert wait_rooms(d.client, [2]) == [KVPoll.Success]
        assert d.pages_equal(p, [3, 4], [5, 6])

        etcd.start()
        _until("the registration comes back without a restart",
               lambda: [r["instance_id"] for r in _registrations(etcd, prefix)] ==
               [prefill.ready["instance_id"]])
        eventually_transfers(p, d, name, 3, [7], [8])
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
