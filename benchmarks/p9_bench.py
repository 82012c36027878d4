"""P9 (issue 21): what a room costs the engine's scheduler thread, kvd vs SGLang's connector.

The thread that makes the engine's calls is the one that also launches the GPU's work, so
its time is serving time lost. Per 1-page room, on both roles, this measures that
thread's wall time and CPU time (``time.thread_time_ns`` of the calling thread) inside
the calls of a room's life: create + init/send + the polls until it ended + clear. The
workload is the same for every system: rounds of :data:`ROUND` rooms started in one
scheduler step, then one step every ``step_s`` (a poll of the round's unfinished rooms
and the clears of those that ended) until every room of the round is cleared; the
sleep between steps is not counted. Every room's page is checked byte for byte on the
decode (outside the timed calls).

Systems, each a prefill and a decode engine process (benchmarks/sides.py builds them):

- ``kvd``: ``KvdClient(use_ring=True)`` and the status table, one ``Sender`` /
  ``Receiver`` per room as kvd's SGLang backend makes them (create, init and send are
  ring records not waited for; the step's poll is one ``poll_array`` of the round's
  rooms; the clear of a room read ended is a ring record not waited for either);
- ``kvd_step``: the same clients, a step's calls submitted together and not waited for
  (``submit_all(calls, wait=False)``: every call a ring record, no wait; a refusal reads
  Failed at the room's next poll);
- ``kvd_step_waited``: the same, waited once per step (``submit_all(calls)``: the vLLM
  connector's shape);
- ``sglang``: SGLang 0.5.23's ``MooncakeKVManager`` in-process (``MooncakeKVSender`` /
  ``MooncakeKVReceiver``, CPU buffers, TCP), driven as its schedulers drive it: the
  decode's receiver is created and ``init`` ed, ``send_metadata`` once the prefill
  answered; the prefill's sender ``init`` s and ``send`` s once the decode's metadata
  arrived (``poll`` says WaitingForInput): those calls sit inside its poll phase.

CPU placements (``issue14.PLACEMENTS``): ``free``; ``same`` (everything on one CPU);
``cross`` (both engines' calling threads on the first CPU; every other thread -- kvd's
daemons, SGLang's and Mooncake's background threads in the engine process -- on the
second). Background CPU is reported separately and honestly: the engine process's other
threads (``process_time`` minus the calling thread) and, for kvd, its daemon
(``/proc/<pid>/stat``).

Rows (``rows``; benchmarks/rows.py): ``P9.prefill``, ``P9.decode`` (calling-thread CPU
per room, free placement), ``.wall`` (its wall time), ``.one_cpu`` / ``.two_cpus`` (the
other placements), ``.step`` (kvd_step), ``.step_waited`` (kvd_step_waited); goal
value/baseline <= 0.25.

Usage: python benchmarks/p9_bench.py [--rounds 8] [--repeats 3] [--step-ms 1.0]
(SGLang's rows need SGLang: run it with .venv-bench's python).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import issue14  # noqa: E402
import rows as rowlib  # noqa: E402

RESULTS = HERE / "results"
#: Rooms started in one scheduler step.
ROUND = 32
#: Goal: kvd's engine-thread time per room at most this fraction of SGLang's.
GOAL = 0.25
LAYERS, ITEM = 4, 4096  # a 1-page room: 8 KV entries + aux (as P4)
SUCCESS, FAILED, WAITING = 4, 0, 2
PHASES = ("start", "poll", "clear")
#: A round that takes longer than this (s) is counted as stalled (its rooms' writes sat
#: in flight: see docs/performance.md, P9).
STALL_S = 0.5


def _place(engine: list[int] | None, other: list[int] | None) -> None:
    """This process: the calling thread on ``engine`` CPUs, every other thread on
    ``other`` (None: leave as is). Threads started later inherit their creator's CPUs,
    so this runs again before every round."""
    if engine is None or other is None:
        return
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, OSError):
            os.sched_setaffinity(int(tid), set(engine) if int(tid) == me else set(other))


class _Meter:
    """Wall and calling-thread CPU (ns) summed per phase."""

    def __init__(self) -> None:
        self.wall = dict.fromkeys(PHASES, 0)
        self.cpu = dict.fromkeys(PHASES, 0)
        self.phase, self.w0, self.c0 = "", 0, 0

    def begin(self, phase: str) -> None:
        self.phase, self.w0, self.c0 = phase, time.perf_counter_ns(), time.thread_time_ns()

    def end(self) -> None:
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        self.cpu[self.phase] += c - self.c0
        self.wall[self.phase] += w - self.w0


class _KvdEngine:
    """kvd's engine side: one client with the ring and the table."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import sides

        from kvd.client import Receiver, Sender, poll_array
        from kvd.protocol import rpc
        from kvd.protocol.codec import pack_indices

        self.side = sides.KvdSide(spec["role"], spec["socket"], spec["bootstrap"], LAYERS,
                                  ITEM, ring=True)
        self.role, self.client, self.bootstrap = spec["role"], self.side.client, spec["bootstrap"]
        self.Sender, self.Receiver, self.poll_array = Sender, Receiver, poll_array
        self.rpc, self.pack = rpc, pack_indices
        self.objs: dict[int, Any] = {}

    def start(self, rooms: list[int], mode: str) -> None:
        if mode.startswith("kvd_step"):
            rpc, calls = self.rpc, []
            for room in rooms:
                page = self.pack(np.array([room % 1024]))
                if self.role == "decode":
                    calls += [rpc.ReceiverCreate(room=room, bootstrap_addr=self.bootstrap),
                              rpc.ReceiverInit(room=room, dst_pages=page, aux_index=room % 1024)]
                else:
                    calls += [rpc.SenderCreate(room=room),
                              rpc.SenderInit(room=room, num_pages=1, aux_index=room % 1024),
                              rpc.SenderSend(room=room, pages=page, is_last=True)]
            refused = self.client.submit_all(calls, wait=mode == "kvd_step_waited")
            if refused:
                raise next(iter(refused.values()))
            return
        for room in rooms:
            page = np.array([room % 1024])
            if self.role == "decode":
                r = self.Receiver(self.client, room, self.bootstrap)
                r.init(page, room % 1024)
                self.objs[room] = r
            else:
                s = self.Sender(self.client, room)
                s.init(1, room % 1024)
                s.send(page)
                self.objs[room] = s

    def poll(self, rooms: np.ndarray) -> np.ndarray:
        return self.poll_array(self.client, rooms)

    def clear(self, rooms: list[int], mode: str) -> None:
        if mode.startswith("kvd_step"):
            refused = self.client.submit_all([self.rpc.Clear(room=r) for r in rooms],
                                             wait=mode == "kvd_step_waited")
            if refused:
                raise next(iter(refused.values()))
            return
        for room in rooms:  # ended (polled): as kvd's SGLang backend, not waited for
            self.objs.pop(room).clear(wait=False)

    def kv(self) -> list[np.ndarray]:
        return self.side.kv()

    def close(self) -> None:
        self.side.close()


