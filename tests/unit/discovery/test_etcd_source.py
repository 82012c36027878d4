"""The etcd source's loops against a scripted client (no etcd; a fake clock)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvd.control.routing import Target
from kvd.discovery.etcd import EtcdLookups, EtcdRegistrar
from kvd.discovery.etcd_client import WatchBatch
from kvd.discovery.events import PeerEvent, PeerPut
from kvd.discovery.keys import RankKey, b64, rank_key
from kvd.errors import DiscoveryUnavailable, NotReady

P = "/kvd/u"
REG = {"role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_size": 1,
       "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "rank_ip": "10.0.0.1",
       "rank_port": 7000, "instance_id": "i1", "page_size": 16}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeEtcd:
    """Scripted answers; ``up`` False makes every call raise DiscoveryUnavailable."""

    def __init__(self) -> None:
        self.up = True
        self.kvs: list[dict[str, Any]] = []
        self.calls: list[str] = []
        self.ttl_left = 3.0
        self.opts = type("O", (), {"timeout": 1.0})()
        self.endpoint = "http://fake:2379"
        self.watching = asyncio.Event()
        self.batches: list[WatchBatch] = []

    def _check(self, name: str) -> None:
        self.calls.append(name)
        if not self.up:
            raise DiscoveryUnavailable("etcd unreachable: fake: ConnectError")

    async def range_prefix(self, prefix: str) -> tuple[list[dict[str, Any]], int]:
        self._check("range")
        return self.kvs, 7

    async def watch(self, prefix: str, rev: int, idle_s: float) -> AsyncIterator[WatchBatch]:
        self._check("watch")
        yield WatchBatch([], rev)
        self.watching.set()
        while self.up:
            if self.batches:
                yield self.batches.pop(0)
            await asyncio.sleep(0.001)
        raise DiscoveryUnavailable("etcd watch ended")

    async def status(self) -> dict[str, Any]:
        self._check("status")
        return {}

    async def grant(self, ttl: float) -> tuple[int, float]:
        self._check("grant")
        return 100 + self.calls.count("grant"), ttl

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        self._check(f"put {lease}")
        return 1

    async def keepalive(self, lease: int) -> float:
        self._check(f"keepalive {lease}")
        return self.ttl_left

    async def revoke(self, lease: int) -> None:
        self._check(f"revoke {lease}")

    async def aclose(self) -> None:
        pass


async def until(cond: Any, bound_s: float = 10.0) -> None:
    """Poll ``cond`` until true, within a generous bound."""
    for _ in range(int(bound_s / 0.001)):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached")


def _kv(instance: str = "i1", rev: int = 5) -> dict[str, Any]:
    key = rank_key(P, "a:1", RankKey(0, 0, 0))
    return {"key": b64(key), "value": b64(json.dumps(REG | {"instance_id": instance})),
            "mod_revision": str(rev)}


def test_lookups_use_the_last_view_for_view_ttl_then_fail_with_the_reason() -> None:
    async def main() -> None:
        fake, clock, seen = FakeEtcd(), Clock(), []
        fake.kvs = [_kv()]
        events: list[PeerEvent] = []
        look = EtcdLookups(fake, P, budget=0.2, view_ttl=5.0, idle_s=1.0,  # type: ignore[arg-type]
                           on_event=events.append, clock=clock)
        task = asyncio.ensure_future(look.run())
        await fake.watching.wait()
        assert [type(e) for e in events] == [PeerPut]
        target = Target(0, 0, 0, False, 1)
        assert (await look.rank("a:1", target)).instance_id == "i1"
        fake.up = False  # etcd goes away
        await until(lambda: look.fresh.down_since is not None)
        clock.t = 4.9  # within etcd_view_ttl: the last view answers
        assert (await look.parallel_info("a:1")).prefill_attn_tp_size == 1
        clock.t = 5.5
        with pytest.raises(DiscoveryUnavailable, match="etcd_view_ttl = 5s") as err:
            await look.rank("a:1", target)
        seen.append(str(err.value))
        fake.up = True  # back: the prefix is read again, lookups answer
        await until(lambda: look.fresh.down_since is None)
        assert (await look.rank("a:1", target)).rank_port == 7000
        with pytest.raises(NotReady, match="no rank dp 0 tp 1 pp 0 of prefill a:1"):
            await look.rank("a:1", Target(1, 0, 0, False, 1))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert "ConnectError" in seen[0] or "ended" in seen[0]

    asyncio.run(main())


def test_registrar_renews_then_registers_again_when_etcd_lost_the_lease() -> None:
    async def main() -> None:
        fake, clock = FakeEtcd(), Clock()
        reg = EtcdRegistrar(fake, P, "a:1", 3.0, clock)  # type: ignore[arg-type]
        reg.set_registration(REG)
        task = asyncio.ensure_future(reg.run())

        await until(lambda: reg.registered)
        assert fake.calls == ["grant", "put 101"]
        clock.t = 1.0  # a third of the TTL: renew
        reg._changed.set()
        await until(lambda: "keepalive 101" in fake.calls)
        fake.ttl_left = 0  # etcd restarted without its data: the lease is unknown
        clock.t = 2.0
        reg._changed.set()
        await until(lambda: "put 102" in fake.calls)
        assert fake.calls[-2:] == ["grant", "put 102"] and reg.registered
        await reg.deregister()
        assert fake.calls[-1] == "revoke 102" and not reg.registered
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


@pytest.mark.parametrize("back_as", ["i1", "i2"])
def test_a_key_missing_after_an_outage_is_a_death_only_if_it_stays_missing(
        back_as: str) -> None:
    """etcd came back without its data: the rank puts its key back within a renew
    period, and rooms bound to it must not fail for that; a rank back as another
    instance (it restarted meanwhile) does fail the rooms of the old one."""
    async def main() -> list[PeerEvent]:
        fake, events = FakeEtcd(), []
        fake.kvs = [_kv()]
        look = EtcdLookups(fake, P, budget=0.2, view_ttl=5.0, idle_s=1.0,  # type: ignore[arg-type]
                           on_event=events.append, resync_grace=0.05)
        task = asyncio.ensure_future(look.run())
        await fake.watching.wait()
        fake.up, fake.kvs = False, []  # down; back empty
        await until(lambda: look.fresh.down_since is not None)
        fake.watching.clear()
        fake.up = True
        await fake.watching.wait()
        fake.batches.append(WatchBatch([{"kv": _kv(back_as, 3)}], 3))  # revisions restart
        want = 2 if back_as == "i1" else 3
        for _ in range(5000):  # poll until, within a generous bound
            if len(events) >= want:
                break
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.1)  # a delete would be due by now (grace 0.05 s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return events

    events = asyncio.run(main())
    kinds = [type(e).__name__ for e in events]
    if back_as == "i1":
        assert kinds == ["PeerPut", "PeerPut"]  # no PeerDeleted: rooms go on
    else:
        assert kinds == ["PeerPut", "PeerPut", "PeerDeleted"]
        assert events[-1].instance == "i1"


def test_all_current_tells_a_target_resolved_from_a_replaced_instance() -> None:
    from kvd.rooms.receiver import Target as Bound

    look = EtcdLookups(FakeEtcd(), P, 1.0, 5.0, 1.0, lambda ev: None)  # type: ignore[arg-type]
    look.view.resync([_kv("i1")], 5)
    assert look.all_current("a:1", [Bound("tcp://10.0.0.1:7000", "i1")])
    look.view.apply_event({"kv": _kv("i2", 6)}, 6)  # restarted while a room resolved
    assert not look.all_current("a:1", [Bound("tcp://10.0.0.1:7000", "i1")])
    assert look.all_current("a:1", [Bound("tcp://10.0.0.1:7000", "i2")])
    assert not look.all_current("b:1", [Bound("tcp://10.0.0.1:7000", "i2")])
