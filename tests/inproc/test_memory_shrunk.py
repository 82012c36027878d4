"""In-process tier: the S16 rule. A registration whose host memory no longer stands (a
buffer's file now ends before the buffer's end) is dropped: every room of that engine
fails with kind ``layout`` naming the buffer and the sizes, the daemon logs one line,
the engine's next room is refused naming why, the same connection registers a good pool
again, and the daemon serves on. No write touches the truncated pool here (the fake
backend copies through the mapping): the sweep's check finds it."""

from __future__ import annotations

import logging
import os

import pytest

from kvd.errors import RegistrationError
from kvd.protocol import rpc
from kvd.refengine.standin import StandInPool
from tests.inproc.harness import FAILED, SUCCESS, Cluster, same_pages, settle, until


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_s16_a_truncated_pool_drops_the_registration_and_the_daemon_serves_on(
        cluster: Cluster, role: str, caplog: pytest.LogCaptureFixture) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(70, [0, 1], p.http_addr)
    await pe.sender(70, [20, 21], send=False)
    await settle(cluster)
    node, eng = (d, de) if role == "decode" else (p, pe)
    first = eng.pool.registration.kv_buffers[0]
    os.truncate(first.path, first.offset)  # type: ignore[union-attr]
    eng.pool.kv = []  # this process must not read the truncated views
    caplog.set_level(logging.ERROR, logger="kvd")
    cluster.clock.advance(1.0)
    node.daemon.sweep()  # the periodic check (at most once a second)
    await until(lambda: node.daemon.core.local is None)  # released through K44's path
    kind, reason = await eng.failure(70)
    assert kind == "layout", (kind, reason)
    assert "KV buffer 0" in reason and "now ends at byte 0" in reason
    assert "registration was dropped" in reason
    dropped = [r for r in caplog.records if "dropping its registration" in r.getMessage()]
    assert len(dropped) == 1
    node.daemon.sweep()  # checked again: nothing more is said
    assert len([r for r in caplog.records if "dropping" in r.getMessage()]) == 1
    create = (rpc.ReceiverCreate(room=71, bootstrap_addr=p.http_addr) if role == "decode"
              else rpc.SenderCreate(room=71))
    with pytest.raises(RegistrationError, match=r"registration was dropped.*KV buffer 0"):
        await eng.call(create)
    # the same connection registers a good pool; a fresh room moves byte for byte
    eng.pool = StandInPool(seed=3, shm_dir=str(cluster.shm_dir), num_layers=2,
                           num_pages=32, item_len=1024, aux_slots=8, aux_item_len=16,
                           page_size=4, head_dim=64)
    cluster.pools.append(eng.pool)
    await eng.call(eng.pool.registration)
    await de.receiver(72, [4, 5], p.http_addr)
    await pe.sender(72, [22, 23])
    await settle(cluster)
    assert await de.status(72) == SUCCESS and same_pages(de, pe, [22, 23], [4, 5])
    assert await de.status(70) in (FAILED, -1)  # the old room: forgotten with its pool
