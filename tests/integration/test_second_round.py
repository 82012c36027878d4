"""Second-round cases (K21-K34) on real daemon processes, the real Mooncake TCP transport on
loopback and real signals. The same cases run deterministically in
``tests/inproc/test_k_second_round.py``; here they show what only real processes can:
bytes through the real engine, SIGSTOP/SIGKILL, sockets, restarts on the same ports.

No test asserts a wall-clock bound: waits are "poll until, within a generous bound" and
short configured timeouts keep each test to a few seconds. Where a case says "within
about a second" (not at a deadline), the test configures that deadline far beyond the
poll bound, and checks the failure *kind*, which says what ended the room.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvd.client import KvdClient, KVPoll, Receiver, Sender
from kvd.errors import RoomError
from kvd.launch import DaemonProcess, start_daemon
from kvd.protocol import rpc
from kvd.refengine.standin import (
    EngineStandIn,
    ModelSpec,
    ShardStandIn,
    StandInPool,
    transfer_room,
    wait_rooms,
)
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

T = TypeVar("T")
DONE = (KVPoll.Success, KVPoll.Failed)
BOUND = 15.0  # generous bound of every "poll until" (each case's own deadlines are shorter)


# ---- helpers -------------------------------------------------------------------------------


def until(probe: Callable[[], T], what: str, timeout: float = BOUND,
          interval: float = 0.02) -> T:
    """Poll ``probe()`` until it returns something truthy (returned); fail the test with
    ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what} (last: {value!r})")
        time.sleep(interval)


def ended(room: Receiver | Sender, timeout: float = BOUND) -> KVPoll | int:
    """Poll ``room`` until it is Success or Failed (not waiting for its pages to be
    releasable, as ``wait`` does); returns the state, failing the test after ``timeout``."""
    until(lambda: room.poll() in DONE, f"room {room.room} ended", timeout)
    return room.poll()


def failures(daemon: DaemonProcess, reason: str) -> float:
    """``kvd_room_failures_total{reason=...}`` scraped from ``daemon``'s /metrics."""
    resp = signed("GET", f"http://{daemon.http_addr}/metrics")
    assert resp.status_code == 200, resp.text
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            if s.name == "kvd_room_failures_total" and s.labels.get("reason") == reason:
                return float(s.value)
    return 0.0


def heartbeat_misses(daemon: DaemonProcess, peer: str) -> float:
    """``kvd_heartbeat_misses_total{peer=...}`` scraped from ``daemon``'s /metrics."""
    resp = signed("GET", f"http://{daemon.http_addr}/metrics")
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            if s.name == "kvd_heartbeat_misses_total" and s.labels.get("peer") == peer:
                return float(s.value)
    return 0.0


def status(daemon: DaemonProcess) -> dict[str, Any]:
    """``daemon``'s /v1/status JSON."""
    resp = signed("GET", f"http://{daemon.http_addr}/v1/status")
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


def snapshot(engine: StandInPool | ShardStandIn) -> list[np.ndarray]:
    """A copy of every KV buffer of a stand-in engine."""
    bufs = engine.kv if isinstance(engine, StandInPool) else engine.buffers
    return [b.copy() for b in bufs]


def unchanged(engine: StandInPool | ShardStandIn, before: list[np.ndarray]) -> bool:
    bufs = engine.kv if isinstance(engine, StandInPool) else engine.buffers
    return all(np.array_equal(b, a) for b, a in zip(bufs, before, strict=True))


def transfer_ports() -> str:
    """Two consecutive free ports below the ephemeral range, for ``transfer_port_range``
    (a restarted decode then gets the same transfer session address as before)."""
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


