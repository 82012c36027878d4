"""Real daemons, real Mooncake TCP on loopback: a room streamed layer by layer (issue 22
item 4). Layer 0 of a chunk lands while the engine has not sent the other layers yet; at
the end every decode byte equals the prefill's page, layer by layer, and aux is there."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender
from kvd.errors import RoomError
from kvd.refengine.standin import wait_rooms
from tests.conftest import PdPair

pytestmark = pytest.mark.integration


def _holds(d: list[np.ndarray], p: list[np.ndarray], dst: np.ndarray, src: np.ndarray,
           bufs: list[int]) -> bool:
    return all(np.array_equal(d[b][dst], p[b][src]) for b in bufs)


def test_i22_a_room_streamed_layer_by_layer_lands_byte_for_byte_over_mooncake(
        pd_pair: PdPair) -> None:
    p, d = pd_pair.p_engine, pd_pair.d_engine
    nl, rng = p.num_layers, np.random.default_rng(4)
    src = rng.choice(p.num_pages, 12, replace=False)
    dst = rng.choice(d.num_pages, 12, replace=False)
    p.aux[2] = rng.integers(0, 256, p.aux.shape[1], dtype=np.uint8)
    before = [b.copy() for b in d.kv]
    Receiver(d.client, 611, pd_pair.bootstrap).init(dst, 4)
    send = Sender(p.client, 611)
    send.init(12, 2)
    send.send_layers(src[:8], (0, 1))  # chunk 1, layer 0
    bound = time.monotonic() + 60.0  # poll until it landed, within a generous bound
    while not _holds(d.kv, p.kv, dst[:8], src[:8], [0, nl]) and time.monotonic() < bound:
        time.sleep(0.01)
    assert _holds(d.kv, p.kv, dst[:8], src[:8], [0, nl])  # K and V of layer 0
    rest = [b for b in range(2 * nl) if b % nl]
    assert all(np.array_equal(d.kv[b], before[b]) for b in rest)  # nothing else yet
    for layer in range(1, nl):
        send.send_layers([], (layer, layer + 1))  # the open pages: chunk 1
    send.send_layers(src[8:], (0, nl - 1))  # chunk 2, every layer but the last
    send.send_layers(src[8:], (nl - 1, nl), is_last=True)
    assert wait_rooms(d.client, [611]) == [KVPoll.Success]
    assert wait_rooms(p.client, [611]) == [KVPoll.Success]
    assert _holds(d.kv, p.kv, dst, src, list(range(2 * nl)))
    assert np.array_equal(d.aux[4], p.aux[2])
    send.clear()


def test_i22_send_layers_edges_name_what_is_wrong_over_the_socket(pd_pair: PdPair) -> None:
    """What the engine sees: a range past the pool fails the room (kind layout) naming the
    range; a negative index and a send() without is_last after send_layers are refused
    in the client, nothing sent; a finishing send with a layer missing names the pages
    and layers."""
    p, d = pd_pair.p_engine, pd_pair.d_engine
    nl = p.num_layers
    src, dst = np.array([1, 2]), np.array([3, 4])
    Receiver(d.client, 612, pd_pair.bootstrap).init(dst, 5)
    send = Sender(p.client, 612)
    send.init(2, 3)
    with pytest.raises(ValueError, match=r"layers \[-1, 1\)"):
        send.send_layers(src, (-1, 1))
    send.send_layers(src, (0, 1))
    with pytest.raises(ValueError, match="pass is_last to send"):
        send.send(src)
    with pytest.raises(RoomError, match=rf"layers \[1, {nl + 3}\) end outside the {nl} "
                                        rf"layers"):
        send.send_layers([], (1, nl + 3))
    assert wait_rooms(p.client, [612]) == [KVPoll.Failed]
    assert send.failure()[0] == "layout"
    assert wait_rooms(d.client, [612]) == [KVPoll.Failed]
    send.clear()
    Receiver(d.client, 613, pd_pair.bootstrap).init(dst, 5)
    send = Sender(p.client, 613)
    send.init(2, 3)
    send.send_layers(src, (0, 1))
    with pytest.raises(RoomError, match=r"room pages \[0, 2\) miss layers? 1"):
        send.send_layers([], (0, 0), is_last=True)
    assert wait_rooms(p.client, [613]) == [KVPoll.Failed]
    send.clear()
