"""One client request -> a prefill leg and a decode leg. PURE (dicts in, dicts out).

The prefill leg computes the prompt's KV and hands it to kvd: it asks for ONE token,
without streaming, with ``kv_transfer_params = {"do_remote_decode": true,
"bootstrap_room": R, "num_samples": n}``. Options that only make sense for the whole
request are adapted, never passed through to fail (K35): ``max_tokens`` and
``max_completion_tokens`` become 1, ``min_tokens`` goes (a minimum above one token would
be refused), ``n`` becomes 1 and ``best_of`` goes -- the decode produces the ``n``
samples, each from its own room (``num_samples``, K33) -- and streaming options go.

Each attempt also carries a fresh release token (``release_token``): the prefill binds
its digest to the attempt's rooms, and the proxy ends them with it (:func:`release_of`)
when it knows no decode will claim them (K45, K46).

The decode leg is the client's request, unchanged, plus the transfer params the prefill
answered (rooms, bootstrap address, blocks). A prefill that answered none (its one token
ended the request) leaves the decode to compute the prompt itself.
"""

from __future__ import annotations

import secrets
from typing import Any

from kvd.protocol.release import MAX_RELEASE_ROOMS

ROOM_LIMIT = 2**63
"""Rooms are below this (SGLang's routers and kvd's vLLM adapter use 63-bit rooms)."""

#: Options removed from the prefill leg (meaningful only for the whole request).
WHOLE_REQUEST_ONLY = ("stream", "stream_options", "min_tokens", "best_of")


class LegError(ValueError):
    """A request the proxy cannot split (answered 400, naming the field)."""


def new_room() -> int:
    """A fresh random room (one per attempt: a retry never reuses a room, K26)."""
    return secrets.randbelow(ROOM_LIMIT)


def samples(body: dict[str, Any]) -> int:
    """The request's ``n`` (default 1). LegError unless a positive int."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise LegError(f"n must be a positive integer, got {n!r}")
    return n


def prefill_body(body: dict[str, Any], room: int, token: str | None = None) -> dict[str, Any]:
    """The prefill leg of ``body`` (see the module docstring); ``token``: the attempt's
    release token (``release_token``, K45/K46)."""
    out = {k: v for k, v in body.items() if k not in WHOLE_REQUEST_ONLY}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "bootstrap_room": room,
                                 "num_samples": samples(body)}
    if token is not None:
        out["kv_transfer_params"]["release_token"] = token
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg of ``body``: the original request plus the prefill's params."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_params:
        out["kv_transfer_params"] = kv_params
    return out


def release_of(params: dict[str, Any] | None, token: str,
               reason: str) -> tuple[str, dict[str, Any]] | None:
    """Where and what to send to end an attempt's rooms (K45/K46): the prefill's
    ``bootstrap_addr`` and a ``POST /v1/rooms/release`` body naming every room of
    ``params`` (``bootstrap_rooms``, else ``bootstrap_room``) with ``token``. None when
    the params name no usable address or room (nothing was handed off)."""
    if not params:
        return None
    addr, rooms = params.get("bootstrap_addr"), params.get("bootstrap_rooms")
    if not isinstance(rooms, list) or not rooms:
        rooms = [params.get("bootstrap_room")]
    rooms = [r for r in rooms if isinstance(r, int) and not isinstance(r, bool)
             and 0 <= r < 2**64][:MAX_RELEASE_ROOMS]
    if not isinstance(addr, str) or ":" not in addr or not rooms:
        return None
    return addr, {"rooms": rooms, "token": token, "reason": reason[:256]}


def transfer_params(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill answer (JSON), or None."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) and params.get("do_remote_prefill") else None
