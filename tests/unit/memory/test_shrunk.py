"""kvd's own accesses to engine memory (aux slots over the control plane) go through the
file's descriptor, so an engine that shrinks its pool under kvd costs a HandleError,
never a SIGBUS (case S16). Each test truncates a file kvd has mapped: a load or store
through the mapping past the new end would kill this test process."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from kvd.errors import HandleError
from kvd.memory import Importer
from kvd.memory.host import HostBuffer
from kvd.protocol.memory import FdHandle, ShmHandle

PAGE = 4096


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


def _pool(shm: Path, size: int = 4 * PAGE) -> Path:
    f = shm / "pool"
    f.write_bytes(bytes(range(256)) * (size // 256))
    f.chmod(0o600)
    return f


def _aux(imp: Importer, f: Path) -> HostBuffer:
    """The last page of the pool: where an engine stand-in keeps its aux slots."""
    b = imp.engine_buffer(ShmHandle(str(f), 3 * PAGE, PAGE), [], os.getuid())
    assert isinstance(b, HostBuffer)
    return b


def test_reads_and_writes_through_the_descriptor_are_the_mapped_bytes(shm: Path) -> None:
    f = _pool(shm)
    b = _aux(Importer(shm), f)
    assert b.read(16, 32) == f.read_bytes()[3 * PAGE + 16:3 * PAGE + 48]
    b.write(100, b"S16 aux payload")
    assert ctypes.string_at(b.address + 100, 15) == b"S16 aux payload"  # same page cache
    assert f.read_bytes()[3 * PAGE + 100:3 * PAGE + 115] == b"S16 aux payload"
    b.release()


@pytest.mark.parametrize("size", [3 * PAGE, 3 * PAGE + 50, 0])
def test_s16_a_pool_shrunk_below_the_aux_slot_is_an_error_not_a_sigbus(
        shm: Path, size: int) -> None:
    f = _pool(shm)
    b = _aux(Importer(shm), f)
    os.truncate(f, size)  # the engine shrinks its pool after registering it
    with pytest.raises(HandleError, match="shrank under kvd"):
        b.read(64, 64)
    with pytest.raises(HandleError, match="shrank under kvd"):
        b.write(64, b"x" * 64)
    assert os.path.getsize(f) == size  # the refused write did not grow the file back
    if size > 3 * PAGE:  # the part still in the file is still readable
        assert b.read(0, 50) == bytes(range(50))
    b.release()


def test_s16_a_shrunk_fd_pool_is_an_error_too(shm: Path) -> None:
    f = _pool(shm)
    fd = os.open(f, os.O_RDWR)
    try:
        b = Importer(shm).engine_buffer(FdHandle(fd=0, offset=3 * PAGE, length=PAGE), [fd],
                                        os.getuid())
    finally:
        os.close(fd)
    os.truncate(f, PAGE)
    with pytest.raises(HandleError, match="shrank under kvd"):
        b.read(0, 8)
    b.release()


@pytest.mark.parametrize(("offset", "n"), [(-1, 4), (PAGE - 3, 4), (0, PAGE + 1)])
def test_accesses_outside_the_buffer_are_refused(shm: Path, offset: int, n: int) -> None:
    b = _aux(Importer(shm), _pool(shm))
    with pytest.raises(HandleError, match="outside this buffer"):
        b.read(offset, n)
    with pytest.raises(HandleError, match="outside this buffer"):
        b.write(offset, b"x" * max(n, 0))
    b.release()
    with pytest.raises(HandleError, match="released"):
        b.read(0, 1)
