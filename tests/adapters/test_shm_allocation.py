"""The vLLM connector's KV-cache placement in /dev/shm, and pointer -> handle lookup."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvd.adapters.shmmaps import NotSharedMemory, handle_for, parse_maps, read_maps  # noqa: E402
from kvd.adapters.vllm.shm import ShmAllocation, remove_stale  # noqa: E402
from kvd.client import ShmPool  # noqa: E402
from kvd.memory import Importer  # noqa: E402


def test_allocations_inside_the_context_live_in_shared_memory(tmp_path: Path) -> None:
    alloc = ShmAllocation(min_bytes=1024, shm_dir="/dev/shm", name_prefix="kvd-test")
    with alloc:
        big = torch.zeros(8192, dtype=torch.int8, device="cpu")  # like allocate_kv_cache
        small = torch.zeros(16, dtype=torch.int8)
        shaped = torch.empty((4, 256), dtype=torch.float32)
    outside = torch.zeros(8192, dtype=torch.int8)
    try:
        assert len(alloc.regions) == 2 and not big.any()
        assert Path(alloc.regions[0].pool.path).stat().st_size == 8192
        view = big.view(torch.float32).view(4, 512)[1:]  # what vLLM does: strided views
        handle = alloc.handle_of(view.data_ptr(), 3 * 2048)
        assert (handle.path, handle.offset, handle.length) == (alloc.regions[0].pool.path,
                                                               2048, 6144)
        with pytest.raises(ValueError):
            alloc.handle_of(small.data_ptr(), 16)
        with pytest.raises(ValueError):
            alloc.handle_of(outside.data_ptr(), 16)
        assert tuple(shaped.shape) == (4, 256)
        # kvd maps the same file and sees the engine's writes without any copy
        view.fill_(1.5)
        buf = Importer(Path("/dev/shm")).engine_buffer(handle, [], os.getuid())
        addr = buf.address
        seen = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_float * 1536).from_address(addr))
        assert np.all(seen == 1.5)
        del seen
        buf.release()
    finally:
        paths = [r.pool.path for r in alloc.regions]
        alloc.close()
    assert not any(os.path.exists(p) for p in paths)


def test_files_of_dead_owners_are_removed() -> None:
    dead = Path("/dev/shm/kvd-test-999999999-deadbeef")
    dead.write_bytes(b"x")
    mine = Path(f"/dev/shm/kvd-test-{os.getpid()}-cafe")
    mine.write_bytes(b"x")
    try:
        removed = remove_stale("/dev/shm", "kvd-test")
        assert str(dead) in removed and mine.exists()
    finally:
        for p in (dead, mine):
            p.unlink(missing_ok=True)


def test_pointers_resolve_to_shm_handles_through_proc_maps() -> None:
    pool = ShmPool(1 << 16)
    try:
        view, handle = pool.alloc(4096)
        view2, handle2 = pool.alloc(100)
        maps = read_maps()
        assert handle_for(view.ctypes.data, 4096, maps) == handle
        assert handle_for(view2.ctypes.data + 10, 50, maps).offset == handle2.offset + 10
        private = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(NotSharedMemory, match="not in a file under /dev/shm"):
            handle_for(private.ctypes.data, 4096, maps)
        with pytest.raises(NotSharedMemory, match="runs past the end"):
            handle_for(view.ctypes.data, 1 << 20, maps)
    finally:
        pool.close()


def test_parse_maps_reads_proc_format() -> None:
    text = ("7f0000000000-7f0000002000 rw-s 00001000 00:1a 42  /dev/shm/pool\n"
            "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 \n"
            "7f0000003000-7f0000004000 rw-s 00000000 00:1a 43  /dev/shm/gone (deleted)\n")
    maps = parse_maps(text)
    assert [m.path for m in maps] == ["/dev/shm/pool", "", "/dev/shm/gone (deleted)"]
    h = handle_for(0x7F0000000100, 16, maps)
    assert (h.path, h.offset, h.length) == ("/dev/shm/pool", 0x1100, 16)
    for addr in (0x7F0000002000, 0x7F0000003000, 0x10):
        with pytest.raises(NotSharedMemory):
            handle_for(addr, 1, maps)
