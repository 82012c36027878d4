"""P5 with the shared-memory engine channel (issue 21): engine-thread cost of the calls an
engine makes per room, through the status table and through the socket, in one run.

Two real daemons (prefill + decode) and two engine clients on each: one that maps the
status table (``use_table=True``, the default) and one that does not (the socket path,
the baseline). Measured, interleaved, medians of ``repeats`` blocks:

- ``poll`` of 1 000 live rooms: :func:`kvd.client.poll_array` with a uint64 array (the
  table's numpy gather), :func:`kvd.client.poll_many` with a list, and the socket's
  ``Poll`` (``poll_many`` on the table-less client);
- one room's ``Sender.poll()``;
- ``Receiver(...)`` (its create), ``Receiver.init`` / ``Sender.send`` of 1-page rooms
  one at a time on an idle pair,
  through the submission ring (both engines' clients have ``use_ring=True``) and over
  the socket (a second, ring-less client on each daemon), alternating room by room;
- ``Sender.send`` of a round of :data:`ROUND` rooms back to back (an engine step's
  chunks: kvd is draining while the engine submits, so the ring needs no syscall),
  through the ring and over the socket.

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
#: Rooms of one engine round (``P5.send_round``).
ROUND = 32


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
    from kvd.client import KvdClient, Sender, poll_array, poll_many
    from kvd.launch import start_daemon
    from kvd.protocol import rpc
    from kvd.refengine.standin import EngineStandIn

    res: dict[str, list[float]] = {k: [] for k in (
        "poll_array_table", "poll_array_random", "poll_many_table", "poll_socket", "poll_one_table",
        "poll_one_socket", "send_ring", "init_ring", "send_socket", "init_socket",
        "create_ring", "create_socket", "round_ring", "round_socket")}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as work:
        pd = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING")
        stack.callback(pd.stop)
        dd = start_daemon("decode", work, log_level="WARNING")
        stack.callback(dd.stop)
        pool = {"num_layers": 4, "num_pages": 1024, "item_len": 4096, "aux_slots": 64,
                "aux_item_len": 64}
        pe = EngineStandIn(pd.socket, use_ring=True, seed=1, **pool)
        stack.callback(pe.close)
        de = EngineStandIn(dd.socket, use_ring=True, seed=2, **pool)
        stack.callback(de.close)
        client = pe.client
        if client.table is None or client.ring is None or de.client.ring is None:
            raise RuntimeError("a kvd served no status table or ring (engine_channel off?)")
        plain = KvdClient(pd.socket, use_table=False)  # the socket path: no table, no ring
        stack.callback(plain.close)
        dplain = KvdClient(dd.socket, use_table=False)
        stack.callback(dplain.close)
        paths = {"ring": (client, de.client), "socket": (plain, dplain)}
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
            times: dict[str, list[float]] = {f"{k}_{m}": [] for k in ("send", "init", "create",
                                                                      "round")
                                              for m in paths}
            for _ in range(rooms_each):
                for mode, (pc, dc) in paths.items():
                    room += 1
                    _one_room(pc, dc, pd.http_addr, room, times, mode)
            for mode, (pc, _dc) in paths.items():
                room += ROUND
                _round(pc, room, times[f"round_{mode}"])
            for key, values in times.items():
                res[key].append(1e6 * statistics.median(values))
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
        "P5.send": _row(m["send_ring"], m["send_socket"], f"<= {GOAL_US:g} us",
                        m["send_ring"] <= GOAL_US,
                        "Sender.send p50, idle pair, one room at a time: ring vs socket"),
        "P5.init": _row(m["init_ring"], m["init_socket"], f"<= {GOAL_US:g} us",
                        m["init_ring"] <= GOAL_US,
                        "Receiver.init p50, idle pair, one room at a time: ring vs socket"),
        "P5.create": _row(m["create_ring"], m["create_socket"], f"<= {GOAL_US:g} us",
                          m["create_ring"] <= GOAL_US,
                          "Receiver(...) (its create) p50, idle pair, one room at a time: "
                          "ring vs socket"),
        "P5.send_round": _row(m["round_ring"], m["round_socket"], f"<= {GOAL_US:g} us",
                              m["round_ring"] <= GOAL_US,
                              f"Sender.send p50 in a round of {ROUND} rooms back to back: "
                              f"ring vs socket"),
    }
    return {"rows": rows, "runs": res, "repeats": repeats}


def _one_room(pc: Any, dc: Any, bootstrap: str, room: int, times: dict[str, list[float]],
              mode: str) -> None:
    """One 1-page room on an idle pair through the clients ``pc`` (prefill) and ``dc``
    (decode); ``Receiver.init`` and ``Sender.send`` timed into ``times``."""
    from kvd.client import Receiver, Sender, wait_many
    from kvd.protocol import rpc

    page = np.array([room % 1024])
    s = Sender(pc, room)
    s.init(1, room % 64)
    t = time.perf_counter()
    r = Receiver(dc, room, bootstrap)
    times[f"create_{mode}"].append(time.perf_counter() - t)
    t = time.perf_counter()
    r.init(page, room % 64)
    times[f"init_{mode}"].append(time.perf_counter() - t)
    t = time.perf_counter()
    s.send(page)
    times[f"send_{mode}"].append(time.perf_counter() - t)
    assert wait_many(dc, [room], 30) == [4], f"room {room} failed"
    assert wait_many(pc, [room], 30) == [4], f"room {room} failed"
    assert s.refused is None and r.refused is None, f"room {room} refused"
    dc.call(rpc.Clear(room=room))
    pc.call(rpc.Clear(room=room))


def _round(pc: Any, first: int, out: list[float]) -> None:
    """:data:`ROUND` prefill rooms (no decode: they stay Bootstrapping), one chunk sent to
    each back to back and timed one by one; then aborted and cleared."""
    from kvd.client import Sender
    from kvd.protocol import rpc

    senders = [Sender(pc, first + i) for i in range(ROUND)]
    for s in senders:
        s.init(4, 0)
    page = np.array([1])
    for s in senders:
        t = time.perf_counter()
        s.send(page, is_last=False)
        out.append(time.perf_counter() - t)
    for s in senders:
        assert s.poll() == 1 and s.refused is None, f"room {s.room} refused"
        pc.call(rpc.Abort(room=s.room))
        pc.call(rpc.Clear(room=s.room))


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
