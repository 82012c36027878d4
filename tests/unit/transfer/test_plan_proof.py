"""The plan validity proof (issue 20 item 1, K42): every byte a decode rank reads for a room
is written exactly once, by exactly one source, and nothing else is written.

Over MHA/MLA, NHD/HND, attention TP 1->1, 2->1, 1->2, 4->2, 1->4 (GQA replication), PP 1-3
with arbitrary stage boundaries, page sizes 1/16/64, chunked sends with ``first_page``:

* every plan the planner makes for valid inputs is accepted, and a byte-level simulation
  of all sources' writes (an independent oracle: a write count per decode byte) shows each
  read byte written once and nothing else -- so "accepted" means "correct";
* mutated plans (a descriptor dropped, duplicated, shifted by one byte, lengthened) are
  refused with the exact first bad byte range and kind;
* destination page lists naming a page twice are refused naming the page;
* the all-sources half (:func:`prove_sources_tile`) refuses a missing, doubled or
  overlapping source (PP stages that overlap, a TP slice twice).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.control.routing import resolve_targets
from kvd.transfer.layout import PairPlan, RankLayout, prove_sources_tile, rank_heads
from kvd.transfer.plan import (
    U64,
    Descriptors,
    PlanRefused,
    check_distinct,
    interval_diff,
    plan_aux,
    prove_plan,
)

HIGH = 0x8000_0000_0000_0000  # decode addresses with bit 63 set
HEAD_DIM, DTYPE, POOL, AUX_LEN = 4, 2, 10, 24
TP_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (1, 4)]  # (prefill, decode) attention TP


@dataclass(frozen=True)
class World:
    mla: bool
    layout: str
    prefill_tp: int
    decode_tp: int
    total_heads: int
    page_size: int
    layers: int
    stages: tuple[int, ...]  # PP stage boundaries: stage k holds [stages[k], stages[k+1])

    def rank(self, tp_rank: int, tp_size: int, l0: int, l1: int, base: int) -> RankLayout:
        heads = 1 if self.mla else rank_heads(tp_rank, tp_size, self.total_heads)[1]
        item = self.page_size * heads * HEAD_DIM * DTYPE * (8 if self.mla else 1)
        nbuf = (l1 - l0) * (1 if self.mla else 2)
        stride = item * POOL + 64  # a gap between buffers: nothing may land there
        return RankLayout(kv_ptrs=np.array([base + b * stride for b in range(nbuf)], np.uint64),
                          item_lens=np.full(nbuf, item, np.uint64), page_size=self.page_size,
                          num_kv_heads=heads, total_kv_heads=1 if self.mla else self.total_heads,
                          head_dim=HEAD_DIM, dtype_size=DTYPE, num_layers=l1 - l0,
                          layer_start=l0, is_mla=self.mla, layout=self.layout, tp_rank=tp_rank,
                          tp_size=tp_size)

    def decode(self, d: int) -> RankLayout:
        return self.rank(d, self.decode_tp, 0, self.layers, HIGH + d * 2**32)

    def prefill(self, tp: int, pp: int) -> RankLayout:
        return self.rank(tp, self.prefill_tp, self.stages[pp], self.stages[pp + 1],
                         0x7F00_0000_0000 + (pp * 8 + tp) * 2**32)

    @property
    def pp(self) -> int:
        return len(self.stages) - 1


@st.composite
def worlds(draw: st.DrawFn) -> World:
    mla = draw(st.booleans())
    ptp, dtp = draw(st.sampled_from(TP_PAIRS))
    total = 2 if (ptp, dtp) == (1, 4) else 4  # 1->4 with 2 KV heads: GQA replication
    pp = draw(st.integers(1, 3))
    layers = draw(st.integers(pp, 5))
    cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1,
                                unique=True))) if pp > 1 else []
    return World(mla, draw(st.sampled_from(["NHD", "HND"])), ptp, dtp, total,
                 draw(st.sampled_from([1, 16, 64])), layers, (0, *cuts, layers))


@st.composite
def rooms(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, list[int]]:
    """(room source pages [P], decode pages [P - first_page], first_page, chunk cuts)."""
    n = draw(st.integers(1, 6))
    src = np.array(draw(st.permutations(range(POOL)))[:n], np.int64)
    first = draw(st.integers(0, n - 1))
    dst = np.array(draw(st.permutations(range(POOL)))[:n - first], np.int64)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    return src, dst, first, [0, *cuts, n]


def chunk_pages(src: np.ndarray, dst: np.ndarray, first: int, lo: int, hi: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """What one chunk of room pages [lo, hi) writes to a decode holding pages from
    ``first`` on (the sender machine's ``_chunk_dest``)."""
    a = max(lo, first)
    return src[lo:hi][a - lo:], dst[a - first:hi - first] if hi > a else dst[:0]


def writes(desc: Descriptors) -> np.ndarray:
    """Every destination byte address written (with repeats), uint64."""
    if len(desc) == 0:
        return np.zeros(0, U64)
    n = desc.length.astype(np.int64)
    starts = np.repeat(desc.dst, n)
    offs = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return starts + offs.astype(U64)


def read_bytes(dst: RankLayout, pages: np.ndarray) -> np.ndarray:
    """Every byte the decode reads for its room pages: whole pages of every buffer."""
    item = int(dst.item_lens[0])
    per = (dst.kv_ptrs[:, None] + pages.astype(U64)[None, :] * U64(item)).ravel()
    return (per[:, None] + np.arange(item, dtype=U64)[None, :]).ravel()


def aux_of(decode: RankLayout) -> tuple[np.ndarray, np.ndarray]:
    return np.array([int(decode.kv_ptrs[-1]) + 2**30], np.uint64), np.array([AUX_LEN], np.uint64)


@settings(max_examples=150, deadline=None)
@given(worlds(), rooms())
def test_k42_every_planned_room_is_proved_and_written_exactly_once(
        w: World, room: tuple[np.ndarray, np.ndarray, int, list[int]]) -> None:
    src_pages, dst_pages, first, cuts = room
    for d in range(w.decode_tp):
        decode = w.decode(d)
        aux_ptrs, aux_lens = aux_of(decode)
        targets = resolve_targets(7, d, w.decode_tp, w.prefill_tp, 1, w.pp, w.mla)
        sources = [w.prefill(t.tp_rank, t.pp_rank) for t in targets]
        prove_sources_tile(decode, sources, [t.is_dummy for t in targets])
        written, aux_writers = [], 0
        for t, src in zip(targets, sources, strict=True):
            if t.is_dummy:
                continue
            pair = PairPlan.of(src, decode)
            for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
                sp, dp = chunk_pages(src_pages, dst_pages, first, lo, hi)
                desc, aux = pair.plan(sp, dp), None
                last = i == len(cuts) - 2 and t.pp_rank == w.pp - 1 and pair.writes_aux
                if last:
                    aux_writers += 1
                    desc = desc.concat(plan_aux(aux_ptrs, aux_ptrs, aux_lens, 0, 3))
                    aux = (aux_ptrs, aux_lens, 3)
                pair.prove(desc, sp, dp, aux, "room 7")  # accepted: no raise
                written.append(writes(desc))
        got = np.sort(np.concatenate(written)) if written else np.zeros(0, U64)
        slot = (aux_ptrs[0] + U64(3 * AUX_LEN)) + np.arange(AUX_LEN, dtype=U64)
        want = np.sort(np.concatenate([read_bytes(decode, dst_pages), slot]))
        assert aux_writers == 1  # the aux slot: one writer per decode rank
        assert np.array_equal(got, want)  # every read byte once, nothing else


@st.composite
def one_plan(draw: st.DrawFn) -> tuple[PairPlan, np.ndarray, np.ndarray, Descriptors]:
    w = draw(worlds())
    d = draw(st.integers(0, w.decode_tp - 1))
    t = draw(st.sampled_from([t for t in resolve_targets(1, d, w.decode_tp, w.prefill_tp, 1,
                                                         w.pp, w.mla) if not t.is_dummy]))
    pair = PairPlan.of(w.prefill(t.tp_rank, t.pp_rank), w.decode(d))
    n = draw(st.integers(1, 5))
    sp = np.array(draw(st.permutations(range(POOL)))[:n], np.int64)
    dp = np.array(draw(st.permutations(range(POOL)))[:n], np.int64)
    return pair, sp, dp, pair.plan(sp, dp)


MUTATIONS = ["drop", "duplicate", "shift+1", "shift-1", "lengthen"]


@settings(max_examples=200, deadline=None)
@given(one_plan(), st.sampled_from(MUTATIONS), st.data())
def test_k42_mutated_plans_are_refused_naming_the_first_bad_range(
        plan: tuple[PairPlan, np.ndarray, np.ndarray, Descriptors], mutation: str,
        data: st.DataObject) -> None:
    pair, sp, dp, desc = plan
    k = data.draw(st.integers(0, len(desc) - 1))
    dst, ln = desc.dst.copy(), desc.length.copy()
    d0, n0 = int(dst[k]), int(ln[k])
    covered = set(zip(dst.tolist(), (dst + ln).tolist(), strict=True))
    if mutation == "drop":
        dst, ln = np.delete(dst, k), np.delete(ln, k)
        want = ("uncovered", d0, d0 + n0)
    elif mutation == "duplicate":
        dst, ln = np.insert(dst, k, dst[k]), np.insert(ln, k, ln[k])
        want = ("doubled", d0, d0 + n0)
    elif mutation == "shift+1":
        dst[k] += U64(1)
        want = ("uncovered", d0, d0 + 1)
    elif mutation == "shift-1":
        dst[k] -= U64(1)
        before = any(hi == d0 for _, hi in covered)  # a neighbour ends where it started
        want = ("doubled" if before else "outside", d0 - 1, d0)
    else:
        ln[k] += U64(1)
        after = any(lo == d0 + n0 for lo, _ in covered)
        want = ("doubled" if after else "outside", d0 + n0, d0 + n0 + 1)
    bad = Descriptors(desc.src[:dst.size] if dst.size <= len(desc) else
                      np.resize(desc.src, dst.size), dst, ln)
    with pytest.raises(PlanRefused) as err:
        pair.prove(bad, sp, dp, None, "room 1")
    assert (err.value.kind, err.value.lo, err.value.hi) == want
    msg = str(err.value)  # names where the bad byte is: layer and page, or no buffer at all
    assert ("page" in msg and "layer" in msg) or "every buffer of the room" in msg, msg


@settings(max_examples=100, deadline=None)
@given(one_plan(), st.data())
def test_k42_a_destination_page_named_twice_is_refused_naming_it(
        plan: tuple[PairPlan, np.ndarray, np.ndarray, Descriptors], data: st.DataObject) -> None:
    pair, _sp, dp, _ = plan
    i = data.draw(st.integers(0, dp.size - 1))
    dup = np.insert(dp, data.draw(st.integers(0, dp.size)), dp[i])
    sp2 = np.array(list(range(POOL))[:dup.size], np.int64)
    with pytest.raises(PlanRefused, match=f"destination page {int(dp[i])} is named twice"):
        pair.prove(pair.plan(sp2, dup), sp2, dup, None, "room 1")


def test_k42_a_reordered_valid_plan_is_accepted() -> None:
    """The proof is about bytes, not order: the slow path accepts a permuted plan."""
    w = World(False, "NHD", 2, 1, 4, 16, 2, (0, 2))
    pair = PairPlan.of(w.prefill(1, 0), w.decode(0))
    sp, dp = np.array([3, 1, 2]), np.array([5, 0, 9])
    desc = pair.plan(sp, dp)
    perm = np.random.default_rng(0).permutation(len(desc))
    pair.prove(Descriptors(desc.src[perm], desc.dst[perm], desc.length[perm]), sp, dp)


@settings(max_examples=100, deadline=None)
@given(worlds(), st.sampled_from(["drop", "again", "overlap"]), st.data())
def test_k42_sources_that_do_not_tile_the_decode_are_refused(
        w: World, mutation: str, data: st.DataObject) -> None:
    d = data.draw(st.integers(0, w.decode_tp - 1))
    decode = w.decode(d)
    targets = [t for t in resolve_targets(1, d, w.decode_tp, w.prefill_tp, 1, w.pp, w.mla)
               if not t.is_dummy]
    sources = [w.prefill(t.tp_rank, t.pp_rank) for t in targets]
    k = data.draw(st.integers(0, len(sources) - 1))
    if mutation == "drop":
        sources.pop(k)
        kind = "uncovered"
    elif mutation == "again":
        sources.append(sources[k])
        kind = "doubled"
    else:  # a PP stage reaching one layer into its neighbour's (or past the decode's end)
        s = sources[k]
        if s.layer_end == w.layers:
            if s.layer_start == 0:
                return  # one stage holds every layer: no neighbour to overlap
            sources[k] = w.rank(s.tp_rank, s.tp_size, s.layer_start - 1, s.layer_end,
                                0x7000_0000_0000)
        else:
            sources[k] = w.rank(s.tp_rank, s.tp_size, s.layer_start, s.layer_end + 1,
                                0x7000_0000_0000)
        kind = "doubled"
    with pytest.raises(PlanRefused, match="decode layer") as err:
        prove_sources_tile(decode, sources)
    assert err.value.kind == kind


def test_interval_diff_agrees_with_a_byte_count() -> None:
    """The sweep names the lowest bad byte like a per-byte count would."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        e_lo = np.sort(rng.choice(200, 6, replace=False)).astype(np.uint64) * U64(4)
        e_len = np.full(6, 4, np.uint64)
        a_lo = np.concatenate([e_lo, rng.integers(0, 800, 2).astype(np.uint64)])
        a_len = np.concatenate([e_len, rng.integers(0, 6, 2).astype(np.uint64)])
        count = np.zeros(900, np.int64)
        want = np.zeros(900, np.int64)
        for lo, n in zip(a_lo.tolist(), a_len.tolist(), strict=True):
            count[lo:lo + n] += 1
        for lo, n in zip(e_lo.tolist(), e_len.tolist(), strict=True):
            want[lo:lo + n] = 1
        bad = np.flatnonzero(count != want)
        got = interval_diff(a_lo, a_len, e_lo, e_len)
        if bad.size == 0:
            assert got is None
        else:
            assert got is not None and got[1] == int(bad[0])


def test_check_distinct_names_page_and_positions() -> None:
    with pytest.raises(PlanRefused, match=r"page 40 is named twice \(positions 0 and 2\)"):
        check_distinct(np.array([40, 41, 40]), "room 3 destination")


def test_prove_plan_counts_aux_once() -> None:
    """The aux slot twice (two sources, or two chunks) is a doubled range named as aux."""
    w = World(False, "HND", 1, 1, 4, 16, 1, (0, 1))
    pair = PairPlan.of(w.prefill(0, 0), w.decode(0))
    aux_ptrs, aux_lens = aux_of(w.decode(0))
    sp = dp = np.array([2])
    one = plan_aux(aux_ptrs, aux_ptrs, aux_lens, 0, 1)
    desc = pair.plan(sp, dp).concat(one).concat(one)
    with pytest.raises(PlanRefused, match="aux 0 slot") as err:
        prove_plan(desc, pair.tiling(sp, dp, (aux_ptrs, aux_lens, 1)), "room 2")
    assert err.value.kind == "doubled"