class _SglangEngine:
    """SGLang's connector in-process (benchmarks/sides.py builds its manager)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import sides

        self.side = sides.SglangSide(spec["role"], spec["bootstrap_port"], LAYERS, ITEM)
        self.role, self.conn, self.mgr = spec["role"], self.side.conn, self.side.mgr
        self.bootstrap = self.side.bootstrap
        self.objs: dict[int, Any] = {}
        self.fed: set[int] = set()  # rooms whose init/send (metadata) went out

    def start(self, rooms: list[int], mode: str) -> None:
        for room in rooms:
            if self.role == "decode":
                r = self.conn.MooncakeKVReceiver(mgr=self.mgr, bootstrap_addr=self.bootstrap,
                                                 bootstrap_room=room)
                self.mgr.try_ensure_parallel_info(self.bootstrap)
                r.init(0)
                self.objs[room] = r
            else:
                self.objs[room] = self.conn.MooncakeKVSender(
                    mgr=self.mgr, bootstrap_addr=self.bootstrap, bootstrap_room=room,
                    req_has_disagg_prefill_dp_rank=False)

    def poll(self, rooms: np.ndarray) -> np.ndarray:
        out = np.empty(rooms.size, dtype=np.int8)
        for i, room in enumerate(rooms.tolist()):
            obj = self.objs[room]
            st = int(obj.poll())
            if st == WAITING and room not in self.fed:  # what its scheduler does next
                page = np.array([room % 1024], dtype=np.int32)
                if self.role == "decode":
                    obj.send_metadata(page, room % 1024)
                else:
                    obj.init(1, room % 1024)
                    obj.send(page)
                self.fed.add(room)
            out[i] = st
        return out

    def clear(self, rooms: list[int], mode: str) -> None:
        for room in rooms:
            self.objs.pop(room).clear()
            self.fed.discard(room)

    def kv(self) -> list[np.ndarray]:
        return self.side.kv()

    def close(self) -> None:
        self.side.close()


def _run_rounds(eng: Any, cmd: dict[str, Any], expected: list[np.ndarray] | None
                ) -> dict[str, Any]:
    """``cmd['rounds']`` rounds of :data:`ROUND` rooms from ``cmd['first']``; see the module
    doc. Returns per-phase sums (ns), rooms, steps, failures and bad pages."""
    meter, mode, step_s = _Meter(), cmd["mode"], cmd["step_s"]
    failed = bad = steps = stalled = 0
    proc0, thr0, t0 = time.process_time_ns(), time.thread_time_ns(), time.perf_counter()
    for k in range(cmd["rounds"]):
        _place(cmd["engine_cpus"], cmd["other_cpus"])
        first = cmd["first"] + k * ROUND
        ids = list(range(first, first + ROUND))
        meter.begin("start")
        eng.start(ids, mode)
        meter.end()
        pending = np.array(ids, dtype=np.uint64)
        began = time.monotonic()
        deadline = began + 60
        while pending.size:
            if steps and time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: rooms {pending.tolist()[:4]}... not done in 60 s")
            meter.begin("poll")
            st = eng.poll(pending)
            meter.end()
            steps += 1
            ended = (st == SUCCESS) | (st == FAILED)
            if ended.any():
                done = pending[ended].tolist()
                failed += int((st == FAILED).sum())
                if expected is not None:  # outside the timed calls
                    for room, s in zip(done, st[ended].tolist(), strict=True):
                        page = room % 1024
                        bad += s == SUCCESS and not all(
                            np.array_equal(a[page], e[page])
                            for a, e in zip(eng.kv(), expected, strict=True))
                meter.begin("clear")
                eng.clear(done, mode)
                meter.end()
                pending = pending[~ended]
            if pending.size:
                time.sleep(step_s)
        stalled += time.monotonic() - began > STALL_S
    rooms = cmd["rounds"] * ROUND
    thr = time.thread_time_ns() - thr0
    return {"rooms": rooms, "steps": steps, "failed": failed, "bad_bytes": bad,
            "stalled_rounds": stalled,
            "wall_ns": meter.wall, "cpu_ns": meter.cpu, "thread_cpu_ns": thr,
            "other_threads_cpu_ns": time.process_time_ns() - proc0 - thr,
            "seconds": time.perf_counter() - t0}


def _engine_main(spec: dict[str, Any], conn: Any) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.path.insert(0, str(HERE))
    import sides

    eng = _SglangEngine(spec) if spec["system"] == "sglang" else _KvdEngine(spec)
    expected = sides.expected_kv(LAYERS, ITEM) if spec["role"] == "decode" else None
    conn.send(("ready", os.getpid()))
    while (cmd := conn.recv()) is not None:
        try:
            conn.send(_run_rounds(eng, cmd, expected))
        except Exception as exc:  # the parent reports it and stops
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
    eng.close()


class _Engines:
    """A prefill and a decode engine process of one system (``kvd`` or ``sglang``)."""

    def __init__(self, system: str, work: str, **settings: Any) -> None:
        ctx = mp.get_context("spawn")
        self.daemons: list[Any] = []
        if system == "kvd":
            from kvd.launch import start_daemon

            p = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING",
                             **settings)
            d = start_daemon("decode", work, log_level="WARNING", **settings)
            self.daemons = [p, d]
            specs = [{"system": system, "role": r, "socket": dm.socket, "bootstrap": p.http_addr}
                     for r, dm in (("prefill", p), ("decode", d))]
        else:
            port = 21000 + os.getpid() % 20000
            specs = [{"system": system, "role": r, "bootstrap_port": port}
                     for r in ("prefill", "decode")]
        self.conns, self.procs = [], []
        for spec in specs:
            a, b = ctx.Pipe()
            proc = ctx.Process(target=_engine_main, args=(spec, b), daemon=True)
            proc.start()
            msg = a.recv()
            assert msg[0] == "ready", msg
            self.conns.append(a)
            self.procs.append(proc)
            time.sleep(0.5 if system == "sglang" else 0.0)  # prefill registers first
        self.next_room = 1

    def run(self, mode: str, rounds: int, step_s: float, engine: list[int] | None,
            other: list[int] | None) -> dict[str, Any]:
        """Both roles' results (``{"prefill": ..., "decode": ...}``), plus each kvd
        daemon's CPU seconds over the run."""
        cmd = {"first": self.next_room, "rounds": rounds, "mode": mode, "step_s": step_s,
               "engine_cpus": engine, "other_cpus": other}
        self.next_room += rounds * ROUND
        cpu0 = [issue14.rooms._proc_cpu(d.proc.pid) for d in self.daemons]
        for c in self.conns:
            c.send(cmd)
        out = dict(zip(("prefill", "decode"), (c.recv() for c in self.conns), strict=True))
        for role, r in out.items():
            if "error" in r:
                raise RuntimeError(f"{mode} {role}: {r['error']}")
        for role, d, c0 in zip(("prefill", "decode"), self.daemons, cpu0, strict=False):
            out[role]["daemon_cpu_s"] = issue14.rooms._proc_cpu(d.proc.pid) - c0
        return out

    def place_daemons(self, cpus: set[int]) -> None:
        for d in self.daemons:
            issue14.pin(d.proc.pid, cpus)

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for d in self.daemons:
            d.stop()


