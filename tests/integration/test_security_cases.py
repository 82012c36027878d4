"""Security cases S05, S06, S08, S11 and S13 on real daemon processes (real Mooncake TCP on
loopback, real restarts, sealed control frames crafted as any holder of the secret can).

No test asserts a wall-clock bound: waits are "poll until, within a generous bound", and
short configured intervals (heartbeat, ``peer_ttl``) keep each test to a few seconds.
Rooms that move data are checked byte for byte.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvd.client import KVPoll, Receiver, Sender
from kvd.launch import LAUNCH_SECRET, DaemonProcess, start_daemon
from kvd.protocol import control
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import (
    EngineStandIn,
    ModelSpec,
    ShardStandIn,
    transfer_room,
    wait_rooms,
)
from kvd.security import Authenticator
from tests.conftest import PdPair, free_port, health, push_frames, signed, start_pair, stop_pair
from tests.integration.test_second_round import ended, until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

T = TypeVar("T")
DONE = (KVPoll.Success, KVPoll.Failed)
BOUND = 30.0  # generous bound of every "poll until"
AUTH = Authenticator(LAUNCH_SECRET.encode())


# ---- helpers -------------------------------------------------------------------------------


def status(daemon: DaemonProcess) -> dict[str, Any]:
    resp = signed("GET", f"http://{daemon.http_addr}/v1/status")
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def tables(daemon: DaemonProcess) -> dict[str, int]:
    return dict(health(daemon)["tables"])


def dropped(daemon: DaemonProcess, why: str) -> int:
    return int(status(daemon)["totals"].get(f"dropped_{why}", 0))


def forge(daemon: DaemonProcess, *msgs: control.ControlMessage) -> None:
    """Send ``msgs`` sealed with the cluster secret for ``daemon``'s instance to its control
    port (what any holder of the secret can do), waiting until they left."""
    push_frames(daemon.ready["control_endpoint"],
                [AUTH.seal(control.encode(m), daemon.ready["instance_id"]) for m in msgs],
                linger_ms=60_000)


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as s:
        yield s


def daemon(stack: contextlib.ExitStack, role: str, tmp: Path, **settings: Any) -> DaemonProcess:
    d = start_daemon(role, tmp, **settings)
    stack.callback(d.stop)
    return d


def engine(stack: contextlib.ExitStack, d: DaemonProcess, **pool: Any) -> EngineStandIn:
    e = EngineStandIn(d.socket, **pool)
    stack.callback(e.close)
    return e


def pair(stack: contextlib.ExitStack, tmp: Path, **opts: Any) -> PdPair:
    pd = start_pair(tmp, **opts)
    stack.callback(stop_pair, pd)
    return pd


class FakePeer:
    """A control endpoint that no daemon owns: a ROUTER socket, as a daemon binds, so that
    what a prefill sends to it can be read (opened as instance ``instance``, decoded)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.auth = Authenticator(LAUNCH_SECRET.encode(), instance)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def received(self, wait_s: float) -> list[control.ControlMessage]:
        """Every message that arrived, waiting up to ``wait_s`` for the first."""
        out: list[control.ControlMessage] = []
        while self.sock.poll(int(wait_s * 1000)):
            frames = self.sock.recv_multipart()
            out.append(control.decode(self.auth.open(frames[-1])))
            wait_s = 0.2
        return out

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def fake_peer(stack: contextlib.ExitStack, instance: str) -> FakePeer:
    f = FakePeer(instance)
    stack.callback(f.close)
    return f


def standin_wire(session: str) -> control.KVArgsWire:
    """KV args shaped like an :class:`EngineStandIn`'s (4 layers, 256 pages of 4096 bytes,
    16 aux slots of 64 bytes): a prefill with a stand-in engine accepts them, unless the
    session is wrong."""
    base = 1 << 40
    kv = [base + i * (256 * 4096) for i in range(8)]
    return control.KVArgsWire(session_id=session, kv_data_ptrs=kv,
                              kv_data_lens=[256 * 4096] * 8, kv_item_lens=[4096] * 8,
                              aux_data_ptrs=[base + 8 * 256 * 4096], aux_data_lens=[16 * 64],
                              aux_item_lens=[64], page_size=16, num_kv_heads=2, head_dim=64,
                              dtype_size=2, num_layers=4)


