"""``kvd doctor``: can this machine run a kvd with these settings? Each check says what to fix.

Checks: the settings are valid; the cluster secret; with ``discovery = etcd``, the
store (reachable, credentials accepted, the cluster's prefix readable); which Mooncake build is
installed; which transfer backend, protocol and NICs are used and why; the
Mooncake transfer engine imports and initialises with those settings (in a
child process, so a crash or hang in the native library is reported, not
suffered); RDMA devices; the locked-memory limit RDMA registration needs; the
shared-memory folder; the configured ports are free; the engine socket (its
folder, its lock, any file at its path) and its group; and, when a kvd is
running on that socket, every port it listens on with its bind address (a
warning for any wider than the configured hosts) and its peers' clock offsets (a
warning past half the freshness window, a failure past it: K40).

:func:`refusals` is what ``kvd serve`` refuses before it starts; doctor reports
each of them as a failed check, so doctor fails whenever serve would.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import resource
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kvd import notify
from kvd.config import Settings, require_secret
from kvd.engine_rpc.socket_path import SocketPathError, lock_path, preflight
from kvd.errors import ConfigError, KvdError

GiB = 1 << 30
MIN_SHM = 1 * GiB
ENGINE_TIMEOUT = 30.0
RDMA_SYSFS = Path("/sys/class/infiniband")
MOONCAKE_FIX = ("install exactly one Mooncake build: pip install 'kvd[cpu]' "
                "(mooncake-transfer-engine-non-cuda) or 'kvd[cuda]'; and the Debian packages "
                "libibverbs1 librdmacm1 libnuma1")
_PROBE = ("import json, os, sys\n"
          "from kvd.transfer.backends.mooncake import MooncakeEngine, MooncakeOptions\n"
          "o = json.loads(sys.argv[1])\n"
          "o['port_range'] = tuple(o['port_range']) if o['port_range'] else None\n"
          "e = MooncakeEngine(MooncakeOptions(**o))\n"
          "print(e.session_id, flush=True)\n"
          "os._exit(0)  # skip the engine's ~1 s teardown\n")


@dataclass
class Check:
    """One result: ``status`` ok, warn or fail; ``fix`` says what to do about it."""

    name: str
    status: Literal["ok", "warn", "fail"]
    detail: str
    fix: str = ""


def run_checks(settings: Settings | None, config_error: KvdError | None = None,
               engine_probe: bool = True, config: Path | None = None) -> list[Check]:
    """Every check, in order. ``settings`` None means the config was invalid
    (``config_error`` says why); the checks then use the built-in defaults. ``config``:
    the file the settings came from (the running daemon's peers are read with its
    secret)."""
    s = settings or Settings.model_construct(role="decode")
    checks = [check_config(config_error)]
    if settings is not None:
        checks.append(check_secret(settings))
        if settings.discovery == "etcd":
            checks.append(check_etcd(settings))
    checks += [check_build(), check_transfer_settings(s)]
    if engine_probe and s.transfer_backend != "local":
        checks.append(check_transfer_engine(s))
    devices = rdma_devices()
    checks += [check_rdma(devices), check_memlock(bool(devices)), check_shm(s.shm_dir)]
    pid = daemon_pid(s.engine_socket)
    own = running_kvd(s.engine_socket, pid)
    checks += [check_port("http port", s.http_host, s.http_port, own),
               check_port("zmq port", s.host, s.zmq_port, own),
               check_socket(s.engine_socket, own)]
    if s.engine_socket_group:
        checks.append(check_group(s.engine_socket_group))
    if pid is not None:
        checks.append(check_listeners(pid, s))
        if settings is not None:
            checks.append(peer_clocks(settings, config))
    return checks


def peer_clocks(s: Settings, config: Path | None) -> Check:
    """The running daemon's peers' clock offsets (its ``/v1/status``), judged against its
    freshness window (:func:`check_peer_clocks`)."""
    from kvd.cli.client import get, resolve_addr

    try:
        addr = resolve_addr(None, config) if config is not None else \
            resolve_addr(f"{'127.0.0.1' if s.http_host in ('0.0.0.0', '') else s.http_host}"
                         f":{s.http_port}", None)
        rows = get(addr, "/v1/status", 3.0, config, failures=0)["peers"]
    except KvdError as exc:
        return Check("peer clocks", "warn", f"could not read the daemon's peers: {exc}",
                     "run kvd peers -a HOST:PORT with the cluster secret")
    return check_peer_clocks(rows, s.auth_max_skew)


def check_peer_clocks(rows: list[dict[str, Any]], window_s: float) -> Check:
    """Peers' clock offsets (``clock_offset_s`` of ``/v1/status`` peer rows, s) against
    the freshness window ``window_s``: beyond it their frames are refused (fail); past
    half of it a little more drift will be (warn). PURE."""
    known = [(r["endpoint"], float(r["clock_offset_s"])) for r in rows
             if r.get("clock_offset_s") is not None]
    if not known:
        return Check("peer clocks", "ok", "no peer clock measured yet")
    worst = max(known, key=lambda k: abs(k[1]))
    beyond = [f"{ep} {off:+.1f}s" for ep, off in known if abs(off) > window_s]
    detail = f"{len(known)} peer(s), largest offset {worst[1]:+.3f}s ({worst[0]})"
    fix = "synchronise the hosts' clocks (NTP, chrony); auth_max_skew is the window"
    if beyond:
        return Check("peer clocks", "fail", f"beyond the {window_s:.0f}s freshness window, "
                     f"their frames are refused: {', '.join(beyond)}", fix)
    if abs(worst[1]) > window_s / 2:
        return Check("peer clocks", "warn", f"{detail}: over half the {window_s:.0f}s "
                     f"freshness window", fix)
    return Check("peer clocks", "ok", detail)


def refusals(settings: Settings) -> list[KvdError]:
    """Why ``kvd serve`` would refuse to start with ``settings`` (empty: nothing known).

    No cluster secret (without ``insecure``) or an unreadable one; an engine socket
    path that cannot be used (skipped when systemd passes the socket); an
    ``engine_socket_group`` that does not exist.
    """
    out: list[KvdError] = []
    try:
        require_secret(settings)
    except ConfigError as exc:
        out.append(exc)
    if not notify.socket_activated():
        try:
            preflight(settings.engine_socket)
        except SocketPathError as exc:
            out.append(exc)
    if settings.engine_socket_group:
        try:
            grp.getgrnam(settings.engine_socket_group)
        except KeyError:
            out.append(ConfigError(f"engine_socket_group {settings.engine_socket_group!r} "
                                   f"does not exist"))
    return out


def as_dicts(checks: list[Check]) -> list[dict[str, Any]]:
    """JSON-shaped checks."""
    return [asdict(c) for c in checks]


def check_config(error: KvdError | None) -> Check:
    if error is None:
        return Check("config", "ok", "settings are valid")
    return Check("config", "fail", str(error).replace("\n", ";"),
                 "correct the settings listed (kvd config show -c FILE shows each source)")


def check_etcd(settings: Settings) -> Check:
    """discovery = etcd: the store answers, takes the credentials, and the cluster's
    prefix is readable (each request bounded by ``http_timeout``)."""
    import asyncio

    from kvd.discovery.etcd import probe
    from kvd.errors import DiscoveryAuthError, DiscoveryUnavailable

    try:
        return Check("etcd", "ok", asyncio.run(probe(settings)))
    except ConfigError as exc:
        return Check("etcd", "fail", str(exc), "fix etcd_password_file (chmod 600, first line)")
    except DiscoveryUnavailable as exc:
        return Check("etcd", "fail", str(exc), "start etcd, or correct etcd_endpoints (and "
                     "etcd_ca_file for https)")
    except DiscoveryAuthError as exc:
        return Check("etcd", "fail", str(exc), "set etcd_user and etcd_password_file to a "
                     "user with read-write access to etcd_prefix")
    except KvdError as exc:
        return Check("etcd", "fail", str(exc), "check etcd's log; etcd 3.4 or later is needed")


def check_secret(settings: Settings) -> Check:
    """The cluster secret is set and readable (or ``insecure`` is on, which warns)."""
    try:
        secret = require_secret(settings)
    except ConfigError as exc:
        path = settings.cluster_secret_file
        if path is not None and "open to group or others" in str(exc):
            return Check("cluster secret", "fail", str(exc), f"chmod 600 {path}")
        return Check("cluster secret", "fail", str(exc),
                     "kvd secret /etc/kvd/cluster.secret, then cluster_secret_file = "
                     "\"/etc/kvd/cluster.secret\" (the same file on every kvd)")
    if secret is None:
        return Check("cluster secret", "warn", "insecure = true: no authentication",
                     "use a cluster secret outside of tests (kvd secret FILE)")
    path = settings.cluster_secret_file
    if path is not None and settings.cluster_secret is None and path.stat().st_mode & 0o077:
        # only with cluster_secret_file_check = "warn": "refuse" failed above
        return Check("cluster secret", "warn", f"{path} is readable by other users "
                     f"(cluster_secret_file_check = warn)", f"chmod 600 {path}")
    where = f"from {path}" if settings.cluster_secret is None else "from the environment"
    return Check("cluster secret", "ok", f"{len(secret)} bytes {where}")


def check_group(name: str) -> Check:
    try:
        grp.getgrnam(name)
    except KeyError:
        return Check("engine socket group", "fail", f"group {name!r} does not exist",
                     f"groupadd {name}, or unset engine_socket_group")
    return Check("engine socket group", "ok", f"{name} may use the engine socket")


def check_build() -> Check:
    """Which Mooncake build provides ``mooncake`` (cpu, CUDA 12 or CUDA 13)."""
    from kvd.transfer.backends.mooncake import build_info

    info = build_info()
    if not info:
        return Check("mooncake build", "fail", "no Mooncake build is installed", MOONCAKE_FIX)
    detail = (f"{info['dist']} {info['version']} ({info['flavour']}; GPU memory: "
              f"{'yes' if info.get('cuda') == 'True' else 'no'})")
    if "problem" in info:
        return Check("mooncake build", "fail", f"{detail}: {info['problem']}", MOONCAKE_FIX)
    return Check("mooncake build", "ok", detail)


def check_transfer_settings(s: Settings) -> Check:
    """Backend, protocol, NICs, bind address and ports in use, and why; RDMA without a NIC
    fails here (the daemon would refuse to start)."""
    from kvd.config import effective_bind_host, transfer_devices
    from kvd.errors import TransportError
    from kvd.transfer.backends.mooncake import check_rdma

    devices = transfer_devices(s)
    if s.transfer_protocol == "tcp":
        nics = "NICs: n/a (tcp uses the kernel's routing)"
    elif devices:
        nics = f"NICs: {', '.join(devices)} (transfer_devices)"
    else:
        nics = (f"NICs: auto, the engine's topology discovery among "
                f"{', '.join(rdma_devices()) or 'none'}")
    ports = s.transfer_port_range or "15000-17000 (Mooncake's default)"
    front = s.transfer_handshake_front and effective_bind_host(s) != "0.0.0.0"
    detail = (f"backend {s.transfer_backend}; protocol {s.transfer_protocol}; {nics}; "
              f"listeners on {effective_bind_host(s)}, ports {ports}; handshake front "
              f"{'on' if front else 'off'}")
    if s.transfer_protocol == "rdma" and s.transfer_backend != "local":
        try:
            check_rdma(devices)
        except TransportError as exc:
            return Check("transfer settings", "fail", f"{detail}: {exc}",
                         "install the RDMA NIC driver and rdma-core, or set "
                         "transfer_protocol = tcp")
    if effective_bind_host(s) == "0.0.0.0":
        return Check("transfer settings", "warn", detail + " (every interface: the TCP "
                     "transport authenticates nobody)", "set transfer_bind_host to the "
                     "address peers use, and firewall the transfer ports (docs/transfer.md)")
    if not front:
        return Check("transfer settings", "warn", detail + " (idle connections to the "
                     "handshake port can stall transfers: S05)", "set transfer_handshake_front "
                     "= true and transfer_bind_host to the address peers use")
    return Check("transfer settings", "ok", detail)


def check_transfer_engine(s: Settings) -> Check:
    """Import and initialise the transfer engine with ``s`` in a child process."""
    from kvd.config import (
        effective_bind_host,
        effective_transfer_host,
        parse_port_range,
        transfer_devices,
    )

    host = effective_transfer_host(s)
    opts = {"host": host, "bind_host": effective_bind_host(s), "protocol": s.transfer_protocol,
            "devices": transfer_devices(s), "port_range": parse_port_range(
                s.transfer_port_range) if s.transfer_port_range else None,
            "handshake_front": s.transfer_handshake_front}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(opts)],
                              capture_output=True, text=True, timeout=ENGINE_TIMEOUT,
                              check=False)
    except subprocess.TimeoutExpired:
        return Check("transfer engine", "fail", f"initialising on {host} hung for "
                     f"{ENGINE_TIMEOUT:g}s", f"check that {host} is an address of this host")
    if proc.returncode == 0:
        return Check("transfer engine", "ok", f"mooncake initialised on {host} "
                     f"({s.transfer_protocol}, session {proc.stdout.strip()})")
    err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    last = err[-1] if err else f"exit code {proc.returncode}"
    fix = MOONCAKE_FIX if "not installed" in last or "ImportError" in last or ".so" in last \
        else f"check that host = {host} is an address of this host"
    return Check("transfer engine", "fail", last, fix)


def daemon_pid(path: Path) -> int | None:
    """Pid of the kvd serving the engine socket at ``path`` (``SO_PEERCRED``), if any."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        except OSError:
            return None
    return int.from_bytes(creds[:4], "little") or None


