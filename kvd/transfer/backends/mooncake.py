"""The ``mooncake`` transfer backend: the ONLY module that imports ``mooncake``.

:class:`MooncakeEngine` implements :class:`~kvd.transfer.backends.base.TransferEngine`
with the real engine (``P2PHANDSHAKE`` metadata: no etcd; ``tcp`` needs nothing,
``rdma`` an RDMA NIC). Mooncake's integer return codes become
:class:`~kvd.errors.TransportError` here. :class:`MooncakeOptions` carries the
settings (protocol, NICs, bind address, port range) and how each is applied
(docs/transfer.md, with the engine's source lines):

* listeners bind to ``bind_host``: the engine binds every interface itself, so its
  ``bind`` calls are pinned during ``initialize`` (:mod:`.bindaddr`);
* the advertised handshake port is kvd's (``handshake_front``, :mod:`.handshake`):
  Mooncake's single-threaded handshake listener is pinned to a loopback address behind
  it and only sees complete requests (S05);
* ports come from ``port_range`` via ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``, read
  once per process when the engine's global configuration loads;
* the TCP transport's per-peer connection pool (``MC_TCP_ENABLE_CONNECTION_POOL``, four
  lanes per peer) is off unless ``tcp_pool``: nothing in Mooncake 0.3.13.post1 closes a
  departed peer's lanes (the binding has no call for it, the C++
  ``TransferEngine::closeSegment`` returns 0 and does nothing, the pool's group
  retirement is private and runs only when a session's data port or instance changes),
  so every decode that went away left four sockets in CLOSE-WAIT for the life of the
  daemon (K39); without the pool a transfer's connections close when it completes (see
  :func:`native_env`);
* the listeners the engine opens take the kernel's largest accept backlog
  (``net.core.somaxconn``) instead of Mooncake's 128 (:func:`widen_backlogs`): without
  the pool every write dials the peer's data port, and a burst of rooms overflowed the
  accept queue of a decode, whose kernel dropped the SYNs and the prefill's kernel
  resent them after 1 s (K39's cost, P4);
* ``rdma`` with ``devices`` (a NIC filter) or ``[]`` (topology discovery);
  asking for RDMA where ``/sys/class/infiniband`` lists no NIC is refused up front.

Facts this module relies on (measured on the CPU machines, see design.md):
one batch call accepts at most 1024 queued + 1024 waiting entries per peer, so
writes are split into sub-batches of ``max_batch_entries`` (<= 1024); a refused
sub-batch may have partly landed, and a retry rewrites the same bytes, which
is idempotent.

A decode that restarts on the same transfer session name (its configured handshake port)
is a new instance behind an old name: the engine caches each session's segment
descriptor (its data port and buffers) for ever, so writes would still dial the dead
instance. :meth:`MooncakeEngine.renew_session` re-reads the descriptor from the new
instance (:class:`SegmentCacheSync`: the C++ ``TransferEngine::syncSegmentCache``, which
the binding does not expose; called through ``ctypes`` after checking the version and
the symbol, falling back to doing nothing with a warning; K39).

Writes are driven without spinning (:class:`~kvd.transfer.pump.WritePump`): each
descriptor is one non-blocking ``transfer_submit_write``, polled with
``transfer_check_status`` from one thread for every destination, with at most
``per_peer_inflight`` entries and, beyond the first ``per_peer_min_entries``, at most
``per_peer_bytes`` bytes in flight per destination. The batch calls
(``batch_transfer_sync_write``) busy-wait a core per caller and keep one batch in
flight; they are not used. ``batch_transfer_async_write`` submits a batch without
waiting (one native call for N entries: 1.3-2.3 us of submitting per 12 KiB entry
against 6-17 us one by one, measured in process, docs/performance.md P1), but the
binding has no status call for a whole batch that does not spin
(``get_batch_transfer_status`` loops until every listed batch ended), and
``transfer_check_status`` reads a batch's first entry only and frees the batch once that
entry ended, while the others may still be in flight: a batch could neither be waited
out nor retried entry by entry, so entries go one by one.
:meth:`MooncakeEngine.start_write` returns at once and calls back;
:meth:`MooncakeEngine.write` blocks on the same path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from kvd.addr import format_host
from kvd.errors import TransportError
from kvd.transfer.backends.base import CancelToken
from kvd.transfer.backends.bindaddr import pinned_binds
from kvd.transfer.backends.handshake import HandshakeFront, Reservation
from kvd.transfer.plan import Descriptors
from kvd.transfer.pump import DEFAULT_INFLIGHT_BYTES, DEFAULT_MIN_ENTRIES, Done, WritePump

RDMA_SYSFS = Path("/sys/class/infiniband")
#: The Mooncake distributions that provide the ``mooncake`` module (install exactly one).
BUILDS = {"mooncake-transfer-engine-non-cuda": "cpu", "mooncake-transfer-engine": "cuda12",
          "mooncake-transfer-engine-cuda13": "cuda13"}


@dataclass(frozen=True)
class MooncakeOptions:
    """How to start the engine. ``host``: the address peers reach (advertised);
    ``bind_host``: where its listeners bind (None: ``host``; ``0.0.0.0``: every
    interface, Mooncake's own behaviour); ``protocol``: ``tcp`` or ``rdma``; ``devices``:
    RDMA NIC names, ``[]`` = topology discovery; ``port_range``: (first, last) for both
    listeners, None = Mooncake's default 15000-17000; ``handshake_front``: serve the
    advertised handshake port from kvd (:mod:`.handshake`; not with a wildcard
    ``bind_host``); ``tcp_pool``: keep Mooncake's per-peer TCP connection pool (see
    :func:`native_env`)."""

    host: str
    bind_host: str | None = None
    protocol: str = "tcp"
    devices: list[str] = field(default_factory=list)
    port_range: tuple[int, int] | None = None
    handshake_front: bool = True
    tcp_pool: bool = False


def native_env(opts: MooncakeOptions) -> dict[str, str]:
    """The environment the native engine reads its configuration from (once per process,
    when it first loads): the port range, and the TCP connection pool -- off unless
    ``tcp_pool``, so that no socket outlives the transfer that opened it (K39). PURE."""
    env = {"MC_TCP_ENABLE_CONNECTION_POOL": "1" if opts.tcp_pool else "0"}
    if opts.port_range is not None:
        env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"] = map(str, opts.port_range)
    return env


def rdma_devices() -> dict[str, str]:
    """RDMA device name -> state of port 1 (``/sys/class/infiniband``)."""
    if not RDMA_SYSFS.is_dir():
        return {}
    out = {}
    for dev in sorted(RDMA_SYSFS.iterdir()):
        state = dev / "ports" / "1" / "state"
        out[dev.name] = state.read_text().strip() if state.exists() else "unknown"
    return out


def check_rdma(devices: list[str]) -> None:
    """Raise :class:`TransportError` unless RDMA can start: a NIC exists, and every NIC
    named in ``devices`` exists."""
    present = rdma_devices()
    if not present:
        raise TransportError("transfer_protocol = rdma but this machine has no RDMA device "
                             f"({RDMA_SYSFS} is empty or missing): install the NIC driver and "
                             "rdma-core, or use transfer_protocol = tcp")
    missing = [d for d in devices if d not in present]
    if missing:
        raise TransportError(f"transfer_devices names {', '.join(missing)}, which this machine "
                             f"does not have (it has {', '.join(present)})")


def build_info() -> dict[str, str]:
    """Which Mooncake build is installed: ``{"dist", "version", "flavour", "cuda"}``
    (empty dict if none); ``flavour`` is cpu, cuda12 or cuda13."""
    dists = [d for d in metadata.packages_distributions().get("mooncake", []) if d in BUILDS]
    if not dists:
        return {}
    info = {"dist": ", ".join(dists), "version": metadata.version(dists[0]),
            "flavour": BUILDS[dists[0]]}
    if len(dists) > 1:
        info["problem"] = "more than one Mooncake build installed: they overwrite each other"
    try:
        from mooncake import engine as native

        info["cuda"] = str(bool(getattr(native, "SUPPORT_CUDA", False)))
    except ImportError as exc:
        info["problem"] = f"cannot import mooncake.engine: {exc}"
    return info

log = logging.getLogger(__name__)

SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def _socket_fds() -> dict[int, int]:
    """This process's socket file descriptors: inode -> fd (``/proc/self/fd``; empty where
    there is no ``/proc``)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(name)
    return out


