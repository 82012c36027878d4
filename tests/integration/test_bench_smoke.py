"""`make bench` keeps working: its transfer, hetero-TP and same-host stages in a reduced form."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> tuple[str, dict[str, Any]]:
    """``benchmarks/run.py ARGS``: its output and its JSON result (it must exit 0 and write
    its result where ``--out`` says: tests run in parallel, each with its own file)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        out = subprocess.run([sys.executable, "benchmarks/run.py", *args, "--out", str(path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        result: dict[str, Any] = json.loads(path.read_text())
    return out.stdout, result


def test_bench_runs_and_reports_ratios() -> None:
    stdout, result = _bench("--only", "transfer,hetero,samehost", "--mib", "16",
                            "--repeats", "1")
    assert "kvd/raw =" in stdout and "hetero/equal =" in stdout
    assert "local/mooncake =" in stdout and "local/memcpy =" in stdout
    assert result["transfer"]["bytes_equal"] is True
    assert result["transfer"]["ratio_kvd_over_raw"] > 0
    assert result["hetero"]["ratio_hetero_over_equal"] > 0
    assert result["samehost"]["bytes_equal"] is True


def test_cancel_bench_reports_the_fresh_room_against_its_baseline() -> None:
    stdout, result = _bench("--only", "cancel", "--cancel-rooms", "6", "--cancel-mib", "1",
                            "--repeats", "1")
    assert "fresh 1-page room" in stdout
    c = result["cancel"]
    assert len(c["baseline_s"]) == len(c["loaded_s"]) == 1 and c["ratio"] > 0
    assert c["aborted_bytes_landed"][0] <= c["aborted_bytes_queued"]


def test_flood_bench_reports_every_phase_against_the_idle_baseline() -> None:
    stdout, result = _bench("--only", "flood", "--flood-seconds", "1")
    assert "/health p99" in stdout and "flood goal" in stdout
    flood = result["flood"]
    assert set(flood["phases"]) == {"idle", "zmq", "body", "idle_conns"}
    for phase in flood["phases"].values():
        assert phase["health"]["n"] > 0 and phase["heartbeat"]["beats"] > 0
        assert phase["health"]["failed"] == 0 and phase["rooms"]["succeeded"] == \
            phase["rooms"]["n"]  # outcomes only: the latencies are the benchmark's to judge
    assert flood["phases"]["zmq"]["flood"]["frames_sent"] > 0


def test_issue14_room_rows_run_both_ways_with_every_byte_checked() -> None:
    """P4 in a reduced form: kvd per call and batched (Many), both verified page by page
    (no failed room, no wrong byte); SGLang's rows need .venv-bench and are skipped here."""
    stdout, r = _bench("--only", "issue14", "--rows", "P4", "--repeats", "1", "--max-rooms", "80",
                       "--rate-rooms", "40")
    assert "kvd benchmark rows" in stdout  # every row in one table
    p4 = r["issue14"]["P4"]
    assert p4["bad_bytes"] == 0 and p4["failed"] == 0
    assert set(p4["median"]) >= {"kvd", "kvd_many", "kvd_ring"}
    for variant in ("kvd", "kvd_many", "kvd_ring"):
        assert p4["median"][variant]["max"]["rooms_per_s"] > 0
    assert {"P4", "P4.many", "P4.ring", "P4.ring.cpu", "P4.ring.p50_100"} <= set(r["rows"])
    assert r["rows"]["P4.ring"]["value"] == p4["median"]["kvd_ring"]["max"]["rooms_per_s"]


def test_issue14_bulk_rows_compare_at_one_pool_setting_and_price_kvds_default() -> None:
    """P1 in a reduced form: kvd and the raw engine both with Mooncake's TCP pool (the raw
    driver's engine read the pool on), every byte compared; kvd at its defaults (the pool
    off, K39) is its own row, priced against kvd with the pool, never against the raw
    engine's pool."""
    stdout, r = _bench("--only", "issue14", "--rows", "P1", "--repeats", "1", "--mib", "2")
    assert "kvd benchmark rows" in stdout
    for size in ("12KiB", "64KiB", "1024KiB"):
        b = r["issue14"]["P1"][size]
        assert b["bytes_equal"] is True and b["raw_pool_env"] == "1"
        assert {"kvd", "kvd_pool_off", "raw_submit_poll", "raw_sync"} <= set(b["gbps"])
        off = r["rows"][f"P1.{size}.pool_off"]
        assert off["value"] == b["gbps"]["kvd_pool_off"]
        assert off["baseline"] == r["rows"][f"P1.{size}"]["value"] == b["gbps"]["kvd"]


def test_issue14_api_rows_run_in_every_placement() -> None:
    """P5 in a reduced form: the trivial RPC beside the echo, poll_many and the idle pair's
    send/init with the engine and kvd where the scheduler puts them, on one CPU and on two
    (the benchmark fails if an idle-pair room does not succeed)."""
    stdout, r = _bench("--only", "issue14", "--rows", "P5", "--repeats", "1",
                       "--api-calls", "200", "--api-rooms", "5")
    assert "kvd benchmark rows" in stdout
    p5 = r["issue14"]["P5"]
    assert {"P5.trivial", "P5.trivial.one_cpu"} <= set(r["rows"])
    two = len(os.sched_getaffinity(0)) > 1  # "cross" needs a second CPU
    assert set(p5["placements"]) == {"free", "same", *(["cross"] if two else [])}
    for where in p5["placements"].values():
        for field in ("trivial_rpc_p50_us", "echo_p50_us", "poll_many_1000_p50_us",
                      "send_idle_p50_us", "init_idle_p50_us"):
            assert where[field] > 0, (field, where)


def test_channel_rows_report_value_baseline_ratio_goal_met() -> None:
    """Issue 21's P5 rows in a reduced form: each row keyed by its id carries its value
    beside the socket baseline measured in the same run, the ratio, the goal and whether
    it is met (the bench itself checks that the table and the socket answer alike)."""
    stdout, r = _bench("--only", "channel", "--repeats", "1", "--api-rooms", "3",
                       "--channel-placements", "free")
    assert "kvd benchmark rows" in stdout
    rows = r["channel"]["rows"]
    assert rows.keys() <= r["rows"].keys()
    assert {"P5.poll_1000", "P5.poll_one", "P5.send", "P5.init", "P5.send_round"} <= set(rows)
    for row in rows.values():
        assert row["value"] > 0 and row["baseline"] > 0 and row["ratio"] > 0, row
        assert row["goal"] and isinstance(row["met"], bool), row


def test_p9_rows_report_engine_thread_time_per_room() -> None:
    """Issue 21's P9 rows in a reduced form (one round of 32 rooms per system and
    placement): the calling thread's CPU and wall per room for both roles, every page
    compared on the decode; SGLang's baseline needs .venv-bench (None here, then nothing
    is judged)."""
    stdout, r = _bench("--only", "p9", "--repeats", "1", "--p9-rounds", "1")
    assert "kvd benchmark rows" in stdout
    rows = r["p9"]["rows"]
    assert {"P9.prefill", "P9.decode", "P9.prefill.wall", "P9.decode.step"} <= set(rows)
    for key, row in rows.items():
        assert row["value"] > 0 and row["failed"] == 0, (key, row)
        assert {"value", "baseline", "ratio", "goal", "met"} <= set(row), key


def test_membership_bench_rows_run_with_every_room_checked() -> None:
    """Issue 19's rows (benchmarks/membership_bench.py) in a reduced form: each restart
    variant's first successful room on the new instance is found (its bytes checked by
    the bench) after a death each source saw, and 256 dead addresses fail every room
    with /health answered throughout. Outcomes only: the timings are the bench's."""
    stdout, r = _bench("--only", "restart,deadaddr", "--repeats", "1", "--restart-interval",
                       "1", "--dead-addrs", "256", "--dead-seconds", "1")
    assert "restart -> first successful room" in stdout and "dead bootstrap" in stdout
    runs = r["restart"]["runs"]
    for name in ("bootstrap_down_seen", "bootstrap_at_once"):
        [run] = runs[name]
        assert run["restart_to_first_room_s"] > 0
        assert run["heartbeat_learned_restart_s"] >= 0
    assert runs["bootstrap_down_seen"][0]["heartbeat_state_at_restart"] == "down"
    [etcd] = runs["etcd"]
    assert "skipped" in etcd or etcd["bound_room_failure"][0] == "peer"
    dead = r["deadaddr"]
    assert dead["rooms_failed"] == 256
    assert all(w.get("health_failed", 0) == 0 for w in dead["windows"])
    assert dead["tables_after"]["heartbeat_targets"] == 0