def register(endpoint: str, instance: str, session: str) -> control.RegisterRank:
    return control.RegisterRank(instance_id=instance, endpoint=endpoint, attn_tp_rank=0,
                                attn_tp_size=1, kv_args=standin_wire(session))


def pages_msg(room: int, endpoint: str, instance: str, dst: bytes, inc: int = 1,
              required: int = 1) -> control.RoomPages:
    return control.RoomPages(room=room, inc=inc, endpoint=endpoint, instance_id=instance,
                             dst_pages=dst, aux_index=0, write_within=60.0,
                             required_dst_info_num=required)


def rooms(daemon: DaemonProcess) -> list[dict[str, Any]]:
    resp = signed("GET", f"http://{daemon.http_addr}/v1/rooms")
    assert resp.status_code == 200, resp.text
    out: list[dict[str, Any]] = resp.json()
    return out


def peer_row(daemon: DaemonProcess, endpoint: str) -> dict[str, Any] | None:
    return next((p for p in status(daemon)["peers"] if p["endpoint"] == endpoint), None)


def transfer_ports() -> str:
    """Two consecutive free ports below the ephemeral range, for ``transfer_port_range``
    (the decode's transfer address is then known before it starts)."""
    rng = np.random.default_rng()
    for _ in range(200):
        first = int(rng.integers(20000, 32000))
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", first))
                b.bind(("127.0.0.1", first + 1))
        except OSError:
            continue
        return f"{first}-{first + 1}"
    raise AssertionError("no two free consecutive ports in 20000-32000")


def snapshot(e: EngineStandIn) -> list[np.ndarray]:
    return [b.copy() for b in e.kv]


def unchanged(e: EngineStandIn, before: list[np.ndarray]) -> bool:
    return all(np.array_equal(b, a) for b, a in zip(e.kv, before, strict=True))


# ---- S05: idle connections to a decode's handshake port --------------------------------------


class IdleFlood:
    """Keeps ``n`` idle TCP connections open to ``addr`` from a thread, opening a new one
    for each the server closes (an attacker who never sends a byte), until closed.
    ``closed_by_server``: how many the server closed."""

    def __init__(self, addr: tuple[str, int], n: int) -> None:
        self.addr, self.n = addr, n
        self.closed_by_server = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conns: list[socket.socket] = []
        try:
            while not self._stop.is_set():
                while len(conns) < self.n:
                    conns.append(socket.create_connection(self.addr, timeout=5))
                readable, _, _ = select.select(conns, [], [], 0.05)
                for c in readable:  # the server closed it (EOF or reset)
                    conns.remove(c)
                    c.close()
                    self.closed_by_server += 1
        finally:
            for c in conns:
                c.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def handshake_outcomes(daemon: DaemonProcess) -> dict[str, float]:
    """``kvd_handshake_connections_total`` by outcome, from ``daemon``'s /metrics."""
    resp = signed("GET", f"http://{daemon.http_addr}/metrics")
    assert resp.status_code == 200, resp.text
    return {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(resp.text)
            for s in fam.samples if s.name == "kvd_handshake_connections_total"}


