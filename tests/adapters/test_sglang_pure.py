"""The SGLang backend's pure parts: KVArgs -> RegisterKV, the TransferBackend extension
and the get_kv_class hook (no SGLang needed)."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvd.adapters.sglang.kvargs import KVArgsError, dtype_size, registration
from kvd.adapters.sglang.plugin import get_kv_class_around, is_kvd, transfer_backend_with_kvd
from kvd.adapters.shmmaps import read_maps
from kvd.client import ShmPool


def _args(pool: ShmPool, layers: int = 2, item: int = 4 * 2 * 8 * 2, **over: Any) -> Any:
    kv = [pool.alloc(16 * item)[0] for _ in range(2 * layers)]
    aux = [pool.alloc(8 * 32)[0]]
    args = SimpleNamespace(
        kv_data_ptrs=[int(b.ctypes.data) for b in kv], kv_data_lens=[b.nbytes for b in kv],
        kv_item_lens=[item] * len(kv), aux_data_ptrs=[int(aux[0].ctypes.data)],
        aux_data_lens=[aux[0].nbytes], aux_item_lens=[32], page_size=4, kv_head_num=2,
        total_kv_head_num=4, kv_cache_dtype_str="bfloat16", kv_layout="hnd",
        prefill_start_layer=6, num_draft_entries=0, state_data_ptrs=[])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_kv_args_become_shm_handles_with_derived_geometry() -> None:
    pool = ShmPool(1 << 16)
    try:
        reg = registration(_args(pool), False, read_maps())
        assert reg.num_layers == 2 and reg.layer_start == 6 and reg.head_dim == 8
        assert (reg.num_kv_heads, reg.total_kv_heads, reg.dtype_size) == (2, 4, 2)
        assert reg.layout == "HND" and not reg.is_mla
        assert {h.path for h in [*reg.kv_buffers, *reg.aux_buffers]} == {pool.path}
        offsets = [h.offset for h in reg.kv_buffers]
        assert offsets == sorted(offsets) and offsets[0] == 0
    finally:
        pool.close()


def test_unsupported_kv_args_are_refused_with_the_reason() -> None:
    pool = ShmPool(1 << 17)
    try:
        maps = read_maps()
        with pytest.raises(KVArgsError, match="draft KV buffers"):
            registration(_args(pool, num_draft_entries=2), False, maps)
        with pytest.raises(KVArgsError, match="state buffers"):
            registration(_args(pool, state_data_ptrs=[[1]]), False, maps)
        with pytest.raises(KVArgsError, match=r"state components mamba, swa: .* not together"):
            registration(_args(pool, state_data_ptrs=[[1, 2], [], [3]], state_types=[
                SimpleNamespace(value="mamba"), "dsa", "swa"]), False, maps)
        with pytest.raises(KVArgsError, match=r"state buffers of type dsa_tail \(the adapter"):
            registration(_args(pool, state_data_ptrs=[[1]], state_types=["dsa_tail"]), False,
                         maps)
        with pytest.raises(KVArgsError, match=r"state buffers \(state: "):
            registration(_args(pool, state_data_ptrs=[5, 6]), False, maps)  # an older flat list
        registration(_args(pool, state_data_ptrs=[[]], state_types=["mamba"]), False, maps)
        with pytest.raises(KVArgsError, match="whole layers"):
            args = _args(pool)
            args.kv_data_ptrs.pop()
            registration(args, False, maps)
        with pytest.raises(KVArgsError, match="vectorized_5d"):
            registration(_args(pool, kv_layout="vectorized_5d"), False, maps)
        private = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(KVArgsError, match=r"KV buffer: .* not in a file under /dev/shm"):
            args = _args(pool)
            args.kv_data_ptrs[1] = int(private.ctypes.data)
            registration(args, False, maps)
    finally:
        pool.close()
    assert dtype_size("torch.float16") == 2 and dtype_size("fp8_e4m3") == 1
    with pytest.raises(KVArgsError):
        dtype_size("complex128")


def test_transfer_backend_gains_kvd_and_keeps_every_member() -> None:
    class TransferBackend(Enum):
        MOONCAKE = "mooncake"
        NIXL = "nixl"

    extended = transfer_backend_with_kvd(TransferBackend)
    assert [(m.name, m.value) for m in extended] == [("MOONCAKE", "mooncake"),
                                                     ("NIXL", "nixl"), ("KVD", "kvd")]
    assert extended.__name__ == "TransferBackend" and transfer_backend_with_kvd(extended) \
        is extended
    assert is_kvd(extended("kvd")) and is_kvd("kvd") and not is_kvd(extended.NIXL)
    calls = []
    assert get_kv_class_around(lambda b, t: calls.append((b, t)) or "orig",
                               extended.NIXL, "manager") == "orig"
    assert calls == [(extended.NIXL, "manager")]


def test_unnamed_shared_memory_is_passed_as_descriptors() -> None:
    """A pool in a memfd (no /dev/shm name) becomes fd handles of the very file behind the
    mapping, at the right offsets; anonymous memory is still refused."""
    import os

    from kvd.client import FdPool
    from kvd.protocol.memory import FdHandle

    pool = FdPool(1 << 16)
    fds: dict[str, int] = {}
    try:
        args = _args(pool)  # type: ignore[arg-type]
        with pytest.raises(KVArgsError, match="not in a file under"):
            registration(args, False, read_maps())  # names only: refused
        reg = registration(args, False, read_maps(), fds=fds)
        handles = [*reg.kv_buffers, *reg.aux_buffers]
        assert all(isinstance(h, FdHandle) for h in handles) and len(fds) == 1
        pool.bytes[:] = np.arange(pool.nbytes, dtype=np.uint64).astype(np.uint8)
        for h, ptr in zip(handles, [*args.kv_data_ptrs, *args.aux_data_ptrs], strict=True):
            start = ptr - int(pool.bytes.ctypes.data)
            assert os.pread(h.fd, 64, h.offset) == pool.bytes[start:start + 64].tobytes()
        anon = np.zeros(4096, np.uint8)
        bad = _args(pool, kv_data_ptrs=[int(anon.ctypes.data)] * 4)
        with pytest.raises(KVArgsError, match="anonymous or private memory"):
            registration(bad, False, read_maps(), fds=fds)
    finally:
        for fd in fds.values():
            os.close(fd)
        pool.close()
