"""``KvdClient.call_many`` against real daemons over the Unix socket (real Mooncake TCP on
loopback): one round trip per engine round, results in order, refusals in place."""

from __future__ import annotations

import socket
import time

import pytest

from kvd.client import KVPoll
from kvd.errors import RoomError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from tests.conftest import PdPair

pytestmark = [pytest.mark.integration]

BOUND = 30.0


def test_call_many_moves_rooms_byte_exact_and_returns_refusals_in_place(
        pd_pair: PdPair) -> None:
    de, pe = pd_pair.d_engine, pd_pair.p_engine
    rooms = list(range(7100, 7112))
    src = {r: (r * 7) % pe.num_pages for r in rooms}
    dst = {r: (r * 3) % de.num_pages for r in rooms}
    out = de.client.call_many([c for r in rooms for c in (
        rpc.ReceiverCreate(room=r, bootstrap_addr=pd_pair.bootstrap),
        rpc.ReceiverInit(room=r, dst_pages=pack_indices([dst[r]]), aux_index=dst[r]))])
    assert out == [None] * (2 * len(rooms))
    out = pe.client.call_many([c for r in rooms for c in (
        rpc.SenderCreate(room=r), rpc.SenderInit(room=r, num_pages=1, aux_index=0),
        rpc.SenderSend(room=r, pages=pack_indices([src[r]]), is_last=True))]
        + [rpc.SenderCreate(room=rooms[0]), rpc.Poll(rooms=rooms)])
    assert out[:-2] == [None] * (3 * len(rooms))
    assert isinstance(out[-2], RoomError) and str(rooms[0]) in str(out[-2])
    assert isinstance(out[-1], rpc.PollResult) and len(out[-1].statuses) == len(rooms)
    deadline = time.monotonic() + BOUND
    while True:
        (polled,) = de.client.call_many([rpc.Poll(rooms=rooms)])
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in polled.statuses) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert polled.statuses == [KVPoll.Success] * len(rooms)
    assert all(de.pages_equal(pe, [src[r]], [dst[r]]) for r in rooms)
    assert de.client.call_many([rpc.Clear(room=r) for r in rooms]) == [None] * len(rooms)
    assert pe.client.call_many([rpc.Clear(room=r) for r in rooms]) == [None] * len(rooms)
    assert de.client.call_many([]) == []


def test_a_many_carrying_a_wait_is_refused_and_the_connection_keeps_serving(
        pd_pair: PdPair) -> None:
    """A hand-made frame: Many with a Wait inside → a ProtocolError reply, nothing ran,
    and the next request on the same connection is answered."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(BOUND)
    sock.connect(pd_pair.decode.socket)
    try:
        bad = rpc.Many(calls=[rpc.Wait(rooms=[1], timeout=5.0)])  # type: ignore[list-item]
        sock.sendall(rpc.encode(rpc.Request(id=1, call=bad)))
        reply = rpc.decode_reply(_frame(sock))
        assert not reply.ok and reply.kind == "ProtocolError"
        sock.sendall(rpc.encode(rpc.Request(id=2, call=rpc.Many(calls=[rpc.Poll(rooms=[5])]))))
        reply = rpc.decode_reply(_frame(sock))
        assert reply.ok and reply.id == 2
        assert reply.result["outcomes"][0]["result"]["statuses"] == [-1]
    finally:
        sock.close()


def _frame(sock: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            assert chunk, "kvd closed the connection"
            buf += chunk
        return buf

    (length,) = rpc.LENGTH.unpack(exact(rpc.LENGTH.size))
    return exact(length)
