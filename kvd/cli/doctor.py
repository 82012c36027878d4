"""``kvd doctor``: can this machine run a kvd with these settings? Each check says what to fix.

Checks: the settings are valid; the Mooncake transfer engine imports and
initialises (in a child process, so a crash or hang in the native library is
reported, not suffered); RDMA devices; the locked-memory limit RDMA
registration needs; the shared-memory folder; the configured ports are free;
the engine socket's folder and any file already at its path.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kvd.config import Settings
from kvd.errors import KvdError

GiB = 1 << 30
MIN_SHM = 1 * GiB
ENGINE_TIMEOUT = 30.0
RDMA_SYSFS = Path("/sys/class/infiniband")
MOONCAKE_FIX = ("install exactly one Mooncake build: pip install 'kvd[cpu]' "
                "(mooncake-transfer-engine-non-cuda) or 'kvd[cuda]'; and the Debian packages "
                "libibverbs1 librdmacm1 libnuma1")
_PROBE = ("import os, sys\n"
          "from kvd.transfer.backends.mooncake import MooncakeEngine\n"
          "e = MooncakeEngine(sys.argv[1])\n"
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
               engine_probe: bool = True) -> list[Check]:
    """Every check, in order. ``settings`` None means the config was invalid
    (``config_error`` says why); the checks then use the built-in defaults."""
    s = settings or Settings.model_construct(role="decode")
    checks = [check_config(config_error)]
    if engine_probe:
        checks.append(check_transfer_engine(s.host))
    devices = rdma_devices()
    checks += [check_rdma(devices), check_memlock(bool(devices)), check_shm(s.shm_dir)]
    checks += [check_port("http port", s.http_host, s.http_port),
               check_port("zmq port", s.host, s.zmq_port), check_socket(s.engine_socket)]
    return checks


def as_dicts(checks: list[Check]) -> list[dict[str, Any]]:
    """JSON-shaped checks."""
    return [asdict(c) for c in checks]


def check_config(error: KvdError | None) -> Check:
    if error is None:
        return Check("config", "ok", "settings are valid")
    return Check("config", "fail", str(error).replace("\n", ";"),
                 "correct the settings listed (kvd config show -c FILE shows each source)")


def check_transfer_engine(host: str) -> Check:
    """Import and initialise the transfer engine on ``host`` in a child process."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, host], capture_output=True,
                              text=True, timeout=ENGINE_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return Check("transfer engine", "fail", f"initialising on {host} hung for "
                     f"{ENGINE_TIMEOUT:g}s", f"check that {host} is an address of this host")
    if proc.returncode == 0:
        return Check("transfer engine", "ok", f"mooncake initialised on {host} (tcp, "
                     f"session {proc.stdout.strip()})")
    err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    last = err[-1] if err else f"exit code {proc.returncode}"
    fix = MOONCAKE_FIX if "not installed" in last or "ImportError" in last or ".so" in last \
        else f"check that host = {host} is an address of this host"
    return Check("transfer engine", "fail", last, fix)


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


def check_port(name: str, host: str, port: int) -> Check:
    if port == 0:
        return Check(name, "ok", "0: any free port is taken at start")
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


def check_socket(path: Path) -> Check:
    name = "engine socket"
    if path.exists() or path.is_symlink():
        existing = _existing_socket(path)
        if existing is not None:
            return existing
    parent = path.parent
    ancestor = next(p for p in (parent, *parent.parents) if p.exists())
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return Check(name, "fail", f"{ancestor} is not writable by uid {os.getuid()}: "
                     f"cannot create {path}",
                     "systemd: RuntimeDirectory= (see deploy/systemd); otherwise "
                     f"install -d -o $USER {parent}")
    verb = "writable" if ancestor == parent else "will be created"
    return Check(name, "ok", f"{parent} {verb}; {path.name} will be mode 0600, so the engine "
                 f"must run as uid {os.getuid()}")


def _existing_socket(path: Path) -> Check | None:
    name = "engine socket"
    if not stat.S_ISSOCK(path.lstat().st_mode):
        return Check(name, "fail", f"{path} exists and is not a socket",
                     "remove it or choose another engine_socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except PermissionError:
            return Check(name, "warn", f"{path} exists and uid {os.getuid()} may not connect",
                         "run the engine and kvd as the same user")
        except OSError:
            return None  # stale file: kvd replaces it at start; check the folder
    return Check(name, "warn", f"a kvd is already serving {path}",
                 "stop it first, or give this kvd another engine_socket")
