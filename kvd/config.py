"""One typed settings object for a kvd daemon.

Sources, lowest to highest priority (pydantic-settings sources)::

    built-in defaults < TOML file (``--config FILE``) < environment < command-line flags

The environment is ``KVD_<SETTING>`` for every setting; the reference
connector's names (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``,
``_WAITING_TIMEOUT``, ``_HEARTBEAT_INTERVAL``, ``_HEARTBEAT_MAX_FAILURE``,
``_THREAD_POOL_SIZE``, ``_QUEUE_SIZE``) are honoured as aliases, below the
``KVD_`` name when both are set. Generic names (``HOST``, ``ROLE``) are never
read. Invalid settings raise :class:`~kvd.errors.ConfigError` listing every
problem at once, each with the source it came from.

``config/kvd.toml`` documents every setting with its default and unit (a test
keeps it in step with this module).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvd.engine_rpc.socket_path import default_engine_socket, default_socket_dir
from kvd.errors import ConfigError
from kvd.filetrust import read_secret_file

ENV_PREFIX = "KVD_"
SGLANG_PREFIX = "SGLANG_DISAGGREGATION_"

#: Settings the reference connector has, by its environment suffix.
SGLANG_ALIASES = {
    "bootstrap_timeout": "BOOTSTRAP_TIMEOUT",
    "waiting_timeout": "WAITING_TIMEOUT",
    "heartbeat_interval": "HEARTBEAT_INTERVAL",
    "heartbeat_max_failures": "HEARTBEAT_MAX_FAILURE",
    "transfer_threads": "THREAD_POOL_SIZE",
    "transfer_queue_size": "QUEUE_SIZE",
}

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]

#: Longest AF_UNIX socket path, in bytes: ``sun_path`` is 108 bytes on Linux, including
#: the terminating NUL that most clients add (unix(7)).
MAX_UNIX_PATH = 107


def env_names(field: str) -> list[str]:
    """Environment variables that set ``field``, highest priority first."""
    names = [f"{ENV_PREFIX}{field.upper()}"]
    if field in SGLANG_ALIASES:
        names.append(SGLANG_PREFIX + SGLANG_ALIASES[field])
    return names


def _env(field: str) -> AliasChoices:
    return AliasChoices(*env_names(field))


def _setting(default: Any = ..., *, unit: str = "", help: str = "", **kw: Any) -> Any:
    """A Field whose docs (``help``, ``unit``) ``kvd config show`` and kvd.toml repeat."""
    return Field(default, description=help, json_schema_extra={"unit": unit}, **kw)


class Settings(BaseSettings):
    """Effective configuration of one kvd daemon (one engine rank).

    Units: seconds for every ``*_timeout``/``*_interval``/``*_budget``; bytes
    for sizes. Port 0 means "pick a free port" (the chosen one is reported).
    """

    # allow_inf_nan=False: every float setting is a duration or a bound, and a room must
    # end by its deadline -- ``inf`` (or a literal that overflows to it) is refused
    model_config = SettingsConfigDict(extra="forbid", populate_by_name=True,
                                      env_prefix=ENV_PREFIX, allow_inf_nan=False)

    role: Literal["prefill", "decode"] = _setting(
        help="which side of PD disaggregation this kvd serves (required)")
    host: str = _setting("127.0.0.1", help="address advertised to peers (ZMQ, transfer engine)")
    transfer_host: str | None = _setting(
        None, help="address of the transfer engine if not host; Mooncake's P2P handshake is "
                   "IPv4-only, so with host = ::1 the default is 127.0.0.1, and any other "
                   "IPv6 host needs an IPv4 transfer_host")
    transfer_backend: Literal["mooncake", "local", "auto"] = _setting(
        "mooncake", help="how KV bytes move: mooncake (the transfer engine, tcp or rdma), "
                         "local (prefill and decode daemons on one host copy directly), or "
                         "auto (local when a decode peer is on this host and its memory "
                         "can be imported, else mooncake)")
    peer_channel_dir: Path = Field(
        default_factory=lambda: default_socket_dir() / "peers",
        json_schema_extra={"unit": "path"},
        description="folder of the same-host peer channel sockets (local/auto backends: "
                    "a decode passes its pool's descriptors there, proving itself); every "
                    "daemon on a host uses the same one; kvd creates it 0750")
    peer_channel_uid: int | None = _setting(
        None, ge=0, help="uid a same-host peer daemon may run as besides kvd's own "
                         "(SO_PEERCRED on the peer channel); default: kvd's own only")
    transfer_protocol: Literal["tcp", "rdma"] = _setting(
        "tcp", help="the Mooncake transport: tcp (any network, no setup) or rdma (needs an "
                    "RDMA NIC; see transfer_devices)")
    transfer_devices: str = _setting(
        "auto", unit="NIC list",
        help="RDMA NICs the transfer engine may use, comma separated (e.g. mlx5_0,mlx5_1), "
             "or auto: the engine's topology discovery picks the NICs nearest each buffer")
    transfer_bind_host: str | None = _setting(
        None, help="address the transfer engine's listeners bind to (default: the transfer "
                   "host); Mooncake itself binds every interface, kvd pins its listeners "
                   "(docs/transfer.md); 0.0.0.0 keeps Mooncake's behaviour")
    transfer_handshake_front: bool = _setting(
        True, help="serve the transfer engine's advertised handshake port from kvd, with "
                   "Mooncake's single-threaded handshake listener on loopback behind it, so "
                   "idle or slow connections to it cannot stall transfers (S05); false, or "
                   "transfer_bind_host = 0.0.0.0: no front, Mooncake's listener is the "
                   "advertised one")
    transfer_tcp_pool: bool = _setting(
        False, help="keep Mooncake's per-peer TCP connection pool (4 connections per peer, "
                    "MC_TCP_ENABLE_CONNECTION_POOL); off: a transfer's connections close "
                    "when it completes, because Mooncake 0.3.13 cannot close a departed "
                    "peer's pooled connections (its closeSegment does nothing) and each "
                    "decode that went away would leave 4 sockets open (K39); with it off "
                    "every write opens a connection (the listeners get the kernel's "
                    "largest accept backlog so bursts do not wait 1 s for dropped SYNs)")
    transfer_port_range: str | None = _setting(
        None, unit="port-port",
        help="ports of the transfer engine's two listeners (P2P handshake and TCP data), "
             "e.g. 15000-15001, so a firewall or NetworkPolicy can name them; within "
             "1024-65535 and outside 32768-60999 (Mooncake ignores such a range); default: "
             "Mooncake's 15000-17000")
    aux_transport: Literal["mooncake", "control"] = _setting(
        "mooncake", help="how aux data travels: in the last transfer batch, or inside the "
                         "final status message over the control plane (TCP fallback)")
    http_host: str = _setting("127.0.0.1", help="REST listener: /health /ready /metrics "
                              "/v1/status, and /route when serving bootstrap")
    http_port: int = _setting(0, ge=0, le=65535, unit="port", help="REST port (0: any free)")
    http_max_connections: int = _setting(
        1024, ge=8, unit="connections",
        help="open HTTP connections across all listeners; at the limit the longest-idle one "
             "is closed for a new one")
    http_fd_reserve: int = _setting(
        256, ge=16, unit="descriptors",
        help="file descriptors kept free for the engine socket, control plane and transfer "
             "engine: HTTP connections are held below RLIMIT_NOFILE minus this")
    http_header_timeout: float = _setting(
        5.0, gt=0, unit="s", help="an HTTP connection must send a complete request head "
                                  "this soon after opening or after its last response")
    http_body_timeout: float = _setting(10.0, gt=0, unit="s",
                                        help="an HTTP request body must arrive within this")
    zmq_port: int = _setting(0, ge=0, le=65535, unit="port",
                             help="kvd<->kvd control port (0: any free)")
    engine_socket: Path = Field(
        default_factory=default_engine_socket, json_schema_extra={"unit": "path"},
        description="Unix socket the engine connects to (mode 0600), in a folder of kvd's "
                    "user that group and others cannot write (kvd creates it 0750)")
    http_docs: bool = _setting(
        False, help="interactive API docs at /docs and /redoc (the browser loads their "
                    "scripts from a CDN: off by default; /openapi.json is always served)")
    serve_bootstrap: bool = _setting(False, help="serve SGLang's /route API (on the REST "
                                     "listener, or on bootstrap_host:bootstrap_port if set)")
    bootstrap_host: str | None = _setting(
        None, help="address of a separate bootstrap listener (default: http_host)")
    bootstrap_port: int | None = _setting(
        None, ge=0, le=65535, unit="port",
        help="serve /route on its own listener at this port (0: any) so that the REST "
             "server can stay on loopback; unset: /route is on the REST listener")
    bootstrap_addr: str | None = _setting(None, unit="host:port",
                                          help="where a prefill rank registers (bootstrap)")
    discovery: Literal["bootstrap", "etcd"] = _setting(
        "bootstrap", help="how decodes find prefill ranks: bootstrap (SGLang's /route on the "
                          "prefill's bootstrap server, heartbeats) or etcd (registrations "
                          "under leases in etcd, watched; docs/discovery.md)")
    etcd_endpoints: str = _setting(
        "http://127.0.0.1:2379", unit="URL list",
        help="etcd client URLs, comma separated (http://host:2379, or https:// with TLS); "
             "tried in order")
    etcd_prefix: str = _setting(
        "/kvd/default", unit="key path",
        help="etcd key prefix of this kvd cluster: only daemons with the same prefix see "
             "each other (one per cluster, e.g. /kvd/prod-a)")
    etcd_lease_ttl: float = _setting(
        10.0, ge=2, le=3600, unit="s",
        help="lease of a prefill rank's registration: a rank that dies (or loses etcd) is "
             "gone from every decode's view this long after its last renewal (renewed "
             "every third of it)")
    etcd_view_ttl: float = _setting(
        30.0, gt=0, unit="s",
        help="decode: while etcd is unreachable, new lookups use the last known view this "
             "long, then fail with the reason (rooms in flight continue)")
    etcd_user: str | None = _setting(None, help="etcd user (auth enabled); needs "
                                     "etcd_password_file")
    etcd_password_file: Path | None = _setting(
        None, unit="path", help="file holding the etcd user's password (first line); "
                                "readable by its owner only (mode 0600 or 0400)")
    etcd_ca_file: Path | None = _setting(
        None, unit="path", help="CA certificate that signed etcd's server certificate "
                                "(https endpoints; default: the system CAs)")
    etcd_cert_file: Path | None = _setting(
        None, unit="path", help="client certificate for etcd --client-cert-auth (with "
                                "etcd_key_file)")
    etcd_key_file: Path | None = _setting(None, unit="path",
                                          help="private key of etcd_cert_file")
    shm_dir: Path = _setting(Path("/dev/shm"), unit="path",
                             help="only shared-memory files under this folder are mapped")

    # Ranks: unset (the default) = taken from the engine when it registers; set = the
    # engine's value must be equal (kvd/ranks.py). Engines that do not send their ranks get
    # rank 0 of size 1 for every unset one.
    attn_tp_size: int | None = _setting(
        None, ge=1, help="attention tensor-parallel size of the engine (unset: the engine's)")
    attn_tp_rank: int | None = _setting(
        None, ge=0, help="this engine rank's attention TP rank (unset: the engine's)")
    attn_dp_size: int | None = _setting(
        None, ge=1, help="attention data-parallel size (unset: the engine's)")
    attn_dp_rank: int | None = _setting(
        None, ge=0, help="this engine rank's attention DP rank (unset: the engine's)")
    pp_size: int | None = _setting(None, ge=1, help="pipeline-parallel size (unset: the "
                                   "engine's)")
    pp_rank: int | None = _setting(None, ge=0, help="this engine rank's pipeline stage "
                                   "(unset: the engine's)")

    bootstrap_timeout: float = _setting(
        300.0, gt=0, unit="s", validation_alias=_env("bootstrap_timeout"),
        help="a room may stay Bootstrapping this long")
    waiting_timeout: float = _setting(
        300.0, gt=0, unit="s", validation_alias=_env("waiting_timeout"),
        help="a room may stay WaitingForInput this long")
    transfer_timeout: float = _setting(120.0, gt=0, unit="s",
                                       help="a room may stay Transferring this long")
    heartbeat_interval: float = _setting(
        5.0, gt=0, unit="s", validation_alias=_env("heartbeat_interval"),
        help="decode -> prefill heartbeat period")
    heartbeat_max_failures: int = _setting(
        2, ge=1, validation_alias=_env("heartbeat_max_failures"),
        help="missed heartbeats before a prefill's rooms fail")
    heartbeat_max_probes_per_s: float = _setting(
        100.0, gt=0, unit="probes/s",
        help="decode: at most this many heartbeat probes per second on average (one round "
             "probes at most this x heartbeat_interval peers, those with a live room first)")
    transfer_threads: int = _setting(
        1, ge=1, le=64, unit="threads", validation_alias=_env("transfer_threads"),
        help="accepted for SGLang compatibility (THREAD_POOL_SIZE) and ignored: one pump "
             "thread drives every Mooncake destination without blocking on any, so a frozen "
             "decode stalls no other")
    transfer_queue_size: int = _setting(
        4, ge=1, validation_alias=_env("transfer_queue_size"),
        help="local backend: writes handed to one destination's copy thread at once (others "
             "wait on the loop); Mooncake writes are bounded per destination in entries")
    max_batch_entries: int = _setting(
        512, ge=1, le=1024, unit="descriptors",
        help="descriptors per Mooncake batch call (the TCP transport refuses > 1024)")
    inflight_entries: int = _setting(
        256, ge=1, le=1024, unit="descriptors",
        help="Mooncake entries in flight per destination; what a cancelled room may still "
             "write is bounded by this window (the rest of its queue is dropped)")
    inflight_bytes: int = _setting(
        2 << 20, ge=1, unit="bytes",
        help="Mooncake bytes in flight per destination beyond the first "
             "inflight_min_entries entries: bounds what a cancelled room may still write "
             "and how long a fresh room waits behind cancelled ones (K43)")
    inflight_min_entries: int = _setting(
        8, ge=1, le=1024, unit="descriptors",
        help="Mooncake entries that may always be in flight per destination whatever "
             "their size (within inflight_entries), so big entries keep the link busy; "
             "inflight_bytes applies beyond them")
    control_send_timeout: float = _setting(5.0, gt=0, unit="s",
                                           help="give up sending one control message after")
    http_timeout: float = _setting(5.0, gt=0, unit="s", help="timeout of one bootstrap request")
    bootstrap_retry_budget: float = _setting(
        30.0, gt=0, unit="s", help="how long lookups/registration keep retrying before failing")
    bootstrap_max_lookups: int = _setting(
        32, ge=1, unit="requests",
        help="decode: bootstrap lookups (/route requests) in flight at once; more wait for a "
             "slot within their retry budget, so thousands of addresses cannot flood the loop "
             "that answers /health")
    max_frame_bytes: int = _setting(64 << 20, ge=1024, unit="bytes",
                                    help="largest control or RPC frame accepted; at least the "
                                         "protocol's largest control message (about 4.75 "
                                         "MiB): a smaller cap would drop peers' real messages")
    transient_retry_s: float = _setting(
        1.0, ge=0, unit="s",
        help="how long a refused transfer batch is retried (never past the room's deadline)")
    release_timeout: float = _setting(
        10.0, gt=0, unit="s",
        help="decode: a failed room's pages become releasable this long after the write "
             "deadline it gave the prefill ranks (which stop writing then), even without "
             "their confirmation that no write is in flight")
    drain_timeout: float = _setting(
        10.0, ge=0, unit="s", help="SIGTERM: in-flight rooms may finish for this long")
    finished_room_ttl: float = _setting(
        600.0, gt=0, unit="s", help="a finished room the engine never cleared is dropped after")
    fault_injection: str | None = _setting(
        None, unit="JSON", help="TESTING ONLY: a FaultPlan applied to every transfer batch")
    test_clock_offset: float = _setting(
        0.0, unit="s", help="TESTING ONLY: this daemon's wall clock (seals, signatures and "
                            "their freshness checks) runs this far ahead of the host's: a "
                            "skewed host without faketime (case K40)")
    cluster_secret: SecretStr | None = _setting(
        None, unit="secret",
        help="shared secret authenticating bootstrap and kvd<->kvd messages; ONLY from the "
             "environment (KVD_CLUSTER_SECRET): refused on the command line and in this file")
    cluster_secret_file: Path | None = _setting(
        None, unit="path", help="file holding the cluster secret (first line); readable by "
                                "its owner only (mode 0600 or 0400)")
    cluster_secret_file_check: Literal["refuse", "warn"] = _setting(
        "refuse", help="a cluster_secret_file that group or others may read: refuse to "
                       "start, or only warn")
    insecure: bool = _setting(
        False, help="run WITHOUT a cluster secret: no authentication (logs a warning)")
    auth_max_skew: float = _setting(
        30.0, gt=0, unit="s", help="authenticated messages older or newer than this are "
                                   "refused (replay window)")
    engine_socket_group: str | None = _setting(
        None, help="group allowed on the engine socket (mode 0660); default: owner only, 0600")
    max_peers: int = _setting(256, ge=1, unit="peers",
                              help="decode ranks a prefill rank accepts registrations from")
    max_rooms_per_peer: int = _setting(
        100_000, ge=1, unit="rooms", help="rooms in flight or buffered per decode peer")
    peer_ttl: float = _setting(
        600.0, gt=0, unit="s", help="a peer with no message and no room for this long is "
                                    "forgotten (its registration, socket and heartbeats)")
    engine_channel: bool = _setting(
        True, help="share a room status table with the engine (a memfd both map): its "
                   "polls read statuses without a syscall; and serve engines that ask for "
                   "a submission ring their room calls go through; off: every poll and "
                   "room call is an RPC")
    status_table_slots: int = _setting(
        1 << 18, ge=2, le=1 << 22, unit="slots",
        help="slots of the shared status table (a power of two; 16 bytes each, in buckets "
             "of two); a room whose bucket other live rooms fill is polled over the socket")
    engine_reconnect_grace: float = _setting(
        10.0, ge=0, unit="s", help="an engine whose connection dropped keeps its registration "
                                   "and rooms this long, waiting for it to reconnect")
    log_level: LogLevel = _setting("INFO", help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    log_format: Literal["text", "json"] = _setting(
        "text", help="text lines, or one JSON object per line")

    instance_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:16],
                             pattern=r"^[A-Za-z0-9._-]{1,64}$",
                             description="names this daemon's life to its peers; every "
                             "authenticated message is addressed to it (default: random "
                             "per start)")

    @field_validator("transfer_port_range")
    @classmethod
    def _port_range(cls, v: str | None) -> str | None:
        if v is not None:
            parse_port_range(v)  # ValueError -> reported with the other problems
        return v

    @field_validator("status_table_slots")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v

    @field_validator("etcd_prefix")
    @classmethod
    def _etcd_prefix(cls, v: str) -> str:
        from kvd.discovery.keys import check_prefix
        return check_prefix(v)

    @field_validator("etcd_endpoints")
    @classmethod
    def _etcd_endpoints(cls, v: str) -> str:
        etcd_endpoint_list(v)  # ValueError -> reported with the other problems
        return v

    @field_validator("transfer_devices")
    @classmethod
    def _devices(cls, v: str) -> str:
        names = [d.strip() for d in v.split(",")]
        if v.strip() != "auto" and (not all(names) or "auto" in names):
            raise ValueError("a comma-separated list of NIC names (e.g. mlx5_0,mlx5_1), or auto")
        return v

    @field_validator("transfer_bind_host")
    @classmethod
    def _bind_host(cls, v: str | None) -> str | None:
        if v is not None:
            ipaddress.IPv4Address(v)  # Mooncake's handshake listener is IPv4
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """A TOML ``true`` in a number setting (``waiting_timeout = true``) would pass
        as 1 (pydantic's lax mode): refuse it instead of running with a 1 s timeout."""
        if isinstance(v, bool) and info.field_name is not None:
            ann = cls.model_fields[info.field_name].annotation
            types = set(get_args(ann)) if get_origin(ann) in (Union, UnionType) else {ann}
            if bool not in types and types & {int, float}:
                raise ValueError("expected a number, not true/false")
        return v

    @field_validator("engine_socket", mode="before")
    @classmethod
    def _socket_path_names_a_file(cls, v: Any) -> Any:
        if isinstance(v, str | Path) and (str(v).endswith("/") or
                                           Path(v).name in ("", ".", "..")):
            raise ValueError(f"{str(v)!r} names no socket file: give a path such as "
                             f"/run/kvd/<rank>.sock")
        return v

    @field_validator("engine_socket")
    @classmethod
    def _socket_path_fits(cls, v: Path) -> Path:
        n = len(os.fsencode(v))
        if n > MAX_UNIX_PATH:
            raise ValueError(f"{n} bytes is too long for a Unix socket path (at most "
                             f"{MAX_UNIX_PATH}): choose a shorter one, e.g. "
                             f"/run/kvd/<rank>.sock or $XDG_RUNTIME_DIR/kvd/<rank>.sock")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check_ranks(self) -> Settings:
        problems = []
        for rank, size in (("attn_tp_rank", "attn_tp_size"), ("attn_dp_rank", "attn_dp_size"),
                           ("pp_rank", "pp_size")):
            if getattr(self, rank) is not None and getattr(self, size) is not None and \
                    getattr(self, rank) >= getattr(self, size):
                problems.append(f"{rank}={getattr(self, rank)} must be < {size}="
                                f"{getattr(self, size)}")
        if self.role == "prefill" and not (self.bootstrap_addr or self.serve_bootstrap):
            problems.append("a prefill kvd needs bootstrap_addr (or serve_bootstrap = true); "
                            "with discovery = etcd it is the instance name routers hand to "
                            "engines")
        if self.transfer_host is None and ":" in self.host and self.host.strip("[]") != "::1":
            problems.append(f"host {self.host} is IPv6: set transfer_host to an IPv4 address "
                            f"(Mooncake's P2P handshake is IPv4-only)")
        if self.host.strip("[]") in ("0.0.0.0", "::", ""):
            problems.append(f"host {self.host!r} is not an address peers can reach: set it to "
                            f"this machine's address (http_host and transfer_bind_host bind)")
        elif self.transfer_backend != "local" and ":" not in self.host:
            transfer = effective_bind_host(self)
            try:
                ipaddress.IPv4Address(transfer)
            except ValueError:
                which = "transfer_bind_host" if self.transfer_bind_host else (
                    "transfer_host" if self.transfer_host else "host")
                problems.append(f"{which} {transfer!r} is not an IPv4 address, which the "
                                f"transfer engine needs (Mooncake's P2P handshake is "
                                f"IPv4-only): set transfer_host to this machine's IPv4 "
                                f"address")
        if self.cluster_secret is not None and self.cluster_secret.get_secret_value() and \
                self.cluster_secret_file is not None:
            problems.append("set cluster_secret or cluster_secret_file, not both")
        problems += _etcd_problems(self)
        problems += _frame_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def etcd_endpoint_list(text: str) -> list[str]:
    """``etcd_endpoints`` as a list of ``scheme://host:port`` URLs; raises ValueError
    naming a bad one."""
    out = []
    for item in (i.strip() for i in text.split(",")):
        scheme, sep, rest = item.partition("://")
        host, _, port = rest.rstrip("/").rpartition(":")
        if not sep or scheme not in ("http", "https") or not host or not port.isdigit() or \
                not 0 < int(port) < 65536 or "/" in rest.rstrip("/"):
            raise ValueError(f"etcd endpoint {item!r} is not http(s)://host:port "
                             f"(e.g. http://127.0.0.1:2379)")
        out.append(item.rstrip("/"))
    return out


def _frame_problems(s: Settings) -> list[str]:
    """A control frame cap below the protocol's largest real message would make this daemon
    drop, unread and unanswered, messages its peers send within the protocol (a room would
    wait for its deadline, K16); at or above it every peer accepts the same frames
    (:func:`kvd.protocol.control.max_frame`, the same on every peer of a wire version), so
    peers need not exchange their caps."""
    from kvd.protocol import control  # the bound is derived from the message types (~20 ms)

    most = control.max_frame()
    if s.max_frame_bytes < most:
        return [f"max_frame_bytes = {s.max_frame_bytes} is below the largest control message "
                f"a peer may send ({most} bytes): set it to at least that"]
    return []


def _etcd_problems(s: Settings) -> list[str]:
    """Cross-setting rules of etcd discovery (checked whatever ``discovery`` is, so a
    half-configured etcd section is reported before it is switched on)."""
    problems = []
    if (s.etcd_user is None) != (s.etcd_password_file is None):
        problems.append("etcd_user and etcd_password_file go together (set both or neither)")
    if s.etcd_key_file is not None and s.etcd_cert_file is None:
        problems.append("etcd_key_file needs etcd_cert_file")
    tls = s.etcd_ca_file or s.etcd_cert_file
    plain = [e for e in etcd_endpoint_list(s.etcd_endpoints) if e.startswith("http://")]
    if tls and plain:
        problems.append(f"etcd TLS files are set but {plain[0]} is plain http: use https://")
    return problems


def read_etcd_password(settings: Settings) -> str | None:
    """The etcd password (first line of ``etcd_password_file``), None without a user.
    Checked as the cluster secret file is (owner-only mode, not empty); raises
    :class:`ConfigError`."""
    if settings.etcd_password_file is None:
        return None
    path = settings.etcd_password_file
    try:
        with path.open("rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            data = fh.read(64 << 10)
    except OSError as exc:
        raise ConfigError(f"cannot read etcd_password_file {path}: "
                          f"{exc.strerror or type(exc).__name__}") from exc
    if mode & 0o077:
        raise ConfigError(f"etcd_password_file {path} is open to group or others (mode "
                          f"{mode & 0o777:04o}): chmod 600 it")
    password = (data.splitlines() or [b""])[0].strip()
    if not password:
        raise ConfigError(f"etcd_password_file {path} is empty (the password is its first line)")
    try:
        return password.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"etcd_password_file {path} is not UTF-8 text") from None


def parse_port_range(text: str) -> tuple[int, int]:
    """``"15000-15001"`` -> ``(15000, 15001)``; raises ValueError naming the rule broken.

    Rules from Mooncake's ``ValidatePortRange`` (mooncake-transfer-engine/src/config.cpp):
    ports 1024-65535 outside the ephemeral range 32768-60999, else it silently uses
    15000-17000; and at least two ports, one per listener (handshake, TCP data).
    """
    lo_s, sep, hi_s = text.partition("-")
    if not sep or not lo_s.strip().isdigit() or not hi_s.strip().isdigit():
        raise ValueError(f"transfer_port_range {text!r} is not FIRST-LAST (e.g. 15000-15001)")
    lo, hi = int(lo_s), int(hi_s)
    if hi - lo < 1:
        raise ValueError(f"transfer_port_range {text!r} needs at least two ports (the "
                         f"handshake and the TCP data listener)")
    for port in (lo, hi):
        if not 1024 <= port <= 65535 or 32768 <= port <= 60999:
            raise ValueError(f"transfer_port_range {text!r}: {port} is outside 1024-65535 or "
                             f"inside 32768-60999 (Mooncake would ignore the range)")
    if lo <= 32768 and hi >= 60999:
        raise ValueError(f"transfer_port_range {text!r} spans the ephemeral range 32768-60999")
    return lo, hi


def transfer_devices(s: Settings) -> list[str]:
    """The configured RDMA NICs, or ``[]`` for auto (topology discovery)."""
    if s.transfer_devices.strip() == "auto":
        return []
    return [d.strip() for d in s.transfer_devices.split(",")]


@dataclass(frozen=True)
class Source:
    """Where one effective value came from: ``kind`` is default, file, env or cli."""

    kind: Literal["default", "file", "env", "cli"]
    origin: str = ""

    def __str__(self) -> str:
        return f"{self.kind} ({self.origin})" if self.origin else self.kind


def _settings_class(toml_file: Path | None) -> type[Settings]:
    """A Settings subclass whose file source is ``toml_file`` (env still wins over it)."""

    class _FileSettings(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if toml_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
            return tuple(sources)

    return _FileSettings


#: Settings whose values never appear in a message, and never come from the command
#: line or the config file (case S15).
SECRET_FIELDS = frozenset({"cluster_secret"})


def _field_of(key: str) -> str:
    """Map a source key (field name or any env alias, any case, ``-`` for ``_``) back to
    its field name; an unknown key is returned as given."""
    low = key.strip().lower().replace("-", "_")
    for name in Settings.model_fields:
        if low == name or low in (n.lower() for n in env_names(name)):
            return name
    return key


def _env_origin(field: str) -> str:
    """The variable that set ``field`` (matching as pydantic-settings does: any case)."""
    present = {k.upper(): k for k in os.environ}
    return next((present[n] for n in env_names(field) if n in present), env_names(field)[0])


def _sources(path: Path | None, cli: dict[str, Any]) -> dict[str, Source]:
    """Which layer supplies each setting (the highest one that has it)."""
    cls = _settings_class(path)
    out = {name: Source("default") for name in Settings.model_fields}
    if path is not None:
        for key in TomlConfigSettingsSource(cls, toml_file=path)():
            out[_field_of(key)] = Source("file", str(path))
    for key in EnvSettingsSource(cls)():
        field = _field_of(key)
        out[field] = Source("env", _env_origin(field))
    for key in cli:
        out[_field_of(key)] = Source("cli")
    return out


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib lets this one through
        raise ConfigError(f"cannot read config file {path}: not UTF-8 text ({exc.reason} "
                          f"at byte {exc.start})") from exc


def _describe(exc: ValidationError, sources: dict[str, Source]) -> str:
    lines = []
    for e in exc.errors():
        loc = [_field_of(str(p)) for p in e["loc"]]
        name = ".".join(loc) or "settings"
        where = f" [{sources[loc[0]]}]" if loc and loc[0] in sources else ""
        shown = str(e["input"]) if isinstance(e["input"], Path) else repr(e["input"])
        # Values of secrets, and of unknown keys (a mistyped secret name), are not echoed.
        hide = e["type"] in ("missing", "extra_forbidden") or (loc and loc[0] in SECRET_FIELDS)
        value = f" = {shown}" if loc and not hide else ""
        lines.append(f"  {name}{value}{where}: {e['msg']}")
    return "invalid kvd configuration:\n" + "\n".join(lines)


def load_with_sources(config_file: str | Path | None = None,
                      **overrides: Any) -> tuple[Settings, dict[str, Source]]:
    """Build the effective :class:`Settings` and the :class:`Source` of each value.

    ``overrides`` are command-line values (``None`` values are ignored).
    Raises :class:`ConfigError` listing every invalid entry (with its source),
    or naming the unreadable file.
    """
    path = Path(config_file) if config_file is not None else None
    if path is not None and SECRET_FIELDS & {_field_of(k) for k in _read_file(path)}:
        raise ConfigError(f"config file {path} sets cluster_secret: a secret never goes in the "
                          f"config file (it gets copied, diffed and shown); set "
                          f"KVD_CLUSTER_SECRET or cluster_secret_file instead")
    # Keys as the user typed them (--set CLUSTER_SECRET=, --set kvd-cluster-secret=) are
    # matched as pydantic-settings would match them, so no spelling slips a secret in.
    cli = {_field_of(k): v for k, v in overrides.items() if v is not None}
    if SECRET_FIELDS & cli.keys():
        raise ConfigError("cluster_secret is never taken from the command line (it would "
                          "show in ps and shell history): set KVD_CLUSTER_SECRET or "
                          "cluster_secret_file")
    sources = _sources(path, cli)
    try:
        return _settings_class(path)(**cli), sources
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from exc


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the effective :class:`Settings` (see :func:`load_with_sources`)."""
    return load_with_sources(config_file, **overrides)[0]


def parse_assignments(items: list[str]) -> dict[str, str]:
    """``["key=value", ...]`` from ``--set`` flags; raises ConfigError naming bad items.

    A bad item is shown only if it is a setting's name (``--set role``): anything else
    might be a value, and a value might be a secret.
    """
    out, bad = {}, []
    for n, item in enumerate(items, 1):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            known = _field_of(item) in Settings.model_fields
            bad.append(repr(item.strip()) if known else f"item {n} (not shown)")
        else:
            out[key] = value.strip()
    if bad:
        raise ConfigError("--set expects KEY=VALUE, got: " + ", ".join(bad))
    return out


def describe_fields() -> list[tuple[str, str, str, Any]]:
    """(name, unit, help, default) of every setting, in declaration order."""
    rows = []
    for name, f in Settings.model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        default = None if f.default_factory is not None or f.is_required() else f.default
        rows.append((name, str(extra.get("unit", "")), f.description or "", default))
    return rows


def env_snapshot() -> dict[str, str]:
    """The KVD_* and SGLANG_DISAGGREGATION_* variables in the environment (for reports);
    secrets masked."""
    return {k: "**********" if _field_of(k) in SECRET_FIELDS else v
            for k, v in os.environ.items() if k.startswith((ENV_PREFIX, SGLANG_PREFIX))}


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


#: Settings whose default depends on the process: the line the template shows.
_DEFAULT_RULES = {"engine_socket": '"/run/kvd/kvd.sock"    # default: this as root; other users: '
                                   '$XDG_RUNTIME_DIR/kvd/kvd.sock (unset: /tmp/kvd-<uid>/kvd.sock)',
                  "peer_channel_dir": '"/run/kvd/peers"    # default: this as root; other users: '
                                      '$XDG_RUNTIME_DIR/kvd/peers (unset: /tmp/kvd-<uid>/peers)'}


def toml_template() -> str:
    """``config/kvd.toml``: every setting, commented out, with its default, unit and env names.

    ``kvd config template > config/kvd.toml`` regenerates it.
    """
    out = [
        "# kvd: every setting with its default and unit (kvd config template prints this file).",
        "# Sources, lowest to highest priority: built-in defaults < this file < environment",
        "# (KVD_<NAME>, and the SGLANG_DISAGGREGATION_* names shown) < command-line flags.",
        "# Uncomment a line to change a setting; `kvd config show -c FILE` prints the effective",
        "# values and where each came from. Examples: config/prefill.toml, config/decode.toml.",
    ]
    for name, unit, help_, default in describe_fields():
        field = Settings.model_fields[name]
        out.append("")
        unit_s = f"unit: {unit}; " if unit else ""
        out.append(f"# {help_} ({unit_s}env: {', '.join(env_names(name))})")
        if field.is_required():
            out.append(f'#{name} = "decode"    # required: "prefill" or "decode"')
        elif name in _DEFAULT_RULES:
            out.append(f"#{name} = {_DEFAULT_RULES[name]}")
        elif field.default_factory is not None:
            out.append(f'#{name} = "0123456789abcdef"    # default: random per start')
        elif name in SECRET_FIELDS:
            out.append(f'#{name} = ""    # default: unset; NEVER here (refused): '
                       f'use KVD_CLUSTER_SECRET or cluster_secret_file')
        elif default is None:
            out.append(f'#{name} = ""    # default: unset')
        else:
            out.append(f"#{name} = {_toml_literal(default)}")
    return "\n".join(out) + "\n"


def effective_bind_host(settings: Settings) -> str:
    """Where the transfer engine's listeners bind: ``transfer_bind_host``, else the
    transfer host."""
    return settings.transfer_bind_host or effective_transfer_host(settings)


def effective_transfer_host(settings: Settings) -> str:
    """The transfer engine's address: ``transfer_host``, else ``host`` (``::1`` maps to
    127.0.0.1 because Mooncake's P2P handshake resolves IPv4 only)."""
    if settings.transfer_host:
        return settings.transfer_host
    return "127.0.0.1" if settings.host.strip("[]") == "::1" else settings.host


MIN_SECRET_BYTES = 16
NO_SECRET = ("no cluster secret: set KVD_CLUSTER_SECRET or cluster_secret_file (kvd secret "
             "FILE writes a new one), or insecure = true to run without authentication")


def read_secret(settings: Settings) -> bytes | None:
    """The cluster secret (bytes) from the environment or the secret file; None if unset.

    The file's first line is the secret (surrounding whitespace ignored). The file is
    checked on the descriptor that is read (no window for a swap,
    :func:`kvd.filetrust.read_secret_file`): a regular file owned by kvd's user or root
    (S22), in folders nobody else may write, and a file that group or others may access
    is refused (``cluster_secret_file_check = "refuse"``, the default) or logged
    (``"warn"``). Raises :class:`ConfigError` if the file cannot be read, is
    open to others, is empty, or the secret is shorter than :data:`MIN_SECRET_BYTES`. No
    message carries the secret (case S15).
    """
    path = settings.cluster_secret_file
    if settings.cluster_secret is not None and settings.cluster_secret.get_secret_value():
        secret, origin = settings.cluster_secret.get_secret_value().strip().encode(), \
            "cluster_secret"
    elif path is not None:
        secret = _read_secret_file(path, settings.cluster_secret_file_check)
        origin = f"cluster_secret_file {path}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the cluster secret ({origin}) must be at least {MIN_SECRET_BYTES} "
                          f"bytes (it has {len(secret)}): kvd secret FILE makes one")
    return secret


def require_secret(settings: Settings) -> bytes | None:
    """:func:`read_secret`, and a :class:`ConfigError` when there is none and
    ``insecure`` is not set (the daemon refuses to start without one)."""
    secret = read_secret(settings)
    if secret is None and not settings.insecure:
        raise ConfigError(NO_SECRET)
    return secret


def load_secret(config_file: str | Path | None = None) -> bytes | None:
    """The cluster secret as a daemon started with ``config_file`` would read it (for
    ``kvd status`` and friends); None if none is set. Raises :class:`ConfigError`."""
    return read_secret(load_settings(config_file, role="decode"))


def _read_secret_file(path: Path, check: Literal["refuse", "warn"]) -> bytes:
    """First line of ``path``, stripped; see :func:`read_secret` for the checks."""
    data = read_secret_file(path, "cluster_secret_file", check,
                            hint=', or set cluster_secret_file_check = "warn"')
    secret = (data.splitlines() or [b""])[0].strip()
    if not secret:
        raise ConfigError(f"cluster_secret_file {path} is empty (the secret is its first "
                          f"line): kvd secret {path} --force writes a new one")
    return secret


def write_secret_file(path: Path, replace: bool = False) -> None:
    """Write a new random secret (64 hex characters, 256 bits) and a newline to ``path``,
    mode 0600, created atomically (a reader never sees a partial file).

    Raises ``FileExistsError`` if ``path`` exists and not ``replace``; ``OSError`` if it
    cannot be written.
    """
    import secrets
    import tempfile

    if path.exists() and not replace:
        raise FileExistsError(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")  # mode 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
