"""kvd proxy against fake OpenAI servers (in process: httpx MockTransport + ASGI)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from kvd.proxy.app import Attempt, Proxy, ProxyConfig, make_app

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Engines:
    """Fake prefill/decode servers: records every request; behaviour per host."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []
        self.behaviour: dict[str, Handler] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        body = json.loads(request.content) if request.content else {}
        self.seen.append((host, request.url.path, body))
        if host in self.behaviour:
            return await self.behaviour[host](request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if host.startswith("p"):
            room = body["kv_transfer_params"]["bootstrap_room"]
            return httpx.Response(200, json={"kv_transfer_params": {
                "do_remote_prefill": True, "bootstrap_room": room, "from": host}})
        return httpx.Response(200, json={"choices": [{"text": f"ok from {host}"}],
                                         "got": body.get("kv_transfer_params")})

    def legs(self, prefix: str) -> list[tuple[str, dict[str, Any]]]:
        return [(h, b) for h, path, b in self.seen if h.startswith(prefix) and
                path.startswith("/v1/")]


def proxy_app(engines: Engines, prefill: int = 1, decode: int = 1, **cfg: Any) -> Any:
    config = ProxyConfig(tuple(f"http://p{i}" for i in range(prefill)),
                         tuple(f"http://d{i}" for i in range(decode)),
                         health_interval=0, **cfg)
    return make_app(config, httpx.AsyncClient(transport=httpx.MockTransport(engines)))


async def post(app: Any, body: dict[str, Any], path: str = "/v1/completions"
               ) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as c:
        return await c.post(path, json=body)


async def test_prefill_params_reach_the_decode_and_rooms_are_fresh() -> None:
    engines = Engines()
    app = proxy_app(engines)
    for _ in range(3):
        r = await post(app, {"model": "m", "prompt": "hi", "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok from d0"
    prefills, decodes = engines.legs("p"), engines.legs("d")
    rooms = [b["kv_transfer_params"]["bootstrap_room"] for _, b in prefills]
    assert len(set(rooms)) == 3 and all(0 <= x < 2**63 for x in rooms)
    assert [b["kv_transfer_params"]["bootstrap_room"] for _, b in decodes] == rooms
    assert all(b["max_tokens"] == 8 for _, b in decodes)
    assert all(b["max_tokens"] == 1 for _, b in prefills)


async def test_k33_n_goes_to_the_decode_and_the_prefill_sends_one_room_per_sample() -> None:
    engines = Engines()
    r = await post(proxy_app(engines), {"model": "m", "prompt": "hi", "n": 2,
                                        "min_tokens": 4, "max_tokens": 8})
    assert r.status_code == 200
    (_, p), (_, d) = engines.legs("p")[0], engines.legs("d")[0]
    assert p["n"] == 1 and "min_tokens" not in p
    assert p["kv_transfer_params"]["num_samples"] == 2
    assert d["n"] == 2 and d["min_tokens"] == 4


async def test_concurrent_requests_go_to_the_least_loaded_prefill() -> None:
    engines = Engines()
    release = asyncio.Event()

    arrived = asyncio.Semaphore(0)

    async def slow(request: httpx.Request) -> httpx.Response:
        arrived.release()
        await release.wait()
        room = json.loads(request.content)["kv_transfer_params"]["bootstrap_room"]
        return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True,
                                                                "bootstrap_room": room}})

    engines.behaviour = {"p0": slow, "p1": slow}
    app = proxy_app(engines, prefill=2)
    tasks = [asyncio.ensure_future(post(app, {"prompt": str(i)})) for i in range(4)]
    for _ in range(4):
        await asyncio.wait_for(arrived.acquire(), 10)
    assert sorted(h for h, _ in engines.legs("p")) == ["p0", "p0", "p1", "p1"]
    release.set()
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 4
    proxy: Proxy = app.state.proxy
    assert all(s.outstanding == 0 for pool in proxy.pools.values() for s in pool.servers)


async def test_a_failing_prefill_is_retried_elsewhere_with_a_fresh_room() -> None:
    engines = Engines()

    async def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": "overloaded"})

    engines.behaviour = {"p0": down}
    app = proxy_app(engines, prefill=2)
    app.state.proxy.pools["prefill"].servers[1].outstanding = 5  # p0 is chosen first
    r = await post(app, {"prompt": "x"})
    assert r.status_code == 200
    (h1, b1), (h2, b2) = engines.legs("p")
    assert (h1, h2) == ("p0", "p1")
    assert b1["kv_transfer_params"]["bootstrap_room"] != b2["kv_transfer_params"][
        "bootstrap_room"]
    assert engines.legs("d")[0][1]["kv_transfer_params"]["bootstrap_room"] == \
        b2["kv_transfer_params"]["bootstrap_room"]


