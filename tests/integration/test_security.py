"""Security with real daemons: authenticated control plane and bootstrap, fuzzing, local
engine socket protection."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender
from kvd.errors import KvdError
from kvd.launch import LAUNCH_SECRET, DaemonProcess, start_daemon
from kvd.protocol import control, rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from kvd.rooms.receiver import first_incarnation
from kvd.security import Authenticator
from tests.conftest import (
    PdPair,
    free_port,
    health,
    push_frames,
    signed,
    start_pair,
    stop_pair,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _auth_failures(daemon) -> int:  # type: ignore[no-untyped-def]
    return int(health(daemon)["counters"]["auth_failures"])


def test_forged_and_replayed_control_messages_are_rejected(pd_pair: PdPair, room_ids) -> None:
    d = pd_pair.d_engine
    room = next(room_ids)
    r = Receiver(d.client, room, pd_pair.bootstrap)
    r.init([1], 1)
    time.sleep(0.3)
    prefill_ep = pd_pair.prefill.ready["control_endpoint"]
    status = control.RoomStatus(room=room, inc=1, status=int(KVPoll.Success), kind="",
                                reason="", endpoint=prefill_ep, instance_id="forger")
    before = _auth_failures(pd_pair.decode)
    wrong = Authenticator(b"not-the-cluster-secret-at-all")
    d_id = pd_pair.decode.ready["instance_id"]
    push_frames(pd_pair.decode.ready["control_endpoint"],  # unsealed, forged
                [control.encode(status), wrong.seal(control.encode(status), d_id)])
    time.sleep(0.5)
    assert r.poll() == KVPoll.WaitingForInput  # neither forged Success was believed
    assert _auth_failures(pd_pair.decode) == before + 2
    # A holder of the secret who is not the room's prefill instance cannot end it (S11):
    # the status names another instance, so it is dropped (and counted), and its replay
    # is refused by the authentication layer.
    good = Authenticator(LAUNCH_SECRET.encode())
    failed = control.RoomStatus(room=room, inc=1, status=int(KVPoll.Failed), kind="aborted",
                                reason="abort from a holder of the secret",
                                endpoint=prefill_ep, instance_id="x")
    sealed = good.seal(control.encode(failed), d_id)
    push_frames(pd_pair.decode.ready["control_endpoint"], [sealed, sealed])  # 2nd: a replay
    time.sleep(0.5)
    assert r.poll() == KVPoll.WaitingForInput
    assert _auth_failures(pd_pair.decode) == before + 3
    r.abort()


def test_forged_registration_is_rejected_and_signed_one_accepted(pd_pair: PdPair) -> None:
    url = f"http://{pd_pair.bootstrap}/route"
    body = {"role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0, "rank_ip": "10.9.9.9",
            "rank_port": 1234}
    assert httpx.put(url, json=body, timeout=5).status_code == 401
    forged = Authenticator(b"not-the-cluster-secret-at-all")
    req = httpx.Request("PUT", url, json=body)
    req.headers.update(forged.http_header("PUT", req.url.path, "", req.content,
                                          pd_pair.prefill.ready["instance_id"]))
    with httpx.Client() as c:
        assert c.send(req).status_code == 401
    params = {"engine_rank": 0, "target_dp_group": 0, "target_pp_rank": 0}
    info = signed("GET", url, params=params).json()
    assert info["rank_ip"] != "10.9.9.9"  # the rank was not redirected
    # A correct registration with the secret is accepted (idempotent re-registration).
    same = {"role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0,
            "rank_ip": info["rank_ip"], "rank_port": info["rank_port"],
            "instance_id": info["instance_id"]}
    assert signed("PUT", url, json=same).status_code == 200


def test_no_secret_refuses_to_start_unless_insecure(tmp_path: Path) -> None:
    env = {"KVD_CLUSTER_SECRET": ""}
    with pytest.raises(KvdError, match="no cluster secret"):
        start_daemon("decode", tmp_path, env=env)
    daemon = start_daemon("decode", tmp_path, env=env, insecure=True)
    try:
        assert health(daemon)["status"] == "ok"
    finally:
        daemon.stop()
    assert "INSECURE" in daemon.log.read_text()


def _mutations(rng: random.Random, seeds: list[bytes], n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(0, 200)))
        else:
            b = bytearray(rng.choice(seeds))
            for _ in range(rng.randrange(1, 6)):
                if b and kind == 1:
                    b[rng.randrange(len(b))] = rng.randrange(256)
                elif kind == 2:
                    b = b[:rng.randrange(len(b) + 1)]
                else:
                    b += rng.randbytes(rng.randrange(1, 16))
            out.append(bytes(b))
    return out


def _seed_frames(pd_pair: PdPair) -> list[bytes]:
    ep = pd_pair.decode.ready["control_endpoint"]
    me = pd_pair.decode.ready["instance_id"]
    args = pd_pair.d_engine.registration
    wire = control.KVArgsWire("127.0.0.1:1", [1], [64], [64], [], [], [], 1, 1, 1, 1, 1)
    # A sealed registration is a secret holder's word: one that survived fuzzing under the
    # real decode's endpoint would replace its registration (who may claim an endpoint is
    # case S11), so the seed registers another endpoint.
    msgs = [control.RegisterRank(me, "tcp://127.0.0.1:9", 0, 1, wire),
            control.RoomPages(room=7, inc=1, endpoint=ep, instance_id=me,
                              dst_pages=pack_indices([1, 2]), aux_index=0, write_within=5.0),
            control.RoomStatus(room=7, inc=1, status=4, kind="", reason="", endpoint=ep,
                               instance_id=me),
            control.RoomAbort(room=7, inc=1, kind="aborted", reason="r", endpoint=ep,
                              instance_id=me)]
    rpcs = [rpc.Request(1, c) for c in (rpc.Poll([1]), rpc.SenderCreate(5), args,
                                        rpc.ReceiverInit(5, pack_indices([1]), 0))]
    return [control.encode(m) for m in msgs] + [rpc.encode(r)[4:] for r in rpcs]


def test_fuzzing_a_live_daemon_leaves_it_healthy_and_memory_untouched(pd_pair: PdPair,
                                                                      room_ids) -> None:
    rng = random.Random(1234)
    p, d = pd_pair.p_engine, pd_pair.d_engine
    before = [b.copy() for b in d.kv]
    seeds = _seed_frames(pd_pair)
    auth = Authenticator(LAUNCH_SECRET.encode())
    frames = _mutations(rng, seeds, 12_000)
    sealable = _mutations(rng, seeds, 2_000)
    for daemon in (pd_pair.prefill, pd_pair.decode):
        # Sealed for their recipient so that they reach the codec too.
        sealed = [auth.seal(f, daemon.ready["instance_id"]) for f in sealable]
        push_frames(daemon.ready["control_endpoint"], frames[:6000])
        # Another connection: the first one is in the penalty box by now (case S02).
        push_frames(daemon.ready["control_endpoint"], sealed)
    # Engine sockets: length-prefixed junk on fresh connections (a bad length closes one).
    for daemon in (pd_pair.prefill, pd_pair.decode):
        for i in range(0, 4000, 50):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2)
                s.connect(daemon.socket)
                for f in frames[6000 + i:6000 + i + 50]:
                    s.sendall(rpc.LENGTH.pack(len(f)) + f)
                time.sleep(0.002)
    # HTTP: random methods, paths, queries and bodies.
    with httpx.Client(timeout=5) as c:
        for i in range(300):
            path = rng.choice(["/route", "/health", "/ready", "/v1/status", "/x", "/route/"])
            q = {rng.choice(["engine_rank", "target_dp_group", "target_pp_rank", "z"]):
                 rng.choice(["-1", "0", "abc", "9" * 30, ""]) for _ in range(3)}
            body = rng.choice([b"", b"{", b'{"role": 1}', rng.randbytes(40)])
            resp = c.request(rng.choice(["GET", "PUT", "DELETE", "POST"]),
                             f"http://{pd_pair.bootstrap}{path}", params=q, content=body)
            assert resp.status_code < 500, (path, q, body, resp.text)
            if i % 3 == 0:
                resp = signed(rng.choice(["GET", "PUT"]), f"http://{pd_pair.bootstrap}/route",
                              params=q, content=body)
                assert resp.status_code < 500, (q, body, resp.text)
    time.sleep(1.0)
    for daemon in (pd_pair.prefill, pd_pair.decode):
        assert daemon.proc.poll() is None
        h = health(daemon)
        assert h["status"] == "ok"
        assert h["counters"]["control_dropped"] > 1000
    room = next(room_ids)
    src, dst = np.array([3, 4, 5]), np.array([200, 201, 202])
    _, recv = transfer_room(p, d, pd_pair.bootstrap, room, src, dst, chunk=2)
    assert wait_rooms(d.client, [room]) == [KVPoll.Success], recv.failure_reason()
    assert d.pages_equal(p, src, dst)
    outside = np.setdiff1d(np.arange(d.num_pages), dst)
    assert all(np.array_equal(a[outside], b[outside]) for a, b in zip(d.kv, before,
                                                                      strict=True))


def _make_user(name: str) -> int:
    if shutil.which("useradd") is None or os.geteuid() != 0:
        pytest.skip("needs root and useradd to create a second local user")
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], capture_output=True)
    import pwd

    return pwd.getpwnam(name).pw_uid


_PROBE = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(3)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect-refused", e.errno); sys.exit(0)
frame = b"KVD\\x01\\x82\\xa2id\\x01\\xa4call\\x81\\xa4type\\xa4info"
try:
    s.sendall(struct.pack(">I", len(frame)) + frame)
    data = s.recv(4)
    print("answered" if data else "closed")
except OSError as e:
    print("closed", e.errno)
"""


