"""kvd benchmarks, each reported as a ratio against a baseline measured in the same run.

transfer: the same KV pages (>= 256 MiB, random page indices) moved P -> D
  (a) through two kvd daemons (engine RPC, control plane, planner, executor),
  (b) directly through two raw Mooncake engines in separate processes (same descriptors),
  (c) memcpy of the same pages inside one process (the machine's ceiling).
  Prints kvd/raw (goal >= 0.9).
plan: planning one 128k-token hetero-TP request vs a naive per-token-slot loop (goal >= 50x),
  and the bounds check's cost (benchmarks/plan_bench.py).
hetero: the same bytes P -> D with equal TP (1 -> 1) and heterogeneous TP (2 -> 1), HND
  layout, through real daemons (goal: hetero >= 0.7x equal).
samehost: the same pages P -> D on one host through the local backend, Mooncake over
  loopback and memcpy, interleaved, bytes verified (goals: local >= 5x Mooncake,
  >= 0.5x memcpy; benchmarks/samehost.py).
flood: /health latency, heartbeat jitter and engine-RPC latency of a prefill kvd while one
  process floods it (tiny ZMQ frames, 250 MB unauthenticated bodies, idle half-sent
  requests), against an idle baseline in the same run (goal: p99 /health <= 50 ms, no
  missed heartbeat; benchmarks/flood_bench.py).
cancel: a fresh 1-page room's latency after N queued rooms of M MiB were aborted, vs the
  same room alone (goal <= 2x; benchmarks/cancel_bench.py, case K43).
restart: a prefill kvd SIGKILLed and restarted on the same ports while a decode has a room
  to it: from the new instance's registration to its first successful room, with bootstrap
  discovery and with etcd, vs one heartbeat_interval (goal <= 100 ms; K37).
deadaddr: a decode's CPU and /health p99 after one Many of 4 096 rooms naming dead
  bootstrap addresses, vs the same window idle (goal: <= 2x idle + 0.1 CPU-s/s; K41;
  both in benchmarks/membership_bench.py).
issue14: every row of issue 14's table (P1, P1b, P4, P5, P6, P8) beside its baseline,
  ratio and goal (benchmarks/issue14.py); SGLang's connector rows need SGLang installed
  (`make bench` builds .venv-bench with it).
channel: issue 21's P5 rows with the shared status table and the submission ring: poll
  of 1 000 rooms and of one room through the table vs the socket's Poll, send/init on an
  idle pair and send in a round of 32 through the ring vs the socket; rows keyed by id
  with value, baseline, ratio, goal, met (benchmarks/channel_bench.py).
p9: issue 21's P9 rows: the engine scheduler thread's CPU and wall time per 1-page room
  (create + init/send + polls until done + clear, rounds of 32 rooms) through kvd with
  the ring and the table vs SGLang's in-process connector, both roles, three CPU
  placements (goal <= 0.25x; benchmarks/p9_bench.py).
Every row of issue14, channel and p9 is printed in ONE table (id, measure, value, baseline,
ratio, goal, met) and saved under "rows" in the JSON, keyed by id (benchmarks/rows.py).
layers: TTFT of a long prompt on the reference engine (SmolLM2 on the CPU) with layer
  streaming vs whole-room transfer, interleaved in one run, and the fraction of the
  transfer time hidden under compute (goal >= 0.5; benchmarks/layers_bench.py; not in the
  default set: it loads the model and runs minutes on 2 cores).
All results are saved as one JSON file under benchmarks/results/.

Usage: python benchmarks/run.py [--mib 256] [--repeats 3]
       [--only issue14,channel,p9,transfer,plan,hetero,samehost,flood,cancel,restart,
               deadaddr,layers] [--p9-rounds 8] [--channel-placements free,same,cross]
       [--layer-tokens 8192] [--model-layers 0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvd.client import KVPoll, Receiver, Sender, wait_many
from kvd.launch import start_daemon
from kvd.protocol import rpc
from kvd.refengine.standin import EngineStandIn
from kvd.transfer.plan import plan_pages

RESULTS = Path(__file__).parent / "results"


def _layout(mib: int, item_kib: int, layers: int) -> dict[str, int]:
    item = item_kib * 1024
    move_pages = max(1, (mib << 20) // (2 * layers * item))
    return {"item_len": item, "layers": layers, "move_pages": move_pages,
            "num_pages": 2 * move_pages}


class KvdPath:
    """P -> D through two kvd daemons and engine stand-ins (rooms in parallel)."""

    def __init__(self, lay: dict[str, int], rooms: int) -> None:
        work = Path(tempfile.mkdtemp(prefix="kvd-bench-"))
        self.prefill = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING")
        self.decode = start_daemon("decode", work, log_level="WARNING")
        opts = {"num_layers": lay["layers"], "num_pages": lay["num_pages"],
                "item_len": lay["item_len"]}
        self.p = EngineStandIn(self.prefill.socket, seed=1, **opts)
        self.d = EngineStandIn(self.decode.socket, seed=2, **opts)
        self.rooms, self.base = rooms, 10_000

    def run(self, src: np.ndarray, dst: np.ndarray) -> tuple[float, bool]:
        """Seconds from the first send to every room's decode Success; bytes checked."""
        self.base += 1000
        parts = np.array_split(np.arange(src.size), self.rooms)
        ids = [self.base + i for i in range(len(parts))]
        for room, idx in zip(ids, parts, strict=True):
            Receiver(self.d.client, room, self.prefill.http_addr).init(dst[idx], room % 16)
        senders = []
        for room, idx in zip(ids, parts, strict=True):
            s = Sender(self.p.client, room)
            s.init(int(idx.size), 0)
            senders.append((s, idx))
        t0 = time.perf_counter()
        for s, idx in senders:
            s.send(src[idx])
        states = wait_many(self.d.client, ids, 60.0)
        elapsed = time.perf_counter() - t0
        ok = all(x == KVPoll.Success for x in states) and self.d.pages_equal(self.p, src, dst)
        for room in ids:
            self.p.client.call(rpc.Clear(room=room))
            self.d.client.call(rpc.Clear(room=room))
        return elapsed, ok

    def close(self) -> None:
        self.p.close()
        self.d.close()
        self.prefill.stop()
        self.decode.stop()


