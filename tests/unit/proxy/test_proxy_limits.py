"""kvd proxy as a public HTTP service (case S20): body caps, body and head deadlines, the
connection cap, the bearer token, and answers that name no engine address. Driven as
ASGI (kvd.proxy.guard, the app over httpx's ASGI transport) and over raw sockets to the
real server (kvd.proxy.serve: uvicorn on loopback, in this process)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvd.bootstrap.server import ConnectionGuard
from kvd.errors import ConfigError
from kvd.proxy.app import ProxyConfig, make_app
from kvd.proxy.guard import ProxyGuard, bearer_matches, read_token_file
from kvd.proxy.serve import limits_of, serve
from tests.unit.proxy.test_proxy_app import Engines, proxy_app

TOKEN = "0123456789abcdef-proxy-token"


class Recorder:
    """An ASGI app that reads the whole body and answers 200 with it."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


class Call:
    """One request through a guard; counts the body chunks the guard pulled."""

    def __init__(self, method: str, path: str, chunks: list[bytes] | None = None,
                 headers: dict[str, str] | None = None, stall: bool = False) -> None:
        self.chunks, self.pulled, self.stall = list(chunks or [b""]), 0, stall
        hdrs = {"host": "127.0.0.1:8000", **(headers or {})}
        self.scope = {"type": "http", "method": method, "path": path, "query_string": b"",
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

    async def run(self, guard: ProxyGuard) -> int:
        await guard(self.scope, self.receive, self.send)
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]}

    @property
    def error(self) -> dict[str, Any]:
        return dict(json.loads(self.sent[1]["body"])["error"])


def token_file(tmp_path: Path, text: str = TOKEN + "\n", mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return path


# ---- body cap and deadline (ASGI) ---------------------------------------------------------

async def test_s20_declared_body_over_the_cap_is_refused_unread() -> None:
    app = Recorder()
    call = Call("POST", "/v1/completions", [b"x" * 65536] * 10,
                {"content-length": str(300 << 20)})
    assert await call.run(ProxyGuard(app, max_body=1 << 20)) == 413  # type: ignore[arg-type]
    assert call.pulled == 0 and app.bodies == []
    assert call.headers["connection"] == "close"  # the rest is never read
    assert call.headers["content-type"] == "application/json"
    assert call.error["code"] == 413 and "314572800 bytes" in call.error["message"]


async def test_s20_chunked_body_over_the_cap_stops_at_the_cap() -> None:
    app, chunk, cap = Recorder(), b"x" * 4096, 64 << 10
    call = Call("POST", "/v1/chat/completions", [chunk] * 1000)  # no Content-Length
    assert await call.run(ProxyGuard(app, max_body=cap)) == 413  # type: ignore[arg-type]
    assert call.pulled * len(chunk) <= cap + len(chunk) and app.bodies == []


async def test_s20_a_body_on_any_other_route_is_refused() -> None:
    call = Call("POST", "/v1/models", [b"{}"], {"content-length": "2"})
    assert await call.run(ProxyGuard(Recorder())) == 413  # type: ignore[arg-type]
    assert call.pulled == 0


async def test_s20_body_under_the_cap_reaches_the_app_whole() -> None:
    app, body = Recorder(), b'{"prompt": "' + b"y" * 5000 + b'"}'
    call = Call("POST", "/v1/completions", [body[:7], body[7:4000], body[4000:]],
                {"content-length": str(len(body))})
    assert await call.run(ProxyGuard(app, max_body=len(body))) == 200  # type: ignore[arg-type]
    assert app.bodies == [body]


async def test_s20_a_body_never_finished_is_answered_408() -> None:
    call = Call("POST", "/v1/completions", headers={"content-length": str(1 << 20)},
                stall=True)
    guard = ProxyGuard(Recorder(), body_timeout=0.05)  # type: ignore[arg-type]
    assert await asyncio.wait_for(call.run(guard), 30) == 408
    assert call.headers["connection"] == "close" and call.error["code"] == 408


async def test_s20_a_loopback_listener_serves_loopback_names_only() -> None:
    guard = ProxyGuard(Recorder(), loopback=True)  # type: ignore[arg-type]
    rebound = Call("GET", "/health", headers={"host": "attacker.example:8000"})
    assert await rebound.run(guard) == 400
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert await Call("GET", "/health", headers={"host": host}).run(guard) == 200


@pytest.mark.parametrize("raw", [b"[" * 200_000, b'{"a": ' * 100_000, b'{"prompt": "\\ud800"}',
                                 b"\xff\xfe", b"[1, 2]", b'"text"', b""])
async def test_s20_malformed_bodies_are_answered_400_never_500(raw: bytes) -> None:
    engines = Engines()
    app = proxy_app(engines)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as c:
        r = await c.post("/v1/completions", content=raw,
                         headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("invalid request: ")
    assert engines.seen == []


# ---- the bearer token ---------------------------------------------------------------------

def test_s20_bearer_compare() -> None:
    token = TOKEN.encode()
    assert bearer_matches(f"Bearer {TOKEN}", token)
    assert bearer_matches(f"bearer  {TOKEN} ", token)
    for bad in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}",
                "Bearer"):
        assert not bearer_matches(bad, token), bad


