"""P5 with the shared-memory engine channel (issue 21): engine-thread cost of the calls an
engine makes per room, through the status table and through the socket, in one run.

Two real daemons (prefill + decode) and two engine clients on each: one that maps the
status table (``use_table=True``, the default) and one that does not (the socket path,
the baseline). Measured, interleaved, medians of ``repeats`` blocks:

- ``poll`` of 1 000 live rooms: :func:`kvd.client.poll_array` with a uint64 array (the
  table's numpy gather), :func:`kvd.client.poll_many` with a list, and the socket's
  ``Poll`` (``poll_many`` on the table-less client);
- one room's ``Sender.poll()``;
- ``Receiver.init`` / ``Sender.send`` of 1-page rooms one at a time on an idle pair
  (these still go over the socket until the submission ring lands: value = baseline).

Rows (``benchmarks/results/channel.json``), keyed by id: ``value``, ``baseline``,
``ratio`` (value / baseline), ``goal`` and ``met``.

Usage: python benchmarks/channel_bench.py [--repeats 5] [--rooms 100]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
GOAL_US = 20.0


def _p50_us(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def _row(value: float, baseline: float, goal: str, met: bool, what: str) -> dict[str, Any]:
    return {"measure": what, "value": round(value, 2), "baseline": round(baseline, 2),
            "ratio": round(value / baseline, 4) if baseline else None, "goal": goal,
            "met": met, "unit": "us"}


def measure(repeats: int = 5, rooms_each: int = 100, polls: int = 300) -> dict[str, Any]:
    """The numbers above (microseconds, medians of block medians)."""
    from kvd.client import KvdClient, Receiver, Sender, poll_array, poll_many, wait_many
    from kvd.launch import start_daemon
    from kvd.protocol import rpc
    from kvd.refengine.standin import EngineStandIn

    res: dict[str, list[float]] = {k: [] for k in (
        "poll_array_table", "poll_array_random", "poll_many_table", "poll_socket", "poll_one_table",
        "poll_one_socket", "send", "init")}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as work:
        pd = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING")
        stack.callback(pd.stop)
        dd = start_daemon("decode", work, log_level="WARNING")
        stack.callback(dd.stop)
        pool = {"num_layers": 4, "num_pages": 1024, "item_len": 4096, "aux_slots": 64,
                "aux_item_len": 64}
        pe = EngineStandIn(pd.socket, seed=1, **pool)
        stack.callback(pe.close)
        de = EngineStandIn(dd.socket, seed=2, **pool)
        stack.callback(de.close)
        client = pe.client
        if client.table is None:
            raise RuntimeError("the prefill kvd served no status table (engine_channel off?)")
        plain = KvdClient(pd.socket, use_table=False)
        stack.callback(plain.close)
        ids = list(range(1, 1001))
        arr = np.array(ids, dtype=np.uint64)
        held = [Sender(client, r) for r in ids]  # 1 000 live rooms (Bootstrapping)
        rng = np.random.default_rng(21)  # and 1 000 with random 63-bit ids (SGLang's)
        rand = [int(x) for x in rng.integers(1 << 40, 1 << 63, 1000, dtype=np.int64)]
        for r in rand:
            Sender(client, r)
        rand_arr = np.array(rand, dtype=np.uint64)
        one = held[0]
        one_plain = Sender.attach(plain, 1)
        assert poll_array(client, arr).tolist() == poll_many(plain, ids)
        room = 1_000_000
        for _ in range(repeats):
            res["poll_array_table"].append(_p50_us(lambda: poll_array(client, arr), polls))
            res["poll_array_random"].append(_p50_us(lambda: poll_array(client, rand_arr),
                                                    polls))
            res["poll_many_table"].append(_p50_us(lambda: poll_many(client, ids), polls))
            res["poll_socket"].append(_p50_us(lambda: poll_many(plain, ids), polls // 3))
            res["poll_one_table"].append(_p50_us(one.poll, polls))
            res["poll_one_socket"].append(_p50_us(one_plain.poll, polls))
            sends, inits = [], []
            for _ in range(rooms_each):
                room += 1
                page = np.array([room % 1024])
                s = Sender(client, room)
                s.init(1, room % 64)
                r = Receiver(de.client, room, pd.http_addr)
                t = time.perf_counter()
                r.init(page, room % 64)
                inits.append(time.perf_counter() - t)
                t = time.perf_counter()
                s.send(page)
                sends.append(time.perf_counter() - t)
                assert wait_many(de.client, [room], 30) == [4], f"room {room} failed"
                assert wait_many(client, [room], 30) == [4], f"room {room} failed"
                de.client.call(rpc.Clear(room=room))
                client.call(rpc.Clear(room=room))
            res["send"].append(1e6 * statistics.median(sends))
            res["init"].append(1e6 * statistics.median(inits))
        for r in ids + rand:
            client.call(rpc.Abort(room=r))
            client.call(rpc.Clear(room=r))
    m = {k: statistics.median(v) for k, v in res.items()}
    rows = {
        "P5.poll_1000": _row(m["poll_array_table"], m["poll_socket"], f"<= {GOAL_US:g} us",
                             m["poll_array_table"] <= GOAL_US,
                             "poll of 1 000 rooms: poll_array (table) vs Poll RPC"),
        "P5.poll_1000_random": _row(m["poll_array_random"], m["poll_socket"],
                                    f"<= {GOAL_US:g} us", m["poll_array_random"] <= GOAL_US,
                                    "poll of 1 000 rooms with random 63-bit ids: "
                                    "poll_array (table) vs Poll RPC"),
        "P5.poll_1000_list": _row(m["poll_many_table"], m["poll_socket"], f"<= {GOAL_US:g} us",
                                  m["poll_many_table"] <= GOAL_US,
                                  "poll of 1 000 rooms: poll_many(list) (table) vs Poll RPC"),
        "P5.poll_one": _row(m["poll_one_table"], m["poll_one_socket"], f"<= {GOAL_US:g} us",
                            m["poll_one_table"] <= GOAL_US,
                            "one room's poll(): table vs Poll RPC"),
        "P5.send": _row(m["send"], m["send"], f"<= {GOAL_US:g} us", m["send"] <= GOAL_US,
                        "Sender.send p50, idle pair (socket: no submission ring yet)"),
        "P5.init": _row(m["init"], m["init"], f"<= {GOAL_US:g} us", m["init"] <= GOAL_US,
                        "Receiver.init p50, idle pair (socket: no submission ring yet)"),
    }
    return {"rows": rows, "runs": res, "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rooms", type=int, default=100)
    args = ap.parse_args(argv)
    out = measure(args.repeats, args.rooms)
    for key, r in out["rows"].items():
        print(f"{key:20} {r['value']:9.1f} us  baseline {r['baseline']:9.1f} us  "
              f"ratio {r['ratio']:.3f}  goal {r['goal']}  met {'yes' if r['met'] else 'NO'}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "channel.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
