"""Same-host transfer: the ``local`` backend vs Mooncake over loopback vs memcpy, same pages.

A child process plays the decode daemon: it owns the destination pool (a sealed memfd,
imported as kvd imports an engine's fd), registers each buffer with a Mooncake engine,
exports the pool (ExportedPool) and serves its descriptors on a peer channel (the
authenticated handshake kvd runs, case S18). The parent plays the prefill daemon: the
same descriptors go (a) through :class:`~kvd.transfer.backends.local.LocalEngine`
attached to the export through that channel, copying through the kernel (the source
is registered as memory that may shrink: what an unsealed ``shm`` pool gets, case S16),
(a') the same with the source registered ``stable`` (this process's own memory; the
destination is a sealed memfd: both sides sealed, ``memmove``), (b) through a Mooncake
engine over TCP loopback, and (c) a memcpy of the same pages inside the parent (the
machine's ceiling). Runs are interleaved; before each run the child zeroes its pool, after it
the child's digest of the destination pages must equal the source pages' digest
(bytes verified, every run).

Run as ``python benchmarks/run.py --only samehost``; the child is this file with
``--child``.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from kvd.protocol.memory import ExportedPool
from kvd.transfer.plan import plan_pages

SECRET = os.urandom(24)
INSTANCE = "bench-decode"


def _identity(instance: str, secret: bytes) -> Any:
    from kvd.security import Authenticator
    from kvd.transfer.backends.peerchannel import Identity

    return Identity(instance, frozenset({os.geteuid()}), Authenticator(secret).channel_mac)


def _child(nbuf: int, per_buf: int, item: int, folder: str, secret: bytes) -> None:
    import contextlib
    import ctypes
    import threading

    from kvd.client import FdPool
    from kvd.hostid import host_identity
    from kvd.memory import Importer, import_engine
    from kvd.transfer.backends.mooncake import MooncakeEngine
    from kvd.transfer.backends.peerchannel import Claim, channel_name, listen, serve_one

    pool = FdPool(FdPool.size_for([per_buf] * nbuf))
    handles = [msgspec.structs.replace(pool.alloc(per_buf)[1], fd=0) for _ in range(nbuf)]
    mem = import_engine(Importer(Path("/dev/shm")), handles, [], [pool.fd], os.getuid())
    engine = MooncakeEngine("127.0.0.1")
    mem.register(engine)
    exported, fds = mem.export(host_identity(), channel_name(INSTANCE))
    sock, me = listen(Path(folder), exported.channel), _identity(INSTANCE, secret)
    mine = Claim(INSTANCE, "", engine.session_id)

    def serve() -> None:
        while True:
            conn, _ = sock.accept()
            with conn, contextlib.suppress(Exception):
                serve_one(conn, me, mine, exported, fds)

    threading.Thread(target=serve, daemon=True).start()
    print(msgspec.json.encode({"pool": exported,
                               "session": engine.session_id}).decode(), flush=True)
    views = [np.ctypeslib.as_array((ctypes.c_uint8 * b.length).from_address(b.address))
             .reshape(-1, item) for b in mem.buffers]
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "zero":
            for v in views:
                v[:] = 0
            print("ok", flush=True)
        elif cmd == "digest":
            pages = np.array([int(x) for x in arg.split(",")])
            h = hashlib.sha256()
            for v in views:
                h.update(v[pages].tobytes())
            print(h.hexdigest(), flush=True)
    os._exit(0)  # skip the engine's teardown


class _Decode:
    def __init__(self, nbuf: int, per_buf: int, item: int, folder: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", str(nbuf),
                                      str(per_buf), str(item), str(folder), SECRET.hex()],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        info = msgspec.json.decode(self.proc.stdout.readline())
        self.pool = msgspec.convert(info["pool"], ExportedPool)
        self.session = info["session"]

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def run(console: Console, mib: int = 256, item_kib: int = 64, layers: int = 8,
        repeats: int = 3) -> dict[str, Any]:
    """Median GB/s of each path and the ratios local/mooncake (goal >= 5) and
    local/memcpy (goal >= 0.5), ``local`` being the kernel copy (S16) and
    ``local_sealed`` the copy between sealed pools; raises AssertionError if any run's
    bytes differ."""
    from kvd.transfer.backends.local import Channel, LocalEngine
    from kvd.transfer.backends.mooncake import MooncakeEngine

    item, nbuf = item_kib << 10, 2 * layers
    move = max(1, (mib << 20) // (nbuf * item))
    pages = 2 * move
    per_buf = pages * item
    rng = np.random.default_rng(0)
    src_pages = rng.choice(pages, move, replace=False)
    dst_pages = rng.choice(pages, move, replace=False)
    src = rng.integers(0, 256, (nbuf, pages, item), dtype=np.uint8)
    expect = hashlib.sha256(b"".join(src[b][src_pages].tobytes() for b in range(nbuf)))
    folder = Path(tempfile.mkdtemp(prefix="kvd-bench-peers-"))
    decode = _Decode(nbuf, per_buf, item, folder)
    local = LocalEngine(channel=Channel(folder, _identity("bench-prefill", SECRET)))
    sealed = LocalEngine(channel=Channel(folder, _identity("bench-prefill", SECRET)))
    mc = MooncakeEngine("127.0.0.1")
    for eng in (local, mc):
        eng.register(src.ctypes.data, src.nbytes)
    sealed.register(src.ctypes.data, src.nbytes, stable=True)  # our own: nothing shrinks it
    for eng in (local, sealed):
        eng.attach_peer(decode.session, decode.pool, INSTANCE)
    src_ptrs = src.ctypes.data + np.arange(nbuf, dtype=np.uint64) * np.uint64(per_buf)
    desc = plan_pages(src_ptrs, [b.address for b in decode.pool.buffers], [item] * nbuf,
                      [item] * nbuf, src_pages, dst_pages)
    mirror = np.zeros_like(src)
    dst_list = ",".join(map(str, dst_pages.tolist()))

    def memcpy() -> None:
        for b in range(nbuf):
            mirror[b][dst_pages] = src[b][src_pages]

    paths = {"local": lambda: local.write(decode.session, desc),
             "local_sealed": lambda: sealed.write(decode.session, desc),
             "mooncake_loopback": lambda: mc.write(decode.session, desc), "memcpy": memcpy}
    times: dict[str, list[float]] = {k: [] for k in paths}
    try:
        for rep in range(repeats + 1):  # round 0 warms up (connections, page faults)
            for name, fn in paths.items():
                decode.ask("zero")
                t0 = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t0
                got = (hashlib.sha256(b"".join(mirror[b][dst_pages].tobytes()
                                               for b in range(nbuf))).hexdigest()
                       if name == "memcpy" else decode.ask(f"digest {dst_list}"))
                assert got == expect.hexdigest(), f"{name}: destination bytes differ"
                if rep:
                    times[name].append(elapsed)
    finally:
        local.close()
        sealed.close()
        decode.close()
    nbytes = int(desc.nbytes)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    out = {"bytes": nbytes, "descriptors": len(desc), "seconds": times, "gbps": gbps,
           "ratio_local_over_mooncake": gbps["local"] / gbps["mooncake_loopback"],
           "ratio_local_over_memcpy": gbps["local"] / gbps["memcpy"],
           "ratio_local_sealed_over_mooncake": gbps["local_sealed"] / gbps["mooncake_loopback"],
           "bytes_equal": True}
    table = Table(title=f"same-host P -> D, {nbytes / 2**20:.0f} MiB in {len(desc)} runs of "
                        f"{item_kib} KiB pages, {repeats} interleaved runs each")
    for col in ("path", "median s", "GB/s"):
        table.add_column(col, justify="right")
    for k, v in times.items():
        table.add_row(k, f"{statistics.median(v):.3f}", f"{gbps[k]:.2f}")
    console.print(table)
    console.print(f"local/mooncake = {out['ratio_local_over_mooncake']:.1f}x (goal >= 5); "
                  f"local/memcpy = {out['ratio_local_over_memcpy']:.2f}x (goal >= 0.5); "
                  f"sealed pools: local/mooncake = "
                  f"{out['ratio_local_sealed_over_mooncake']:.1f}x; bytes verified every run")
    return out


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
               bytes.fromhex(sys.argv[6]))
    else:
        run(Console())