def _raw_receiver(nbytes: int, item: int, conn: Any) -> None:
    from kvd.transfer.backends.mooncake import MooncakeEngine

    engine = MooncakeEngine("127.0.0.1")
    buf = np.zeros(nbytes, dtype=np.uint8)
    engine.register(buf.ctypes.data, nbytes)
    conn.send((engine.session_id, buf.ctypes.data))
    while (pages := conn.recv()) is not None:  # after each run: a digest of the dst pages
        conn.send(_digest(buf, item, pages))


def _digest(buf: np.ndarray, item: int, pages: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(buf.reshape(-1, item)[pages].tobytes()).hexdigest()


class RawPath:
    """The same descriptors through two raw Mooncake engines in separate processes."""

    def __init__(self, lay: dict[str, int], src: np.ndarray, dst: np.ndarray) -> None:
        from kvd.transfer.backends.mooncake import MooncakeEngine

        per_buf, nbufs, item = lay["num_pages"] * lay["item_len"], 2 * lay["layers"], \
            lay["item_len"]
        self.parent, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_raw_receiver,
                                                    args=(per_buf * nbufs, item, child))
        self.proc.start()
        self.session, dst_base = self.parent.recv()
        self.engine = MooncakeEngine("127.0.0.1")
        self.buf = np.random.default_rng(1).integers(0, 256, per_buf * nbufs, dtype=np.uint8)
        self.engine.register(self.buf.ctypes.data, self.buf.nbytes)
        offs = np.arange(nbufs, dtype=np.uint64) * np.uint64(per_buf)
        self.desc = plan_pages(np.uint64(self.buf.ctypes.data) + offs, np.uint64(dst_base) + offs,
                               [item] * nbufs, [item] * nbufs, src, dst)
        rows = lay["num_pages"]
        self.src_rows = np.concatenate([b * rows + src for b in range(nbufs)])
        self.dst_rows = np.concatenate([b * rows + dst for b in range(nbufs)])
        self.item = item

    def run(self) -> tuple[float, bool]:
        t0 = time.perf_counter()
        self.engine.write(self.session, self.desc)
        elapsed = time.perf_counter() - t0
        self.parent.send(self.dst_rows)
        ok = self.parent.recv() == _digest(self.buf, self.item, self.src_rows)
        return elapsed, ok

    def close(self) -> None:
        self.parent.send(None)
        self.proc.join()


