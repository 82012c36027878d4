"""kvd benchmarks, each reported as a ratio against a baseline measured in the same run.

transfer: the same KV pages (>= 256 MiB, random page indices) moved P -> D
  (a) through two kvd daemons (engine RPC, control plane, planner, executor),
  (b) directly through two raw Mooncake engines in separate processes (same descriptors),
  (c) memcpy of the same pages inside one process (the machine's ceiling).
Prints kvd/raw (goal >= 0.9) and saves JSON under benchmarks/results/.

Usage: python benchmarks/run.py [--mib 256] [--repeats 3] [--item-kib 64]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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
from kvd.refengine.standin import EngineStandIn
from kvd.transfer.plan import plan_pages

RESULTS = Path(__file__).parent / "results"


def _layout(mib: int, item_kib: int, layers: int) -> dict[str, int]:
    item = item_kib * 1024
    move_pages = max(1, (mib << 20) // (2 * layers * item))
    return {"item_len": item, "layers": layers, "move_pages": move_pages,
            "num_pages": 2 * move_pages}


def bench_kvd(lay: dict[str, int], src: np.ndarray, dst: np.ndarray, repeats: int,
              rooms: int) -> tuple[list[float], bool]:
    work = Path(tempfile.mkdtemp(prefix="kvd-bench-"))
    prefill = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING")
    decode = start_daemon("decode", work, log_level="WARNING")
    opts = {"num_layers": lay["layers"], "num_pages": lay["num_pages"],
            "item_len": lay["item_len"]}
    p, d = EngineStandIn(prefill.socket, seed=1, **opts), EngineStandIn(decode.socket, seed=2,
                                                                       **opts)
    times, ok = [], True
    try:
        for rep in range(repeats + 1):  # the first round warms up connections
            base = 10_000 * (rep + 1)
            parts = np.array_split(np.arange(src.size), rooms)
            for i, idx in enumerate(parts):
                Receiver(d.client, base + i, prefill.http_addr).init(dst[idx], i % 16)
            senders = []
            for i, idx in enumerate(parts):
                s = Sender(p.client, base + i)
                s.init(int(idx.size), 0)
                senders.append((s, idx))
            t0 = time.perf_counter()
            for s, idx in senders:
                s.send(src[idx])
            ids = [base + i for i in range(rooms)]
            states = wait_many(d.client, ids, 60.0)
            elapsed = time.perf_counter() - t0
            ok &= all(x == KVPoll.Success for x in states) and d.pages_equal(p, src, dst)
            if rep:
                times.append(elapsed)
            for s, _ in senders:
                s.clear()
            for i in ids:
                Receiver.clear(_Stub(d.client, i))  # type: ignore[arg-type]
    finally:
        p.close()
        d.close()
        prefill.stop()
        decode.stop()
    return times, ok


class _Stub:
    def __init__(self, client: Any, room: int) -> None:
        self.client, self.room = client, room


def _raw_receiver(nbytes: int, conn: Any) -> None:
    from kvd.transfer.engine import MooncakeEngine

    engine = MooncakeEngine("127.0.0.1")
    buf = np.zeros(nbytes, dtype=np.uint8)
    engine.register(buf.ctypes.data, nbytes)
    conn.send((engine.session_id, buf.ctypes.data))
    conn.recv()  # until the sender is done
    conn.send(int(buf.astype(np.uint64).sum()))


def bench_raw(lay: dict[str, int], src: np.ndarray, dst: np.ndarray,
              repeats: int) -> tuple[list[float], bool]:
    from kvd.transfer.engine import MooncakeEngine

    per_buf = lay["num_pages"] * lay["item_len"]
    nbufs = 2 * lay["layers"]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_receiver, args=(per_buf * nbufs, child))
    proc.start()
    session, dst_base = parent.recv()
    engine = MooncakeEngine("127.0.0.1")
    buf = np.random.default_rng(1).integers(0, 256, per_buf * nbufs, dtype=np.uint8)
    engine.register(buf.ctypes.data, buf.nbytes)
    offs = np.arange(nbufs, dtype=np.uint64) * np.uint64(per_buf)
    items = [lay["item_len"]] * nbufs
    desc = plan_pages(np.uint64(buf.ctypes.data) + offs, np.uint64(dst_base) + offs, items,
                      items, src, dst)
    times = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        engine.write(session, desc)
        if rep:
            times.append(time.perf_counter() - t0)
    parent.send("done")
    parent.recv()
    proc.join()
    return times, True


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--item-kib", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rooms", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    console = Console()
    lay = _layout(args.mib, args.item_kib, args.layers)
    rng = np.random.default_rng(0)
    src = rng.choice(lay["num_pages"], lay["move_pages"], replace=False)
    dst = rng.choice(lay["num_pages"], lay["move_pages"], replace=False)
    nbytes = lay["move_pages"] * lay["item_len"] * 2 * lay["layers"]
    console.print(f"moving {nbytes / 2**20:.0f} MiB: {lay['move_pages']} random pages x "
                  f"{2 * lay['layers']} buffers x {lay['item_len'] // 1024} KiB")
    kvd_t, kvd_ok = bench_kvd(lay, src, dst, args.repeats, args.rooms)
    raw_t, _ = bench_raw(lay, src, dst, args.repeats)
    mem_t = bench_memcpy(lay, src, dst, args.repeats)
    result = _report(console, nbytes, kvd_t, raw_t, mem_t, kvd_ok, lay, args)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"transfer-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    console.print(f"saved {out}")
    return 0 if kvd_ok else 1


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
