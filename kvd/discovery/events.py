"""Watch events as typed values, and the decode's view of the cluster's prefill ranks.
PURE (no I/O).

etcd's watch (and a range after a reconnect) gives raw key-values; :class:`View` turns
them into :data:`PeerEvent` values a membership machine can consume:

* :class:`PeerPut` -- a prefill rank registered, re-registered or restarted
  (``previous`` names the instance it replaced, when another one held the key);
* :class:`PeerDeleted` -- a rank's key is gone: its lease expired (the rank died or lost
  etcd for a whole TTL) or it deregistered on a clean shutdown.

Revisions are etcd's: every event names the store revision it happened at, and
:meth:`View.apply` drops anything older than what the view already holds for the key,
so a replayed or reordered event can never bring back a dead instance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvd.addr import join_hostport
from kvd.bootstrap.table import ParallelInfo, PrefillRegistration, RankInfo
from kvd.discovery.keys import RankKey, parse_rank_key, unb64


@dataclass(frozen=True)
class Entry:
    """One prefill rank as etcd holds it (``revision``: its key's mod revision)."""

    addr: str
    rank: RankKey
    reg: PrefillRegistration
    revision: int

    @property
    def instance(self) -> str:
        """The rank's instance id ("" if the registration names none)."""
        return self.reg.instance_id or ""

    @property
    def endpoint(self) -> str:
        """Its control endpoint, ``tcp://host:port``."""
        return f"tcp://{join_hostport(self.reg.rank_ip.strip('[]'), self.reg.rank_port)}"

    def rank_info(self) -> RankInfo:
        """The rank as a ``/route`` rank answer would name it."""
        return RankInfo(rank_ip=self.reg.rank_ip, rank_port=self.reg.rank_port,
                        instance_id=self.reg.instance_id)

    def parallel_info(self) -> ParallelInfo:
        """The instance's sizes (page size in tokens) as a ``/route`` answer names them."""
        r = self.reg
        return ParallelInfo(prefill_attn_tp_size=r.attn_tp_size, prefill_dp_size=r.attn_dp_size,
                            prefill_pp_size=r.pp_size, prefill_page_size=r.page_size)


@dataclass(frozen=True)
class PeerPut:
    """Prefill rank ``rank`` of instance name ``addr`` is registered as ``instance`` at
    control ``endpoint``; ``previous``: the instance id it replaced (a restart), None
    when the key was new or held by the same instance."""

    addr: str
    rank: RankKey
    instance: str
    endpoint: str
    revision: int
    previous: str | None = None
    previous_endpoint: str | None = None


@dataclass(frozen=True)
class PeerDeleted:
    """Prefill rank ``rank`` of ``addr`` (last known as ``instance`` at ``endpoint``) left
    etcd at ``revision``: lease expired, or deregistered."""

    addr: str
    rank: RankKey
    instance: str
    endpoint: str
    revision: int


PeerEvent = PeerPut | PeerDeleted


def decode_kv(prefix: str, kv: dict[str, Any]) -> Entry | None:
    """An :class:`Entry` from one gateway ``kv`` object; None if its key is not a prefill
    rank's or its value is not a valid registration (foreign data is ignored, not
    trusted: the registration is validated as ``PUT /route`` validates it)."""
    try:
        key = unb64(kv["key"]).decode()
        parsed = parse_rank_key(prefix, key)
        if parsed is None:
            return None
        reg = PrefillRegistration.model_validate(json.loads(unb64(kv.get("value", ""))))
        revision = int(kv.get("mod_revision", 0))
    except (KeyError, ValueError, TypeError, ValidationError, UnicodeDecodeError):
        return None
    addr, rank = parsed
    if (rank.dp, rank.tp, rank.pp) != (reg.attn_dp_rank, reg.attn_tp_rank, reg.pp_rank):
        return None  # a key that does not say what its value says is not believed
    return Entry(addr, rank, reg, revision)


def deleted_key(prefix: str, kv: dict[str, Any]) -> tuple[str, RankKey] | None:
    """(addr, rank) of a DELETE event's ``kv`` (which holds the key only)."""
    try:
        return parse_rank_key(prefix, unb64(kv["key"]).decode())
    except (KeyError, ValueError, UnicodeDecodeError):
        return None


class View:
    """The decode's picture of every prefill rank under one prefix, fed by the watch.

    ``revision`` is the newest store revision applied; :meth:`apply_event` (one watch
    event), :meth:`resync` (a fresh range after a reconnect) return the typed events
    that changed the view, in order.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.entries: dict[tuple[str, RankKey], Entry] = {}
        self.revision = 0

    def instance(self, addr: str) -> dict[RankKey, Entry]:
        """The ranks of instance name ``addr`` now."""
        return {k[1]: e for k, e in self.entries.items() if k[0] == addr}

    def apply_event(self, ev: dict[str, Any], revision: int) -> list[PeerEvent]:
        """One gateway watch event (``{"type": "DELETE"?, "kv": {...}}``)."""
        kv = ev.get("kv") or {}
        if ev.get("type") == "DELETE":
            where = deleted_key(self.prefix, kv)
            rev = int(kv.get("mod_revision", revision) or revision)
            self.revision = max(self.revision, rev)
            return [] if where is None else self._delete(where, rev)
        entry = decode_kv(self.prefix, kv)
        if entry is None:
            return []
        self.revision = max(self.revision, entry.revision)
        return self._put(entry)

    def resync(self, kvs: list[dict[str, Any]], revision: int) -> list[PeerEvent]:
        """Replace the view by a range read at ``revision``: deletes for keys gone (they
        expired while the watch was down), puts for new or changed ones."""
        fresh = {}
        for kv in kvs:
            e = decode_kv(self.prefix, kv)
            if e is not None:
                fresh[(e.addr, e.rank)] = e
        out: list[PeerEvent] = []
        for key in [k for k in self.entries if k not in fresh]:
            out += self._delete(key, max(revision, self.entries[key].revision))
        for e in fresh.values():  # the range is the truth, even from a store whose data
            if self.entries.get((e.addr, e.rank)) != e:  # was wiped (revisions restart)
                out += self._put(e, force=True)
        self.revision = revision
        return out

    def _put(self, e: Entry, force: bool = False) -> list[PeerEvent]:
        key = (e.addr, e.rank)
        old = self.entries.get(key)
        if old is not None and old.revision >= e.revision and not force:
            return []  # already seen (a replay after a reconnect)
        self.entries[key] = e
        replaced = old is not None and old.instance != e.instance
        return [PeerPut(e.addr, e.rank, e.instance, e.endpoint, e.revision,
                        old.instance if replaced and old else None,
                        old.endpoint if replaced and old else None)]

    def _delete(self, key: tuple[str, RankKey], revision: int) -> list[PeerEvent]:
        old = self.entries.get(key)
        if old is None or old.revision > revision:
            return []
        del self.entries[key]
        return [PeerDeleted(old.addr, old.rank, old.instance, old.endpoint, revision)]
