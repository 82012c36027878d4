"""Where a kvd prefill daemon's time goes under P1's bulk load: py-spy on both daemons.

Starts a kvd pair (benchmarks/rooms.py) with P1's pages (``--mib`` per room, ``--kib``
items, ``--layers``, random source and destination pages, as benchmarks/issue14.py),
moves one room to warm the connections up, then moves ``--rooms`` rooms one after the
other while ``py-spy record`` samples each daemon (``--rate`` Hz, all threads, idle
samples dropped). Prints GB/s and, per daemon, the functions with the most samples, self
and inclusive, as shares of that daemon's samples (benchmarks/profile_rooms.py's
summary); writes the collapsed stacks to ``benchmarks/results/pyspy-bulk-<role>-<kib>KiB.txt``.

Usage: python benchmarks/profile_bulk.py [--kib 12] [--tcp-pool] [--native]
(py-spy: ``make bench`` installs it in .venv-bench; run as root or with ptrace allowed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rooms
from profile_rooms import RESULTS, _pyspy, summarize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=12, help="item size, KiB")
    ap.add_argument("--mib", type=int, default=256, help="bytes per room, MiB")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rooms", type=int, default=4, help="rooms sampled, one at a time")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--tree", default=None, help="another checkout's kvd")
    ap.add_argument("--native", action="store_true", help="C frames too (py-spy --native)")
    ap.add_argument("--tcp-pool", action="store_true",
                    help="daemons with transfer_tcp_pool = true (Mooncake's TCP pool)")
    args = ap.parse_args()
    item = args.kib * 1024
    move = max(1, (args.mib << 20) // (2 * args.layers * item))
    pages = move + move // 4 + 1
    rng = np.random.default_rng(args.kib)
    src, dst = rng.permutation(pages)[:move], rng.permutation(pages)[:move]
    pair = rooms.Pair("kvd", args.layers, item, tempfile.mkdtemp(prefix="kvd-prof-"),
                      pages=pages, tree=args.tree, transfer_tcp_pool=args.tcp_pool)
    names = ["prefill", "decode"]
    try:
        pair.bulk(src, dst)  # warm up: connections, registration
        out_dir = Path(tempfile.mkdtemp(prefix="kvd-pyspy-"))
        spies = [subprocess.Popen([_pyspy(), "record", "--pid", str(pid), "--rate",
                                   str(args.rate), "--format", "raw", "--threads",
                                   "--output", str(out_dir / f"{name}.txt"),
                                   *(["--native"] if args.native else ["--nonblocking"])],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for name, pid in zip(names, pair.daemon_pids(), strict=True)]
        time.sleep(1.0)  # py-spy attached
        runs = [pair.bulk(src, dst) for _ in range(args.rooms)]
        for s in spies:
            s.send_signal(2)  # SIGINT: py-spy writes its output and exits
        for s in spies:
            s.wait(30)
    finally:
        pair.close()
    nbytes = 2 * args.layers * move * item
    report: dict[str, object] = {
        "kib": args.kib, "entries": 2 * args.layers * move, "tcp_pool": args.tcp_pool,
        "tree": args.tree or "this checkout", "gbps": [nbytes / t / 1e9 for t, _ in runs],
        "bytes_equal": all(ok for _, ok in runs)}
    RESULTS.mkdir(exist_ok=True)
    for name in names:
        raw = (out_dir / f"{name}.txt").read_text()
        report[name] = summarize(raw)
        (RESULTS / f"pyspy-bulk-{name}-{args.kib}KiB.txt").write_text(raw)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