def test_s05_idle_handshake_connections_to_one_decode_do_not_block_another(
        tmp_path: Path, stack: contextlib.ExitStack) -> None:
    """An attacker keeps 20 idle TCP connections open to decode A's advertised handshake
    port (opening a new one for each that is closed); then a room to A (P's first transfer
    to A: a handshake) and rooms to decode B (already known to P) → every room succeeds
    byte-exact, A's front closed the idle connections (its metric counts them, the
    attacker saw them closed) and relayed P's handshake. Without the front, Mooncake's one
    handshake thread gives each idle connection 5 s: 20 of them outlast the handshake
    client's 60 s limit, A's room fails, and B's rooms wait on the binding's mutex."""
    p = daemon(stack, "prefill", tmp_path, serve_bootstrap=True)
    a = daemon(stack, "decode", tmp_path)
    b = daemon(stack, "decode", tmp_path)
    pe, ae, be = engine(stack, p, seed=1), engine(stack, a, seed=2), engine(stack, b, seed=3)
    transfer_room(pe, be, p.http_addr, 500, [1], [1], chunk=1)  # P knows B's segment
    assert wait_rooms(be.client, [500], timeout=BOUND) == [KVPoll.Success]
    assert be.pages_equal(pe, [1], [1])
    host, port = a.ready["session_id"].rsplit(":", 1)  # the advertised handshake port
    flood = IdleFlood((host, int(port)), 20)
    stack.callback(flood.close)
    until(lambda: handshake_outcomes(a).get("idle", 0) >= 20, "A's front closed 20 idle "
          "connections", timeout=60)
    send_a, recv_a = transfer_room(pe, ae, p.http_addr, 501, [2, 3], [4, 5], chunk=2)
    rooms_b = [transfer_room(pe, be, p.http_addr, 510 + i, [10 + i], [20 + i], chunk=1)[1]
               for i in range(3)]
    until(lambda: all(r.poll() in DONE for r in rooms_b), "B's rooms ended", timeout=90)
    assert [r.poll() for r in rooms_b] == [KVPoll.Success] * 3
    assert all(be.pages_equal(pe, [10 + i], [20 + i]) for i in range(3))
    assert ended(recv_a, timeout=90) == KVPoll.Success, recv_a.failure()
    assert ended(send_a) == KVPoll.Success
    assert ae.pages_equal(pe, [2, 3], [4, 5])
    flood.close()
    outcomes = handshake_outcomes(a)
    assert outcomes.get("relayed", 0) >= 1, outcomes  # P's handshake went through the front
    assert flood.closed_by_server >= 20


# ---- S06: the bootstrap server restarts ------------------------------------------------------


def test_s06_prefill_ranks_register_again_after_the_bootstrap_server_restarts(
        tmp_path: Path, stack: contextlib.ExitStack) -> None:
    """Prefill rank 0 (attn_tp 2) serves bootstrap, rank 1 registers with it; rank 0
    restarts on the same ports (a new instance, an empty table) → rank 1 registers again
    by itself, /route answers for it, and a room over both ranks succeeds byte-exact."""
    spec = ModelSpec(total_kv_heads=4)
    source = spec.global_kv(seed=6)
    ports = {"zmq_port": free_port(), "http_port": free_port()}
    fast = {"heartbeat_interval": 0.5}  # the bootstrap-check period too
    tp = {"attn_tp_size": 2}
    r0 = start_daemon("prefill", tmp_path, serve_bootstrap=True, attn_tp_rank=0, **tp,
                      **ports, **fast)
    stack.callback(lambda: r0.stop())  # the current rank 0 (replaced below)
    e0 = ShardStandIn(r0.socket, spec, 0, 2, source=source, seed=10)
    r1 = daemon(stack, "prefill", tmp_path, bootstrap_addr=r0.http_addr, attn_tp_rank=1,
                **tp, **fast)
    e1 = ShardStandIn(r1.socket, spec, 1, 2, source=source, seed=11)
    stack.callback(e1.close)
    url = f"http://{r0.http_addr}/route"
    rank1 = {"engine_rank": 1, "target_dp_group": 0, "target_pp_rank": 0}
    first = until(lambda: (resp := signed("GET", url, params=rank1)).status_code == 200
                  and resp.json(), "rank 1 registered with the first bootstrap")
    old_instance = r0.ready["instance_id"]
    e0.close()
    r0.stop()
    r0 = start_daemon("prefill", tmp_path, serve_bootstrap=True, attn_tp_rank=0, **tp,
                      **ports, **fast)
    e0 = ShardStandIn(r0.socket, spec, 0, 2, source=source, seed=12)
    stack.callback(lambda: e0.close())
    assert r0.ready["instance_id"] != old_instance and r0.http_addr in url
    again = until(lambda: (resp := signed("GET", url, params=rank1)).status_code == 200
                  and resp.json(), "rank 1 registered with the restarted bootstrap")
    assert (again["rank_ip"], again["rank_port"], again["instance_id"]) == \
        (first["rank_ip"], first["rank_port"], first["instance_id"])
    assert "registering again" in r1.log.read_text()  # the restart was noticed, not missed
    d = daemon(stack, "decode", tmp_path)
    de = ShardStandIn(d.socket, spec, 0, 1, seed=13)
    stack.callback(de.close)
    src, dst = np.array([3, 7, 9]), np.array([40, 41, 50])
    recv = Receiver(de.client, 600, r0.http_addr)
    recv.init(dst, 0)  # the only room on this decode
    senders = []
    for e in (e0, e1):
        s = Sender(e.client, 600)
        s.init(len(src), 0)
        s.send(src)
        senders.append(s)
    assert recv.wait(BOUND) == KVPoll.Success, recv.failure()
    assert [s.wait(BOUND) for s in senders] == [KVPoll.Success] * 2
    assert de.holds(source, src, dst)  # both ranks' heads, byte for byte


