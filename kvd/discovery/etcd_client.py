"""etcd's v3 API over its JSON gRPC gateway, with httpx (async). The only module that
talks to etcd.

Endpoints used (etcd 3.4+; docs/discovery.md says why the gateway and not gRPC):
``/v3/auth/authenticate``, ``/v3/lease/grant``, ``/v3/lease/keepalive``,
``/v3/kv/lease/revoke``, ``/v3/kv/put``, ``/v3/kv/range``, ``/v3/watch`` (a stream of
newline-separated JSON messages), ``/v3/maintenance/status``. Keys and values travel
base64-encoded; 64-bit integers as decimal strings.

Endpoints are tried in order; one that does not answer is skipped for the next. With a
user, a token from ``authenticate`` goes in the ``Authorization`` header and is renewed
once when etcd says it is invalid (etcd expires simple tokens after 5 minutes idle).
TLS: a CA to verify the server, and a client certificate and key for etcd's
``--client-cert-auth``.

Errors: :class:`~kvd.errors.DiscoveryUnavailable` (no endpoint answered),
:class:`~kvd.errors.DiscoveryAuthError` (credentials refused),
:class:`~kvd.errors.DiscoveryError` (any other refusal, or a malformed answer).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvd.discovery.keys import b64, range_end
from kvd.errors import DiscoveryAuthError, DiscoveryError, DiscoveryUnavailable

#: gRPC status codes etcd's gateway reports (``code`` in an error body).
UNAUTHENTICATED, PERMISSION_DENIED, INVALID_ARGUMENT = 16, 7, 3
#: etcd's auth errors that carry a generic code (rpctypes' ErrGRPCUserEmpty: code 3):
#: translated here, at the boundary, into DiscoveryAuthError, the type kvd reads.
AUTH_MESSAGES = ("etcdserver: user name is empty", "etcdserver: authentication failed",
                 "etcdserver: invalid auth token", "etcdserver: permission denied")


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd: ``endpoints`` (``http(s)://host:port``), optional
    user/password, TLS files, and the timeout of one request (s)."""

    endpoints: tuple[str, ...]
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    timeout: float = 5.0


@dataclass(frozen=True)
class WatchBatch:
    """One watch response: its ``events`` (gateway JSON) at store ``revision``."""

    events: list[dict[str, Any]]
    revision: int


class WatchIdle(DiscoveryUnavailable):
    """The watch stream said nothing for its idle bound (etcd may be fine: probe it)."""


class WatchCompacted(DiscoveryError):
    """The watch's start revision was compacted away: read the prefix again."""


