"""Layer streaming in the sender machine (issue 22 item 4).

The engine hands a room's KV chunk by chunk and, inside a chunk, layer range by layer
range (``SenderRooms.send(..., layers=(lo, hi))``: of new pages, of pages named before, or
of every page still missing a layer). Hypothesis draws the chunks, the layer cuts, how each
range names its pages, the decode's prefix hit and the order of write results; the writes
the machine asks for must name every (decode page, layer) exactly once, each from the right
source page, with aux on the last write only, and the room must succeed only after it.
Errors (a layer named twice, out of range, after the end, pages mixing new and named ones,
a last send leaving a layer unnamed) fail the room, as a bad chunk does.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import RoomError
from kvd.protocol import control
from kvd.protocol.codec import pack_indices
from kvd.rooms.effects import CancelWrites, Effect, Write
from kvd.rooms.layers import Coverage, layer_mask, positions_of, runs_of
from kvd.rooms.sender import SenderRooms
from kvd.rooms.state import FailureKind, KVPoll, RoomFailure
from tests.unit.rooms.roomkit import AUX, D0, POOL, kv_args, of, register, sender

ROOM = 7


def streaming(num_layers: int, pd: int = 16) -> SenderRooms:
    """A prefill rank with ``num_layers`` layers and one registered decode rank (page size
    ``pd``; the prefill's is 16)."""
    s = sender()
    s.num_layers, s.page_size = num_layers, 16
    msg = msgspec.structs.replace(register(), kv_args=msgspec.structs.replace(
        kv_args(), page_size=pd))
    s.on_register(msg, POOL, AUX, None, "plan", 0.0)
    return s


def bind(s: SenderRooms, dst: np.ndarray, first: int = 0) -> list[Effect]:
    return s.on_pages(control.RoomPages(
        room=ROOM, inc=1, endpoint=D0, instance_id="d-a", dst_pages=pack_indices(dst),
        aux_index=2, write_within=100.0, required_dst_info_num=1, first_page=first), 1.0)


Send = tuple[np.ndarray, bool, tuple[int, int] | None]


@st.composite
def plans(draw: st.DrawFn) -> tuple[int, int, int, list[Send]]:
    """``(num_layers, room pages, decode prefix hit, sends)``: chunks cut at random, each
    sent whole or as consecutive layer ranges naming their pages in one of three ways."""
    nl = draw(st.integers(1, 6))
    n = draw(st.integers(1, 12))
    hit = draw(st.integers(0, n - 1))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
    src = np.random.default_rng(n * 7 + nl).permutation(POOL)[:n].astype(np.int64)
    sends: list[Send] = []
    for a, b in itertools.pairwise([0, *cuts, n]):
        chunk = src[a:b]
        lcuts = sorted(draw(st.sets(st.integers(1, nl - 1), max_size=nl))) if nl > 1 else []
        if not lcuts and draw(st.booleans()):
            sends.append((chunk, False, None))
            continue
        for i, (lo, hi) in enumerate(itertools.pairwise([0, *lcuts, nl])):
            how = draw(st.sampled_from(["named", "open", "split"])) if i else "new"
            named = chunk if how != "open" else chunk[:0]
            if how == "named" and draw(st.booleans()):  # any order: the set is what counts
                named = named[np.random.default_rng(lo).permutation(named.size)]
            if how == "split" and chunk.size > 1:  # two sends of scattered pages each
                part = np.asarray(draw(st.lists(st.booleans(), min_size=chunk.size,
                                                max_size=chunk.size)))
                if part.any() and not part.all():
                    sends.append((chunk[part], False, (lo, hi)))
                    named = chunk[~part]
            sends.append((named, False, (lo, hi)))
    last = sends[-1]
    sends[-1] = (last[0], True, last[2])
    return nl, n, hit, sends


def _cells(w: Write, nl: int) -> list[tuple[int, int, int]]:
    """``(decode page, layer, source page)`` of every cell a write moves."""
    lo, hi = w.layers if w.layers is not None else (0, nl)
    d = w.dests[0]
    src = w.src_pages[d.src_from:]
    assert src.size == d.dst_pages.size
    return [(int(dp), layer, int(sp)) for sp, dp in zip(src, d.dst_pages, strict=True)
            for layer in range(lo, hi)]


@settings(max_examples=300, deadline=None)
@given(plans(), st.data())
def test_i22_layer_streams_write_each_page_layer_once_aux_last(
        plan: tuple[int, int, int, list[Send]], data: st.DataObject) -> None:
    nl, n, hit, sends = plan
    src = np.concatenate([p for p, _, lay in sends if lay is None or lay[0] == 0])
    dst = np.random.default_rng(n).permutation(POOL)[:n].astype(np.int64)
    s = streaming(nl)
    s.create(ROOM, 0.0)
    s.init(ROOM, n, 1, 0.0)
    early = data.draw(st.integers(0, len(sends)))  # sends before the decode binds
    writes: list[Write] = []
    inflight: list[Write] = []
    sent = 0

    def step(out: list[Effect]) -> None:
        new = of(out, Write)
        writes.extend(new)
        inflight.extend(new)
        assert len(inflight) <= 1  # one write per room at a time

    for _ in range(early):
        step(s.send(ROOM, *sends[sent][:2], 1.5, layers=sends[sent][2]))
        sent += 1
    step(bind(s, dst[hit:], hit))
    while sent < len(sends) or inflight:
        if sent < len(sends) and (not inflight or data.draw(st.booleans())):
            step(s.send(ROOM, *sends[sent][:2], 2.0, layers=sends[sent][2]))
            sent += 1
        else:
            w = inflight.pop()
            assert s.rooms[ROOM].status == KVPoll.Transferring
            step(s.write_done(ROOM, w.attempt, None, 0, 0.0, 2.0))
    assert s.rooms[ROOM].status == KVPoll.Success
    cells = Counter(c[:2] for w in writes for c in _cells(w, nl))
    want = {(int(dst[i]), layer) for i in range(hit, n) for layer in range(nl)}
    assert set(cells) == want and set(cells.values()) == {1}  # each cell exactly once
    where = {int(dst[i]): int(src[i]) for i in range(n)}
    assert all(where[dp] == sp for w in writes for dp, _, sp in _cells(w, nl))
    assert [w.is_last for w in writes] == [False] * (len(writes) - 1) + [True]
    assert [w.aux_index for w in writes][-1] == 1 and \
        all(w.aux_index is None for w in writes[:-1])


@settings(max_examples=300, deadline=None)
@given(plans(), st.sampled_from([4, 64]), st.data())
def test_i22_layer_streams_to_another_page_size_write_each_token_layer_once(
        plan: tuple[int, int, int, list[Send]], pd: int, data: st.DataObject) -> None:
    """A decode with another page size is written in tokens: each layer range moves as soon
    as its pages reach a decode page boundary (overlap), every (decode token, layer) of the
    room from the decode's prefix hit on is written exactly once, from the right source page
    and slot, aux on the last write only."""
    nl, n, hit, sends = plan
    s = streaming(nl, pd)
    s.create(ROOM, 0.0)
    s.init(ROOM, n, 1, 0.0)
    tokens = n * 16
    nd = -(-tokens // pd)
    hit = min(hit, nd - 1)
    src = np.concatenate([p for p, _, lay in sends if lay is None or lay[0] == 0])
    dst = np.random.default_rng(n).permutation(POOL)[:nd].astype(np.int64)
    bind(s, dst[hit:], hit)
    writes: list[Write] = []
    inflight: list[Write] = []
    for named, last, lay in sends:
        new = of(s.send(ROOM, named, last, 2.0, layers=lay), Write)
        writes += new
        inflight += new
        while inflight and (data.draw(st.booleans()) or last):
            new = of(s.write_done(ROOM, inflight.pop().attempt, None, 0, 0.0, 2.0), Write)
            writes += new
            inflight += new
        assert len(inflight) <= 1  # one write per room at a time
    assert s.rooms[ROOM].status == KVPoll.Success
    cells: Counter[tuple[int, int, int]] = Counter()
    for w in writes:
        assert w.tokens is not None
        lo, hi = w.layers if w.layers is not None else (0, nl)
        (d,) = w.dests
        a, b = d.tokens  # type: ignore[misc]
        for t in range(a, b):
            # the source page and slot the planner reads token t from, and where it lands
            assert w.src_pages[t // 16 - w.src_first] == src[t // 16]
            dp = int(d.dst_pages[t // pd - d.dst_first])
            cells.update((dp, t % pd, layer) for layer in range(lo, hi))
    want = {(int(dst[t // pd]), t % pd, layer) for t in range(hit * pd, tokens)
            for layer in range(nl)}
    assert set(cells) == want and set(cells.values()) == {1}
    assert [w.is_last for w in writes] == [False] * (len(writes) - 1) + [True]
    assert writes[-1].aux_index == 1 and all(w.aux_index is None for w in writes[:-1])


@pytest.mark.parametrize(("pd", "pages", "first"), [(64, 8, (0, 128)), (4, 2, (0, 32))])
def test_i22_a_layer_of_retiled_pages_moves_while_later_layers_compute(
        pd: int, pages: int, first: tuple[int, int]) -> None:
    """16 -> 64 and 16 -> 4: the first layer of a chunk that fills whole decode pages is
    written at once, before any later layer is named."""
    s = streaming(3, pd)
    s.create(ROOM, 0.0)
    s.init(ROOM, pages, 1, 0.0)
    bind(s, np.arange(-(-pages * 16 // pd), dtype=np.int64))
    src = np.arange(10, 10 + pages, dtype=np.int64)
    (w,) = of(s.send(ROOM, src, False, 1.0, layers=(0, 1)), Write)
    assert (w.tokens, w.layers, w.is_last) == (first, (0, 1), False)
    assert not of(s.send(ROOM, src[:0], False, 1.0, layers=(1, 2)), Write)  # one at a time
    (w2,) = of(s.write_done(ROOM, w.attempt, None, 0, 0.0, 1.0), Write)
    assert (w2.tokens, w2.layers) == (first, (1, 2))
    assert not of(s.send(ROOM, src[:0], True, 1.0, layers=(2, 3)), Write)
    (w3,) = of(s.write_done(ROOM, w2.attempt, None, 0, 0.0, 1.0), Write)
    assert (w3.tokens, w3.layers, w3.is_last) == (first, (2, 3), True)


def _started(nl: int = 4, n: int = 3) -> tuple[SenderRooms, np.ndarray]:
    s = streaming(nl)
    s.create(ROOM, 0.0)
    s.init(ROOM, n, 1, 0.0)
    bind(s, np.arange(40, 40 + n, dtype=np.int64))
    return s, np.arange(10, 10 + n, dtype=np.int64)


@pytest.mark.parametrize("bad", ["twice", "twice_open", "outside", "empty_range", "mixed",
                                 "last_gap", "whole_twice"])
def test_i22_a_bad_layer_send_fails_the_room(bad: str) -> None:
    s, src = _started()
    s.send(ROOM, src[:2], False, 1.0, layers=(0, 2))
    calls = {
        "twice": lambda: s.send(ROOM, src[:1], False, 1.0, layers=(1, 3)),
        "twice_open": lambda: s.send(ROOM, src[:0], False, 1.0, layers=(0, 1)),
        "outside": lambda: s.send(ROOM, src[:2], False, 1.0, layers=(2, 5)),
        "empty_range": lambda: s.send(ROOM, src[:2], False, 1.0, layers=(2, 2)),
        "mixed": lambda: s.send(ROOM, src[1:], False, 1.0, layers=(2, 3)),
        "last_gap": lambda: s.send(ROOM, src[2:], True, 1.0, layers=(0, 4)),
        "whole_twice": lambda: s.send(ROOM, src[:1], False, 1.0),
    }
    with pytest.raises(RoomError) as info:
        calls[bad]()
    r = s.rooms[ROOM]
    assert r.status == KVPoll.Failed and r.failure is not None
    assert r.failure.kind == FailureKind.LAYOUT
    assert any(isinstance(e, CancelWrites) for e in info.value.effects)  # a write was out


def test_i22_a_layer_send_after_the_last_is_refused_and_nothing_is_written() -> None:
    s, src = _started(nl=2, n=1)
    writes = of(s.send(ROOM, src, False, 1.0, layers=(0, 1)), Write)
    writes += of(s.send(ROOM, src[:0], True, 1.0, layers=(1, 2)), Write)
    with pytest.raises(RoomError):
        s.send(ROOM, src[:0], False, 1.0, layers=(1, 2))
    assert [w.layers for w in writes] == [(0, 1)]
    out = s.write_done(ROOM, writes[0].attempt, None, 0, 0.0, 1.0)
    (last,) = of(out, Write)
    assert last.layers == (1, 2) and last.is_last
    assert s.write_done(ROOM, last.attempt, None, 0, 0.0, 1.0)
    assert s.rooms[ROOM].status == KVPoll.Success


def test_i22_a_failed_layer_write_ends_the_stream() -> None:
    """A write that fails mid-stream fails the room; later layer sends are dropped (the
    engine reads the outcome from poll), nothing more is written."""
    s, src = _started(nl=3, n=2)
    (w,) = of(s.send(ROOM, src, False, 1.0, layers=(0, 1)), Write)
    assert not of(s.send(ROOM, src[:0], False, 1.0, layers=(1, 2)), Write)  # queued
    failure = RoomFailure(FailureKind.TRANSPORT, "link down", "prefill")
    out = s.write_done(ROOM, w.attempt, failure, 0, 0.0, 1.0)
    assert not of(out, Write) and s.rooms[ROOM].status == KVPoll.Failed
    assert s.send(ROOM, src[:0], True, 1.0, layers=(2, 3)) == []


def test_i22_an_abort_mid_stream_cancels_the_layer_in_flight() -> None:
    s, src = _started(nl=3, n=2)
    (w,) = of(s.send(ROOM, src, False, 1.0, layers=(0, 1)), Write)
    out = s.abort(ROOM, "client gone", 1.0)
    assert of(out, CancelWrites) == [CancelWrites(ROOM, w.attempt)]  # K43
    assert s.rooms[ROOM].status == KVPoll.Failed


def test_i22_layer_ranges_need_the_layer_count() -> None:
    s, src = _started()
    s.num_layers = 0
    with pytest.raises(RoomError, match="end outside the 0 layers"):
        s.send(ROOM, src, False, 1.0, layers=(0, 1))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 7), st.lists(st.tuples(st.integers(0, 20), st.integers(1, 20),
                                             st.integers(0, 6), st.integers(1, 7)),
                                   max_size=12))
def test_i22_coverage_matches_a_cell_set(nl: int, ops: list[tuple[int, int, int, int]]) -> None:
    """The run-length coverage answers what a plain set of (page, layer) cells does."""
    cover, cells, size = Coverage(nl), set(), 0
    for a, n, lo, width in ops:
        hi = min(lo + width, nl)
        if lo >= hi:
            continue
        mask = layer_mask(lo, hi)
        if a >= size:  # new pages
            cover.add(n, mask)
            cells |= {(p, x) for p in range(size, size + n) for x in range(lo, hi)}
            size += n
            continue
        pos = np.arange(a, min(a + n, size), dtype=np.int64)
        runs = runs_of(pos)
        assert np.array_equal(positions_of(runs), pos)
        want = {(p, x) for p in pos.tolist() for x in range(lo, hi)}
        clash = cover.clash(runs, mask)
        assert (clash is None) == (not want & cells)
        if clash is not None:
            assert clash in cells and clash == min(want & cells)
            continue
        cover.mark(runs, mask)
        cells |= want
    full = {(p, x) for p in range(size) for x in range(nl)}
    gap = cover.first_gap()
    assert (gap is None) == (cells == full)
    if gap is not None:
        assert gap == min(full - cells)
    prefix = next((p for p in range(size) if any((p, x) not in cells for x in range(nl))),
                  size)
    assert cover.complete_prefix() == prefix
    assert cover.layer_prefixes().tolist() == [
        next((p for p in range(size) if (p, x) not in cells), size) for x in range(nl)]
    assert (cover.gaps() == "") == (gap is None)
    if gap is not None:
        assert f"page {gap[0]}" in cover.gaps() or f"pages [{gap[0]}," in cover.gaps()
    assert {p for a, b in cover.open_runs() for p in range(a, b)} == \
        {p for p, _ in full - cells}


@pytest.mark.parametrize("pd", [16, 64])
def test_i22_a_last_send_of_no_layers_finishes_a_streamed_room(pd: int) -> None:
    """``send_layers([], (l, l), is_last=True)`` once every layer of every page was sent:
    the room ends with one more write carrying aux and no KV (equal and re-tiled pages)."""
    s = streaming(2, pd)
    s.create(ROOM, 0.0)
    s.init(ROOM, 4, 1, 0.0)
    bind(s, np.arange(-(-64 // pd), dtype=np.int64))
    src = np.arange(10, 14, dtype=np.int64)
    writes = of(s.send(ROOM, src, False, 1.0, layers=(0, 1)), Write)
    writes += of(s.write_done(ROOM, writes[-1].attempt, None, 0, 0.0, 1.0), Write)
    writes += of(s.send(ROOM, src[:0], False, 1.0, layers=(1, 2)), Write)
    writes += of(s.write_done(ROOM, writes[-1].attempt, None, 0, 0.0, 1.0), Write)
    writes += of(s.send(ROOM, src[:0], True, 1.0, layers=(0, 0)), Write)
    last = writes[-1]
    assert last.is_last and last.aux_index == 1 and last.layers is None
    assert not any(w.is_last for w in writes[:-1])
    if pd == 16:
        assert last.src_pages.size == 0
    else:
        assert last.tokens is not None and last.tokens[0] == last.tokens[1] == 64
    s.write_done(ROOM, last.attempt, None, 0, 0.0, 1.0)
    assert s.rooms[ROOM].status == KVPoll.Success


@pytest.mark.parametrize(("call", "match", "fails"), [
    # the finishing send while layers are missing: which pages miss which layers
    (lambda s, p: s.send(ROOM, p[:0], True, 1.0, layers=(0, 0)),
     r"leaves layers unnamed: room pages \[0, 2\) miss layers 2-3 \(every layer", True),
    (lambda s, p: s.send(ROOM, p[:1], True, 1.0, layers=(2, 2)),
     r"a last send of no layers \(\[2, 2\)\) names 1 pages", True),
    (lambda s, p: s.send(ROOM, p[:2], False, 1.0, layers=(2, 2)),
     r"layers \[2, 2\) name no layer", True),
    (lambda s, p: s.send(ROOM, p[:2], False, 1.0, layers=(3, 1)),
     r"layers \[3, 1\) name no layer", True),
    (lambda s, p: s.send(ROOM, p[:2], False, 1.0, layers=(2, 9)),
     r"layers \[2, 9\) end outside the 4 layers", True),
])
def test_i22_send_layers_edges_name_what_is_wrong(call: object, match: str,
                                                  fails: bool) -> None:
    s, src = _started()
    s.send(ROOM, src[:2], False, 1.0, layers=(0, 2))
    with pytest.raises(RoomError, match=match):
        call(s, src)  # type: ignore[operator]
    r = s.rooms[ROOM]
    assert (r.status == KVPoll.Failed) == fails
    assert r.failure is not None and r.failure.kind == FailureKind.LAYOUT
    assert re.search(match, r.failure.reason)  # what the engine's poll reads names it too


def test_i22_a_layer_range_of_no_page_before_any_page_says_so() -> None:
    s, src = _started()
    with pytest.raises(RoomError, match="named no page yet"):
        s.send(ROOM, src[:0], False, 1.0, layers=(0, 1))
    assert s.rooms[ROOM].failure is not None
    assert s.rooms[ROOM].failure.kind == FailureKind.LAYOUT


def test_i22_a_send_after_the_last_names_itself_and_the_room_goes_on() -> None:
    s, src = _started(nl=2, n=1)
    (w,) = of(s.send(ROOM, src, True, 1.0), Write)
    with pytest.raises(RoomError, match=r"layers \[0, 1\) of 0 pages sent after the room's "
                                        r"last send"):
        s.send(ROOM, src[:0], False, 1.0, layers=(0, 1))
    with pytest.raises(RoomError, match="a chunk of 1 pages sent after"):
        s.send(ROOM, src, False, 1.0)
    assert s.rooms[ROOM].status == KVPoll.Transferring  # the room is not failed by it
    s.write_done(ROOM, w.attempt, None, 0, 0.0, 1.0)
    assert s.rooms[ROOM].status == KVPoll.Success
