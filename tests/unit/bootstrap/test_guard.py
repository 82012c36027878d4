"""kvd.bootstrap.guard (request admission before the app: host, route policy, body cap,
MAC from headers before the body) and kvd.bootstrap.server's ConnectionGuard (cases
S03, S04, S14), driven directly as ASGI / with fake connections."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvd.bootstrap.guard import ROUTE_BODY_LIMIT, RequestGuard, host_of, is_loopback
from kvd.bootstrap.server import ConnectionGuard, HttpLimits
from kvd.security import INSTANCE_HEADER, Authenticator

SECRET = b"0123456789abcdef-cluster"


class App:
    """An ASGI app that reads the whole body and answers 200 with its length."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.calls.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})


class Request:
    """One request through the guard; counts how many body chunks the guard pulled."""

    def __init__(self, method: str, path: str, chunks: list[bytes] | None = None,
                 headers: dict[str, str] | None = None, query: str = "",
                 stall: bool = False) -> None:
        self.chunks = list(chunks or [b""])
        self.pulled = 0
        self.stall = stall
        hdrs = {"host": "127.0.0.1:8998", **(headers or {})}
        self.scope = {"type": "http", "method": method, "path": path,
                      "query_string": query.encode(),
                      "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()]}
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.stall:
            await asyncio.sleep(3600)
        self.pulled += 1
        chunk = self.chunks.pop(0) if self.chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks)}

    async def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)

    async def run(self, guard: RequestGuard) -> int:
        await guard(self.scope, self.receive, self.send)
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]}


def signed(auth: Authenticator, to: str, method: str, path: str, body: bytes = b"",
           query: str = "") -> dict[str, str]:
    return {"content-length": str(len(body)),
            **auth.http_header(method, path, query, body, to)}


@pytest.fixture
def app() -> App:
    return App()


def guard(app: App, **kw: Any) -> RequestGuard:
    kw.setdefault("auth", Authenticator(SECRET, "boot"))
    return RequestGuard(app, **kw)  # type: ignore[arg-type]


async def test_s03_unauthenticated_body_is_refused_before_it_is_read(app: App) -> None:
    body = json.dumps({"rank_ip": "10.9.9.9"}).encode()
    req = Request("PUT", "/route", [body] * 100, {"content-length": str(100 * len(body))})
    assert await req.run(guard(app)) == 401
    assert req.pulled == 0 and app.calls == []
    assert req.headers["connection"] == "close"  # the rest of the body is never read
    assert req.headers[INSTANCE_HEADER.lower()] == "boot"


async def test_s03_declared_body_over_the_cap_is_refused_unread(app: App) -> None:
    peer = Authenticator(SECRET, "p")
    hdrs = signed(peer, "boot", "PUT", "/route", b"{}")
    hdrs["content-length"] = str(250 << 20)
    req = Request("PUT", "/route", [b"x" * 65536], hdrs)
    assert await req.run(guard(app)) == 413
    assert req.pulled == 0


async def test_s03_streamed_body_over_the_cap_stops_at_the_cap(app: App) -> None:
    peer = Authenticator(SECRET, "p")
    hdrs = signed(peer, "boot", "PUT", "/route", b"{}")
    del hdrs["content-length"]  # chunked: no declared length
    chunk = b"x" * 4096
    req = Request("PUT", "/route", [chunk] * 1000)
    req.scope["headers"] += [(k.lower().encode(), v.encode()) for k, v in hdrs.items()]
    assert await req.run(guard(app)) == 413
    assert req.pulled * len(chunk) <= ROUTE_BODY_LIMIT + len(chunk)


async def test_signed_request_reaches_the_app_with_its_body(app: App) -> None:
    peer = Authenticator(SECRET, "p")
    body = b'{"role": "Prefill"}'
    req = Request("PUT", "/route", [body[:5], body[5:]], signed(peer, "boot", "PUT", "/route",
                                                                 body))
    assert await req.run(guard(app)) == 200
    assert app.calls == [body]


async def test_a_body_other_than_the_signed_one_is_refused(app: App) -> None:
    peer = Authenticator(SECRET, "p")
    hdrs = signed(peer, "boot", "PUT", "/route", b'{"rank_ip": "10.0.0.1"}')
    req = Request("PUT", "/route", [b'{"rank_ip": "10.6.6.6"}'], hdrs)
    assert await req.run(guard(app)) == 401 and app.calls == []


async def test_s09_a_request_signed_for_another_instance_is_refused(app: App) -> None:
    peer = Authenticator(SECRET, "p")
    req = Request("GET", "/route", headers=signed(peer, "other-bootstrap", "GET", "/route"))
    assert await req.run(guard(app)) == 401
    assert req.headers[INSTANCE_HEADER.lower()] == "boot"


async def test_body_that_never_arrives_times_out(app: App) -> None:
    peer = Authenticator(SECRET, "p")
    req = Request("PUT", "/route", headers=signed(peer, "boot", "PUT", "/route", b"{}"),
                  stall=True)
    assert await req.run(guard(app, body_timeout=0.05)) == 408


