"""Extra paged cache groups (issue 22 items 1 and 2): a draft model's KV and an indexer's K
cache ride on the room's KV pages, each with its own item length, layers, heads and
layout, head-sliced over attention TP or replicated.

Oracles, independent of the planner: real bytes (a global tensor per group written into
every prefill rank's pages by its layout, the plans applied, every decode byte compared
with the tensor) and a write count per decode byte (every byte the decode reads for the
room written exactly once, by one source; nothing else). Pairing refuses a group missing
or shaped differently on the other side with one reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import RegistrationError
from kvd.protocol.control import GroupSpec, GroupWire, KVArgsWire
from kvd.transfer.groups import (
    GROUP_ID_BASE,
    GroupLayout,
    group_layouts,
    pair_groups,
    plan_room_groups,
    prove_group_sources_tile,
)
from kvd.transfer.kvargs import RankArgs
from kvd.transfer.layout import RankLayout, prefill_targets, rank_heads
from kvd.transfer.plan import U64, PlanRefused, check_plan_bounds

TP_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)]
DTYPE = 2


@dataclass(frozen=True)
class Group:
    """A group's model-wide shape: ``heads`` KV heads (replicated: 1), ``head_dim``."""

    name: str
    layers: int
    heads: int
    head_dim: int
    replicated: bool
    layout: str

    def head_bytes(self) -> int:
        return self.head_dim * DTYPE

    def kinds(self) -> int:
        return 1 if self.replicated else 2


@dataclass(frozen=True)
class World:
    groups: tuple[Group, ...]
    prefill_tp: int
    decode_tp: int
    ps: int
    pd: int
    stages: tuple[int, ...]  # prefill PP cut points in every group's layers (fractions)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    ptp, dtp = draw(st.sampled_from(TP_PAIRS))
    n = draw(st.integers(1, 2))
    groups = []
    for i in range(n):
        rep = draw(st.booleans())
        groups.append(Group(("draft", "indexer")[i], draw(st.integers(2, 3)),
                            1 if rep else 4, draw(st.sampled_from([2, 3])), rep,
                            draw(st.sampled_from(["NHD", "HND"]))))
    ps = draw(st.sampled_from([1, 4, 16]))
    pd = ps if draw(st.booleans()) else draw(st.sampled_from([1, 4, 16]))
    pp = draw(st.integers(1, 2))
    return World(tuple(groups), ptp, dtp, ps, pd, (0, 1) if pp == 1 else (0, 1, 2))


