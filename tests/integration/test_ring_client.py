"""The engine's client on the ring (issue 21) between real processes, engine clients with
``use_ring=True``: two threads of one client submitting at once, and a ring refusal read
through every status path. A room call the engine did not wait for (``Receiver.init``,
``Sender.send``) and kvd refused makes the room read Failed for the engine -- through the
room object, and equally through ``poll_many``, ``poll_array`` and ``wait_many``, the
batch reads an engine (and its adapter) polls a whole step with. A Clear, whichever way it
went, drops the kept refusal with the room, so the same id later starts clean."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender, poll_array, poll_many, wait_many
from kvd.protocol import rpc
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
    pair = start_pair(tmp_path_factory.mktemp("ring-reads"), engine_opts={"use_ring": True})
    yield pair
    stop_pair(pair)


def test_a_refused_ring_init_reads_failed_through_every_batch_read(ring_pair: PdPair) -> None:
    """Room 901 names the aux slot live room 900 holds (K42): over the socket its init
    raises; over the ring it returns, and every read path says Failed -- a batch poll that
    said WaitingForInput would leave the engine waiting for a room kvd will never fill."""
    d = ring_pair.d_engine.client
    ring = d.ring
    assert ring is not None
    a = Receiver(d, 900, ring_pair.bootstrap)
    a.init([1, 2], aux_index=3)
    b = Receiver(d, 901, ring_pair.bootstrap)
    b.init([5, 6], aux_index=3)  # refused by kvd; the ring does not wait
    until(ring.drained, "kvd ran both inits")
    assert poll_many(d, [900, 901])[1] == KVPoll.Failed
    assert poll_array(d, np.array([900, 901], dtype=np.uint64)).tolist()[1] == KVPoll.Failed
    assert wait_many(d, [901], BOUND) == [KVPoll.Failed]  # not WaitingForInput at BOUND
    assert poll_many(d, [900])[0] != KVPoll.Failed  # room 900 is not touched
    # the batch reads leave the refusal to the room: its failure still names it
    assert b.poll() == KVPoll.Failed and "aux slot 3" in b.failure()[1]
    # and the room object having looked does not take it from the batch reads
    assert poll_many(d, [901]) == [KVPoll.Failed]
    assert Receiver.attach(d, 901).poll() == KVPoll.Failed  # another handle on the room
    a.clear()
    b.clear()
    assert poll_many(d, [900, 901]) == [-1, -1]


def test_a_clear_over_the_socket_drops_the_kept_refusal_with_the_room(
        ring_pair: PdPair) -> None:
    """The refusal of room 911's init is kept; the engine clears the room with a plain
    call (not through the room object): a new room 911 then starts clean."""
    d = ring_pair.d_engine.client
    ring = d.ring
    assert ring is not None
    a = Receiver(d, 910, ring_pair.bootstrap)
    a.init([1, 2], aux_index=5)
    Receiver(d, 911, ring_pair.bootstrap).init([5, 6], aux_index=5)  # refused
    until(ring.drained, "kvd ran both inits")
    assert poll_many(d, [911]) == [KVPoll.Failed]
    d.call(rpc.Clear(room=911))
    a.clear()
    again = Receiver(d, 911, ring_pair.bootstrap)
    again.init([5, 6], aux_index=5)
    until(ring.drained, "kvd ran the new init")
    assert again.poll() != KVPoll.Failed and poll_many(d, [911]) != [KVPoll.Failed]
    again.clear()


def test_two_threads_of_one_client_submit_at_once(ring_pair: PdPair) -> None:
    """KvdClient is thread-safe (one call at a time): two threads create, init, send,
    abort and clear 100 rooms each through one client's ring with no error, every call
    ran once (the ring's tail moved by exactly their count) and no room is left."""
    pe = ring_pair.p_engine.client
    ring = pe.ring
    assert ring is not None
    before = ring.sub.tail
    errors: list[BaseException] = []

    def rooms(base: int) -> None:
        try:
            for r in range(base, base + 100):
                s = Sender(pe, r)
                s.init(num_pages=2, aux_index=0)
                s.send(np.array([1]), is_last=False)
                s.abort("a test")
                s.clear()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rooms, args=(b,)) for b in (20_000, 30_000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    assert not errors and not any(t.is_alive() for t in threads)
    assert pe.ring is ring and ring.sub.tail - before == 2 * 100 * 5
    ids = list(range(20_000, 20_100)) + list(range(30_000, 30_100))
    assert set(poll_many(pe, ids)) == {-1}


def test_k27_a_refusal_kept_across_a_dropped_connection_reads_failed_on_every_path(
        ring_pair: PdPair) -> None:
    """Room 931's refused init is read, then the connection drops: the client keeps the
    refusal across the reconnect (K27, same kvd), so the first read after the drop --
    which goes over the socket, with no ring or table yet -- must say Failed on every
    path, not kvd's WaitingForInput; a Clear then drops it and the id starts clean."""
    d = ring_pair.d_engine.client
    ring = d.ring
    assert ring is not None
    a = Receiver(d, 930, ring_pair.bootstrap)
    a.init([1, 2], aux_index=6)
    b = Receiver(d, 931, ring_pair.bootstrap)
    b.init([5, 6], aux_index=6)  # refused by kvd; the ring does not wait
    until(ring.drained, "kvd ran both inits")
    d._drop()  # the connection drops; the next call reconnects and registers again
    assert poll_many(d, [931]) == [KVPoll.Failed]
    d._drop()
    assert wait_many(d, [931], BOUND) == [KVPoll.Failed]  # not WaitingForInput at BOUND
    d._drop()
    assert b.poll() == KVPoll.Failed and "aux slot 6" in b.failure()[1]
    d._drop()
    assert poll_array(d, np.array([931], dtype=np.uint64)).tolist() == [KVPoll.Failed]
    d._drop()
    d.call(rpc.Clear(room=931))  # over the socket, before any ring is open again
    a.clear()
    again = Receiver(d, 931, ring_pair.bootstrap)
    again.init([5, 6], aux_index=6)
    assert again.poll() != KVPoll.Failed and poll_many(d, [931]) != [KVPoll.Failed]
    again.clear()
