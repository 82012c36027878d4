"""kvd.bootstrap.client: requests signed for the instance that serves the address, learned
from /health, re-addressed once after a restart (case S09)."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from kvd.bootstrap import client as signed_http
from kvd.errors import AuthError
from kvd.security import HEADER, INSTANCE_HEADER, Authenticator

SECRET = b"0123456789abcdef-cluster"


class Server:
    """A stand-in kvd HTTP server: open /health, everything else signed for ``instance``."""

    def __init__(self, instance: str) -> None:
        self.auth = Authenticator(SECRET, instance)
        self.seen: list[httpx.Request] = []

    def restart(self, instance: str) -> None:
        self.auth = Authenticator(SECRET, instance)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"instance_id": self.auth.instance_id})
        try:
            claim = self.auth.check_http_headers(request.headers.get(HEADER), request.method,
                                                 request.url.path, request.url.query.decode())
            self.auth.check_http_body(claim, hashlib.sha256(request.content).hexdigest())
        except AuthError as exc:
            return httpx.Response(401, text=str(exc),
                                  headers={INSTANCE_HEADER: self.auth.instance_id})
        return httpx.Response(200, json={"ok": True})


async def test_signed_for_the_server_instance_and_readdressed_after_a_restart() -> None:
    server, recipients = Server("first"), signed_http.Recipients()
    auth = Authenticator(SECRET, "me")
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as c:
        r = await signed_http.request(c, auth, recipients, "PUT", "http://b:1/route",
                                      json={"rank_port": 1})
        assert r.status_code == 200 and recipients.get("b:1") == "first"
        assert [q.url.path for q in server.seen] == ["/health", "/route"]
        server.restart("second")
        server.seen.clear()
        r = await signed_http.request(c, auth, recipients, "GET", "http://b:1/route",
                                      params={"engine_rank": -1})
        assert r.status_code == 200 and recipients.get("b:1") == "second"
        assert [q.url.path for q in server.seen] == ["/route", "/route"]  # one retry


async def test_open_paths_go_unsigned() -> None:
    server = Server("x")
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as c:
        r = await signed_http.request(c, Authenticator(SECRET, "me"), signed_http.Recipients(),
                                      "GET", "http://b:1/health")
    assert r.status_code == 200 and HEADER not in server.seen[0].headers


def test_blocking_callers_too() -> None:
    server = Server("boot")
    with httpx.Client(transport=httpx.MockTransport(server)) as c:
        r = signed_http.request_sync(c, Authenticator(SECRET, "cli"), "GET",
                                     "http://b:1/v1/status")
        assert r.status_code == 200
        bad = signed_http.request_sync(c, Authenticator(b"not-the-secret-0123", "cli"), "GET",
                                       "http://b:1/v1/status")
        assert bad.status_code == 401  # a wrong secret is not retried into success


def test_a_server_that_names_no_instance_is_an_http_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as c, \
            pytest.raises(httpx.HTTPError, match="did not name its kvd instance"):
        signed_http.request_sync(c, Authenticator(SECRET, "cli"), "GET", "http://b:1/route")


def test_recipients_are_bounded() -> None:
    r = signed_http.Recipients(capacity=2)
    for i in range(5):
        r.set(f"h:{i}", str(i))
    assert r.get("h:0") is None and r.get("h:4") == "4"
