"""Lifecycle and peer failures: SIGTERM drain, engine disconnect, dead kvd, K04, K19."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvd.client import KvdClient, KVPoll, Receiver, Sender, poll_array, poll_many
from kvd.launch import start_daemon
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import eventually_transfers, free_port, health, start_pair, stop_pair

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _poll_until(client: KvdClient, rooms: list[int], done: set[int], timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = poll_many(client, rooms)
        if all(s in done for s in states):
            return states
        time.sleep(0.02)
    return poll_many(client, rooms)


def test_sigterm_drains_fails_the_rest_unlinks_socket_and_exits_0(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, p_opts={"drain_timeout": 1.0,
                                        "fault_injection": json.dumps({"delay_s": 0.3})})
    p, d = pair.p_engine, pair.d_engine
    try:
        transfer_room(p, d, pair.bootstrap, 1, [1, 2], [3, 4], chunk=1)  # in flight: drains
        Receiver(d.client, 2, pair.bootstrap).init([5], 5)
        Sender(p.client, 2)  # never sends: failed at the end of the drain
        time.sleep(0.2)
        t0 = time.monotonic()
        pair.prefill.kill(signal.SIGTERM)
        assert pair.prefill.proc.wait(10) == 0
        assert time.monotonic() - t0 < 4
        assert not Path(pair.prefill.socket).exists()
        states = _poll_until(d.client, [1, 2], {KVPoll.Success, KVPoll.Failed}, 5)
        assert states == [KVPoll.Success, KVPoll.Failed]
        assert d.pages_equal(p, [1, 2], [3, 4])
        assert "shutting down" in Receiver.attach(d.client, 2).failure_reason()
    finally:
        stop_pair(pair)



def test_draining_daemon_refuses_new_rooms(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, d_opts={"drain_timeout": 3.0})
    _p, d = pair.p_engine, pair.d_engine
    try:
        Receiver(d.client, 1, pair.bootstrap).init([1], 1)  # keeps the drain waiting
        pair.decode.kill(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(Exception, match="draining"):
            Receiver(d.client, 2, pair.bootstrap)
        assert pair.decode.proc.wait(10) == 0
    finally:
        stop_pair(pair)


def test_engine_disconnect_fails_its_rooms_and_unregisters_memory(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, d_opts={"release_timeout": 1.0})
    p, d = pair.p_engine, pair.d_engine
    try:
        Receiver(d.client, 1, pair.bootstrap).init([1, 2], 1)
        time.sleep(0.3)
        d.client.close()  # the decode engine goes away
        s = Sender(p.client, 1)
        s.init(2, 0)
        s.send([3, 4])
        assert s.wait(10) == KVPoll.Failed  # aborted by D, or its memory refused the write
        h = health(pair.decode)
        assert not h["engine_registered"] and h["tables"]["rooms"] == 0
        # The engine comes back (same pools): re-registers, and rooms work again.
        d.client = KvdClient(pair.decode.socket)
        d.client.call(d.registration)
        transfer_room(p, d, pair.bootstrap, 2, [5, 6], [7, 8], chunk=2)
        assert wait_rooms(d.client, [2]) == [KVPoll.Success]
        assert d.pages_equal(p, [5, 6], [7, 8])
    finally:
        stop_pair(pair)


def test_dead_kvd_reads_failed_and_client_reconnects_with_registration(tmp_path: Path) -> None:
    sock = str(tmp_path / "decode.sock")
    http_port = free_port()
    pair = start_pair(tmp_path, d_opts={"engine_socket": sock, "http_port": http_port})
    p, d = pair.p_engine, pair.d_engine
    try:
        r = Receiver(d.client, 1, pair.bootstrap)
        r.init([1], 1)
        old_table = d.client.table
        assert old_table is not None  # the engine reads statuses from kvd's table
        pair.decode.kill(signal.SIGKILL)
        pair.decode.proc.wait(5)
        # the table's writer is silent: within its staleness bound the client asks the
        # socket, which is gone (a table-less client reads Failed at once)
        assert _poll_until(d.client, [1], {KVPoll.Failed}, 10.0) == [KVPoll.Failed]
        assert r.poll() == KVPoll.Failed
        assert "kvd unreachable" in r.failure_reason()
        assert poll_many(d.client, [1, 2]) == [KVPoll.Failed, KVPoll.Failed]
        pair.decode = start_daemon("decode", tmp_path, engine_socket=sock, http_port=http_port)
        transfer_room(p, d, pair.bootstrap, 3, [2, 3], [4, 5], chunk=2)  # replays RegisterKV
        assert wait_rooms(d.client, [3]) == [KVPoll.Success]
        assert d.client.reconnects == 1
        assert d.client.table is not None and d.client.table is not old_table  # the new kvd's
        assert poll_many(d.client, [3]) == [KVPoll.Success]
        assert d.pages_equal(p, [2, 3], [4, 5])
    finally:
        stop_pair(pair)


def test_k04_receivers_bound_to_a_finished_room_fail_at_once(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, d_opts={"waiting_timeout": 30.0})
    extra = [start_daemon("decode", tmp_path) for _ in range(2)]
    engines = [EngineStandIn(x.socket, seed=10 + i) for i, x in enumerate(extra)]
    p = pair.p_engine
    try:
        receivers = [Receiver(e.client, 100, pair.bootstrap)
                     for e in (pair.d_engine, *engines)]
        receivers[0].init([1, 2], 1)
        time.sleep(0.3)
        s = Sender(p.client, 100)
        s.init(2, 0)
        s.send([3, 4])
        assert receivers[0].wait(10) == KVPoll.Success
        t0 = time.monotonic()
        for i, r in enumerate(receivers[1:]):
            r.init([5 + i, 6 + i], 5 + i)
        for r in receivers[1:]:
            assert _poll_until(r.client, [100], {KVPoll.Failed}, 5) == [KVPoll.Failed]
            assert "duplicate room" in r.failure_reason()
        assert time.monotonic() - t0 < 2.0
        assert pair.d_engine.pages_equal(p, [3, 4], [1, 2])
    finally:
        for e in engines:
            e.close()
        for x in extra:
            x.stop()
        stop_pair(pair)


@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_k19_frozen_or_dead_prefill_bounds_every_send(tmp_path: Path, fault: str) -> None:
    hb = {"heartbeat_interval": 0.5, "heartbeat_max_failures": 2, "control_send_timeout": 1.0}
    http_port, zmq_port = free_port(), free_port()
    p_opts = {"http_port": http_port, "zmq_port": zmq_port}
    # a page per room: live rooms' pages never overlap (K42)
    pair = start_pair(tmp_path, p_opts=p_opts, d_opts=hb, engine_opts={},
                      d_engine_opts={"num_pages": 5120})
    healthy = start_daemon("prefill", tmp_path, serve_bootstrap=True)
    h_engine = EngineStandIn(healthy.socket, seed=3)
    d = pair.d_engine
    try:
        transfer_room(pair.p_engine, d, pair.bootstrap, 1, [1], [1], chunk=1)  # connected
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        pair.prefill.kill(signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
        rooms = list(range(10, 5010))
        t0 = time.monotonic()
        for room in rooms:
            Receiver(d.client, room, pair.bootstrap).init([room], room)
        assert time.monotonic() - t0 < 30  # no RPC waited on the dead peer
        ok_room = 20_000
        transfer_room(h_engine, d, healthy.http_addr, ok_room, [2], [5100], chunk=1)
        assert wait_rooms(d.client, [ok_room]) == [KVPoll.Success]
        states = _poll_until(d.client, rooms, {KVPoll.Failed}, 10)
        assert states == [KVPoll.Failed] * len(rooms)
        reason = Receiver.attach(d.client, rooms[-1]).failure_reason()
        assert pair.bootstrap in reason
        assert httpx.get(f"http://{pair.decode.http_addr}/health", timeout=1).status_code == 200
        if fault == "sigstop":
            pair.prefill.kill(signal.SIGCONT)
        else:
            pair.p_engine.close()
            pair.prefill = start_daemon("prefill", tmp_path, serve_bootstrap=True, **p_opts)
            pair.p_engine = EngineStandIn(pair.prefill.socket, seed=1)
        eventually_transfers(pair.p_engine, d, pair.bootstrap, 30_000, [7], [8])
        assert d.pages_equal(pair.p_engine, [7], [8])
        assert np.isfinite(health(pair.decode)["uptime_s"])
    finally:
        pair.prefill.kill(signal.SIGCONT)
        h_engine.close()
        healthy.stop()
        stop_pair(pair)


def test_polls_read_the_status_table_without_a_round_trip(tmp_path: Path) -> None:
    """Issue 21 step A over the real socket: the engine's client maps kvd's status table
    at registration; a room moved end to end reads Success on both sides from the table
    (no request sent), rooms the table does not answer are asked over the socket in one
    Poll, and a client with ``use_table=False`` answers the same over the socket."""
    pair = start_pair(tmp_path)
    p, d = pair.p_engine, pair.d_engine
    try:
        assert p.client.table is not None and d.client.table is not None
        transfer_room(p, d, pair.bootstrap, 7, [1, 2], [3, 4], chunk=1)
        for eng in (p, d):
            assert _poll_until(eng.client, [7], {KVPoll.Success}, 20.0) == [KVPoll.Success]
            sent = eng.client._next_id
            assert poll_many(eng.client, [7]) == [KVPoll.Success]
            assert poll_array(eng.client, np.array([7], dtype=np.uint64)).tolist() == [4]
            assert eng.client._next_id == sent  # no request: the table answered
            assert poll_many(eng.client, [7, 12345]) == [KVPoll.Success, -1]
            assert eng.client._next_id == sent + 1  # one Poll, for the unknown room only
        plain = KvdClient(pair.decode.socket, use_table=False)
        try:
            assert plain.table is None
            assert poll_many(plain, [7, 12345]) == [KVPoll.Success, -1]
        finally:
            plain.close()
        assert d.pages_equal(p, [1, 2], [3, 4])
    finally:
        stop_pair(pair)


_LAUNCHER = """
import json, sys, time
from kvd.launch import start_daemon
d = start_daemon("decode", sys.argv[1], timeout=120, log_level="WARNING")
print(json.dumps({"pid": d.proc.pid, "socket": d.socket}), flush=True)
time.sleep(3600)  # killed by the test, never stopping its daemon
"""


def test_a_daemon_whose_launcher_dies_stops_by_itself(tmp_path: Path) -> None:
    """A test run or benchmark killed mid-way leaves no daemon holding ports: the
    daemon's lifeline (kvd.launch.LIFELINE_ENV) reads end of file and it stops as at
    SIGTERM, unlinking its socket."""
    import subprocess
    import sys

    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        started = json.loads(launcher.stdout.readline())
        pid, sock = started["pid"], started["socket"]
        assert Path(sock).exists()
        assert Path(f"/proc/{pid}").exists()  # alive while its launcher lives
        launcher.kill()
        launcher.wait(30)

        def alive() -> bool:
            try:  # one read: the process may be reaped between two
                stat = Path(f"/proc/{pid}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                return False
            return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie has stopped

        deadline = time.monotonic() + 120
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(), "the daemon outlived its launcher"
        assert not Path(sock).exists()  # it shut down, not crashed
    finally:
        launcher.kill()
        launcher.wait()
