"""Failure handling with real daemons, real Mooncake TCP and real signals (cases K01-K19)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender, poll_many, wait_many
from kvd.errors import RoomError
from kvd.launch import start_daemon
from kvd.protocol import rpc
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import eventually_transfers, free_port, health, start_pair, stop_pair

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _faults(**plan: object) -> str:
    return json.dumps(plan)


def test_k01_prefill_registers_once_bootstrap_comes_up(tmp_path: Path) -> None:
    port = free_port()
    prefill = start_daemon("prefill", tmp_path, bootstrap_addr=f"127.0.0.1:{port}")
    engine = EngineStandIn(prefill.socket, seed=1)  # PUTs start now, refused: nobody listens
    time.sleep(0.5)
    boot = start_daemon("decode", tmp_path, serve_bootstrap=True, http_port=port)
    decode = start_daemon("decode", tmp_path, bootstrap_retry_budget=5.0)
    d_engine = EngineStandIn(decode.socket, seed=2)
    try:
        transfer_room(engine, d_engine, f"127.0.0.1:{port}", 1, [1, 2], [3, 4], chunk=2)
        assert wait_rooms(d_engine.client, [1], timeout=15) == [KVPoll.Success]
        assert d_engine.pages_equal(engine, [1, 2], [3, 4])
    finally:
        for e in (engine, d_engine):
            e.close()
        for d in (prefill, boot, decode):
            d.stop()


def test_k01_decode_lookup_fails_in_bounded_time(tmp_path: Path) -> None:
    decode = start_daemon("decode", tmp_path, bootstrap_retry_budget=1.0, http_timeout=0.5)
    d_engine = EngineStandIn(decode.socket, seed=2)
    try:
        t0 = time.monotonic()
        r = Receiver(d_engine.client, 7, f"127.0.0.1:{free_port()}")
        assert r.wait(10) == KVPoll.Failed
        assert time.monotonic() - t0 < 4
        assert "bootstrap unreachable" in r.failure_reason()
    finally:
        d_engine.close()
        decode.stop()


def _late_messages(pair, rooms: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Sealed (authentic) late control messages: an abort to P, a failure report to D."""
    import zmq

    from kvd.launch import LAUNCH_SECRET
    from kvd.protocol import control
    from kvd.security import Authenticator

    auth, ctx = Authenticator(LAUNCH_SECRET.encode()), zmq.Context()
    p_ep, d_ep = (pair.prefill.ready["control_endpoint"], pair.decode.ready["control_endpoint"])
    p_id, d_id = pair.prefill.ready["instance_id"], pair.decode.ready["instance_id"]

    def abort(r: int) -> control.ControlMessage:
        return control.RoomAbort(room=r, inc=1, kind="aborted", reason="late abort",
                                 endpoint=d_ep, instance_id="late")

    def failure(r: int) -> control.ControlMessage:
        return control.RoomStatus(room=r, inc=1, status=0, kind="transport",
                                  reason="late failure", endpoint=p_ep, instance_id="x")

    for target, to, make in ((p_ep, p_id, abort), (d_ep, d_id, failure)):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(target)
        for room in rooms:
            sock.send(auth.seal(control.encode(make(room)), to))
        sock.close()
    ctx.term()


def test_k05_late_abort_after_clear_leaves_no_trace(pd_pair, room_ids) -> None:
    """10 000 create -> success -> clear -> late abort / late failure cycles (250 at a time:
    rooms in flight together have distinct destination pages, K42)."""
    p, d = pd_pair.p_engine, pd_pair.d_engine
    base = health(pd_pair.decode)["tables"], health(pd_pair.prefill)["tables"]
    auth_failures = health(pd_pair.decode)["counters"]["auth_failures"]  # shared fixture
    for _ in range(40):
        rooms = [next(room_ids) for _ in range(250)]
        pairs = [transfer_room(p, d, pd_pair.bootstrap, room, [room % 256],
                               [i % 256], chunk=1) for i, room in enumerate(rooms)]
        assert wait_many(d.client, rooms, 60) == [KVPoll.Success] * len(rooms)
        assert wait_many(p.client, rooms, 60) == [KVPoll.Success] * len(rooms)
        for send, recv in pairs:
            recv.clear()
            send.clear()
        _late_messages(pd_pair, rooms)
        for send, recv in pairs[:5]:  # late engine-side aborts too: ignored, nothing raises
            recv.abort("late")
            send.abort("late")
    time.sleep(1.0)
    assert poll_many(d.client, rooms) == [-1] * len(rooms)
    assert poll_many(p.client, rooms) == [-1] * len(rooms)
    new = rooms[0]  # a cleared room id starts fresh
    r = Receiver(d.client, new, pd_pair.bootstrap)
    assert r.poll() in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
    r.abort()
    r.clear()
    time.sleep(0.3)
    after = health(pd_pair.decode)["tables"], health(pd_pair.prefill)["tables"]
    assert after[0]["rooms"] == base[0]["rooms"] and after[1]["rooms"] == base[1]["rooms"]
    assert after[1]["pending"] == base[1]["pending"]
    assert health(pd_pair.decode)["counters"]["auth_failures"] == auth_failures


