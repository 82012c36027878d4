"""A stand-in decode daemon for local-backend tests: imports an FdPool the way kvd does,
serves it on a peer channel (as instance ``INSTANCE`` in ``FOLDER``, cluster secret from
``KVD_TEST_SECRET`` hex, or none), prints its ExportedPool (JSON) and then answers
``digest`` lines with a SHA-256 of its buffers, until stdin closes. With ``shm`` as the
fifth argument the pool is an unsealed /dev/shm file instead, and ``truncate N`` cuts it
to N bytes (the engine of case S16; answered with the file's path; no digest after that).
Usage: python -m tests.helpers.exporter NBUF NBYTES FOLDER INSTANCE [shm]"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import sys
import threading
from pathlib import Path

import msgspec

from kvd.client import FdPool, ShmPool
from kvd.hostid import host_identity
from kvd.memory import Importer, import_engine
from kvd.security import Authenticator
from kvd.transfer.backends.peerchannel import Claim, Identity, channel_name, listen, serve_one

#: The transfer session the tests attach this peer under (its claim names it).
SESSION = "decode-1"


def main() -> None:
    nbuf, nbytes, folder, instance = (int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]),
                                      sys.argv[4])
    secret = os.environ.get("KVD_TEST_SECRET")
    auth = Authenticator(bytes.fromhex(secret) if secret else None, instance)
    size = FdPool.size_for([nbytes] * nbuf)
    if sys.argv[5:6] == ["shm"]:
        shm = ShmPool(size)
        handles: list = [shm.alloc(nbytes)[1] for _ in range(nbuf)]
        mem = import_engine(Importer(Path("/dev/shm")), handles, [], [], os.getuid())
    else:
        pool = FdPool(size)
        handles = [msgspec.structs.replace(pool.alloc(nbytes)[1], fd=0) for _ in range(nbuf)]
        mem = import_engine(Importer(Path("/dev/shm")), handles, [], [pool.fd], os.getuid())
    exported, fds = mem.export(host_identity(), channel_name(instance))
    sock = listen(folder, exported.channel)
    me = Identity(instance, frozenset({os.geteuid()}), auth.channel_mac)
    mine = Claim(instance, "", SESSION)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(Exception):
                serve_one(conn, me, mine, exported, fds)

    threading.Thread(target=serve, daemon=True).start()
    print(msgspec.json.encode(exported).decode(), flush=True)
    for line in sys.stdin:
        if line.startswith("truncate "):
            os.truncate(shm.path, int(line.split()[1]))
            print(shm.path, flush=True)
        elif line.strip() == "digest":
            h = hashlib.sha256()
            for b in mem.buffers:
                h.update(ctypes.string_at(b.address, b.length))
            print(h.hexdigest(), flush=True)
    sock.close()


if __name__ == "__main__":
    main()
