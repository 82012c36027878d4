"""kvd.client.ShmPool: the engine's /dev/shm file never outlives it for long: close(), the
last view, interpreter exit, and, for a killed owner, the next pool's sweep."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvd.client import ShmPool
from kvd.client.pool import PREFIX, owner_name, sweep_stale

REPO = Path(__file__).resolve().parents[3]


def _ns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def test_names_carry_the_owner() -> None:
    name = owner_name()
    assert name.startswith(f"{PREFIX}-{os.getpid()}-{_ns()}-")


def test_close_unlinks_and_close_keep_does_not(tmp_path: Path) -> None:
    pool = ShmPool(4096, shm_dir=str(tmp_path))
    view, handle = pool.alloc(100)
    view[:] = 7
    assert Path(handle.path).exists()
    pool.close()
    assert not Path(pool.path).exists()
    kept = ShmPool(4096, shm_dir=str(tmp_path))
    kept.close(unlink=False)
    assert Path(kept.path).exists()


def test_the_file_goes_with_the_last_view(tmp_path: Path) -> None:
    pool = ShmPool(4096, shm_dir=str(tmp_path))
    path = Path(pool.path)
    view, _ = pool.alloc(64)
    del pool
    gc.collect()
    assert path.exists()  # a view still maps it: the engine still uses the memory
    del view
    gc.collect()
    assert not path.exists()


_CHILD = textwrap.dedent("""
    import os, sys, time
    from kvd.client import ShmPool
    pool = ShmPool(4096, shm_dir=sys.argv[1])
    keep = ShmPool(4096, shm_dir=sys.argv[1])
    keep.close(unlink=False)
    print(pool.path, keep.path, flush=True)
    if sys.argv[2] == "hang":
        time.sleep(60)
""")


def _child(shm_dir: Path, how: str) -> tuple[subprocess.Popen[str], str, str]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(shm_dir), how], text=True,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    owned, kept = proc.stdout.readline().split()
    return proc, owned, kept


def test_an_engine_that_exits_without_close_leaves_nothing(tmp_path: Path) -> None:
    proc, owned, kept = _child(tmp_path, "exit")
    assert proc.wait(30) == 0
    assert not Path(owned).exists()
    assert Path(kept).exists()  # close(unlink=False): the caller took it over


def test_files_of_a_killed_engine_are_swept_by_the_next_pool(tmp_path: Path) -> None:
    proc, owned, _ = _child(tmp_path, "hang")
    assert sweep_stale(tmp_path) == []  # its owner runs
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert Path(owned).exists()
    other_ns = tmp_path / f"{PREFIX}-{proc.pid}-1-deadbeef"  # another container's pid
    other_ns.write_bytes(b"")
    unparsed = tmp_path / f"{PREFIX}-x-y-z"
    unparsed.write_bytes(b"")
    foreign = tmp_path / "someone-else-123-4-5"
    foreign.write_bytes(b"")
    pool = ShmPool(4096, shm_dir=str(tmp_path))
    try:
        assert not Path(owned).exists()
        assert other_ns.exists() and unparsed.exists() and foreign.exists()
    finally:
        pool.close()


def test_bad_sizes_and_names() -> None:
    with pytest.raises(ValueError):
        ShmPool(0)
    pool = ShmPool(4096)
    try:
        with pytest.raises(FileExistsError):
            ShmPool(4096, name=Path(pool.path).name)
        with pytest.raises(MemoryError):
            pool.alloc(8192)
    finally:
        pool.close()