def measure(rounds: int = 8, repeats: int = 3, step_s: float = 1e-3,
            where: tuple[str, ...] = issue14.PLACEMENTS, **settings: Any) -> dict[str, Any]:
    """Per placement, per system, per role: medians over ``repeats`` interleaved runs of
    ``rounds`` rounds; ``settings`` go to both kvd daemons (e.g. ``transfer_tcp_pool``).
    Raises ValueError for ``rounds`` or ``repeats`` < 1."""
    if rounds < 1 or repeats < 1:
        raise ValueError(f"P9 needs rounds >= 1 and repeats >= 1 (got {rounds}, {repeats})")
    systems = ["kvd", "kvd_step", "kvd_step_waited", *(["sglang"] if issue14.have_sglang() else [])]
    allowed = os.sched_getaffinity(0)
    cpus = {w: c for w, c in issue14.placements(allowed).items() if w in where}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {s: [] for s in systems}
                                                        for w in cpus}
    load = [issue14.machine_load()]
    with contextlib.ExitStack() as stack:
        kvd = _Engines("kvd", issue14._work(), **settings)
        stack.callback(kvd.close)
        engines = {"kvd": kvd, "kvd_step": kvd, "kvd_step_waited": kvd}
        if "sglang" in systems:
            sg = _Engines("sglang", issue14._work())
            stack.callback(sg.close)
            engines["sglang"] = sg
        for s in systems:  # warm-up: registration, connections, peers
            engines[s].run(s, 2, step_s, None, None)
        for _ in range(repeats):
            for w, (mine, theirs) in cpus.items():
                kvd.place_daemons(theirs)
                for s in systems:
                    runs[w][s].append(engines[s].run(s, rounds, step_s, sorted(mine),
                                                     sorted(theirs)))
        kvd.place_daemons(allowed)
    load.append(issue14.machine_load())
    per = {w: {s: _summary(v) for s, v in by.items()} for w, by in runs.items()}
    return {"rows": rows_of(per), "per_room_us": per, "runs": runs, "load": load,
            "rounds": rounds, "round": ROUND, "repeats": repeats, "step_s": step_s,
            "cpus": sorted(allowed), "kvd_settings": settings}