class EtcdClient:
    """One connection pool to one etcd cluster."""

    def __init__(self, opts: EtcdOptions, http: httpx.AsyncClient | None = None) -> None:
        if not opts.endpoints:
            raise DiscoveryError("no etcd endpoints configured")
        self.opts = opts
        self.http = http or httpx.AsyncClient(timeout=opts.timeout, trust_env=False,
                                              verify=_tls(opts))
        self._current = 0
        self._token: str | None = None

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to now."""
        return self.opts.endpoints[self._current].rstrip("/")

    # ---- API ------------------------------------------------------------------------

    async def grant(self, ttl: float) -> tuple[int, float]:
        """A new lease of ``ttl`` s; returns (lease id, TTL etcd granted in s)."""
        r = await self.call("/v3/lease/grant", {"TTL": max(1, round(ttl))})
        return int(r["ID"]), float(r.get("TTL", ttl))

    async def keepalive(self, lease: int) -> float:
        """Renew ``lease``; returns its TTL (s), 0 when etcd no longer has it."""
        r = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return float((r.get("result") or {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """Drop ``lease`` and every key put under it (a clean shutdown)."""
        await self.call("/v3/kv/lease/revoke", {"ID": str(lease)})

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Put ``key``; returns the store revision."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        r = await self.call("/v3/kv/put", body)
        return int(r.get("header", {}).get("revision", 0))

    async def range_prefix(self, prefix: str) -> tuple[list[dict[str, Any]], int]:
        """Every key-value under ``prefix`` and the store revision they were read at."""
        r = await self.call("/v3/kv/range", {"key": b64(prefix),
                                             "range_end": b64(range_end(prefix))})
        return list(r.get("kvs", [])), int(r.get("header", {}).get("revision", 0))

    async def status(self) -> dict[str, Any]:
        """The answering member's status (version, db size, leader)."""
        return await self.call("/v3/maintenance/status", {})

    async def watch(self, prefix: str, start_revision: int,
                    idle_s: float) -> AsyncIterator[WatchBatch]:
        """Changes under ``prefix`` from ``start_revision`` on, as they happen. Ends by
        raising: :class:`DiscoveryUnavailable` when the stream breaks (reconnect and read
        again), :class:`WatchIdle` when it is silent for ``idle_s`` (a partition looks
        like silence: probe etcd), :class:`WatchCompacted`, or :class:`DiscoveryError`."""
        body = {"create_request": {"key": b64(prefix), "range_end": b64(range_end(prefix)),
                                   "start_revision": str(start_revision)}}
        await self._ensure_token()
        timeout = httpx.Timeout(self.opts.timeout, read=idle_s)
        try:
            async with self.http.stream("POST", f"{self.endpoint}/v3/watch", json=body,
                                        headers=self._headers(), timeout=timeout) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    self._raise_for(resp)
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield _watch_message(line)
        except httpx.ReadTimeout as exc:
            raise WatchIdle(f"etcd watch at {self.endpoint}: silent for {idle_s:g}s") from exc
        except httpx.HTTPError as exc:
            self._rotate()
            raise DiscoveryUnavailable(f"etcd watch at {self.endpoint}: "
                                       f"{type(exc).__name__}") from exc
        raise DiscoveryUnavailable(f"etcd watch at {self.endpoint} ended")

    # ---- plumbing --------------------------------------------------------------------

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the first endpoint that answers (renewing an
        expired token once); returns the JSON answer."""
        await self._ensure_token()
        resp = await self._post(path, body)
        if resp.status_code == 401 and self.opts.user:
            self._token = None  # simple tokens expire: authenticate again, once
            await self._ensure_token()
            resp = await self._post(path, body)
        if resp.status_code != 200:
            self._raise_for(resp)
        try:
            data = resp.json()
        except ValueError as exc:
            raise DiscoveryError(f"etcd {self.endpoint}{path}: not JSON") from exc
        if not isinstance(data, dict):
            raise DiscoveryError(f"etcd {self.endpoint}{path}: unexpected answer")
        return data

    async def _post(self, path: str, body: dict[str, Any],
                    auth: bool = True) -> httpx.Response:
        errors = []
        for _ in self.opts.endpoints:
            url = f"{self.endpoint}{path}"
            try:
                return await self.http.post(url, json=body,
                                            headers=self._headers() if auth else {})
            except httpx.HTTPError as exc:
                errors.append(f"{self.endpoint}: {type(exc).__name__}")
                self._rotate()
        raise DiscoveryUnavailable("etcd unreachable: " + "; ".join(errors))

    async def _ensure_token(self) -> None:
        if not self.opts.user or self._token is not None:
            return
        resp = await self._post("/v3/auth/authenticate",
                                {"name": self.opts.user, "password": self.opts.password or ""},
                                auth=False)
        if resp.status_code != 200:
            self._raise_for(resp)
        token = resp.json().get("token")
        if not isinstance(token, str) or not token:
            raise DiscoveryAuthError(f"etcd {self.endpoint} gave no auth token for user "
                                     f"{self.opts.user!r}")
        self._token = token

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    def _rotate(self) -> None:
        self._current = (self._current + 1) % len(self.opts.endpoints)

    def _raise_for(self, resp: httpx.Response) -> None:
        try:
            err = resp.json()
        except ValueError:
            err = {}
        if not isinstance(err, dict):
            err = {}
        if isinstance(err.get("error"), dict):  # a stream's error message
            err = err["error"]
        message = str(err.get("message") or err.get("error") or resp.text[:200]).strip()
        code = err.get("code")
        where = f"etcd {self.endpoint}{resp.request.url.path}"
        if code in (UNAUTHENTICATED, PERMISSION_DENIED) or resp.status_code in (401, 403) or \
                message.startswith(AUTH_MESSAGES):
            who = f"user {self.opts.user!r}" if self.opts.user else "no user (auth is on?)"
            raise DiscoveryAuthError(f"{where}: {message} ({who})")
        raise DiscoveryError(f"{where}: HTTP {resp.status_code}: {message}")


def _watch_message(line: str) -> WatchBatch:
    """One line of the watch stream (``created`` and progress messages: no events)."""
    try:
        msg = json.loads(line)
    except ValueError as exc:
        raise DiscoveryError(f"etcd watch: malformed message {line[:100]!r}") from exc
    if "error" in msg:
        err = msg["error"]
        raise DiscoveryError(f"etcd watch: {err.get('message', err)}")
    result = msg.get("result", {})
    if int(result.get("compact_revision", 0) or 0):
        raise WatchCompacted(f"etcd watch: revision compacted to {result['compact_revision']}")
    if result.get("canceled"):
        raise DiscoveryError(f"etcd watch canceled: {result.get('cancel_reason', '')}")
    revision = int(result.get("header", {}).get("revision", 0))
    return WatchBatch(list(result.get("events") or []), revision)


def _tls(opts: EtcdOptions) -> ssl.SSLContext | bool:
    """The TLS context: the CA (else the system's), and the client certificate."""
    if opts.ca_file is None and opts.cert_file is None:
        return True
    ctx = ssl.create_default_context(cafile=str(opts.ca_file) if opts.ca_file else None)
    if opts.cert_file is not None:
        ctx.load_cert_chain(str(opts.cert_file), str(opts.key_file) if opts.key_file else None)
    return ctx