@dataclass(frozen=True)
class Running:
    """The kvd these settings describe, found running: ``pid`` serves the engine socket
    and holds its lock; ``ports`` are its listening TCP ports (empty if unreadable)."""

    pid: int
    ports: frozenset[int]


def running_kvd(path: Path, pid: int | None) -> Running | None:
    """The kvd serving ``path`` if ``pid`` (its ``SO_PEERCRED``) is also the pid in its
    ``<socket>.lock``: then the socket and its ports are that daemon's, not a conflict
    (``kvd doctor`` run beside the daemon it checks). None otherwise."""
    from kvd.netstat import listeners

    if pid is None:
        return None
    try:
        holder = int(lock_path(path).read_text().strip() or "0")
    except (OSError, ValueError):
        return None
    if holder != pid:
        return None
    try:
        ports = frozenset(x.port for x in listeners(pid))
    except OSError:
        ports = frozenset()
    return Running(pid, ports)


def check_listeners(pid: int, s: Settings) -> Check:
    """Every listening port of the running kvd ``pid`` with its bind address; warn about
    any wider than the configured hosts (S01)."""
    from kvd.config import effective_bind_host, effective_transfer_host
    from kvd.netstat import listeners, wider_than

    try:
        found = listeners(pid)
    except OSError as exc:
        return Check("listening ports", "warn", f"cannot read pid {pid}'s sockets: {exc}",
                     "run kvd doctor as the daemon's user")
    allowed = {s.host, s.http_host, s.bootstrap_host or s.http_host,
               effective_transfer_host(s), effective_bind_host(s)}
    detail = f"pid {pid}: " + ", ".join(map(str, found))
    wide = wider_than(found, allowed)
    if wide:
        return Check("listening ports", "warn", f"{detail}; wider than configured: "
                     f"{', '.join(map(str, wide))}",
                     "bind them to the configured host (transfer_bind_host) or firewall them "
                     "(docs/transfer.md lists each port)")
    return Check("listening ports", "ok", detail)