def test_k06_abort_mid_transfer_defers_release(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, p_opts={"fault_injection": _faults(delay_s=2.0)},
                      engine_opts={"num_pages": 128})
    p, d = pair.p_engine, pair.d_engine
    try:
        pages = np.arange(64)
        src1 = np.random.default_rng(1).permutation(128)[:64]
        r1 = Receiver(d.client, 1, pair.bootstrap)
        r1.init(pages, int(pages[0]))
        s1 = Sender(p.client, 1)
        s1.init(64, 0)
        before = [b[32:64].copy() for b in d.kv]
        s1.send(src1[:32])
        s1.send(src1[32:])
        time.sleep(0.5)
        r1.abort("client went away")
        assert r1.poll() == KVPoll.Failed
        assert not r1.releasable()  # prefill still has a write in flight
        with pytest.raises(RoomError, match="not releasable"):
            r1.clear(timeout=0.1)
        t0 = time.monotonic()
        assert r1.wait(10) == KVPoll.Failed and r1.releasable()
        assert 0.8 < time.monotonic() - t0 < 5  # released when the 2 s batch returned
        r1.clear()
        assert s1.wait(5) == KVPoll.Failed
        time.sleep(2.5)  # a second chunk, had it been scheduled, would have landed by now
        assert all(np.array_equal(b[32:64], x) for b, x in zip(d.kv, before, strict=True))
        src2 = np.random.default_rng(2).permutation(128)[:64]
        transfer_room(p, d, pair.bootstrap, 2, src2, pages, chunk=64)
        assert wait_rooms(d.client, [2], timeout=20) == [KVPoll.Success]
        assert d.pages_equal(p, src2, pages)
    finally:
        stop_pair(pair)


def test_k07_one_failed_batch_fails_only_its_room(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, p_opts={"fault_injection": _faults(fail_batches=[0]),
                                        "transient_retry_s": 0.2})
    p, d = pair.p_engine, pair.d_engine
    try:
        transfer_room(p, d, pair.bootstrap, 1, [1, 2], [3, 4], chunk=2)
        assert wait_rooms(d.client, [1]) == [KVPoll.Failed]
        reason = Receiver.attach(d.client, 1).failure_reason()
        assert "refused" in reason and pair.decode.ready["control_endpoint"] in reason
        for room in range(2, 6):
            transfer_room(p, d, pair.bootstrap, room, [room], [room + 10], chunk=1)
        assert wait_rooms(d.client, list(range(2, 6))) == [KVPoll.Success] * 4
        assert d.pages_equal(p, [2, 3, 4, 5], [12, 13, 14, 15])
        log = pair.prefill.log.read_text()
        assert "refused" in log and "recovered after 1 failed room" in log
        counters = health(pair.prefill)["counters"]
        assert counters["session_failures"] == 1 and counters["session_recoveries"] == 1
    finally:
        stop_pair(pair)