def test_second_local_user_cannot_use_the_engine_socket() -> None:
    uid = _make_user("kvdfuzz")
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python3 that another user can run")
    work = Path(tempfile.mkdtemp(prefix="kvd-sec-", dir="/tmp"))
    work.chmod(0o755)  # the other user may reach the folder, not the socket
    daemon = start_daemon("decode", work)
    try:
        sock = daemon.socket
        assert os.stat(sock).st_mode & 0o777 == 0o600
        probe = work / "probe.py"
        probe.write_text(_PROBE)
        probe.chmod(0o644)

        def run_as_other() -> str:
            out = subprocess.run([python, str(probe), sock], capture_output=True, text=True,
                                 user=uid, timeout=20, cwd="/")
            return out.stdout.strip() or out.stderr.strip()

        assert run_as_other().startswith("connect-refused")  # mode 0600 stops it
        os.chmod(sock, 0o666)  # even with a wrong file mode, peer credentials stop it
        assert run_as_other().startswith("closed")
        assert "refused connection from" in daemon.log.read_text()
        assert health(daemon)["status"] == "ok"
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


# ---- round two: one process must not stall a daemon, captured messages are useless ----------

ROOT = Path(__file__).resolve().parents[2]
FLOODS = ROOT / "benchmarks" / "floods.py"
FAST_HEARTBEAT = {"heartbeat_interval": 0.5, "heartbeat_max_failures": 2}


