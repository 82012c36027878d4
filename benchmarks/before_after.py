"""Issue 14's bulk, room and API rows for two checkouts of kvd, interleaved in one run.

P1 (bulk: one room of random pages, 12 KiB / 64 KiB / 1 MiB items, GB/s) and P4 (1-page
rooms: max rooms/s with 128 in flight, latency p50/p99 at 100 and 500 rooms/s offered;
the per-call driver, the only one an older kvd has) run a kvd pair per
checkout (daemons and engine processes on that checkout's code, benchmarks/rooms.py),
alternating checkouts each repeat. P5 (trivial RPC, ``poll_many`` of 1 000 rooms, each
placed by the scheduler, then with the client and the daemon on one CPU and on two;
``Sender.send`` / ``Receiver.init`` p50 come from P4's 100 rooms/s runs) runs each
checkout's client against its own daemon in a child process, alternating too. Medians.

P1b: where SGLang is installed (.venv-bench), its own connector moves the same pages in
the same interleaving, and each checkout's P1 is also given as a ratio to it.
P6 (RSS idle and after ``--rss-rooms`` rooms) and P8 (isolation from a frozen decode) run
issue14.py's own benchmark in a child process on each checkout's kvd.

Usage: python benchmarks/before_after.py BEFORE [AFTER] [--repeats 3] (it works from a
temporary directory of its own: from inside a checkout, ``python -m``/``-c`` children
would import that checkout's kvd whatever PYTHONPATH says)
(AFTER defaults to this checkout; each is a path to a kvd source tree, e.g. a
``git worktree add --detach /tmp/before <commit>``). Writes results/before-after.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import rooms

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

API = """
import json, os, statistics, sys, tempfile, time
from kvd.client import Sender, poll_many
from kvd.launch import start_daemon
from kvd.protocol import rpc
from kvd.refengine.standin import EngineStandIn

def p50(fn, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)

work = tempfile.mkdtemp(prefix="kvd-ba-")
d = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING",
                 env={"PYTHONPATH": sys.argv[1]})
eng = EngineStandIn(d.socket, num_layers=1, num_pages=2048, item_len=1024, seed=1)
sys.path.insert(0, sys.argv[2])  # benchmarks/: the placements P5 uses in make bench
from issue14 import pin, placements

out = {}
every = os.sched_getaffinity(0)
try:
    empty = rpc.Poll(rooms=[])
    p50(lambda: eng.client.call(empty), 500)  # warm up
    ids = list(range(1, 1001))
    for room in ids:
        Sender(eng.client, room)
    for place, (mine, its) in placements(every).items():
        where = "" if place == "free" else "_" + place
        pin(os.getpid(), mine)
        pin(d.proc.pid, its)
        time.sleep(0.1)
        out["trivial_rpc" + where + "_p50_us"] = p50(lambda: eng.client.call(empty), 3000)
        out["poll_many_1000" + where + "_p50_us"] = p50(lambda: poll_many(eng.client, ids), 300)
finally:
    pin(os.getpid(), every)
    eng.close()
    d.stop()