def _tcp_listener(fd: int, inode: int) -> socket.socket | None:
    """A duplicate of ``fd`` if it still is socket ``inode`` and a listening TCP socket
    (the caller closes it; closing the duplicate leaves the original open)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino == inode:
            sock = socket.socket(fileno=dup)
            if (sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET,
                                                                     socket.AF_INET6)
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                return sock
            sock.close()
            return None
    except OSError:
        pass
    os.close(dup)
    return None


def widen_backlogs(before: set[int], backlog: int | None = None) -> list[int]:
    """Give every listening TCP socket of this process whose inode is not in ``before``
    (the socket inodes that existed before the engine started: :func:`_socket_fds`) an
    accept backlog of ``backlog`` connections (default: ``net.core.somaxconn``, the
    kernel's cap; 4096 if unreadable). Returns the ports changed.

    ``listen()`` on a listening socket only sets its backlog (Linux); the socket is
    reached through a duplicate of its descriptor (checked to be the same inode), so no
    descriptor of the engine is closed or replaced and the engine's state is untouched.
    Why: Mooncake listens with a backlog of 128; with the TCP pool off every write opens
    a connection, and a burst of 1-page rooms overflowed a decode's accept queue: the
    dropped SYNs were resent after the kernel's 1 s timeout and whole rounds of rooms
    waited 1 s (K39's cost, docs/performance.md)."""
    if backlog is None:
        try:
            backlog = int(SOMAXCONN.read_text())
        except (OSError, ValueError):
            backlog = 4096
    ports = []
    for inode, fd in _socket_fds().items():
        if inode in before:
            continue
        sock = _tcp_listener(fd, inode)
        if sock is None:
            continue
        with sock:
            try:
                sock.listen(backlog)
                ports.append(int(sock.getsockname()[1]))
            except OSError as exc:
                log.warning("could not widen the accept backlog of %s: %s",
                            sock.getsockname(), exc)
    return sorted(ports)


#: ``mooncake::TransferEngine::syncSegmentCache(std::string const&)`` (Itanium C++ ABI,
#: libstdc++'s ``std::__cxx11::string``): a public, non-virtual member of the C++ engine.
SYNC_SYMBOL = ("_ZN8mooncake14TransferEngine16syncSegmentCacheERKNSt7__cxx1112basic_string"
               "IcSt11char_traitsIcESaIcEEE")
#: Mooncake versions whose ``syncSegmentCache`` kvd has read and tested (P2P handshake
#: mode: for each cached segment of that name it fetches the descriptor again over the
#: handshake and, if it changed, replaces it under the same segment id, which the
#: binding's name -> id map keeps using; a failed fetch keeps the old one). Any other
#: version: :meth:`MooncakeEngine.renew_session` does nothing, with a warning.
SYNC_VERSIONS = frozenset({"0.3.13.post1"})


class _CxxString(ctypes.Structure):
    """libstdc++'s ``std::__cxx11::string`` on LP64 Linux: data pointer, length, then
    16 bytes that hold short strings or the heap capacity. Built by hand only to be passed
    by const reference (read, never resized or freed by the callee)."""

    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t),
                ("capacity", ctypes.c_size_t), ("_pad", ctypes.c_size_t)]