def bench_memcpy(lay: dict[str, int], src: np.ndarray, dst: np.ndarray,
                 repeats: int) -> list[float]:
    shape = (lay["num_pages"], lay["item_len"])
    a = [np.random.default_rng(i).integers(0, 256, shape, dtype=np.uint8)
         for i in range(2 * lay["layers"])]
    b = [np.zeros(shape, dtype=np.uint8) for _ in a]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x, y in zip(a, b, strict=True):
            y[dst] = x[src]
        times.append(time.perf_counter() - t0)
    return times


class _TpCluster:
    """P ranks (attn TP ``p_tp``) and one decode rank, each with a shard stand-in."""

    def __init__(self, spec: Any, source: np.ndarray, p_tp: int) -> None:
        from kvd.refengine.standin import ShardStandIn

        work = Path(tempfile.mkdtemp(prefix="kvd-bench-"))
        self.prefill = [start_daemon("prefill", work, log_level="WARNING", attn_tp_size=p_tp,
                                     attn_tp_rank=0, serve_bootstrap=True)]
        for r in range(1, p_tp):
            self.prefill.append(start_daemon("prefill", work, log_level="WARNING",
                                             attn_tp_size=p_tp, attn_tp_rank=r,
                                             bootstrap_addr=self.prefill[0].http_addr))
        self.decode = start_daemon("decode", work, log_level="WARNING")
        self.p_eng = [ShardStandIn(d.socket, spec, r, p_tp, source=source, seed=r)
                      for r, d in enumerate(self.prefill)]
        self.d_eng = ShardStandIn(self.decode.socket, spec, seed=9)

    def run(self, room: int, src: np.ndarray, dst: np.ndarray, source: np.ndarray) -> float:
        """Seconds from the first send to decode Success; bytes checked afterwards."""
        recv = Receiver(self.d_eng.client, room, self.prefill[0].http_addr)
        recv.init(dst, 0)
        senders = []
        for e in self.p_eng:
            s = Sender(e.client, room)
            s.init(len(src), 0)
            senders.append(s)
        t0 = time.perf_counter()
        for s in senders:
            s.send(src)
        state = recv.wait(60)
        elapsed = time.perf_counter() - t0
        assert state == KVPoll.Success and self.d_eng.holds(source, src, dst)
        recv.clear()
        for s in senders:
            s.clear()
        return elapsed

    def close(self) -> None:
        for e in [*self.p_eng, self.d_eng]:
            e.close()
        for d in [*self.prefill, self.decode]:
            d.stop()