def rdma_devices() -> dict[str, str]:
    """RDMA device name -> state of port 1 (``/sys/class/infiniband``)."""
    if not RDMA_SYSFS.is_dir():
        return {}
    out = {}
    for dev in sorted(RDMA_SYSFS.iterdir()):
        state = dev / "ports" / "1" / "state"
        out[dev.name] = state.read_text().strip() if state.exists() else "unknown"
    return out


def check_rdma(devices: dict[str, str]) -> Check:
    if not devices:
        return Check("rdma devices", "warn", "none: only the TCP transport is available",
                     "for RDMA install the NIC driver and rdma-core (ibv_devices lists them); "
                     "TCP is fine for tests and single-host setups")
    listed = ", ".join(f"{k} ({v})" for k, v in devices.items())
    down = [k for k, v in devices.items() if "ACTIVE" not in v]
    if len(down) == len(devices):
        return Check("rdma devices", "warn", f"{listed}: no port is ACTIVE",
                     "check cabling and the subnet manager (ibstat)")
    return Check("rdma devices", "ok", listed)


def check_memlock(rdma: bool) -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock limit", "ok", "unlimited")
    detail = f"{soft // 1024} KiB"
    if not rdma:
        return Check("memlock limit", "ok", f"{detail} (only RDMA registration needs more)")
    return Check("memlock limit", "warn", f"{detail}: RDMA registration of a KV pool needs "
                 "locked memory as large as the pool",
                 "LimitMEMLOCK=infinity in the systemd unit, ulimit -l unlimited, or the "
                 "IPC_LOCK capability in Kubernetes")


