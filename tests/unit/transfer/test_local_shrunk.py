"""Case S16 on the ``local`` backend: an engine truncates its pool file under kvd while a
same-host copy reads (prefill, source) or writes (decode, destination) it. The copy goes
through the kernel, so the write fails with a TransportError naming what is gone, and
the process lives. Each scenario runs in a child process (tests.helpers.local_shrink):
a regression would be a SIGBUS, which must not take pytest down with it."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd.errors import HandleError
from kvd.memory.hostcopy import copy_runs


def _run(folder: Path, side: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.local_shrink", str(folder),
                           side], capture_output=True, text=True, timeout=120)
    assert proc.returncode != -signal.SIGBUS, f"the copying process died of SIGBUS: {proc}"
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_s16_local_copy_from_a_truncated_source_is_an_error_not_a_sigbus(
        tmp_path: Path) -> None:
    out = _run(tmp_path / "peers", "source")
    assert out["first_ok"]  # the same copy landed byte for byte before the truncation
    assert "faulted" in out["error"] and "S16" in out["error"], out
    assert out["size"] == 0
    assert "KV buffer 0" in out["lost"] and "now ends at byte 0" in out["lost"], out


def test_s16_local_copy_into_a_truncated_destination_is_an_error_and_names_it(
        tmp_path: Path) -> None:
    out = _run(tmp_path / "peers", "destination")
    assert out["first_ok"]
    assert "the peer's buffer 0" in out["error"] and "now ends at byte 4096" in out["error"]
    assert out["size"] == 4096  # nothing was written through a descriptor: not grown back
    assert out["lost"] == ""  # the prefill's own memory still stands


def _file(size: int) -> tuple[int, mmap.mmap, int]:
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    return fd, mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


@pytest.mark.parametrize("runs", [1, 3, 2500])  # 2500 runs: three calls of IOV_MAX
def test_copy_runs_copies_every_run_and_stops_at_a_truncated_one(runs: int) -> None:
    page = 4096
    size = runs * page
    sfd, smm, src = _file(size)
    dfd, dmm, dst = _file(size)
    data = np.random.default_rng(runs).integers(0, 256, size, dtype=np.uint8)
    smm[:] = data.tobytes()
    order = np.random.default_rng(0).permutation(runs).astype(np.uint64)
    srcs = np.uint64(src) + np.arange(runs, dtype=np.uint64) * np.uint64(page)
    dsts = np.uint64(dst) + order * np.uint64(page)
    lens = np.full(runs, page, dtype=np.uint64)
    copy_runs(dsts, srcs, lens)
    got = np.frombuffer(dmm, dtype=np.uint8).reshape(runs, page)
    assert np.array_equal(got[order.astype(np.int64)], data.reshape(runs, page))
    del got
    os.ftruncate(dfd, 0)  # every destination run is beyond the file's end now
    with pytest.raises(HandleError, match="faulted"):
        copy_runs(dsts, srcs, lens)
    assert os.fstat(dfd).st_size == 0  # not grown back
    for fd, mm in ((sfd, smm), (dfd, dmm)):
        mm.close()
        os.close(fd)