@pytest.mark.parametrize("path", ["/v1/status", "/v1/rooms", "/docs", "/openapi.json",
                                  "/route", "/anything"])
async def test_s14_everything_but_the_open_paths_needs_the_secret(app: App, path: str) -> None:
    assert await Request("GET", path).run(guard(app)) == 401
    peer = Authenticator(SECRET, "p")
    ok = Request("GET", path, headers=signed(peer, "boot", "GET", path))
    assert await ok.run(guard(app)) == 200


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
async def test_open_paths_need_no_secret_but_take_no_body(app: App, path: str) -> None:
    assert await Request("GET", path).run(guard(app)) == 200
    big = Request("GET", path, [b"x" * 10], {"content-length": "10"})
    assert await big.run(guard(app)) == 413


@pytest.mark.parametrize("host,ok", [("127.0.0.1:8998", True), ("localhost:8998", True),
                                     ("[::1]:8998", True), ("127.0.0.1", True),
                                     ("evil.example:8998", False), ("10.0.0.1:8998", False),
                                     ("", False), ("[::1", False)])
async def test_s14_host_header_on_a_loopback_listener(app: App, host: str, ok: bool) -> None:
    req = Request("GET", "/health", headers={"host": host})
    assert await req.run(guard(app, loopback=True)) == (200 if ok else 400)
    other = Request("GET", "/health", headers={"host": host})
    assert await other.run(guard(app, loopback=False)) == 200


def test_host_parsing() -> None:
    assert host_of("[::1]:80") == "::1" and host_of("a.b:80") == "a.b"
    assert host_of("::1") == "::1" and host_of("x") == "x"
    assert is_loopback("127.5.5.5") and is_loopback("::1") and is_loopback("LOCALHOST")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


async def test_insecure_mode_checks_caps_but_no_signatures(app: App) -> None:
    g = guard(app, auth=Authenticator(None, "boot"))
    assert await Request("GET", "/v1/status").run(g) == 200
    assert await Request("PUT", "/route", [b"x"], {"content-length": str(1 << 30)}).run(g) == 413


# ---- ConnectionGuard ------------------------------------------------------------------------

class Conn:
    def __init__(self, name: str) -> None:
        self.name, self.evicted = name, False

    def evict(self) -> None:
        self.evicted = True

    def __repr__(self) -> str:
        return self.name


def make(max_connections: int = 3, fds: int = 10, limit: int = 10_000,
         reserve: int = 16) -> ConnectionGuard:
    return ConnectionGuard(HttpLimits(max_connections, reserve, 5.0), fd_count=lambda: fds,
                           fd_limit=lambda: limit, clock=lambda: 0.0)


def test_s04_idle_connections_make_room_never_served_ones_first() -> None:
    g = make(max_connections=3)
    kept, fresh1, fresh2 = Conn("kept"), Conn("fresh1"), Conn("fresh2")
    assert g.admit(kept)
    g.started(kept)
    g.finished(kept)  # a heartbeat prober's kept-alive connection
    assert g.admit(fresh1) and g.admit(fresh2)
    newcomer = Conn("new")
    assert g.admit(newcomer)
    assert fresh1.evicted and not fresh2.evicted and not kept.evicted
    assert g.admit(Conn("new2")) and fresh2.evicted and not kept.evicted
    assert g.admit(Conn("new3")) and newcomer.evicted and not kept.evicted
    assert len(g) == 3


def test_busy_connections_are_never_evicted_and_a_full_busy_house_refuses() -> None:
    g = make(max_connections=2)
    a, b = Conn("a"), Conn("b")
    for c in (a, b):
        assert g.admit(c)
        g.started(c)
    assert not g.admit(Conn("c")) and g.refused == 1
    assert not a.evicted and not b.evicted
    g.finished(a)
    assert g.admit(Conn("d")) and a.evicted
    g.release(b)
    assert len(g) == 1


def test_s04_file_descriptors_in_reserve_bound_connections() -> None:
    g = make(max_connections=1000, fds=900, limit=1024, reserve=100)
    assert g.capacity() == 24  # 1024 - 100 reserved - 900 other descriptors
    conns = [Conn(str(i)) for i in range(30)]
    for c in conns:
        assert g.admit(c)
    assert len(g) == 24 and sum(c.evicted for c in conns) == 6
    starved = make(fds=2000, limit=1024)
    assert starved.capacity() == 0 and not starved.admit(Conn("x"))


def test_per_request_warnings_are_held_back() -> None:
    import logging

    from kvd.bootstrap.server import PerRequestWarnings

    now = [0.0]
    f = PerRequestWarnings(60.0, clock=lambda: now[0])

    def rec(msg: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", level, __file__, 1, msg, None, None)

    assert f.filter(rec("Invalid HTTP request received."))
    assert not any(f.filter(rec("Invalid HTTP request received.")) for _ in range(1000))
    assert f.filter(rec("Unsupported upgrade request."))  # another kind
    assert f.filter(rec("an error", logging.ERROR))
    now[0] = 61.0
    passed = rec("Invalid HTTP request received.")
    assert f.filter(passed) and "1000 more held back" in passed.msg
