"""S05 measurement: what idle connections to a decode's handshake port do to transfers.

Three Mooncake engines on loopback: P (this process), a decode D and a healthy peer H
(child processes, 1 MiB registered each). P has already written to H. N idle TCP
connections are opened to D's handshake port; then P writes 4 KiB to D (its first
write: a handshake) in one thread and 4 KiB to H in another. Prints both durations.
Usage: python benchmarks/handshake_idle.py N [--no-front]   (N = 0 is the baseline;
``--no-front`` starts D without kvd's handshake front, where each idle connection costs
about 5 s, so keep N small there). See docs/transfer.md.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from kvd.transfer.backends.mooncake import MooncakeEngine
from kvd.transfer.plan import Descriptors

CHILD = """
import os, sys, numpy as np
from kvd.transfer.backends.mooncake import MooncakeEngine, MooncakeOptions
e = MooncakeEngine(MooncakeOptions("127.0.0.1", handshake_front=sys.argv[1] == "front"))
b = np.zeros(1 << 20, dtype=np.uint8)
e.register(b.ctypes.data, b.nbytes)
print(e.session_id, b.ctypes.data, flush=True)
sys.stdin.read()
os._exit(0)
"""


def _peer(front: bool = True) -> tuple[subprocess.Popen[str], str, int]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, "front" if front else "none"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    session, addr = p.stdout.readline().split()
    return p, session, int(addr)


def main(n_idle: int, front: bool = True) -> dict[str, tuple[float, object]]:
    _d, d_session, d_addr = _peer(front)
    _h, h_session, h_addr = _peer()
    engine = MooncakeEngine("127.0.0.1", retry_budget=0.0)
    src = np.ones(1 << 20, dtype=np.uint8)
    engine.register(src.ctypes.data, src.nbytes)

    def desc(addr: int) -> Descriptors:
        return Descriptors(np.array([src.ctypes.data], np.uint64),
                           np.array([addr], np.uint64), np.array([4096], np.uint64))

    engine.write(h_session, desc(h_addr))  # H is known: no handshake needed later
    port = int(d_session.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(n_idle)]
    time.sleep(0.2)
    result: dict[str, tuple[float, object]] = {}

    def write(name: str, session: str, addr: int) -> None:
        t0 = time.monotonic()
        try:
            engine.write(session, desc(addr))
            ok: object = True
        except Exception as exc:
            ok = repr(exc)[:100]
        result[name] = (round(time.monotonic() - t0, 2), ok)

    a = threading.Thread(target=write, args=("first write to D", d_session, d_addr))
    a.start()
    time.sleep(0.1)
    b = threading.Thread(target=write, args=("write to healthy H", h_session, h_addr))
    b.start()
    a.join()
    b.join()
    for s in idle:
        s.close()
    return result


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    front = "--no-front" not in sys.argv
    print(n, "idle connections,", "front" if front else "no front", json.dumps(main(n, front)),
          flush=True)
    os._exit(0)  # skip the engines' teardown
