"""examples/pd_proxy.py: prefill leg with max_tokens=1 and a room, params forwarded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def proxy() -> Any:
    spec = importlib.util.spec_from_file_location("pd_proxy", REPO / "examples" / "pd_proxy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_legs(proxy: Any) -> None:
    body = {"model": "m", "messages": [], "max_tokens": 50, "stream": True,
            "max_completion_tokens": 50, "kv_transfer_params": {"junk": 1}}
    p = proxy.prefill_body(body, 42)
    assert p["max_tokens"] == p["max_completion_tokens"] == 1 and "stream" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "bootstrap_room": 42}
    d = proxy.decode_body(body, {"do_remote_prefill": True})
    assert d["max_tokens"] == 50 and d["kv_transfer_params"] == {"do_remote_prefill": True}
    assert "kv_transfer_params" not in proxy.decode_body(body, None)


async def test_proxy_forwards_the_prefill_params_to_decode(proxy: Any) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def engines(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "prefill":
            params = {"do_remote_prefill": True,
                      "bootstrap_room": body["kv_transfer_params"]["bootstrap_room"]}
            return httpx.Response(200, json={"kv_transfer_params": params})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    app = proxy.make_app("http://prefill", "http://decode", client=client)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                  "max_tokens": 8})
    assert r.status_code == 200 and r.json() == {"choices": [{"text": "ok"}]}
    assert "x-kvd-prefill-ms" in r.headers
    (p_host, p_body), (d_host, d_body) = seen
    assert (p_host, d_host) == ("prefill", "decode") and p_body["max_tokens"] == 1
    room = p_body["kv_transfer_params"]["bootstrap_room"]
    assert 0 <= room < 2**63 and d_body["max_tokens"] == 8
    assert d_body["kv_transfer_params"] == {"do_remote_prefill": True, "bootstrap_room": room}
