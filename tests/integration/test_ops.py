"""Operations against real daemons: the ``kvd`` CLI as a user runs it, REST status and
metrics, systemd notifications and JSON logs."""

from __future__ import annotations

import json
import os
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
from tests.conftest import PdPair, signed

pytestmark = pytest.mark.integration

_SCRIPT = Path(sys.executable).with_name("kvd")
KVD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvd.cli.main"]
ROOM_BYTES = 10 * 8 * 4096 + 64  # 10 pages x 8 buffers x item_len, plus one aux slot


def kvd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the ``kvd`` command line with the launched daemons' cluster secret."""
    env = {**os.environ, "KVD_CLUSTER_SECRET": LAUNCH_SECRET}
    return subprocess.run([*KVD, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env)


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
        assert peer["heartbeat"] in ("unknown", "ok")
        assert peer["instance_id"] == pd_pair.prefill.ready["instance_id"]
    finally:
        recv.abort("test over")
        wait_rooms(d.client, [waiting])


def test_metrics_move_after_rooms(pd_pair: PdPair, room_ids) -> None:
    p, d = pd_pair.p_engine, pd_pair.d_engine
    p_addr, d_addr = pd_pair.prefill.http_addr, pd_pair.decode.http_addr
    decode_peer = pd_pair.decode.ready["control_endpoint"]
    p0, d0 = scrape(p_addr), scrape(d_addr)
    rooms = [next(room_ids) for _ in range(3)]
    for i, room in enumerate(rooms):
        transfer_room(p, d, pd_pair.bootstrap, room, np.arange(10) + 10 * i,
                      np.arange(100, 110) + 10 * i, chunk=4)
    assert wait_rooms(d.client, rooms) == [KVPoll.Success] * 3
    assert wait_rooms(p.client, rooms) == [KVPoll.Success] * 3
    bad = next(room_ids)
    recv = Receiver(d.client, bad, pd_pair.bootstrap)
    recv.init(np.arange(200, 204), 0)
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
            {s.name for s in KVPoll}
        assert states[("kvd_ready", ())] == 1
        assert ("kvd_executor_busy", ()) in states and ("kvd_transfer_queue_depth", ()) in states

    status = get(p_addr, "/v1/status").json()
    failure = next(f for f in status["recent_failures"] if f["room"] == bad)
    assert "metrics test" in failure["reason"] and failure["category"] == "aborted"
    assert status["totals"]["rooms_succeeded"] >= 3


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
    assert get(pd_pair.prefill.http_addr, "/docs").status_code == 200


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