class Cleanup(contextlib.ExitStack):
    """Clean-ups run at teardown, last registered first; every daemon registered with
    :meth:`thaw` gets SIGCONT before any of them is stopped (a stopped daemon would not
    hear SIGTERM, and its peers' shutdowns may wait on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen: list[DaemonProcess] = []

    def thaw(self, d: DaemonProcess) -> None:
        self.frozen.append(d)

    def __exit__(self, *exc: object) -> bool:
        for d in self.frozen:
            d.kill(signal.SIGCONT)
        return bool(super().__exit__(*exc))


@pytest.fixture
def stack() -> Iterator[Cleanup]:
    with Cleanup() as s:
        yield s


def pair(stack: Cleanup, tmp: Path, p_opts: dict | None = None,
         d_opts: dict | None = None, **engines: Any) -> PdPair:
    """A P (serving bootstrap) + D pair stopped at teardown (``stop_pair`` reads the
    current ``pair.prefill``/``pair.decode``, so a test may replace them)."""
    pd = start_pair(tmp, p_opts=p_opts, d_opts=d_opts, **engines)
    stack.callback(stop_pair, pd)
    stack.thaw(pd.prefill)
    stack.thaw(pd.decode)
    return pd


def daemon(stack: Cleanup, role: str, tmp: Path, **settings: Any) -> DaemonProcess:
    d = start_daemon(role, tmp, **settings)
    stack.callback(d.stop)
    stack.thaw(d)
    return d


def engine(stack: Cleanup, d: DaemonProcess, **pool: Any) -> EngineStandIn:
    e = EngineStandIn(d.socket, **pool)
    stack.callback(e.close)
    return e


def shard(stack: Cleanup, d: DaemonProcess, spec: ModelSpec, *args: Any,
          **kw: Any) -> ShardStandIn:
    e = ShardStandIn(d.socket, spec, *args, **kw)
    stack.callback(e.close)
    return e


@dataclass(frozen=True)
class _Side:
    role: str
    daemon: DaemonProcess


def _sides(pd: PdPair) -> tuple[_Side, _Side]:
    return _Side("prefill", pd.prefill), _Side("decode", pd.decode)


def _faults(**plan: object) -> str:
    """A ``fault_injection`` setting (:class:`kvd.transfer.faults.FaultPlan` as JSON)."""
    return json.dumps(plan)


# ---- K21: an abort reached before the peer is known ---------------------------------------


def test_k21_abort_before_the_decode_came_is_delivered_with_its_reason(
        room_pair: PdPair, room_ids: Iterator[int]) -> None:
    """P's engine aborts and clears R before D exists for it: D's R fails with P's reason
    (kind ``aborted``), not at its waiting timeout (the default, 300 s); aborted but not
    cleared likewise, never ``duplicate``; the remembered outcome answers a later decode
    incarnation too. Nothing is written."""
    pd = room_pair
    p, d = pd.p_engine, pd.d_engine
    base = {(x.role, k): failures(x.daemon, k) for x in _sides(pd)
            for k in ("aborted", "duplicate")}
    room1, room2 = next(room_ids), next(room_ids)
    dst = [200, 201, 202, 203]
    before = [kv[dst].copy() for kv in d.kv]
    s = Sender(p.client, room1)
    s.abort("client gone")
    s.clear()
    r = Receiver(d.client, room1, pd.bootstrap)
    r.init(dst[:2], int(dst[0]))
    assert ended(r) == KVPoll.Failed
    kind, reason = r.failure()
    assert kind == "aborted" and "client gone" in reason, (kind, reason)
    # aborted on P but not cleared yet: the same answer, not "duplicate room"
    s2 = Sender(p.client, room2)
    s2.abort("client gone")
    r2 = Receiver(d.client, room2, pd.bootstrap)
    r2.init(dst[2:], int(dst[2]))
    assert ended(r2) == KVPoll.Failed
    assert r2.failure() == ("aborted", s2.failure()[1])
    assert r.wait(BOUND) == KVPoll.Failed and r.releasable()  # nothing was ever sent
    assert all(np.array_equal(kv[dst], b) for kv, b in zip(d.kv, before, strict=True))

    now = {(x.role, k): failures(x.daemon, k) - base[(x.role, k)] for x in _sides(pd)
           for k in ("aborted", "duplicate")}
    assert now == {("prefill", "aborted"): 2, ("prefill", "duplicate"): 0,
                   ("decode", "aborted"): 2, ("decode", "duplicate"): 0}, now
    # the tombstone answers a later incarnation of the room as well
    r.clear()
    r3 = Receiver(d.client, room1, pd.bootstrap)
    r3.init([204], 204)
    assert ended(r3) == KVPoll.Failed and r3.failure()[0] == "aborted"
    for room in (room1, room2):
        Receiver.attach(d.client, room).clear()
    s2.clear()


# ---- K22: a decode-side end must stop every prefill writer --------------------------------


def test_k22a_a_decode_deadline_stops_the_prefill_writer(tmp_path: Path,
                                                         stack: Cleanup) -> None:
    """D's waiting timeout ends R after chunk 1 landed; once D says the pages are
    releasable the engine reuses them, and P's chunk 2 (sent later) writes nothing."""
    pd = pair(stack, tmp_path, d_opts={"waiting_timeout": 2.0, "release_timeout": 0.5})
    p, d = pd.p_engine, pd.d_engine
    dst, src = [0, 1, 2, 3], [8, 9, 10, 11]
    r = Receiver(d.client, 30, pd.bootstrap)
    r.init(dst, int(dst[0]))
    s = Sender(p.client, 30)
    s.init(4, 0)
    until(lambda: s.poll() == KVPoll.WaitingForInput, "P bound to D's pages")
    s.send(src[:2])  # chunk 1: lands
    until(lambda: d.pages_equal(p, src[:2], dst[:2]), "chunk 1 landed")
    assert ended(r) == KVPoll.Failed  # D's waiting deadline
    assert r.failure()[0] == "timeout", r.failure()
    assert ended(s) == KVPoll.Failed  # told by D (and past D's write bound anyway)
    until(r.releasable, "D's pages releasable")
    for kv in d.kv:  # the engine reuses the pages for another request
        kv[dst] = 0xAB
    before = snapshot(d)
    s.send(src[2:], is_last=True)  # chunk 2, after the end: must not land
    # A later room to the same decode session is written on the same transfer thread, after
    # anything chunk 2 could have started: once it succeeded, chunk 2 had its chance.
    transfer_room(p, d, pd.bootstrap, 31, [20], [40], chunk=1)
    assert wait_rooms(d.client, [31], timeout=BOUND) == [KVPoll.Success]
    assert d.pages_equal(p, [20], [40])
    for kv, b in zip(d.kv, before, strict=True):
        b[40] = kv[40]
    assert unchanged(d, before), "chunk 2 wrote into released pages"
    assert s.poll() == KVPoll.Failed and r.poll() == KVPoll.Failed


def test_k22_an_engine_dropping_an_unfinished_room_cancels_the_prefill_writer(
        tmp_path: Path, stack: Cleanup) -> None:
    """D's engine clears a room P is bound to (it drops the request): P hears the end at
    once (its room fails, ``aborted``), confirms nothing is in flight, and D's pages are
    releasable and the clear completes, far before the 120 s waiting timeout."""
    pd = pair(stack, tmp_path, d_opts={"waiting_timeout": 120.0})
    p, d = pd.p_engine, pd.d_engine
    r = Receiver(d.client, 32, pd.bootstrap)
    r.init([0, 1], 0)
    s = Sender(p.client, 32)
    s.init(2, 0)
    until(lambda: s.poll() == KVPoll.WaitingForInput, "P bound to D's pages")
    r.clear(timeout=BOUND)  # refused until P confirmed, then done
    assert r.poll() == -1  # cleared
    assert ended(s) == KVPoll.Failed
    kind, reason = s.failure()
    assert kind == "aborted" and "cleared before it finished" in reason, (kind, reason)
    assert failures(pd.decode, "aborted") == 1
    s.send([2, 3])  # the prefill engine's chunks come late: nothing is written
    transfer_room(p, d, pd.bootstrap, 33, [4], [5], chunk=1)  # the barrier
    assert wait_rooms(d.client, [33], timeout=BOUND) == [KVPoll.Success]
    assert not d.pages_equal(p, [2, 3], [0, 1])


SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=16)


def test_k22b_a_late_prefill_rank_writes_nothing_after_another_aborted(
        tmp_path: Path, stack: Cleanup) -> None:
    """Prefill TP 2 -> decode TP 1: rank 0 aborts R; rank 1 creates its sender later and
    sends: it fails at once and writes nothing; D's pages are releasable once both ranks
    confirmed, and later rooms through rank 1 land exactly."""
    source = SPEC.global_kv(7)
    p0 = daemon(stack, "prefill", tmp_path, serve_bootstrap=True, attn_tp_size=2,
                attn_tp_rank=0)
    p1 = daemon(stack, "prefill", tmp_path, bootstrap_addr=p0.http_addr, attn_tp_size=2,
                attn_tp_rank=1)
    d = daemon(stack, "decode", tmp_path, waiting_timeout=120.0)
    e0 = shard(stack, p0, SPEC, 0, 2, source=source, seed=1)
    e1 = shard(stack, p1, SPEC, 1, 2, source=source, seed=2)
    de = shard(stack, d, SPEC, 0, 1, seed=3)
    before = snapshot(de)
    r = Receiver(de.client, 40, p0.http_addr)
    r.init([0, 1], 0)
    s0 = Sender(e0.client, 40)
    until(lambda: s0.poll() == KVPoll.WaitingForInput, "rank 0 bound to D's pages")
    s0.abort("rank 0 gave up")
    assert ended(r) == KVPoll.Failed
    kind, reason = r.failure()
    assert kind == "aborted" and "rank 0 gave up" in reason, (kind, reason)
    until(r.releasable, "D's pages releasable (both prefill ranks confirmed)")
    time.sleep(1.0)  # rank 1's sender comes later
    s1 = Sender(e1.client, 40)
    assert s1.poll() == KVPoll.Failed  # the abort reached rank 1 before its sender existed
    s1.init(2, 0)
    s1.send([3, 4])
    assert s1.poll() == KVPoll.Failed
    # A later room through both ranks: rank 1's writes to D go on the same thread after
    # anything room 40 could have started there.
    senders = []
    r2 = Receiver(de.client, 41, p0.http_addr)
    r2.init([6, 7], 1)
    for e in (e0, e1):
        s = Sender(e.client, 41)
        s.init(2, 1)
        s.send([9, 10])
        senders.append(s)
    assert ended(r2) == KVPoll.Success
    assert de.holds(source, [9, 10], [6, 7])
    for buf, b in zip(de.buffers, before, strict=True):
        b.reshape(SPEC.num_pages, -1)[[6, 7]] = buf.reshape(SPEC.num_pages, -1)[[6, 7]]
    assert unchanged(de, before), "a prefill rank wrote into the aborted room's pages"


# ---- K23: failure categories come from types, not text ------------------------------------


def test_k23_a_refused_batch_counts_as_transport_on_both_sides(
        tmp_path: Path, stack: Cleanup) -> None:
    """The real engine's submission of one batch is refused on every try while the decode
    is alive: the room fails as ``transport`` on P and D (kind, metric), never as
    ``unreachable``; the session stays usable."""
    pd = pair(stack, tmp_path, p_opts={"fault_injection": _faults(fail_batches=[0]),
                                       "transient_retry_s": 0.2})
    p, d = pd.p_engine, pd.d_engine
    _send, r = transfer_room(p, d, pd.bootstrap, 50, [2], [1], chunk=1)
    assert ended(r) == KVPoll.Failed
    assert r.failure()[0] == "transport", r.failure()
    assert ended(_send) == KVPoll.Failed and _send.failure() == r.failure()
    for x in (pd.prefill, pd.decode):
        assert failures(x, "transport") == 1
        assert failures(x, "unreachable") == 0
    transfer_room(p, d, pd.bootstrap, 51, [3], [4], chunk=1)
    assert wait_rooms(d.client, [51], timeout=BOUND) == [KVPoll.Success]
    assert d.pages_equal(p, [3], [4])


def test_k23_failure_categories_on_real_daemons(tmp_path: Path, stack: Cleanup) -> None:
    """The categories the other tests of this file do not produce (``transport``,
    ``aborted``, ``bootstrap``, ``layout``, ``duplicate``, ``timeout``, ``heartbeat``),
    each from its own cause on one pair, each counted under its own label on the decode
    (and on the prefill where it decided). (``registration``: K25, K30; ``peer``: K28;
    ``unreachable``: K32.)"""
    pd = pair(stack, tmp_path,
              p_opts={"fault_injection": _faults(fail_batches=[0]), "transient_retry_s": 0.2},
              d_opts={"waiting_timeout": 3.0, "heartbeat_interval": 1.0,
                      "heartbeat_max_failures": 2, "bootstrap_retry_budget": 1.0,
                      "http_timeout": 0.5})
    p, d = pd.p_engine, pd.d_engine
    got: dict[str, str] = {}
    _s, r = transfer_room(p, d, pd.bootstrap, 1, [1], [1], chunk=1)  # batch 0 is refused
    assert ended(r) == KVPoll.Failed
    got["transport"] = r.failure()[0]
    r = Receiver(d.client, 2, pd.bootstrap)
    r.init([2], 2)
    r.abort("the client went away")
    got["aborted"] = r.failure()[0]
    r = Receiver(d.client, 3, f"127.0.0.1:{free_port()}")  # nobody serves bootstrap there
    assert ended(r) == KVPoll.Failed
    got["bootstrap"] = r.failure()[0]
    r = Receiver(d.client, 4, pd.bootstrap)
    r.init([4], 4)
    s = Sender(p.client, 4)
    s.init(1, 0)
    until(lambda: s.poll() == KVPoll.WaitingForInput, "P bound to D's pages")
    with pytest.raises(RoomError):
        s.send([p.num_pages + 1])  # outside P's pool: fails the room (P decides)...
    assert s.failure()[0] == "layout"
    assert ended(r) == KVPoll.Failed  # ... and the decode hears it at once
    got["layout"] = r.failure()[0]
    s, r = transfer_room(p, d, pd.bootstrap, 5, [5], [5], chunk=1)
    assert ended(r) == KVPoll.Success
    r.clear()  # P still holds room 5 (Success): a new receiver for it is a duplicate
    r = Receiver(d.client, 5, pd.bootstrap)
    r.init([6], 6)
    assert ended(r) == KVPoll.Failed
    got["duplicate"] = r.failure()[0]
    r = Receiver(d.client, 6, pd.bootstrap)  # P's engine never creates room 6
    r.init([7], 7)
    assert ended(r) == KVPoll.Failed
    got["timeout"] = r.failure()[0]
    for kind in ("layout", "transport"):
        assert failures(pd.prefill, kind) == 1, kind
    r = Receiver(d.client, 7, pd.bootstrap)
    r.init([8], 8)
    until(lambda: r.poll() == KVPoll.WaitingForInput, "room 7 sent its pages")
    pd.prefill.kill(signal.SIGSTOP)  # heartbeats go unanswered
    assert ended(r) == KVPoll.Failed
    got["heartbeat"] = r.failure()[0]
    assert got == {k: k for k in got}, got
    for kind in got:
        assert failures(pd.decode, kind) == 1, kind
    assert failures(pd.decode, "unreachable") == 0


