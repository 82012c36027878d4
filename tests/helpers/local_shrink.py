"""Case S16 on the ``local`` backend, in a process of its own (a copy through a mapping
past its file's end would kill it with SIGBUS, and pytest with it): a prefill-side
``LocalEngine`` copies pages from an unsealed /dev/shm source into a same-host peer's
unsealed /dev/shm pool (:mod:`tests.helpers.exporter` in ``shm`` mode), then the
``source`` or the ``destination`` file is truncated and the same copy is made again.
Prints one JSON line: the first copy's digest check, the second copy's error (or
``""``), and the file's size after it. Usage: python -m tests.helpers.local_shrink
FOLDER source|destination"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np

from kvd.client import ShmPool
from kvd.errors import TransportError
from kvd.memory import Importer, import_engine
from kvd.protocol.memory import ExportedPool
from kvd.security import Authenticator
from kvd.transfer.backends.local import Channel, LocalEngine
from kvd.transfer.backends.peerchannel import Identity
from kvd.transfer.plan import plan_pages

NBUF, NBYTES, ITEM = 4, 64 * 1024, 4096
SECRET = b"s16-test-secret-0123456789abcdef"
PEER = "decode-inst"


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def main() -> None:
    folder, side = Path(sys.argv[1]), sys.argv[2]
    env = {**os.environ, "KVD_TEST_SECRET": SECRET.hex()}
    peer = subprocess.Popen([sys.executable, "-m", "tests.helpers.exporter", str(NBUF),
                             str(NBYTES), str(folder), PEER, "shm"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert peer.stdout is not None
    pool = msgspec.json.decode(peer.stdout.readline(), type=ExportedPool)
    src_pool = ShmPool(NBUF * NBYTES)  # the prefill engine's pool: unsealed
    src_pool.bytes[:] = np.random.default_rng(7).integers(0, 256, NBUF * NBYTES,
                                                          dtype=np.uint8)
    expect = src_pool.bytes.reshape(NBUF, -1, ITEM)[:, [3, 4, 5]].copy()
    mem = import_engine(Importer(Path("/dev/shm")),
                        [src_pool.alloc(NBYTES)[1] for _ in range(NBUF)], [], [], os.getuid())
    me = Identity("prefill-inst", frozenset({os.geteuid()}),
                  Authenticator(SECRET, "prefill-inst").channel_mac)
    eng = LocalEngine(channel=Channel(folder, me))
    mem.register(eng)
    eng.attach_peer("decode-1", pool, PEER)
    desc = plan_pages([b.address for b in mem.kv], [b.address for b in pool.buffers],
                      [ITEM] * NBUF, [ITEM] * NBUF, np.array([3, 4, 5]), np.array([0, 1, 2]))
    eng.write("decode-1", desc)
    want = np.zeros((NBUF, NBYTES // ITEM, ITEM), dtype=np.uint8)
    want[:, [0, 1, 2]] = expect
    first_ok = _ask(peer, "digest") == hashlib.sha256(want.tobytes()).hexdigest()
    if side == "source":
        src_pool.bytes = np.zeros(0, dtype=np.uint8)  # this process must not touch it now
        os.truncate(src_pool.path, 0)
        size_of = lambda: os.path.getsize(src_pool.path)  # noqa: E731
    else:
        path = Path(_ask(peer, f"truncate {ITEM}"))
        size_of = lambda: path.stat().st_size  # noqa: E731
    error = ""
    try:
        eng.write("decode-1", desc)
    except TransportError as exc:
        error = str(exc)
    print(msgspec.json.encode({"first_ok": first_ok, "error": error, "size": size_of(),
                               "lost": mem.lost() or ""}).decode(), flush=True)
    eng.close()
    assert peer.stdin is not None
    peer.stdin.close()
    peer.wait(10)


if __name__ == "__main__":
    main()