# ---- S08: peers are forgotten -----------------------------------------------------------------


def test_s08_decode_churn_never_fills_max_peers(tmp_path: Path,
                                                stack: contextlib.ExitStack) -> None:
    """P accepts 2 decode peers (``max_peers``) and forgets idle ones after 3 s
    (``peer_ttl``). Two decodes each finish a room and stop (P is full: a third and a
    fourth registration are refused, and leave nothing behind, not even their claims on
    transfer addresses); once they are forgotten, two new decodes (one with a refused
    claim's transfer address) register and their rooms succeed byte-exact; P's status
    lists only live peers, and the forgotten peers' sockets are closed."""
    p = daemon(stack, "prefill", tmp_path, serve_bootstrap=True, max_peers=2, peer_ttl=3.0)
    pe = engine(stack, p, seed=1)
    first = [daemon(stack, "decode", tmp_path) for _ in range(2)]
    for i, d in enumerate(first):
        de = EngineStandIn(d.socket, seed=10 + i)
        try:
            transfer_room(pe, de, p.http_addr, 800 + i, [1 + i], [2 + i], chunk=1)
            assert wait_rooms(de.client, [800 + i], timeout=BOUND) == [KVPoll.Success]
            assert de.pages_equal(pe, [1 + i], [2 + i])
        finally:
            de.close()
    # P is full now: more registrations are refused, so forgetting is what lets the
    # decodes below in (the stopped ones never say goodbye)
    assert tables(p)["peers"] == 2
    ports = transfer_ports()  # a later decode's transfer address is one of these two
    forge(p, *(register(f"tcp://127.0.0.1:{9 + i}", f"s08-extra-{i}", f"127.0.0.1:{port}")
               for i, port in enumerate(map(int, ports.split("-")))))
    until(lambda: dropped(p, "max_peers") == 2, "two more registrations refused at max_peers")
    for d in first:
        d.stop()
    gone = [d.ready["control_endpoint"] for d in first]
    until(lambda: tables(p)["peers"] == 0, "the stopped decodes forgotten after peer_ttl")
    assert not {row["endpoint"] for row in status(p)["peers"]} & set(gone)
    assert tables(p)["control_sockets"] == 0  # no socket kept for a forgotten peer
    # the refused registrations left nothing behind: a decode with one of their transfer
    # addresses (from another endpoint) is accepted
    live = [daemon(stack, "decode", tmp_path, transfer_port_range=ports),
            daemon(stack, "decode", tmp_path)]
    engines = [engine(stack, d, seed=20 + i) for i, d in enumerate(live)]
    for i, de in enumerate(engines):
        transfer_room(pe, de, p.http_addr, 810 + i, [30 + i], [40 + i], chunk=1)
    for i, de in enumerate(engines):
        assert wait_rooms(de.client, [810 + i], timeout=BOUND) == [KVPoll.Success], \
            Receiver.attach(de.client, 810 + i).failure()
        assert de.pages_equal(pe, [30 + i], [40 + i])
    rows = {row["endpoint"]: row["state"] for row in status(p)["peers"]}
    assert rows == {d.ready["control_endpoint"]: "registered" for d in live}
    assert dropped(p, "max_peers") == 2  # the new decodes were never refused


# ---- S11: rooms are bound to their parties --------------------------------------------------