# ---- K24: a frozen decode must not stall others -------------------------------------------


def test_k24_a_frozen_decode_does_not_stall_another(tmp_path: Path, stack: Cleanup) -> None:
    """One P, two decodes. P is writing a 32 MiB room into D1 when D1 is frozen (SIGSTOP):
    a 1-page room to D2 (P's first transfer to it) still succeeds; D1's room fails by P's
    transfer deadline; after SIGCONT a new room to D1 succeeds.

    P already wrote to D1 once (its transfer session is open), as when D1 froze mid-room.
    Batches to D1 are delayed 0.5 s by the fault wrapper so that D1 is frozen before the
    bytes go; the room to D2 starts once the real engine is inside its write to D1."""
    d1 = daemon(stack, "decode", tmp_path)
    d2 = daemon(stack, "decode", tmp_path)
    p = daemon(stack, "prefill", tmp_path, serve_bootstrap=True, transfer_timeout=3.0,
               fault_injection=_faults(delay_s=0.5, peers=[d1.ready["session_id"]]))
    pe = engine(stack, p, seed=1, num_pages=1024)
    e1 = engine(stack, d1, seed=2, num_pages=1024)
    e2 = engine(stack, d2, seed=3)
    _s0, r0 = transfer_room(pe, e1, p.http_addr, 59, [1], [1], chunk=1)  # D1 is known
    assert ended(r0) == KVPoll.Success
    big = np.arange(1024)
    assert sum(kv[big].nbytes for kv in pe.kv) == 32 << 20
    r1 = Receiver(e1.client, 60, p.http_addr)
    r1.init(big, int(big[0]))
    s1 = Sender(pe.client, 60)
    s1.init(1024, 0)
    until(lambda: s1.poll() == KVPoll.WaitingForInput, "P bound to D1's pages")
    s1.send(big)  # one 32 MiB chunk: its write starts now
    d1.kill(signal.SIGSTOP)
    time.sleep(1.0)  # the 0.5 s delay is over: the write to D1 is in the real engine
    assert s1.poll() == KVPoll.Transferring
    _s2, r2 = transfer_room(pe, e2, p.http_addr, 61, [4], [3], chunk=1)
    assert ended(r2) == KVPoll.Success, r2.failure()
    assert e2.pages_equal(pe, [4], [3])
    assert ended(s1) == KVPoll.Failed  # by P's transfer deadline, D1 still frozen
    assert s1.failure()[0] == "timeout", s1.failure()
    d1.kill(signal.SIGCONT)
    assert ended(r1) == KVPoll.Failed
    assert r1.wait(BOUND) == KVPoll.Failed and r1.releasable()
    r1.clear()
    _s3, r3 = transfer_room(pe, e1, p.http_addr, 62, [7, 8], [5, 6], chunk=1)
    assert ended(r3) == KVPoll.Success, r3.failure()
    assert e1.pages_equal(pe, [7, 8], [5, 6])


# ---- K25: every byte the decode will read is written --------------------------------------


def test_k25_a_layer_the_decode_reads_is_written_or_the_pair_is_refused(
        tmp_path: Path, stack: Cleanup) -> None:
    """P registers 4 layers, D 5: the pair is refused at registration, naming the layers;
    the room never reports Success on either side and no byte lands in D's pool."""
    pd = pair(stack, tmp_path, engine_opts={"num_layers": 4},
              d_engine_opts={"num_layers": 5})
    p, d = pd.p_engine, pd.d_engine
    assert len(p.kv) == 8 and len(d.kv) == 10
    before = snapshot(d)
    s, r = transfer_room(p, d, pd.bootstrap, 70, [2, 3], [1, 2], chunk=2)
    assert ended(r) == KVPoll.Failed and ended(s) == KVPoll.Failed
    kind, reason = r.failure()
    assert kind == "registration" and "layer" in reason, (kind, reason)
    assert s.failure()[0] == "registration", s.failure()
    assert r.wait(BOUND) == KVPoll.Failed and r.releasable()
    assert unchanged(d, before)
    peers = status(pd.prefill)["peers"]
    assert [x["state"] for x in peers] == ["rejected"] and "layer" in peers[0]["detail"]


# ---- K26: a room id reused by a retry -----------------------------------------------------


