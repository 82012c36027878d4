"""Operations against real daemons: the ``kvd`` CLI as a user runs it, REST status and
metrics, systemd notifications and JSON logs."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvd.bootstrap.guard import OPEN_PATHS
from kvd.client import KVPoll, Receiver, Sender
from kvd.launch import LAUNCH_SECRET, start_daemon
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import PdPair, push_frames, signed

pytestmark = pytest.mark.integration

_SCRIPT = Path(sys.executable).with_name("kvd")
KVD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvd.cli.main"]
ROOM_BYTES = 10 * 8 * 4096 + 64  # 10 pages x 8 buffers x item_len, plus one aux slot


def kvd(*args: str, timeout: float = 60,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``kvd`` command line with the launched daemons' cluster secret (``env``:
    added to this process's environment, after the secret)."""
    full = {**os.environ, "KVD_CLUSTER_SECRET": LAUNCH_SECRET, **(env or {})}
    return subprocess.run([*KVD, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=full)


def get(addr: str, path: str) -> httpx.Response:
    """GET, signed unless the path is open (``/v1/*`` and ``/docs`` need the secret)."""
    if path in OPEN_PATHS:
        return httpx.get(f"http://{addr}{path}", timeout=5)
    return signed("GET", f"http://{addr}{path}")


def scrape(addr: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = get(addr, "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(resp.text) for s in fam.samples}


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_status_rooms_peers_against_running_daemons(pd_pair: PdPair, room_ids) -> None:
    p, d = pd_pair.p_engine, pd_pair.d_engine
    done = next(room_ids)
    transfer_room(p, d, pd_pair.bootstrap, done, np.arange(10), np.arange(20, 30), chunk=5)
    assert wait_rooms(d.client, [done]) == [KVPoll.Success]
    waiting = next(room_ids)
    recv = Receiver(d.client, waiting, pd_pair.bootstrap)  # no sender: stays in flight
    recv.init(np.arange(40, 44), 1)
    try:
        status = kvd("status", "-a", pd_pair.prefill.http_addr)
        assert status.returncode == 0, status.stderr
        out = status.stdout
        assert "kvd prefill" in out and "ready" in out
        assert pd_pair.prefill.ready["instance_id"] in out
        assert pd_pair.decode.ready["control_endpoint"] in out  # the decode peer
        assert "rooms:" in out and "Success" in out and "rooms/s" in out

        rooms = kvd("rooms", "--json", "-a", pd_pair.decode.http_addr)
        assert rooms.returncode == 0, rooms.stderr
        row = next(r for r in json.loads(rooms.stdout) if r["room"] == waiting)
        assert row["state"] in ("Bootstrapping", "WaitingForInput")
        assert row["peer"] == pd_pair.prefill.ready["control_endpoint"]
        assert row["age_s"] >= 0
        assert done not in [r["room"] for r in json.loads(rooms.stdout)]  # finished

        peers = kvd("peers", "--json", "-a", pd_pair.decode.http_addr)
        (peer,) = [x for x in json.loads(peers.stdout)
                   if x["endpoint"] == pd_pair.prefill.ready["control_endpoint"]]
        assert peer["kind"] == "prefill" and peer["bootstrap"] == pd_pair.bootstrap
        # "missed N": a heartbeat that timed out on a busy machine is shown as such
        assert re.fullmatch(r"unknown|ok|missed \d+", peer["heartbeat"]), peer["heartbeat"]
        assert peer["last_message"] is not None  # the Success status of `done`
        assert peer["heartbeat"] == "unknown" or peer["last_heartbeat"] is not None
        shown = kvd("peers", "-a", pd_pair.decode.http_addr)
        assert shown.returncode == 0 and "last heard" in shown.stdout and " ago" in shown.stdout
        assert peer["instance_id"] == pd_pair.prefill.ready["instance_id"]
    finally:
        recv.abort("test over")
        wait_rooms(d.client, [waiting])


def test_metrics_move_after_rooms(pd_pair: PdPair, room_ids) -> None:
    p, d = pd_pair.p_engine, pd_pair.d_engine
    p_addr, d_addr = pd_pair.prefill.http_addr, pd_pair.decode.http_addr
    decode_peer = "127.0.0.1"  # the decode's host: its ZMQ port changes with every restart
    p0, d0 = scrape(p_addr), scrape(d_addr)
    rooms = [next(room_ids) for _ in range(3)]
    for i, room in enumerate(rooms):
        transfer_room(p, d, pd_pair.bootstrap, room, np.arange(10) + 10 * i,
                      np.arange(100, 110) + 10 * i, chunk=4)
    assert wait_rooms(d.client, rooms) == [KVPoll.Success] * 3
    assert wait_rooms(p.client, rooms) == [KVPoll.Success] * 3
    bad = next(room_ids)
    recv = Receiver(d.client, bad, pd_pair.bootstrap)
    recv.init(np.arange(200, 204), 200)
    Sender(p.client, bad).init(4, 0)
    recv.abort("metrics test")
    assert wait_rooms(p.client, [bad]) == [KVPoll.Failed]
    assert wait_rooms(d.client, [bad]) == [KVPoll.Failed]
    p1, d1 = scrape(p_addr), scrape(d_addr)

    assert delta(p1, p0, "kvd_rooms_finished_total", status="success") == 3
    assert delta(p1, p0, "kvd_rooms_finished_total", status="failed") == 1
    assert delta(p1, p0, "kvd_room_failures_total", reason="aborted") == 1
    assert delta(p1, p0, "kvd_transfers_total", peer=decode_peer) == 9  # 3 chunks per room
    assert delta(p1, p0, "kvd_transfer_bytes_total", peer=decode_peer) == 3 * ROOM_BYTES
    for hist in ("kvd_room_latency_seconds", "kvd_room_transfer_seconds", "kvd_room_bytes"):
        assert delta(p1, p0, f"{hist}_count") == 3, hist
        assert delta(p1, p0, f"{hist}_bucket", le="+Inf") == 3, hist
    assert delta(p1, p0, "kvd_room_bytes_sum") == 3 * ROOM_BYTES
    assert delta(p1, p0, "kvd_room_transfer_seconds_sum") > 0

    assert delta(d1, d0, "kvd_rooms_finished_total", status="success") == 3
    assert delta(d1, d0, "kvd_room_failures_total", reason="aborted") == 1
    assert delta(d1, d0, "kvd_room_latency_seconds_count") == 3
    assert delta(d1, d0, "kvd_room_transfer_seconds_count") == 0  # decode writes nothing

    for states in (p1, d1):
        assert {dict(k[1])["state"] for k in states if k[0] == "kvd_rooms"} == \
            {"failed", "bootstrapping", "waiting_for_input", "transferring", "success"}
        assert not [k for k in states if k[0].endswith("_created")]
        assert ("kvd_auth_failures_total", ()) in states
        assert states[("kvd_ready", ())] == 1
        assert ("kvd_executor_busy", ()) in states and ("kvd_transfer_queue_depth", ()) in states

    status = get(p_addr, "/v1/status").json()
    failure = next(f for f in status["recent_failures"] if f["room"] == bad)
    assert "metrics test" in failure["reason"] and failure["category"] == "aborted"
    assert status["totals"]["rooms_succeeded"] >= 3
    # the prefill's liveness view of its decode: when it last heard from it, its last error
    (decode,) = [x for x in status["peers"]
                 if x["endpoint"] == pd_pair.decode.ready["control_endpoint"]]
    assert decode["last_message"] is not None and time.time() - decode["last_message"] < 60
    assert "metrics test" in decode["last_error"] and decode["last_error_time"] is not None


def test_auth_failures_are_counted(pd_pair: PdPair) -> None:
    addr = pd_pair.prefill.http_addr
    before = scrape(addr)
    unsigned = httpx.get(f"http://{addr}/route?engine_rank=-1&target_dp_group=-1"
                         f"&target_pp_rank=-1", timeout=5)
    assert unsigned.status_code == 401
    assert delta(scrape(addr), before, "kvd_auth_failures_total") == 1
    # an unsealed control frame is counted by the inbound pipeline, into the same total
    push_frames(pd_pair.prefill.ready["control_endpoint"], [b"not a sealed frame"])
    deadline = time.monotonic() + 10
    while delta(scrape(addr), before, "kvd_auth_failures_total") < 2 and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert delta(scrape(addr), before, "kvd_auth_failures_total") == 2


def test_ready_health_and_openapi(pd_pair: PdPair) -> None:
    for daemon in (pd_pair.prefill, pd_pair.decode):
        ready = get(daemon.http_addr, "/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["transfer_engine"] and ready.json()["engine_registered"]
        assert ready.json()["draining"] is False
        assert get(daemon.http_addr, "/health").json()["status"] == "ok"
    assert get(pd_pair.prefill.http_addr, "/ready").json()["bootstrap_registered"] is True
    assert get(pd_pair.decode.http_addr, "/ready").json()["bootstrap_registered"] is None
    spec = get(pd_pair.prefill.http_addr, "/openapi.json").json()
    assert {"/health", "/ready", "/metrics", "/v1/status", "/v1/rooms", "/route"} <= \
        set(spec["paths"])
    assert get(pd_pair.prefill.http_addr, "/docs").status_code == 404  # http_docs = false


def test_config_show_and_doctor_as_a_user(pd_pair: PdPair, tmp_path: Path) -> None:
    shown = kvd("config", "show", "--json", "-c", str(pd_pair.prefill.config))
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)
    assert rows["serve_bootstrap"] == {"value": True, "source": "file",
                                       "origin": str(pd_pair.prefill.config)}
    assert rows["zmq_port"]["source"] == "default"

    busy = int(pd_pair.prefill.ready["http_port"])
    cfg = tmp_path / "doctor.toml"
    cfg.write_text(f'role = "decode"\nhttp_port = {busy}\n'
                   f'engine_socket = "{tmp_path / "run" / "kvd.sock"}"\n')
    doc = kvd("doctor", "--json", "-c", str(cfg))
    checks = {c["name"]: c for c in json.loads(doc.stdout)}
    assert doc.returncode == 1
    assert checks["http port"]["status"] == "fail" and "in use" in checks["http port"]["detail"]
    assert checks["transfer engine"]["status"] == "ok", checks["transfer engine"]
    assert checks["engine socket"]["status"] == "ok"
    text = kvd("doctor", "-c", str(cfg))
    assert text.returncode == 1 and "fix:" in text.stdout and "in use" in text.stdout

    bad = tmp_path / "bad.toml"
    bad.write_text('role = "decode"\nhttp_port = -1\nmax_batch_entries = 5000\n')
    serve = kvd("serve", "-c", str(bad))
    assert serve.returncode == 2
    assert "http_port" in serve.stderr and "max_batch_entries" in serve.stderr
    assert "Traceback" not in serve.stderr


def _recv_all(sock: socket.socket, until: float) -> list[bytes]:
    out = []
    sock.settimeout(0.05)
    while time.monotonic() < until:
        try:
            out.append(sock.recv(4096))
        except TimeoutError:
            continue
    return out


def test_systemd_notify_watchdog_json_logs_and_not_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notify_path = tmp_path / "notify.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(notify_path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify_path))
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # ping every 0.1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    daemon = start_daemon("decode", tmp_path, log_format="json", bootstrap_retry_budget=0.3)
    engine = None
    try:
        got = _recv_all(rx, time.monotonic() + 0.6)
        assert got[0].startswith(b"READY=1\n") and b"STATUS=" in got[0]
        assert got.count(b"WATCHDOG=1") >= 3

        engine = EngineStandIn(daemon.socket, num_pages=16, num_layers=1)
        dead = f"127.0.0.1:{free_port()}"
        recv = Receiver(engine.client, 4242, dead)
        assert recv.wait(10) == KVPoll.Failed  # the bootstrap server does not exist
    finally:
        if engine is not None:
            engine.close()
        assert daemon.stop() == 0
    assert b"STOPPING=1" in _recv_all(rx, time.monotonic() + 0.3)
    rx.close()

    lines = [json.loads(ln) for ln in daemon.log.read_text().splitlines() if ln.startswith("{")]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(x) for x in lines)
    room_lines = [x for x in lines if x.get("room") == 4242]
    assert room_lines and all(x["peer"] == dead for x in room_lines), room_lines

    gone = kvd("status", "-a", daemon.http_addr)
    assert gone.returncode == 1 and gone.stdout == ""
    assert gone.stderr.count("\n") == 1 and "no kvd daemon answering" in gone.stderr


def test_a_second_serve_on_a_live_socket_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    first = start_daemon("decode", tmp_path)
    engine = None
    try:
        second = kvd("serve", "--role", "decode", "--engine-socket", first.socket,
                     env={"KVD_CLUSTER_SECRET": LAUNCH_SECRET})
        assert second.returncode == 2
        assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
        assert f"locked by pid {first.proc.pid}" in second.stderr
        engine = EngineStandIn(first.socket, num_pages=4, num_layers=1)  # still served
        assert Path(first.socket).exists()
    finally:
        if engine is not None:
            engine.close()
        assert first.stop() == 0
    assert not Path(first.socket).exists()  # the first one removes its own socket


_ACTIVATE = ("import os, sys\n"
             "os.dup2(int(sys.argv[1]), 3)  # where systemd puts the first passed socket\n"
             "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1',\n"
             "                  LISTEN_FDNAMES='engine')\n"
             "os.execv(sys.argv[2], sys.argv[2:])  # same pid: LISTEN_PID stays right\n")


def test_systemd_socket_activation(tmp_path: Path) -> None:
    """kvd serves the socket it inherits (as from kvd@.socket), never unlinks it, and an
    engine that connects while kvd restarts is served by the next kvd (the backlog)."""
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX)  # systemd's copy of the socket
    listener.bind(str(path))
    listener.listen()
    fd = listener.fileno()
    opts = {"engine_socket": str(path), "prefix": [sys.executable, "-c", _ACTIVATE, str(fd)],
            "pass_fds": (fd,)}
    daemon = start_daemon("decode", tmp_path, **opts)
    engine = None
    try:
        engine = EngineStandIn(str(path), num_pages=4, num_layers=1)
        assert get(daemon.http_addr, "/ready").status_code == 200
        engine.close()
        engine = None
        assert daemon.stop() == 0
        assert path.exists()  # systemd's socket: kvd leaves it
        waiting = socket.socket(socket.AF_UNIX)
        waiting.connect(str(path))  # accepted into the backlog while no kvd runs
        waiting.close()
        daemon = start_daemon("decode", tmp_path, **opts)
        engine = EngineStandIn(str(path), num_pages=4, num_layers=1)
        assert get(daemon.http_addr, "/ready").status_code == 200
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()
        listener.close()


def test_daemons_ignore_proxy_settings(tmp_path: Path, room_ids) -> None:
    """A dead proxy in the daemons' environment: bootstrap lookups and heartbeats (httpx)
    still go straight to the peer."""
    from tests.conftest import start_pair, stop_pair

    dead = f"http://127.0.0.1:{free_port()}"
    env = {v: dead for v in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY",
                             "all_proxy")}
    env |= {"NO_PROXY": "", "no_proxy": ""}
    pair = start_pair(tmp_path, p_opts={"env": env},
                      d_opts={"env": env, "heartbeat_interval": 0.2})
    try:
        room = next(room_ids)
        transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, room, np.arange(4),
                      np.arange(4), chunk=2)
        assert wait_rooms(pair.d_engine.client, [room]) == [KVPoll.Success]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # heartbeats too (they also use httpx)
            peers = get(pair.decode.http_addr, "/v1/status").json()["peers"]
            if any(p["heartbeat"] == "ok" for p in peers):
                break
            time.sleep(0.1)
        assert any(p["heartbeat"] == "ok" for p in peers), peers
    finally:
        stop_pair(pair)


def test_readme_engine_example_runs(tmp_path: Path) -> None:
    """examples/engine_minimal.py (the README's engine snippet, kept identical by
    tests/unit/test_readme.py) against a prefill and a decode daemon."""
    prefill = start_daemon("prefill", tmp_path, serve_bootstrap=True)
    decode = start_daemon("decode", tmp_path)
    try:
        example = Path(__file__).resolve().parents[2] / "examples" / "engine_minimal.py"
        run = subprocess.run([sys.executable, str(example), prefill.socket, decode.socket,
                              prefill.http_addr], capture_output=True, text=True, timeout=120,
                             check=False)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "room 42: 4 pages x 4 buffers moved, equal" in run.stdout
    finally:
        prefill.stop()
        decode.stop()
