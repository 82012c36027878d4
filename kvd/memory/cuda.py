"""GPU memory: the ONE module of kvd that imports the CUDA bindings (``cuda.bindings``).

Importing a :class:`~kvd.protocol.memory.CudaIpcHandle` (CUDA runtime API):

1. the GPU is found by UUID among the devices this process sees (ordinals differ
   between processes with different ``CUDA_VISIBLE_DEVICES``), and made current
   (``cudaSetDevice``: its primary context);
2. ``cudaIpcOpenMemHandle(handle, cudaIpcMemLazyEnablePeerAccess)`` maps the whole
   ``cudaMalloc`` segment; a handle is opened at most once per process (a second open
   fails: CUDA docs, ``cudaIpcOpenMemHandle``), so opens are shared and counted;
3. checks: the pointer lives on that device (``cudaPointerGetAttributes``) and
   ``offset + length`` fits in the segment (``cuMemGetAddressRange``);
4. release: ``cudaIpcCloseMemHandle`` with the last buffer of that handle.

Copies (the ``local`` backend): ``cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault)`` on a
stream of the destination's device (unified addressing finds both devices), peer
access enabled between the two devices when they differ and can; one synchronise per
batch.

Everything raises :class:`~kvd.errors.CudaUnavailable` on a machine without the
bindings, a driver or the device, and :class:`~kvd.errors.HandleError` for a bad handle.
The bindings are imported on first use only, so CPU-only daemons never load them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvd.errors import CudaUnavailable, HandleError, TransportError
from kvd.protocol.memory import CUDA_IPC_HANDLE_BYTES, CudaIpcHandle

_lock = threading.Lock()


def _runtime() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise CudaUnavailable(
            "cuda_ipc memory needs the CUDA bindings: pip install 'kvd[cuda]' (CUDA 12) or "
            "'kvd[cuda13]' (CUDA 13)") from exc
    return runtime


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _call(fn: Any, *args: Any) -> tuple[Any, ...]:
    """Call a binding; a missing driver library becomes :class:`CudaUnavailable`."""
    try:
        out = fn(*args)
    except Exception as exc:  # the bindings raise plain RuntimeErrors without a driver
        raise CudaUnavailable(f"no usable CUDA driver on this machine: {exc}") from exc
    return out if isinstance(out, tuple) else (out,)


def _ok(err: Any, what: str) -> None:
    rt = _runtime()
    if err != rt.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        if name in ("cudaErrorNoDevice", "cudaErrorInsufficientDriver",
                    "cudaErrorNotSupported", "cudaErrorSystemNotReady"):
            raise CudaUnavailable(f"{what}: {name} (no usable CUDA device on this machine)")
        raise HandleError(f"{what}: {name}")


def format_uuid(raw: bytes) -> str:
    """16 raw UUID bytes -> ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi's form)."""
    h = bytes(raw)[:16].hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def device_count() -> int:
    """CUDA devices this process sees (0 without a driver or bindings)."""
    try:
        err, n = _call(_runtime().cudaGetDeviceCount)
    except CudaUnavailable:
        return 0
    return int(n) if err == _runtime().cudaError_t.cudaSuccess else 0


def device_of(uuid: str) -> int:
    """The ordinal of the GPU named ``uuid`` in this process; raises CudaUnavailable."""
    rt = _runtime()
    err, n = _call(rt.cudaGetDeviceCount)
    _ok(err, "cudaGetDeviceCount")
    seen = []
    for i in range(int(n)):
        err, props = _call(rt.cudaGetDeviceProperties, i)
        _ok(err, f"cudaGetDeviceProperties({i})")
        seen.append(format_uuid(bytes(props.uuid.bytes)))
        if seen[-1].lower() == uuid.lower():
            return i
    raise CudaUnavailable(f"GPU {uuid} is not visible to this process (sees {seen or 'none'};"
                          f" check CUDA_VISIBLE_DEVICES)")


@dataclass
class _Opened:
    ptr: int
    size: int
    device: int
    refs: int = 0


@dataclass
class CudaBuffer:
    """``length`` bytes of GPU memory at device pointer ``address`` on ``device_index``."""

    handle: CudaIpcHandle
    address: int
    length: int
    device_index: int
    owner: CudaImports
    released: bool = False

    @property
    def device(self) -> str:
        return f"cuda:{self.device_index}"

    @property
    def host_addressable(self) -> bool:
        return False

    @property
    def stable(self) -> bool:
        """Not host memory: the host copy rules (S16) do not apply."""
        return False

    def export(self) -> CudaIpcHandle:
        """The engine's own handle: another process opens the same segment."""
        return self.handle

    def read(self, offset: int, n: int) -> bytes:
        """Not host addressable: raises :class:`HandleError` (aux over the control plane
        needs host aux buffers)."""
        raise HandleError(f"{self.device} memory is not host addressable: kvd cannot read "
                          f"it over the control plane")

    def write(self, offset: int, data: bytes) -> None:
        """Not host addressable: raises :class:`HandleError`."""
        raise HandleError(f"{self.device} memory is not host addressable: kvd cannot write "
                          f"it over the control plane")

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner.unref(self.handle.handle)


