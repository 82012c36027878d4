"""A stand-in decode daemon for local-backend tests: imports an FdPool the way kvd does,
prints its ExportedPool (JSON) and then answers ``digest`` lines with a SHA-256 of its
buffers, until stdin closes. Usage: python -m tests.helpers.exporter NBUF NBYTES"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
from pathlib import Path

import msgspec

from kvd.client import FdPool
from kvd.hostid import host_identity
from kvd.memory import Importer, import_engine


def main() -> None:
    nbuf, nbytes = int(sys.argv[1]), int(sys.argv[2])
    pool = FdPool(FdPool.size_for([nbytes] * nbuf))
    handles = [msgspec.structs.replace(pool.alloc(nbytes)[1], fd=0) for _ in range(nbuf)]
    mem = import_engine(Importer(Path("/dev/shm")), handles, [], [pool.fd], os.getuid())
    print(msgspec.json.encode(mem.export(host_identity())).decode(), flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            h = hashlib.sha256()
            for b in mem.buffers:
                h.update(ctypes.string_at(b.address, b.length))
            print(h.hexdigest(), flush=True)


if __name__ == "__main__":
    main()
