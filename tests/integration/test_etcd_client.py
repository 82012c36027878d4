"""kvd's etcd client against a real etcd: leases, watch events, auth (user/password)."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import pytest

from kvd.config import load_settings
from kvd.discovery.etcd import etcd_options
from kvd.discovery.etcd_client import EtcdClient, EtcdOptions
from kvd.discovery.events import PeerDeleted, PeerPut, View
from kvd.discovery.keys import RankKey, instances_prefix, rank_key
from kvd.errors import DiscoveryAuthError, DiscoveryUnavailable
from tests.conftest import free_port
from tests.helpers.etcd import EtcdServer

pytestmark = [pytest.mark.integration]

PREFIX = "/kvd/client-test"
REG = (b'{"role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_size": 1, '
       b'"attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "rank_ip": "127.0.0.1", '
       b'"rank_port": 7000, "instance_id": "i1"}')


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def test_lease_expiry_reaches_the_watch_as_a_typed_delete(etcd: EtcdServer) -> None:
    async def main() -> list:
        c = EtcdClient(EtcdOptions((etcd.url,)))
        view, events = View(PREFIX), []
        kvs, rev = await c.range_prefix(instances_prefix(PREFIX))
        view.resync(kvs, rev)
        lease, ttl = await c.grant(2)
        assert ttl == 2 and await c.keepalive(lease) == 2
        await c.put(rank_key(PREFIX, "a:1", RankKey(0, 0, 0)), REG, lease)
        async for batch in c.watch(instances_prefix(PREFIX), rev + 1, idle_s=30):
            for ev in batch.events:
                events += view.apply_event(ev, batch.revision)
            if any(isinstance(e, PeerDeleted) for e in events):
                break  # no keepalive: etcd expires the lease and deletes the key
        assert await c.keepalive(lease) == 0  # gone: the registrar would grant again
        await c.aclose()
        return events

    put, deleted = asyncio.run(main())
    assert isinstance(put, PeerPut) and put.instance == "i1"
    assert deleted == PeerDeleted("a:1", RankKey(0, 0, 0), "i1", "tcp://127.0.0.1:7000",
                                  deleted.revision)


def test_user_password_auth_and_a_wrong_password(etcd: EtcdServer, tmp_path: Path) -> None:
    for path, body in [("/v3/auth/user/add", {"name": "root", "password": "rootpw"}),
                       ("/v3/auth/role/add", {"name": "root"}),
                       ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                       ("/v3/auth/user/add", {"name": "kvd", "password": "kvd-secret"}),
                       ("/v3/auth/role/add", {"name": "kvd"}),
                       ("/v3/auth/role/grant", {"name": "kvd", "perm": {
                           "permType": "READWRITE", "key": _b64("/kvd/"),
                           "range_end": _b64("/kvd0")}}),
                       ("/v3/auth/user/grant", {"user": "kvd", "role": "kvd"}),
                       ("/v3/auth/enable", {})]:
        etcd.call(path, body)
    pw = tmp_path / "etcd-password"
    pw.write_text("kvd-secret\n")
    os.chmod(pw, 0o600)
    s = load_settings(role="decode", etcd_endpoints=etcd.url, etcd_user="kvd",
                      etcd_password_file=str(pw))

    async def main() -> None:
        c = EtcdClient(etcd_options(s))
        await c.put(f"{PREFIX}/x", b"1")
        kvs, _ = await c.range_prefix(PREFIX)
        assert [base64.b64decode(kv["value"]) for kv in kvs] == [b"1"]
        await c.aclose()
        anon = EtcdClient(EtcdOptions((etcd.url,)))
        with pytest.raises(DiscoveryAuthError, match="no user"):
            await anon.range_prefix(PREFIX)
        await anon.aclose()
        wrong = EtcdClient(EtcdOptions((etcd.url,), "kvd", "guess"))
        with pytest.raises(DiscoveryAuthError, match="'kvd'"):
            await wrong.range_prefix(PREFIX)
        await wrong.aclose()

    asyncio.run(main())


def test_endpoints_are_tried_in_order() -> None:
    async def main() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        c = EtcdClient(EtcdOptions((dead, f"http://127.0.0.1:{free_port()}"), timeout=1.0))
        with pytest.raises(DiscoveryUnavailable, match="etcd unreachable") as err:
            await c.range_prefix(PREFIX)
        assert str(err.value).count("ConnectError") == 2
        await c.aclose()

    asyncio.run(main())


def test_doctor_checks_the_store(etcd: EtcdServer, tmp_path: Path) -> None:
    from kvd.cli.doctor import check_etcd

    s = load_settings(role="decode", discovery="etcd", etcd_endpoints=etcd.url,
                      etcd_prefix="/kvd/doctor")
    ok = check_etcd(s)
    assert ok.status == "ok" and "v3." in ok.detail and "0 prefill ranks" in ok.detail
    down = check_etcd(load_settings(role="decode", discovery="etcd", http_timeout=1.0,
                                    etcd_endpoints=f"http://127.0.0.1:{free_port()}"))
    assert down.status == "fail" and "unreachable" in down.detail and "start etcd" in down.fix
    pw = tmp_path / "pw"
    pw.write_text("x\n")
    pw.chmod(0o640)
    bad = check_etcd(s.model_copy(update={"etcd_user": "kvd", "etcd_password_file": pw}))
    assert bad.status == "fail" and "chmod 600" in bad.detail
