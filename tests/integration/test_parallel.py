"""TP/MLA/PP/DP parity with real daemons and real Mooncake TCP: every room's destination
bytes equal the expected re-sharding (cases K08, K11, K12, K14, K15, K20)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender, poll_many
from kvd.launch import DaemonProcess, start_daemon
from kvd.refengine.standin import ModelSpec, ShardStandIn

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class Cluster:
    """Prefill ranks (tp x dp x pp, rank (0,0,0) serves bootstrap) and decode ranks (tp)."""

    spec: ModelSpec
    source: np.ndarray
    prefill: dict[tuple[int, int, int], tuple[DaemonProcess, ShardStandIn]] = \
        field(default_factory=dict)
    decode: list[tuple[DaemonProcess, ShardStandIn]] = field(default_factory=list)
    bootstrap: str = ""

    def stop(self) -> None:
        for daemon, engine in [*self.prefill.values(), *self.decode]:
            engine.close()
            daemon.stop()


def _layers(pp_rank: int, pp: int, total: int) -> tuple[int, int]:
    per = total // pp
    return pp_rank * per, per


def start_cluster(tmp: Path, spec: ModelSpec, p_tp: int = 1, d_tp: int = 1, p_pp: int = 1,
                  p_dp: int = 1, p_opts: dict | None = None, d_opts: dict | None = None,
                  d_scale: float = 1.0) -> Cluster:
    c = Cluster(spec, spec.global_kv(seed=42))
    keys = [(dp, tp, pp) for dp in range(p_dp) for tp in range(p_tp) for pp in range(p_pp)]
    for dp, tp, pp in keys:
        first = not (dp or tp or pp)
        opts = {"attn_tp_size": p_tp, "attn_tp_rank": tp, "attn_dp_size": p_dp,
                "attn_dp_rank": dp, "pp_size": p_pp, "pp_rank": pp, **(p_opts or {})}
        opts |= {"serve_bootstrap": True} if first else {"bootstrap_addr": c.bootstrap}
        daemon = start_daemon("prefill", tmp, **opts)
        if first:
            c.bootstrap = daemon.http_addr
        start, n = _layers(pp, p_pp, spec.num_layers)
        engine = ShardStandIn(daemon.socket, spec, tp, p_tp, start, n, source=c.source,
                              seed=dp * 100 + tp * 10 + pp)
        c.prefill[(dp, tp, pp)] = (daemon, engine)
    for tp in range(d_tp):
        daemon = start_daemon("decode", tmp, attn_tp_size=d_tp, attn_tp_rank=tp,
                              **(d_opts or {}))
        c.decode.append((daemon, ShardStandIn(daemon.socket, spec, tp, d_tp, seed=1000 + tp,
                                              item_len_scale=d_scale)))
    return c


def run_room(c: Cluster, room: int, src: np.ndarray, dst: np.ndarray, dp: int,
             dp_rank: int | None = None, chunk: int = 3) -> tuple[list, list]:
    receivers = []
    for _, e in c.decode:
        r = Receiver(e.client, room, c.bootstrap, dp_rank)
        r.init(dst, room % e.spec.aux_slots)
        receivers.append(r)
    senders = []
    for (pdp, _, _), (_, e) in c.prefill.items():
        if pdp != dp:
            continue
        e.aux[room % e.spec.aux_slots] = room % 251
        s = Sender(e.client, room)
        s.init(len(src), room % e.spec.aux_slots)
        for i in range(0, len(src), chunk):
            s.send(src[i:i + chunk])
        senders.append(s)
    return senders, receivers


def _wait(rooms: list, timeout: float = 20) -> list:
    return [r.wait(timeout) for r in rooms]


def _pages(spec: ModelSpec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(spec.num_pages)[:n], rng.permutation(spec.num_pages)[:n]


CASES = [  # (p_tp, d_tp, is_mla, layout, heads)
    (2, 1, False, "NHD", 4), (1, 2, False, "HND", 4), (2, 1, True, "NHD", 1),
    (1, 2, True, "NHD", 1), (4, 2, False, "HND", 4), (2, 4, False, "NHD", 4)]


@pytest.mark.parametrize(("p_tp", "d_tp", "mla", "layout", "heads"), CASES,
                         ids=[f"P{a}D{b}{'-mla' if m else ''}-{lay}" for a, b, m, lay, _ in CASES])
def test_tp_mismatch_reshards_exactly(tmp_path: Path, p_tp: int, d_tp: int, mla: bool,
                                      layout: str, heads: int) -> None:
    spec = ModelSpec(total_kv_heads=heads, is_mla=mla, layout=layout)
    c = start_cluster(tmp_path, spec, p_tp=p_tp, d_tp=d_tp)
    try:
        src, dst = _pages(spec, 10, 1)
        senders, receivers = run_room(c, 5, src, dst, dp=0)
        assert _wait(receivers) == [KVPoll.Success] * d_tp
        assert _wait(senders) == [KVPoll.Success] * p_tp
        for _, e in c.decode:
            assert e.holds(c.source, src, dst)
            assert e.aux[5 % spec.aux_slots][0] == 5 % 251
    finally:
        c.stop()


def test_k11_gqa_replication_end_to_end(tmp_path: Path) -> None:
    spec = ModelSpec(total_kv_heads=2, layout="NHD")
    c = start_cluster(tmp_path, spec, p_tp=1, d_tp=4)
    try:
        src, dst = _pages(spec, 6, 2)
        _, receivers = run_room(c, 1, src, dst, dp=0)
        assert _wait(receivers) == [KVPoll.Success] * 4
        assert [(e.h0, e.nh) for _, e in c.decode] == [(0, 1), (0, 1), (1, 1), (1, 1)]
        assert all(e.holds(c.source, src, dst) for _, e in c.decode)
    finally:
        c.stop()


def test_pp2_prefill_to_pp1_decode(tmp_path: Path) -> None:
    spec = ModelSpec(num_layers=4)
    c = start_cluster(tmp_path, spec, p_pp=2)
    try:
        src, dst = _pages(spec, 9, 3)
        senders, receivers = run_room(c, 7, src, dst, dp=0)
        assert _wait(receivers) == [KVPoll.Success]
        assert _wait(senders) == [KVPoll.Success] * 2
        assert c.decode[0][1].holds(c.source, src, dst)
    finally:
        c.stop()


def test_k14_dp_routing_room_based_and_explicit(tmp_path: Path) -> None:
    spec = ModelSpec()
    c = start_cluster(tmp_path, spec, p_dp=2)
    try:
        for room in (10, 11):  # room % 2 picks the prefill DP group
            src, dst = _pages(spec, 4, room)
            _senders, receivers = run_room(c, room, src, dst, dp=room % 2)
            assert _wait(receivers) == [KVPoll.Success]
            assert c.decode[0][1].holds(c.source, src, dst)
        src, dst = _pages(spec, 4, 12)
        _, receivers = run_room(c, 12, src, dst, dp=1, dp_rank=1)  # explicit, not room % 2
        assert _wait(receivers) == [KVPoll.Success]
        assert c.decode[0][1].holds(c.source, src, dst)
        r = Receiver(c.decode[0][1].client, 13, c.bootstrap, dp_rank=2)
        assert r.wait(5) == KVPoll.Failed
        assert "dp_size" in r.failure_reason()
    finally:
        c.stop()


def test_k12_item_len_mismatch_never_writes(tmp_path: Path) -> None:
    spec = ModelSpec()
    c = start_cluster(tmp_path, spec, d_scale=0.5)
    try:
        d = c.decode[0][1]
        before = [b.copy() for b in d.buffers]
        src, dst = _pages(spec, 4, 5)
        _senders, receivers = run_room(c, 1, src, dst, dp=0)
        assert _wait(receivers, 10) == [KVPoll.Failed]
        assert "kv item len mismatch" in receivers[0].failure_reason()
        assert all(np.array_equal(a, b) for a, b in zip(d.buffers, before, strict=True))
    finally:
        c.stop()


def test_k12_positive_control_tp_mismatch_with_right_item_len(tmp_path: Path) -> None:
    spec = ModelSpec()
    c = start_cluster(tmp_path, spec, p_tp=2, d_tp=1)  # item lens differ by the TP ratio
    try:
        src, dst = _pages(spec, 4, 6)
        _, receivers = run_room(c, 1, src, dst, dp=0)
        assert _wait(receivers) == [KVPoll.Success]
    finally:
        c.stop()


def test_k15_pp_stages_time_out_at_different_moments(tmp_path: Path) -> None:
    spec = ModelSpec()
    c = start_cluster(tmp_path, spec, p_pp=2, p_opts={"bootstrap_timeout": 2.0})
    try:
        stage0, stage1 = c.prefill[(0, 0, 0)][1], c.prefill[(0, 0, 1)][1]
        s0 = Sender(stage0.client, 9)
        time.sleep(0.3)
        s1 = Sender(stage1.client, 9)
        assert s0.wait(5) == KVPoll.Failed and s1.wait(5) == KVPoll.Failed
        assert "Bootstrapping" in s0.failure_reason()
        s0.clear()
        s1.clear()
        r = Receiver(c.decode[0][1].client, 9, c.bootstrap)
        r.init([1, 2], 1)  # pages after the fact: P stores nothing that outlives the room
        time.sleep(0.5)
        assert poll_many(stage0.client, [9]) == [-1]
        assert poll_many(stage1.client, [9]) == [-1]
    finally:
        c.stop()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(4, 2), (2, 4)])
def test_k20_mla_dummy_ranks_conclude_without_timeout(tmp_path: Path, p_tp: int,
                                                     d_tp: int) -> None:
    spec = ModelSpec(is_mla=True, total_kv_heads=1)
    c = start_cluster(tmp_path, spec, p_tp=p_tp, d_tp=d_tp,
                      d_opts={"waiting_timeout": 60.0}, p_opts={"bootstrap_timeout": 60.0})
    try:
        src, dst = _pages(spec, 5, 7)
        t0 = time.monotonic()
        senders, receivers = run_room(c, 3, src, dst, dp=0)
        assert _wait(receivers) == [KVPoll.Success] * d_tp
        assert _wait(senders) == [KVPoll.Success] * p_tp
        assert time.monotonic() - t0 < 10
        assert all(e.holds(c.source, src, dst) for _, e in c.decode)
    finally:
        c.stop()


def test_k08_failure_reaches_every_decode_endpoint(tmp_path: Path) -> None:
    spec = ModelSpec()
    faults = json.dumps({"fail_batches": [0]})
    c = start_cluster(tmp_path, spec, p_tp=1, d_tp=2,
                      p_opts={"fault_injection": faults, "transient_retry_s": 0.1})
    try:
        src, dst = _pages(spec, 4, 8)
        _, receivers = run_room(c, 1, src, dst, dp=0)
        t0 = time.monotonic()
        assert _wait(receivers, 10) == [KVPoll.Failed, KVPoll.Failed]
        assert time.monotonic() - t0 < 2.0
        assert all("refused" in r.failure_reason() for r in receivers)
    finally:
        c.stop()
