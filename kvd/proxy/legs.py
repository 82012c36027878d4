"""One client request -> a prefill leg and a decode leg. PURE (dicts in, dicts out).

The prefill leg computes the prompt's KV and hands it to kvd: it asks for ONE token,
without streaming, with ``kv_transfer_params = {"do_remote_decode": true,
"bootstrap_room": R, "num_samples": n}``. Options that only make sense for the whole
request are adapted, never passed through to fail (K35): ``max_tokens`` and
``max_completion_tokens`` become 1, ``min_tokens`` goes (a minimum above one token would
be refused), ``n`` becomes 1 and ``best_of`` goes -- the decode produces the ``n``
samples, each from its own room (``num_samples``, K33) -- and streaming options go.

The decode leg is the client's request, unchanged, plus the transfer params the prefill
answered (rooms, bootstrap address, blocks). A prefill that answered none (its one token
ended the request) leaves the decode to compute the prompt itself.
"""

from __future__ import annotations

import secrets
from typing import Any

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


def prefill_body(body: dict[str, Any], room: int) -> dict[str, Any]:
    """The prefill leg of ``body`` (see the module docstring)."""
    out = {k: v for k, v in body.items() if k not in WHOLE_REQUEST_ONLY}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "bootstrap_room": room,
                                 "num_samples": samples(body)}
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg of ``body``: the original request plus the prefill's params."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_params:
        out["kv_transfer_params"] = kv_params
    return out


def transfer_params(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill answer (JSON), or None."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) and params.get("do_remote_prefill") else None
