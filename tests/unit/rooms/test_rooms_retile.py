"""The sender machine with different page sizes on the two sides (issue 22 item 3).

A prefill with ``Ps`` tokens per page writes a decode with ``Pd``: the machine re-cuts the
engine's chunks so that every write but the last ends on a decode page boundary, each
decode page is named by one write only, and the last write ends at the room's token count.
Hypothesis drives the engine's chunks and the write results in any interleaving.
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.protocol import control
from kvd.protocol.codec import pack_indices
from kvd.rooms.effects import Effect, Write
from kvd.rooms.sender import SenderRooms
from kvd.rooms.state import FailureKind, KVPoll
from tests.unit.rooms.roomkit import AUX, D0, D1, POOL, kv_args, of, pages, register, sender

SIZES = [1, 4, 16, 64]


def retiled(ps: int, pd: int, decodes: tuple[str, ...] = (D0,)) -> SenderRooms:
    """A prefill rank of page size ``ps`` with decode ranks of page size ``pd``."""
    s = sender()
    s.num_pages, s.page_size = 4096, ps
    for ep in decodes:
        msg = msgspec.structs.replace(register(ep), kv_args=msgspec.structs.replace(kv_args(),
                                                                           page_size=pd))
        s.on_register(msg, 4096, AUX, None, "plan", 0.0)
    return s


def bind(s: SenderRooms, room: int, dst: np.ndarray, first: int = 0, ep: str = D0,
         required: int = 1) -> list[Effect]:
    return s.on_pages(control.RoomPages(
        room=room, inc=1, endpoint=ep, instance_id="d-a", dst_pages=pack_indices(dst),
        aux_index=2, write_within=100.0, required_dst_info_num=required, first_page=first),
        1.0)


@st.composite
def rooms(draw: st.DrawFn) -> tuple[int, int, int, int, list[int]]:
    ps = draw(st.sampled_from(SIZES))
    pd = draw(st.sampled_from([p for p in SIZES if p != ps]))
    t = draw(st.integers(1, 300))
    ns, nd = -(-t // ps), -(-t // pd)
    hit = draw(st.integers(0, nd - 1))
    cuts = sorted(draw(st.sets(st.integers(1, ns - 1), max_size=5))) if ns > 1 else []
    return ps, pd, t, hit, [0, *cuts, ns]


@settings(max_examples=300, deadline=None)
@given(rooms(), st.data())
def test_i22_retiled_writes_cover_the_room_once_on_whole_decode_pages(
        room: tuple[int, int, int, int, list[int]], data: st.DataObject) -> None:
    ps, pd, t, hit, cuts = room
    ns, nd = cuts[-1], -(-t // pd)
    rng = np.random.default_rng(t)
    src = rng.permutation(4096)[:ns].astype(np.int64)
    dst = rng.permutation(4096)[:nd].astype(np.int64)
    s = retiled(ps, pd)
    s.create(1, 0.0)
    s.init(1, ns, 1, 0.0)
    bind(s, 1, dst[hit:], hit)
    sent, writes, inflight = 0, [], []
    chunks = [(src[a:b], b == ns) for a, b in itertools.pairwise(cuts)]
    while sent < len(chunks) or inflight:
        if sent < len(chunks) and (not inflight or data.draw(st.booleans())):
            out = s.send(1, chunks[sent][0], chunks[sent][1], 2.0)
            sent += 1
        else:
            w = inflight.pop()
            out = s.write_done(1, w.attempt, None, 0, 0.0, 2.0)
        new = of(out, Write)
        writes += new
        inflight += new
        assert len(inflight) <= 1  # one write per room at a time
    assert s.poll(1).status == KVPoll.Success  # type: ignore[union-attr]
    assert writes and writes[-1].is_last and writes[-1].aux_index == 1
    assert all(not w.is_last and w.aux_index is None for w in writes[:-1])
    end = min(ns * ps, nd * pd)  # the room's token count as both sides' pages say
    lo = 0
    named: list[int] = []
    for w in writes:
        assert w.tokens is not None and w.tokens[0] == lo
        lo = w.tokens[1]
        assert w.is_last or lo % pd == 0  # whole decode pages, except the last write
        # the source pages hold exactly the write's tokens, from room page src_first
        first, last = w.tokens[0] // ps, -(-w.tokens[1] // ps)
        assert w.src_first == first and np.array_equal(w.src_pages, src[first:last])
        (d,) = w.dests
        a, b = d.tokens  # type: ignore[misc]
        assert b == w.tokens[1]
        if a < b:
            assert a == max(w.tokens[0], hit * pd)
            assert d.dst_first == a // pd and np.array_equal(
                d.dst_pages, dst[a // pd:-(-b // pd)])
            named += d.dst_pages.tolist()
        else:
            assert d.dst_pages.size == 0
    assert lo == end
    # each decode page the room writes is named by one write only, every one from hit on
    assert sorted(named) == sorted(dst[hit:].tolist())


def test_i22_equal_page_sizes_keep_whole_page_writes() -> None:
    s = retiled(16, 16)
    s.create(1, 0.0)
    s.init(1, 3, 1, 0.0)
    bind(s, 1, pages(7, 8, 9))
    (w,) = of(s.send(1, pages(1, 2, 3), True, 2.0), Write)
    assert w.tokens is None and w.dests[0].tokens is None
    assert w.src_pages.tolist() == [1, 2, 3] and w.dests[0].dst_pages.tolist() == [7, 8, 9]


def test_i22_a_chunk_short_of_a_decode_page_waits_for_the_next() -> None:
    """16 -> 64: three 16-token pages are no whole decode page; the fourth completes it."""
    s = retiled(16, 64)
    s.create(1, 0.0)
    s.init(1, 6, 1, 0.0)
    bind(s, 1, pages(40, 41))
    assert of(s.send(1, pages(0, 1, 2), False, 2.0), Write) == []
    (w,) = of(s.send(1, pages(3, 4), False, 2.0), Write)
    assert w.tokens == (0, 64) and w.src_pages.tolist() == [0, 1, 2, 3]
    assert w.dests[0].dst_pages.tolist() == [40]
    s.send(1, pages(5), True, 2.0)
    (last,) = of(s.write_done(1, w.attempt, None, 0, 0.0, 2.0), Write)
    assert last.is_last and last.tokens == (64, 96) and last.src_first == 4
    assert last.src_pages.tolist() == [4, 5] and last.dests[0].dst_pages.tolist() == [41]


def test_i22_pages_with_no_common_token_count_fail_the_room() -> None:
    """64 -> 16: 2 prefill pages hold tokens 65..128, 4 decode pages 49..64: no request
    length fits both; and a decode with too few pages for a chunk."""
    s = retiled(64, 16)
    s.create(1, 0.0)
    s.init(1, 2, 1, 0.0)
    bind(s, 1, pages(10, 11, 12, 13))
    s.send(1, pages(0, 1), True, 2.0)
    p = s.poll(1)
    assert p is not None and p.status == KVPoll.Failed and p.failure is not None
    assert p.failure.kind == FailureKind.LAYOUT
    assert "index length mismatch: the prefill's last page gets no token" in p.failure.reason
    s = retiled(16, 64)
    s.create(2, 0.0)
    s.init(2, 12, 1, 0.0)
    bind(s, 2, pages(10))  # 64 tokens, the chunk has 128
    s.send(2, pages(*range(8)), False, 2.0)
    p = s.poll(2)
    assert p is not None and p.status == KVPoll.Failed and p.failure is not None
    assert "tokens up to 128 do not fit" in p.failure.reason


def test_i22_two_decodes_cut_at_a_boundary_of_both() -> None:
    """A room written to two decode ranks: writes end at multiples of both page sizes."""
    s = sender()
    s.num_pages, s.page_size = POOL, 16
    for ep, pd in ((D0, 32), (D1, 48)):
        msg = msgspec.structs.replace(register(ep), kv_args=msgspec.structs.replace(kv_args(),
                                                                           page_size=pd))
        s.on_register(msg, POOL, AUX, None, "plan", 0.0)
    s.create(1, 0.0)
    s.init(1, 12, 1, 0.0)  # 192 tokens: 6 pages of 32, 4 of 48
    bind(s, 1, pages(*range(6)), ep=D0, required=2)
    bind(s, 1, pages(*range(20, 24)), ep=D1, required=2)
    (w,) = of(s.send(1, pages(*range(11)), False, 2.0), Write)
    assert w.tokens == (0, 96)  # 176 tokens received, cut at lcm(32, 48) = 96
    assert [d.dst_pages.tolist() for d in w.dests] == [[0, 1, 2], [20, 21]]
