"""Real processes, real Mooncake (loopback): K42 -- a destination page named twice, a page
or an aux slot shared by two live rooms and a source page named twice are refused where
the engine sees them, and a room next to the refused ones moves byte for byte."""

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
        r_dup.init([240, 241, 240], 240)
    r_dup.abort("refused")
    # a room on distinct pages, live while the next one asks for one of them
    r = Receiver(d.client, good, pd_pair.bootstrap)
    r.init(dst, int(dst[0]))
    r_other = Receiver(d.client, other, pd_pair.bootstrap)
    with pytest.raises(RoomError, match=rf"page 242 \(position 1\) is held by room {good}"):
        r_other.init([243, 242], 243)
    r_other.abort("refused")
    # a prefill room naming one source page twice: refused at send, the room fails
    r_twice = Receiver(d.client, twice, pd_pair.bootstrap)
    r_twice.init([244, 245], 244)
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


def test_k42_a_live_rooms_aux_slot_is_refused_and_each_first_token_lands_in_its_own(
        pd_pair: PdPair, room_ids: Iterator[int]) -> None:
    """Two live rooms naming one aux slot: the second room's first token would overwrite
    the first's. The decode refuses the second at init, naming slot and room; with a slot
    of its own, both rooms move, pages and aux byte for byte, each aux in its own slot."""
    p, d = pd_pair.p_engine, pd_pair.d_engine
    a, b = next(room_ids), next(room_ids)
    p.aux[5][:], p.aux[6][:] = 0xA5, 0x5A
    ra = Receiver(d.client, a, pd_pair.bootstrap)
    ra.init([250, 251], 250)
    rb = Receiver(d.client, b, pd_pair.bootstrap)
    with pytest.raises(RoomError, match=rf"aux slot 250 \(position 0\) is held by room {a}"):
        rb.init([252, 253], 250)
    rb.init([252, 253], 252)  # nothing was recorded: init again with a slot of its own
    sa, sb = Sender(p.client, a), Sender(p.client, b)
    sa.init(2, 5)
    sb.init(2, 6)
    sa.send([40, 41], is_last=True)
    sb.send([42, 43], is_last=True)
    assert [ended(x) for x in (ra, rb, sa, sb)] == [KVPoll.Success] * 4
    assert d.pages_equal(p, [40, 41, 42, 43], [250, 251, 252, 253])
    assert (d.aux[250] == p.aux[5]).all() and (d.aux[252] == p.aux[6]).all()
    for room in (ra, rb, sa, sb):
        room.clear()