def _stage_layers(g: Group, stage: int, n_stages: int) -> tuple[int, int]:
    cut = [0, *([g.layers // 2] if n_stages > 1 else []), g.layers]
    return cut[stage], cut[stage + 1]


class Rank:
    """One rank's group buffers in one flat memory from ``base`` (a gap between buffers)."""

    def __init__(self, w: World, tp_rank: int, tp_size: int, page: int, pool: int,
                 base: int, stage: int | None = None) -> None:
        self.base, self.page, self.tp_rank, self.tp_size = base, page, tp_rank, tp_size
        self.layouts: list[GroupLayout] = []
        self.geom: list[tuple[Group, int, int, int, int, list[int]]] = []
        at, id_base = base, GROUP_ID_BASE
        for g in w.groups:
            l0, l1 = (0, g.layers) if stage is None else _stage_layers(g, stage,
                                                                      len(w.stages) - 1)
            h0, nh = (0, 1) if g.replicated else rank_heads(tp_rank, tp_size, g.heads)
            item = page * nh * g.head_bytes()
            nbuf = (l1 - l0) * g.kinds()
            ptrs = [at + b * (item * pool + 64) for b in range(nbuf)]
            at = ptrs[-1] + item * pool + 64
            lay = RankLayout(kv_ptrs=np.array(ptrs, U64), item_lens=np.full(nbuf, item, U64),
                             page_size=page, num_kv_heads=nh, total_kv_heads=g.heads,
                             head_dim=g.head_dim, dtype_size=DTYPE, num_layers=l1 - l0,
                             layer_start=l0, is_mla=g.replicated, layout=g.layout,
                             tp_rank=tp_rank, tp_size=tp_size)
            self.layouts.append(GroupLayout(g.name, lay, id_base))
            self.geom.append((g, l0, l1, h0, nh, ptrs))
            id_base += nbuf
        self.mem = np.zeros(at - base, np.uint8)
        self.count = np.zeros(at - base, np.int64)

    def slots(self, pages: np.ndarray, tokens: int):  # type: ignore[no-untyped-def]
        """``(group index, layer, kind, token, global head, byte offset in mem)`` of every
        head slot of the first ``tokens`` tokens of room pages ``pages``."""
        for gi, (g, l0, l1, h0, nh, ptrs) in enumerate(self.geom):
            hb, item = g.head_bytes(), self.page * nh * g.head_bytes()
            for li in range(l1 - l0):
                for k in range(g.kinds()):
                    ptr = ptrs[k * (l1 - l0) + li] - self.base
                    for t in range(tokens):
                        p, s = int(pages[t // self.page]), t % self.page
                        for j in range(nh):
                            inner = (s * nh + j) if g.layout == "NHD" or g.replicated else \
                                (j * self.page + s)
                            yield gi, l0 + li, k, t, h0 + j, ptr + p * item + inner * hb, hb


def truth_bytes(gi: int, layer: int, kind: int, token: int, head: int, hb: int) -> np.ndarray:
    seed = ((gi * 7 + layer) * 3 + kind) * 1009 + token * 31 + head
    return np.random.default_rng(seed).integers(0, 256, hb, dtype=np.uint8)


def apply(desc, src: Rank, dst: Rank) -> None:  # type: ignore[no-untyped-def]
    for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist(), strict=True):
        assert s - src.base >= 0 and s - src.base + n <= src.mem.size
        assert d - dst.base >= 0 and d - dst.base + n <= dst.mem.size
        dst.mem[d - dst.base:d - dst.base + n] = src.mem[s - src.base:s - src.base + n]
        dst.count[d - dst.base:d - dst.base + n] += 1


@settings(max_examples=60, deadline=None)
@given(worlds(), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_i22_groups_move_byte_for_byte_every_decode_byte_once(w: World, tokens: int,
                                                             seed: int) -> None:
    rng = np.random.default_rng(seed)
    ns, nd = -(-tokens // w.ps), -(-tokens // w.pd)
    if w.ps == w.pd:
        tokens = ns * w.ps  # whole pages move: every slot of the room's pages
    src_pages = rng.permutation(ns + 2)[:ns].astype(np.int64)
    dst_pages = rng.permutation(nd + 2)[:nd].astype(np.int64)
    n_stages = len(w.stages) - 1
    for d_rank in range(w.decode_tp):
        dst = Rank(w, d_rank, w.decode_tp, w.pd, nd + 2, 1 << 40)
        sources = []
        for i, p_rank in enumerate(prefill_targets(d_rank, w.decode_tp, w.prefill_tp)):
            for stage in range(n_stages):
                src = Rank(w, p_rank, w.prefill_tp, w.ps, ns + 2, (1 << 32) * (i * 4 + stage + 1),
                           stage)
                for gi, layer, kind, t, head, off, hb in src.slots(src_pages, ns * w.ps):
                    src.mem[off:off + hb] = truth_bytes(gi, layer, kind, t, head, hb)
                plans = pair_groups(tuple(src.layouts), tuple(dst.layouts), stage, n_stages)
                chunk = None if w.ps == w.pd else (0, tokens)
                desc = plan_room_groups(plans, src_pages, dst_pages, chunk)
                apply(desc, src, dst)
                sources.append(tuple(src.layouts))
        prove_group_sources_tile(tuple(dst.layouts), sources)
        expect = np.zeros_like(dst.count)
        for gi, layer, kind, t, head, off, hb in dst.slots(dst_pages, tokens):
            assert np.array_equal(dst.mem[off:off + hb],
                                  truth_bytes(gi, layer, kind, t, head, hb)), (gi, layer, t)
            expect[off:off + hb] = 1
        assert np.array_equal(dst.count, expect)  # once each, and nothing else written


def _one(name: str = "draft", rep: bool = False, layout: str = "NHD") -> World:
    return World((Group(name, 2, 1 if rep else 4, 2, rep, layout),), 1, 1, 4, 4, (0, 1))


def _layouts(w: World, tp_rank: int = 0, tp_size: int = 1) -> tuple[GroupLayout, ...]:
    return tuple(Rank(w, tp_rank, tp_size, w.ps, 4, 1 << 32).layouts)


def test_i22_a_group_on_one_side_only_is_refused_naming_it() -> None:
    draft = _layouts(_one())
    with pytest.raises(RegistrationError, match="group 'draft' only on the prefill"):
        pair_groups(draft, ())
    with pytest.raises(RegistrationError, match="group 'draft' only on the decode"):
        pair_groups((), draft)
    pair_groups((), draft, pp_rank=0, pp_size=2)  # another stage may hold it


@pytest.mark.parametrize(("other", "why"), [
    (_one(rep=True), "group 'draft': .*is_mla False vs True"),
    (_one(layout="HND"), "group 'draft': .*layout NHD vs HND"),
    (World((Group("draft", 2, 4, 3, False, "NHD"),), 1, 1, 4, 4, (0, 1)),
     "group 'draft': .*head_dim 2 vs 3"),
    (World((Group("draft", 1, 4, 2, False, "NHD"),), 1, 1, 4, 4, (0, 1)),
     "group 'draft': .*layers")])
def test_i22_a_group_shaped_differently_is_refused_with_one_reason(other: World,
                                                                  why: str) -> None:
    with pytest.raises(RegistrationError, match=r"paged cache groups .*" + why):
        pair_groups(_layouts(_one()), _layouts(other))


def test_i22_a_head_sliced_group_owed_by_an_mla_dummy_is_refused() -> None:
    src, dst = _layouts(_one(), 1, 2), _layouts(_one(), 0, 1)
    with pytest.raises(RegistrationError, match="MLA dummy"):
        pair_groups(src, dst, src_dummy=True)
    rep = _one(rep=True)  # a replicated group is written by the first target, not the dummy
    plans = pair_groups(_layouts(rep, 1, 2), _layouts(rep, 0, 1), src_dummy=True)
    assert not plans[0].writes


def test_i22_a_replicated_group_is_written_by_one_replica() -> None:
    w = _one(rep=True)
    dst = _layouts(w, 0, 1)
    plans = [pair_groups(_layouts(w, r, 2), dst)[0].writes for r in range(2)]
    assert plans == [True, False]
    prove_group_sources_tile(dst, [_layouts(w, r, 2) for r in range(2)])


def test_i22_the_sources_tile_refuses_a_missing_or_doubled_group_head() -> None:
    w = _one()
    dst = _layouts(w, 0, 1)
    with pytest.raises(PlanRefused, match=r"group 'draft': .*written by 0"):
        prove_group_sources_tile(dst, [_layouts(w, 0, 2)])
    with pytest.raises(PlanRefused, match=r"group 'draft': .*written by 2"):
        prove_group_sources_tile(dst, [_layouts(w, 0, 1), _layouts(w, 0, 1)])


def test_i22_a_mutated_group_plan_is_refused() -> None:
    w = _one()
    src, dst = _layouts(w), _layouts(w)
    plans = pair_groups(src, dst)
    pages = np.array([1, 2], np.int64)
    desc = plans[0].pair.plan(pages, pages)
    short = type(desc)(desc.src, desc.dst, desc.length - U64(1))
    with pytest.raises(PlanRefused, match="group 'draft'"):
        plans[0].pair.prove(short, pages, pages, None, "room 1, group 'draft'")


def _wire(groups: list[GroupWire], kv_pages: int = 8) -> KVArgsWire:
    return KVArgsWire("s", [1 << 30, 2 << 30], [64 * kv_pages] * 2, [64, 64], [], [], [],
                      page_size=4, num_kv_heads=4, head_dim=4, dtype_size=1, num_layers=1,
                      groups=groups)


def _gw(name: str = "draft", pages: int = 8, item: int = 32, at: int = 3) -> GroupWire:
    spec = GroupSpec(name, [item], 1, 1, 4, 2, replicated=True)
    return GroupWire(spec, [at << 30], [pages * item])


def test_i22_registration_takes_groups_as_regions_from_group_id_base() -> None:
    args = RankArgs.of(_wire([_gw("draft"), _gw("indexer", item=16, at=4)]))
    ids = sorted(int(i) for i in args.regions.ids if i >= GROUP_ID_BASE)
    assert ids == [GROUP_ID_BASE, GROUP_ID_BASE + 1]
    lay = group_layouts(args.wire, 0, 1)
    assert [(g.name, g.id_base) for g in lay] == [("draft", GROUP_ID_BASE),
                                                  ("indexer", GROUP_ID_BASE + 1)]


@pytest.mark.parametrize(("groups", "why"), [
    ([_gw(), _gw(at=4)], "'draft' registered twice"),
    ([_gw(pages=4)], "buffer 0 holds 4 pages, the main KV 8"),
    ([GroupWire(GroupSpec("draft", [32, 32], 1, 1, 4, 2, replicated=True), [1], [256])],
     "2 item lengths")])
def test_i22_a_bad_group_registration_is_refused(groups: list[GroupWire], why: str) -> None:
    with pytest.raises(RegistrationError, match=why):
        RankArgs.of(_wire(groups))


def test_i22_group_descriptors_are_bounds_checked_against_their_own_buffer() -> None:
    a = RankArgs.of(_wire([_gw()]))
    plans = pair_groups(group_layouts(a.wire, 0, 1), group_layouts(a.wire, 0, 1))
    pages = np.array([7], np.int64)
    desc = plan_room_groups(plans, pages, pages)
    check_plan_bounds(desc, a.regions, a.regions, "room 1")
    assert desc.span_bufs is not None and int(desc.span_bufs[1][0]) == GROUP_ID_BASE