def _flood(kind: str, target: str, seconds: float, *extra: str) -> subprocess.Popen[str]:
    """One unauthenticated process flooding ``target`` (benchmarks/floods.py)."""
    return subprocess.Popen([sys.executable, str(FLOODS), kind, target, "--seconds",
                             str(seconds), *extra], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)


@dataclass
class Outcomes:
    """What a healthy peer saw while a flood ran: every value could fail."""

    rooms: list[int] = field(default_factory=list)
    states: list[KVPoll | int] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    flood: dict = field(default_factory=dict)


def _while_flooding(pair: PdPair, proc: subprocess.Popen[str], first_room: int,
                    p_health: str, fresh_connections: bool = False) -> Outcomes:
    """Rooms through the pair and /health probes of ``p_health`` until the flood ends
    (each probe on a new connection with ``fresh_connections``, as a new peer would).
    Probes get a generous timeout: the outcome checked is that they are answered."""
    out, room = Outcomes(), first_room
    with httpx.Client(timeout=10) as kept:
        while proc.poll() is None:
            room += 1
            transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, room, [room % 64],
                          [room % 64], chunk=1)
            out.rooms.append(room)
            out.states += wait_rooms(pair.d_engine.client, [room], timeout=30)
            try:
                url = f"http://{p_health}/health"
                resp = httpx.get(url, timeout=10) if fresh_connections else kept.get(url)
                if resp.status_code != 200:
                    out.health_failures.append(str(resp.status_code))
            except httpx.HTTPError as exc:
                out.health_failures.append(type(exc).__name__)
            time.sleep(0.05)
    out.flood = json.loads(proc.communicate()[0])
    return out