print(json.dumps(out))
os._exit(0)
"""


def api(tree: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree, GLOG_minloglevel="2")
    out = subprocess.run([sys.executable, "-c", API, tree, str(HERE)], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def in_tree(tree: str, expr: str) -> Any:
    """``expr`` (over benchmarks/issue14.py, imported as ``issue14``) evaluated in a child
    process whose kvd (daemons and engines) is ``tree``'s; its JSON value."""
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import issue14; "
            f"print(json.dumps({expr}, default=str))")
    env = dict(os.environ, PYTHONPATH=tree, GLOG_minloglevel="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=3600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after", nargs="?", default=str(ROOT))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-rooms", type=int, default=3000)
    ap.add_argument("--rate-rooms", type=int, default=1000)
    ap.add_argument("--bulk-mib", type=int, default=256, help="P1 bytes per room; 0: skip")
    ap.add_argument("--rss-rooms", type=int, default=100_000, help="P6 rooms; 0: skip")
    ap.add_argument("--isolation", type=int, default=1, help="P8 runs per checkout; 0: skip")
    ap.add_argument("--skip-rooms", action="store_true", help="skip P4 and P5")
    args = ap.parse_args()
    for name in ("repeats", "max_rooms", "rate_rooms"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if 0 < args.rss_rooms < 10:
        ap.error("--rss-rooms must be 0 (skip) or at least 10")
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    # `python -c` and `python -m` put the working directory ahead of PYTHONPATH: from inside
    # a checkout every child (daemons, engines) would import that checkout's kvd
    os.chdir(tempfile.mkdtemp(prefix="kvd-ba-"))
    load = os.getloadavg()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        k: {"max": [], "100": [], "500": [], "api": []} for k in trees}
    pairs = {} if args.skip_rooms else {
        k: rooms.Pair("kvd", 4, 4096, tempfile.mkdtemp(prefix=f"kvd-{k}-"), tree=t)
        for k, t in trees.items()}
    try:
        for p in pairs.values():
            p.run(300, None, 64)
        for _ in range(args.repeats if pairs else 0):
            for k, p in pairs.items():
                runs[k]["max"].append(p.run(args.max_rooms, None, 128))
                runs[k]["100"].append(p.run(args.rate_rooms, 100.0, 256))
                runs[k]["500"].append(p.run(args.rate_rooms, 500.0, 256))
    finally:
        for p in pairs.values():
            p.close()
    for _ in range(0 if args.skip_rooms else args.repeats):
        for k, t in trees.items():
            runs[k]["api"].append(api(t))
    # P1b: SGLang's own connector on the same pages, interleaved (where it is installed:
    # .venv-bench); it does not depend on either checkout
    import issue14

    bulk_systems = [*trees, *(["sglang"] if issue14.have_sglang() else [])]
    bulk: dict[str, dict[str, float]] = {k: {} for k in bulk_systems} if args.bulk_mib else {}
    bulk_bad = 0
    for kib in (12, 64, 1024) if args.bulk_mib else ():
        item, layers = kib * 1024, 8
        move = max(1, (args.bulk_mib << 20) // (2 * layers * item))
        pages = move + move // 4 + 1
        rng = np.random.default_rng(kib)
        src, dst = rng.permutation(pages)[:move], rng.permutation(pages)[:move]
        bp = {k: rooms.Pair("kvd", layers, item, tempfile.mkdtemp(prefix=f"kvd-{k}-"),
                            pages=pages, tree=t) for k, t in trees.items()}
        if "sglang" in bulk_systems:
            bp["sglang"] = rooms.Pair("sglang", layers, item, tempfile.mkdtemp(prefix="sg-"),
                                      pages=pages)
        secs: dict[str, list[float]] = {k: [] for k in bp}
        try:
            for rep in range(args.repeats + 1):  # round 0 warms connections up
                for k, p in bp.items():
                    t, good = p.bulk(src, dst)
                    bulk_bad += not good
                    if rep:
                        secs[k].append(t)
        finally:
            for p in bp.values():
                p.close()
        for k in bp:
            bulk[k][f"{kib}KiB"] = 2 * layers * move * item / statistics.median(secs[k]) / 1e9

    rss = {k: in_tree(t, f"issue14.bench_rss({args.rss_rooms})") for k, t in trees.items()} \
        if args.rss_rooms else {}
    iso: dict[str, list[dict[str, Any]]] = {k: [] for k in trees} if args.isolation else {}
    for _ in range(args.isolation):
        for k, t in trees.items():
            iso[k].append(in_tree(t, "issue14.bench_isolation()"))

    def med(k: str, kind: str, field: str) -> float:
        return float(statistics.median(r[field] for r in runs[k][kind]))

    rows = [("P4 rooms/s, 128 in flight", "max", "rooms_per_s", "{:.0f}"),
            ("P4 CPU ms/room (both daemons)", "max", "cpu_ms_per_room", "{:.2f}"),
            ("P4 p50 at 100 rooms/s (ms)", "100", "p50_ms", "{:.2f}"),
            ("P4 p99 at 100 rooms/s (ms)", "100", "p99_ms", "{:.2f}"),
            ("P4 p50 at 500 rooms/s (ms)", "500", "p50_ms", "{:.2f}"),
            ("P4 p99 at 500 rooms/s (ms)", "500", "p99_ms", "{:.2f}"),
            ("P5 Sender.send p50 (us, at 100/s)", "100", "send_p50_us", "{:.0f}"),
            ("P5 Receiver.init p50 (us, at 100/s)", "100", "init_p50_us", "{:.0f}"),
            ("P5 trivial RPC p50 (us)", "api", "trivial_rpc_p50_us", "{:.1f}"),
            ("  trivial, engine and kvd on one CPU", "api", "trivial_rpc_same_p50_us", "{:.1f}"),
            ("  trivial, engine CPU 0, kvd CPU 1", "api", "trivial_rpc_cross_p50_us", "{:.1f}"),
            ("P5 poll_many 1 000 p50 (us)", "api", "poll_many_1000_p50_us", "{:.0f}"),
            ("  poll_many, engine and kvd on one CPU", "api", "poll_many_1000_same_p50_us",
             "{:.0f}"),
            ("  poll_many, engine CPU 0, kvd CPU 1", "api", "poll_many_1000_cross_p50_us",
             "{:.0f}")]
    if args.skip_rooms:
        rows = []
    # a placement that could not be made (one CPU allowed: no "cross") has no row
    rows = [r for r in rows if all(r[2] in x for k in trees for x in runs[k][r[1]])]
    table = {name: {k: med(k, kind, field) for k in trees} for name, kind, field, _ in rows}
    print(f"machine load before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'measure':40s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for name, _, _, fmt in rows:
        b, a = table[name]["before"], table[name]["after"]
        print(f"{name:40s} {fmt.format(b):>10s} {fmt.format(a):>10s} {a / b:>12.2f}x")
    bad = sum(r.get("bad_bytes", 0) + r.get("failed", 0) for k in runs
              for kind in ("max", "100", "500") for r in runs[k].get(kind, []))
    for size in bulk.get("before", {}):
        b, a = bulk["before"][size], bulk["after"][size]
        print(f"{'P1 bulk ' + size + ' items (GB/s)':40s} {b:>10.2f} {a:>10.2f} {a / b:>12.2f}x")
        if "sglang" in bulk:
            g = bulk["sglang"][size]
            print(f"{'P1b ' + size + ' vs SGLang ' + f'{g:.2f} GB/s':40s} {b / g:>9.2f}x "
                  f"{a / g:>9.2f}x")
    bad += bulk_bad
    for k in rss:
        bad += rss[k]["failed"] + rss[k]["bad_bytes"]
    if rss:
        b, a = rss["before"], rss["after"]
        for i, side in enumerate(("prefill", "decode")):
            print(f"{'P6 RSS idle, ' + side + ' (MB)':40s} {b['idle_mb'][i]:>10.0f} "
                  f"{a['idle_mb'][i]:>10.0f} {a['idle_mb'][i] / b['idle_mb'][i]:>12.2f}x")
        keys = [("growth_after_warm", "after the first rooms")]
        if b.get("history_rooms") and a.get("history_rooms"):
            keys = [("growth_after_history", "after the history filled"),
                    ("growth_after_settled", "after it settled")]
        for key, what in keys:
            if key in b and key in a:
                print(f"{'P6 growth ' + what + ' (%)':40s} {100 * b[key]:>10.1f} "
                      f"{100 * a[key]:>10.1f}")
    if iso:
        b8, a8 = (statistics.median(r["ratio_p99"] for r in iso[k]) for k in trees)
        bw, aw = (statistics.median(r["p99_ms"]["with_frozen"] for r in iso[k]) for k in trees)
        print(f"{'P8 healthy p99, one decode frozen (ms)':40s} {bw:>10.2f} {aw:>10.2f} "
              f"{aw / bw:>12.2f}x")
        print(f"{'P8 p99 frozen / p99 without':40s} {b8:>10.2f} {a8:>10.2f} {a8 / b8:>12.2f}x")
    print(f"failed rooms or wrong bytes: {bad}")
    out = {"trees": trees, "load_before": load, "load_after": os.getloadavg(), "table": table,
           "bulk_gbps": bulk, "rss": rss, "isolation": iso, "runs": runs, "bad": bad}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "before-after.json").write_text(json.dumps(out, indent=1, default=str))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
