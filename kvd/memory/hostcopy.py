"""Copies between host mappings that an engine may shrink under kvd (case S16).

A load or store through a mapping past the end of its file kills the process with
``SIGBUS``; the same access made by the kernel on the process's behalf fails with
``EFAULT`` instead. :func:`copy_runs` therefore copies with ``process_vm_writev`` on this
process itself: the kernel reads each source run and writes each destination run, up to
``IOV_MAX`` (1024) runs per call, and a run that touches memory no longer backed by its
file ends the copy with a :class:`~kvd.errors.HandleError` naming the byte it stopped at.
Nothing is written through a descriptor, so no file grows back.

A kernel that refuses the call (``ENOSYS``, or ``EPERM`` under a seccomp profile that
filters it) falls back to ``memmove`` for the rest of the process's life, with one
warning: such a host is again exposed to S16 (seal pools, ``fd`` handles).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os

import numpy as np

from kvd.errors import HandleError

log = logging.getLogger("kvd.memory")

#: Most iovecs one ``process_vm_writev`` call takes on each side (Linux ``UIO_MAXIOV``).
IOV_MAX = 1024

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_pvw = _libc.process_vm_writev
_pvw.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                 ctypes.c_ulong, ctypes.c_ulong]
_pvw.restype = ctypes.c_ssize_t
_kernel_copy = True  # False once the kernel refused process_vm_writev


def copy_runs(dst: np.ndarray, src: np.ndarray, length: np.ndarray) -> None:
    """Copy ``length[i]`` bytes from address ``src[i]`` to address ``dst[i]`` of this
    process, for every ``i`` (uint64 arrays of one size; runs must not overlap). Raises
    :class:`HandleError` when a run touches memory that is not there any more (a file
    shrunk under its mapping: case S16); runs before it landed, later ones did not."""
    n = int(length.size)
    pid = os.getpid()
    for first in range(0, n, IOV_MAX):
        last = min(first + IOV_MAX, n)
        if not _kernel_copy:
            _memmove(dst[first:last], src[first:last], length[first:last])
            continue
        local, remote = _iovecs(src[first:last], length[first:last]), \
            _iovecs(dst[first:last], length[first:last])
        want = int(length[first:last].sum())
        got = _pvw(pid, local.ctypes.data, last - first, remote.ctypes.data, last - first, 0)
        if got == want:
            continue
        if got < 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _refused(ctypes.get_errno())
            _memmove(dst[first:last], src[first:last], length[first:last])
            continue
        raise _fault(got, ctypes.get_errno(), first, dst, src, length)


def _iovecs(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``struct iovec[]`` (base, length: two 64-bit words each) for the runs."""
    iov = np.empty((addr.size, 2), dtype=np.uint64)
    iov[:, 0], iov[:, 1] = addr, length
    return iov


def _memmove(dst: np.ndarray, src: np.ndarray, length: np.ndarray) -> None:
    for d, s, k in zip(dst.tolist(), src.tolist(), length.tolist(), strict=True):
        ctypes.memmove(d, s, k)


def _refused(err: int) -> None:
    global _kernel_copy
    _kernel_copy = False
    log.warning("process_vm_writev is refused here (%s): host copies go through the "
                "mapping; a pool shrunk under kvd kills it with SIGBUS (S16): seal pools "
                "(fd handles, kvd.client.FdPool)", os.strerror(err))


def _fault(got: int, err: int, first: int, dst: np.ndarray, src: np.ndarray,
           length: np.ndarray) -> HandleError:
    """The run a short copy stopped in, named with its addresses."""
    done = max(got, 0)
    ends = np.cumsum(length[first:first + IOV_MAX].astype(np.uint64))
    i = first + int(np.searchsorted(ends, done, side="right"))
    i = min(i, int(length.size) - 1)
    why = os.strerror(err) if got < 0 else f"stopped after {done} bytes"
    return HandleError(f"host copy of run {i} ([{int(src[i]):#x}, +{int(length[i])}) -> "
                       f"{int(dst[i]):#x}) faulted ({why}): memory behind one side is gone "
                       f"(a pool file shrunk under kvd, S16)")
