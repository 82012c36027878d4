"""Room calls through the submission ring (issue 21 step B) between real processes: engine
clients with ``use_ring=True`` against real daemons over Mooncake TCP loopback."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KVPoll, Sender
from kvd.errors import KvdError, KvdUnreachable
from kvd.launch import start_daemon
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import PdPair, start_pair, stop_pair

pytestmark = [pytest.mark.integration]

BOUND = 30.0


def until(predicate: Callable[[], object], what: str, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not predicate():
        assert time.monotonic() < deadline, f"not within {bound}s: {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def ring_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    pair = start_pair(tmp_path_factory.mktemp("ring"), engine_opts={"use_ring": True})
    yield pair
    stop_pair(pair)


def test_rooms_move_byte_exact_with_both_engines_on_the_ring(ring_pair: PdPair) -> None:
    """Eight rooms of three chunks each, every call of both engines through its ring:
    every room succeeds on both sides and every page arrives byte for byte."""
    pe, de = ring_pair.p_engine, ring_pair.d_engine
    assert pe.client.ring is not None and de.client.ring is not None
    before = pe.client.ring.sub.tail, de.client.ring.sub.tail
    rooms = list(range(8100, 8108))
    src = {r: [(r * 5 + i) % pe.num_pages for i in range(6)] for r in rooms}
    dst = {r: [(r * 7 + i) % de.num_pages for i in range(6)] for r in rooms}
    pairs = [transfer_room(pe, de, ring_pair.bootstrap, r, src[r], dst[r], chunk=2,
                           aux_src=r % 4, aux_dst=r % 4) for r in rooms]
    assert wait_rooms(de.client, rooms, BOUND) == [KVPoll.Success] * len(rooms)
    assert wait_rooms(pe.client, rooms, BOUND) == [KVPoll.Success] * len(rooms)
    for r in rooms:
        assert de.pages_equal(pe, src[r], dst[r]), f"room {r}"
    # create, init and three sends per prefill room; create and init per decode room
    assert pe.client.ring.sub.tail - before[0] == 5 * len(rooms)
    assert de.client.ring.sub.tail - before[1] == 2 * len(rooms)
    for s, r in pairs:
        assert s.refused is None and r.refused is None
        r.clear()
        s.clear()
    assert [r.poll() for _, r in pairs] == [-1] * len(rooms)


def test_a_refused_send_through_the_ring_fails_the_room_for_the_engine(
        ring_pair: PdPair) -> None:
    """A send kvd refuses (a page beyond the pool) returns at once; the refusal comes back
    in the completion ring: the room reads Failed, names it, and its next send raises."""
    pe = ring_pair.p_engine
    s = Sender(pe.client, 8200)
    s.init(2, 0)
    s.send(np.array([pe.num_pages + 5]), is_last=False)  # no answer waited for
    until(lambda: s.poll() == KVPoll.Failed, "the refusal read back")
    kind, reason = s.failure()
    assert kind and "8200" in reason
    with pytest.raises(KvdError):
        s.send(np.array([1]))
    s.clear()  # the refusal goes with the room
    assert s.refused is None and s.poll() == -1


def test_an_engine_on_the_ring_whose_kvd_died_falls_back_and_registers_again(
        tmp_path: Path) -> None:
    """K27 with the ring: kvd SIGKILLed, the engine's next call that waits on the ring sees
    kvd's end of the socket close (KvdUnreachable, not a timeout); kvd restarted on the
    same socket, the next call reconnects, registers again and gets a fresh ring, and a
    room moves byte for byte through it."""
    pair = start_pair(tmp_path, engine_opts={"use_ring": True})
    try:
        pe = pair.p_engine
        old_ring = pe.client.ring
        assert old_ring is not None
        pair.prefill.kill(signal.SIGKILL)
        pair.prefill.proc.wait(10)
        t = time.monotonic()
        with pytest.raises(KvdUnreachable):
            Sender(pe.client, 8300)
        assert time.monotonic() - t < BOUND / 3
        assert pe.client.ring is None
        pair.prefill = start_daemon("prefill", tmp_path, serve_bootstrap=True,
                                    engine_socket=pair.prefill.socket,
                                    http_port=pair.prefill.ready["http_port"])
        _s, r = transfer_room(pe, pair.d_engine, pair.bootstrap, 8301, [1, 2], [3, 4], chunk=1)
        assert pe.client.reconnects == 1
        assert pe.client.ring is not None and pe.client.ring is not old_ring
        assert r.wait(BOUND) == KVPoll.Success
        assert pair.d_engine.pages_equal(pe, [1, 2], [3, 4])
        assert isinstance(pe, EngineStandIn)
    finally:
        stop_pair(pair)


def test_each_room_reads_its_own_refusal_whatever_other_rooms_hold(
        ring_pair: PdPair) -> None:
    """Refusals of three rooms come back at different times; one room's refusal not yet
    looked at does not hide another's. (Sends to rooms kvd does not know: refused, and
    kvd reads them unknown, so only the refusal says Failed.)"""
    pe = ring_pair.p_engine
    ring = pe.client.ring
    assert ring is not None
    a, b, c = (Sender.attach(pe.client, r) for r in (8400, 8401, 8402))
    a.send(np.array([1]), is_last=False)
    c.send(np.array([1]), is_last=False)
    until(ring.drained, "kvd ran both sends")
    assert a.poll() == KVPoll.Failed  # c's refusal is read with a's and kept for c
    b.send(np.array([1]), is_last=False)
    until(ring.drained, "kvd ran b's send")
    assert b.poll() == KVPoll.Failed  # its refusal is read, though c's is still kept
    assert c.poll() == KVPoll.Failed
    for s in (a, b, c):
        assert f"unknown room {s.room}" in s.failure()[1]
        s.clear()
        assert s.poll() == -1
