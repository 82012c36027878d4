"""Memory given by the engine, on real daemons: files opened safely (S10), per-buffer aux
bounds (S07), transactional registration (S12), only described regions registered with
the transfer engine (S01). These use only APIs that existed before the memory rework,
so that they can be run against older code to show the failures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KvdClient, RegisterKV, ShmHandle, ShmPool
from kvd.errors import RegistrationError, RpcError
from kvd.launch import DaemonProcess, start_daemon

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon("decode", tmp_path_factory.mktemp("mem"))
    yield d
    d.stop()


def _reg(kv: list[ShmHandle], aux: list[ShmHandle], item: int = 4096,
         aux_item: int = 64) -> RegisterKV:
    return RegisterKV(kv_buffers=kv, kv_item_lens=[item] * len(kv), aux_buffers=aux,
                      aux_item_lens=[aux_item] * len(aux), page_size=16, num_kv_heads=2,
                      head_dim=64, dtype_size=2, num_layers=len(kv) // 2)


def _refused(client: KvdClient, reg: RegisterKV) -> str:
    with pytest.raises((RegistrationError, RpcError)) as info:
        client.call(reg)
    return str(info.value)


def _maps(daemon: DaemonProcess) -> str:
    return Path(f"/proc/{daemon.proc.pid}/maps").read_text()


def test_s10_symlink_in_shm_dir_is_not_followed(decode: DaemonProcess) -> None:
    other = ShmPool(1 << 16)  # e.g. another engine's pool: the link stays inside /dev/shm
    link = Path("/dev/shm") / f"kvd-test-link-{os.getpid()}"
    link.symlink_to(other.path)
    client = KvdClient(decode.socket)
    try:
        reason = _refused(client, _reg([ShmHandle(str(link), 0, 8192)] * 2, []))
        assert "symbolic link" in reason
        assert other.path not in _maps(decode)
    finally:
        link.unlink()
        client.close()
        other.close()


def test_s10_file_owned_by_another_user_is_refused(decode: DaemonProcess) -> None:
    pool = ShmPool(1 << 16)
    os.chown(pool.path, 4242, 4242)
    client = KvdClient(decode.socket)
    try:
        _, a = pool.alloc(8192)
        _, b = pool.alloc(8192)
        assert "owned by uid 4242" in _refused(client, _reg([a, b], []))
        assert pool.path not in _maps(decode)
    finally:
        client.close()
        pool.close()


def test_s07_aux_buffer_shorter_than_one_item_is_refused(decode: DaemonProcess) -> None:
    pool = ShmPool(1 << 16)
    client = KvdClient(decode.socket)
    try:
        kv = [pool.alloc(8192)[1] for _ in range(2)]
        _, aux = pool.alloc(32)  # aux_item_len 64: zero slots
        assert "shorter than one aux item" in _refused(client, _reg(kv, [aux]))
        assert pool.path not in _maps(decode)
    finally:
        client.close()
        pool.close()


def test_s12_failed_registration_leaves_nothing_mapped_or_registered(
        decode: DaemonProcess) -> None:
    first, good = ShmPool(1 << 16), ShmPool(1 << 16)
    client = KvdClient(decode.socket)
    try:
        kv = [first.alloc(8192)[1] for _ in range(2)]
        bad = ShmHandle(first.path, 0, 1 << 20)  # past the end of the file
        _refused(client, _reg([*kv, bad, bad], []))
        assert first.path not in _maps(decode)
        info = client.call(_reg([good.alloc(8192)[1] for _ in range(2)], []))
        assert info.num_pages == 2
        maps = _maps(decode)
        assert good.path in maps and first.path not in maps
    finally:
        client.close()  # the daemon releases this engine's registration
        first.close()
        good.close()


def test_s01_only_the_described_buffers_are_registered_with_the_transfer_engine(
        tmp_path: Path) -> None:
    from kvd.transfer.backends.mooncake import MooncakeEngine
    from kvd.transfer.plan import Descriptors

    daemon = start_daemon("decode", tmp_path)
    pool = ShmPool(4 << 20)  # 4 MiB file; the engine describes 16 KiB of it
    client = KvdClient(daemon.socket)
    attacker = MooncakeEngine("127.0.0.1", retry_budget=0.0)
    src = np.full(4096, 0xAB, dtype=np.uint8)
    try:
        kv = [pool.alloc(8192)[1] for _ in range(2)]
        session = client.call(_reg(kv, [])).session_id
        line = next(ln for ln in _maps(daemon).splitlines() if pool.path in ln)
        base = int(line.split("-")[0], 16)  # the daemon maps the whole file
        attacker.register(src.ctypes.data, src.nbytes)

        def write(offset: int) -> bool:
            desc = Descriptors(np.array([src.ctypes.data], dtype=np.uint64),
                               np.array([base + offset], dtype=np.uint64),
                               np.array([4096], dtype=np.uint64))
            try:
                attacker.write(session, desc)
                return True
            except Exception:
                return False

        assert write(kv[0].offset)  # positive control: inside a described buffer
        assert (pool.bytes[kv[0].offset:kv[0].offset + 4096] == 0xAB).all()
        assert not write(2 << 20)  # inside the file, outside every described buffer
        assert (pool.bytes[2 << 20:(2 << 20) + 4096] == 0).all()
    finally:
        client.close()
        daemon.stop()
        pool.close()