def test_s11_a_decode_cannot_claim_another_peers_transfer_session(
        tmp_path: Path, stack: contextlib.ExitStack) -> None:
    """A holder of the secret registers with P under its own endpoint but with decode D's
    transfer session (or P's own) → refused, and its pages for D's room are refused too;
    the same registration with a session of its own is accepted (so the session was the
    reason); D's room succeeds byte-exact and D's memory sees no other write."""
    pd = pair(stack, tmp_path)
    p, d = pd.p_engine, pd.d_engine
    transfer_room(p, d, pd.bootstrap, 700, [1], [1], chunk=1)  # D registered with P
    assert wait_rooms(d.client, [700], timeout=BOUND) == [KVPoll.Success]
    d_session = pd.decode.ready["session_id"]
    thief, mirror = fake_peer(stack, "s11-thief"), fake_peer(stack, "s11-mirror")
    honest = fake_peer(stack, "s11-honest")
    forge(pd.prefill, register(thief.endpoint, thief.instance, d_session),
          register(mirror.endpoint, mirror.instance, pd.prefill.ready["session_id"]),
          register(honest.endpoint, honest.instance, f"127.0.0.1:{free_port()}"))
    rows = until(lambda: all(peer_row(pd.prefill, f.endpoint) for f in (thief, mirror, honest))
                 and {f: peer_row(pd.prefill, f.endpoint) for f in (thief, mirror, honest)},
                 "P answered the three registrations")
    assert rows[thief]["state"] == "rejected", rows[thief]
    assert d_session in rows[thief]["detail"] and \
        pd.decode.ready["control_endpoint"] in rows[thief]["detail"], rows[thief]
    assert rows[mirror]["state"] == "rejected" and "own" in rows[mirror]["detail"], rows[mirror]
    assert rows[honest]["state"] == "registered", rows[honest]
    # D's room 701 is bound; the thief sends pages for it too (pages D does not use)
    before = snapshot(d)
    recv = Receiver(d.client, 701, pd.bootstrap)
    recv.init([5, 6], 5)
    send = Sender(p.client, 701)
    send.init(2, 0)
    until(lambda: send.poll() == KVPoll.WaitingForInput, "P bound room 701 to D")
    forge(pd.prefill, pages_msg(701, thief.endpoint, "s11-thief", pack_indices([100, 101])))
    answers = thief.received(BOUND)
    assert [(type(m).__name__, getattr(m, "room", None), getattr(m, "status", None))
            for m in answers] == \
        [("RoomStatus", 701, int(KVPoll.Failed))], answers
    send.send([7, 8])
    assert ended(recv) == KVPoll.Success, recv.failure()
    assert d.pages_equal(p, [7, 8], [5, 6])
    after = snapshot(d)
    for b, a in zip(before, after, strict=True):  # only D's own pages 5, 6 changed
        a[[5, 6]] = b[[5, 6]]
    assert all(np.array_equal(b, a) for b, a in zip(before, after, strict=True))
    assert mirror.received(0.2) == []  # P never talks to a rejected mirror unasked


@pytest.mark.parametrize("order", ["after", "before"])
def test_s11_a_secret_holder_cannot_join_a_room_as_an_extra_destination(
        tmp_path: Path, stack: contextlib.ExitStack, order: str) -> None:
    """Decode E (a registered peer, holding the secret) sends pages for D's room R and says
    the room has two destinations (``required_dst_info_num`` 2), ``after`` D bound R or
    ``before`` → E never receives a byte of R: after, E is refused and R succeeds at D
    byte-exact; before, the destinations disagree and R fails on both sides, unwritten."""
    pd = pair(stack, tmp_path)
    p, d = pd.p_engine, pd.d_engine
    e_daemon = daemon(stack, "decode", tmp_path)
    e = engine(stack, e_daemon, seed=9)
    transfer_room(p, e, pd.bootstrap, 720, [1], [1], chunk=1)  # E registered with P
    assert wait_rooms(e.client, [720], timeout=BOUND) == [KVPoll.Success]
    e_before, d_before = snapshot(e), snapshot(d)
    join = pages_msg(721, e_daemon.ready["control_endpoint"], e_daemon.ready["instance_id"],
                     pack_indices([60, 61]), inc=99, required=2)
    send = Sender(p.client, 721)
    if order == "before":
        forge(pd.prefill, join)
        until(lambda: [r["peer"] for r in rooms(pd.prefill) if r["room"] == 721] ==
              [e_daemon.ready["control_endpoint"]], "P bound E to room 721")
    recv = Receiver(d.client, 721, pd.bootstrap)
    recv.init([10, 11], 10)
    send.init(2, 0)
    if order == "after":
        until(lambda: send.poll() == KVPoll.WaitingForInput, "P bound room 721 to D")
        words = tables(pd.prefill)["words"]
        forge(pd.prefill, join)
        until(lambda: tables(pd.prefill)["words"] > words, "P answered E's join")
    send.send([12, 13])
    states = ended(recv), ended(send)
    assert unchanged(e, e_before), f"E received bytes of room 721 ({order}, {states})"
    if order == "after":
        assert states == (KVPoll.Success, KVPoll.Success), recv.failure()
        assert d.pages_equal(p, [12, 13], [10, 11])
    else:  # the destinations disagree: the room fails on both sides, nothing written
        assert states == (KVPoll.Failed, KVPoll.Failed)
        assert recv.failure()[0] == "duplicate", recv.failure()
        assert unchanged(d, d_before)


