"""What every HTTP request passes before the app sees it (cases S03, S14).

:class:`RequestGuard` is a pure ASGI middleware, outermost in the app, so nothing
has read the body yet when it runs. In order, per request:

1. On a loopback listener, the ``Host`` header must name a loopback host (a web
   page that rebinds its DNS name to 127.0.0.1 sends its own name: refused, 400).
2. The route's :class:`RoutePolicy` says whether it needs the cluster secret and
   how large its body may be. Open: ``GET /health``, ``/ready``, ``/metrics``
   (liveness, readiness and scraping must work without the secret; they carry no
   room ids or addresses). Everything else, unknown paths included, needs it.
3. A declared ``Content-Length`` above the route's cap: 413, body unread.
4. The ``KVD-HMAC`` authorization is checked from the headers alone (401 with the
   answering instance in ``KVD-Instance``, body unread).
5. The body is read up to the cap within ``body_timeout`` seconds (413 / 408), and
   its SHA-256 must be the one the signature covers (401).

Every refusal answers ``Connection: close``: a body the client is still sending
is never read. Starlette's ``TrustedHostMiddleware`` is not used because it
splits the Host header on the first ``:``, which breaks ``[::1]:port``.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvd.errors import AuthError, Skewed
from kvd.protocol.release import RELEASE_BODY_LIMIT
from kvd.security import CLOCK_HEADER, HEADER, INSTANCE_HEADER, Authenticator

log = logging.getLogger(__name__)

#: Paths served without the secret (GET only). Clients do not sign requests to these.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
#: The release route (rooms ended by their opener's token, K45/K46).
RELEASE_PATH = "/v1/rooms/release"
#: Largest ``PUT /route`` body (bytes). An SGLang registration is a few hundred bytes.
ROUTE_BODY_LIMIT = 64 << 10


@dataclass(frozen=True)
class RoutePolicy:
    """``auth``: the request must carry a valid KVD-HMAC; ``max_body``: bytes."""

    auth: bool = True
    max_body: int = 0


OPEN = RoutePolicy(auth=False, max_body=0)
SIGNED = RoutePolicy(auth=True, max_body=0)

#: Per (method, path); anything not listed is :data:`SIGNED` with no body. A release
#: (K45/K46) is not signed with the cluster secret: the room's own release token is its
#: authority (:mod:`kvd.protocol.release`; any secret holder could end any room, S11).
DEFAULT_POLICIES: Mapping[tuple[str, str], RoutePolicy] = {
    **{("GET", p): OPEN for p in OPEN_PATHS},
    ("PUT", "/route"): RoutePolicy(auth=True, max_body=ROUTE_BODY_LIMIT),
    ("POST", RELEASE_PATH): RoutePolicy(auth=False, max_body=RELEASE_BODY_LIMIT),
}

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """True for a loopback name or address (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    host = host.strip("[]").split("%")[0]
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host part of a ``Host`` header (``[::1]:80`` -> ``::1``; ``a:80`` -> ``a``)."""
    if header.startswith("["):
        host, sep, _ = header[1:].partition("]")
        return host if sep else ""
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class Refusal(Exception):
    """A request refused before the app ran: ``status`` and a one-line ``text``."""

    def __init__(self, status: int, text: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(text)
        self.status, self.text, self.headers = status, text, headers or {}


class RequestGuard:
    """ASGI middleware enforcing host, route policy, body cap and authentication.

    ``auth`` None or disabled: no signatures are checked (insecure mode), caps and
    timeouts still apply. ``loopback``: check the Host header. ``body_timeout`` in
    seconds. ``on_auth_failure`` is told about each refused signature.
    """

    def __init__(self, app: ASGIApp, auth: Authenticator | None = None,
                 policies: Mapping[tuple[str, str], RoutePolicy] = DEFAULT_POLICIES,
                 loopback: bool = False, body_timeout: float = 10.0,
                 on_auth_failure: Callable[[AuthError], None] | None = None) -> None:
        self.app, self.auth, self.policies = app, auth, policies
        self.loopback, self.body_timeout = loopback, body_timeout
        self.on_auth_failure = on_auth_failure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._admit(scope, receive)
        except Refusal as exc:
            await _refuse(send, exc)
            return
        if body is None:  # the client went away
            return
        await self.app(scope, replay(body, receive), send)

    async def _admit(self, scope: Scope, receive: Receive) -> bytes | None:
        headers = headers_of(scope)
        if self.loopback:
            self._check_host(headers.get("host", ""))
        policy = self.policies.get((scope["method"], scope["path"]), SIGNED)
        declared = content_length(headers)
        if declared is not None and declared > policy.max_body:
            raise Refusal(413, f"body of {declared} bytes over this route's limit of "
                               f"{policy.max_body}")
        checking = policy.auth and self.auth is not None and self.auth.enabled
        claim = self._check_signature(scope, headers) if checking else None
        body = await self._read_body(receive, policy.max_body)
        if claim is not None and body is not None:
            assert self.auth is not None
            try:
                self.auth.check_http_body(claim, hashlib.sha256(body).hexdigest())
            except AuthError as exc:
                raise self._unauthenticated(exc) from exc
        return body

    def _check_host(self, host: str) -> None:
        if not is_loopback(host_of(host)):
            raise Refusal(400, "bad Host header: this listener serves loopback names only")

    def _check_signature(self, scope: Scope, headers: dict[str, str]) -> Any:
        assert self.auth is not None
        try:
            return self.auth.check_http_headers(headers.get(HEADER.lower()), scope["method"],
                                                scope["path"],
                                                scope["query_string"].decode("latin-1"))
        except AuthError as exc:
            raise self._unauthenticated(exc) from exc

    def _unauthenticated(self, exc: AuthError) -> Refusal:
        if self.on_auth_failure is not None:
            self.on_auth_failure(exc)
        assert self.auth is not None
        headers = {INSTANCE_HEADER: self.auth.instance_id}
        if isinstance(exc, Skewed):  # the client's clock is off ours: say by how much (K40)
            headers[CLOCK_HEADER] = f"{exc.offset_s:.3f}"
        return Refusal(401, f"unauthenticated: {exc}", headers)

    async def _read_body(self, receive: Receive, limit: int) -> bytes | None:
        return await read_body(receive, limit, self.body_timeout)


async def read_body(receive: Receive, limit: int, seconds: float) -> bytes | None:
    """The whole request body, at most ``limit`` bytes, within ``seconds``; None
    if the client disconnected. Raises :class:`Refusal` 413 as soon as the body passes
    ``limit`` (declared or chunked: nothing past it is read) and 408 at the deadline."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(seconds):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise Refusal(413, f"body over this route's limit of {limit} bytes")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise Refusal(408, f"request body not received within {seconds:g}s") from None


def headers_of(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def content_length(headers: dict[str, str]) -> int | None:
    value = headers.get("content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise Refusal(400, "bad Content-Length")
    return int(value)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then defers."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Send, refusal: Refusal) -> None:
    await respond(send, refusal.status, (refusal.text + "\n").encode(),
                  "text/plain; charset=utf-8", refusal.headers)


async def respond(send: Send, status: int, body: bytes, content_type: str,
                  headers: Mapping[str, str] | None = None) -> None:
    """Send a whole response that closes the connection (``Connection: close``: a body
    the client is still sending is never read)."""
    raw = [(b"content-type", content_type.encode()),
           (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
