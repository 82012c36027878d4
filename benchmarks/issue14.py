"""Issue 14's table: every row measured in one run, each beside its baseline and goal.

P1   bulk P -> D through kvd vs the raw transfer engine driven the best way found
     (non-blocking single-entry submit + status polling, 256 in flight; or sync
     sub-batches of 512: the faster of the two per size), same pages, 12 KiB / 64 KiB /
     1 MiB items, bytes checked. Both sides run with Mooncake's TCP connection pool on
     (Mooncake 0.3.13.post1's own default, which the raw driver and SGLang get when
     nothing is set; kvd: ``transfer_tcp_pool = true``), so the row compares like with
     like. ``P1.<size>.pool_off``: kvd at its defaults (the pool off since K39: a new
     connection per entry) against kvd with the pool, same run: the price of K39's default.
P1b  the same rooms through SGLang 0.5.23's own MooncakeKVManager (in-process, CPU buffers,
     TCP, the pool on; skipped with a reason where SGLang is not installed: `make bench`
     installs it).
P4   1-page rooms: max rooms/s with many in flight, latency p50/p99 at 100 and 500 rooms/s
     offered, kvd vs SGLang (benchmarks/rooms.py; runs interleaved, medians).
P5   engine API: Sender.send / Receiver.init p50 (in the 100 rooms/s runs, and one room at
     a time on an idle pair), poll_many of 1 000 rooms, a trivial RPC vs a bare Unix-socket
     echo (uvloop server, blocking client); each with the engine and the servers on one
     CPU, on two, and where the scheduler puts them (PLACEMENTS).
P6   daemon RSS idle, and after N rooms created -> succeeded -> cleared once the bounded
     room history has settled (flat within 5 %).
P8   isolation: a decode frozen (SIGSTOP) mid-transfer while 1-page rooms to a healthy
     decode continue: their p99 against the same rooms without the frozen one.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rooms

LAYERS_ROOMS, ITEM_ROOMS = 4, 4096  # a 1-page room: 8 KV entries + aux


def have_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def _work() -> str:
    return tempfile.mkdtemp(prefix="kvd-bench-")


# ---- P1 / P1b: bulk --------------------------------------------------------------------


def _raw_receiver(nbytes: int, conn: Any) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = np.zeros(nbytes, dtype=np.uint8)
    e.register_memory(buf.ctypes.data, nbytes)
    conn.send((f"127.0.0.1:{e.get_rpc_port()}", buf.ctypes.data))
    while (req := conn.recv()) is not None:  # (item, dst rows): a digest of those rows
        item, rows = req
        conn.send(_digest(buf.reshape(-1, item)[rows]))


def _digest(rows: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(rows.tobytes()).hexdigest()


class RawBest:
    """The same descriptors through the bare Mooncake binding, two ways (no kvd code)."""

    def __init__(self, layers: int, item: int, pages: int, src: np.ndarray,
                 dst: np.ndarray) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")
        from mooncake.engine import TransferEngine

        nbufs, per = 2 * layers, pages * item
        self.parent, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_raw_receiver,
                                                    args=(nbufs * per, child), daemon=True)
        self.proc.start()
        self.session, base = self.parent.recv()
        self.e = TransferEngine()
        self.e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        self.pool_env = os.environ.get(POOL_ENV)  # what this engine's transport read
        self.buf = np.random.default_rng(5).integers(0, 256, nbufs * per, dtype=np.uint8)
        self.e.register_memory(self.buf.ctypes.data, self.buf.nbytes)
        b = np.arange(nbufs, dtype=np.uint64)[:, None] * np.uint64(per)
        self.S = (np.uint64(self.buf.ctypes.data) + b + src.astype(np.uint64) * np.uint64(item)
                  ).ravel().tolist()
        self.D = (np.uint64(base) + b + dst.astype(np.uint64) * np.uint64(item)).ravel().tolist()
        self.L = [item] * len(self.S)
        self.item = item
        self.src_rows = (np.arange(nbufs)[:, None] * pages + src).ravel()
        self.dst_rows = (np.arange(nbufs)[:, None] * pages + dst).ravel()

    def submit_poll(self, window: int = 256) -> None:
        sub, chk, n = self.e.transfer_submit_write, self.e.transfer_check_status, len(self.S)
        inflight: list[int] = []
        i, delay = 0, 50e-6
        while i < n or inflight:
            while i < n and len(inflight) < window:
                bid = sub(self.session, self.S[i], self.D[i], self.L[i])
                assert 0 < bid < 1 << 63, "refused"
                inflight.append(bid)
                i += 1
            keep = []
            for bid in inflight:
                rc = chk(bid)
                if rc == 0:
                    keep.append(bid)
                else:
                    assert rc == 1, f"entry failed: {rc}"
            if len(keep) == len(inflight):
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
            else:
                delay = 50e-6
            inflight = keep

    def sync(self, batch: int = 512) -> None:
        for i in range(0, len(self.S), batch):
            rc = self.e.batch_transfer_sync_write(self.session, self.S[i:i + batch],
                                                  self.D[i:i + batch], self.L[i:i + batch])
            assert rc == 0, f"batch refused: {rc}"

    def run(self, how: str) -> tuple[float, bool]:
        t0 = time.perf_counter()
        getattr(self, how)()
        elapsed = time.perf_counter() - t0
        self.parent.send((self.item, self.dst_rows))
        ok = self.parent.recv() == _digest(self.buf.reshape(-1, self.item)[self.src_rows])
        return elapsed, ok

    def close(self) -> None:
        self.parent.send(None)
        self.proc.join(10)


#: Where the pool setting reaches each P1 path: Mooncake reads this when an engine's TCP
#: transport starts (the raw driver's engines, SGLang's); kvd sets it from its own
#: ``transfer_tcp_pool`` (kvd/transfer/backends/mooncake.py), which ``KVD_TRANSFER_TCP_POOL``
#: in the environment would override over the daemon's settings file.
POOL_ENV, KVD_POOL_ENV = "MC_TCP_ENABLE_CONNECTION_POOL", "KVD_TRANSFER_TCP_POOL"


@contextlib.contextmanager
def tcp_pool_env(on: bool) -> Any:
    """Engines started inside (in this process, or spawned from it) run with Mooncake's TCP
    connection pool ``on``; kvd daemons started inside take ``transfer_tcp_pool`` from
    their settings, not from a ``KVD_TRANSFER_TCP_POOL`` the caller's environment holds.
    The environment is restored on exit."""
    saved = {k: os.environ.get(k) for k in (POOL_ENV, KVD_POOL_ENV)}
    os.environ[POOL_ENV] = "1" if on else "0"
    os.environ.pop(KVD_POOL_ENV, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_bulk(mib: int, layers: int, repeats: int, sizes: tuple[int, ...] = (12, 64, 1024),
               before: str | None = None, **settings: Any) -> dict[str, Any]:
    """P1 and P1b for each item size (KiB): kvd, the raw engine and SGLang, every one with
    Mooncake's TCP pool on; and kvd at its default (the pool off, K39) as ``kvd_pool_off``
    unless ``settings`` turn the pool on (``run.py --tcp-pool``). ``before``: another
    checkout whose kvd runs the same rooms at the same settings (``kvd_before``,
    ``kvd_before_pool_off``), for a before/after in one run. ``settings`` go to every kvd
    daemon. Runs interleaved, ``repeats`` rounds after a warm-up round, medians."""
    out: dict[str, Any] = {}
    pool_off = not settings.get("transfer_tcp_pool", False)
    trees = {"kvd": None, **({"kvd_before": before} if before else {})}
    for kib in sizes:
        item = kib * 1024
        move = max(1, (mib << 20) // (2 * layers * item))
        pages = move + move // 4 + 1
        rng = np.random.default_rng(kib)
        src, dst = rng.permutation(pages)[:move], rng.permutation(pages)[:move]
        nbytes = 2 * layers * move * item
        paths: dict[str, Any] = {}
        with tcp_pool_env(True):
            for name, tree in trees.items():
                for pool in (True, False) if pool_off else (True,):
                    paths[name + ("" if pool else "_pool_off")] = rooms.Pair(
                        "kvd", layers, item, _work(), pages=pages, tree=tree,
                        **(settings | {"transfer_tcp_pool": pool}))
            paths["raw"] = RawBest(layers, item, pages, src, dst)
            if have_sglang():
                paths["sglang"] = rooms.Pair("sglang", layers, item, _work(), pages=pages)
        times: dict[str, list[float]] = {
            k: [] for k in [*paths, "raw_submit_poll", "raw_sync"] if k != "raw"}
        ok, raw_pool_env = True, paths["raw"].pool_env
        try:
            for rep in range(repeats + 1):  # interleaved; round 0 warms connections up
                for name in times:
                    if name.startswith("raw_"):
                        t, good = paths["raw"].run(name[4:])
                    else:
                        t, good = paths[name].bulk(src, dst)
                    ok &= good
                    if rep:
                        times[name].append(t)
        finally:
            for p in paths.values():
                p.close()
        gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        best = max(gbps["raw_submit_poll"], gbps["raw_sync"])
        row: dict[str, Any] = {"bytes": nbytes, "entries": 2 * layers * move, "gbps": gbps,
                               "seconds": times, "raw_best_gbps": best,
                               "ratio_vs_raw_best": gbps["kvd"] / best, "bytes_equal": ok,
                               "raw_pool_env": raw_pool_env}
        if "sglang" in gbps:
            row["ratio_vs_sglang"] = gbps["kvd"] / gbps["sglang"]
        if "kvd_pool_off" in gbps:
            row["pool_off_vs_pool"] = gbps["kvd_pool_off"] / gbps["kvd"]
        if before:
            row["before"] = before
        out[f"{kib}KiB"] = row
    return out


# ---- P4 / P5 / P6: rooms ---------------------------------------------------------------


def bench_rooms(repeats: int, max_rooms: int, rate_rooms: int, ring: bool = True,
                **settings: Any) -> dict[str, Any]:
    """P4 (and the send/init part of P5), kvd and SGLang interleaved, medians; with
    ``ring``, also kvd with the engine channel (``kvd_ring``). ``settings`` go to every
    kvd daemon (e.g. ``transfer_tcp_pool``)."""
    systems = ["kvd", "sglang"] if have_sglang() else ["kvd"]
    pairs = {s: rooms.Pair(s, LAYERS_ROOMS, ITEM_ROOMS, _work(),
                           **(settings if s == "kvd" else {})) for s in systems}
    # "kvd_many": the same kvd pair, each engine round's calls in one Many round trip
    # (absent from kvd before the Many call: before/after runs of an older checkout);
    # "kvd_ring": a second kvd pair whose engines use the submission ring and the status
    # table (issue 21): each round's calls in one submit_all, polls from the table
    from kvd.client import KvdClient

    variants = [*systems, *(["kvd_many"] if hasattr(KvdClient, "call_many") else [])]
    if ring and hasattr(KvdClient, "submit_all"):
        pairs["kvd_ring"] = rooms.Pair("kvd", LAYERS_ROOMS, ITEM_ROOMS, _work(), ring=True,
                                       **settings)
        variants.append("kvd_ring")
        systems = [*systems, "kvd_ring"]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {"max": [], "100": [], "500": []}
                                                        for s in variants}
    try:
        for s in systems:
            pairs[s].run(300, None, 64, batch=s == "kvd_ring")  # warm-up: connections
        for _ in range(repeats):
            for s in variants:
                pair = pairs[s.removesuffix("_many")]
                batch = s.endswith(("_many", "_ring"))
                runs[s]["max"].append(pair.run(max_rooms, None, 128, batch=batch))
                runs[s]["100"].append(pair.run(rate_rooms, 100.0, 256, batch=batch))
                runs[s]["500"].append(pair.run(rate_rooms, 500.0, 256, batch=batch))
    finally:
        for p in pairs.values():
            p.close()
    systems = variants
    med = {s: {k: {f: statistics.median(r[f] for r in v) for f in v[0]
                   if isinstance(v[0][f], int | float)}
               for k, v in runs[s].items()} for s in systems}
    return {"median": med, "runs": runs,
            "bad_bytes": sum(r["bad_bytes"] for s in systems for v in runs[s].values()
                             for r in v),
            "failed": sum(r["failed"] for s in systems for v in runs[s].values() for r in v)}


def _echo_server(path: str) -> None:
    import asyncio

    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.t = transport

        def data_received(self, data: bytes) -> None:
            self.t.write(data)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_unix_server(Echo, path)
        await server.serve_forever()

    uvloop.run(main())


def _connect_when_listening(path: str, server: Any, bound_s: float = 60.0) -> socket.socket:
    """A Unix-socket connection to ``path`` once ``server`` (a started process) listens.

    The socket file appears at ``bind``, before ``listen``: a connect in between is
    refused, so each try waits until one is accepted, within ``bound_s`` seconds.
    Raises RuntimeError if the server exits or the bound passes first."""
    deadline = time.monotonic() + bound_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        if not server.is_alive():
            raise RuntimeError(f"the echo server exited (code {server.exitcode}) before "
                               f"listening on {path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the echo server did not listen on {path} within {bound_s} s")
        time.sleep(0.01)


def _p50_us(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


#: Where the engine (this process) and the server (echo, kvd daemons: every thread) run for
#: P5, among the CPUs this process may use. "free": wherever the scheduler puts them;
#: "same": all on the first CPU; "cross": the engine on the first, the servers on the
#: second (skipped with one CPU). A Unix-socket round trip costs about 4x more across CPUs
#: than on one here (a wake-up on another CPU of this VM), and the scheduler places a
#: single-threaded echo server and a multi-threaded daemon differently, so "free"
#: compares a placement with another; "same" and "cross" compare like with like.
PLACEMENTS = ("free", "same", "cross")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (threads started later inherit it
    from the thread that starts them). Raises OSError if the kernel refuses (a CPU this
    process may not use): a placement that did not happen must not be reported."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


def placements(allowed: set[int]) -> dict[str, tuple[set[int], set[int]]]:
    """``{placement: (engine CPUs, server CPUs)}`` within ``allowed``."""
    cpus = sorted(allowed)
    out = {"free": (set(cpus), set(cpus)), "same": ({cpus[0]}, {cpus[0]})}
    if len(cpus) > 1:
        out["cross"] = ({cpus[0]}, {cpus[1]})
    return out


def bench_api(n: int = 3000, repeats: int = 3, rooms_each: int = 100) -> dict[str, Any]:
    """P5, per placement (:data:`PLACEMENTS`), interleaved, medians of ``repeats`` blocks:
    a trivial RPC (``Poll`` of no rooms) vs a bare Unix-socket echo (uvloop server,
    blocking client) of the same size; ``poll_many`` of 1 000 live rooms; and the engine
    API's own cost on an idle pair: ``Receiver.init`` then ``Sender.send`` of 1-page rooms
    one at a time (the send starts the write: planning included), each room waited for
    and cleared before the next. The placements use the CPUs this process may use
    (``taskset``), and this process's affinity is restored at the end. Raises ValueError
    for ``n`` < ``repeats``, ``repeats`` < 1 or ``rooms_each`` < 1."""
    if repeats < 1 or n < repeats or rooms_each < 1:
        raise ValueError(f"P5 needs repeats >= 1, calls >= repeats and rooms >= 1 (got "
                         f"repeats={repeats}, calls={n}, rooms={rooms_each})")
    from kvd.client import Receiver, Sender, poll_many, wait_many
    from kvd.launch import start_daemon
    from kvd.protocol import rpc
    from kvd.refengine.standin import EngineStandIn

    allowed = os.sched_getaffinity(0)
    where_cpus = placements(allowed)
    res: dict[str, dict[str, list[float]]] = {
        w: {k: [] for k in ("echo", "trivial", "poll", "send", "init")} for w in where_cpus}
    work = _work()
    with contextlib.ExitStack() as stack:  # each thing started is stopped, in reverse
        path = os.path.join(work, "echo.sock")
        echo = mp.get_context("spawn").Process(target=_echo_server, args=(path,), daemon=True)
        echo.start()
        stack.callback(echo.kill)
        sock = stack.enter_context(_connect_when_listening(path, echo))
        msg = b"\x00\x00\x00\x20KVD\x04" + b"x" * 28  # the size of a trivial request (36 B)

        def echo_once() -> None:
            sock.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(sock.recv(65536))

        pd = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING")
        stack.callback(pd.stop)
        dd = start_daemon("decode", work, log_level="WARNING")
        stack.callback(dd.stop)
        pool = {"num_layers": LAYERS_ROOMS, "num_pages": 1024, "item_len": ITEM_ROOMS,
                "aux_slots": 1024, "aux_item_len": 64}  # a slot per page (K42)
        pe = EngineStandIn(pd.socket, seed=1, **pool)
        stack.callback(pe.close)
        de = EngineStandIn(dd.socket, seed=2, **pool)
        stack.callback(de.close)
        servers = [echo.pid, pd.proc.pid, dd.proc.pid]
        stack.callback(pin, os.getpid(), allowed)
        client, empty = pe.client, rpc.Poll(rooms=[])
        ids = list(range(1, 1001))
        for r in ids:  # 1 000 live rooms (Bootstrapping: no decode)
            Sender(client, r)
        room = 1_000_000
        for _ in range(repeats):
            for where, (mine, theirs) in where_cpus.items():
                pin(os.getpid(), mine)
                for pid in servers:
                    pin(pid, theirs)
                time.sleep(0.1)
                out = res[where]
                out["echo"].append(_p50_us(echo_once, n // repeats))
                out["trivial"].append(_p50_us(lambda: client.call(empty), n // repeats))
                out["poll"].append(_p50_us(lambda: poll_many(client, ids), 100))
                sends, inits = [], []
                for _ in range(rooms_each):
                    room += 1
                    page = np.array([room % 1024])
                    s = Sender(client, room)
                    s.init(1, room % 1024)
                    r = Receiver(de.client, room, pd.http_addr)
                    t = time.perf_counter()
                    r.init(page, room % 1024)
                    inits.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    s.send(page)
                    sends.append(time.perf_counter() - t)
                    assert wait_many(de.client, [room], 30) == [4], f"room {room} failed"
                    assert wait_many(client, [room], 30) == [4], f"room {room} failed"
                    de.client.call(rpc.Clear(room=room))
                    client.call(rpc.Clear(room=room))
                out["send"].append(1e6 * statistics.median(sends))
                out["init"].append(1e6 * statistics.median(inits))
        for r in ids:
            client.call(rpc.Abort(room=r))
            client.call(rpc.Clear(room=r))
    per: dict[str, dict[str, float]] = {}
    for where, out in res.items():
        m = {k: statistics.median(v) for k, v in out.items()}
        per[where] = {"trivial_rpc_p50_us": m["trivial"], "echo_p50_us": m["echo"],
                      "ratio_trivial_over_echo": m["trivial"] / m["echo"],
                      "poll_many_1000_p50_us": m["poll"], "send_idle_p50_us": m["send"],
                      "init_idle_p50_us": m["init"]}
    return {"placements": per, "runs": res, "cpus": sorted(allowed), **per["free"]}


#: Ended rooms a prefill side remembers (tombstones and final words, K21/K30): bounded
#: per-room history, full after this many rooms (kvd/rooms/sender.py Limits.tombstones).
HISTORY_ROOMS = 65_536
#: Rooms after which the full history's tables have settled: for about 20 000 rooms after
#: it fills, RSS still rises (about 12 MB on the prefill: the bounded tables' dicts keep
#: growing their hash tables while entries churn), then stays flat (measured to 230 000).
SETTLED_ROOMS = HISTORY_ROOMS + 25_000


def bench_rss(count: int) -> dict[str, Any]:
    """P6: RSS of both daemons idle, after a tenth of ``count`` rooms (at most 10 000),
    once the bounded room history is full, once it has settled (``SETTLED_ROOMS``), and
    after ``count`` MORE rooms from there (``count`` >= 20 000; smaller counts measure from
    the tenth: the history is then still filling). Raises ValueError for ``count`` < 10.
    Flatness is judged from the settled point: before it, RSS grows by design up to the
    bound (about the tables' entries times their size), then it must stay flat."""
    if count < 10:
        raise ValueError(f"P6 needs at least 10 rooms, got {count}")
    tenth = min(count // 10, 10_000)  # the "warm" point
    full = HISTORY_ROOMS + 5_000 if count >= 20_000 else None
    pair = rooms.Pair("kvd", LAYERS_ROOMS, ITEM_ROOMS, _work())
    try:
        pids = pair.daemon_pids()
        idle = [rooms.rss_mb(p) for p in pids]
        res = [pair.run(tenth, None, 128)]
        warm = [rooms.rss_mb(p) for p in pids]
        history = settled = warm
        if full:
            res.append(pair.run(full - tenth, None, 128))
            history = [rooms.rss_mb(p) for p in pids]
            res.append(pair.run(SETTLED_ROOMS - full, None, 128))
            settled = [rooms.rss_mb(p) for p in pids]
            res.append(pair.run(count, None, 128))
        else:
            res.append(pair.run(count - tenth, None, 128))
        after = [rooms.rss_mb(p) for p in pids]
    finally:
        pair.close()
    return {"rooms": count, "warm_rooms": tenth, "idle_mb": idle, "warm_mb": warm,
            "history_full_mb": history,
            "history_rooms": full, "settled_mb": settled,
            "settled_rooms": SETTLED_ROOMS if full else None,
            "total_rooms": SETTLED_ROOMS + count if full else count, "after_mb": after,
            "growth_after_warm": max(a / w - 1 for a, w in zip(after, warm, strict=True)),
            "growth_after_history": max(a / b - 1 for a, b in zip(after, history, strict=True)),
            "growth_after_settled": max(a / b - 1 for a, b in zip(after, settled,
                                                                  strict=True)),
            "failed": sum(r["failed"] for r in res),
            "bad_bytes": sum(r["bad_bytes"] for r in res)}


# ---- P8: isolation ---------------------------------------------------------------------


def _healthy_rooms(p: Any, d: Any, bootstrap: str, first: int, count: int,
                   rate: float) -> list[float]:
    """1-page rooms to the healthy decode at ``rate``; latency (s) from each due time."""
    from kvd.client import KVPoll, Receiver, Sender, poll_many
    from kvd.protocol import rpc

    t0, pending, lat, i = time.monotonic() + 0.05, {}, [], 0
    while i < count or pending:
        now = time.monotonic()
        while i < count and now >= t0 + i / rate:
            room = first + i
            Receiver(d.client, room, bootstrap).init([room % 512], room % 512)
            s = Sender(p.client, room)
            s.init(1, 0)
            s.send([room % 512])
            pending[room] = t0 + i / rate
            i += 1
        ids = list(pending)
        for room, st in zip(ids, poll_many(d.client, ids), strict=True) if ids else ():
            if st in (KVPoll.Success, KVPoll.Failed):
                assert st == KVPoll.Success, f"healthy room {room} failed"
                lat.append(time.monotonic() - pending.pop(room))
                d.client.call(rpc.Clear(room=room))
                p.client.call(rpc.Clear(room=room))
        time.sleep(200e-6)
    return sorted(lat)


def bench_isolation(count: int = 300, rate: float = 100.0) -> dict[str, Any]:
    """P8: healthy rooms' p99 with and without a decode frozen mid-transfer."""
    from kvd.client import KVPoll, Receiver, Sender
    from kvd.launch import start_daemon
    from kvd.refengine.standin import EngineStandIn

    work = _work()
    opts = {"log_level": "WARNING", "transfer_timeout": 30.0}
    pd = start_daemon("prefill", work, serve_bootstrap=True, **opts)
    healthy = start_daemon("decode", work, **opts)
    frozen = start_daemon("decode", work, **opts)
    pool = {"num_layers": 4, "num_pages": 1024, "item_len": 64 << 10}
    p = EngineStandIn(pd.socket, seed=1, **pool)
    dh, df = EngineStandIn(healthy.socket, seed=2, **pool), EngineStandIn(frozen.socket, seed=3,
                                                                          **pool)
    try:
        _healthy_rooms(p, dh, pd.http_addr, 1, 100, rate)  # warm-up
        base = _healthy_rooms(p, dh, pd.http_addr, 1000, count, rate)
        big = np.arange(1024)
        Receiver(df.client, 99999, pd.http_addr).init(big, 1)
        s = Sender(p.client, 99999)
        s.init(big.size, 1)
        s.send(big)  # 512 MiB to the decode about to freeze
        time.sleep(0.2)
        frozen.proc.send_signal(signal.SIGSTOP)
        during = _healthy_rooms(p, dh, pd.http_addr, 5000, count, rate)
        frozen.proc.send_signal(signal.SIGCONT)
        big_state = s.wait(60)
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
        for e in (p, dh, df):
            e.close()
        for dm in (pd, healthy, frozen):
            dm.stop()
    p99 = {"without": rooms._q(base, 0.99), "with_frozen": rooms._q(during, 0.99)}
    return {"p99_ms": {k: 1e3 * v for k, v in p99.items()},
            "p50_ms": {"without": 1e3 * rooms._q(base, 0.5),
                       "with_frozen": 1e3 * rooms._q(during, 0.5)},
            "ratio_p99": p99["with_frozen"] / p99["without"], "rooms": count,
            "frozen_room_end": KVPoll(big_state).name if big_state >= 0 else "unknown"}


def machine_load() -> str:
    out = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout
    return out.strip()


# ---- rows (benchmarks/rows.py): every measure keyed by its id ---------------------------

_ON = {"free": "placed by the scheduler", "same": "engine and kvd on one CPU",
       "cross": "engine on CPU 0, kvd on CPU 1"}
_AT = {"free": "", "same": ".one_cpu", "cross": ".two_cpus"}
#: P4's kvd variants: row id suffix and words.
_P4 = {"kvd": ("", "one engine call per RPC"),
       "kvd_many": (".many", "each engine round in one Many"),
       "kvd_ring": (".ring", "each engine round in one submit_all through the ring, polls "
                             "from the status table")}
P4_ROOMS_GOAL, P4_CPU_GOAL_MS = 3000, 0.5


def rows_of(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every measured row of an issue14 result ``r`` (what run.py's ``issue14`` collects:
    ``P1``, ``P4``, ``P5``, ``P6``, ``P8``), keyed by id, as benchmarks/rows.py makes them."""
    from rows import row

    out: dict[str, dict[str, Any]] = {}
    for size, b in r.get("P1", {}).items():
        g = b["gbps"]
        bad = "" if b["bytes_equal"] else "; BYTES DIFFER"
        out[f"P1.{size}"] = row(
            f"bulk {size} items, {b['bytes'] >> 20} MiB, vs the raw transfer engine's best, "
            f"TCP pool on both", g["kvd"], "GB/s", ">= 1.0x",
            b["ratio_vs_raw_best"] >= 1.0 and not bad, baseline=b["raw_best_gbps"],
            detail=f"raw submit/poll {g['raw_submit_poll']:.2f}, sync {g['raw_sync']:.2f}{bad}")
        if "sglang" in g:
            out[f"P1b.{size}"] = row(f"bulk {size} items vs SGLang's connector, TCP pool on "
                                     f"both", g["kvd"], "GB/s", ">= 1.0x",
                                     b["ratio_vs_sglang"] >= 1.0 and not bad,
                                     baseline=g["sglang"], detail="SGLang" + bad)
        if "kvd_pool_off" in g:
            out[f"P1.{size}.pool_off"] = row(
                f"bulk {size} items at kvd's defaults (TCP pool off, K39) vs kvd with the "
                f"pool", g["kvd_pool_off"], "GB/s", "- (the price of K39's default)", None,
                baseline=g["kvd"],
                detail=f"kvd with the pool; {g['kvd_pool_off'] / b['raw_best_gbps']:.2f}x the "
                       f"raw engine's best with its pool{bad}")
        for suffix in ("", "_pool_off"):
            if f"kvd_before{suffix}" in g:
                out[f"P1.{size}.vs_before{suffix.replace('_', '.', 1)}"] = row(
                    f"bulk {size} items, this kvd vs {b['before']}'s, TCP pool "
                    f"{'off' if suffix else 'on'} for both", g[f"kvd{suffix}"], "GB/s", "-",
                    None, baseline=g[f"kvd_before{suffix}"], detail=f"{b['before']}{bad}")
    if "P4" in r:
        m, ok = r["P4"]["median"], r["P4"]["bad_bytes"] == 0 and r["P4"]["failed"] == 0
        sg = m.get("sglang")
        for system, (suffix, how) in _P4.items():
            k = m.get(system)
            if k is None:
                continue
            mx, cpu = k["max"]["rooms_per_s"], k["max"]["cpu_ms_per_room"]
            smx = sg["max"]["rooms_per_s"] if sg else None
            out[f"P4{suffix}"] = row(
                f"1-page rooms/s, 128 in flight, {how}", mx, "rooms/s",
                f">= 1.0x SGLang and >= {P4_ROOMS_GOAL}",
                (smx is None or mx >= smx) and mx >= P4_ROOMS_GOAL and ok, baseline=smx,
                detail=f"SGLang; {k['max']['cpu_cores']:.2f} cores" if smx else "")
            out[f"P4{suffix}.cpu"] = row(
                f"daemon CPU per room (both daemons), max rate, {how}", cpu, "ms",
                f"<= {P4_CPU_GOAL_MS} ms", cpu <= P4_CPU_GOAL_MS,
                baseline=sg["max"]["cpu_ms_per_room"] if sg else None,
                detail="SGLang: CPU of its engine processes" if sg else "")
            for rate in ("100", "500"):
                kk, s = k[rate], sg[rate] if sg else None
                out[f"P4{suffix}.p50_{rate}"] = row(
                    f"p50 latency at {rate} rooms/s, {how}", kk["p50_ms"], "ms",
                    "<= SGLang's", s is None or kk["p50_ms"] <= s["p50_ms"],
                    baseline=s["p50_ms"] if s else None,
                    detail=f"p99 {kk['p99_ms']:.2f} vs SGLang {s['p99_ms']:.2f} ms" if s
                    else f"p99 {kk['p99_ms']:.2f} ms")
        k100 = m["kvd"]["100"]
        for call, key in (("send", "send_p50_us"), ("init", "init_p50_us")):
            out[f"P5.{call}_in_100"] = row(
                f"{'Sender.send' if call == 'send' else 'Receiver.init'} p50 inside the "
                f"100 rooms/s run (socket)", k100[key], "us", "<= 100 us", k100[key] <= 100,
                baseline=sg["100"][key] if sg else None,
                detail="SGLang, in-process" if sg else "")
    for where, pa in r.get("P5", {}).get("placements", {}).items():
        at, on = _AT.get(where, f".{where}"), _ON.get(where, where)
        out[f"P5.trivial{at}"] = row(f"trivial RPC p50 vs a Unix-socket echo, {on}",
                                     pa["trivial_rpc_p50_us"], "us", "<= 1.5x",
                                     pa["ratio_trivial_over_echo"] <= 1.5,
                                     baseline=pa["echo_p50_us"], detail="echo")
        for call in ("send", "init"):
            v = pa.get(f"{call}_idle_p50_us")
            if v is not None:
                out[f"P5.{call}_idle_socket{at}"] = row(
                    f"{'Sender.send' if call == 'send' else 'Receiver.init'} p50, idle pair, "
                    f"over the socket, {on}", v, "us", "<= 100 us", v <= 100)
        v = pa["poll_many_1000_p50_us"]
        out[f"P5.poll_many_socket{at}"] = row(f"poll_many of 1 000 rooms over the socket, {on}",
                                              v, "us", "<= 200 us", v <= 200)
    if "P6" in r:
        m6 = r["P6"]
        out["P6.idle"] = row("daemon RSS idle, the larger of prefill and decode",
                             max(m6["idle_mb"]), "MB", "<= 150 MB", max(m6["idle_mb"]) <= 150,
                             detail="prefill / decode " + " / ".join(f"{x:.0f}"
                                                                    for x in m6["idle_mb"]))
        settled = m6.get("settled_rooms")
        base = m6["settled_mb"] if settled else m6["warm_mb"]
        after = m6["after_mb"]
        i = max(range(len(after)), key=lambda j: after[j] / base[j])
        out["P6.flat"] = row(
            f"RSS after {m6['rooms']} more rooms" + (f" from the settled history ({settled} "
                                                     f"rooms)" if settled else ""),
            after[i], "MB", "flat (+-5 %)",
            abs(after[i] / base[i] - 1) <= 0.05 and m6["bad_bytes"] == 0, baseline=base[i],
            detail="the daemon that grew most")
    if "P8" in r:
        m8 = r["P8"]
        out["P8"] = row("healthy rooms' p99, one decode frozen mid-transfer",
                        m8["p99_ms"]["with_frozen"], "ms", "<= 2x",
                        m8["ratio_p99"] <= 2.0, baseline=m8["p99_ms"]["without"],
                        detail="without the frozen decode")
    return out


@contextlib.contextmanager
def placed(where: str) -> Any:
    """Run a benchmark that starts its own daemons (``kvd.launch.start_daemon``) in one of
    :data:`PLACEMENTS`: this process (the engine) on the placement's engine CPUs, every
    daemon started meanwhile (all its threads) on its server CPUs; this process's CPUs
    are restored after. Raises KeyError for a placement this machine lacks."""
    import kvd.launch as launch

    allowed = os.sched_getaffinity(0)
    mine, theirs = placements(allowed)[where]
    start = launch.start_daemon

    def start_placed(*args: Any, **kwargs: Any) -> Any:
        d = start(*args, **kwargs)
        pin(d.proc.pid, theirs)
        return d

    launch.start_daemon = start_placed  # type: ignore[assignment]
    pin(os.getpid(), mine)
    try:
        yield
    finally:
        launch.start_daemon = start  # type: ignore[assignment]
        pin(os.getpid(), allowed)