def check_shm(path: Path) -> Check:
    if not path.is_dir():
        return Check("shared memory", "fail", f"{path} does not exist",
                     "set shm_dir to the folder where the engine creates its KV pool files")
    if not os.access(path, os.R_OK | os.X_OK):
        return Check("shared memory", "fail", f"{path} is not readable by uid {os.getuid()}",
                     "run kvd as the engine's user, or share the folder with its group")
    st = os.statvfs(path)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{path}: {total / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
    if total < MIN_SHM:
        return Check("shared memory", "warn", detail + " (too small for a KV pool)",
                     "docker run --shm-size=...; in Kubernetes mount an emptyDir with "
                     "medium: Memory at /dev/shm")
    return Check("shared memory", "ok", detail)


def check_port(name: str, host: str, port: int, own: Running | None = None) -> Check:
    """Can ``kvd serve`` bind ``host:port``? A port the running kvd of these settings
    (``own``) listens on is its own, not a conflict."""
    if port == 0:
        return Check(name, "ok", "0: any free port is taken at start")
    if own is not None and port in own.ports:
        return Check(name, "ok", f"{host}:{port} is held by this kvd (pid {own.pid}, running)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return Check(name, "fail", f"{host}:{port} is in use",
                             f"another kvd? (kvd status -a {host}:{port}; ss -ltnp "
                             f"'sport = :{port}'), or choose another port")
            return Check(name, "fail", f"cannot bind {host}:{port}: {exc.strerror}",
                         "use an address of this host, or a port >= 1024 as non-root")
    return Check(name, "ok", f"{host}:{port} is free")


def check_socket(path: Path, own: Running | None = None) -> Check:
    """What ``kvd serve`` checks before it binds the engine socket (folder, lock, any file
    at the path); when systemd passes the socket (``kvd@.socket``) there is nothing to
    check here, and a socket the running kvd of these settings (``own``) serves is its
    own."""
    name = "engine socket"
    if notify.socket_activated():
        return Check(name, "ok", "passed by systemd (socket activation)")
    if own is not None:
        return Check(name, "ok", f"{path}: served by this kvd (pid {own.pid}, running; "
                     "kvd status shows it)")
    try:
        preflight(path)
    except SocketPathError as exc:
        return Check(name, "fail", f"{path}: {exc.detail}", exc.fix)
    verb = "writable" if path.parent.is_dir() else "will be created"
    return Check(name, "ok", f"{path.parent} {verb}; {path.name} will be mode 0600, so the "
                 f"engine must run as uid {os.geteuid()}")
