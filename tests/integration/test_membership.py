"""Membership cases (K37, K38, K41) on real daemon processes: real restarts on the same
ports, a real SIGTERM deregistration, thousands of real dead addresses. The same cases
run deterministically in ``tests/inproc/test_membership.py``.

No wall-clock bounds: "poll until, within a generous bound".
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvd.client import KVPoll, Receiver
from kvd.protocol import rpc
from kvd.refengine.standin import transfer_room
from tests.conftest import free_port, health
from tests.integration.test_second_round import (
    Cleanup,
    daemon,
    ended,
    engine,
    status,
    until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def stack() -> Iterator[Cleanup]:
    with Cleanup() as s:
        yield s


def _row(d: object, addr: str) -> dict[str, object] | None:
    rows = [x for x in status(d)["peers"] if x["bootstrap"] == addr]  # type: ignore[arg-type]
    return rows[0] if rows else None


def test_k37_a_room_after_a_prefill_restart_succeeds_without_waiting_for_a_heartbeat(
        tmp_path: Path, stack: Cleanup) -> None:
    """P is SIGKILLed; D's heartbeat sees it down (the room bound to it fails). P comes
    back on the same ports as a new instance: D's next room looks P up fresh, the /route
    answer names the new instance and the room succeeds, byte for byte. (D's heartbeat
    period, 6 s, is far longer than the restart: before, that room failed at once as
    "down" until a heartbeat answered.)"""
    ports = {"zmq_port": free_port(), "http_port": free_port()}
    p = daemon(stack, "prefill", tmp_path, serve_bootstrap=True, **ports)
    d = daemon(stack, "decode", tmp_path, heartbeat_interval=6.0, heartbeat_max_failures=1,
               bootstrap_retry_budget=5.0, waiting_timeout=120.0)
    pe, de = engine(stack, p, seed=1), engine(stack, d, seed=2)
    s1, r1 = transfer_room(pe, de, p.http_addr, 1, [1], [1], chunk=1)
    assert ended(r1) == KVPoll.Success
    until(lambda: (_row(d, p.http_addr) or {}).get("last_heartbeat"), "D probed P once", 30)
    bound = Receiver(de.client, 2, p.http_addr)  # bound to the old instance
    bound.init([2], 2)
    old = p.ready["instance_id"]
    p.kill(signal.SIGKILL)
    p.proc.wait(10)
    until(lambda: (_row(d, p.http_addr) or {}).get("heartbeat") == "down", "D saw P down", 30)
    assert ended(bound) == KVPoll.Failed
    pe.close()
    p2 = daemon(stack, "prefill", tmp_path, serve_bootstrap=True, **ports)
    assert p2.ready["instance_id"] != old
    pe2 = engine(stack, p2, seed=3)
    until(lambda: httpx.get(f"http://{p2.http_addr}/ready").status_code == 200, "P registered")
    _s, r3 = transfer_room(pe2, de, p2.http_addr, 3, [5], [3], chunk=1)
    assert ended(r3) == KVPoll.Success, r3.failure()
    assert de.pages_equal(pe2, [5], [3])
    after = _row(d, p2.http_addr)
    assert after is not None and after["instance_id"] == p2.ready["instance_id"]
    assert bound.failure()[0] in ("heartbeat", "peer")
    del s1


def test_k38_a_lost_dp_group_fails_only_its_rooms(tmp_path: Path, stack: Cleanup) -> None:
    """Prefill attn DP 2; group 1's rank gets SIGTERM (deregistered). A decode started
    afterwards fills a room of group 0; a room of group 1 fails within its lookup budget
    naming the group; group 1 started again: its rooms succeed, nothing else restarted."""
    p0 = daemon(stack, "prefill", tmp_path, serve_bootstrap=True, attn_dp_size=2,
                attn_dp_rank=0)
    p1 = daemon(stack, "prefill", tmp_path, bootstrap_addr=p0.http_addr, attn_dp_size=2,
                attn_dp_rank=1)
    e0, e1 = engine(stack, p0, seed=1), engine(stack, p1, seed=2)
    until(lambda: httpx.get(f"http://{p1.http_addr}/ready").status_code == 200, "P1 ready")
    e1.close()
    p1.stop()  # SIGTERM: deregisters
    d = daemon(stack, "decode", tmp_path, bootstrap_retry_budget=2.0)
    de = engine(stack, d, seed=3)
    _s, r10 = transfer_room(e0, de, p0.http_addr, 10, [4], [1], chunk=1)  # 10 % 2: group 0
    assert ended(r10) == KVPoll.Success, r10.failure()
    assert de.pages_equal(e0, [4], [1])
    r11 = Receiver(de.client, 11, p0.http_addr)  # group 1
    r11.init([2], 2)
    assert ended(r11) == KVPoll.Failed
    kind, reason = r11.failure()
    assert kind == "bootstrap" and "DP group 1 has 0/1 ranks" in reason, reason
    p1b = daemon(stack, "prefill", tmp_path, bootstrap_addr=p0.http_addr, attn_dp_size=2,
                 attn_dp_rank=1)
    e1b = engine(stack, p1b, seed=4)
    until(lambda: httpx.get(f"http://{p1b.http_addr}/ready").status_code == 200, "P1 back")
    _s, r13 = transfer_room(e1b, de, p0.http_addr, 13, [6], [3], chunk=1)  # group 1
    assert ended(r13) == KVPoll.Success, r13.failure()
    assert de.pages_equal(e1b, [6], [3])


def test_k41_thousands_of_dead_bootstraps_keep_health_answered(
        tmp_path: Path, stack: Cleanup) -> None:
    """One Many of 4 096 ReceiverCreate calls naming 4 096 distinct dead bootstrap
    addresses (loopback, nobody listens). Throughout, D answers /health, and a heartbeat
    round never probes more than the cap (20/s x 0.5 s = 10 targets); every room fails
    within its lookup budget, then D forgets every address."""
    d = daemon(stack, "decode", tmp_path, heartbeat_interval=0.5,
               heartbeat_max_probes_per_s=20.0, bootstrap_retry_budget=1.0)
    de = engine(stack, d, seed=2)
    rooms = list(range(5000, 5000 + 4096))
    calls = [rpc.ReceiverCreate(room=r, bootstrap_addr=f"127.1.{i // 250}.{1 + i % 250}:9",
                                dp_rank=None) for i, r in enumerate(rooms)]
    out = de.client.call_many(calls)  # type: ignore[arg-type]
    assert all(o is None for o in out)
    targets: list[int] = []

    def all_failed() -> bool:
        h = health(d)  # answered every time (raises, failing the test, otherwise)
        targets.append(int(h["tables"]["heartbeat_targets"]))
        res = de.client.call(rpc.Poll(rooms=rooms))
        return all(s == int(KVPoll.Failed) for s in res.statuses)

    until(all_failed, "every room failed", timeout=120, interval=0.2)
    assert max(targets) <= 10, targets
    until(lambda: health(d)["tables"]["health"] == 0, "every dead address forgotten", 60)
    assert health(d)["tables"]["heartbeat_targets"] == 0