def bench_hetero(console: Console, repeats: int, pages: int = 64) -> dict[str, Any]:
    """Equal TP (1 -> 1) vs hetero TP (2 -> 1), HND, same bytes, real daemons; runs of the
    two are interleaved so that both see the same machine state."""
    from kvd.refengine.standin import ModelSpec

    spec = ModelSpec(num_layers=8, total_kv_heads=8, head_dim=128, page_size=64,
                     num_pages=2 * pages, layout="HND")
    source = spec.global_kv(seed=1)
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(spec.num_pages)[:pages], rng.permutation(spec.num_pages)[:pages]
    out: dict[str, Any] = {"bytes": int(source[:, :, :pages].nbytes)}
    names = {"equal_tp_1to1": 1, "hetero_tp_2to1": 2}
    clusters = {name: _TpCluster(spec, source, p_tp) for name, p_tp in names.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for rep in range(2 * repeats + 1):
            for name, cluster in clusters.items():
                t = cluster.run(100 + rep, src, dst, source)
                if rep:  # the first round warms up connections
                    times[name].append(t)
    finally:
        for cluster in clusters.values():
            cluster.close()
    for name in names:
        out[name] = {"seconds": times[name],
                     "gbps": out["bytes"] / statistics.median(times[name]) / 1e9}
    out["ratio_hetero_over_equal"] = out["hetero_tp_2to1"]["gbps"] / out["equal_tp_1to1"]["gbps"]
    table = Table(title=f"hetero vs equal TP, HND, {out['bytes'] / 2**20:.0f} MiB, "
                        f"{2 * repeats} interleaved runs each")
    for col in ("path", "median s", "GB/s"):
        table.add_column(col, justify="right")
    for name in names:
        table.add_row(name, f"{statistics.median(out[name]['seconds']):.3f}",
                      f"{out[name]['gbps']:.2f}")
    console.print(table)
    console.print(f"hetero/equal = {out['ratio_hetero_over_equal']:.2f} (goal >= 0.7)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--item-kib", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rooms", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="issue14,channel,p9,plan,hetero,samehost,flood,cancel,"
                                      "restart,deadaddr")
    ap.add_argument("--p9-rounds", type=int, default=8,
                    help="p9: rounds of 32 rooms per run (each system, role, placement)")
    ap.add_argument("--p9-step-ms", type=float, default=1.0,
                    help="p9: the scheduler step's period, ms")
    ap.add_argument("--channel-placements", default="free,same,cross",
                    help="channel: CPU placements (issue14.PLACEMENTS) to measure in")
    ap.add_argument("--cancel-rooms", type=int, default=150, help="cancel: rooms aborted")
    ap.add_argument("--cancel-mib", type=int, default=32, help="cancel: MiB per room")
    ap.add_argument("--cancel-inflight-mib", type=int, default=None,
                    help="cancel: the prefill's inflight_bytes in MiB (default: kvd's)")
    ap.add_argument("--restart-interval", type=float, default=5.0,
                    help="restart: the decode's heartbeat_interval (the baseline), s")
    ap.add_argument("--restart-ttl", type=float, default=2.0,
                    help="restart: etcd_lease_ttl of the etcd variant, s")
    ap.add_argument("--dead-addrs", type=int, default=4096,
                    help="deadaddr: distinct dead bootstrap addresses in one Many")
    ap.add_argument("--dead-seconds", type=float, default=5.0,
                    help="deadaddr: seconds per CPU window")
    ap.add_argument("--flood-seconds", type=float, default=6.0, help="per flood phase")
    ap.add_argument("--rss-rooms", type=int, default=100_000,
                    help="P6: rooms created -> succeeded -> cleared (after the room "
                         "history settled)")
    ap.add_argument("--max-rooms", type=int, default=3000, help="P4: rooms per max-rate run")
    ap.add_argument("--rate-rooms", type=int, default=1000,
                    help="P4: rooms per run at 100 and 500 rooms/s")
    ap.add_argument("--rows", default="P1,P4,P5,P6,P8", help="issue14: which rows")
    ap.add_argument("--tcp-pool", action="store_true",
                    help="P4 and P9: kvd daemons with transfer_tcp_pool = true (Mooncake's "
                         "per-peer TCP connection pool; off by default since K39); P1 always "
                         "compares kvd, the raw engine and SGLang with the pool on, and "
                         "without this option adds kvd at its defaults (P1.<size>.pool_off)")
    ap.add_argument("--p1-before", default=None, metavar="TREE",
                    help="P1: also run another checkout's kvd (a git worktree of an older "
                         "commit) on the same rooms at the same settings, interleaved "
                         "(rows P1.<size>.vs_before, .vs_before.pool_off)")
    ap.add_argument("--api-calls", type=int, default=3000,
                    help="P5: calls per placement for the trivial RPC and the echo")
    ap.add_argument("--api-rooms", type=int, default=100,
                    help="P5: idle-pair rooms per placement and repeat (send/init)")
    ap.add_argument("--layer-tokens", type=int, default=8192,
                    help="layers: prompt length in tokens")
    ap.add_argument("--model-layers", type=int, default=0,
                    help="layers: keep the reference model's first N layers (0: all 30)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the JSON result here (default: a new "
                         "benchmarks/results/bench-<time>.json)")
    args = ap.parse_args(argv)
    for name, low in (("repeats", 1), ("mib", 1), ("layers", 1), ("rooms", 1),
                      ("cancel_rooms", 1), ("cancel_mib", 1),
                      ("max_rooms", 1), ("rate_rooms", 1), ("api_rooms", 1),
                      ("api_calls", args.repeats), ("rss_rooms", 10), ("p9_rounds", 1)):
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} must be at least {low}, "
                     f"got {getattr(args, name)}")
    console = Console()
    only = set(args.only.split(","))
    sys.path.insert(0, str(Path(__file__).parent))
    import issue14
    import rows as rowlib

    results: dict[str, Any] = {"args": vars(args), "load_before": issue14.machine_load()}
    table_rows: dict[str, dict[str, Any]] = {}
    ok = True
    if "issue14" in only:
        results["issue14"], ok14 = _bench_issue14(console, args)
        table_rows |= issue14.rows_of(results["issue14"])
        ok &= ok14
    if "channel" in only:
        results["channel"] = _bench_channel(console, args)
        table_rows |= results["channel"]["rows"]
    if "p9" in only:
        import p9_bench

        results["p9"] = p9_bench.measure(args.p9_rounds, args.repeats, args.p9_step_ms / 1e3,
                                         **_kvd_settings(args))
        table_rows |= results["p9"]["rows"]
    if "transfer" in only:
        results["transfer"], ok = _bench_transfer(console, args)
    if "plan" in only:
        sys.path.insert(0, str(Path(__file__).parent))
        import plan_bench

        results["plan"] = plan_bench.run(console)
    if "hetero" in only:
        results["hetero"] = bench_hetero(console, args.repeats)
    if "samehost" in only:
        sys.path.insert(0, str(Path(__file__).parent))
        import samehost

        results["samehost"] = samehost.run(console, args.mib, args.item_kib, args.layers,
                                           args.repeats)
    if "flood" in only:
        sys.path.insert(0, str(Path(__file__).parent))
        import flood_bench

        results["flood"] = flood_bench.run(console, args.flood_seconds)
    if only & {"restart", "deadaddr"}:
        sys.path.insert(0, str(Path(__file__).parent))
        import membership_bench

        if "restart" in only:
            results["restart"] = membership_bench.bench_restart(
                console, args.repeats, args.restart_interval, args.restart_ttl)
        if "deadaddr" in only:
            results["deadaddr"] = membership_bench.bench_deadaddr(
                console, args.dead_addrs, args.dead_seconds)
    if "cancel" in only:
        sys.path.insert(0, str(Path(__file__).parent))
        import cancel_bench

        results["cancel"] = cancel_bench.run(console, args.cancel_rooms, args.cancel_mib,
                                             args.repeats, args.cancel_inflight_mib)
    if "layers" in only:
        results["layers"] = _bench_layers(console, args)
    results["load_after"] = issue14.machine_load()
    if table_rows:
        results["rows"] = table_rows
        load = " -> ".join(x.split("load average:")[-1].strip()
                           for x in (results["load_before"], results["load_after"]))
        Console(width=max(console.width, 180)).print(rowlib.table(
            table_rows, f"kvd benchmark rows (medians; load average {load}; "
                        f"CPUs {sorted(os.sched_getaffinity(0))})"))
        if "issue14" in only and not results["issue14"].get("sglang"):
            console.print("SGLang is not installed in this environment: P1b, P9 and the "
                          "SGLang baselines skipped (`make bench` installs it in .venv-bench)")
    out = args.out or _new_result_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    console.print(f"saved {out}")
    return 0 if ok else 1


