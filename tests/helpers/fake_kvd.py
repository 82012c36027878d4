"""A stand-in kvd engine socket for client tests: real framing over a Unix socket."""

from __future__ import annotations

import socket
import threading
from typing import Any

from kvd.protocol import rpc


class FakeKvd:
    """A fake kvd on ``path``: answers the first ``answered`` requests, then reads and
    records the rest without answering. Each answer is ``reply`` as given (its own id),
    else ``Reply(id=<the request's>, ok=True, result=result)`` (default: an empty
    PollResult). ``seen``: (connection number, call name) of every request received."""

    def __init__(self, path: str, answered: int = 2**62, reply: rpc.Reply | None = None,
                 result: Any = None) -> None:
        self.answered, self.reply = answered, reply
        self.result = rpc.PollResult(statuses=[]) if result is None else result
        self.seen: list[tuple[int, str]] = []
        self.conns: list[socket.socket] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn, len(self.conns)),
                             daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        buf = b""
        while True:
            try:
                data = conn.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            buf += data
            while len(buf) >= rpc.LENGTH.size:
                (n,) = rpc.LENGTH.unpack_from(buf)
                if len(buf) < rpc.LENGTH.size + n:
                    break
                req = rpc.decode_request(buf[rpc.LENGTH.size:rpc.LENGTH.size + n])
                buf = buf[rpc.LENGTH.size + n:]
                self.seen.append((number, type(req.call).__name__))
                if len(self.seen) <= self.answered:
                    reply = self.reply or rpc.Reply(id=req.id, ok=True, result=self.result)
                    conn.sendall(rpc.encode(reply))

    def close(self) -> None:
        for s in (*self.conns, self.listener):
            s.close()
