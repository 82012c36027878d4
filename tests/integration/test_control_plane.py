"""Real processes: the control plane under big forged frames (S19) and clock skew between
daemons (K40: measured, reported, and beyond the window named in the room's failure)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import KVPoll, Receiver, Sender
from kvd.errors import KvdError
from kvd.launch import LAUNCH_SECRET, DaemonProcess, start_daemon
from kvd.protocol import control, rpc
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import PdPair, free_port, health, start_pair, stop_pair
from tests.integration.test_security import FAST_HEARTBEAT, _flood, _misses, _while_flooding

KVD = [sys.executable, "-m", "kvd.cli.main"]


def kvd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVD_CLUSTER_SECRET": LAUNCH_SECRET}
    return subprocess.run([*KVD, *args], capture_output=True, text=True, timeout=60,
                          check=False, env=env)


def peer_rows(daemon: DaemonProcess) -> dict[str, dict]:
    out = kvd("peers", "--json", "-a", daemon.http_addr)
    assert out.returncode == 0, out.stderr
    return {r["endpoint"]: r for r in json.loads(out.stdout)}


@pytest.fixture(scope="module")
def s19_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    """A P/D pair whose decode heartbeats every 0.5 s: a loop stalled for a second shows."""
    pair = start_pair(tmp_path_factory.mktemp("s19"), d_opts=FAST_HEARTBEAT)
    transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, 1, [1], [1], chunk=1)
    assert wait_rooms(pair.d_engine.client, [1]) == [KVPoll.Success]
    yield pair
    stop_pair(pair)


def test_s19_big_forged_frames_from_several_connections_fail_no_room_and_miss_no_heartbeat(
        s19_pair: PdPair) -> None:
    """S19: forged frames just under the cap (the largest real message) from four
    connections, and 60 MiB ones over it from two more, flood P's control port → every
    room of the healthy decode succeeds, no heartbeat is missed, /health answers, and the
    frames are refused (counted; the oversized ones by ZMQ, unread)."""
    pair = s19_pair
    before, ep = _misses(pair.decode), pair.prefill.ready["control_endpoint"]
    dropped = health(pair.prefill)["counters"]["control_dropped"]
    under = _flood("zmq", ep, 6, "--size", str(control.max_frame() - 1024),
                   "--connections", "4")
    over = _flood("zmq", ep, 6, "--size", str(60 << 20), "--connections", "2")
    try:
        out = _while_flooding(pair, under, 3_000, pair.prefill.http_addr)
    finally:
        over.communicate(timeout=60)
    assert out.flood["frames_sent"] > 20, out.flood
    assert out.states == [KVPoll.Success] * len(out.rooms) and len(out.rooms) >= 3
    assert out.health_failures == []
    assert _misses(pair.decode) == before
    assert health(pair.prefill)["counters"]["control_dropped"] > dropped + 20


def test_k40_skew_is_measured_and_beyond_the_window_fails_the_room_fast(
        tmp_path: Path) -> None:
    """K40 on real processes, with the decode's wall clock offset by the test knob
    (``test_clock_offset``; no faketime needed). A bootstrap-only kvd with a wide window
    lets the decode resolve P; P's window is 30 s.

    * D 10 s ahead (within P's window): rooms succeed, and ``kvd peers`` on P shows D's
      clock about +10 s;
    * D 45 s ahead: P refuses D's registration as skewed and answers with a typed refusal
      -> D's room fails with kind ``peer`` and a reason naming the skew and the offset,
      long before its waiting timeout (300 s); P's peers show D as refused with +45 s.
    """
    boot = start_daemon("decode", tmp_path, serve_bootstrap=True, auth_max_skew=120.0)
    p = start_daemon("prefill", tmp_path, bootstrap_addr=boot.http_addr)
    near = start_daemon("decode", tmp_path, test_clock_offset=10.0)
    far = start_daemon("decode", tmp_path, test_clock_offset=45.0, waiting_timeout=300.0)
    engines = [EngineStandIn(d.socket, seed=s) for d, s in ((p, 1), (near, 2), (far, 3))]
    try:
        transfer_room(engines[0], engines[1], boot.http_addr, 40, [3], [4], chunk=1)
        assert wait_rooms(engines[1].client, [40], timeout=30) == [KVPoll.Success]
        assert engines[1].pages_equal(engines[0], [3], [4])  # byte for byte
        row = peer_rows(p)[near.ready["control_endpoint"]]
        assert 5.0 < row["clock_offset_s"] < 15.0
        shown = kvd("peers", "-a", p.http_addr)
        assert shown.returncode == 0 and re.search(r"\+(9|10)\.\d{3}s", shown.stdout), \
            shown.stdout

        receiver = Receiver(engines[2].client, 41, boot.http_addr)
        receiver.init([5], 5)
        sender = Sender(engines[0].client, 41)
        sender.init(1, 0)
        deadline = time.monotonic() + 60  # generous; the waiting timeout is 300 s
        while receiver.poll() != KVPoll.Failed and time.monotonic() < deadline:
            time.sleep(0.05)  # (not wait(): its pages stay held for the release bound)
        assert receiver.poll() == KVPoll.Failed
        kind, reason = receiver.failure()
        assert kind == "peer", reason
        assert re.search(r"clock skew: prefill rank \S+'s clock is 4[45]\.\ds behind", reason)
        row = peer_rows(p)[far.ready["control_endpoint"]]
        assert row["state"] == "refused" and 40.0 < row["clock_offset_s"] < 50.0
        counters = health(p)["counters"]
        assert counters["skewed"] >= 1 and counters["refusals_sent"] >= 1
        sender.abort("test over")
    finally:
        for e in engines:
            e.close()
        for d in (far, near, p, boot):
            d.stop()


def test_k39_decodes_that_come_and_go_leave_no_socket_on_the_prefill(tmp_path: Path) -> None:
    """K39: decodes come and go one after another (each serves a room, then is killed).
    Once each is forgotten (peer_ttl), the prefill holds no socket to it in any state --
    no CLOSE-WAIT transfer lanes (Mooncake's pool, which its binding cannot close, is
    off), no control socket redialling it: the prefill's TCP sockets are back to their
    baseline."""
    from kvd.netstat import connections, listeners

    def to_others(pid: int) -> list:
        """The process's TCP sockets whose other end is not the process itself (its own
        keep-alive to its bootstrap, its handshake front to Mooncake behind it)."""
        mine = connections(pid)
        own = {c.port for c in mine} | {x.port for x in listeners(pid)}
        return [c for c in mine if c.remote_port not in own]

    p = start_daemon("prefill", tmp_path, serve_bootstrap=True, peer_ttl=1.0)
    engine = EngineStandIn(p.socket, seed=1)
    try:
        pid = p.proc.pid
        baseline = len(to_others(pid))
        for i in range(5):
            d = start_daemon("decode", tmp_path)
            de = EngineStandIn(d.socket, seed=2)
            try:
                transfer_room(engine, de, p.http_addr, 390 + i, [i], [i], chunk=1)
                assert wait_rooms(de.client, [390 + i]) == [KVPoll.Success]
                assert de.pages_equal(engine, [i], [i])
            finally:
                de.close()
                d.kill(signal.SIGKILL)
                d.proc.wait(30)
            engine.client.call(rpc.Clear(room=390 + i))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (len(to_others(pid)) > baseline or
                                               peer_rows(p)):
            time.sleep(0.2)
        left = to_others(pid)
        assert len(left) <= baseline, left
        assert not any(c.state == "08" for c in left)  # no CLOSE-WAIT
        assert peer_rows(p) == {}  # every decode forgotten
    finally:
        engine.close()
        p.stop()


def _resources(pid: int) -> dict[str, int]:
    """What a process holds: open FDs, threads, RSS bytes (/proc)."""
    rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task")),
            "rss": rss_pages * os.sysconf("SC_PAGE_SIZE")}


#: ``KVD_SOAK_DECODES=200`` runs issue 19's full soak (about 10 minutes on 2 cores).
SOAK_DECODES = int(os.environ.get("KVD_SOAK_DECODES", "32"))
SOAK_AT_ONCE, SOAK_RANGES = 4, 16


@pytest.mark.integration
@pytest.mark.slow
def test_k39_soak_many_decodes_come_and_go_and_the_prefill_returns_to_baseline(
        tmp_path: Path) -> None:
    """K39 soak (issue 19): 32 decodes, 4 at a time, each serve a room (bytes checked) and
    are SIGKILLed. Once all are forgotten (peer_ttl), the prefill's resources are back
    to its baseline, taken after one warm-up decode came and went (Mooncake starts its
    worker threads and the first session lazily; those stay by design):

    * TCP sockets to other processes (kvd.netstat): <= baseline, none in CLOSE-WAIT;
    * open FDs and threads: <= baseline + 4 (a leak of one per decode would be +32);
    * RSS: <= baseline + 32 MiB (allocator slack, not a ratio: a per-decode leak of
      ~1 MiB would show).

    Issue 19 asks for 200 (``KVD_SOAK_DECODES=200`` runs them); 32 fit the suite's
    time. Two runs at 200 found the two failures reported with issue 19: a decode on a
    dead one's transfer session name written through the stale segment (since renewed),
    and, once, rooms that hung in Transferring from the 34th decode on (60 with a range
    per decode passed). Decodes
    share port ranges in turn, so session names may repeat (counted, printed).
    """
    from concurrent.futures import ThreadPoolExecutor

    from kvd.netstat import connections, listeners

    def to_others(pid: int) -> list:
        mine = connections(pid)
        own = {c.port for c in mine} | {x.port for x in listeners(pid)}
        return [c for c in mine if c.remote_port not in own]

    p = start_daemon("prefill", tmp_path, serve_bootstrap=True, peer_ttl=1.0,
                     log_level="WARNING")
    engine = EngineStandIn(p.socket, seed=1)
    pid = p.proc.pid

    sessions: list[str] = []

    def one(i: int) -> None:
        # SOAK_RANGES transfer port ranges of 8, taken in turn: a later decode may come
        # back on a dead one's transfer session name (with another data port), which
        # the prefill renews before writing to it (a range is never shared by decodes
        # alive at once, and its ports stay free for a dead one's TIME_WAIT)
        first = 20000 + 8 * (i % SOAK_RANGES)
        retry_until = time.monotonic() + 120  # a dead decode's ports sit in TIME_WAIT <= 60 s
        while True:
            try:
                d = start_daemon("decode", tmp_path, log_level="WARNING",
                                 transfer_port_range=f"{first}-{first + 7}")
                break
            except KvdError:  # every port of the range still taken: the decode comes later
                if time.monotonic() > retry_until:
                    raise
                time.sleep(2.0)
        sessions.append(d.ready["session_id"])
        try:
            de = EngineStandIn(d.socket, seed=2)
            try:
                room = 3900 + i
                send, recv = transfer_room(engine, de, p.http_addr, room, [i % 60], [i % 60],
                                           chunk=1)
                assert wait_rooms(de.client, [room], timeout=60) == [KVPoll.Success], \
                    (d.ready["control_endpoint"], recv.failure(), send.poll(), send.failure())
                assert de.pages_equal(engine, [i % 60], [i % 60])
                engine.client.call(rpc.Clear(room=room))
            finally:
                de.close()
        finally:
            d.kill(signal.SIGKILL)
            d.proc.wait(30)

    def settled(base_sockets: int) -> bool:
        return len(to_others(pid)) <= base_sockets and not peer_rows(p)

    try:
        one(0)  # warm-up
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and peer_rows(p):
            time.sleep(0.2)
        base_sockets, base = len(to_others(pid)), _resources(pid)
        with ThreadPoolExecutor(SOAK_AT_ONCE) as pool:
            list(pool.map(one, range(1, 1 + SOAK_DECODES)))
        during = _resources(pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not settled(base_sockets):
            time.sleep(0.2)
        left, after = to_others(pid), _resources(pid)
        print(f"K39 soak: baseline {base} sockets {base_sockets}; right after the "
              f"decodes {during}; settled {after} sockets {len(left)}; "
              f"{len(sessions) - len(set(sessions))} session names used again")
        assert len(left) <= base_sockets, left
        assert not any(c.state == "08" for c in left)  # no CLOSE-WAIT
        assert peer_rows(p) == {}  # every decode forgotten
        assert after["fds"] <= base["fds"] + 4, (base, after)
        assert after["threads"] <= base["threads"] + 4, (base, after)
        assert after["rss"] <= base["rss"] + (32 << 20), (base, after)
    finally:
        engine.close()
        p.stop()


def _three_ports() -> tuple[int, int]:
    """Three consecutive ports free on 127.0.0.1 below the ephemeral range (first, last)."""
    import random
    import socket

    for _ in range(200):
        first = random.randrange(20000, 32000)
        try:
            with socket.socket() as a, socket.socket() as b, socket.socket() as c:
                for s, port in ((a, first), (b, first + 1), (c, first + 2)):
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first, first + 2
    raise AssertionError("no three free consecutive ports in 20000-32000")


def _data_port(d: DaemonProcess, first: int, last: int) -> int:
    """The decode's Mooncake TCP data port: its listener in the transfer range that is not
    its handshake (session) port."""
    from kvd.netstat import listeners

    session_port = int(d.ready["session_id"].rsplit(":", 1)[1])
    found = {x.port for x in listeners(d.proc.pid)
             if first <= x.port <= last and x.port != session_port}
    assert len(found) == 1, found
    return found.pop()


@pytest.mark.integration
@pytest.mark.slow
def test_k39_a_decode_restarted_at_a_dead_decodes_session_name_is_written_byte_for_byte(
        tmp_path: Path) -> None:
    """K39's sibling (found by the soak): D serves a room, is SIGKILLed and comes back on
    the SAME control, HTTP and transfer handshake port -- the same transfer session name
    -- but another Mooncake data port (the dead one's is taken). Once P knows the new
    instance (its registration), P's transfer backend must not dial what it cached for
    the dead one: the new instance's room lands byte for byte."""
    import socket

    first, last = _three_ports()
    ports = {"zmq_port": free_port(), "http_port": free_port(),
             "transfer_port_range": f"{first}-{last}"}
    p = start_daemon("prefill", tmp_path, serve_bootstrap=True)
    pe = EngineStandIn(p.socket, seed=1)
    d = start_daemon("decode", tmp_path, **ports)
    de = EngineStandIn(d.socket, seed=2)
    try:
        _s, _r = transfer_room(pe, de, p.http_addr, 1, [1, 2], [3, 4], chunk=2)
        assert wait_rooms(de.client, [1], timeout=60) == [KVPoll.Success]
        assert de.pages_equal(pe, [1, 2], [3, 4])
        session, old_data = d.ready["session_id"], _data_port(d, first, last)
        # Mooncake picks ports in the range at random, and the dead one's handshake port
        # is refused to it while its relays' sockets sit in TIME_WAIT (up to 60 s)
        deadline = time.monotonic() + 150
        de.close()
        d.kill(signal.SIGKILL)
        d.proc.wait(30)
        while time.monotonic() < deadline:
            with socket.socket() as squat:  # the dead one's data port: taken
                squat.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                squat.bind(("127.0.0.1", old_data))
                squat.listen(1)
                try:
                    nd = start_daemon("decode", tmp_path, **ports)
                except KvdError:  # every port of the range still taken (TIME_WAIT): again
                    time.sleep(1.0)
                    continue
            if nd.ready["session_id"] == session:
                d = nd
                break
            nd.kill(signal.SIGKILL)  # another handshake port: not the case under test
            nd.proc.wait(30)
            time.sleep(1.0)
        de = EngineStandIn(d.socket, seed=3)
        assert d.ready["session_id"] == session  # the same transfer session name
        assert _data_port(d, first, last) != old_data
        for room in (2, 3):  # the first registers the new instance with P
            send, recv = transfer_room(pe, de, p.http_addr, room, [5, 6], [7, 8], chunk=2)
            assert wait_rooms(de.client, [room], timeout=60) == [KVPoll.Success], \
                (recv.failure(), send.failure())
            assert de.pages_equal(pe, [5, 6], [7, 8])
    finally:
        de.close()
        pe.close()
        d.stop()
        p.stop()
