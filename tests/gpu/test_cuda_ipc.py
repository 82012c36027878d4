"""GPU-only: cuda_ipc import and the local backend's device-to-device copies, checked in
another process byte for byte, and their speed against a plain torch copy of the same
pages (printed). Skipped, with the reason, where there is no CUDA device."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest

from kvd.memory import cuda as kcuda

pytestmark = pytest.mark.skipif(kcuda.device_count() == 0,
                                reason="needs an NVIDIA GPU with a driver (scripts/gpu-check.sh)")

NBYTES, ITEM = 256 << 20, 64 << 10


def _exporter() -> tuple[subprocess.Popen[str], object]:
    from kvd.protocol.memory import ExportedPool

    p = subprocess.Popen([sys.executable, "-m", "tests.gpu.cuda_exporter", str(NBYTES)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, msgspec.json.decode(p.stdout.readline(), type=ExportedPool)


def _digest(p: subprocess.Popen[str]) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("digest\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def test_cuda_ipc_import_and_local_gpu_copy_are_byte_exact() -> None:
    import torch

    from kvd.errors import TransportError
    from kvd.transfer.backends.local import LocalEngine
    from kvd.transfer.plan import Descriptors, plan_pages

    proc, pool = _exporter()
    try:
        src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda")
        eng = LocalEngine()
        eng.register(src.data_ptr(), NBYTES, f"cuda:{src.device.index}")
        assert eng.attach_peer("decode", pool) == "local"
        pages = NBYTES // ITEM
        rng = np.random.default_rng(0)
        sp, dp = rng.choice(pages, pages // 2, replace=False), rng.choice(pages, pages // 2,
                                                                         replace=False)
        desc = plan_pages([src.data_ptr()], [pool.buffers[0].address], [ITEM], [ITEM], sp, dp)
        t0 = time.perf_counter()
        eng.write("decode", desc)
        local_s = time.perf_counter() - t0
        expect = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda").view(pages, ITEM)
        sp_t, dp_t = torch.as_tensor(sp, device="cuda"), torch.as_tensor(dp, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        expect[dp_t] = src.view(pages, ITEM)[sp_t]
        torch.cuda.synchronize()
        torch_s = time.perf_counter() - t0
        want = hashlib.sha256(expect.cpu().numpy().tobytes()).hexdigest()
        assert _digest(proc) == want
        moved = desc.nbytes / 1e9
        print(f"\nlocal cudaMemcpyAsync {moved / local_s:.1f} GB/s vs torch gather copy "
              f"{moved / torch_s:.1f} GB/s ({desc.nbytes >> 20} MiB, {len(desc)} runs)")
        bad = Descriptors(np.array([src.data_ptr()], np.uint64),
                          np.array([pool.buffers[0].address + NBYTES - 8], np.uint64),
                          np.array([16], np.uint64))
        with pytest.raises(TransportError, match="outside"):
            eng.write("decode", bad)
        eng.close()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)


def test_cuda_ipc_handle_of_a_wrong_size_range_is_refused() -> None:
    import torch

    from kvd.client.cuda import cuda_ipc_handle
    from kvd.errors import HandleError

    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    h = cuda_ipc_handle(t)
    big = msgspec.structs.replace(h, length=h.length + (64 << 20))
    with pytest.raises(HandleError):  # past the segment (or CUDA refuses the own handle)
        kcuda.CudaImports().buffer(big)