def _kvd_settings(args: Any) -> dict[str, Any]:
    """Daemon settings the options ask for (``--tcp-pool``)."""
    return {"transfer_tcp_pool": True} if args.tcp_pool else {}


def _new_result_path() -> Path:
    """A result file no other run wrote: ``bench-<time>.json``, ``-2``, ``-3``... when two
    runs end in the same second (a second run must never overwrite the first's numbers)."""
    stem = f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = RESULTS / f"{stem}.json", 1
    while out.exists():
        n += 1
        out = RESULTS / f"{stem}-{n}.json"
    return out


def _bench_layers(console: Console, args: Any) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    import layers_bench

    out = layers_bench.run(args.layer_tokens, args.model_layers, args.repeats)
    table = Table(title=f"layer streaming: {out['tokens']} tokens, {out['layers']} layers, "
                        f"{out['kv_bytes'] >> 20} MiB of KV (medians, s)")
    for col in ("mode", "TTFT", "forward", "exposed transfer", "in writes"):
        table.add_column(col)
    for mode, m in out["median"].items():
        table.add_row(mode, f"{m['ttft_s']:.3f}", f"{m['compute_s']:.3f}",
                      f"{m['exposed_s']:.3f}", f"{m['xfer_s']:.3f}")
    console.print(table)
    console.print(f"TTFT layers/whole = {out['ttft_ratio_layers_over_whole']:.3f}; hidden "
                  f"{out['hidden_fraction']:.2f} of the transfer (goal >= {out['goal_hidden']})")
    return out