def cxx_string(text: bytes) -> tuple[_CxxString, ctypes.Array[ctypes.c_char]]:
    """A ``std::string const&`` argument for ``text`` and the buffer that must outlive the
    call (heap form: data points at the buffer, capacity = length; NUL-terminated)."""
    buf = ctypes.create_string_buffer(text, len(text) + 1)
    return _CxxString(ctypes.addressof(buf), len(text), len(text), 0), buf


class SegmentCacheSync:
    """Calls ``syncSegmentCache(name)`` on the C++ engine behind a Python
    ``TransferEngine`` (``get_engine_ptr()``). :meth:`of` returns None, with the reason
    logged, unless: the installed version is one of :data:`SYNC_VERSIONS`; the platform is
    64-bit Linux (the string layout); the binding has ``get_engine_ptr``; and the already
    loaded ``engine.so`` exports :data:`SYNC_SYMBOL`. Blocking (one handshake round trip
    to the peer): never call it on the event loop."""

    def __init__(self, fn: Callable[[int, Any], int], engine_ptr: int) -> None:
        self._fn, self._engine = fn, engine_ptr

    @classmethod
    def of(cls, native: Any, version: str) -> SegmentCacheSync | None:
        problem = None
        if version not in SYNC_VERSIONS:
            problem = f"Mooncake {version or '(unknown version)'} is not one kvd has checked"
        elif platform.system() != "Linux" or ctypes.sizeof(ctypes.c_void_p) != 8:
            problem = "not 64-bit Linux"
        elif not callable(getattr(native, "get_engine_ptr", None)):
            problem = "the binding has no get_engine_ptr"
        if problem is None:
            try:
                from mooncake import engine as module

                lib = ctypes.CDLL(module.__file__, mode=os.RTLD_NOLOAD)
                fn = getattr(lib, SYNC_SYMBOL)
                ptr = int(native.get_engine_ptr())
            except (OSError, AttributeError, ImportError, TypeError, ValueError) as exc:
                problem = f"syncSegmentCache is not reachable: {exc}"
            else:
                if ptr == 0:
                    problem = "get_engine_ptr() is null"
        if problem is not None:
            log.warning("a decode restarted on a known transfer session name may not be "
                        "reachable until this daemon restarts: %s", problem)
            return None
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.POINTER(_CxxString)], ctypes.c_int
        return cls(fn, ptr)

    def __call__(self, session: str) -> int:
        arg, buf = cxx_string(session.encode())
        rc = int(self._fn(self._engine, ctypes.byref(arg)))
        del buf  # kept alive through the call
        return rc


