"""Where a kvd daemon's time goes under the P4 room load: py-spy on both daemons.

Starts a kvd pair (benchmarks/rooms.py), warms it up, then runs 1-page rooms at max rate
(``--window`` in flight) while ``py-spy record`` samples each daemon (``--rate`` Hz,
all threads, idle samples dropped). Prints, per daemon, the CPU it used per room and
the functions with the most samples, self and inclusive (a function counted once per
sample even if it recurses), as shares of that daemon's samples. Writes the raw
collapsed stacks next to the JSON results for flame graphs.

``--batch``: each engine round in one ``Many`` (P4's batched row); ``--ring``: the
engines use the submission ring and the status table, each round's calls in one
``submit_all`` (P4's ring row, issue 21). The report names the load it ran.

Usage: python benchmarks/profile_rooms.py [--rooms 4000] [--tree PATH] [--batch | --ring]
(py-spy: ``make bench`` installs it in .venv-bench; run as root or with ptrace allowed).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rooms

RESULTS = Path(__file__).resolve().parent / "results"


def _pyspy() -> str:
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy not found: make bench installs it in .venv-bench")
    return found


def summarize(raw: str, top: int = 25) -> dict[str, list[tuple[str, float]]]:
    """Self and inclusive shares of the top functions in collapsed stacks ``raw``
    (lines ``frame;frame;... count``)."""
    self_n: collections.Counter[str] = collections.Counter()
    incl_n: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")"
                  if " (" in f else f for f in stack.split(";")]
        total += n
        self_n[frames[-1]] += n
        for f in set(frames):
            incl_n[f] += n
    def share(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(100 * n / max(total, 1), 1)) for f, n in c.most_common(top)]

    return {"samples": [("total", float(total))], "self": share(self_n),
            "inclusive": share(incl_n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rooms", type=int, default=4000)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--tree", default=None, help="another checkout's kvd")
    ap.add_argument("--native", action="store_true", help="C frames too (py-spy --native)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--batch", action="store_true", help="each engine round in one Many")
    load.add_argument("--ring", action="store_true",
                      help="the engines use the ring and the table (submit_all per round)")
    ap.add_argument("--tcp-pool", action="store_true",
                    help="daemons with transfer_tcp_pool = true (Mooncake's TCP pool)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvd-prof-")
    pair = rooms.Pair("kvd", 4, 4096, work, tree=args.tree, ring=args.ring,
                      **({"transfer_tcp_pool": True} if args.tcp_pool else {}))
    batch = args.batch or args.ring
    try:
        pair.run(300, None, args.window, batch=batch)  # warm up: peers known, caches filled
        names = ["prefill", "decode"]
        out_dir = Path(tempfile.mkdtemp(prefix="kvd-pyspy-"))
        spies = [subprocess.Popen([_pyspy(), "record", "--pid", str(pid), "--rate",
                                   str(args.rate), "--format", "raw", "--threads",
                                   "--output", str(out_dir / f"{name}.txt"),
                                   *(["--native"] if args.native else ["--nonblocking"])],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for name, pid in zip(names, pair.daemon_pids(), strict=True)]
        time.sleep(1.0)  # py-spy attached
        result = pair.run(args.rooms, None, args.window, batch=batch)
        for s in spies:
            s.send_signal(2)  # SIGINT: py-spy writes its output and exits
        for s in spies:
            s.wait(30)
        report = {"run": {k: v for k, v in result.items() if k != "latencies"},
                  "tree": args.tree or "this checkout",
                  "load": "ring" if args.ring else "many" if args.batch else "per call",
                  "tcp_pool": args.tcp_pool}
        for name in names:
            raw = (out_dir / f"{name}.txt").read_text()
            report[name] = summarize(raw)
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / f"pyspy-{name}-{report['load'].replace(' ', '-')}.txt").write_text(raw)
    finally:
        pair.close()
    print(json.dumps(report, indent=1))
    suffix = "" if report["load"] == "per call" else f"-{report['load']}"
    (RESULTS / f"profile-rooms{suffix}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