def test_k16_every_state_has_a_deadline(tmp_path: Path) -> None:
    opts = {"bootstrap_timeout": 1.5, "waiting_timeout": 1.5, "transfer_timeout": 1.5,
            "heartbeat_interval": 120.0}
    # D's WaitingForInput deadline is longer than P's Transferring one: D's clock starts
    # when it sent its pages, before P's, so with equal deadlines the room 3 case below
    # raced D's abort against P's own deadline (D's deadline: test_k16_frozen_prefill_*).
    pair = start_pair(tmp_path, p_opts=opts | {"fault_injection": _faults(delay_s=3.0)},
                      d_opts=opts | {"waiting_timeout": 5.0})
    p, d = pair.p_engine, pair.d_engine
    try:
        # P creates R and D never sends: Failed at the bootstrap timeout.
        s = Sender(p.client, 1)
        t0 = time.monotonic()
        assert s.wait(10) == KVPoll.Failed
        assert 1.0 < time.monotonic() - t0 < 3.0
        assert "timed out in Bootstrapping" in s.failure_reason()
        # D sends pages for a room P never creates: the buffered entry is dropped.
        Receiver(d.client, 2, pair.bootstrap).init([1], 1)
        time.sleep(0.5)
        assert health(pair.prefill)["tables"]["pending"] == 1
        time.sleep(2.0)
        assert health(pair.prefill)["tables"]["pending"] == 0
        # A transfer stuck in Transferring (3 s batches) fails at its 1.5 s deadline, and the
        # late end of the write does not turn it into Success.
        r = Receiver(d.client, 3, pair.bootstrap)
        r.init([5], 5)
        s3 = Sender(p.client, 3)
        s3.init(1, 0)
        s3.send([6])
        t0 = time.monotonic()
        assert s3.wait(10) == KVPoll.Failed
        assert time.monotonic() - t0 < 3.0
        assert "timed out in Transferring" in s3.failure_reason()
        assert r.wait(10) == KVPoll.Failed
        time.sleep(2.0)
        assert r.poll() == KVPoll.Failed and s3.poll() == KVPoll.Failed
    finally:
        stop_pair(pair)


def test_k16_frozen_prefill_fails_waiting_room(tmp_path: Path) -> None:
    opts = {"bootstrap_timeout": 3.0, "waiting_timeout": 3.0, "heartbeat_interval": 120.0}
    pair = start_pair(tmp_path, p_opts=opts, d_opts=opts)
    p, d = pair.p_engine, pair.d_engine
    try:
        r = Receiver(d.client, 1, pair.bootstrap)
        r.init([1, 2], 1)
        s = Sender(p.client, 1)  # P has R's pages now
        time.sleep(0.3)
        pair.prefill.kill(signal.SIGSTOP)
        t0 = time.monotonic()
        assert _poll_until_done(r, 10) == KVPoll.Failed  # wait() would also await release
        assert 2.0 < time.monotonic() - t0 < 4.5
        assert "timed out in WaitingForInput" in r.failure_reason()
        assert not r.releasable()  # P may still write: pages held until release_timeout
        pair.prefill.kill(signal.SIGCONT)
        del s
    finally:
        pair.prefill.kill(signal.SIGCONT)
        stop_pair(pair)


def _poll_until_done(room: Receiver | Sender, timeout: float) -> KVPoll | int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = room.poll()
        if state in (KVPoll.Success, KVPoll.Failed):
            return state
        time.sleep(0.01)
    return room.poll()