# ---- S13: buffering for rooms not created yet -------------------------------------------------


MIB = 1 << 20


def test_s13_pages_for_unknown_rooms_are_bounded_and_unregistered_ones_dropped(
        tmp_path: Path, stack: contextlib.ExitStack) -> None:
    """P (``max_rooms_per_peer`` 32) gets sealed pages for rooms its engine never created:
    from registered decode D, twenty-five 3 MiB messages and then 100 small ones; from an
    endpoint that never registered, four 3 MiB messages and 100 small ones → P buffers at
    most 64 MiB and at most 32 rooms of D's, refuses (answers) the rest, drops and counts
    every unregistered message without answering or connecting to it, and a normal room
    from D still succeeds byte-exact."""
    pd = pair(stack, tmp_path, p_opts={"max_rooms_per_peer": 32})
    p, d = pd.p_engine, pd.d_engine
    transfer_room(p, d, pd.bootstrap, 900, [1], [1], chunk=1)  # D registered with P
    assert wait_rooms(d.client, [900], timeout=BOUND) == [KVPoll.Success]
    ghost = fake_peer(stack, "s13-ghost")
    base, sockets = tables(pd.prefill), tables(pd.prefill)["control_sockets"]
    unregistered = dropped(pd.prefill, "unregistered")
    # page 0, 786 432 times: valid indices, 3 MiB of them (a frame is capped at the largest
    # real message, a 1M-page RoomPages: S19)
    big = bytes(3 * MIB)
    d_ep, d_id = pd.decode.ready["control_endpoint"], pd.decode.ready["instance_id"]
    for i in range(4):  # the unregistered endpoint first: none of it may be kept
        forge(pd.prefill, pages_msg(20_000 + i, ghost.endpoint, "s13-ghost", big))
    forge(pd.prefill, *(pages_msg(20_100 + i, ghost.endpoint, "s13-ghost", pack_indices([i]))
                        for i in range(100)))
    until(lambda: dropped(pd.prefill, "unregistered") == unregistered + 104,
          "P dropped the unregistered endpoint's 104 messages")
    assert tables(pd.prefill)["pending"] == base["pending"] == 0
    assert tables(pd.prefill)["pending_bytes"] == 0
    for i in range(25):
        forge(pd.prefill, pages_msg(30_000 + i, d_ep, d_id, big))
    forge(pd.prefill, *(pages_msg(30_100 + i, d_ep, d_id, pack_indices([i]))
                        for i in range(100)))
    # every message of D's is either buffered or answered (P's final words are remembered)
    until(lambda: (t := tables(pd.prefill))["pending"] + t["words"] - base["words"] == 125,
          "P buffered or answered each of D's 125 messages")
    t = tables(pd.prefill)
    assert t["pending_bytes"] <= 64 * MIB, t  # the byte bound: twenty-one 3 MiB messages fit
    assert t["pending"] <= 32, t  # the per-peer bound
    assert t["pending_bytes"] == 21 * 3 * MIB + 4 * (t["pending"] - 21), t
    assert ghost.received(0.5) == []  # never answered
    assert tables(pd.prefill)["control_sockets"] == sockets  # and never connected to
    # a normal room from D: its sender exists before its pages (D's buffer is full)
    send = Sender(p.client, 901)
    recv = Receiver(d.client, 901, pd.bootstrap)
    recv.init([30, 31], 30)
    send.init(2, 0)
    send.send([40, 41])
    assert ended(recv) == KVPoll.Success, recv.failure()
    assert d.pages_equal(p, [40, 41], [30, 31])