def test_k26_a_retry_with_the_same_room_id_is_its_own_attempt(tmp_path: Path,
                                                              stack: Cleanup) -> None:
    """P's batches take 2 s. Attempt 1 of R is being written when D aborts it; the router
    retries R at once with new pages. Attempt 2's receiver is refused with an explicit
    error until attempt 1's write returned; then attempt 2 succeeds on both sides, its
    bytes in its own pages, and attempt 1's late report never decides it."""
    pd = pair(stack, tmp_path, p_opts={"fault_injection": _faults(delay_s=2.0)})
    p, d = pd.p_engine, pd.d_engine
    r1 = Receiver(d.client, 80, pd.bootstrap)
    r1.init([0, 1, 2, 3], 0)
    s1 = Sender(p.client, 80)
    s1.init(4, 0)
    until(lambda: s1.poll() == KVPoll.WaitingForInput, "P bound to attempt 1's pages")
    s1.send([20, 21, 22, 23])  # a 2 s write starts
    time.sleep(0.3)
    r1.abort("router retries")
    assert r1.poll() == KVPoll.Failed
    time.sleep(0.2)
    # the retry: the prefill engine creates the room again at once...
    assert ended(s1) == KVPoll.Failed
    s1.clear()
    s2 = Sender(p.client, 80)
    s2.init(4, 0)
    # ... the decode side's new receiver is refused until attempt 1 has quiesced
    with pytest.raises(RoomError, match="not releasable"):
        Receiver(d.client, 80, pd.bootstrap)
    assert not r1.releasable()
    assert r1.wait(BOUND) == KVPoll.Failed and r1.releasable()  # attempt 1's write returned
    r2 = Receiver(d.client, 80, pd.bootstrap)
    r2.init([10, 11, 12, 13], 10)
    s2.send([24, 25, 26, 27])
    assert ended(r2) == KVPoll.Success, r2.failure()
    assert ended(s2) == KVPoll.Success, s2.failure()
    assert d.pages_equal(p, [24, 25, 26, 27], [10, 11, 12, 13])


# ---- K27: a long wait is not a dead engine ------------------------------------------------


class _Engine(StandInPool):
    """A stand-in engine whose client has a short RPC timeout."""

    def __init__(self, socket: str, timeout: float, **pool: Any) -> None:
        super().__init__(**pool)
        self.client = KvdClient(socket, timeout=timeout)
        self.info = self.client.call(self.registration)

    def close(self) -> None:
        self.client.close()
        super().close()


def test_k27_a_long_wait_and_a_reconnect_keep_the_engine(tmp_path: Path,
                                                         stack: Cleanup) -> None:
    """An engine client with a 2 s RPC timeout waits 5 s on a room whose prefill is slow
    while another room is in flight: ``wait`` answers the room's real state, the next
    call works, the other room succeeds, kvd never sees the engine as gone. A dropped
    connection and a reconnect of the same engine keep its registration and rooms."""
    pd = pair(stack, tmp_path, p_opts={"fault_injection": _faults(delay_s=1.0)})
    p = pd.p_engine
    pd.d_engine.close()  # the decode engine of this test has a short RPC timeout
    d = _Engine(pd.decode.socket, timeout=2.0, seed=5)
    pd.d_engine = d  # type: ignore[assignment]  # closed by stop_pair
    mark = len(pd.decode.log.read_text())  # the log from here on
    slow = Receiver(d.client, 90, pd.bootstrap)  # its prefill engine has not started yet
    slow.init([1, 2], 1)
    _s2, r2 = transfer_room(p, d, pd.bootstrap, 91, [5, 6], [3, 4], chunk=1)  # in flight
    assert slow.wait(5.0) == KVPoll.WaitingForInput  # longer than the client's timeout
    assert r2.wait(BOUND) == KVPoll.Success  # the next call works
    assert d.pages_equal(p, [5, 6], [3, 4])
    # the connection drops (the engine's socket closes without a goodbye) and comes back
    d.client._drop()
    assert d.client.reconnects == 0
    assert slow.poll() == KVPoll.WaitingForInput  # reconnects, replays its registration
    assert d.client.reconnects == 1
    s = Sender(p.client, 90)
    s.init(2, 0)
    s.send([7, 8])
    assert slow.wait(BOUND) == KVPoll.Success
    assert d.pages_equal(p, [7, 8], [1, 2])
    assert health(pd.decode)["engine_registered"]
    log = pd.decode.log.read_text()[mark:]
    assert "reconnected: registration and rooms kept" in log
    assert "engine disconnected" not in log


# ---- K28: messages from an old instance of a peer -----------------------------------------


def _restart(stack: Cleanup, old: DaemonProcess, tmp: Path, **settings: Any) -> DaemonProcess:
    """SIGKILL ``old`` and start the same role again with ``settings`` (same ports)."""
    old.kill(signal.SIGKILL)
    old.proc.wait(10)
    return daemon(stack, old.ready["role"], tmp, **settings)


def test_k28_a_restarted_decode_is_never_written_for_its_old_rooms(
        tmp_path: Path, stack: Cleanup) -> None:
    """D gave P its pages for R1 and R2, then is SIGKILLed and restarted on the same
    control, HTTP and transfer ports (the same transfer session address) with a fresh
    engine. P's engine sends R2 before the new instance registered, and R1 after: both
    fail on P (R1 as ``peer``) and no byte of either lands in the new D; the new D's own
    room through the same session lands exactly."""
    ports = {"zmq_port": free_port(), "http_port": free_port(),
             "transfer_port_range": transfer_ports()}
    pd = pair(stack, tmp_path, d_opts=ports)
    p = pd.p_engine
    senders = {}
    for room, dst in ((100, [0, 1]), (102, [2, 3])):
        Receiver(pd.d_engine.client, room, pd.bootstrap).init(dst, int(dst[0]))
        senders[room] = s = Sender(p.client, room)
        s.init(2, 0)
        until(lambda s=s: s.poll() == KVPoll.WaitingForInput, f"P bound R{room} to the old D")
    old_session = pd.decode.ready["session_id"]
    for _ in range(20):  # Mooncake takes the range's two ports in a random order
        pd.decode = _restart(stack, pd.decode, tmp_path, **ports)
        if pd.decode.ready["session_id"] == old_session:
            break
    assert pd.decode.ready["session_id"] == old_session  # the same transfer address
    pd.d_engine.close()  # the old engine went with its daemon
    pd.d_engine = d = engine(stack, pd.decode, seed=5)
    before = snapshot(d)
    senders[102].send([6, 7])  # P does not know yet that D restarted
    assert ended(senders[102]) == KVPoll.Failed
    r2 = Receiver(d.client, 101, pd.bootstrap)  # registers the new instance with P
    r2.init([5], 5)
    assert ended(senders[100]) == KVPoll.Failed
    assert senders[100].failure()[0] == "peer", senders[100].failure()
    senders[100].send([2, 3])  # after the new instance registered: must not land
    s2 = Sender(p.client, 101)  # later on the same transfer session: the barrier
    s2.init(1, 0)
    s2.send([9])
    assert ended(r2) == KVPoll.Success, r2.failure()
    assert d.pages_equal(p, [9], [5])
    for kv, b in zip(d.kv, before, strict=True):
        b[5] = kv[5]
    assert unchanged(d, before), "a room of the old instance was written into the new one"