def _bench_channel(console: Console, args: Any) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    import channel_bench
    import issue14

    out: dict[str, Any] = {"rows": {}, "placements": {}}
    on = {"free": "placed by the scheduler", "same": "one CPU",
          "cross": "engine on CPU 0, kvd on CPU 1"}
    have = issue14.placements(os.sched_getaffinity(0))
    for where in args.channel_placements.split(","):
        if where not in have:
            continue
        with issue14.placed(where):
            got = channel_bench.measure(max(args.repeats, 3), args.api_rooms)
        out["placements"][where] = got
        suffix = {"free": "", "same": ".one_cpu", "cross": ".two_cpus"}.get(where, f".{where}")
        for key, r in got["rows"].items():
            out["rows"][key + suffix] = r | {"measure": f"{r['measure']}, {on.get(where, where)}"}
    return out


def _bench_issue14(console: Console, args: Any) -> tuple[dict[str, Any], bool]:
    sys.path.insert(0, str(Path(__file__).parent))
    import issue14

    rows, out = set(args.rows.split(",")), {"load_before": issue14.machine_load()}
    if "P1" in rows:
        out["P1"] = issue14.bench_bulk(args.mib, args.layers, args.repeats,
                                       before=args.p1_before, **_kvd_settings(args))
    if "P4" in rows:
        out["P4"] = issue14.bench_rooms(args.repeats, args.max_rooms, args.rate_rooms,
                                        **_kvd_settings(args))
    if "P5" in rows:
        out["P5"] = issue14.bench_api(args.api_calls, args.repeats, args.api_rooms)
    if "P6" in rows:
        out["P6"] = issue14.bench_rss(args.rss_rooms)
    if "P8" in rows:
        out["P8"] = issue14.bench_isolation()
    out["load_after"] = issue14.machine_load()
    out["sglang"] = issue14.have_sglang()
    ok = all(b["bytes_equal"] for b in out.get("P1", {}).values())
    ok &= all(out[k]["bad_bytes"] == 0 for k in ("P4", "P6") if k in out)
    return out, ok


def _bench_transfer(console: Console, args: Any) -> tuple[dict[str, Any], bool]:
    lay = _layout(args.mib, args.item_kib, args.layers)
    rng = np.random.default_rng(0)
    src = rng.choice(lay["num_pages"], lay["move_pages"], replace=False)
    dst = rng.choice(lay["num_pages"], lay["move_pages"], replace=False)
    nbytes = lay["move_pages"] * lay["item_len"] * 2 * lay["layers"]
    console.print(f"moving {nbytes / 2**20:.0f} MiB: {lay['move_pages']} random pages x "
                  f"{2 * lay['layers']} buffers x {lay['item_len'] // 1024} KiB")
    kvd_path, raw_path = KvdPath(lay, args.rooms), RawPath(lay, src, dst)
    kvd_t: list[float] = []
    raw_t: list[float] = []
    ok = True
    try:  # interleaved, after one warm-up round each: both see the same machine state
        for rep in range(args.repeats + 1):
            (kt, k_ok), (rt, r_ok) = kvd_path.run(src, dst), raw_path.run()
            ok &= k_ok and r_ok
            if rep:
                kvd_t.append(kt)
                raw_t.append(rt)
    finally:
        kvd_path.close()
        raw_path.close()
    mem_t = bench_memcpy(lay, src, dst, args.repeats)
    return _report(console, nbytes, kvd_t, raw_t, mem_t, ok, lay, args), ok


def _report(console: Console, nbytes: int, kvd_t: list[float], raw_t: list[float],
            mem_t: list[float], ok: bool, lay: dict[str, int], args: Any) -> dict[str, Any]:
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in
            (("kvd", kvd_t), ("raw_mooncake", raw_t), ("memcpy", mem_t))}
    table = Table(title="P -> D transfer (median of repeats)")
    for col in ("path", "seconds", "GB/s", "vs raw"):
        table.add_column(col, justify="right")
    for name, t in (("kvd", kvd_t), ("raw_mooncake", raw_t), ("memcpy", mem_t)):
        table.add_row(name, f"{statistics.median(t):.3f}", f"{gbps[name]:.2f}",
                      f"{gbps[name] / gbps['raw_mooncake']:.2f}x")
    console.print(table)
    ratio = gbps["kvd"] / gbps["raw_mooncake"]
    console.print(f"kvd/raw = {ratio:.2f} (goal >= 0.9); bytes equal: {ok}")
    return {"bytes": nbytes, "layout": lay, "args": vars(args), "seconds":
            {"kvd": kvd_t, "raw_mooncake": raw_t, "memcpy": mem_t}, "gbps": gbps,
            "ratio_kvd_over_raw": ratio, "bytes_equal": ok}


if __name__ == "__main__":
    sys.exit(main())
