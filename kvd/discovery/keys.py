"""The etcd key layout of kvd's fleet discovery. PURE (no I/O).

One key per prefill rank::

    {etcd_prefix}/prefill/{instance name}/{dp}/{tp}/{pp}  ->  JSON registration

``etcd_prefix`` namespaces one cluster (``/kvd/<cluster>``); the *instance name* is
the ``bootstrap_addr`` a router hands to the engines in each request
(``bootstrap_host:bootstrap_port``), so routers need no change: a room's
``bootstrap_addr`` names the prefill instance, in etcd mode as a name only (no server
needs to listen there). The value is what the rank PUTs to ``/route`` today
(:class:`~kvd.bootstrap.table.PrefillRegistration`: parallel info, control endpoint,
instance id, page size).

etcd's JSON gateway carries keys and values base64-encoded (:func:`b64`, :func:`unb64`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

PREFILL = "prefill"


@dataclass(frozen=True, order=True)
class RankKey:
    """A prefill rank's place in its instance: (attn DP group, attn TP rank, PP stage)."""

    dp: int
    tp: int
    pp: int


def check_prefix(prefix: str) -> str:
    """``prefix`` normalised (no trailing ``/``); raises ValueError unless it is an
    absolute path of printable ASCII without spaces (``/kvd/prod-a``)."""
    p = prefix.rstrip("/")
    if not p.startswith("/") or len(p) < 2:
        raise ValueError(f"etcd_prefix {prefix!r} must be an absolute key path like /kvd/prod")
    if not all(33 <= ord(c) < 127 for c in p) or "//" in p:
        raise ValueError(f"etcd_prefix {prefix!r}: printable ASCII without spaces or '//' only")
    return p


def instances_prefix(prefix: str) -> str:
    """Every prefill rank of the cluster lives under this (ends with ``/``)."""
    return f"{prefix}/{PREFILL}/"


def instance_prefix(prefix: str, name: str) -> str:
    """Every rank of the prefill instance ``name`` lives under this (ends with ``/``)."""
    _check_name(name)
    return f"{prefix}/{PREFILL}/{name}/"


def rank_key(prefix: str, name: str, rank: RankKey) -> str:
    """The key of one prefill rank."""
    return f"{instance_prefix(prefix, name)}{rank.dp}/{rank.tp}/{rank.pp}"


def parse_rank_key(prefix: str, key: str) -> tuple[str, RankKey] | None:
    """(instance name, rank) of a key under :func:`instances_prefix`; None for any other
    key (a foreign or malformed one is ignored, never guessed at)."""
    head = instances_prefix(prefix)
    if not key.startswith(head):
        return None
    parts = key[len(head):].split("/")
    if len(parts) != 4 or not parts[0]:
        return None
    try:
        dp, tp, pp = (int(p) for p in parts[1:])
    except ValueError:
        return None
    if min(dp, tp, pp) < 0 or any(not p.isdigit() for p in parts[1:]):
        return None
    return parts[0], RankKey(dp, tp, pp)


def range_end(key: str) -> str:
    """etcd's ``range_end`` for "every key starting with ``key``": the key with its last
    byte incremented (keys here are ASCII, so no carry is needed)."""
    data = key.encode()
    return (data[:-1] + bytes([data[-1] + 1])).decode()


def b64(text: str | bytes) -> str:
    """Base64 of ``text`` (UTF-8), as etcd's JSON gateway wants keys and values."""
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def unb64(text: str) -> bytes:
    """Inverse of :func:`b64`; raises ValueError on bad base64."""
    return base64.b64decode(text, validate=True)


def _check_name(name: str) -> None:
    if not name or "/" in name or not all(33 <= ord(c) < 127 for c in name):
        raise ValueError(f"prefill instance name {name!r}: printable ASCII without '/' or "
                         f"spaces (it is the bootstrap_addr, host:port)")