def test_k28_the_same_decode_registering_again_keeps_its_rooms(tmp_path: Path,
                                                               stack: Cleanup) -> None:
    """Another prefill rank re-registers with the bootstrap server (a new epoch): D drops
    its lookups and registers again with P, the same instance as before. Rooms bound
    before that are still D's: P's Success reaches D (P and D agree), not D's waiting
    timeout."""
    p = daemon(stack, "prefill", tmp_path, serve_bootstrap=True, attn_dp_size=2,
               attn_dp_rank=0)
    d = daemon(stack, "decode", tmp_path, heartbeat_interval=0.5, waiting_timeout=60.0)
    pe, de = engine(stack, p, seed=1), engine(stack, d, seed=2)
    route = f"http://{p.http_addr}/route"
    dp1 = {"role": "Prefill", "attn_dp_size": 2, "attn_dp_rank": 1, "rank_ip": "127.0.0.1",
           "rank_port": free_port(), "instance_id": "dp1", "page_size": 16}
    assert signed("PUT", route, json=dp1).status_code == 200  # DP rank 1 (never used)
    r = Receiver(de.client, 200, p.http_addr, dp_rank=0)
    r.init([1], 1)
    s = Sender(pe.client, 200)
    s.init(1, 0)
    until(lambda: s.poll() == KVPoll.WaitingForInput, "P bound to D's pages")
    until(lambda: [x["heartbeat"] for x in status(d)["peers"]] == ["ok"], "D probed P")
    dp1["rank_port"] = free_port()  # DP rank 1 restarted elsewhere: a new epoch
    assert signed("PUT", route, json=dp1).status_code == 200
    until(lambda: health(d)["tables"]["rank_cache"] == 0, "D saw the new epoch")
    _s2, r2 = transfer_room(pe, de, p.http_addr, 202, [3], [2], chunk=1)  # registers again
    # (an even room: DP rank 0 by room routing)
    assert ended(r2) == KVPoll.Success
    s.send([4])
    assert ended(s) == KVPoll.Success
    assert ended(r) == KVPoll.Success, r.failure()
    assert de.pages_equal(pe, [4, 3], [1, 2])


# ---- K29: an abort reaches every destination ----------------------------------------------


def test_k29_an_abort_reaches_every_destination(tmp_path: Path, stack: Cleanup) -> None:
    """Prefill TP 1 -> decode TP 2: decode rank 0 aborts R; decode rank 1's R fails with
    rank 0's reason (not at its 120 s waiting timeout), and so does P's."""
    source = SPEC.global_kv(3)
    p = daemon(stack, "prefill", tmp_path, serve_bootstrap=True)
    opts = {"attn_tp_size": 2, "waiting_timeout": 120.0}
    d0 = daemon(stack, "decode", tmp_path, attn_tp_rank=0, **opts)
    d1 = daemon(stack, "decode", tmp_path, attn_tp_rank=1, **opts)
    pe = shard(stack, p, SPEC, 0, 1, source=source, seed=1)
    e0 = shard(stack, d0, SPEC, 0, 2, seed=2)
    e1 = shard(stack, d1, SPEC, 1, 2, seed=3)
    r0 = Receiver(e0.client, 110, p.http_addr)
    r0.init([0, 1], 0)
    r1 = Receiver(e1.client, 110, p.http_addr)
    r1.init([2, 3], 2)
    s = Sender(pe.client, 110)
    s.init(2, 0)
    until(lambda: s.poll() == KVPoll.WaitingForInput, "P bound to both decode ranks")
    r0.abort("decode rank 0 gave up")
    assert ended(r1) == KVPoll.Failed
    kind, reason = r1.failure()
    assert kind == "aborted" and "decode rank 0 gave up" in reason, (kind, reason)
    assert ended(s) == KVPoll.Failed and "decode rank 0 gave up" in s.failure()[1]
    for r in (r0, r1):  # nothing was written: both ranks may reuse their pages
        assert r.wait(BOUND) == KVPoll.Failed and r.releasable()
    # the next room through both ranks works
    for r, dst in ((Receiver(e0.client, 111, p.http_addr), [4, 5]),
                   (Receiver(e1.client, 111, p.http_addr), [6, 7])):
        r.init(dst, 1)
    s2 = Sender(pe.client, 111)
    s2.init(2, 1)
    s2.send([8, 9])
    assert ended(s2) == KVPoll.Success, s2.failure()
    until(lambda: e0.holds(source, [8, 9], [4, 5]) and e1.holds(source, [8, 9], [6, 7]),
          "room 111's bytes on both decode ranks")


def _forge(target: str, to_instance: str, msg: object) -> None:
    """Send ``msg`` sealed with the cluster secret for ``to_instance`` to the control
    endpoint ``target`` (what any holder of the secret can do)."""
    from kvd.launch import LAUNCH_SECRET
    from kvd.protocol import control
    from kvd.security import Authenticator

    auth = Authenticator(LAUNCH_SECRET.encode())
    push_frames(target, [auth.seal(control.encode(msg), to_instance)])  # type: ignore[arg-type]


