"""A minimal prefill/decode proxy for vLLM engines that move KV through kvd.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000

For each ``POST /v1/chat/completions`` or ``/v1/completions``:

1. pick a room (a random 63-bit ``bootstrap_room``, the router's job in SGLang terms);
2. send the request to the prefill engine with ``max_tokens=1``, no streaming and
   ``kv_transfer_params = {"do_remote_decode": true, "bootstrap_room": room}``;
3. forward the request, unchanged except for the ``kv_transfer_params`` the prefill
   response returned, to the decode engine, and return (or stream) its answer.

If the prefill returns no transfer params (e.g. its single token was EOS), the decode
engine computes the prompt itself. ``GET /health`` and ``GET /v1/models`` go to decode.
The response header ``x-kvd-prefill-ms`` tells how long the prefill leg took.
Only stdlib, FastAPI, httpx and uvicorn (kvd's own dependencies).
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ROOM_LIMIT = 2**63


def prefill_body(body: dict[str, Any], room: int) -> dict[str, Any]:
    """The prefill leg of ``body``: one output token, no stream, remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "bootstrap_room": room}
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg of ``body``: the original request plus the prefill's params."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_params:
        out["kv_transfer_params"] = kv_params
    return out


def make_app(prefill: str, decode: str, timeout: float = 600.0,
             client: httpx.AsyncClient | None = None) -> FastAPI:
    """The proxy app for one prefill and one decode engine (base URLs); ``client`` is the
    HTTP client to reach them (tests pass one with a mock transport)."""
    app = FastAPI(title="kvd PD proxy")
    client = client or httpx.AsyncClient(timeout=timeout)

    async def handle(path: str, request: Request) -> Response:
        body = await request.json()
        started = time.perf_counter()
        p = await client.post(f"{prefill}{path}", json=prefill_body(body, secrets.randbelow(
            ROOM_LIMIT)))
        if p.status_code != 200:
            return Response(p.content, p.status_code, media_type="application/json")
        prefill_ms = f"{(time.perf_counter() - started) * 1e3:.1f}"
        d_body = decode_body(body, p.json().get("kv_transfer_params"))
        headers = {"x-kvd-prefill-ms": prefill_ms}
        if body.get("stream"):
            return StreamingResponse(_stream(client, f"{decode}{path}", d_body),
                                     media_type="text/event-stream", headers=headers)
        d = await client.post(f"{decode}{path}", json=d_body)
        return Response(d.content, d.status_code, media_type="application/json",
                        headers=headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("/v1/completions", request)

    @app.get("/health")
    async def health() -> Response:
        d = await client.get(f"{decode}/health")
        return Response(d.content, d.status_code)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        d = await client.get(f"{decode}/v1/models")
        return JSONResponse(d.json(), d.status_code)

    return app


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]
                  ) -> AsyncIterator[bytes]:
    async with client.stream("POST", url, json=body) as r:
        async for chunk in r.aiter_raw():
            yield chunk


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="base URL of the prefill engine")
    ap.add_argument("--decode", required=True, help="base URL of the decode engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    uvicorn.run(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
