"""Re-tiling across page sizes (issue 22 item 3): a prefill with ``Ps`` tokens per page
writes a decode with ``Pd`` (1, 16, 64 both ways), MHA and MLA, NHD and HND, fused K/V,
attention TP 1->1, 2->1, 1->2, 4->2, 1->4 (GQA replication), PP stages, chunked sends
(``first_page`` in sender pages) and a decode prefix hit (decode pages it already holds).

Oracles, independent of the planner: real bytes (a global KV tensor written into each
prefill rank's pages by its layout, the plans applied, every decode byte compared with
the tensor or the untouched sentinel) and a write count per decode byte (each byte the
decode reads for the room written exactly once, nothing else). The proof
(:meth:`PairPlan.prove_tokens`) accepts every such plan and refuses mutated ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.control.routing import resolve_targets
from kvd.errors import LayoutError, RegistrationError
from kvd.transfer.layout import PairPlan, RankLayout, check_pair, rank_heads
from kvd.transfer.plan import U64, Descriptors, PlanRefused

HEAD_DIM, DTYPE, SENTINEL = 2, 2, 0xAA
TP_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (1, 4)]
SIZES = [1, 16, 64]


@dataclass(frozen=True)
class World:
    mla: bool
    fused: bool
    layout: str
    prefill_tp: int
    decode_tp: int
    total_heads: int
    ps: int
    pd: int
    layers: int
    stages: tuple[int, ...]

    def head_bytes(self) -> int:
        """Bytes of one head of one token (MLA: the latent, 3 heads wide)."""
        return HEAD_DIM * DTYPE * (3 if self.mla else 2 if self.fused else 1)

    def rank(self, tp_rank: int, tp_size: int, l0: int, l1: int, page: int, pool: int,
             base: int) -> RankLayout:
        heads = 1 if self.mla else rank_heads(tp_rank, tp_size, self.total_heads)[1]
        item = page * heads * self.head_bytes()
        nbuf = (l1 - l0) * (1 if self.mla or self.fused else 2)
        stride = item * pool + 64  # a gap between buffers: nothing may land there
        return RankLayout(kv_ptrs=np.array([base + b * stride for b in range(nbuf)], U64),
                          item_lens=np.full(nbuf, item, U64), page_size=page,
                          num_kv_heads=heads, total_kv_heads=1 if self.mla else self.total_heads,
                          head_dim=HEAD_DIM, dtype_size=DTYPE, num_layers=l1 - l0,
                          layer_start=l0, is_mla=self.mla, layout=self.layout,
                          tp_rank=tp_rank, tp_size=tp_size, fused_kv=self.fused)

    @property
    def pp(self) -> int:
        return len(self.stages) - 1


@st.composite
def worlds(draw: st.DrawFn) -> World:
    mla = draw(st.booleans())
    fused = not mla and draw(st.booleans())
    ptp, dtp = draw(st.sampled_from(TP_PAIRS))
    total = 2 if (ptp, dtp) == (1, 4) else 4
    pp = draw(st.integers(1, 2))
    layers = draw(st.integers(pp, 3))
    cuts = [draw(st.integers(1, layers - 1))] if pp > 1 else []
    ps, pd = draw(st.sampled_from([(a, b) for a in SIZES for b in SIZES if a != b]))
    return World(mla, fused, draw(st.sampled_from(["NHD", "HND"])), ptp, dtp, total, ps, pd,
                 layers, (0, *cuts, layers))


@dataclass(frozen=True)
class Room:
    tokens: int
    src_pages: np.ndarray  # sender room pages [ceil(T / Ps)]
    dst_pages: np.ndarray  # decode room pages [ceil(T / Pd)]
    hit: int  # decode pages the decode already holds (its first_page)
    cuts: list[int]  # sender chunk boundaries, sender pages
    src_pool: int
    dst_pool: int


@st.composite
def rooms(draw: st.DrawFn, w: World) -> Room:
    t = draw(st.integers(1, 140))
    ns, nd = -(-t // w.ps), -(-t // w.pd)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sp_pool, dp_pool = ns + 3, nd + 3
    src = rng.permutation(sp_pool)[:ns].astype(np.int64)
    dst = rng.permutation(dp_pool)[:nd].astype(np.int64)
    if draw(st.booleans()):  # contiguous pages: runs join across pages
        src, dst = np.arange(1, ns + 1, dtype=np.int64), np.arange(2, nd + 2, dtype=np.int64)
    hit = draw(st.integers(0, nd - 1))
    cuts = sorted(draw(st.sets(st.integers(1, ns - 1), max_size=3))) if ns > 1 else []
    return Room(t, src, dst, hit, [0, *cuts, ns], sp_pool, dp_pool)


def offset(r: RankLayout, hb: int, page: int, slot: int, head: int) -> int:
    """Byte offset of (page, slot, local head) in one buffer of ``r`` (the layout's rule)."""
    if r.layout == "NHD" or r.is_mla:
        return page * int(r.item_lens[0]) + (slot * r.num_kv_heads + head) * hb
    return page * int(r.item_lens[0]) + (head * r.page_size + slot) * hb


class Memory:
    """One rank's bytes: a flat array addressed from ``base``."""

    def __init__(self, r: RankLayout, pool: int) -> None:
        self.base = int(r.kv_ptrs[0])
        size = int(r.kv_ptrs[-1]) - self.base + int(r.item_lens[0]) * pool + 64
        self.mem = np.full(size, SENTINEL, np.uint8)


def fill(w: World, r: RankLayout, m: Memory, kv: np.ndarray, room: Room) -> None:
    """Write the global tensor ``kv[layer, buf, token, head, byte]`` into ``r``'s pages."""
    hb = w.head_bytes()
    h0 = r.heads[0]
    for b in range(r.kv_ptrs.size):
        layer, kind = r.layer_start + b % r.num_layers, b // r.num_layers
        for t in range(room.tokens):
            page, slot = int(room.src_pages[t // r.page_size]), t % r.page_size
            for h in range(r.num_kv_heads):
                at = int(r.kv_ptrs[b]) - m.base + offset(r, hb, page, slot, h)
                m.mem[at:at + hb] = kv[layer, kind, t, h0 + h]


def apply(desc: Descriptors, src: Memory, dst: Memory) -> None:
    for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist(), strict=True):
        a, b = s - src.base, d - dst.base
        assert a >= 0 and a + n <= src.mem.size and b >= 0 and b + n <= dst.mem.size
        dst.mem[b:b + n] = src.mem[a:a + n]


def writes(desc: Descriptors) -> np.ndarray:
    if len(desc) == 0:
        return np.zeros(0, U64)
    n = desc.length.astype(np.int64)
    offs = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return np.repeat(desc.dst, n) + offs.astype(U64)


def chunks(w: World, room: Room) -> list[tuple[int, int, int, int]]:
    """``(f, n, lo, hi)`` per sender chunk: sender pages [f, f + n), tokens [lo, hi)."""
    first_token = room.hit * w.pd
    out = []
    for f, e in itertools.pairwise(room.cuts):
        lo, hi = max(f * w.ps, first_token), min(e * w.ps, room.tokens)
        if hi > lo:  # a chunk wholly inside the decode's prefix hit sends nothing
            out.append((f, e - f, lo, hi))
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_i22_retiled_rooms_move_every_byte_once_and_are_proved(data: st.DataObject) -> None:
    w = data.draw(worlds())
    room = data.draw(rooms(w))
    hb = w.head_bytes()
    nb = 1 if w.mla or w.fused else 2
    heads = 1 if w.mla else w.total_heads
    kv = np.random.default_rng(room.tokens).integers(
        0, 255, (w.layers, nb, room.tokens, heads, hb), dtype=np.uint8)
    dst_named = room.dst_pages[room.hit:]
    for d in range(w.decode_tp):
        decode = w.rank(d, w.decode_tp, 0, w.layers, w.pd, room.dst_pool,
                        0x8000_0000_0000_0000 + d * 2**32)
        dmem = Memory(decode, room.dst_pool)
        targets = resolve_targets(7, d, w.decode_tp, w.prefill_tp, 1, w.pp, w.mla)
        written = []
        for t in targets:
            if t.is_dummy:
                continue
            base = 0x7F00_0000_0000 + (t.pp_rank * 8 + t.tp_rank) * 2**32
            src = w.rank(t.tp_rank, w.prefill_tp, w.stages[t.pp_rank], w.stages[t.pp_rank + 1],
                         w.ps, room.src_pool, base)
            smem = Memory(src, room.src_pool)
            fill(w, src, smem, kv, room)
            pair = PairPlan.of(src, decode, retile=True)
            assert pair.retiled
            for f, n, lo, hi in chunks(w, room):
                desc = pair.plan_tokens(room.src_pages[f:f + n], dst_named, lo, hi, f, room.hit)
                with mock.patch("kvd.transfer.layout.interval_diff", side_effect=AssertionError(
                        "the planner's own order must take the in-order fast path")):
                    pair.prove_tokens(desc, dst_named, lo, hi, room.hit, None, "room 7")
                apply(desc, smem, dmem)
                written.append(writes(desc))
        # the bytes: every decode (layer, buf, token >= hit, head) is the tensor's
        h0, first = decode.heads[0], room.hit * w.pd
        want = np.full(dmem.mem.size, SENTINEL, np.uint8)
        read = []
        for b in range(decode.kv_ptrs.size):
            layer, kind = b % decode.num_layers, b // decode.num_layers
            for tok in range(first, room.tokens):
                page, slot = int(room.dst_pages[tok // w.pd]), tok % w.pd
                for h in range(decode.num_kv_heads):
                    at = int(decode.kv_ptrs[b]) - dmem.base + offset(decode, hb, page, slot, h)
                    want[at:at + hb] = kv[layer, kind, tok, h0 + h]
                    read.append(np.arange(at, at + hb, dtype=np.int64))
        assert np.array_equal(dmem.mem, want)
        got = np.sort(np.concatenate(written)) if written else np.zeros(0, U64)
        exp = (np.sort(np.concatenate(read)).astype(U64) + U64(dmem.base)) if read else \
            np.zeros(0, U64)
        assert np.array_equal(got, exp)  # each read byte written once, nothing else


@st.composite
def one_plan(draw: st.DrawFn) -> tuple[PairPlan, Room, Descriptors]:
    w = draw(worlds())
    room = draw(rooms(w))
    d = draw(st.integers(0, w.decode_tp - 1))
    t = draw(st.sampled_from([t for t in resolve_targets(1, d, w.decode_tp, w.prefill_tp, 1,
                                                         w.pp, w.mla) if not t.is_dummy]))
    src = w.rank(t.tp_rank, w.prefill_tp, w.stages[t.pp_rank], w.stages[t.pp_rank + 1], w.ps,
                 room.src_pool, 0x7F00_0000_0000)
    decode = w.rank(d, w.decode_tp, 0, w.layers, w.pd, room.dst_pool, 0x8000_0000_0000_0000)
    pair = PairPlan.of(src, decode, retile=True)
    return pair, room, pair.plan_tokens(room.src_pages, room.dst_pages, 0, room.tokens)


@settings(max_examples=100, deadline=None)
@given(one_plan(), st.data())
def test_i22_a_permuted_retiled_plan_takes_the_general_sweep(
        plan: tuple[PairPlan, Room, Descriptors], data: st.DataObject) -> None:
    """Another order of the same descriptors is still proved (by the sort-and-sweep)."""
    pair, room, desc = plan
    order = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).permutation(len(desc))
    pair.prove_tokens(Descriptors(desc.src[order], desc.dst[order], desc.length[order]),
                      room.dst_pages, 0, room.tokens)


@settings(max_examples=200, deadline=None)
@given(one_plan(), st.sampled_from(["drop", "duplicate", "shift+1", "lengthen", "split+1"]),
       st.data())
def test_i22_mutated_retiled_plans_are_refused(plan: tuple[PairPlan, Room, Descriptors],
                                               mutation: str, data: st.DataObject) -> None:
    pair, room, desc = plan
    if len(desc) == 0:
        return
    k = data.draw(st.integers(0, len(desc) - 1))
    dst, ln = desc.dst.copy(), desc.length.copy()
    if mutation == "drop":
        dst, ln = np.delete(dst, k), np.delete(ln, k)
    elif mutation == "duplicate":
        dst, ln = np.insert(dst, k, dst[k]), np.insert(ln, k, ln[k])
    elif mutation == "shift+1":
        dst[k] += U64(1)
    elif mutation == "split+1":  # cut in two, the second half one byte late: in order still
        if ln[k] < 2:
            return
        half = ln[k] // U64(2)
        dst = np.insert(dst, k + 1, dst[k] + half + U64(1))
        ln = np.insert(ln, k + 1, ln[k] - half)
        ln[k] = half
    else:
        ln[k] += U64(1)
    bad = Descriptors(np.resize(desc.src, dst.size), dst, ln)
    with pytest.raises(PlanRefused, match="plan refused"):
        pair.prove_tokens(bad, room.dst_pages, 0, room.tokens)


def test_i22_tokens_outside_the_named_pages_are_refused() -> None:
    w = World(False, False, "NHD", 1, 1, 4, 16, 64, 1, (0, 1))
    src = w.rank(0, 1, 0, 1, 16, 8, 0x1000_0000)
    dst = w.rank(0, 1, 0, 1, 64, 8, 0x9000_0000)
    pair = PairPlan.of(src, dst, retile=True)
    with pytest.raises(LayoutError, match="outside the 2 source pages"):
        pair.plan_tokens(np.array([0, 1]), np.array([0]), 0, 40)  # 2 x 16 < 40 tokens
    with pytest.raises(LayoutError, match="outside the 1 destination pages"):
        pair.plan_tokens(np.array([0, 1, 2, 3, 4]), np.array([0]), 0, 80)
    with pytest.raises(PlanRefused, match="destination page 3 is named twice"):
        pair.prove_tokens(Descriptors.empty(), np.array([3, 3]), 0, 100)


def test_i22_page_size_mismatch_refused_unless_retiling() -> None:
    w = World(True, False, "NHD", 1, 1, 4, 16, 64, 1, (0, 1))
    src, dst = w.rank(0, 1, 0, 1, 16, 8, 0x1000), w.rank(0, 1, 0, 1, 64, 8, 0x9000_0000)
    with pytest.raises(RegistrationError, match="page_size 16 vs 64"):
        check_pair(src, dst)
    check_pair(src, dst, retile=True)
    bad = w.rank(0, 1, 0, 1, 64, 8, 0x9000_0000)
    bad = RankLayout(**{**bad.__dict__, "item_lens": bad.item_lens + U64(64)})  # 65 B/token
    with pytest.raises(RegistrationError, match="kv item len mismatch"):
        check_pair(src, bad, retile=True)


def test_i22_contiguous_token_major_pages_join_into_one_descriptor_per_buffer() -> None:
    """16 -> 64, NHD, equal heads, contiguous pages on both sides: one run per buffer."""
    w = World(False, False, "NHD", 1, 1, 4, 16, 64, 2, (0, 2))
    src, dst = w.rank(0, 1, 0, 2, 16, 10, 0x1000_0000), w.rank(0, 1, 0, 2, 64, 4, 0x9000_0000)
    pair = PairPlan.of(src, dst, retile=True)
    desc = pair.plan_tokens(np.arange(8), np.arange(2), 0, 128)
    assert len(desc) == 4 and desc.nbytes == 4 * 128 * 4 * HEAD_DIM * DTYPE
    pair.prove_tokens(desc, np.arange(2), 0, 128)