def test_k29_only_a_bound_decode_rank_may_abort(tmp_path: Path, stack: Cleanup) -> None:
    """A registered decode rank that is not bound to R sends P an abort of R: dropped and
    counted; R goes on and succeeds."""
    from kvd.protocol import control

    pd = pair(stack, tmp_path)
    p, d = pd.p_engine, pd.d_engine
    other = daemon(stack, "decode", tmp_path)
    oe = engine(stack, other, seed=9)
    transfer_room(p, oe, pd.bootstrap, 121, [1], [1], chunk=1)  # `other` registers with P
    assert wait_rooms(oe.client, [121], timeout=BOUND) == [KVPoll.Success]
    r = Receiver(d.client, 120, pd.bootstrap)
    r.init([1], 1)
    s = Sender(p.client, 120)
    s.init(1, 0)
    until(lambda: s.poll() == KVPoll.WaitingForInput, "P bound R to D")
    dropped = status(pd.prefill)["totals"].get("dropped_unbound", 0)
    _forge(pd.prefill.ready["control_endpoint"], pd.prefill.ready["instance_id"],
           control.RoomAbort(room=120, inc=0, kind="aborted", reason="not yours",
                             endpoint=other.ready["control_endpoint"],
                             instance_id=other.ready["instance_id"]))
    until(lambda: status(pd.prefill)["totals"].get("dropped_unbound", 0) == dropped + 1,
          "P dropped the abort from a decode rank not bound to R")
    assert s.poll() == KVPoll.WaitingForInput and r.poll() == KVPoll.WaitingForInput
    s.send([2])
    assert ended(r) == KVPoll.Success, r.failure()
    assert d.pages_equal(p, [2], [1])


# ---- K30: a refused pairing fails both sides fast -----------------------------------------


def test_k30_a_refused_pairing_fails_both_sides_at_once(tmp_path: Path,
                                                       stack: Cleanup) -> None:
    """D's KV geometry cannot be served from P's (page size 32 with the same bytes per page
    halves its heads; page sizes alone are re-tiled since issue 22): D's pages for R are
    refused, and R fails on D and on P as ``registration`` (P's bootstrap timeout is the
    default 300 s); a sender created after the refusal fails at once too."""
    pd = pair(stack, tmp_path, engine_opts={"page_size": 16}, d_engine_opts={"page_size": 32})
    p, d = pd.p_engine, pd.d_engine
    s = Sender(p.client, 130)
    r = Receiver(d.client, 130, pd.bootstrap)
    r.init([1], 1)
    assert ended(r) == KVPoll.Failed and ended(s) == KVPoll.Failed
    assert r.failure()[0] == "registration" and s.failure()[0] == "registration", \
        (r.failure(), s.failure())
    assert "incompatible KV layouts" in r.failure()[1], r.failure()
    r2 = Receiver(d.client, 131, pd.bootstrap)  # the sender comes after the refusal
    r2.init([2], 2)
    assert ended(r2) == KVPoll.Failed
    s2 = Sender(p.client, 131)
    assert s2.poll() == KVPoll.Failed and s2.failure()[0] == "registration"
    assert failures(pd.prefill, "timeout") == 0 and failures(pd.decode, "timeout") == 0


# ---- K31: background loops survive and forget ---------------------------------------------


def test_k31_a_dead_prefill_is_forgotten_after_peer_ttl(tmp_path: Path,
                                                        stack: Cleanup) -> None:
    """D used two prefills; one dies: D's heartbeats see it down, and once its address has
    been unused for ``peer_ttl`` D forgets it: no more probes (its miss counter stops), no
    control socket, no log lines, no status row; the live prefill is still probed and its
    rooms still work."""
    # a probe's time limit is the heartbeat interval: 1 s keeps the live prefill's probes
    # answered on a busy machine; peer_ttl leaves time to see the dead prefill down first
    hb = {"heartbeat_interval": 1.0, "heartbeat_max_failures": 2, "peer_ttl": 6.0,
          "waiting_timeout": 120.0}
    pd = pair(stack, tmp_path, d_opts=hb)
    p, d = pd.p_engine, pd.d_engine
    gone = daemon(stack, "prefill", tmp_path, serve_bootstrap=True)
    ge = engine(stack, gone, seed=4)
    gone_addr = gone.http_addr
    _s, r0 = transfer_room(p, d, pd.bootstrap, 140, [1], [1], chunk=1)
    _g, g0 = transfer_room(ge, d, gone_addr, 141, [2], [2], chunk=1)
    assert ended(r0) == KVPoll.Success and ended(g0) == KVPoll.Success
    live = Receiver(d.client, 142, pd.bootstrap)  # keeps P in use
    live.init([3], 3)

    def rows() -> set[str]:
        return {x["bootstrap"] for x in status(pd.decode)["peers"]}

    assert rows() == {pd.bootstrap, gone_addr}
    assert health(pd.decode)["tables"]["control_sockets"] == 2
    gone.kill(signal.SIGKILL)
    gone.proc.wait(10)
    until(lambda: any(x["heartbeat"] == "down" for x in status(pd.decode)["peers"]),
          "the dead prefill seen down")
    until(lambda: rows() == {pd.bootstrap}, "the dead prefill forgotten")
    h = health(pd.decode)
    assert h["tables"]["health"] == 1
    assert h["tables"]["control_sockets"] == 1, h["tables"]  # its socket is closed
    misses = heartbeat_misses(pd.decode, gone_addr)
    assert misses >= 2
    lines = pd.decode.log.read_text().count(gone_addr)
    time.sleep(3.0)  # three heartbeat periods
    h = health(pd.decode)
    assert heartbeat_misses(pd.decode, gone_addr) == misses  # no more probes of it
    assert pd.decode.log.read_text().count(gone_addr) == lines  # no more log lines
    assert [x["heartbeat"] for x in status(pd.decode)["peers"]] == ["ok"]  # P still probed
    assert h["counters"]["loop_errors"] == 0
    Sender(p.client, 142).init(1, 0)
    Sender.attach(p.client, 142).send([5])
    assert ended(live) == KVPoll.Success and d.pages_equal(p, [5], [3])


