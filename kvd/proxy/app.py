"""The PD proxy: FastAPI app forwarding OpenAI requests as a prefill leg then a decode leg.

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. choose a prefill server and a decode server (least outstanding requests, healthy
   first: :mod:`kvd.proxy.pool`), pick a fresh room;
2. prefill leg (:func:`kvd.proxy.legs.prefill_body`): one token, no stream, the room;
3. decode leg (:func:`kvd.proxy.legs.decode_body`): the client's request plus the
   prefill's transfer params, streamed back if the client asked for a stream.

Failures: a 4xx from an engine is the client's answer, as is. A prefill that cannot be
reached or answers 5xx is retried on another prefill with a fresh room; a decode that
cannot be reached (the request never left) is retried on another decode with the same
room -- the prefill's KV is still waiting for it; a decode that failed after it took the
request (its engine then aborts the room in kvd) is retried from the prefill with a fresh
room. ``retries`` bounds the extra attempts; then 502.

Cancellation (K35): a client that disconnects while a leg runs cancels that leg's HTTP
request, and the engine aborts the request: a prefill aborted mid-prompt hands nothing
off and frees its blocks; a decode aborted while its KV is in flight aborts the room in
kvd (the adapter names the prefill's bootstrap address, so the abort reaches the prefill
even before its room exists, K34). A streamed decode leg is closed when the client goes.
Rooms nobody will claim (K45, K46): each attempt's prefill leg carries a fresh release
token (the prefill's kvd keeps its digest per room). When the proxy knows no decode will
claim an attempt's rooms -- the decode refused the request (4xx), the decode leg failed
and is retried with fresh rooms, no attempt succeeded, or the client left before a
decode answered -- it ends every room of the attempt with ``POST /v1/rooms/release`` to
the prefill's bootstrap address, in the background (retrying rooms the prefill does not
know yet for up to ``RELEASE_PATIENCE`` s): the prefill frees their KV at once instead
of at kvd's bootstrap timeout. A room that already ended is left as it is.

Health: every ``health_interval`` s each server's ``GET /health``; ``max_failures``
failed probes or requests in a row take a server out of the choice until a probe
succeeds. ``GET /health`` answers 200 while each role has a healthy server.

Metrics (``GET /metrics``, the proxy's own registry): ``kvd_proxy_requests_total
{outcome}``, ``kvd_proxy_attempts_total{role,outcome}``, ``kvd_proxy_leg_seconds{role}``,
``kvd_proxy_outstanding{role,server}``, ``kvd_proxy_server_healthy{role,server}``,
``kvd_proxy_refused_total{reason}`` (requests refused by :mod:`kvd.proxy.guard`),
``kvd_proxy_releases_total{outcome}`` (rooms ended on a prefill, K45/K46).

Limits (S20): every request passes :class:`kvd.proxy.guard.ProxyGuard` (body cap, body
deadline, optional bearer token) before this app reads a byte of it. Nothing the proxy
answers names an engine's address unless ``expose_servers``: ``/health``, the ``server``
label of the metrics and the reasons of a 502 name each server by its role and index
(``prefill #0``, the order of ``--prefill``); the log names the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvd.bootstrap.guard import RELEASE_PATH
from kvd.protocol.release import new_token
from kvd.proxy.guard import DEFAULT_MAX_BODY, ProxyGuard, read_token_file
from kvd.proxy.legs import (
    LegError,
    decode_body,
    new_room,
    prefill_body,
    release_of,
    transfer_params,
)
from kvd.proxy.pool import NoServer, Pool, Server

log = logging.getLogger("kvd.proxy")

#: Why :class:`ProxyGuard` refused, by status (the ``reason`` of kvd_proxy_refused_total).
_REFUSALS = {400: "bad_host", 401: "unauthenticated", 408: "body_timeout",
             413: "body_too_large"}

#: Response headers of an engine that are not forwarded (hop-by-hop or recomputed).
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                 "content-encoding", "date", "server"}


@dataclass(frozen=True)
class ProxyConfig:
    """What the proxy routes to and how hard it tries (times in seconds)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    retries: int = 2
    timeout: float = 600.0
    health_interval: float = 5.0
    max_failures: int = 2
    max_body: int = DEFAULT_MAX_BODY
    body_timeout: float = 10.0
    header_timeout: float = 5.0
    max_connections: int = 1024
    token_file: Path | None = None
    expose_servers: bool = False


