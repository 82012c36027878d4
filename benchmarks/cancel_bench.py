"""K43: a fresh room's latency while N aborted rooms were queued P -> D, vs baseline.

Two real kvd daemons over Mooncake TCP loopback, engine stand-ins. Baseline: a fresh
1-page room alone (receiver init, sender init and send, until the decode says Success).
Loaded: N rooms of ``room_mib`` MiB each are bound and sent (their writes queue in the
prefill's pump), the prefill engine aborts all N at once, and the same fresh room is
timed. Without cancellation it waits for the whole queue (the case: 2.98 s vs 0.02 s);
with it, only for what was in flight (``inflight_entries``, ``inflight_bytes``,
``inflight_min_entries``). Also reported: bytes of the aborted rooms that still landed,
from the prefill's counters.
Goal: loaded / baseline <= 2 (medians).

Run as ``python benchmarks/run.py --only cancel [--cancel-rooms 150 --cancel-mib 32]``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from kvd.client import KVPoll, Receiver, Sender
from kvd.launch import DaemonProcess, start_daemon
from kvd.refengine.standin import EngineStandIn, wait_rooms

ITEM = 256 << 10  # bytes per page and buffer (4 buffers: 2 layers, K and V)


def _counters(d: DaemonProcess) -> dict[str, int]:
    out: dict[str, int] = httpx.get(f"http://{d.http_addr}/health", timeout=10).json()[
        "counters"]
    return out


def _fresh(p: EngineStandIn, d: EngineStandIn, boot: str, room: int, page: int) -> float:
    """Seconds from a 1-page room's send to the decode's Success."""
    r = Receiver(d.client, room, boot)
    r.init([page], page)  # the aux slot of its page (K42: aborted rooms may hold 0)
    s = Sender(p.client, room)
    s.init(1, page)
    t0 = time.perf_counter()
    s.send([page])
    states = wait_rooms(d.client, [room], timeout=60.0, interval=0.0005)
    dt = time.perf_counter() - t0
    assert states == [KVPoll.Success], states
    assert d.pages_equal(p, [page], [page])
    return dt


def run(console: Console, rooms: int = 150, room_mib: int = 32, repeats: int = 3,
        inflight_mib: int | None = None) -> dict[str, Any]:
    """Medians and the ratio; ``inflight_mib``: the prefill's ``inflight_bytes`` (None: its
    default). Raises AssertionError if a fresh room's bytes differ."""
    room_pages = max(1, (room_mib << 20) // (4 * ITEM))
    pages = rooms * room_pages + 1
    work = Path(tempfile.mkdtemp(prefix="kvd-bench-cancel-"))
    extra = {} if inflight_mib is None else {"inflight_bytes": inflight_mib << 20}
    prefill = start_daemon("prefill", work, serve_bootstrap=True, log_level="WARNING", **extra)
    decode = start_daemon("decode", work, log_level="WARNING", waiting_timeout=600.0)
    opts = {"num_layers": 2, "num_pages": pages, "item_len": ITEM}
    p = EngineStandIn(prefill.socket, seed=1, **opts)
    d = EngineStandIn(decode.socket, seed=2, **opts)
    boot, spare, next_room = prefill.http_addr, pages - 1, 90_000
    base, loaded, landed, queued = [], [], [], rooms * room_pages * 4 * ITEM
    try:
        _fresh(p, d, boot, next_room, spare)  # warm: the transfer session is open
        for _ in range(repeats):
            next_room += 1
            base.append(_fresh(p, d, boot, next_room, spare))
        for _ in range(repeats):
            before = _counters(prefill)["cancelled_bytes_landed"]
            first = next_room + 1
            senders = []
            for k in range(rooms):
                room, dst = first + k, np.arange(k * room_pages, (k + 1) * room_pages)
                Receiver(d.client, room, boot).init(dst, int(dst[0]))  # own aux (K42)
                s = Sender(p.client, room)
                s.init(room_pages, 0)
                senders.append((s, dst))
            while any(s.poll() != KVPoll.WaitingForInput for s, _ in senders):
                time.sleep(0.001)
            for s, dst in senders:
                s.send(dst[::-1], is_last=True)
            for s, _ in senders:
                s.abort("benchmark: client gone")
            next_room = first + rooms
            loaded.append(_fresh(p, d, boot, next_room, spare))
            wait_rooms(d.client, list(range(first, first + rooms)), timeout=120.0)
            landed.append(_counters(prefill)["cancelled_bytes_landed"] - before)
    finally:
        p.close()
        d.close()
        prefill.stop()
        decode.stop()
    b, lo = statistics.median(base), statistics.median(loaded)
    out = {"rooms": rooms, "inflight_mib": inflight_mib,
           "room_mib": room_pages * 4 * ITEM / (1 << 20),
           "baseline_s": base, "loaded_s": loaded, "ratio": lo / b,
           "aborted_bytes_queued": queued, "aborted_bytes_landed": landed, "goal": 2.0}
    table = Table(title=f"K43: fresh 1-page room after {rooms} queued rooms of "
                        f"{out['room_mib']:.0f} MiB were aborted (medians of {repeats})")
    for col in ("baseline", "after aborts", "ratio", "goal", "aborted bytes landed"):
        table.add_column(col)
    table.add_row(f"{b * 1e3:.1f} ms", f"{lo * 1e3:.1f} ms", f"{lo / b:.2f}x", "<= 2x",
                  f"{statistics.median(landed) / (1 << 20):.0f} of {queued / (1 << 20):.0f} MiB")
    console.print(table)
    return out
