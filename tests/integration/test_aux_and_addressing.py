"""Aux data over the control-plane fallback (K09) and addressing: IPv6, bind failures (K13)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KvdClient, KVPoll, Receiver, Sender
from kvd.errors import KvdError
from kvd.launch import start_daemon
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import signed, start_pair, stop_pair

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_k09_aux_slot_reuse_over_the_control_plane(tmp_path: Path) -> None:
    faults = json.dumps({"aux_delay_s": 0.05})  # a slow TCP fallback for aux
    pair = start_pair(tmp_path, p_opts={"aux_transport": "control", "fault_injection": faults},
                      d_opts={"aux_transport": "control"},
                      engine_opts={"aux_slots": 16, "aux_item_len": 16},
                      d_engine_opts={"aux_slots": 4, "aux_item_len": 16})
    p, d = pair.p_engine, pair.d_engine
    d.aux[:] = 0  # the engine starts with empty slots
    free_slots, src_slots = list(range(4)), list(range(16))
    slots_lock = threading.Condition()
    mismatches: list[int] = []
    local = threading.local()

    def clients() -> tuple[KvdClient, KvdClient]:
        if not hasattr(local, "c"):  # one connection per thread: waits block their caller
            local.c = (KvdClient(p.client.path), KvdClient(d.client.path))
        return local.c

    def one_room(room: int) -> None:
        pc, dc = clients()
        with slots_lock:
            slots_lock.wait_for(lambda: free_slots)
            slot = free_slots.pop()
            src_slot = src_slots.pop()  # the prefill engine's own slot, exclusive as well
        try:
            assert not d.aux[slot].any()  # a freed slot reads as empty
            p.aux[src_slot, :8] = np.frombuffer(np.int64(room).tobytes(), np.uint8)
            p.aux[src_slot, 8:] = np.frombuffer(np.int64(room % 50_000).tobytes(), np.uint8)
            r = Receiver(dc, room, pair.bootstrap)
            r.init([room % 256], slot)
            s = Sender(pc, room)
            s.init(1, src_slot)
            s.send([room % 256])
            assert r.wait(30) == KVPoll.Success
            got_room, token = np.frombuffer(d.aux[slot].tobytes(), np.int64)
            if got_room != room or token != room % 50_000:
                mismatches.append(room)
            r.clear()
            s.clear()
        finally:
            d.aux[slot] = 0
            with slots_lock:
                free_slots.append(slot)
                src_slots.append(src_slot)
                slots_lock.notify()

    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one_room, range(1, 1001)))
        assert mismatches == []
        assert time.monotonic() - t0 < 120
        # An aux payload that does not fit the decode's slots fails only that room.
        bad = start_daemon("decode", tmp_path, aux_transport="control")
        bad_engine = EngineStandIn(bad.socket, seed=5, aux_slots=4, aux_item_len=8)
        try:
            r = Receiver(bad_engine.client, 5000, pair.bootstrap)
            r.init([1], 1)
            time.sleep(0.3)
            s = Sender(p.client, 5000)
            s.init(1, 0)
            s.send([1])
            assert r.wait(10) == KVPoll.Failed
            assert "aux" in r.failure_reason()
        finally:
            bad_engine.close()
            bad.stop()
        transfer_room(p, d, pair.bootstrap, 5001, [2], [3], chunk=1)
        assert wait_rooms(d.client, [5001]) == [KVPoll.Success]
    finally:
        stop_pair(pair)


def test_k13_ipv6_loopback_end_to_end(tmp_path: Path) -> None:
    v6 = {"host": "::1", "http_host": "::1"}
    pair = start_pair(tmp_path, p_opts=v6, d_opts=v6)
    p, d = pair.p_engine, pair.d_engine
    try:
        assert pair.bootstrap.startswith("[::1]:")
        assert pair.prefill.ready["control_endpoint"].startswith("tcp://[::1]:")
        transfer_room(p, d, pair.bootstrap, 1, [1, 2, 3], [4, 5, 6], chunk=2)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        assert d.pages_equal(p, [1, 2, 3], [4, 5, 6])
        info = signed("GET", f"http://{pair.bootstrap}/route",
                      params={"engine_rank": 0, "target_dp_group": 0}).json()
        assert info["rank_ip"] == "::1"
    finally:
        stop_pair(pair)


def test_k13_listener_that_cannot_bind_exits_with_an_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(KvdError, match="cannot bind"):
            start_daemon("decode", tmp_path, http_port=port, timeout=20)
        assert time.monotonic() - t0 < 10


def test_k13_ipv6_host_without_ipv4_transfer_host_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(KvdError, match="transfer_host"):
        start_daemon("decode", tmp_path, host="fe80::1")


def test_bootstrap_listener_binds_what_the_config_says(tmp_path: Path) -> None:
    prefill = start_daemon("prefill", tmp_path, serve_bootstrap=True, bootstrap_host="127.0.0.2",
                           bootstrap_port=0)
    decode = start_daemon("decode", tmp_path)
    p, d = EngineStandIn(prefill.socket, seed=1), EngineStandIn(decode.socket, seed=2)
    try:
        boot = prefill.ready["bootstrap_addr"]
        assert boot.startswith("127.0.0.2:") and boot != prefill.http_addr
        params = {"engine_rank": 0, "target_dp_group": 0}
        assert signed("GET", f"http://{prefill.http_addr}/route", params=params
                      ).status_code == 404  # the REST listener (loopback) has no /route
        assert signed("GET", f"http://{boot}/route", params=params).status_code == 200
        transfer_room(p, d, boot, 1, [1, 2], [3, 4], chunk=1)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        assert d.pages_equal(p, [1, 2], [3, 4])
    finally:
        p.close()
        d.close()
        prefill.stop()
        decode.stop()