@pytest.fixture(scope="module")
def hb_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    """A P/D pair whose decode heartbeats every 0.5 s: a loop stalled for a second shows."""
    pair = start_pair(tmp_path_factory.mktemp("hb"), d_opts=FAST_HEARTBEAT)
    transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, 1, [1], [1], chunk=1)
    assert wait_rooms(pair.d_engine.client, [1]) == [KVPoll.Success]
    yield pair
    stop_pair(pair)


def _misses(daemon: DaemonProcess) -> int:
    return int(health(daemon)["counters"]["heartbeat_misses"])


def test_s02_control_flood_keeps_heartbeats_rooms_and_health(hb_pair: PdPair) -> None:
    """S02: one process sends tiny frames to P's control port as fast as it can → every
    room of the healthy decode succeeds, no heartbeat is missed, /health answers, the
    engine RPC answers, and the flood is dropped (counted)."""
    pair, before = hb_pair, _misses(hb_pair.decode)
    proc = _flood("zmq", pair.prefill.ready["control_endpoint"], 6)
    out = _while_flooding(pair, proc, 2_000, pair.prefill.http_addr)
    assert out.flood["frames_sent"] > 10_000
    assert out.states == [KVPoll.Success] * len(out.rooms) and len(out.rooms) >= 5
    assert out.health_failures == []
    assert _misses(pair.decode) == before
    assert pair.p_engine.client.call(rpc.Info())["status"] == "ok"
    counters = health(pair.prefill)["counters"]
    assert counters["control_dropped"] > 10_000 and counters["control_penalized"] > 0


def test_s03_huge_unauthenticated_bodies_are_refused_unread(hb_pair: PdPair) -> None:
    """S03: PUT /route declaring 250 MB, streamed by one process again and again → the
    server answers from the headers and never takes the body (a few MB of socket buffers
    at most); rooms, heartbeats and /health are unaffected."""
    pair, before = hb_pair, _misses(hb_pair.decode)
    proc = _flood("body", pair.bootstrap, 4, "--mib", "250")
    out = _while_flooding(pair, proc, 3_000, pair.prefill.http_addr)
    assert out.flood["attempts"] >= 2
    assert out.flood["max_body_bytes_sent"] < 64 << 20, out.flood
    assert out.states == [KVPoll.Success] * len(out.rooms) and out.health_failures == []
    assert _misses(pair.decode) == before
    # With the secret too: a body over the route's cap is refused before it is read.
    url = f"http://{pair.bootstrap}/route"
    big = {"role": "Prefill", "rank_ip": "127.0.0.1", "rank_port": 1, "pad": "x" * (1 << 20)}
    resp = signed("PUT", url, json=big)
    assert resp.status_code == 413, resp.text