def _summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per role: per-room microseconds (medians over runs) of the calling thread's wall and
    CPU (total and per phase), its other threads, its daemon; steps per room; failures."""
    out: dict[str, dict[str, Any]] = {}
    for role in ("prefill", "decode"):
        rs = [r[role] for r in runs]

        def med(f: Any, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(f(r) / r["rooms"] for r in rs)

        out[role] = {
            "wall_us": med(lambda r: sum(r["wall_ns"].values()) / 1e3),
            "cpu_us": med(lambda r: sum(r["cpu_ns"].values()) / 1e3),
            "wall_phase_us": {p: med(lambda r, p=p: r["wall_ns"][p] / 1e3) for p in PHASES},
            "cpu_phase_us": {p: med(lambda r, p=p: r["cpu_ns"][p] / 1e3) for p in PHASES},
            "thread_cpu_us": med(lambda r: r["thread_cpu_ns"] / 1e3),
            "other_threads_cpu_us": med(lambda r: r["other_threads_cpu_ns"] / 1e3),
            "daemon_cpu_us": med(lambda r: r.get("daemon_cpu_s", 0.0) * 1e6),
            "polls_per_room": med(lambda r: r["steps"]),
            "poll_cpu_us_per_poll": statistics.median(
                r["cpu_ns"]["poll"] / 1e3 / max(r["steps"], 1) for r in rs),
            "stalled_rounds": sum(r["stalled_rounds"] for r in rs),
            "rounds": sum(r["rooms"] for r in rs) // ROUND,
            "failed": sum(r["failed"] for r in rs), "bad_bytes": sum(r["bad_bytes"] for r in rs)}
    return out


_WHERE = {"free": "", "same": ".one_cpu", "cross": ".two_cpus"}
_ON = {"free": "placed by the scheduler", "same": "one CPU",
       "cross": "calling threads on CPU 0, the rest on CPU 1"}


def rows_of(per: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The P9 rows (benchmarks/rows.py) from :func:`measure`'s per-room summaries: kvd (and
    kvd_step, kvd_step_waited) against SGLang, calling-thread CPU and wall per room, every
    placement."""
    out: dict[str, dict[str, Any]] = {}
    for where, by in per.items():
        sg = by.get("sglang")
        for role in ("prefill", "decode"):
            for system, suffix in (("kvd", ""), ("kvd_step", ".step"),
                                   ("kvd_step_waited", ".step_waited")):
                k = by[system][role]
                b = sg[role] if sg else None
                bad = k["failed"] + k["bad_bytes"] + (b["failed"] + b["bad_bytes"] if b else 0)
                how = {"kvd": "per-room calls", "kvd_step": "submit_all per step, not waited",
                       "kvd_step_waited": "submit_all per step, waited"}[system]
                for metric in ("cpu", "wall"):
                    v, base = k[f"{metric}_us"], b[f"{metric}_us"] if b else None
                    ratio = v / base if base else None
                    rid = f"P9.{role}{suffix}{'' if metric == 'cpu' else '.wall'}{_WHERE[where]}"
                    detail = (f"SGLang; kvd thread+daemon CPU {k['cpu_us']:.0f}+"
                              f"{k['daemon_cpu_us']:.0f} us, SGLang thread+background "
                              f"{b['cpu_us']:.0f}+{b['other_threads_cpu_us']:.0f} us"
                              if b else "SGLang not installed")
                    out[rid] = rowlib.row(
                        f"{role} engine-thread {metric.upper() if metric == 'cpu' else 'wall'}"
                        f" per 1-page room, rounds of {ROUND}, {how} (ring + table), "
                        f"{_ON[where]}", v, "us", f"<= {GOAL:g}x SGLang",
                        None if ratio is None else (ratio <= GOAL and bad == 0),
                        baseline=base, detail=detail, failed=bad)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="rounds of 32 rooms per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=1.0, help="scheduler step period, ms")
    ap.add_argument("--where", default=",".join(issue14.PLACEMENTS),
                    help="placements: free,same,cross")
    ap.add_argument("--tcp-pool", action="store_true",
                    help="kvd daemons with transfer_tcp_pool = true (Mooncake's TCP pool)")
    args = ap.parse_args(argv)
    out = measure(args.rounds, args.repeats, args.step_ms / 1e3,
                  tuple(args.where.split(",")),
                  **({"transfer_tcp_pool": True} if args.tcp_pool else {}))
    from rich.console import Console

    Console(width=200).print(rowlib.table(out["rows"], f"P9 (load {out['load'][0]})"))
    print(json.dumps(out["per_room_us"], indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"p9{'-tcp-pool' if args.tcp_pool else ''}.json").write_text(
        json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