#: Seconds a release keeps asking about rooms the prefill does not know yet.
RELEASE_PATIENCE = 10.0


@dataclass(frozen=True)
class Attempt:
    """One prefill hand-off: its transfer params (None: nothing handed off) and the
    release token bound to its rooms (K45/K46)."""

    params: dict[str, Any] | None
    token: str


class Retry(Exception):
    """An attempt failed in a way another attempt may not: ``fresh_room`` says whether
    the prefill leg must run again (False: the decode never saw the request)."""

    def __init__(self, reason: str, fresh_room: bool = True, url: str = "") -> None:
        super().__init__(reason)
        self.fresh_room, self.url = fresh_room, url


class Metrics:
    """The proxy's Prometheus series, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvd_proxy_requests", "Client requests by outcome (ok, "
                                "client_error, failed, cancelled)", ["outcome"], registry=r)
        self.attempts = Counter("kvd_proxy_attempts", "Legs sent, by role and outcome (ok, "
                                "client_error, retried, cancelled)", ["role", "outcome"],
                                registry=r)
        self.leg_s = Histogram("kvd_proxy_leg_seconds", "Seconds of each leg (decode: until "
                               "the response started)", ["role"], registry=r,
                               buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120))
        self.outstanding = Gauge("kvd_proxy_outstanding", "Requests in flight per server",
                                 ["role", "server"], registry=r)
        self.healthy = Gauge("kvd_proxy_server_healthy", "1 while a server takes requests",
                             ["role", "server"], registry=r)
        self.releases = Counter("kvd_proxy_releases", "Rooms the proxy ended on a prefill, "
                                "by outcome (released, ended, refused, unknown, "
                                "unreachable)", ["outcome"], registry=r)
        self.refused = Counter("kvd_proxy_refused", "Requests refused before forwarding "
                               "(bad_host, unauthenticated, body_timeout, body_too_large)",
                               ["reason"], registry=r)

    def refusal(self, status: int) -> None:
        """Count one refusal of :class:`kvd.proxy.guard.ProxyGuard` by its status."""
        self.refused.labels(_REFUSALS.get(status, str(status))).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Proxy:
    """The routing state of one proxy (pools, HTTP client, metrics)."""

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.pools = {"prefill": Pool.of("prefill", list(config.prefill), config.max_failures),
                      "decode": Pool.of("decode", list(config.decode), config.max_failures)}
        self.client = client or httpx.AsyncClient(timeout=config.timeout, trust_env=False,
                                                  limits=httpx.Limits(max_connections=None))
        self.metrics = Metrics()
        self._releases: set[asyncio.Task[None]] = set()
        self._index = {(role, s.url): i for role, pool in self.pools.items()
                       for i, s in enumerate(pool.servers)}
        self._gauges()

    def label(self, role: str, server: Server) -> str:
        """How answers and metrics name ``server``: its URL with ``expose_servers``, else
        its index in its role's list (``"0"``)."""
        return server.url if self.config.expose_servers else str(self._index[role, server.url])

    def name(self, role: str, server: Server) -> str:
        """``server`` in a message to a client: ``prefill http://...`` or ``prefill #0``."""
        label = self.label(role, server)
        return f"{role} {label}" if self.config.expose_servers else f"{role} #{label}"

    def _gauges(self) -> None:
        for role, pool in self.pools.items():
            for s in pool.servers:
                self.metrics.outstanding.labels(role, self.label(role, s)).set(s.outstanding)
                self.metrics.healthy.labels(role, self.label(role, s)).set(int(s.healthy))

    # ---- one client request -----------------------------------------------------------

    async def handle(self, path: str, request: Request) -> Response:
        """Forward one request; a client that leaves cancels it (499 for the record)."""
        try:
            body = _json_object(await request.body())
            prefill_body(body, 0)  # validates what the split needs (n)
        except (ValueError, LegError) as exc:
            self.metrics.requests.labels("client_error").inc()
            return _error(400, f"invalid request: {exc}", "invalid_request_error")
        work = asyncio.ensure_future(self._attempts(path, body))
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            gone.cancel()
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        self.metrics.requests.labels("cancelled").inc()
        log.info("client left during %s: both legs cancelled", path)
        return Response(status_code=499)

    async def _attempts(self, path: str, body: dict[str, Any]) -> Response:
        tried: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        attempt: Attempt | None = None  # the prefill's hand-off no decode took yet
        last = "no attempt"
        try:
            for _ in range(self.config.retries + 1):
                try:
                    if attempt is None:
                        answer = await self._prefill(path, body, tried["prefill"])
                        if isinstance(answer, Response):
                            self.metrics.requests.labels("client_error").inc()
                            return answer
                        attempt = answer
                    response = await self._decode(path, body, attempt.params, tried["decode"])
                    if 400 <= response.status_code < 500:  # refused: nobody claims the rooms
                        self._end(attempt, f"the decode refused the request "
                                           f"({response.status_code})")
                    attempt = None  # the decode has it (or refused it: ended above)
                    if not isinstance(response, StreamingResponse):  # a stream: at its end
                        self.metrics.requests.labels(
                            "ok" if response.status_code < 400 else "client_error").inc()
                    return response
                except Retry as exc:
                    last = str(exc)
                    if exc.fresh_room and attempt is not None:  # this hand-off is abandoned
                        self._end(attempt, f"the attempt failed ({exc}); retried")
                        attempt = None
                    log.warning("attempt failed at %s (%s); retrying%s", exc.url, exc,
                                "" if attempt is not None else " with a fresh room")
                except NoServer as exc:
                    last = str(exc)
                    break
        except asyncio.CancelledError:  # the client left: whatever was handed off ends
            if attempt is not None:
                self._end(attempt, "the client left")
            raise
        if attempt is not None:
            self._end(attempt, f"no attempt succeeded: {last}")
        self.metrics.requests.labels("failed").inc()
        return _error(502, f"no attempt succeeded: {last}", "proxy_error")

    def _end(self, attempt: Attempt, reason: str) -> None:
        """End the attempt's rooms on the prefill with its release token, in the
        background (K45, K46): the proxy is the party that knows no decode will claim
        them, so the prefill frees their KV now instead of at kvd's bootstrap timeout."""
        target = release_of(attempt.params, attempt.token, reason)
        if target is None:
            return
        task = asyncio.create_task(self._release(*target), name="proxy-release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, addr: str, release: dict[str, Any]) -> None:
        """POST the release until every room has an outcome other than ``unknown`` (the
        prefill engine creates its rooms a step after it answered) or
        :data:`RELEASE_PATIENCE` s passed; each room's outcome is counted once."""
        url, delay = f"http://{addr}{RELEASE_PATH}", 0.02
        deadline = time.monotonic() + RELEASE_PATIENCE
        pending = list(release["rooms"])
        while pending:
            outcomes = await self._release_once(url, {**release, "rooms": pending})
            if outcomes is None:
                self.metrics.releases.labels("unreachable").inc(len(pending))
                return
            for room in list(pending):
                outcome = outcomes.get(str(room), "unknown")
                if outcome != "unknown":
                    pending.remove(room)
                    self.metrics.releases.labels(outcome).inc()
            if pending and time.monotonic() + delay > deadline:
                self.metrics.releases.labels("unknown").inc(len(pending))
                log.warning("release: rooms %s unknown at %s after %.0f s", pending, addr,
                            RELEASE_PATIENCE)
                return
            if pending:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _release_once(self, url: str, release: dict[str, Any]) -> dict[str, str] | None:
        """One release request: each room's outcome, or None if it was not answered."""
        try:
            r = await self.client.post(url, json=release, timeout=10.0)
            if r.status_code == 429:
                return {}
            answer = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("release at %s failed: %s", url, type(exc).__name__)
            return None
        rooms = answer.get("rooms") if isinstance(answer, dict) else None
        if not isinstance(rooms, dict):
            log.warning("release at %s answered %d", url, r.status_code)
            return None
        return {str(k): str(v) for k, v in rooms.items()}

    async def _prefill(self, path: str, body: dict[str, Any],
                       tried: set[str]) -> Attempt | Response:
        """The prefill leg: the attempt (its transfer params, None if it handed nothing
        off, and its release token), or the engine's 4xx answer for the client. Raises
        Retry."""
        server = self.pools["prefill"].choose(tried)
        tried.add(server.url)
        token = new_token()
        leg = prefill_body(body, new_room(), token)
        r = await self._leg("prefill", server, lambda: self.client.post(
            f"{server.url}{path}", json=leg))
        if r.status_code >= 400:
            return _forward(r, r.content)
        try:
            return Attempt(transfer_params(r.json()), token)
        except ValueError as exc:
            raise Retry(f"{self.name('prefill', server)} answered no JSON: {exc}",
                        url=server.url) from exc

    async def _decode(self, path: str, body: dict[str, Any], params: dict[str, Any] | None,
                      tried: set[str]) -> Response:
        server = self.pools["decode"].choose(tried)
        leg = decode_body(body, params)
        tried.add(server.url)
        req = self.client.build_request("POST", f"{server.url}{path}", json=leg)
        r = await self._leg("decode", server, lambda: self.client.send(req, stream=True),
                            keep=True)
        if not body.get("stream"):
            try:
                content = await r.aread()
            finally:
                await self._done(server, r)
            return _forward(r, content)
        return StreamingResponse(self._relay(server, r), status_code=r.status_code,
                                 headers=_headers(r), media_type=r.headers.get("content-type"))

    async def _leg(self, role: str, server: Server,
                   send: Callable[[], Awaitable[httpx.Response]],
                   keep: bool = False) -> httpx.Response:
        """Send one leg to ``server``, counting it as outstanding there (``keep``: until
        :meth:`_done`, for a streamed body). Raises Retry for transport errors and 5xx."""
        pool, started = self.pools[role], time.perf_counter()
        self._busy(role, server, +1)
        try:
            r = await send()
        except asyncio.CancelledError:
            self._busy(role, server, -1)
            self.metrics.attempts.labels(role, "cancelled").inc()
            raise
        except httpx.HTTPError as exc:
            self._busy(role, server, -1)
            pool.failed(server)
            self._gauges()
            self.metrics.attempts.labels(role, "retried").inc()
            never_sent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
            raise Retry(f"{self.name(role, server)} unreachable: {type(exc).__name__}",
                        fresh_room=role == "prefill" or not never_sent,
                        url=server.url) from exc
        self.metrics.leg_s.labels(role).observe(time.perf_counter() - started)
        if r.status_code >= 500:
            with contextlib.suppress(httpx.HTTPError):
                await r.aread()
            await self._done(server, r, role)
            pool.failed(server)
            self._gauges()
            self.metrics.attempts.labels(role, "retried").inc()
            raise Retry(f"{self.name(role, server)} answered {r.status_code}", url=server.url)
        pool.ok(server)
        server.served += 1
        self.metrics.attempts.labels(role, "ok" if r.status_code < 400 else
                                     "client_error").inc()
        if not keep:
            self._busy(role, server, -1)
        return r

    async def _relay(self, server: Server, r: httpx.Response) -> AsyncIterator[bytes]:
        """The decode's stream, chunk by chunk; closing it (the client left) closes the
        decode request, and the decode engine aborts it."""
        outcome = "cancelled"
        try:
            async for chunk in r.aiter_raw():
                yield chunk
            outcome = "ok" if r.status_code < 400 else "client_error"
        finally:
            self.metrics.requests.labels(outcome).inc()
            await self._done(server, r)

    async def _done(self, server: Server, r: httpx.Response, role: str = "decode") -> None:
        await r.aclose()
        self._busy(role, server, -1)

    def _busy(self, role: str, server: Server, delta: int) -> None:
        server.outstanding += delta
        self.metrics.outstanding.labels(role, self.label(role, server)).set(server.outstanding)

    # ---- health -------------------------------------------------------------------------

    async def probe_all(self) -> None:
        """One health probe of every server (concurrently)."""
        await asyncio.gather(*(self._probe(pool, s) for pool in self.pools.values()
                               for s in pool.servers))
        self._gauges()

    async def _probe(self, pool: Pool, server: Server) -> None:
        try:
            r = await self.client.get(f"{server.url}/health",
                                      timeout=max(self.config.health_interval, 1.0))
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            pool.ok(server)
        else:
            pool.failed(server)

    async def health_loop(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # a bug in one round must not stop the next
                log.exception("health probe round failed")
            await asyncio.sleep(self.config.health_interval)

    def health(self) -> tuple[int, dict[str, Any]]:
        """``GET /health``: 200 while each role has a healthy server; each server by its
        index (and its URL with ``expose_servers``)."""
        view = {role: [{"index": i, **({"url": s.url} if self.config.expose_servers else {}),
                        "healthy": s.healthy, "outstanding": s.outstanding,
                        "failures": s.failures, "served": s.served}
                       for i, s in enumerate(pool.servers)]
                for role, pool in self.pools.items()}
        up = all(any(s.healthy for s in pool.servers) for pool in self.pools.values())
        return (200 if up else 503), {"status": "ok" if up else "degraded", **view}


def make_app(config: ProxyConfig, client: httpx.AsyncClient | None = None,
             loopback: bool = False) -> FastAPI:
    """The proxy app; ``client`` reaches the engines (tests pass one over a mock
    transport). Health probes run while the app's lifespan runs (``health_interval`` > 0).
    ``loopback``: the listener is a loopback address (Host headers are checked).

    Raises :class:`kvd.errors.ConfigError` if ``config.token_file`` is refused.
    """
    token = read_token_file(config.token_file) if config.token_file is not None else None
    proxy = Proxy(config, client)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = (asyncio.create_task(proxy.health_loop(), name="proxy-health")
                if config.health_interval > 0 else None)
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await proxy.client.aclose()

    app = FastAPI(title="kvd PD proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.proxy = proxy
    app.add_middleware(ProxyGuard, token=token, max_body=config.max_body,
                       body_timeout=config.body_timeout, loopback=loopback,
                       on_refusal=proxy.metrics.refusal)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.get("/health")
    async def health() -> JSONResponse:
        code, body = proxy.health()
        return JSONResponse(body, code)

    @app.get("/v1/models")
    async def models() -> Response:
        server = proxy.pools["decode"].choose()
        try:
            r = await proxy.client.get(f"{server.url}/v1/models")
        except httpx.HTTPError as exc:
            log.warning("decode %s unreachable for /v1/models: %s", server.url, exc)
            return _error(502, f"{proxy.name('decode', server)} unreachable: "
                               f"{type(exc).__name__}", "proxy_error")
        return _forward(r, r.content)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object that can be forwarded as it came. Raises
    ValueError (the client's 400, never a 500) for invalid JSON, nesting deeper than the
    parser's recursion limit, a string that is not Unicode text (a lone surrogate
    ``\\ud800`` parses but cannot be sent as UTF-8), or anything but an object."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise LegError("the request body must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ValueError("a string in the body is not valid Unicode (lone surrogate)") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    return body


def _headers(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower() not in _DROP_HEADERS}


def _forward(r: httpx.Response, content: bytes) -> Response:
    return Response(content, r.status_code, headers=_headers(r))


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)
