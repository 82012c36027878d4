"""In-process tier: a ``RegisterKV`` with an integer outside its wire bound (a negative
layer, item length or handle offset, a count past int64, a parallel size of 0) is refused
at the engine socket -- a ProtocolError reply naming the field, nothing registered -- and
a good registration on the same connection afterwards works and moves bytes. Before,
``layer_start=-1`` registered (the daemon failed only when it registered with a peer: a
RegisterRank no peer would decode), and the others were refused by later checks in words
that named no field ("item lengths must be positive", "buffer [-8, +32768) is outside
...", "4 KV buffers for 9223372036854775808 layers")."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvd.client import KvdClient
from kvd.engine_rpc.server import Connection, EngineRpcServer
from kvd.errors import ProtocolError
from kvd.protocol import codec, rpc
from kvd.refengine.standin import StandInPool
from tests.inproc.harness import SUCCESS, Cluster, Engine, same_pages, settle


def _bad(reg: rpc.RegisterKV) -> list[tuple[str, Any]]:
    """Registrations with one integer out of range, and the field the refusal must name."""
    shm = reg.kv_buffers[0]
    group = rpc.GroupSpec(name="draft", item_lens=[-1], num_layers=1, num_kv_heads=1,
                          head_dim=1, dtype_size=1)
    return [
        ("$.call.layer_start", msgspec.structs.replace(reg, layer_start=-1)),
        ("$.call.kv_item_lens[0]",
         msgspec.structs.replace(reg, kv_item_lens=[-reg.kv_item_lens[0], *reg.kv_item_lens[1:]])),
        ("$.call.num_layers", msgspec.structs.replace(reg, num_layers=2**63)),
        ("$.call.kv_buffers[0].offset",
         msgspec.structs.replace(reg, kv_buffers=[msgspec.structs.replace(shm, offset=-8),
                                                  *reg.kv_buffers[1:]])),
        ("$.call.groups[0].item_lens[0]", msgspec.structs.replace(reg, groups=[group])),
        ("$.call.ranks.attn_tp_size",
         msgspec.structs.replace(reg, ranks=rpc.EngineRanks(attn_tp_rank=0, attn_tp_size=0))),
    ]


async def _answer(server: EngineRpcServer, call: rpc.Call, conn: Connection) -> rpc.Reply:
    """What the engine socket answers ``call`` (decoded from its frame, as it arrives)."""
    return await server.answer(codec.encode(rpc.Request(id=7, call=call)), conn)


async def test_a_registration_with_an_out_of_range_integer_is_refused_naming_it(
        cluster: Cluster, tmp_path: Path) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    de = await d.engine(seed=2)
    server = EngineRpcServer(tmp_path / "kvd.sock", p.daemon.dispatch, 1 << 24)
    pool = StandInPool(seed=1, shm_dir=str(cluster.shm_dir), num_layers=2, num_pages=32,
                       item_len=1024, aux_slots=64, aux_item_len=16, page_size=4, head_dim=64)
    cluster.pools.append(pool)
    conn = Connection(next(cluster._conns))
    for field, bad in _bad(pool.registration):
        reply = await _answer(server, bad, conn)
        assert not reply.ok, field
        assert reply.kind == "ProtocolError", (field, reply)
        assert f"`{field}`" in reply.error, (field, reply.error)
        assert p.daemon.core.local is None, field
    # the good one, on the same connection, registers and its rooms move byte for byte
    reply = await _answer(server, pool.registration, conn)
    assert reply.ok, reply.error
    pe = Engine(p, pool, conn)
    p.engines.append(pe)
    await settle(cluster)
    await de.receiver(60, [3, 4], p.http_addr, aux=1)
    await pe.sender(60, [10, 11], aux=2)
    await settle(cluster)
    assert await de.status(60) == SUCCESS and await pe.status(60) == SUCCESS
    assert same_pages(de, pe, [10, 11], [3, 4])
    assert (de.pool.aux[1] == pe.pool.aux[2]).all()


@pytest.mark.parametrize("value", [-1, 2**63])
def test_the_registration_calls_integers_are_bounded_in_the_codec(value: int) -> None:
    """The unit view of the same rule: layer_start outside ``[0, 2**63)`` does not decode."""
    reg = rpc.RegisterKV(kv_buffers=[], kv_item_lens=[], aux_buffers=[], aux_item_lens=[],
                         page_size=1, num_kv_heads=1, head_dim=1, dtype_size=1, num_layers=1,
                         layer_start=value)
    with pytest.raises(ProtocolError, match=r"`\$\.call\.layer_start`"):
        rpc.decode_request(codec.encode(rpc.Request(id=1, call=reg)))


async def test_over_the_engine_socket_the_client_gets_the_refusal_and_registers_after(
        cluster: Cluster, tmp_path: Path) -> None:
    """The same through a real Unix socket and :class:`~kvd.client.KvdClient`: the refusal
    arrives as a ProtocolError naming the field, the connection stays usable, and the
    good registration on it succeeds."""
    p = await cluster.node("prefill")
    path = tmp_path / "e.sock"
    server = EngineRpcServer(path, p.daemon.dispatch, 1 << 24, None, p.daemon.dispatch_now)
    await server.start()
    pool = StandInPool(seed=1, shm_dir=str(cluster.shm_dir), num_layers=2, num_pages=32,
                       item_len=1024, aux_slots=64, aux_item_len=16, page_size=4, head_dim=64)
    cluster.pools.append(pool)
    client = KvdClient(str(path), timeout=60.0, use_table=False)
    try:
        bad = msgspec.structs.replace(pool.registration, layer_start=-1)
        with pytest.raises(ProtocolError, match=r"`\$\.call\.layer_start`"):
            await asyncio.to_thread(client.call, bad)
        assert p.daemon.core.local is None
        result = await asyncio.to_thread(client.call, pool.registration)
        assert isinstance(result, rpc.RegisterResult) and result.num_pages == 32
        assert p.daemon.core.local is not None
    finally:
        await asyncio.to_thread(client.close)
        await server.stop()
