"""1-page rooms through one prefill/decode pair: kvd (two daemons) vs SGLang's in-process
Mooncake connector, each engine rank in its own process (benchmarks/sides.py).

Both sides run the same schedule: room ``i`` is due at ``t0 + i / rate`` (or, at max
rate, as soon as fewer than ``window`` rooms are in flight). The decode side polls every
``POLL_S`` and records, per room, the time from its due time to Success; every room's
KV page is checked in every buffer. The caller interleaves runs and takes medians.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

POLL_S = 200e-6
WAIT_S = 0.05  # the longest Wait of the wait-driven kvd variant


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _make_side(spec: dict[str, Any]) -> Any:
    import sides

    pages = spec.get("pages", sides.PAGES)
    if spec["system"] == "kvd":
        return sides.KvdSide(spec["role"], spec["socket"], spec["bootstrap"], spec["layers"],
                             spec["item"], pages, ring=spec.get("ring", False))
    return sides.SglangSide(spec["role"], spec["bootstrap_port"], spec["layers"], spec["item"],
                            pages)


def _side_main(spec: dict[str, Any], conn: Any) -> None:
    import sys

    if spec.get("tree"):  # another checkout's kvd (before/after comparisons)
        sys.path.insert(0, spec["tree"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    side = _make_side(spec)
    expected = None
    if spec["role"] == "decode":
        import sides

        expected = sides.expected_kv(spec["layers"], spec["item"],
                                     spec.get("pages", sides.PAGES))
    conn.send(("ready", os.getpid()))
    while (cmd := conn.recv()) is not None:
        conn.send(_bulk(side, cmd, expected) if "src" in cmd else _drive(side, cmd, expected))
    side.close()


def _bulk(side: Any, cmd: dict[str, Any], expected: list[np.ndarray] | None) -> dict[str, Any]:
    """One room of many pages: the prefill returns when it sent, the decode when the room
    succeeded (monotonic times; the parent subtracts), bytes checked on the decode. A kvd
    side waits in kvd (``Wait``, the engine API's way to wait for a transfer); SGLang's
    polls its in-process state every ``POLL_S``."""
    import sides

    room, src, dst = cmd["room"], np.asarray(cmd["src"]), np.asarray(cmd["dst"])
    if expected is None:  # prefill: send at t0
        while time.monotonic() < cmd["t0"]:
            time.sleep(0.0005)
        sent = time.monotonic()
        side.bulk(room, src)
    else:
        side.bulk(room, dst)
    wait = getattr(side, "wait_any", None)  # kvd: block in kvd (Wait), no poll RPC loop
    # (None: SGLang, or a kvd whose Wait has no any_done)
    while (st := (wait([room], 1.0) if wait else side.poll([room]))[0]) not in (
            sides.SUCCESS, sides.FAILED):
        if wait is None:
            time.sleep(POLL_S)
    done = time.monotonic()
    ok = st == sides.SUCCESS
    if ok and expected is not None:
        ok = all(np.array_equal(k[dst], e[src]) for k, e in zip(side.kv(), expected,
                                                                   strict=True))
    side.clear(room)
    return {"time": sent if expected is None else done, "ok": ok}


def _drive(side: Any, cmd: dict[str, Any], expected: list[np.ndarray] | None) -> dict[str, Any]:
    """Run rooms ``cmd['first'] .. + cmd['count']`` on this side; see the module doc."""
    import sides

    rooms = list(range(cmd["first"], cmd["first"] + cmd["count"]))
    rate, window, t0 = cmd["rate"], cmd["window"], cmd["t0"]
    while time.monotonic() < t0:
        time.sleep(0.001)
    pending: dict[int, float] = {}
    lat: list[float] = []
    failed = bad = i = 0
    side.times.clear()
    start = time.monotonic()
    clears: list[int] = []
    while cmd.get("batch") and (i < len(rooms) or pending):  # one Many per round
        now = time.monotonic()
        starts = []
        while i < len(rooms) and len(pending) < window and (not rate or now >= t0 + i / rate):
            starts.append(rooms[i])
            pending[rooms[i]] = t0 + i / rate if rate else now
            i += 1
        ids = list(pending)
        statuses = side.step(starts, clears, ids)
        clears = []
        for room, st in zip(ids, statuses, strict=True):
            if st not in (sides.SUCCESS, sides.FAILED):
                continue
            if st == sides.FAILED:
                failed += 1
            elif expected is not None:
                lat.append(time.monotonic() - pending[room])
                bad += not _page_ok(side, expected, room)
            clears.append(room)
            del pending[room]
        time.sleep(POLL_S)
    if clears:
        side.step([], clears, [])
    while i < len(rooms) or pending:
        now = time.monotonic()
        while i < len(rooms) and len(pending) < window and (not rate or now >= t0 + i / rate):
            side.start(rooms[i])
            pending[rooms[i]] = t0 + i / rate if rate else time.monotonic()
            i += 1
        if pending:
            ids = list(pending)
            if cmd.get("wait"):  # block in kvd until a room ends or the next one is due
                due = t0 + i / rate if rate and i < len(rooms) else now + WAIT_S
                statuses = side.wait_any(ids, max(0.0, min(due, now + WAIT_S) - now))
            else:
                statuses = side.poll(ids)
            for room, st in zip(ids, statuses, strict=True):
                if st not in (sides.SUCCESS, sides.FAILED):
                    continue
                done = time.monotonic()
                if st == sides.FAILED:
                    failed += 1
                elif expected is not None:
                    lat.append(done - pending[room])
                    bad += not _page_ok(side, expected, room)
                side.clear(room)
                del pending[room]
        if not cmd.get("wait") or not pending:
            time.sleep(POLL_S)
    elapsed = time.monotonic() - start
    return {"rooms": len(rooms), "seconds": elapsed, "failed": failed, "bad_bytes": bad,
            "latencies": lat, "api_p50_us": 1e6 * statistics.median(side.times)
            if side.times else None}


def _page_ok(side: Any, expected: list[np.ndarray], room: int) -> bool:
    """Does the decode hold the room's page exactly as the prefill wrote it, in every
    buffer?"""
    import sides

    page = room % sides.PAGES
    return all(np.array_equal(k[page], e[page])
               for k, e in zip(side.kv(), expected, strict=True))


class Pair:
    """A prefill and a decode engine process for one system (``kvd`` or ``sglang``)."""

    def __init__(self, system: str, layers: int, item: int, work: str,
                 pages: int | None = None, tree: str | None = None, ring: bool = False,
                 **daemon: Any) -> None:
        """``ring`` (kvd only): the engines' room calls go through the submission ring
        and their polls read the status table (issue 21)."""
        self.system, self.daemons = system, []
        ctx = mp.get_context("spawn")
        specs: list[dict[str, Any]] = []
        base: dict[str, Any] = {"system": system, "layers": layers, "item": item}
        if ring:
            base["ring"] = True
        if pages is not None:
            base["pages"] = pages
        if tree is not None:  # daemons and engine processes run that checkout's kvd
            base["tree"] = tree
            daemon["env"] = {"PYTHONPATH": tree}
        if system == "kvd":
            from kvd.launch import start_daemon

            p = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING",
                             **daemon)
            d = start_daemon("decode", work, log_level="WARNING", **daemon)
            self.daemons = [p, d]
            specs = [base | {"role": "prefill", "socket": p.socket, "bootstrap": p.http_addr},
                     base | {"role": "decode", "socket": d.socket, "bootstrap": p.http_addr}]
        else:
            port = 20000 + os.getpid() % 20000
            specs = [base | {"role": "prefill", "bootstrap_port": port},
                     base | {"role": "decode", "bootstrap_port": port}]
        self.conns, self.procs, self.pids = [], [], []
        for spec in specs:
            a, b = ctx.Pipe()
            proc = ctx.Process(target=_side_main, args=(spec, b), daemon=True)
            proc.start()
            msg = a.recv()
            assert msg[0] == "ready"
            self.conns.append(a)
            self.procs.append(proc)
            self.pids.append(msg[1])
            time.sleep(0.5 if system == "sglang" else 0.0)  # prefill registers first
        self.next_room = 1

    def daemon_pids(self) -> list[int]:
        return [d.proc.pid for d in self.daemons] or self.pids

    def run(self, count: int, rate: float | None, window: int,
            wait: bool = False, batch: bool = False) -> dict[str, Any]:
        """Run ``count`` rooms; returns decode latencies, rooms/s, CPU of the daemons.
        ``wait`` (kvd only): each side waits in kvd (``Wait`` with ``any_done``) for a
        room to end or the next one to be due, instead of polling every ``POLL_S``;
        ``batch`` (kvd only): each round's starts, clears and poll go in ONE ``Many``
        round trip per side (no per-call API times then)."""
        t0 = time.monotonic() + 0.2
        cmd = {"first": self.next_room, "count": count, "rate": rate, "window": window,
               "t0": t0, "wait": wait, "batch": batch}
        self.next_room += count
        cpu0 = sum(_proc_cpu(p) for p in self.daemon_pids())
        for c in self.conns:
            c.send(cmd)
        p_res, d_res = (c.recv() for c in self.conns)
        cpu = sum(_proc_cpu(p) for p in self.daemon_pids()) - cpu0
        lat = sorted(d_res["latencies"])
        return {"rooms_per_s": count / d_res["seconds"], "p50_ms": 1e3 * _q(lat, 0.5),
                "p99_ms": 1e3 * _q(lat, 0.99), "failed": p_res["failed"] + d_res["failed"],
                "bad_bytes": d_res["bad_bytes"], "cpu_cores": cpu / d_res["seconds"],
                "cpu_ms_per_room": 1e3 * cpu / count, "send_p50_us": p_res["api_p50_us"],
                "init_p50_us": d_res["api_p50_us"]}

    def bulk(self, src: np.ndarray, dst: np.ndarray) -> tuple[float, bool]:
        """Seconds from the prefill's send to the decode's Success of one room; bytes ok."""
        room, self.next_room = self.next_room, self.next_room + 1
        cmd = {"room": room, "src": src.tolist(), "dst": dst.tolist(),
               "t0": time.monotonic() + 0.3}
        for c in self.conns:
            c.send(cmd)
        p_res, d_res = (c.recv() for c in self.conns)
        return d_res["time"] - p_res["time"], bool(d_res["ok"])

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for d in self.daemons:
            d.stop()


def _q(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]