class _SilentServer:
    """Accepts TCP connections and never answers (an unresponsive bootstrap server)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self.stop = True
        for c in self.conns:
            c.close()
        self.sock.close()


def test_k17_unresponsive_bootstrap_does_not_stall_other_rooms(tmp_path: Path) -> None:
    """While one room waits on a bootstrap server that accepts and never answers, rooms to
    a healthy prefill keep completing and /health keeps answering (functional outcomes;
    the latencies themselves are measured by ``make bench``, not asserted here)."""
    pair = start_pair(tmp_path, d_opts={"http_timeout": 0.5, "bootstrap_retry_budget": 4.0})
    p, d = pair.p_engine, pair.d_engine
    silent = _SilentServer()
    try:
        stuck = Receiver(d.client, 999, f"127.0.0.1:{silent.port}")
        done_while_stuck, room = 0, 0
        while stuck.poll() != KVPoll.Failed and room < 500:
            room += 1
            transfer_room(p, d, pair.bootstrap, room, [room % 200], [room % 200], chunk=1)
            assert wait_rooms(d.client, [room], timeout=30) == [KVPoll.Success]
            assert httpx.get(f"http://{pair.decode.http_addr}/health", timeout=10).status_code \
                == 200
            if stuck.poll() != KVPoll.Failed:
                done_while_stuck += 1
            for c in (p, d):
                c.client.call(rpc.Clear(room=room))
        assert stuck.wait(30) == KVPoll.Failed
        kind, reason = stuck.failure()
        assert kind == "bootstrap" and "bootstrap unreachable" in reason
        assert done_while_stuck >= 3  # healthy rooms completed while the lookup hung
    finally:
        silent.close()
        stop_pair(pair)


def test_k18_transient_queue_full_is_backpressure(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, p_opts={"fault_injection": _faults(transient_per_batch=3)})
    p, d = pair.p_engine, pair.d_engine
    try:
        rooms = list(range(1, 501))
        rng = np.random.default_rng(5)
        plans = {}
        for i in range(0, len(rooms), 50):  # 50 rooms in flight at a time
            batch = rooms[i:i + 50]
            dst_all = rng.permutation(256)  # rooms in flight never share destination pages
            for j, room in enumerate(batch):
                src, dst = rng.choice(256, 2, replace=False), dst_all[2 * j:2 * j + 2]
                plans[room] = (src, dst)
                transfer_room(p, d, pair.bootstrap, room, src, dst, chunk=2)
            assert wait_many(d.client, batch, 30) == [KVPoll.Success] * len(batch)
            for room in batch:
                assert d.pages_equal(p, *plans[room])
                Receiver.attach(d.client, room).clear()
        assert "accepted after 3 retries" in pair.prefill.log.read_text()  # retried...
        assert health(pair.prefill)["counters"]["session_failures"] == 0  # ...never failed
    finally:
        stop_pair(pair)


def test_k18_queue_full_past_deadline_fails_only_that_room(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, p_opts={"fault_injection": _faults(fail_batches=[1]),
                                        "transient_retry_s": 0.3})
    p, d = pair.p_engine, pair.d_engine
    try:
        transfer_room(p, d, pair.bootstrap, 1, [1], [1], chunk=1)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        transfer_room(p, d, pair.bootstrap, 2, [2], [2], chunk=1)
        assert wait_rooms(d.client, [2]) == [KVPoll.Failed]
        assert "queue full" in Receiver.attach(d.client, 2).failure_reason()
        transfer_room(p, d, pair.bootstrap, 3, [3], [3], chunk=1)
        assert wait_rooms(d.client, [3]) == [KVPoll.Success]
    finally:
        stop_pair(pair)


def test_sigkill_prefill_fails_rooms_and_restart_recovers(tmp_path: Path) -> None:
    hb = {"heartbeat_interval": 0.5, "heartbeat_max_failures": 2}
    http_port, zmq_port = free_port(), free_port()
    p_opts = {"http_port": http_port, "zmq_port": zmq_port}
    pair = start_pair(tmp_path, p_opts=p_opts, d_opts=hb)
    other = start_daemon("prefill", tmp_path, serve_bootstrap=True)
    other_engine = EngineStandIn(other.socket, seed=3)
    p, d = pair.p_engine, pair.d_engine
    try:
        rooms = list(range(1, 201))
        for room in rooms:  # receivers bound, senders never send: rooms stay in flight
            Receiver(d.client, room, pair.bootstrap).init([room % 256], room % 256)
        assert wait_many(d.client, rooms[-1:], 0.5)[0] == KVPoll.WaitingForInput
        pair.prefill.kill(signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and KVPoll.WaitingForInput in poll_many(d.client, rooms):
            time.sleep(0.02)
        states = poll_many(d.client, rooms)
        detect = time.monotonic() - t0
        assert states == [KVPoll.Failed] * len(rooms)
        assert detect < 0.5 * 2 + 2
        reason = Receiver.attach(d.client, 1).failure_reason()
        assert pair.bootstrap in reason
        # pages the failed rooms (1-200) do not hold: theirs are not releasable yet (K42)
        transfer_room(other_engine, d, other.http_addr, 500, [1], [201], chunk=1)
        assert wait_rooms(d.client, [500]) == [KVPoll.Success]
        p.close()
        pair.prefill = start_daemon("prefill", tmp_path, serve_bootstrap=True, **p_opts)
        pair.p_engine = p = EngineStandIn(pair.prefill.socket, seed=1)
        eventually_transfers(p, d, pair.bootstrap, 600, [7, 8], [209, 210])
        assert d.pages_equal(p, [7, 8], [209, 210])
        # Peers that come and go leave the decode daemon's open FDs bounded.
        fds = _fds(pair.decode.proc.pid)
        for cycle in range(3):
            pair.prefill.kill(signal.SIGKILL)
            pair.prefill.proc.wait(5)
            p.close()
            pair.prefill = start_daemon("prefill", tmp_path, serve_bootstrap=True, **p_opts)
            pair.p_engine = p = EngineStandIn(pair.prefill.socket, seed=1)
            eventually_transfers(p, d, pair.bootstrap, 700 + 50 * cycle, [1], [220 + cycle])
        assert _fds(pair.decode.proc.pid) <= fds + 4
    finally:
        other_engine.close()
        other.stop()
        stop_pair(pair)


def test_rooms_in_any_order_leave_tables_and_fds_at_baseline(tmp_path: Path) -> None:
    opts = {"bootstrap_timeout": 0.5, "waiting_timeout": 0.5, "transfer_timeout": 1.0}
    pair = start_pair(tmp_path, p_opts=opts, d_opts=opts | {"release_timeout": 0.5})
    p, d = pair.p_engine, pair.d_engine
    rng = np.random.default_rng(9)
    try:
        transfer_room(p, d, pair.bootstrap, 1, [1], [1], chunk=1)
        wait_rooms(d.client, [1])
        for c in (p, d):
            Receiver.attach(c.client, 1).clear()
        base = (health(pair.prefill)["tables"], health(pair.decode)["tables"],
                _fds(pair.prefill.proc.pid), _fds(pair.decode.proc.pid))
        rooms = list(range(10, 10_010))
        for i in range(0, len(rooms), 250):  # room % 256: distinct pages per batch (K42)
            batch = rooms[i:i + 250]
            senders = {}
            for room in batch:
                kind = rng.integers(0, 4)  # 0 success, 1 abort, 2 timeout, 3 receiver-only
                r = Receiver(d.client, room, pair.bootstrap)
                r.init([room % 256], room % 256)
                if kind in (0, 1):
                    s = Sender(p.client, room)
                    s.init(1, 0)
                    s.send([room % 256])
                    senders[room] = s
                if kind == 1:
                    r.abort("random abort")
                if kind == 2:
                    Sender(p.client, room)  # never sends: times out in WaitingForInput
            wait_many(d.client, batch, 30)
            wait_many(p.client, batch, 30)
            for room in batch:
                Receiver.attach(d.client, room).clear()
                Sender.attach(p.client, room).clear()
        time.sleep(1.5)  # pending entries expire
        after = (health(pair.prefill)["tables"], health(pair.decode)["tables"],
                 _fds(pair.prefill.proc.pid), _fds(pair.decode.proc.pid))
        for key in ("rooms", "pending", "peers"):
            assert after[0][key] == base[0][key], (key, base[0], after[0])
        for key in ("rooms", "registered", "rank_cache"):
            assert after[1][key] == base[1][key], (key, base[1], after[1])
        assert after[2] <= base[2] + 5 and after[3] <= base[3] + 5
    finally:
        stop_pair(pair)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_k07_dead_decode_fails_fast_and_other_sessions_are_unaffected(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, p_opts={"transient_retry_s": 0.3})
    d2 = start_daemon("decode", tmp_path)
    d2_engine = EngineStandIn(d2.socket, seed=7)
    p, d1 = pair.p_engine, pair.d_engine
    try:
        Receiver(d1.client, 1, pair.bootstrap).init([1, 2], 1)
        Receiver(d2_engine.client, 2, pair.bootstrap).init([3, 4], 3)
        time.sleep(0.5)  # both rooms bound on the prefill side
        pair.decode.kill(signal.SIGKILL)
        pair.decode.proc.wait(5)
        s1, s2 = Sender(p.client, 1), Sender(p.client, 2)
        t0 = time.monotonic()
        for s, pages in ((s1, [5, 6]), (s2, [7, 8])):
            s.init(2, 0)
            s.send(pages)
        assert s1.wait(10) == KVPoll.Failed
        assert time.monotonic() - t0 < 3.0
        assert s2.wait(10) == KVPoll.Success
        assert Receiver(d2_engine.client, 3, pair.bootstrap) is not None
        assert wait_many(d2_engine.client, [2], 5) == [KVPoll.Success]
        assert d2_engine.pages_equal(p, [7, 8], [3, 4])
    finally:
        d2_engine.close()
        d2.stop()
        stop_pair(pair)


def test_k02_slow_bootstrap_registration_retries_until_it_completes(tmp_path: Path) -> None:
    boot = start_daemon("decode", tmp_path, serve_bootstrap=True)  # a bootstrap-only kvd
    prefill = start_daemon("prefill", tmp_path, bootstrap_addr=boot.http_addr, http_timeout=0.3)
    decode = start_daemon("decode", tmp_path, bootstrap_retry_budget=10.0)
    try:
        boot.kill(signal.SIGSTOP)  # accepts connections, answers nothing: PUTs time out
        p = EngineStandIn(prefill.socket, seed=1)
        d = EngineStandIn(decode.socket, seed=2)
        time.sleep(1.5)
        ready = httpx.get(f"http://{prefill.http_addr}/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["bootstrap_registered"] is False
        boot.kill(signal.SIGCONT)
        transfer_room(p, d, boot.http_addr, 1, [1, 2], [3, 4], chunk=2)
        assert wait_rooms(d.client, [1], timeout=20) == [KVPoll.Success]
        assert d.pages_equal(p, [1, 2], [3, 4])
        assert "not reachable yet" in prefill.log.read_text()  # retried, then registered
        assert httpx.get(f"http://{prefill.http_addr}/ready", timeout=5).status_code == 200
        p.close()
        d.close()
    finally:
        boot.kill(signal.SIGCONT)
        for x in (prefill, decode, boot):
            x.stop()


def test_prefill_restart_between_heartbeats_fails_bound_rooms_fast_then_rooms_succeed(
        tmp_path: Path) -> None:
    """The decode side still believes it is registered with a restarted prefill (no
    heartbeat has run yet). The new instance never answers a message sealed for the old one
    (a prefill never answers an unregistered endpoint): the next heartbeat sees the new
    instance, fails the rooms bound to the old one with kind "peer" (not at the waiting
    timeout), and new rooms register again and succeed."""
    http_port, zmq_port = free_port(), free_port()
    p_opts = {"http_port": http_port, "zmq_port": zmq_port}
    pair = start_pair(tmp_path, p_opts=p_opts, d_opts={"heartbeat_interval": 0.5})
    d = pair.d_engine
    try:
        transfer_room(pair.p_engine, d, pair.bootstrap, 1, [1], [2], chunk=1)
        assert wait_rooms(d.client, [1]) == [KVPoll.Success]
        pair.prefill.kill(signal.SIGKILL)
        pair.prefill.proc.wait(5)
        pair.p_engine.close()
        pair.prefill = start_daemon("prefill", tmp_path, serve_bootstrap=True, **p_opts)
        pair.p_engine = EngineStandIn(pair.prefill.socket, seed=1)
        _send, recv = transfer_room(pair.p_engine, d, pair.bootstrap, 2, [3, 4], [5, 6], chunk=1)
        state = wait_rooms(d.client, [2], timeout=30)[0]
        if state == KVPoll.Failed:  # the heartbeats saw it down, or the old instance's cache
            assert any(w in recv.failure_reason() for w in ("restarted", "heartbeats missed"))
        else:  # the heartbeat saw the restart before the room was created
            assert state == KVPoll.Success
        # Rooms created before the decode's heartbeat has seen the new instance fail fast
        # (prefill down, or restarted); once it has, new rooms succeed.
        deadline = time.monotonic() + 60
        for room in range(3, 100):
            _send, recv = transfer_room(pair.p_engine, d, pair.bootstrap, room, [7, 8],
                                        [9, 10], chunk=1)
            if wait_rooms(d.client, [room], timeout=30) == [KVPoll.Success]:
                break
            assert recv.failure()[0] in ("heartbeat", "peer"), recv.failure()
            assert time.monotonic() < deadline, "no room succeeded after the restart"
            time.sleep(0.2)
        assert d.pages_equal(pair.p_engine, [7, 8], [9, 10])
    finally:
        stop_pair(pair)
