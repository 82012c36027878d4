"""kvd.memory: each handle kind imports through one interface; refusals are typed and
leave nothing mapped (S10, S12); CUDA without a driver is a clear error."""

from __future__ import annotations

import builtins
import ctypes
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest

from kvd.client import FdPool, ShmPool
from kvd.errors import CudaUnavailable, HandleError
from kvd.memory import Importer, import_engine
from kvd.memory import cuda as kcuda
from kvd.protocol.memory import CudaIpcHandle, FdHandle, PassedFdHandle, ShmHandle


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


def _file(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_shm_buffer_maps_the_engines_bytes(shm: Path) -> None:
    f = _file(shm / "pool", bytes(range(256)) * 16)
    imp = Importer(shm)
    b = imp.engine_buffer(ShmHandle(str(f), 256, 512), [], os.getuid())
    assert (b.length, b.device, b.host_addressable) == (512, "cpu", True)
    assert ctypes.string_at(b.address, 512) == f.read_bytes()[256:768]
    same = imp.engine_buffer(ShmHandle(str(f), 0, 64), [], os.getuid())
    assert len(imp.host.files) == 1  # one open file, shared
    assert same.address == b.address - 256
    b.release()
    same.release()
    assert imp.host.files == {}


def test_s10_symlink_to_a_file_is_refused(shm: Path, tmp_path: Path) -> None:
    secret = _file(tmp_path / "secret", b"x" * 4096)
    (shm / "pool").symlink_to(secret)
    with pytest.raises(HandleError, match="symbolic link"):
        Importer(shm).engine_buffer(ShmHandle(str(shm / "pool"), 0, 64), [], os.getuid())


def test_s10_symlinked_folder_inside_shm_dir_is_refused(shm: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    _file(outside / "pool", b"x" * 4096)
    (shm / "sub").symlink_to(outside)
    with pytest.raises(HandleError, match="symbolic link"):
        Importer(shm).engine_buffer(ShmHandle(str(shm / "sub" / "pool"), 0, 64), [], os.getuid())


@pytest.mark.parametrize("path", ["/etc/passwd", "relative/pool", "{shm}/../x", "{shm}"])
def test_s10_names_outside_shm_dir_are_refused(shm: Path, path: str) -> None:
    with pytest.raises(HandleError):
        Importer(shm).engine_buffer(ShmHandle(path.format(shm=shm), 0, 1), [], os.getuid())


def test_s10_file_of_another_user_is_refused(shm: Path) -> None:
    f = _file(shm / "pool", b"x" * 4096)
    with pytest.raises(HandleError, match="not by the engine"):
        Importer(shm).engine_buffer(ShmHandle(str(f), 0, 64), [], os.getuid() + 1)


@pytest.mark.parametrize(("mode", "match"), [(0o666, "writable by every user")])
def test_s10_world_writable_file_is_refused(shm: Path, mode: int, match: str) -> None:
    f = _file(shm / "pool", b"x" * 4096, mode)
    with pytest.raises(HandleError, match=match):
        Importer(shm).engine_buffer(ShmHandle(str(f), 0, 64), [], os.getuid())


def test_s10_fifo_and_empty_files_are_refused(shm: Path) -> None:
    os.mkfifo(shm / "fifo", 0o600)
    _file(shm / "empty", b"")
    imp = Importer(shm)
    with pytest.raises(HandleError, match="regular file"):
        imp.engine_buffer(ShmHandle(str(shm / "fifo"), 0, 1), [], os.getuid())
    with pytest.raises(HandleError, match="empty"):
        imp.engine_buffer(ShmHandle(str(shm / "empty"), 0, 1), [], os.getuid())


def test_range_past_the_end_is_refused_and_unmapped(shm: Path) -> None:
    f = _file(shm / "pool", b"x" * 4096)
    imp = Importer(shm)
    with pytest.raises(HandleError, match="outside"):
        imp.engine_buffer(ShmHandle(str(f), 4000, 97), [], os.getuid())
    assert imp.host.files == {}


def test_fd_pool_descriptor_is_imported() -> None:
    pool = FdPool(1 << 16)
    view, h = pool.alloc(4096)
    view[:] = np.arange(4096) % 251
    imp = Importer(Path("/dev/shm"))
    b = imp.engine_buffer(FdHandle(0, h.offset, h.length), [pool.fd], os.getuid())
    assert ctypes.string_at(b.address, 4096) == view.tobytes()
    ctypes.memset(b.address, 7, 16)  # same memory both ways
    assert view[:16].tolist() == [7] * 16
    b.release()
    pool.close()


def test_fd_read_only_or_unsealed_memfd_is_refused(tmp_path: Path) -> None:
    f = _file(tmp_path / "ro", b"x" * 4096)
    ro = os.open(f, os.O_RDONLY)
    loose = os.memfd_create("loose", os.MFD_ALLOW_SEALING)
    os.ftruncate(loose, 4096)
    imp = Importer(tmp_path)
    try:
        with pytest.raises(HandleError, match="read-write"):
            imp.engine_buffer(FdHandle(0, 0, 64), [ro], os.getuid())
        with pytest.raises(HandleError, match="F_SEAL_SHRINK"):
            imp.engine_buffer(FdHandle(0, 0, 64), [loose], os.getuid())
        fcntl.fcntl(loose, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        imp.engine_buffer(FdHandle(0, 0, 64), [loose], os.getuid()).release()
        with pytest.raises(HandleError, match="descriptor #1 of 1"):
            imp.engine_buffer(FdHandle(1, 0, 64), [loose], os.getuid())
    finally:
        os.close(ro)
        os.close(loose)


def test_s12_failed_import_leaves_nothing_mapped(shm: Path) -> None:
    good = _file(shm / "good", b"g" * 8192)
    (shm / "bad").symlink_to(good)
    imp = Importer(shm)
    with pytest.raises(HandleError):
        import_engine(imp, [ShmHandle(str(good), 0, 4096), ShmHandle(str(shm / "bad"), 0, 64)],
                      [], [], os.getuid())
    assert imp.host.files == {}


def test_s07_overlapping_buffers_refused_and_released(shm: Path) -> None:
    f = _file(shm / "pool", b"x" * 8192)
    imp = Importer(shm)
    with pytest.raises(HandleError, match="overlap"):
        import_engine(imp, [ShmHandle(str(f), 0, 4096)], [ShmHandle(str(f), 4000, 64)], [],
                      os.getuid())
    assert imp.host.files == {}


def test_passed_fd_region_names_only_a_position_among_the_passed_descriptors(shm: Path
                                                                           ) -> None:
    pool = ShmPool(4096, shm_dir=str(shm))
    fd = os.open(pool.path, os.O_RDWR)
    imp = Importer(shm)
    try:
        with pytest.raises(HandleError, match="descriptor #1 of 1"):
            imp.peer_buffer(PassedFdHandle(1, 0, 64), [fd])
        with pytest.raises(HandleError, match="outside"):
            imp.peer_buffer(PassedFdHandle(0, 4000, 4096), [fd])
        buf = imp.peer_buffer(PassedFdHandle(0, 64, 64), [fd])
        assert buf.length == 64
        buf.release()
    finally:
        os.close(fd)
        pool.close()


def test_cuda_handle_without_a_driver_is_a_clear_error() -> None:
    if kcuda.device_count():
        pytest.skip("a CUDA device is present: tests/gpu covers the real import")
    h = CudaIpcHandle(b"\0" * 64, 0, 4096, "GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(CudaUnavailable, match="CUDA"):
        Importer(Path("/dev/shm")).engine_buffer(h, [], os.getuid())


def test_cuda_handle_without_bindings_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_cuda(name: str, *args: object, **kw: object) -> object:
        if name.startswith("cuda"):
            raise ImportError("No module named 'cuda'")
        return real_import(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    h = CudaIpcHandle(b"\0" * 64, 0, 4096, "GPU-x")
    with pytest.raises(CudaUnavailable, match=r"kvd\[cuda\]"):
        Importer(Path("/dev/shm")).engine_buffer(h, [], os.getuid())


@pytest.mark.parametrize(("handle", "match"), [
    (CudaIpcHandle(b"\0" * 63, 0, 64, "GPU-x"), "64 bytes"),
    (CudaIpcHandle(b"\0" * 64, -1, 64, "GPU-x"), "bad range"),
    (CudaIpcHandle(b"\0" * 64, 0, 0, "GPU-x"), "bad range"),
])
def test_malformed_cuda_handles_are_refused_before_cuda(handle: CudaIpcHandle,
                                                        match: str) -> None:
    with pytest.raises(HandleError, match=match):
        Importer(Path("/dev/shm")).engine_buffer(handle, [], os.getuid())


def test_uuid_formatting_matches_nvidia_smi() -> None:
    assert kcuda.format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