# ---- K32: every room ends by its deadline, whatever happens to its tasks -------------------


def test_k32_rooms_whose_messages_cannot_be_delivered_end_at_the_send_timeout(
        tmp_path: Path, stack: Cleanup) -> None:
    """P has just died (SIGKILL: its connections are closed); two new rooms send their
    pages towards it: both fail with a reason naming P's control endpoint (kind
    ``unreachable``), not at the 120 s waiting timeout (heartbeats are off: 120 s)."""
    pd = pair(stack, tmp_path, d_opts={"control_send_timeout": 1.0,
                                       "heartbeat_interval": 120.0,
                                       "waiting_timeout": 120.0})
    p, d = pd.p_engine, pd.d_engine
    transfer_room(p, d, pd.bootstrap, 150, [1], [1], chunk=1)  # D registered with P
    assert wait_rooms(d.client, [150], timeout=BOUND) == [KVPoll.Success]
    endpoint = pd.prefill.ready["control_endpoint"]
    pd.prefill.kill(signal.SIGKILL)
    pd.prefill.proc.wait(10)
    rooms = [Receiver(d.client, room, pd.bootstrap) for room in (151, 152)]
    for i, r in enumerate(rooms):
        r.init([2 + i], 2 + i)
    for r in rooms:
        assert ended(r) == KVPoll.Failed
        kind, reason = r.failure()
        assert kind == "unreachable" and endpoint in reason, (kind, reason)
        assert r.releasable()  # the pages never left
    assert failures(pd.decode, "timeout") == 0


# ---- K33: several samples of one request share a room -------------------------------------


def test_k33_a_refused_second_receiver_never_inherits_the_first(
        room_pair: PdPair, room_ids: Iterator[int]) -> None:
    """Two receivers for one active room (two samples of one request): the second is
    refused at creation, nothing is ever written to its pages and nothing reports on its
    behalf; the first succeeds with its own bytes."""
    p, d = room_pair.p_engine, room_pair.d_engine
    room = next(room_ids)
    first = Receiver(d.client, room, room_pair.bootstrap)
    first.init([210, 211], 210)
    second_pages = [212, 213]
    before = [kv[second_pages].copy() for kv in d.kv]
    with pytest.raises(RoomError, match="already active"):
        Receiver(d.client, room, room_pair.bootstrap)
    with pytest.raises(RoomError, match="init called twice"):  # nor may it give pages
        d.client.call(rpc.ReceiverInit(room=room, dst_pages=np.asarray(
            second_pages, "<i4").tobytes(), aux_index=0))
    s = Sender(p.client, room)
    s.init(2, 0)
    s.send([7, 8])
    assert ended(first) == KVPoll.Success
    assert d.pages_equal(p, [7, 8], [210, 211])
    assert all(np.array_equal(kv[second_pages], b) for kv, b in zip(d.kv, before, strict=True))
    assert all(f["room"] != room for f in status(room_pair.decode)["recent_failures"])
    first.clear()
    s.clear()


# ---- K34: a cancellation that arrives before the room exists ------------------------------


def test_k34_an_abort_before_the_sender_exists_fails_it_at_once(
        room_pair: PdPair, room_ids: Iterator[int]) -> None:
    """D's engine aborts R before P's engine created Sender(R): once the abort reached P,
    Sender(R) is Failed at its creation with D's reason (P's bootstrap timeout is the
    default 300 s)."""
    p, d = room_pair.p_engine, room_pair.d_engine
    room = next(room_ids)
    r = Receiver(d.client, room, room_pair.bootstrap)
    r.init([220], 220)
    until(lambda: health(room_pair.prefill)["tables"]["pending"] >= 1,
          "D's pages buffered on P")
    base = health(room_pair.prefill)["tables"]["early_aborts"]
    r.abort("prefix hit")
    assert r.poll() == KVPoll.Failed
    until(lambda: health(room_pair.prefill)["tables"]["early_aborts"] > base,
          "the abort kept on P")
    s = Sender(p.client, room)
    assert s.poll() == KVPoll.Failed
    kind, reason = s.failure()
    assert kind == "aborted" and "prefix hit" in reason, (kind, reason)
    assert r.wait(BOUND) == KVPoll.Failed and r.releasable()
    r.clear()
    s.clear()


def test_k34_an_abort_from_a_restarted_decode_still_reaches_the_prefill(
        tmp_path: Path, stack: Cleanup) -> None:
    """D gave P its pages for R and is then SIGKILLed and restarted (same ports): it does
    not know R, yet its engine's abort of R, naming the bootstrap address, reaches P, and
    Sender(R) fails at once with that reason."""
    ports = {"zmq_port": free_port(), "http_port": free_port()}
    pd = pair(stack, tmp_path, d_opts=ports)
    p = pd.p_engine
    Receiver(pd.d_engine.client, 180, pd.bootstrap).init([1], 1)
    until(lambda: health(pd.prefill)["tables"]["pending"] == 1, "D's pages buffered on P")
    pd.decode = _restart(stack, pd.decode, tmp_path, **ports)
    pd.d_engine.close()
    pd.d_engine = d = engine(stack, pd.decode, seed=3)
    d.client.call(rpc.Abort(room=180, reason="cancelled by the router",
                            bootstrap_addr=pd.bootstrap))
    until(lambda: health(pd.prefill)["tables"]["early_aborts"] == 1, "the abort kept on P")
    s = Sender(p.client, 180)
    assert s.poll() == KVPoll.Failed
    kind, reason = s.failure()
    assert kind == "aborted" and "cancelled by the router" in reason, (kind, reason)
    assert health(pd.prefill)["tables"]["pending"] == 0  # the old instance's pages dropped
    # the restarted decode's own rooms work
    transfer_room(p, d, pd.bootstrap, 181, [4], [5], chunk=1)
    assert wait_rooms(d.client, [181], timeout=BOUND) == [KVPoll.Success]
    assert d.pages_equal(p, [4], [5])