def test_s04_idle_connection_flood_keeps_probes_and_new_decodes(tmp_path: Path) -> None:
    """S04: one process holds thousands of half-sent requests open against P, whose file
    descriptors are limited to 1024 → the decode's heartbeats, its rooms, /health, and a
    decode that starts during the flood and bootstraps from P all keep working."""
    pair = start_pair(tmp_path, p_opts={"prefix": ["prlimit", "--nofile=1024:1024"]},
                      d_opts=FAST_HEARTBEAT)
    extra: list[DaemonProcess] = []
    try:
        transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, 1, [1], [1], chunk=1)
        assert wait_rooms(pair.d_engine.client, [1]) == [KVPoll.Success]
        before = _misses(pair.decode)
        # 20 s: a decode daemon starts in 2-5 s on a loaded host, and at least 3 rooms must
        # follow it while the flood still runs
        proc = _flood("idle", pair.bootstrap, 20, "--connections", "3000")
        time.sleep(2.0)  # the flood is at full strength
        d2 = start_daemon("decode", tmp_path, bootstrap_retry_budget=5.0)
        extra.append(d2)
        d2_engine = EngineStandIn(d2.socket, seed=3)
        try:
            transfer_room(pair.p_engine, d2_engine, pair.bootstrap, 50, [5], [6], chunk=1)
            assert wait_rooms(d2_engine.client, [50], timeout=30) == [KVPoll.Success], \
                "the new decode could not bootstrap from P"
        finally:
            d2_engine.close()
        assert proc.poll() is None, "the flood ended before the new decode was checked"
        out = _while_flooding(pair, proc, 4_000, pair.prefill.http_addr,
                              fresh_connections=True)
        assert out.flood["opened"] > 1024, out.flood  # more than P could have held
        assert len(out.rooms) >= 3, "the flood ended before the checks ran"
        assert out.states == [KVPoll.Success] * len(out.rooms)
        assert out.health_failures == []
        assert _misses(pair.decode) == before
    finally:
        for d in extra:
            d.stop()
        stop_pair(pair)


def test_s09_captured_request_is_refused_by_another_bootstrap(pd_pair: PdPair,
                                                              tmp_path: Path) -> None:
    """S09: P's registration, signed for bootstrap A, replayed to bootstrap B (same secret)
    → 401, and B's decodes are not redirected."""
    b = start_daemon("prefill", tmp_path, serve_bootstrap=True)
    b_engine = EngineStandIn(b.socket, seed=4)
    try:
        a_url, b_url = f"http://{pd_pair.bootstrap}/route", f"http://{b.http_addr}/route"
        params = {"engine_rank": 0, "target_dp_group": 0, "target_pp_rank": 0}
        a_rank = signed("GET", a_url, params=params).json()
        b_rank = signed("GET", b_url, params=params).json()
        body = {"role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0,
                "rank_ip": a_rank["rank_ip"], "rank_port": a_rank["rank_port"],
                "instance_id": a_rank["instance_id"]}
        with httpx.Client(timeout=5) as c:
            captured = c.build_request("PUT", a_url, json=body)
            captured.headers.update(Authenticator(LAUNCH_SECRET.encode()).http_header(
                "PUT", "/route", "", captured.content, pd_pair.prefill.ready["instance_id"]))
            assert c.send(captured).status_code == 200  # where it was meant to go
            replay = c.build_request("PUT", b_url, content=captured.content,
                                     headers=dict(captured.headers))
            refused = c.send(replay)
        assert refused.status_code == 401 and "another kvd instance" in refused.text
        assert signed("GET", b_url, params=params).json() == b_rank  # not redirected
    finally:
        b_engine.close()
        b.stop()