#: ``transfer_submit_write`` returns ``(batch_id_t)-1`` (a u64) when it refuses.
_REFUSED_IDS = 1 << 63


class MooncakeEngine:
    """A real Mooncake Transfer Engine, TCP transport, P2P handshake.

    Create one per daemon and keep it: destroying an engine takes about 1 s.
    ``max_batch_entries`` is the sub-batch size the fault hook counts in (<= 1024,
    the TCP transport's per-peer queue); ``per_peer_inflight`` bounds the entries in
    flight per destination and ``per_peer_bytes`` their bytes beyond the first
    ``per_peer_min_entries`` entries, which always may go (K43, see the pump). A refused
    entry (a full queue answers like a dead peer) is retried with backoff from
    ``retry_backoff`` doubling up to 50 ms, for at most ``retry_budget`` seconds and never
    past the caller's deadline.
    ``submit_hook`` (fault injection, tests only) may force a sub-batch's rc.
    """

    def __init__(self, host: str | MooncakeOptions, max_batch_entries: int = 512,
                 retry_budget: float = 1.0, retry_backoff: float = 0.001,
                 submit_hook: Callable[[str, int, int], int | None] | None = None,
                 per_peer_inflight: int = 256, per_peer_bytes: int = DEFAULT_INFLIGHT_BYTES,
                 per_peer_min_entries: int = DEFAULT_MIN_ENTRIES) -> None:
        opts = host if isinstance(host, MooncakeOptions) else MooncakeOptions(host)
        self.options = opts
        if opts.protocol == "rdma":
            check_rdma(opts.devices)
        self.front: HandshakeFront | None = None
        self._native = self._start(opts)
        self._session_id = f"{format_host(opts.host)}:{self._native.get_rpc_port()}"
        self._sync = SegmentCacheSync.of(self._native, build_info().get("version", ""))
        self.max_batch_entries = max_batch_entries
        self.retry_budget = retry_budget
        self.retry_backoff = retry_backoff
        self.submit_hook = submit_hook
        timeout = max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30") or 30))
        self.pump = WritePump(self._submit_one, self._native.transfer_check_status,
                              per_peer=per_peer_inflight, batch_entries=max_batch_entries,
                              retry_budget=retry_budget, retry_backoff=retry_backoff,
                              timeout_s=float(timeout), hook=submit_hook,
                              per_peer_bytes=per_peer_bytes,
                              min_entries=per_peer_min_entries)

    @property
    def retried(self) -> int:
        """Refused or failed submissions that were retried."""
        return self.pump.retried

    def _submit_one(self, peer: str, src: int, dst: int, length: int) -> int:
        bid = int(self._native.transfer_submit_write(peer, src, dst, length))
        return -1 if bid == 0 or bid >= _REFUSED_IDS else bid

    def _start(self, opts: MooncakeOptions) -> Any:
        os.environ.setdefault("GLOG_minloglevel", "1")
        os.environ.update(native_env(opts))  # read once, when the engine's config loads
        try:
            from mooncake.engine import TransferEngine as _Native
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise TransportError(
                "the Mooncake transfer engine is not installed: pip install "
                "'kvd[cpu]' (mooncake-transfer-engine-non-cuda), 'kvd[cuda]' (CUDA 12) or "
                "'kvd[cuda13]'") from exc
        native = _Native()
        bind = opts.bind_host or opts.host
        devices = ",".join(opts.devices)
        host = format_host(opts.host)
        reservation = None
        before = set(_socket_fds())
        if bind in ("0.0.0.0", ""):
            rc = native.initialize(host, "P2PHANDSHAKE", opts.protocol, devices)
        else:
            reservation = Reservation(bind, bind) if opts.handshake_front else None
            with pinned_binds(reservation or bind, "mooncake") as patched:
                if not patched:
                    log.warning("could not pin the transfer engine's listeners to %s: they "
                                "listen on every interface (see kvd doctor)", bind)
                rc = native.initialize(host, "P2PHANDSHAKE", opts.protocol, devices)
        if rc != 0:
            if reservation is not None:
                reservation.release()
            hint = (f" (are the ports of transfer_port_range {opts.port_range[0]}-"
                    f"{opts.port_range[1]} in use? After a restart they can stay in "
                    f"TIME_WAIT for up to 60 s: wait, or widen the range)"
                    if opts.port_range is not None else "")
            raise TransportError(f"transfer engine initialize({opts.host}, {opts.protocol}, "
                                 f"devices={devices or 'auto'}) failed: rc={rc}{hint}", rc)
        widened = widen_backlogs(before)
        log.debug("transfer engine listeners %s: accept backlog widened", widened)
        port = int(native.get_rpc_port())
        problem = None
        if opts.port_range is not None and not opts.port_range[0] <= port <= opts.port_range[1]:
            problem = (f"the transfer engine took port {port}, outside transfer_port_range "
                       f"{opts.port_range[0]}-{opts.port_range[1]}: another engine in this "
                       f"process loaded Mooncake's configuration first")
        elif reservation is not None and reservation.sock is not None:
            problem = reservation.check(port)
            if problem is not None:
                problem += "; set transfer_handshake_front = false to run without it " \
                           "(S05 unmitigated)"
        if problem is not None:
            if reservation is not None:
                reservation.release()
            raise TransportError(problem)
        if reservation is not None and reservation.sock is not None:
            self.front = HandshakeFront(reservation.sock, (reservation.backend, port))
            self.front.start()
        return native

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, addr: int, length: int, device: str = "cpu",
                 stable: bool = False) -> None:
        location = device if device.startswith("cuda") else "*"  # "*": the engine finds it
        rc = self._native.register_memory(addr, length, location)
        if rc != 0:
            raise TransportError(f"register_memory({addr:#x}, {length}) failed: rc={rc}", rc)

    def unregister(self, addr: int) -> None:
        rc = self._native.unregister_memory(addr)
        if rc != 0:
            raise TransportError(f"unregister_memory({addr:#x}) failed: rc={rc}", rc)

    def can_start(self, peer_session: str) -> bool:
        return True

    def renew_session(self, peer_session: str) -> None:
        """The peer behind ``peer_session`` is a new instance (a decode restarted on the
        same handshake port): re-read its segment descriptor, so the next write dials the
        new instance's data port and buffers (K39). Blocking (a handshake round trip);
        nothing happens for a session never written to, or where :class:`SegmentCacheSync`
        is unavailable (then writes may fail as before: logged once at start)."""
        if self._sync is None:
            return
        rc = self._sync(peer_session)
        if rc != 0:
            log.warning("renewing transfer session %s: syncSegmentCache rc=%d", peer_session,
                        rc)

    def start_write(self, peer_session: str, desc: Descriptors, deadline: float | None,
                    done: Done, cancel: CancelToken | None = None) -> None:
        """Start writing ``desc``; ``done(error)`` is called once from the pump thread,
        when every submitted entry returned (error: a TransportError, or None; entries
        not submitted when ``cancel`` is cancelled are dropped: WriteCancelled)."""
        self.pump.start(peer_session, desc, deadline, done, cancel)

    def write(self, peer_session: str, desc: Descriptors, deadline: float | None = None) -> None:
        if len(desc) == 0:
            return
        finished = threading.Event()
        result: list[TransportError | None] = []

        def done(error: TransportError | None) -> None:
            result.append(error)
            finished.set()

        self.start_write(peer_session, desc, deadline, done)
        finished.wait()
        if result[0] is not None:
            raise result[0]

    def close_writes(self, timeout: float | None = None) -> None:
        """Stop the pump (writes not started fail; those in flight get ``timeout`` s)."""
        self.pump.close(timeout)
