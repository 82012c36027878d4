"""Flood benchmark (cases S02-S04): how a prefill kvd answers while ONE unauthenticated
process floods it, against an idle baseline measured in the same run.

Setup: a prefill kvd serving bootstrap and a decode kvd that heartbeats it every
0.5 s (2 misses fail its rooms), each with an engine stand-in. Phases, one after the
other, each ``seconds`` long: ``idle`` (no flood), ``zmq`` (tiny frames to the control
port), ``body`` (unauthenticated ``PUT /route`` declaring 250 MB, again and again),
``idle_conns`` (thousands of half-sent requests held open; benchmarks/floods.py).
During every phase, in parallel:

- /health latency: ``GET /health`` on P every 20 ms over a kept-alive connection;
- heartbeat jitter: a decode-like prober beats P's /health on a fixed 250 ms schedule
  (its own kept-alive connection); jitter is how late each beat completes after its
  scheduled start; a beat not answered within its period counts as missed; the real
  decode kvd's own missed heartbeats are reported too (its counter);
- engine RPC latency: an ``Info`` call on P's engine socket every 50 ms;
- newcomer: ``GET /health`` on a NEW connection every 250 ms (what a decode that starts
  during the flood does first): connect + answer time;
- rooms: 1-page rooms through D -> P, one after another.

Probers connect before the flood starts, as the peers of a running daemon have; the
window measured starts 0.5 s into the flood.

Goal: p99 /health <= 50 ms and no missed heartbeat under each flood.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from kvd.client import KVPoll
from kvd.client.rpc import KvdClient
from kvd.launch import DaemonProcess, start_daemon
from kvd.protocol import rpc
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms

FLOODS = Path(__file__).parent / "floods.py"
BEAT_S = 0.25
GOAL_P99_MS = 50.0


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


class _Probe(threading.Thread):
    """Calls ``once()`` every ``period`` s until stopped; records seconds per call (None:
    the call failed)."""

    def __init__(self, once: Callable[[], None], period: float) -> None:
        super().__init__(daemon=True)
        self.once, self.period = once, period
        self.samples: list[float | None] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                self.once()
                self.samples.append(time.perf_counter() - t0)
            except Exception:
                self.samples.append(None)
            self.stop.wait(max(0.0, self.period - (time.perf_counter() - t0)))


class _Heartbeat(threading.Thread):
    """Beats on a fixed schedule (absolute deadlines, like a timer that does not drift)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.late_ms: list[float] = []
        self.missed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5 * BEAT_S) as client:
            start = time.perf_counter()
            n = 0
            while not self.stop.is_set():
                n += 1
                due = start + n * BEAT_S
                self.stop.wait(max(0.0, due - time.perf_counter()))
                try:
                    client.get(self.url)
                except httpx.HTTPError:
                    self.missed += 1
                    continue
                late = time.perf_counter() - due
                self.late_ms.append(late * 1000)
                if late > BEAT_S:
                    self.missed += 1