def test_s09_frame_for_one_decode_is_useless_at_another(pd_pair: PdPair, room_ids,
                                                        tmp_path: Path) -> None:
    """S09: a failure report sealed for decode D1 is refused by decode D2, which holds the
    same room id with the same prefill; at D1 it works (the seal is good)."""
    d1, d2 = start_daemon("decode", tmp_path), start_daemon("decode", tmp_path)
    e1, e2 = EngineStandIn(d1.socket, seed=5), EngineStandIn(d2.socket, seed=7)
    try:
        room = next(room_ids)
        r1 = Receiver(e1.client, room, pd_pair.bootstrap)
        r2 = Receiver(e2.client, room, pd_pair.bootstrap)
        r1.init([1], 1)
        r2.init([1], 1)
        deadline = time.monotonic() + 10
        while KVPoll.Bootstrapping in (r1.poll(), r2.poll()) and time.monotonic() < deadline:
            time.sleep(0.05)  # both resolved P: a report from P counts now
        assert r1.poll() == r2.poll() == KVPoll.WaitingForInput
        inc = first_incarnation(d1.ready["instance_id"])  # D1's first room
        report = control.RoomStatus(room=room, inc=inc, status=int(KVPoll.Failed),
                                    kind="aborted", reason="captured report",
                                    endpoint=pd_pair.prefill.ready["control_endpoint"],
                                    instance_id=pd_pair.prefill.ready["instance_id"])
        sealed = Authenticator(LAUNCH_SECRET.encode()).seal(
            control.encode(report), d1.ready["instance_id"])
        push_frames(d2.ready["control_endpoint"], [sealed])
        deadline = time.monotonic() + 10
        while health(d2)["counters"]["auth_failures"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health(d2)["counters"]["auth_failures"] >= 1
        assert health(d2)["counters"]["misaddressed"] >= 1  # authentic, not for it
        assert r2.poll() == KVPoll.WaitingForInput
        push_frames(d1.ready["control_endpoint"], [sealed])
        assert r1.wait(10) == KVPoll.Failed and "captured report" in r1.failure_reason()
        r1.abort("test over")
        r2.abort("test over")
    finally:
        e1.close()
        e2.close()
        d1.stop()
        d2.stop()


def test_s09_frame_for_a_prefill_is_useless_after_it_restarts(tmp_path: Path) -> None:
    """S09: an abort sealed for prefill P (instance 1) reaches P after it restarted on the
    same control port (instance 2) → not acted on, counted, and answered with a typed
    refusal naming instance 2 (push, don't wait): the new P's room is untouched, and so
    is D's room, bound to instance 2 already; the same abort sealed for instance 2 fails
    it (the seal is good)."""
    ports = {"zmq_port": free_port(), "http_port": free_port()}
    auth = Authenticator(LAUNCH_SECRET.encode())
    p = start_daemon("prefill", tmp_path, serve_bootstrap=True, **ports)
    ep, first = p.ready["control_endpoint"], p.ready["instance_id"]
    p.stop()
    p = start_daemon("prefill", tmp_path, serve_bootstrap=True, **ports)
    d = start_daemon("decode", tmp_path)
    engine, d_engine = EngineStandIn(p.socket, seed=6), EngineStandIn(d.socket, seed=8)
    try:
        assert p.ready["control_endpoint"] == ep and p.ready["instance_id"] != first
        receiver = Receiver(d_engine.client, 77, p.http_addr)
        receiver.init([1], 1)
        sender = Sender(engine.client, 77)
        sender.init(1, 0)
        deadline = time.monotonic() + 10
        while sender.poll() != KVPoll.WaitingForInput and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender.poll() == KVPoll.WaitingForInput  # bound to D's first incarnation
        abort = control.encode(control.RoomAbort(
            room=77, inc=first_incarnation(d.ready["instance_id"]), kind="aborted",
            reason="captured abort",
            endpoint=d.ready["control_endpoint"], instance_id=d.ready["instance_id"]))
        push_frames(ep, [auth.seal(abort, first)])  # as captured before the restart
        deadline = time.monotonic() + 10
        while health(p)["counters"]["misaddressed"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        counters = health(p)["counters"]
        assert counters["misaddressed"] >= 1 and counters["auth_failures"] >= 1
        assert counters["refusals_sent"] >= 1  # to the endpoint the authentic frame names
        time.sleep(0.3)
        assert sender.poll() == KVPoll.WaitingForInput
        assert receiver.poll() == KVPoll.WaitingForInput  # bound to instance 2: untouched
        push_frames(ep, [auth.seal(abort, p.ready["instance_id"])])
        assert wait_rooms(engine.client, [77], timeout=10) == [KVPoll.Failed]
        receiver.abort("test over")
    finally:
        engine.close()
        d_engine.close()
        d.stop()
        p.stop()


def test_s14_operations_views_need_the_secret(pd_pair: PdPair, room_ids) -> None:
    """S14: /v1/status, /v1/rooms and the API schema need the secret; /health and
    /metrics stay open and show no room id, transfer session, socket path or pid; a
    loopback listener refuses a foreign Host header (DNS rebinding)."""
    room = 987_654_321_000 + next(room_ids)
    transfer_room(pd_pair.p_engine, pd_pair.d_engine, pd_pair.bootstrap, room, [7], [8],
                  chunk=1)
    assert wait_rooms(pd_pair.d_engine.client, [room]) == [KVPoll.Success]
    for daemon in (pd_pair.prefill, pd_pair.decode):
        base = f"http://{daemon.http_addr}"
        for path in ("/v1/status", "/v1/rooms?all=true", "/openapi.json", "/docs"):
            assert httpx.get(base + path, timeout=5).status_code == 401, path
        assert str(room) in signed("GET", base + "/v1/rooms?all=true").text
        assert signed("GET", base + "/v1/status").status_code == 200
        secrets = [str(room), daemon.ready["session_id"], daemon.socket, '"pid"']
        for path in ("/health", "/metrics", "/ready"):
            text = httpx.get(base + path, timeout=5).text
            assert not [s for s in secrets if s in text], (path, text[:2000])
        rebound = httpx.get(base + "/health", headers={"Host": "kvd.attacker.example"},
                            timeout=5)
        assert rebound.status_code == 400


def test_s14_cli_reads_the_secret_as_the_daemon_does(pd_pair: PdPair,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    from kvd.cli.main import main

    addr = pd_pair.decode.http_addr
    monkeypatch.delenv("KVD_CLUSTER_SECRET", raising=False)
    assert main(["status", "-a", addr]) == 1
    assert "needs the cluster secret" in capsys.readouterr().err
    secret = tmp_path / "cluster.secret"
    secret.write_text(LAUNCH_SECRET + "\n")
    secret.chmod(0o600)
    monkeypatch.setenv("KVD_CLUSTER_SECRET_FILE", str(secret))
    assert main(["status", "--json", "-a", addr]) == 0
    assert json.loads(capsys.readouterr().out)["role"] == "decode"
    monkeypatch.delenv("KVD_CLUSTER_SECRET_FILE")
    monkeypatch.setenv("KVD_CLUSTER_SECRET", LAUNCH_SECRET)
    assert main(["rooms", "--json", "-a", addr]) == 0
    assert main(["peers", "--json", "-a", addr]) == 0


def test_s15_open_secret_file_is_refused_and_the_secret_never_logged(tmp_path: Path) -> None:
    """S15: a secret file readable by others stops the daemon before it starts; with mode
    0600 it starts, and neither its log nor ``kvd config show`` carries the secret, even
    after unauthenticated traffic."""
    secret = "s15-" + LAUNCH_SECRET
    path = tmp_path / "cluster.secret"
    path.write_text(secret + "\n")
    path.chmod(0o644)
    env = {"KVD_CLUSTER_SECRET": "", "KVD_CLUSTER_SECRET_FILE": str(path)}
    with pytest.raises(KvdError, match="open to group or others") as exc:
        start_daemon("decode", tmp_path, env=env)
    assert secret not in str(exc.value)
    path.chmod(0o600)
    daemon = start_daemon("decode", tmp_path, env=env, log_level="DEBUG")
    try:
        push_frames(daemon.ready["control_endpoint"], [b"junk", b"KVA2" + bytes(200)])
        assert httpx.get(f"http://{daemon.http_addr}/v1/status", timeout=5).status_code == 401
        shown = subprocess.run([sys.executable, "-m", "kvd.cli.main", "config", "show",
                                "-c", str(daemon.config)], capture_output=True, text=True,
                               env={**os.environ, **env}, timeout=60)
        assert shown.returncode == 0 and secret not in shown.stdout + shown.stderr
    finally:
        daemon.stop()
    log = daemon.log.read_text()
    assert "dropped control frame" in log and secret not in log