async def test_s20_requests_without_the_token_are_refused_before_forwarding(
        tmp_path: Path) -> None:
    engines = Engines()
    app = proxy_app(engines, token_file=token_file(tmp_path))
    body = {"model": "m", "prompt": "hi"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as c:
        for headers in ({}, {"authorization": "Bearer wrong-token-of-some-length"},
                        {"authorization": TOKEN}):
            r = await c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "authentication_error"
        assert (await c.get("/v1/models")).status_code == 401
        assert engines.seen == []  # nothing reached an engine
        assert (await c.get("/health")).status_code == 200  # probes and scrapes are open
        metrics = (await c.get("/metrics")).text
        assert 'kvd_proxy_refused_total{reason="unauthenticated"} 4.0' in metrics
        r = await c.post("/v1/completions", json=body,
                         headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok from d0"
    assert [h for h, _ in engines.legs("")] == ["p0", "d0"]


@pytest.mark.parametrize("case", ["open", "group", "other_owner", "short",
                                  "empty", "missing", "directory"])
def test_s20_token_file_is_checked_like_a_secret(tmp_path: Path, case: str) -> None:
    path = token_file(tmp_path)
    if case == "open":
        path.chmod(0o644)
    elif case == "group":
        path.chmod(0o640)
    elif case == "other_owner":
        if os.geteuid() != 0:
            pytest.skip("chown needs root")
        os.chown(path, 4242, 4242)
    elif case == "short":
        path.write_text("short\n")
    elif case == "empty":
        path.write_text("")
    elif case == "missing":
        path = tmp_path / "absent"
    elif case == "directory":
        path = tmp_path
    with pytest.raises(ConfigError) as err:
        read_token_file(path)
    assert TOKEN not in str(err.value) and str(path) in str(err.value)
    with pytest.raises(ConfigError):
        make_app(ProxyConfig(("http://p",), ("http://d",), token_file=path))


def test_s20_token_file_behind_a_symlink_is_checked_where_it_points(tmp_path: Path) -> None:
    """The token file follows the one secret-file rule (kvd.filetrust): a link is followed
    (Kubernetes mounts secrets as links) and the file it reaches is checked."""
    link = tmp_path / "link"
    link.symlink_to(token_file(tmp_path))
    assert read_token_file(link) == TOKEN.encode()
    (tmp_path / "token").chmod(0o644)
    with pytest.raises(ConfigError, match=r"group or others|open"):
        read_token_file(link)


def test_s20_the_cli_refuses_a_token_file_open_to_others(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from kvd.cli.main import main

    path = token_file(tmp_path, mode=0o644)
    code = main(["proxy", "-p", "http://127.0.0.1:1", "-d", "http://127.0.0.1:2",
                 "--port", "0", "--token-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "open to group or others" in err and TOKEN not in err


def test_s20_first_line_is_the_token(tmp_path: Path) -> None:
    assert read_token_file(token_file(tmp_path, f"  {TOKEN}  \nrest\n")) == TOKEN.encode()


# ---- what the proxy tells the world -------------------------------------------------------

@pytest.mark.parametrize("expose", [False, True])
async def test_s20_health_metrics_and_errors_name_engines_only_when_asked(
        expose: bool) -> None:
    engines = Engines()

    async def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    engines.behaviour = {"p0": down}
    app = proxy_app(engines, retries=0, expose_servers=expose)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as c:
        health = (await c.get("/health")).text
        metrics = (await c.get("/metrics")).text
        failed = (await c.post("/v1/completions", json={"prompt": "x"})).text
    for text in (health, metrics, failed):
        assert ("http://p0" in text) is expose, text
    assert ('server="0"' in metrics) is not expose
    assert json.loads(health)["prefill"][0]["index"] == 0
    assert ("prefill #0 unreachable" in failed) is not expose


# ---- the real server: head deadline and connection cap ------------------------------------

@dataclass
class Served:
    port: int
    guard: ConnectionGuard


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    """``kvd proxy`` served in this process on loopback (engines unreachable: port 1),
    with the limits the test parametrizes."""
    config = ProxyConfig(("http://127.0.0.1:1",), ("http://127.0.0.1:1",), retries=0,
                         health_interval=0, **request.param)
    guard = ConnectionGuard(limits_of(config))
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, "127.0.0.1", 0, port.set_result, stop, guard))
    try:
        yield Served(await asyncio.wait_for(port, 30), guard)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def _open(port: int, head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    return reader, writer


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sent until it closed (poll until, within a generous bound)."""
    return await asyncio.wait_for(reader.read(), 60)


HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
BUSY_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
             b"Content-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"prompt\"")


async def _until(condition: Callable[[], bool]) -> None:
    """Poll until ``condition`` holds, within a generous bound."""
    for _ in range(6000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 60 s")


@pytest.mark.parametrize("served", [{"header_timeout": 0.5, "max_connections": 100}],
                         indirect=True)
async def test_s20_half_sent_heads_are_closed_at_the_header_deadline(served: Served) -> None:
    conns = [await _open(served.port, HALF_HEAD) for _ in range(40)]
    answers = await asyncio.gather(*(_closed_by_server(r) for r, _ in conns))
    assert answers == [b""] * 40  # closed, never answered
    assert served.guard.evicted == 0  # by the deadline, not by the cap
    for _, w in conns:
        w.close()
    async with httpx.AsyncClient() as c:  # the server still serves
        assert (await c.get(f"http://127.0.0.1:{served.port}/health")).status_code == 200


@pytest.mark.parametrize("served", [{"header_timeout": 60, "body_timeout": 60,
                                     "max_connections": 4}], indirect=True)
async def test_s20_the_connection_cap_evicts_idle_then_refuses_when_all_are_busy(
        served: Served) -> None:
    url = f"http://127.0.0.1:{served.port}/health"
    idle = [await _open(served.port, HALF_HEAD) for _ in range(4)]
    await _until(lambda: len(served.guard) == 4)
    async with httpx.AsyncClient() as c:  # a newcomer gets in: an idle one made room
        assert (await c.get(url)).status_code == 200
    assert await _closed_by_server(idle[0][0]) == b""
    assert served.guard.evicted == 1
    for _, w in idle:
        w.close()
    await _until(lambda: len(served.guard) == 0)
    busy = [await _open(served.port, BUSY_HEAD) for _ in range(4)]
    await _until(lambda: len(served.guard._busy) == 4)
    # every connection is busy (a body in progress): a newcomer is refused at once,
    # whatever it sends, and none of the busy ones is dropped for it
    for _ in range(3):
        newcomer, w = await _open(served.port,
                                  b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert await _closed_by_server(newcomer) == b""
        w.close()
    assert served.guard.refused == 3 and len(served.guard._busy) == 4
    for _, w in busy:
        w.write(b': "x"}')
        await w.drain()
    answers = [await _closed_by_server(r) for r, _ in busy]
    assert all(a.startswith(b"HTTP/1.1 502 ") for a in answers), answers
    for _, w in busy:
        w.close()