def _fresh_get(port: int) -> None:
    """``GET /health`` on a new connection (raw socket: no client-side setup measured)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        if not s.recv(64).startswith(b"HTTP/1.1 200"):
            raise ConnectionError("no 200 answer")


class _Cluster:
    def __init__(self) -> None:
        work = Path(tempfile.mkdtemp(prefix="kvd-flood-"))
        self.p = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING")
        self.d = start_daemon("decode", work, log_level="WARNING", heartbeat_interval=0.5,
                              heartbeat_max_failures=2)
        self.pe = EngineStandIn(self.p.socket, seed=1)
        self.de = EngineStandIn(self.d.socket, seed=2)
        self.room = 0

    def rooms(self, stop: threading.Event, out: list[KVPoll | int]) -> None:
        while not stop.is_set():
            self.room += 1
            r = self.room
            transfer_room(self.pe, self.de, self.p.http_addr, r, [r % 64], [r % 64], chunk=1)
            out += wait_rooms(self.de.client, [r], timeout=30)
            for c in (self.pe.client, self.de.client):
                c.call(rpc.Clear(room=r))

    def misses(self) -> int:
        h = httpx.get(f"http://{self.d.http_addr}/health", timeout=10).json()
        return int(h["counters"]["heartbeat_misses"])

    def close(self) -> None:
        self.pe.close()
        self.de.close()
        self.p.stop()
        self.d.stop()


def _flood(kind: str, cluster: _Cluster, seconds: float) -> subprocess.Popen[str] | None:
    p: DaemonProcess = cluster.p
    target = {"zmq": p.ready["control_endpoint"], "body": p.http_addr,
              "idle_conns": p.http_addr}.get(kind)
    if target is None:
        return None
    name = "idle" if kind == "idle_conns" else kind
    return subprocess.Popen([sys.executable, str(FLOODS), name, target, "--seconds",
                             str(seconds)], stdout=subprocess.PIPE, text=True)


def _phase(cluster: _Cluster, kind: str, seconds: float) -> dict[str, Any]:
    health_url = f"http://{cluster.p.http_addr}/health"
    kept = httpx.Client(timeout=10)
    rpc_client = KvdClient(cluster.p.socket, timeout=10)
    probes = {"health": _Probe(lambda: kept.get(health_url).raise_for_status(), 0.02),
              "rpc": _Probe(lambda: rpc_client.call(rpc.Info()), 0.05),
              "newcomer": _Probe(lambda: _fresh_get(cluster.p.ready["http_port"]), BEAT_S)}
    beat = _Heartbeat(health_url)
    stop, states = threading.Event(), []
    runner = threading.Thread(target=cluster.rooms, args=(stop, states), daemon=True)
    for t in (*probes.values(), beat, runner):
        t.start()
    time.sleep(0.3)  # every prober connected
    flood = _flood(kind, cluster, seconds + 1.0)
    time.sleep(0.5)  # the flood at full strength before measuring
    misses0 = cluster.misses()
    for probe in probes.values():
        probe.samples = []
    beat.late_ms, beat.missed, states[:] = [], 0, []
    time.sleep(seconds)
    for t in (*probes.values(), beat):
        t.stop.set()
    stop.set()
    for t in (*probes.values(), beat, runner):
        t.join(30)
    flood_out = json.loads(flood.communicate()[0]) if flood else {}
    kept.close()
    rpc_client.close()
    return _summary(kind, probes, beat, states, cluster.misses() - misses0, flood_out)


def _summary(kind: str, probes: dict[str, _Probe], beat: _Heartbeat,
             states: list[KVPoll | int], kvd_misses: int,
             flood: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"phase": kind, "flood": flood}
    for name, probe in probes.items():
        ms = [s * 1000 for s in probe.samples if s is not None]
        out[name] = {"n": len(probe.samples), "failed": probe.samples.count(None),
                     "p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99),
                     "max_ms": max(ms, default=float("nan"))}
    out["heartbeat"] = {"beats": len(beat.late_ms) + beat.missed, "missed": beat.missed,
                        "jitter_p50_ms": _pct(beat.late_ms, 50),
                        "jitter_p99_ms": _pct(beat.late_ms, 99),
                        "jitter_max_ms": max(beat.late_ms, default=float("nan")),
                        "kvd_decode_missed": kvd_misses}
    out["rooms"] = {"n": len(states), "succeeded": states.count(KVPoll.Success)}
    out["goal_met"] = bool(out["health"]["p99_ms"] <= GOAL_P99_MS and beat.missed == 0
                           and kvd_misses == 0 and out["health"]["failed"] == 0)
    return out


def run(console: Console, seconds: float = 6.0,
        phases: tuple[str, ...] = ("idle", "zmq", "body", "idle_conns")) -> dict[str, Any]:
    """Every phase against one cluster; prints a table and returns the numbers."""
    cluster = _Cluster()
    try:
        transfer_room(cluster.pe, cluster.de, cluster.p.http_addr, 0, [0], [0], chunk=1)
        wait_rooms(cluster.de.client, [0])
        results = [_phase(cluster, kind, seconds) for kind in phases]
    finally:
        cluster.close()
    _print(console, results, seconds)
    load = os.getloadavg()
    console.print(f"load average {load[0]:.1f} on {os.cpu_count()} CPUs (the machine is "
                  f"shared: tails grow with it)")
    return {"seconds_per_phase": seconds, "goal_p99_health_ms": GOAL_P99_MS,
            "beat_period_s": BEAT_S, "phases": {r["phase"]: r for r in results},
            "loadavg_1m": load[0], "cpus": os.cpu_count(),
            "goal_met": all(r["goal_met"] for r in results if r["phase"] != "idle")}


def _print(console: Console, results: list[dict[str, Any]], seconds: float) -> None:
    table = Table(title=f"prefill kvd, one flooding process, {seconds:g} s per phase")
    for col in ("phase", "/health ms p50/p99/max", "beat late ms p99", "missed beats",
                "rpc ms p99", "newcomer ms p99", "rooms"):
        table.add_column(col, justify="right")
    for r in results:
        h, b, c, n = r["health"], r["heartbeat"], r["rpc"], r["newcomer"]
        table.add_row(r["phase"], f"{h['p50_ms']:.1f}/{h['p99_ms']:.1f}/{h['max_ms']:.0f}",
                      f"{b['jitter_p99_ms']:.1f}", f"{b['missed']}+{b['kvd_decode_missed']}",
                      f"{c['p99_ms']:.1f}", f"{n['p99_ms']:.0f}",
                      f"{r['rooms']['succeeded']}/{r['rooms']['n']}")
    console.print(table)
    console.print("missed beats: emulated prober + the decode kvd's own; /health probes "
                  f"that failed: {[r['health']['failed'] for r in results]}")
    base = results[0]["health"]["p99_ms"] if results[0]["phase"] == "idle" else float("nan")
    for r in results[1:]:
        console.print(f"{r['phase']}: /health p99 {r['health']['p99_ms']:.1f} ms (idle "
                      f"{base:.1f} ms; goal <= {GOAL_P99_MS:.0f}); flood {r['flood']}")
    console.print("flood goal met" if all(r["goal_met"] for r in results[1:])
                  else "flood goal NOT met")


if __name__ == "__main__":
    print(json.dumps(run(Console()), indent=2, default=str))
