"""Security with real daemons: authenticated control plane and bootstrap, fuzzing, local
engine socket protection."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq

from kvd.client import KVPoll, Receiver
from kvd.errors import KvdError
from kvd.launch import LAUNCH_SECRET, start_daemon
from kvd.protocol import control, rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import transfer_room, wait_rooms
from kvd.security import Authenticator
from tests.conftest import PdPair, health, signed

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _push(endpoint: str, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    for f in frames:
        sock.send(f)
    sock.close()
    ctx.term()


def _auth_failures(daemon) -> int:  # type: ignore[no-untyped-def]
    return int(health(daemon)["counters"]["auth_failures"])


def test_forged_and_replayed_control_messages_are_rejected(pd_pair: PdPair, room_ids) -> None:
    d = pd_pair.d_engine
    room = next(room_ids)
    r = Receiver(d.client, room, pd_pair.bootstrap)
    r.init([1], 0)
    time.sleep(0.3)
    prefill_ep = pd_pair.prefill.ready["control_endpoint"]
    status = control.RoomStatus(room=room, inc=1, status=int(KVPoll.Success), kind="",
                                reason="", endpoint=prefill_ep, instance_id="forger")
    before = _auth_failures(pd_pair.decode)
    wrong = Authenticator(b"not-the-cluster-secret-at-all")
    _push(pd_pair.decode.ready["control_endpoint"],
          [control.encode(status), wrong.seal(control.encode(status))])  # unsealed, forged
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
    sealed = good.seal(control.encode(failed))
    _push(pd_pair.decode.ready["control_endpoint"], [sealed, sealed])  # the second is a replay
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
    req.headers.update(forged.http_header("PUT", req.url.path, "", req.content))
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
    args = pd_pair.d_engine.registration
    wire = control.KVArgsWire("127.0.0.1:1", [1], [64], [64], [], [], [], 1, 1, 1, 1, 1)
    msgs = [control.RegisterRank("x", ep, 0, 1, wire),
            control.RoomPages(room=7, inc=1, endpoint=ep, instance_id="x",
                              dst_pages=pack_indices([1, 2]), aux_index=0, write_within=5.0),
            control.RoomStatus(room=7, inc=1, status=4, kind="", reason="", endpoint=ep,
                               instance_id="x"),
            control.RoomAbort(room=7, inc=1, kind="aborted", reason="r", endpoint=ep,
                              instance_id="x")]
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
    sealed = [auth.seal(f) for f in _mutations(rng, seeds, 4_000)]  # reach the codec too
    for daemon in (pd_pair.prefill, pd_pair.decode):
        _push(daemon.ready["control_endpoint"], frames[:6000] + sealed[:2000])
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
        assert h["counters"]["auth_failures"] + h["counters"]["protocol_errors"] > 1000
    room = next(room_ids)
    src, dst = np.array([3, 4, 5]), np.array([200, 201, 202])
    transfer_room(p, d, pd_pair.bootstrap, room, src, dst, chunk=2)
    assert wait_rooms(d.client, [room]) == [KVPoll.Success]
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
