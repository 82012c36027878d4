"""Real processes, real Mooncake (loopback): K42 -- a destination page named twice, pages
shared by two live rooms and a source page named twice are refused where the engine
sees them, and a room next to the refused ones moves byte for byte."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from kvd.client import KVPoll, Receiver, Sender
from kvd.errors import RoomError
from tests.conftest import PdPair

T = TypeVar("T")
BOUND = 15.0  # generous bound of every "poll until"


def until(probe: Callable[[], T], what: str) -> T:
    deadline = time.monotonic() + BOUND
    while not (value := probe()):
        if time.monotonic() > deadline:
            pytest.fail(f"not within {BOUND}s: {what}")
        time.sleep(0.02)
    return value


def ended(room: Receiver | Sender) -> KVPoll | int:
    until(lambda: room.poll() in (KVPoll.Success, KVPoll.Failed), f"room {room.room} ended")
    return room.poll()


def test_k42_refused_pages_and_a_good_room_byte_for_byte(pd_pair: PdPair,
                                                         room_ids: Iterator[int]) -> None:
    p, d = pd_pair.p_engine, pd_pair.d_engine
    dup, good, other, twice = (next(room_ids) for _ in range(4))
    dst, src = [240, 241, 242], [30, 31, 32]
    # a destination page named twice: refused at init, nothing recorded
    r_dup = Receiver(d.client, dup, pd_pair.bootstrap)
    with pytest.raises(RoomError, match=r"page 240 is named twice \(positions 0 and 2\)"):
        r_dup.init([240, 241, 240], 0)
    r_dup.abort("refused")
    # a room on distinct pages, live while the next one asks for one of them
    r = Receiver(d.client, good, pd_pair.bootstrap)
    r.init(dst, 0)
    r_other = Receiver(d.client, other, pd_pair.bootstrap)
    with pytest.raises(RoomError, match=rf"page 242 \(position 1\) is held by room {good}"):
        r_other.init([243, 242], 0)
    r_other.abort("refused")
    # a prefill room naming one source page twice: refused at send, the room fails
    r_twice = Receiver(d.client, twice, pd_pair.bootstrap)
    r_twice.init([244, 245], 0)
    s_twice = Sender(p.client, twice)
    s_twice.init(2, 0)
    with pytest.raises(RoomError, match="source page 33 is named twice"):
        s_twice.send([33, 33], is_last=True)
    assert ended(r_twice) == KVPoll.Failed and r_twice.failure()[0] == "layout"
    # the good room, in two chunks: every page lands exactly where it should
    s = Sender(p.client, good)
    s.init(3, 0)
    s.send(src[:2], is_last=False)
    s.send(src[2:], is_last=True)
    assert ended(r) == KVPoll.Success and ended(s) == KVPoll.Success
    assert d.pages_equal(p, src, dst)
    for room in (r, s, r_dup, r_other, r_twice, s_twice):
        room.clear()
