"""GPU stand-in decode process for tests/gpu: a CUDA KV pool exported with cuda_ipc and
imported the way kvd imports it; prints the ExportedPool (JSON), then answers ``digest``
with a SHA-256 of the pool's bytes. Usage: python -m tests.gpu.cuda_exporter NBYTES"""

from __future__ import annotations

import hashlib
import os
import sys

import msgspec


def main() -> None:
    import torch

    from kvd.client.cuda import cuda_ipc_handle
    from kvd.hostid import host_identity
    from kvd.protocol.memory import ExportedBuffer, ExportedPool

    nbytes = int(sys.argv[1])
    pool = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    h = cuda_ipc_handle(pool)
    exported = ExportedPool(host_identity(), [ExportedBuffer(pool.data_ptr(), nbytes, h)])
    print(msgspec.json.encode(exported).decode(), flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            torch.cuda.synchronize()
            print(hashlib.sha256(pool.cpu().numpy().tobytes()).hexdigest(), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