@dataclass
class CudaImports:
    """The IPC handles this process opened, by handle bytes (each opened once)."""

    opened: dict[bytes, _Opened] = field(default_factory=dict)

    def buffer(self, h: CudaIpcHandle) -> CudaBuffer:
        """Open (or share) ``h``'s segment; raises HandleError / CudaUnavailable."""
        if len(h.handle) != CUDA_IPC_HANDLE_BYTES:
            raise HandleError(f"a CUDA IPC handle has {CUDA_IPC_HANDLE_BYTES} bytes, got "
                              f"{len(h.handle)}")
        if h.offset < 0 or h.length <= 0:
            raise HandleError(f"bad range offset={h.offset} length={h.length}")
        with _lock:
            seg = self.opened.get(h.handle) or self._open(h)
            if h.offset + h.length > seg.size:
                if seg.refs == 0:
                    self._close(h.handle, seg)
                raise HandleError(f"buffer [{h.offset}, +{h.length}) exceeds its CUDA "
                                  f"segment of {seg.size} bytes on {h.device_uuid}")
            seg.refs += 1
        return CudaBuffer(h, seg.ptr + h.offset, h.length, seg.device, self)

    def _open(self, h: CudaIpcHandle) -> _Opened:
        rt, drv = _runtime(), _driver()
        dev = device_of(h.device_uuid)
        _ok(_call(rt.cudaSetDevice, dev)[0], f"cudaSetDevice({dev})")
        mh = rt.cudaIpcMemHandle_t()
        mh.reserved = bytes(h.handle)
        err, ptr = _call(rt.cudaIpcOpenMemHandle, mh, rt.cudaIpcMemLazyEnablePeerAccess)
        _ok(err, f"cudaIpcOpenMemHandle on {h.device_uuid}")
        seg = _Opened(int(ptr), 0, dev)
        try:
            err, attrs = _call(rt.cudaPointerGetAttributes, int(ptr))
            _ok(err, "cudaPointerGetAttributes")
            if int(attrs.device) != dev:
                raise HandleError(f"the handle's memory is on device {attrs.device}, not on "
                                  f"{h.device_uuid} (device {dev})")
            res, _base, size = _call(drv.cuMemGetAddressRange, int(ptr))
            if res != drv.CUresult.CUDA_SUCCESS:
                raise HandleError(f"cuMemGetAddressRange: {res}")
            seg.size = int(size)
        except Exception:
            _call(rt.cudaIpcCloseMemHandle, int(ptr))
            raise
        self.opened[h.handle] = seg
        return seg

    def unref(self, key: bytes) -> None:
        with _lock:
            seg = self.opened.get(key)
            if seg is not None:
                seg.refs -= 1
                if seg.refs <= 0:
                    self._close(key, seg)

    def _close(self, key: bytes, seg: _Opened) -> None:
        self.opened.pop(key, None)
        rt = _runtime()
        _call(rt.cudaSetDevice, seg.device)
        _call(rt.cudaIpcCloseMemHandle, seg.ptr)


class CudaCopier:
    """Device-to-device copies for the ``local`` backend (one stream per device)."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._peers: set[tuple[int, int]] = set()

    def copy(self, runs: Iterable[tuple[int, int, int]], dst_device: int,
             src_device: int) -> None:
        """Copy every ``(dst, src, nbytes)`` run, then wait; raises TransportError."""
        rt = _runtime()
        _ok(_call(rt.cudaSetDevice, dst_device)[0], f"cudaSetDevice({dst_device})")
        self._enable_peer(dst_device, src_device)
        stream = self._stream(dst_device)
        kind = rt.cudaMemcpyKind.cudaMemcpyDefault
        for dst, src, n in runs:
            err = _call(rt.cudaMemcpyAsync, dst, src, n, kind, stream)[0]
            if err != rt.cudaError_t.cudaSuccess:
                raise TransportError(f"cudaMemcpyAsync({dst:#x}, {src:#x}, {n}): {err}")
        err = _call(rt.cudaStreamSynchronize, stream)[0]
        if err != rt.cudaError_t.cudaSuccess:
            raise TransportError(f"cudaStreamSynchronize: {err}")

    def _stream(self, dev: int) -> Any:
        if dev not in self._streams:
            err, stream = _call(_runtime().cudaStreamCreate)
            _ok(err, "cudaStreamCreate")
            self._streams[dev] = stream
        return self._streams[dev]

    def _enable_peer(self, dev: int, peer: int) -> None:
        if dev == peer or (dev, peer) in self._peers:
            return
        rt = _runtime()
        err, can = _call(rt.cudaDeviceCanAccessPeer, dev, peer)
        if err == rt.cudaError_t.cudaSuccess and can:
            err = _call(rt.cudaDeviceEnablePeerAccess, peer, 0)[0]
            if err not in (rt.cudaError_t.cudaSuccess,
                           rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
                raise TransportError(f"cudaDeviceEnablePeerAccess({dev} -> {peer}): {err}")
        self._peers.add((dev, peer))  # without peer access, copies are staged by the driver