async def test_an_unreachable_decode_is_retried_with_the_same_room() -> None:
    """The request never reached d0, so the prefill's KV still waits for a decode: d1
    takes the same room; the prompt is not prefilled twice."""
    engines = Engines()

    async def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    engines.behaviour = {"d0": refuse}
    app = proxy_app(engines, decode=2)
    app.state.proxy.pools["decode"].servers[1].outstanding = 5
    r = await post(app, {"prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok from d1"
    assert len(engines.legs("p")) == 1
    rooms = [b["kv_transfer_params"]["bootstrap_room"] for _, b in engines.legs("d")]
    assert len(rooms) == 2 and rooms[0] == rooms[1]


async def test_a_decode_that_failed_after_taking_the_request_restarts_from_prefill() -> None:
    engines = Engines()
    calls = {"n": 0}

    async def flaky(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            return httpx.Response(500, json={"error": "kv load failed"})
        return httpx.Response(200, json={"choices": [{"text": "second"}]})

    engines.behaviour = {"d0": flaky}
    r = await post(proxy_app(engines), {"prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "second"
    rooms = [b["kv_transfer_params"]["bootstrap_room"] for _, b in engines.legs("p")]
    assert len(rooms) == 2 and rooms[0] != rooms[1]


async def test_client_errors_pass_through_and_retries_are_bounded() -> None:
    engines = Engines()

    async def bad(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    async def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502)

    engines.behaviour = {"p0": bad}
    r = await post(proxy_app(engines), {"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
    assert not engines.legs("d")
    engines = Engines()
    engines.behaviour = {"p0": broken}
    app = proxy_app(engines, retries=2)
    r = await post(app, {"prompt": "x"})
    assert r.status_code == 502 and "prefill #0 answered 502" in r.json()["error"]["message"]
    assert len(engines.legs("p")) == 3
    r = await post(app, {"prompt": "x", "n": 0})
    assert r.status_code == 400 and "n must be" in r.json()["error"]["message"]


async def test_streams_are_relayed_chunk_by_chunk() -> None:
    engines = Engines()

    async def sse(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is True
        chunks = [b"data: {\"n\": 1}\n\n", b"data: {\"n\": 2}\n\n", b"data: [DONE]\n\n"]
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=httpx.ByteStream(b"".join(chunks)))

    engines.behaviour = {"d0": sse}
    app = proxy_app(engines)
    r = await post(app, {"prompt": "x", "stream": True}, "/v1/chat/completions")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.count("data:") == 3
    assert "stream" not in engines.legs("p")[0][1]
    text = app.state.proxy.metrics.render()
    assert b'kvd_proxy_requests_total{outcome="ok"} 1.0' in text


def _request(app: Any, body: dict[str, Any], gone: asyncio.Event) -> Request:
    """A request whose client disconnects when ``gone`` is set."""
    sent = {"body": False}

    async def receive() -> dict[str, Any]:
        if not sent["body"]:
            sent["body"] = True
            return {"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b"", "app": app}
    return Request(scope, receive)


async def test_k35_a_client_leaving_during_prefill_cancels_the_prefill_leg() -> None:
    engines = Engines()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def long_prefill(request: httpx.Request) -> httpx.Response:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    engines.behaviour = {"p0": long_prefill}
    app = proxy_app(engines)
    proxy: Proxy = app.state.proxy
    gone = asyncio.Event()
    handling = asyncio.ensure_future(proxy.handle("/v1/completions",
                                                  _request(app, {"prompt": "x"}, gone)))
    await asyncio.wait_for(started.wait(), 10)
    gone.set()
    response = await asyncio.wait_for(handling, 10)
    assert response.status_code == 499 and cancelled.is_set()
    assert not engines.legs("d")  # the decode leg never starts
    assert proxy.pools["prefill"].servers[0].outstanding == 0
    assert b'kvd_proxy_requests_total{outcome="cancelled"} 1.0' in proxy.metrics.render()


async def test_health_probes_take_a_dead_server_out_and_bring_it_back() -> None:
    engines = Engines()
    state = {"up": False}

    async def health(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200 if state["up"] else 503)
        return httpx.Response(200, json={"choices": []})

    engines.behaviour = {"d0": health}
    app = proxy_app(engines, max_failures=2)
    proxy: Proxy = app.state.proxy
    await proxy.probe_all()
    await proxy.probe_all()
    code, view = proxy.health()
    assert code == 503 and view["decode"][0]["healthy"] is False
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as c:
        assert (await c.get("/health")).status_code == 503
        text = (await c.get("/metrics")).text
    assert 'kvd_proxy_server_healthy{role="decode",server="0"} 0.0' in text
    state["up"] = True
    await proxy.probe_all()
    assert proxy.health()[0] == 200


@pytest.mark.parametrize("cli_args", [["--prefill", "p:1", "--decode", "http://d"]])
def test_cli_refuses_urls_without_a_scheme(cli_args: list[str]) -> None:
    from kvd.cli.main import main

    assert main(["proxy", *cli_args]) == 2


async def test_k35_a_client_leaving_between_the_legs_releases_the_room() -> None:
    """The prefill handed its KV off, the client left before any decode answered: the
    attempt's rooms are ended on the prefill with the attempt's release token."""
    engines = Engines()
    proxy: Proxy = proxy_app(engines).state.proxy
    params = {"do_remote_prefill": True, "bootstrap_room": 7, "bootstrap_rooms": [7, 8],
              "bootstrap_addr": "k0:1"}
    proxy._end(Attempt(params, "t" * 43), "the client left")
    await asyncio.gather(*proxy._releases)
    (host, body), = releases(engines)
    assert host == "k0" and body == {"rooms": [7, 8], "token": "t" * 43,
                                     "reason": "the client left"}


def releases(engines: Engines) -> list[tuple[str, dict[str, Any]]]:
    return [(h, b) for h, path, b in engines.seen if path == "/v1/rooms/release"]


def handing_off(engines: Engines) -> None:
    """Fake prefills answer like the vLLM connector: two rooms and a bootstrap address;
    fake kvds at k0 answer every release."""
    async def prefill(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        kv = json.loads(request.content)["kv_transfer_params"]
        return httpx.Response(200, json={"kv_transfer_params": {
            "do_remote_prefill": True, "bootstrap_room": kv["bootstrap_room"],
            "bootstrap_rooms": [kv["bootstrap_room"], 5], "bootstrap_addr": "k0:1"}})

    async def kvd(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return httpx.Response(200, json={"rooms": {str(r): "released" for r in body["rooms"]}})

    engines.behaviour.update({"p0": prefill, "p1": prefill, "k0": kvd})


async def test_k45_a_refused_request_releases_every_room_with_its_token() -> None:
    engines = Engines()
    handing_off(engines)

    async def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "n > 1 at temperature 0"})

    engines.behaviour["d0"] = refuse
    app = proxy_app(engines)
    r = await post(app, {"model": "m", "prompt": "hi", "n": 2, "temperature": 0})
    assert r.status_code == 400
    await asyncio.gather(*app.state.proxy._releases)
    (_, p), = engines.legs("p")
    token = p["kv_transfer_params"]["release_token"]
    (_, rel), = releases(engines)
    assert rel["rooms"] == [p["kv_transfer_params"]["bootstrap_room"], 5]
    assert rel["token"] == token and len(token) >= 22
    (_, d), = engines.legs("d")
    assert "release_token" not in json.dumps(d)  # the decode never sees the token


async def test_k45_a_successful_request_releases_nothing() -> None:
    engines = Engines()
    handing_off(engines)
    app = proxy_app(engines)
    assert (await post(app, {"model": "m", "prompt": "hi"})).status_code == 200
    await asyncio.gather(*app.state.proxy._releases)
    assert releases(engines) == []


async def test_k46_a_retried_attempt_never_leaves_its_rooms_behind() -> None:
    """The decode fails after taking the request (its kvd died): each abandoned attempt's
    rooms are released with that attempt's own token before/while the next one runs."""
    engines = Engines()
    handing_off(engines)

    async def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": "kvd gone"})

    engines.behaviour["d0"] = broken
    app = proxy_app(engines, prefill=2, retries=2)
    r = await post(app, {"model": "m", "prompt": "hi"})
    assert r.status_code == 502
    await asyncio.gather(*app.state.proxy._releases)
    tokens = [b["kv_transfer_params"]["release_token"] for _, b in engines.legs("p")]
    rooms = [b["kv_transfer_params"]["bootstrap_room"] for _, b in engines.legs("p")]
    assert len(tokens) == 3 and len(set(tokens)) == 3
    got = sorted((b["token"], b["rooms"][0]) for _, b in releases(engines))
    assert got == sorted(zip(tokens, rooms, strict=True))
    assert metric_value(app, 'kvd_proxy_releases_total{outcome="released"}') == 6.0


async def test_k46_rooms_the_prefill_does_not_know_yet_are_asked_again() -> None:
    engines = Engines()
    calls: list[list[int]] = []

    async def late(request: httpx.Request) -> httpx.Response:
        rooms = json.loads(request.content)["rooms"]
        calls.append(rooms)
        outcome = "unknown" if len(calls) == 1 else "released"
        return httpx.Response(200, json={"rooms": {str(r): outcome for r in rooms}})

    engines.behaviour["k0"] = late
    proxy: Proxy = proxy_app(engines).state.proxy
    proxy._end(Attempt({"bootstrap_rooms": [1, 2], "bootstrap_addr": "k0:1"}, "t" * 43), "x")
    await asyncio.gather(*proxy._releases)
    assert calls == [[1, 2], [1, 2]]


def metric_value(app: Any, series: str) -> float:
    for line in app.state.proxy.metrics.render().decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0
