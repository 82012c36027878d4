"""Bad input gets a clear error and fails only its own room; the daemon keeps serving."""

from __future__ import annotations

import socket

import httpx
import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender
from kvd.errors import KVTransferError, ProtocolError, RoomError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.refengine.standin import transfer_room, wait_rooms
from tests.conftest import PdPair, signed

pytestmark = pytest.mark.integration


def test_unknown_room_is_a_clear_error(room_pair: PdPair) -> None:
    with pytest.raises(RoomError, match="unknown room 999999999"):
        room_pair.p_engine.client.call(rpc.SenderInit(room=999999999, num_pages=1, aux_index=0))


def test_page_outside_pool_fails_only_that_room(room_pair: PdPair, room_ids) -> None:
    p, d = room_pair.p_engine, room_pair.d_engine
    bad = next(room_ids)
    with pytest.raises(RoomError, match="outside the registered pool"):
        Receiver(d.client, bad, room_pair.bootstrap).init([0, d.num_pages + 5], 0)
    s = Sender(p.client, bad)
    s.init(2, 0)
    with pytest.raises(RoomError, match="outside the registered pool"):
        s.send([1, p.num_pages])
    assert s.poll() == KVPoll.Failed
    assert "outside" in s.failure_reason()
    good = next(room_ids)
    transfer_room(p, d, room_pair.bootstrap, good, [1, 2], [7, 8], chunk=1)
    assert wait_rooms(d.client, [good]) == [KVPoll.Success]


def test_k03_duplicate_sender_and_receiver_refused(room_pair: PdPair, room_ids) -> None:
    p, d = room_pair.p_engine, room_pair.d_engine
    room = next(room_ids)
    Sender(p.client, room)
    with pytest.raises(RoomError, match="already active"):
        Sender(p.client, room)
    Receiver(d.client, room, room_pair.bootstrap)
    with pytest.raises(RoomError, match="already active"):
        Receiver(d.client, room, room_pair.bootstrap)


def test_k10_last_chunk_longer_than_destination_fails_only_that_room(room_pair: PdPair,
                                                                    room_ids) -> None:
    p, d = room_pair.p_engine, room_pair.d_engine
    room = next(room_ids)
    r = Receiver(d.client, room, room_pair.bootstrap)
    r.init([10, 11], 10)
    s = Sender(p.client, room)
    s.init(3, 0)
    s.send([20, 21, 22])
    assert wait_rooms(d.client, [room]) == [KVPoll.Failed]
    assert "index length mismatch 3 vs 2" in r.failure_reason()
    assert wait_rooms(p.client, [room]) == [KVPoll.Failed]
    nxt = next(room_ids)
    transfer_room(p, d, room_pair.bootstrap, nxt, [20, 21], [10, 11], chunk=2)
    assert wait_rooms(d.client, [nxt]) == [KVPoll.Success]
    assert d.pages_equal(p, [20, 21], [10, 11])


def test_malformed_engine_frame_answers_protocol_error_and_keeps_serving(
        room_pair: PdPair) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(room_pair.decode.socket)
        junk = b"KVD\x09garbage"
        sock.sendall(rpc.LENGTH.pack(len(junk)) + junk)
        (length,) = rpc.LENGTH.unpack(sock.recv(4))
        reply = rpc.decode_reply(sock.recv(length))
    assert not reply.ok and reply.kind == "ProtocolError"
    assert "version" in reply.error
    assert room_pair.d_engine.client.call(rpc.Info())["status"] == "ok"


def test_pack_rejects_float_page_indices() -> None:
    with pytest.raises(ProtocolError):
        pack_indices(np.array([1.5]))


def test_route_and_health_answer(room_pair: PdPair) -> None:
    base = f"http://{room_pair.bootstrap}"
    info = signed("GET", f"{base}/route", params={"engine_rank": -1, "target_dp_group": -1,
                                                  "target_pp_rank": -1}).json()
    assert info["prefill_attn_tp_size"] == 1 and info["prefill_dp_size"] == 1
    rank = signed("GET", f"{base}/route", params={"engine_rank": 0, "target_dp_group": 0,
                                                  "target_pp_rank": 0}).json()
    assert rank["rank_port"] == int(room_pair.prefill.ready["control_endpoint"].rsplit(":", 1)[1])
    assert signed("GET", f"{base}/route", params={"engine_rank": 5, "target_dp_group": 0}
                  ).status_code == 404
    assert signed("GET", f"{base}/route", params={"engine_rank": "abc",
                                                  "target_dp_group": 0}).status_code == 400
    # Without the cluster secret the bootstrap API answers nothing but 401.
    assert httpx.get(f"{base}/route", params={"engine_rank": 0, "target_dp_group": 0}
                     ).status_code == 401
    health = httpx.get(f"http://{room_pair.decode.http_addr}/health").json()
    assert health["status"] == "ok" and health["role"] == "decode"
    assert health["instance_id"] == room_pair.decode.ready["instance_id"]


def test_failure_exception_raises_kv_transfer_error_with_room_and_reason(room_pair: PdPair,
                                                                          room_ids) -> None:
    room = next(room_ids)
    r = Receiver(room_pair.d_engine.client, room, room_pair.bootstrap)
    r.abort("the client went away")
    assert r.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError) as info:
        r.failure_exception()
    assert info.value.room == room and "the client went away" in info.value.reason
