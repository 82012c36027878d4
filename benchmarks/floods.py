"""Floods from one unauthenticated process, for the flood benchmark and the S02-S04 tests.

Each flood runs for a bounded time against loopback and prints one JSON line of what
it did. Run one as a child process::

    python benchmarks/floods.py zmq tcp://127.0.0.1:5555 --seconds 5
    python benchmarks/floods.py zmq tcp://127.0.0.1:5555 --size 4000000 --connections 4
    python benchmarks/floods.py body 127.0.0.1:8998 --seconds 5 --mib 250
    python benchmarks/floods.py idle 127.0.0.1:8998 --seconds 5 --connections 4000

zmq   tiny random frames, as fast as one DEALER socket sends them (the control socket
      is a ROUTER; a PUSH socket would not get past the ZMTP handshake); with ``--size``
      and ``--connections``: big forged frames (a seal's magic, a random header and body)
      from several DEALER sockets, round robin (S19);
body  ``PUT /route`` declaring (and streaming) a huge body, unauthenticated, again and
      again; reports the most bytes the server took on one connection before closing it;
idle  many connections that each send half a request head and then nothing; a
      connection the server closes is opened again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import selectors
import socket
import sys
import time
from typing import Any

from kvd.addr import parse_hostport


def zmq_flood(endpoint: str, seconds: float, size: int = 16,
              kind: str = "dealer", connections: int = 1) -> dict[str, Any]:
    """Send ``size``-byte random frames to ``endpoint`` for ``seconds`` from
    ``connections`` sockets (``kind`` "push" reaches the PULL socket of kvd before seal
    version 2, for comparisons). Frames of 1 KiB and more look sealed (``KVA2``): they
    are forged seals, refused at the MAC."""
    import zmq

    ctx = zmq.Context()
    socks = []
    for _ in range(connections):
        sock = ctx.socket(zmq.PUSH if kind == "push" else zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 200)
        sock.connect(endpoint)
        socks.append(sock)
    big = size >= 1024
    frames = [(b"KVA2" if big else b"") + os.urandom(size - 4 if big else size)
              for _ in range(4 if big else 64)]
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for i, f in enumerate(frames):
            try:
                socks[i % len(socks)].send(f, copy=not big)
                sent += 1
            except zmq.Again:  # the receiver's queue is full: that is backpressure
                break
    for sock in socks:
        sock.close()
    ctx.term()
    return {"flood": "zmq", "frames_sent": sent, "bytes_sent": sent * size}


_HEAD = ("PUT /route HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
         "Content-Length: {length}\r\n\r\n")


def body_flood(addr: str, seconds: float, mib: int = 250) -> dict[str, Any]:
    """Unauthenticated ``PUT /route`` with a ``mib`` MiB body, repeated for ``seconds``."""
    host, port = parse_hostport(addr)
    length, chunk = mib << 20, b"x" * (1 << 16)
    attempts, most, statuses = 0, 0, set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        attempts += 1
        sent, status = _one_body(host, port, length, chunk, end)
        most = max(most, sent)
        statuses.add(status)
    return {"flood": "body", "attempts": attempts, "max_body_bytes_sent": most,
            "declared_bytes": length, "answers": sorted(statuses)}


def _one_body(host: str, port: int, length: int, chunk: bytes,
              end: float) -> tuple[int, str]:
    """(body bytes the server took, its status line or how the connection ended)."""
    sent = 0
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(_HEAD.format(host=host, length=length).encode())
        s.setblocking(False)
        while sent < length and time.monotonic() < end:
            if select.select([s], [], [], 0)[0]:  # the server answered (or closed)
                return sent, _status(s)
            try:
                sent += s.send(chunk[: length - sent])
            except BlockingIOError:
                time.sleep(0.001)
            except OSError as exc:
                return sent, type(exc).__name__
    return sent, "sent everything" if sent >= length else "time up"


def _status(s: socket.socket) -> str:
    try:
        data = s.recv(256)
    except OSError as exc:
        return type(exc).__name__
    return data.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"


def idle_flood(addr: str, seconds: float, connections: int = 4000) -> dict[str, Any]:
    """Hold up to ``connections`` half-sent requests open for ``seconds``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, connections + 256), hard))
    host, port = parse_hostport(addr)
    sel = selectors.DefaultSelector()
    opened = closed = failed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while len(sel.get_map()) < connections and time.monotonic() < end:
            s = _half_request(host, port)
            if s is None:
                failed += 1
                break
            sel.register(s, selectors.EVENT_READ)
            opened += 1
        for key, _ in sel.select(0.05):  # readable: closed (or answered) by the server
            sel.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
            closed += 1
    held = len(sel.get_map())
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return {"flood": "idle", "opened": opened, "closed_by_server": closed,
            "connect_failures": failed, "held_at_end": held}


def _half_request(host: str, port: int) -> socket.socket | None:
    try:
        s = socket.create_connection((host, port), timeout=2)
        s.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode())
    except OSError:
        return None
    s.setblocking(False)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["zmq", "body", "idle"])
    ap.add_argument("target", help="tcp://host:port (zmq) or host:port (http)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--mib", type=int, default=250)
    ap.add_argument("--connections", type=int, default=None,
                    help="idle: connections held (4000); zmq: sockets sending (1)")
    ap.add_argument("--size", type=int, default=16, help="zmq: bytes per frame")
    ap.add_argument("--socket", choices=["dealer", "push"], default="dealer",
                    help="zmq: the socket type (push: kvd before seal version 2)")
    args = ap.parse_args(argv)
    if args.kind == "zmq":
        result = zmq_flood(args.target, args.seconds, args.size, args.socket,
                           args.connections or 1)
    elif args.kind == "body":
        result = body_flood(args.target, args.seconds, args.mib)
    else:
        result = idle_flood(args.target, args.seconds, args.connections or 4000)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
