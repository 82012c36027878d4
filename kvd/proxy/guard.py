"""What every request to ``kvd proxy`` passes before the app sees it (case S20).

The proxy is a public HTTP service: it takes OpenAI requests from anyone who can reach
its port. :class:`ProxyGuard` is a pure ASGI middleware, outermost in the app, so
nothing has read the body yet when it runs. In order, per request:

1. On a loopback listener, the ``Host`` header must name a loopback host (DNS
   rebinding, as the daemon's listeners: :func:`kvd.bootstrap.guard.is_loopback`): 400.
2. The route's policy: ``GET /health`` and ``GET /metrics`` are open (probes and
   scrapers carry no token; they name no engine address unless ``--expose-servers``);
   everything else, unknown paths included, needs the bearer token when one is set.
3. A declared ``Content-Length`` above the route's cap (``max_body`` bytes for the
   completion routes, 0 elsewhere): 413, body unread.
4. ``Authorization: Bearer <token>``, compared in constant time: 401, body unread.
5. The body is read up to the cap within ``body_timeout`` seconds: 413 as soon as a
   body (chunked too) passes the cap, 408 at the deadline
   (:func:`kvd.bootstrap.guard.read_body`, the daemon's own reader).

Every refusal is an OpenAI-style JSON error and answers ``Connection: close``, so a
body the client is still sending is never read. Head deadlines and the connection cap
are the daemon's too (:class:`kvd.bootstrap.server.GuardedH11Protocol`), applied by
:mod:`kvd.proxy.serve`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from kvd.bootstrap.guard import (
    Refusal,
    content_length,
    headers_of,
    host_of,
    is_loopback,
    read_body,
    replay,
    respond,
)
from kvd.errors import ConfigError
from kvd.filetrust import read_secret_file

#: Paths served without the token (GET only): liveness and scraping.
OPEN_PATHS = frozenset({"/health", "/metrics"})
#: The routes that take a body (``max_body`` bytes at most).
BODY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Default cap of a request body (bytes): a 128k-token prompt as token ids is ~1 MiB.
DEFAULT_MAX_BODY = 4 << 20
#: Shortest token accepted (bytes; the cluster secret's minimum too).
MIN_TOKEN_BYTES = 16

_KINDS = {400: "invalid_request_error", 401: "authentication_error",
          408: "timeout_error", 413: "invalid_request_error"}


def read_token_file(path: Path) -> bytes:
    """The bearer token: the first line of ``path``, stripped; the file is checked like
    every secret file (:func:`kvd.filetrust.read_secret_file`: a regular file of this
    user or root, owner-only, in folders nobody else can change). Raises
    :class:`ConfigError` if the file is refused, empty or shorter than
    :data:`MIN_TOKEN_BYTES`."""
    data = read_secret_file(path, "proxy token file")
    token = (data.splitlines() or [b""])[0].strip()
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"proxy token file {path}: the token (its first line) must be at "
                          f"least {MIN_TOKEN_BYTES} bytes, it has {len(token)}")
    return token


def bearer_matches(header: str | None, token: bytes) -> bool:
    """True if ``header`` is ``Bearer <token>`` (scheme case-insensitive). The compare is
    constant-time in the token's content and length (digests of both are compared)."""
    scheme, _, given = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(hashlib.sha256(given.strip().encode("latin-1")).digest(),
                               hashlib.sha256(token).digest())


class ProxyGuard:
    """ASGI middleware enforcing host, token, body cap and body deadline (see the module
    docstring). ``token`` None: no authentication. ``max_body`` bytes, ``body_timeout``
    seconds; ``on_refusal`` is told each refusal's status (400, 401, 408 or 413). Raises
    nothing to the server: every refusal is answered (S20)."""

    def __init__(self, app: ASGIApp, token: bytes | None = None,
                 max_body: int = DEFAULT_MAX_BODY, body_timeout: float = 10.0,
                 loopback: bool = False,
                 on_refusal: Callable[[int], None] | None = None) -> None:
        self.app, self.token, self.max_body = app, token, max_body
        self.body_timeout, self.loopback, self.on_refusal = body_timeout, loopback, on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._admit(scope, receive)
        except Refusal as exc:
            if self.on_refusal is not None:
                self.on_refusal(exc.status)
            message = json.dumps({"error": {"message": exc.text, "code": exc.status,
                                            "type": _KINDS.get(exc.status, "proxy_error")}})
            await respond(send, exc.status, message.encode(), "application/json", exc.headers)
            return
        if body is None:  # the client went away
            return
        await self.app(scope, replay(body, receive), send)

    async def _admit(self, scope: Scope, receive: Receive) -> bytes | None:
        headers = headers_of(scope)
        if self.loopback and not is_loopback(host_of(headers.get("host", ""))):
            raise Refusal(400, "bad Host header: this proxy listens on loopback and serves "
                               "loopback names only")
        method, path = scope["method"], scope["path"]
        open_route = method in ("GET", "HEAD") and path in OPEN_PATHS
        limit = self.max_body if method == "POST" and path in BODY_PATHS else 0
        declared = content_length(headers)
        if declared is not None and declared > limit:
            raise Refusal(413, f"request body of {declared} bytes is over this route's "
                               f"limit of {limit} bytes")
        if self.token is not None and not open_route and \
                not bearer_matches(headers.get("authorization"), self.token):
            raise Refusal(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                          {"WWW-Authenticate": "Bearer"})
        return await read_body(receive, limit, self.body_timeout)
