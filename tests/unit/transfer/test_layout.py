"""kvd.transfer.layout: heterogeneous TP / PP / MLA planning, applied to real memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import BoundsError, IndexLengthMismatch, LayoutError, RegistrationError
from kvd.protocol.control import KVArgsWire
from kvd.transfer import plan
from kvd.transfer.layout import (
    RankLayout,
    check_pair,
    head_overlap,
    plan_transfer,
    prefill_targets,
    rank_heads,
)
from kvd.transfer.plan import Descriptors, Regions, check_bounds

U = np.uint64
HIGH = 0x8000_0000_0000_0000  # bit 63 set


def make(tp_rank: int = 0, tp_size: int = 1, total: int = 8, *, page_size: int = 16,
         head_dim: int = 128, dtype_size: int = 2, num_layers: int = 2, layer_start: int = 0,
         is_mla: bool = False, layout: str = "NHD", base: int = 0x7F00_0000_0000,
         pool_pages: int = 64, item: int | None = None) -> RankLayout:
    """A layout with made-up, non-overlapping buffer addresses (no real memory)."""
    heads = 1 if is_mla else rank_heads(tp_rank, tp_size, total)[1]
    if item is None:
        item = page_size * heads * head_dim * dtype_size
    nbuf = num_layers * (1 if is_mla else 2)
    ptrs = [base + b * (item * pool_pages + 4096) for b in range(nbuf)]
    return RankLayout(kv_ptrs=np.array(ptrs, dtype=U), item_lens=np.full(nbuf, item, dtype=U),
                      page_size=page_size, num_kv_heads=heads,
                      total_kv_heads=1 if is_mla else total,
                      head_dim=head_dim, dtype_size=dtype_size, num_layers=num_layers,
                      layer_start=layer_start, is_mla=is_mla, layout=layout, tp_rank=tp_rank,
                      tp_size=tp_size)


def naive(src: RankLayout, dst: RankLayout, sp: list[int], dp: list[int]
          ) -> list[tuple[int, int, int]]:
    """Per page / per token slot reference in Python ints (SGLang's send_kvcache_slice loop).

    Whole pages are not coalesced; compare with plans of non-contiguous pages only.
    """
    if src.is_mla:
        s0, sn, d0, dn = 0, 1, 0, 1
    else:
        s0, sn = rank_heads(src.tp_rank, src.tp_size, src.total_kv_heads)
        d0, dn = rank_heads(dst.tp_rank, dst.tp_size, dst.total_kv_heads)
    common = sorted(set(range(s0, s0 + sn)) & set(range(d0, d0 + dn)))
    if not common:
        return []
    hb = src.head_dim * src.dtype_size
    kinds = 1 if src.is_mla else 2
    out = []
    for kind in range(kinds):
        for layer in range(src.layer_start, src.layer_start + src.num_layers):
            sb = kind * src.num_layers + layer - src.layer_start
            db = kind * dst.num_layers + layer - dst.layer_start
            s_ptr, d_ptr = int(src.kv_ptrs[sb]), int(dst.kv_ptrs[db])
            s_item, d_item = int(src.item_lens[sb]), int(dst.item_lens[db])
            for s_page, d_page in zip(sp, dp, strict=True):
                s_at, d_at = s_ptr + s_page * s_item, d_ptr + d_page * d_item
                if src.is_mla or (sn == dn == len(common)):
                    out.append((s_at, d_at, s_item))
                elif src.layout == "HND":
                    run = src.page_size * hb
                    out.append((s_at + (common[0] - s0) * run, d_at + (common[0] - d0) * run,
                                len(common) * run))
                else:
                    for t in range(src.page_size):
                        out.append((s_at + (t * sn + common[0] - s0) * hb,
                                    d_at + (t * dn + common[0] - d0) * hb, len(common) * hb))
    return out


def triples(desc: Descriptors) -> list[tuple[int, int, int]]:
    for arr in (desc.src, desc.dst, desc.length):
        assert arr.dtype == np.uint64
    return list(zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist(), strict=True))


# --------------------------------------------------------------------------- rank_heads / TP

@pytest.mark.parametrize(("tp", "total", "expected"), [
    (1, 8, [(0, 8)]),
    (2, 8, [(0, 4), (4, 4)]),
    (4, 2, [(0, 1), (0, 1), (1, 1), (1, 1)]),
    (8, 4, [(0, 1), (0, 1), (1, 1), (1, 1), (2, 1), (2, 1), (3, 1), (3, 1)]),
    (2, 1, [(0, 1), (0, 1)]),
])
def test_rank_heads(tp: int, total: int, expected: list[tuple[int, int]]) -> None:
    assert [rank_heads(r, tp, total) for r in range(tp)] == expected


@pytest.mark.parametrize(("rank", "tp", "total"), [(0, 3, 8), (0, 3, 2), (2, 2, 8), (0, 0, 8),
                                                   (0, 2, 0)])
def test_rank_heads_refused(rank: int, tp: int, total: int) -> None:
    with pytest.raises(RegistrationError):
        rank_heads(rank, tp, total)


def test_prefill_targets_mirror_sglang() -> None:
    assert [list(prefill_targets(d, 2, 2)) for d in range(2)] == [[0], [1]]
    assert [list(prefill_targets(d, 4, 2)) for d in range(4)] == [[0], [0], [1], [1]]
    assert [list(prefill_targets(d, 2, 4)) for d in range(2)] == [[0, 1], [2, 3]]
    assert list(prefill_targets(0, 1, 8)) == list(range(8))


def test_tp_pair_not_dividing_refused() -> None:
    src = make(0, 3, total=6)
    dst = make(0, 2, total=6)
    with pytest.raises(RegistrationError, match="attention TP sizes 3 vs 2") as exc:
        check_pair(src, dst)
    assert "neither divides" in str(exc.value)
    with pytest.raises(RegistrationError, match="neither divides"):
        plan_transfer(src, dst, [0], [0])
    with pytest.raises(RegistrationError, match="neither divides"):
        prefill_targets(0, 2, 3)


# --------------------------------------------------------------------------- K11

# (prefill TP, decode TP, KV heads) -> per decode rank, per target prefill rank:
# (src_head_start, dst_head_start, n_heads), from SGLang's send_kvcache_slice offsets.
K11_TABLE: dict[tuple[int, int, int], list[list[tuple[int, int, int]]]] = {
    (1, 4, 2): [[(0, 0, 1)], [(0, 0, 1)], [(1, 0, 1)], [(1, 0, 1)]],
    (2, 4, 8): [[(0, 0, 2)], [(2, 0, 2)], [(0, 0, 2)], [(2, 0, 2)]],
    (4, 2, 8): [[(0, 0, 2), (0, 2, 2)], [(0, 0, 2), (0, 2, 2)]],
    (1, 8, 8): [[(d, 0, 1)] for d in range(8)],
    (2, 8, 4): [[(h, 0, 1)] for h in (0, 0, 1, 1, 0, 0, 1, 1)],
    (8, 1, 8): [[(0, p, 1) for p in range(8)]],
}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cfg", list(K11_TABLE))
def test_k11_gqa_replication_decode_tp_gt_kv_heads(cfg: tuple[int, int, int],
                                                   layout: str) -> None:
    ptp, dtp, total = cfg
    page, hd, ds = 16, 128, 2
    prefill = [make(p, ptp, total, layout=layout, base=0x10_0000_0000 * (p + 1))
               for p in range(ptp)]
    decode = [make(d, dtp, total, layout=layout, base=0x7000_0000_0000 + 0x10_0000_0000 * d)
              for d in range(dtp)]
    sp, dp = np.array([3, 7, 8]), np.array([1, 5, 2])
    for d, dst in enumerate(decode):
        targets = list(prefill_targets(d, dtp, ptp))
        assert [head_overlap(prefill[p], dst) for p in targets] == K11_TABLE[cfg][d]
        d0, dn = dst.heads
        covered: list[int] = []
        for p in targets:
            src = prefill[p]
            desc = plan_transfer(src, dst, sp, dp)
            s_off, d_off, n = head_overlap(src, dst)
            covered += range(src.heads[0] + s_off, src.heads[0] + s_off + n)
            assert dst.heads[0] + d_off == src.heads[0] + s_off  # the same absolute heads
            item = int(src.item_lens[0])
            per_page = 1 if layout == "HND" else page
            assert len(desc) == 2 * 2 * sp.size * per_page
            assert set(desc.length.tolist()) == {n * hd * ds * (page if layout == "HND" else 1)}
            rel = (desc.src - src.kv_ptrs[0]) % U(item * 64 + 4096) % U(item)
            assert int((rel + desc.length).max()) <= item  # every range inside a prefill item
            assert triples(desc) == naive(src, dst, sp.tolist(), dp.tolist())
        # the union of distinct heads written covers the decode rank's heads exactly
        assert sorted(covered) == list(range(d0, d0 + dn))
        bytes_per_page = 2 * 2 * page * dn * hd * ds
        moved = sum(plan_transfer(prefill[p], dst, sp, dp).nbytes for p in targets)
        assert moved == bytes_per_page * sp.size


# --------------------------------------------------------------------------- K12

def test_k12_item_len_mismatch_refused() -> None:
    src = make(0, 2, 8)                          # 4 heads: item = 16*4*128*2 = 16384
    dst = make(0, 2, 8, item=8192)               # half of prefill's
    with pytest.raises(RegistrationError, match="kv item len mismatch") as exc:
        check_pair(src, dst)
    assert "16384 vs 8192" in str(exc.value)
    with pytest.raises(RegistrationError, match="kv item len mismatch"):
        plan_transfer(src, dst, [0], [0])
    # positive control: a TP mismatch with the right item length is accepted
    ok = make(0, 4, 8)                           # 2 heads: 8192 bytes per page is right here
    assert int(ok.item_lens[0]) == 8192
    check_pair(src, ok)
    assert plan_transfer(src, ok, [0], [0]).nbytes == 2 * 2 * 8192


def test_item_len_inconsistent_with_heads_refused_on_either_side() -> None:
    with pytest.raises(RegistrationError, match="kv item len mismatch 1000 vs 8192"):
        check_pair(make(0, 2, 8, item=1000), make(0, 4, 8))
    with pytest.raises(RegistrationError, match="kv item len mismatch 16384 vs 16384"):
        check_pair(make(0, 2, 8), make(0, 4, 8, item=16384))


def test_mla_item_len_mismatch_refused() -> None:
    src = make(0, 2, is_mla=True, item=576 * 2 * 16)
    with pytest.raises(RegistrationError, match="kv item len mismatch 18432 vs 9216"):
        check_pair(src, make(0, 4, is_mla=True, item=576 * 16))
    check_pair(src, make(3, 4, is_mla=True, item=576 * 2 * 16))


def test_check_pair_lists_every_problem() -> None:
    src = make(0, 1, 8, page_size=16, head_dim=128, layout="NHD")
    dst = make(0, 1, 4, page_size=32, head_dim=64, layout="HND", num_layers=1)
    with pytest.raises(RegistrationError) as exc:
        check_pair(src, dst)
    msg = str(exc.value)
    for part in ("page_size 16 vs 32", "head_dim 128 vs 64", "layout NHD vs HND",
                 "total_kv_heads 8 vs 4", "prefill layers [0, 2) outside decode layers [0, 1)"):
        assert part in msg
    with pytest.raises(RegistrationError, match="is_mla False vs True"):
        check_pair(make(), make(is_mla=True))
    with pytest.raises(RegistrationError, match="dtype_size 2 vs 4"):
        check_pair(make(), make(dtype_size=4))


def test_num_kv_heads_must_match_tp_share() -> None:
    r = make(0, 2, 8)
    wrong = RankLayout(r.kv_ptrs, r.item_lens // U(2), r.page_size, 2, 8, r.head_dim,
                       r.dtype_size, r.num_layers, 0, False, "NHD", 0, 2)
    with pytest.raises(RegistrationError, match="decode num_kv_heads 2 vs 4"):
        check_pair(r, wrong)


@pytest.mark.parametrize("changes", [
    {"kv_ptrs": np.zeros(3, dtype=U)}, {"layout": "NDH"}, {"tp_rank": 2}, {"page_size": 0},
    {"layer_start": -1}, {"item_lens": np.zeros(4, dtype=U)}, {"kv_ptrs": [-1, 0, 0, 0]},
])
def test_rank_layout_structure_refused(changes: dict[str, Any]) -> None:
    base = make(0, 2, 8)
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    with pytest.raises(RegistrationError, match="invalid KV layout"):
        RankLayout(**{**fields, **changes})


# --------------------------------------------------------------------------- from_wire

def _wire(**changes: Any) -> KVArgsWire:
    w = KVArgsWire(session_id="s", kv_data_ptrs=[HIGH, HIGH + 2**20, HIGH + 2**21,
                                                 HIGH + 3 * 2**20],
                   kv_data_lens=[2**20] * 4, kv_item_lens=[8192] * 4, aux_data_ptrs=[],
                   aux_data_lens=[], aux_item_lens=[], page_size=16, num_kv_heads=2,
                   head_dim=128, dtype_size=2, num_layers=2, layer_start=3)
    return msgspec.structs.replace(w, **changes)


def test_from_wire_defaults_total_heads_to_local_times_tp() -> None:
    r = RankLayout.from_wire(_wire(), tp_rank=1, tp_size=4)
    assert (r.total_kv_heads, r.num_kv_heads, r.heads) == (8, 2, (2, 2))
    assert r.kv_ptrs.dtype == np.uint64 and int(r.kv_ptrs[0]) == HIGH
    assert (r.layer_start, r.layer_end, r.layout, r.is_mla) == (3, 5, "NHD", False)


def test_from_wire_reads_total_kv_heads_when_present() -> None:
    w = _wire(num_kv_heads=1, kv_item_lens=[4096] * 4)
    r = RankLayout.from_wire(msgspec.structs.replace(w, total_kv_heads=2), tp_rank=3, tp_size=4)
    assert (r.total_kv_heads, r.heads) == (2, (1, 1))
    zero = msgspec.structs.replace(w, total_kv_heads=0)
    assert RankLayout.from_wire(zero, 0, 4).total_kv_heads == 4
    # Older peers omit the field entirely: 0 is assumed.
    fields = {k: v for k, v in msgspec.structs.asdict(w).items() if k != "total_kv_heads"}
    old: Any = SimpleNamespace(**fields)
    assert RankLayout.from_wire(old, 0, 4).total_kv_heads == 4


def test_from_wire_mla_total_is_replicated() -> None:
    w = _wire(is_mla=True, num_kv_heads=1, num_layers=4, kv_item_lens=[9216] * 4)
    assert RankLayout.from_wire(w, 2, 4).total_kv_heads == 1


def test_from_wire_bad_buffer_count() -> None:
    with pytest.raises(RegistrationError, match="4 KV buffers for 3 layers"):
        RankLayout.from_wire(_wire(num_layers=3), 0, 1)


# --------------------------------------------------------------------------- descriptor shapes

def test_equal_tp_contiguous_pages_coalesce_to_one_descriptor_per_buffer() -> None:
    for layout in ("NHD", "HND"):
        src, dst = make(1, 2, layout=layout), make(1, 2, layout=layout, base=HIGH)
        desc = plan_transfer(src, dst, np.arange(10, 30), np.arange(0, 20))
        assert len(desc) == 4
        assert desc.length.tolist() == [20 * int(src.item_lens[0])] * 4
        assert desc.src.tolist() == [int(p) + 10 * int(src.item_lens[0]) for p in src.kv_ptrs]
        assert desc.dst.tolist() == dst.kv_ptrs.tolist()


def test_hnd_hetero_is_one_descriptor_per_page_per_buffer() -> None:
    src, dst = make(0, 1, 8, layout="HND", num_layers=3), make(1, 2, 8, layout="HND",
                                                               num_layers=3, base=HIGH)
    sp, dp = [1, 3, 5, 6, 7], [9, 0, 4, 5, 6]
    desc = plan_transfer(src, dst, sp, dp)
    assert len(desc) == 6 * 5
    assert set(desc.length.tolist()) == {16 * 4 * 128 * 2}
    assert triples(desc) == naive(src, dst, sp, dp)


def test_nhd_hetero_is_page_size_descriptors_per_page_per_buffer() -> None:
    src, dst = make(0, 1, 8, num_layers=3), make(1, 2, 8, num_layers=3, base=HIGH)
    desc = plan_transfer(src, dst, [1, 2, 3], [4, 5, 6])
    assert len(desc) == 6 * 3 * 16
    assert set(desc.length.tolist()) == {4 * 128 * 2}
    assert triples(desc) == naive(src, dst, [1, 2, 3], [4, 5, 6])
    # order: [buffer][page][token]; token rows of 8 heads on src, 4 on dst
    assert int(desc.src[1] - desc.src[0]) == 8 * 256 and int(desc.dst[1] - desc.dst[0]) == 4 * 256
    assert int(desc.src[0]) == int(src.kv_ptrs[0]) + 1 * int(src.item_lens[0]) + 4 * 256


def test_disjoint_heads_give_no_descriptors() -> None:
    src, dst = make(1, 2, 8), make(0, 4, 8)      # heads 4..7 vs 0..1
    assert head_overlap(src, dst) == (0, 0, 0)
    assert len(plan_transfer(src, dst, [1, 2], [3, 4])) == 0


def test_mla_hetero_tp_moves_whole_pages() -> None:
    src = make(0, 2, is_mla=True, item=576 * 2 * 16, num_layers=3)
    dst = make(3, 4, is_mla=True, item=576 * 2 * 16, num_layers=3, base=HIGH)
    desc = plan_transfer(src, dst, [4, 5, 9], [0, 1, 2])
    assert len(desc) == 3 * 2  # 3 buffers x 2 runs
    assert desc.nbytes == 3 * 3 * 576 * 2 * 16


def test_pp_stage_writes_its_layers_into_the_same_absolute_layers() -> None:
    dst = make(0, 1, 8, num_layers=6, layer_start=2, base=HIGH)    # layers 2..7
    src = make(0, 2, 8, num_layers=2, layer_start=4)               # layers 4, 5
    sp, dp = [0, 2], [7, 1]
    desc = plan_transfer(src, dst, sp, dp)
    assert triples(desc) == naive(src, dst, sp, dp)
    d_item = int(dst.item_lens[0])
    first_k, first_v = int(dst.kv_ptrs[4 - 2]), int(dst.kv_ptrs[6 + 4 - 2])
    per_buf = len(desc) // 4
    assert int(desc.dst[0]) == first_k + 7 * d_item
    assert int(desc.dst[2 * per_buf]) == first_v + 7 * d_item
    with pytest.raises(RegistrationError, match=r"prefill layers \[7, 9\) outside decode "):
        check_pair(make(0, 1, 8, num_layers=2, layer_start=7), dst)


def test_index_length_mismatch() -> None:
    with pytest.raises(IndexLengthMismatch, match="index length mismatch 3 vs 2"):
        plan_transfer(make(0, 1), make(0, 2), [1, 2, 3], [4, 5])
    assert len(plan_transfer(make(0, 1), make(0, 2), [], [])) == 0
    with pytest.raises(LayoutError, match="negative"):
        plan_transfer(make(0, 1), make(0, 2), [-1], [0])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("ptp", "dtp", "rank"), [(1, 2, 1), (4, 2, 3), (1, 1, 0)])
def test_uint64_pointers_with_bit_63_set(layout: str, ptp: int, dtp: int, rank: int) -> None:
    src = make(rank % ptp, ptp, 8, layout=layout, base=HIGH | 0x7FFF_0000_0000)
    dst = make(rank % dtp, dtp, 8, layout=layout, base=0xFFFF_F000_0000_0000)
    sp, dp = [5, 1, 63], [0, 62, 7]
    desc = plan_transfer(src, dst, sp, dp)
    got = triples(desc)
    assert got and got == naive(src, dst, sp, dp)
    assert all(s >= HIGH and d >= HIGH for s, d, _ in got)
    regions = Regions.of(dst.kv_ptrs, dst.item_lens * U(64))
    check_bounds(desc.dst, desc.length, regions, "destination")


def test_address_wrapping_past_2_64_refused() -> None:
    dst = make(1, 2, 8, base=2**64 - 2**30, pool_pages=1)
    with pytest.raises(LayoutError, match="past 2\\*\\*64"):
        plan_transfer(make(0, 1, 8), dst, [0], [2**40])


# --------------------------------------------------------------------------- property test

TP_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (8, 1)]


@dataclass
class Side:
    """Every rank's buffers of one side, carved out of one uint8 arena with gaps."""

    arena: np.ndarray
    layouts: dict[tuple[int, int], RankLayout] = field(default_factory=dict)
    views: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)
    regions: dict[tuple[int, int], Regions] = field(default_factory=dict)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    ptp, dtp = draw(st.sampled_from(TP_PAIRS))
    total = 2 if (ptp, dtp) == (1, 4) else draw(st.sampled_from([2, 4, 8]))
    pp = draw(st.sampled_from([1, 2]))
    layers = draw(st.integers(pp, 3))
    split = draw(st.integers(1, layers - 1)) if pp == 2 else layers
    src_n, dst_n = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    count = draw(st.integers(1, min(src_n, dst_n)))  # empty plans: unit tests
    dst_pages = draw(st.permutations(range(dst_n)))[:count]
    src_pages = draw(st.lists(st.integers(0, src_n - 1), min_size=len(dst_pages),
                              max_size=len(dst_pages), unique=len(dst_pages) <= src_n))
    if draw(st.booleans()):  # bias towards runs contiguous on both sides
        src_pages = sorted(src_pages)
        dst_pages = sorted(dst_pages)
    return {"ptp": ptp, "dtp": dtp, "total": total, "stages": [(0, split), (split, layers)]
            if pp == 2 else [(0, layers)], "layers": layers,
            "mla": draw(st.booleans()), "layout": draw(st.sampled_from(["NHD", "HND"])),
            "page_size": draw(st.sampled_from([1, 16, 64])),
            "head_dim": draw(st.sampled_from([1, 2, 4])),
            "dtype_size": draw(st.sampled_from([1, 2])),
            "src_n": src_n, "dst_n": dst_n, "src": src_pages, "dst": dst_pages,
            "gaps": draw(st.lists(st.integers(0, 40), min_size=64, max_size=64)),
            "seed": draw(st.integers(0, 2**32 - 1))}


def shard(glob: np.ndarray, layer: int, kind: int, pages: np.ndarray, h0: int, n: int,
          layout: str) -> np.ndarray:
    """Reference re-sharding: pages of one layer/kind, heads [h0, h0+n), as [P, item] bytes."""
    x = glob[layer, kind][pages][:, :, h0:h0 + n, :]        # [P, page_size, n, head bytes]
    if layout == "HND":
        x = x.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(x).reshape(len(pages), int(np.prod(x.shape[1:])))


def build_side(sc: dict[str, Any], ranks: list[tuple[int, int]], tp: int, pages: int,
               rng: np.random.Generator, glob: np.ndarray | None) -> Side:
    """Buffers for ``(tp_rank, stage)`` ranks; filled from ``glob`` (prefill) or random bytes."""
    kinds = 1 if sc["mla"] else 2
    head_bytes = glob_head_bytes(sc)
    plan: list[tuple[tuple[int, int], int, int, int, int]] = []  # (rank, layer, kind, off, item)
    off, g = 0, iter(sc["gaps"] * 8)
    for tp_rank, stage in ranks:
        lo, hi = sc["stages"][stage] if glob is not None else (0, sc["layers"])
        n = 1 if sc["mla"] else rank_heads(tp_rank, tp, sc["total"])[1]
        item = sc["page_size"] * n * head_bytes
        for kind in range(kinds):
            for layer in range(lo, hi):
                off += next(g)
                plan.append(((tp_rank, stage), layer, kind, off, item))
                off += item * pages
    side = Side(rng.integers(0, 256, size=off + 8, dtype=np.uint8))
    base = side.arena.ctypes.data
    for rank in ranks:
        mine = [p for p in plan if p[0] == rank]
        lo = min(p[1] for p in mine)
        n_layers = max(p[1] for p in mine) - lo + 1
        h0, n = (0, 1) if sc["mla"] else rank_heads(rank[0], tp, sc["total"])
        views = [side.arena[o:o + it * pages].reshape(pages, it) for _, _, _, o, it in mine]
        if glob is not None:
            for (_, layer, kind, _, _), v in zip(mine, views, strict=True):
                v[:] = shard(glob, layer, kind, np.arange(pages), h0, n, sc["layout"])
        ptrs = np.array([base + p[3] for p in mine], dtype=U)
        items = np.array([p[4] for p in mine], dtype=U)
        side.layouts[rank] = RankLayout(
            kv_ptrs=ptrs, item_lens=items, page_size=sc["page_size"], num_kv_heads=n,
            total_kv_heads=1 if sc["mla"] else sc["total"], head_dim=sc["head_dim"],
            dtype_size=sc["dtype_size"], num_layers=n_layers, layer_start=lo, is_mla=sc["mla"],
            layout=sc["layout"], tp_rank=rank[0], tp_size=tp)
        side.views[rank] = views
        side.regions[rank] = Regions.of(ptrs, items * U(pages))
    return side


def glob_head_bytes(sc: dict[str, Any]) -> int:
    return int(sc["head_dim"] * sc["dtype_size"])


def apply(desc: Descriptors, src: Side, dst: Side) -> None:
    """Copy every descriptor by address offset inside the two arenas (vectorised per length)."""
    so = (desc.src - U(src.arena.ctypes.data)).astype(np.int64)
    do = (desc.dst - U(dst.arena.ctypes.data)).astype(np.int64)
    for ln in np.unique(desc.length).tolist():
        m = desc.length == U(ln)
        r = np.arange(ln, dtype=np.int64)
        dst.arena[(do[m][:, None] + r).ravel()] = src.arena[(so[m][:, None] + r).ravel()]


def assert_disjoint(addrs: np.ndarray, lengths: np.ndarray) -> None:
    order = np.argsort(addrs)
    a, n = addrs[order], lengths[order]
    assert np.all(a[:-1] + n[:-1] <= a[1:]), "two descriptors write the same bytes"


@settings(max_examples=800, deadline=None)
@given(scenarios())
def test_plans_reshard_real_memory_like_the_reference(sc: dict[str, Any]) -> None:
    rng = np.random.default_rng(sc["seed"])
    heads = 1 if sc["mla"] else sc["total"]
    kinds = 1 if sc["mla"] else 2
    glob = rng.integers(0, 256, size=(sc["layers"], kinds, sc["src_n"], sc["page_size"], heads,
                                      glob_head_bytes(sc)), dtype=np.uint8)
    p_ranks = [(r, s) for r in range(sc["ptp"]) for s in range(len(sc["stages"]))]
    prefill = build_side(sc, p_ranks, sc["ptp"], sc["src_n"], rng, glob)
    decode = build_side(sc, [(d, 0) for d in range(sc["dtp"])], sc["dtp"], sc["dst_n"], rng, None)
    sp, dp = np.array(sc["src"], dtype=np.int64), np.array(sc["dst"], dtype=np.int64)

    expected = {}
    for d in range(sc["dtp"]):
        h0, n = (0, 1) if sc["mla"] else rank_heads(d, sc["dtp"], sc["total"])
        want = [v.copy() for v in decode.views[(d, 0)]]
        for i, v in enumerate(want):
            layer, kind = i % sc["layers"], i // sc["layers"]
            v[dp] = shard(glob, layer, kind, sp, h0, n, sc["layout"])
        expected[d] = want

    for d in range(sc["dtp"]):
        dst = decode.layouts[(d, 0)]
        targets = list(prefill_targets(d, sc["dtp"], sc["ptp"]))
        for p in targets[:1] if sc["mla"] else targets:  # MLA: the others are dummies
            for stage in range(len(sc["stages"])):
                src = prefill.layouts[(p, stage)]
                check_pair(src, dst)
                desc = plan_transfer(src, dst, sp, dp)
                check_bounds(desc.src, desc.length, prefill.regions[(p, stage)], "source")
                check_bounds(desc.dst, desc.length, decode.regions[(d, 0)], "destination")
                assert_disjoint(desc.dst, desc.length)
                apply(desc, prefill, decode)

    for d in range(sc["dtp"]):
        for got, want in zip(decode.views[(d, 0)], expected[d], strict=True):
            np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- check_bounds at scale

def bounds_reference(addrs: list[int], lengths: list[int], regions: Regions, what: str
                     ) -> str | None:
    """Entry-by-entry in Python ints: the message check_bounds must raise, or None."""
    if any(a + n >= 2**64 for a, n in zip(addrs, lengths, strict=True)):
        return f"{what} range wraps past 2**64"
    spans = list(zip(regions.start.tolist(), regions.end.tolist(), strict=True))
    for a, n in zip(addrs, lengths, strict=True):
        if not any(s <= a and a + n <= e for s, e in spans):
            return f"{what} range [{a:#x}, +{n}) is outside every registered buffer"
    return None


@st.composite
def bounds_cases(draw: st.DrawFn) -> tuple[list[int], list[int], Regions]:
    base = draw(st.sampled_from([0, 0x7F00_0000_0000, HIGH, 2**64 - 2**20]))
    sizes = draw(st.lists(st.integers(1, 4096), min_size=0, max_size=5))
    gaps = draw(st.lists(st.integers(0, 512), min_size=len(sizes), max_size=len(sizes)))
    starts, at = [], base
    for size, gap in zip(sizes, gaps, strict=True):
        at += gap
        starts.append(at)
        at += size
    fit = [i for i, (st_, sz) in enumerate(zip(starts, sizes, strict=True)) if st_ + sz < 2**64]
    regions = Regions.of(np.array([starts[i] for i in fit], dtype=U),
                         np.array([sizes[i] for i in fit], dtype=U))
    count = draw(st.integers(0, 300))
    bad_rate = draw(st.sampled_from([0.0, 0.003, 0.03]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    addrs, lengths = [], []
    for _ in range(count):
        roll = rng.random()
        if fit and roll >= bad_rate:  # inside a region, buffer-major-ish
            i = fit[min(len(fit) - 1, len(addrs) * len(fit) // max(count, 1))]
            off = int(rng.integers(0, sizes[i]))
            addrs.append(starts[i] + off)
            lengths.append(int(rng.integers(0, sizes[i] - off + 1)))
        elif fit and roll < bad_rate / 2:  # one byte past the end of a region
            i = fit[int(rng.integers(0, len(fit)))]
            off = int(rng.integers(0, sizes[i]))
            addrs.append(starts[i] + off)
            lengths.append(sizes[i] - off + 1)
        else:  # anywhere, possibly wrapping or straddling a gap
            addrs.append(min(2**64 - 1, base + int(rng.integers(0, 2**16))))
            lengths.append([1, 2**12, 2**63, 2**64 - 1][int(rng.integers(0, 4))])
    return addrs, lengths, regions


@settings(max_examples=400, deadline=None)
@given(bounds_cases(), st.sampled_from([(8, 2), (4,), (64, 16, 3), (2048, 256)]))
def test_check_bounds_matches_entry_by_entry(case: tuple[list[int], list[int], Regions],
                                             blocks: tuple[int, ...]) -> None:
    addrs, lengths, regions = case
    want = bounds_reference(addrs, lengths, regions, "dst")
    with mock.patch.object(plan, "_BOUNDS_BLOCKS", blocks):
        if want is None:
            check_bounds(np.array(addrs, dtype=U), np.array(lengths, dtype=U), regions, "dst")
        else:
            with pytest.raises(BoundsError) as exc:
                check_bounds(np.array(addrs, dtype=U), np.array(lengths, dtype=U), regions,
                             "dst")
            assert str(exc.value) == want


def test_check_bounds_block_whose_max_sum_wraps_is_checked_entry_by_entry() -> None:
    # no entry wraps, but max(addr) + max(len) of the block does (and wraps back inside
    # region 0): the block must not pass as a whole
    regions = Regions.of(np.array([0, 2**64 - 2**20], dtype=U),
                         np.array([2**63 + 2**62, 2**20 - 1], dtype=U))
    addrs = np.array([0x10, 2**64 - 2**19] * 4, dtype=U)
    lengths = np.array([2**63 + 2**62 + 100, 16] * 4, dtype=U)
    with mock.patch.object(plan, "_BOUNDS_BLOCKS", (8,)), pytest.raises(
            BoundsError, match="range \\[0x10, "):
        check_bounds(addrs, lengths, regions, "destination")


def test_check_bounds_finds_the_first_bad_entry_of_a_large_plan() -> None:
    src = make(0, 2, 8, num_layers=4)
    dst = make(1, 4, 8, num_layers=4, base=HIGH)
    desc = plan_transfer(src, dst, np.arange(0, 64, 2), np.arange(64)[::-2])
    regions = Regions.of(dst.kv_ptrs, dst.item_lens * U(64))
    check_bounds(desc.dst, desc.length, regions, "destination")
    bad = desc.dst.copy()
    bad[len(bad) // 2 + 5] += U(2**30)
    bad[len(bad) - 3] += U(2**31)
    with pytest.raises(BoundsError, match=f"{int(bad[len(bad) // 2 + 5]):#x}"):
        check_bounds(bad, desc.length, regions, "destination")
    with pytest.raises(BoundsError, match="wraps past 2"):
        check_bounds(bad, desc.length + U(2**63), regions, "destination")


# --------------------------------------------------------------------------- bounds spans

@settings(max_examples=120, deadline=None)
@given(pair=st.sampled_from([(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (8, 1)]),
       layout=st.sampled_from(["NHD", "HND"]), mla=st.booleans(),
       page_size=st.sampled_from([1, 16, 64]), data=st.data())
def test_every_descriptor_lies_inside_a_span(pair: tuple[int, int], layout: str, mla: bool,
                                             page_size: int, data: Any) -> None:
    """``check_plan_bounds`` checks spans instead of descriptors: each descriptor must lie
    inside one span on both sides, else the fast check would not be a real check."""
    p_tp, d_tp = pair
    total = 2 if (p_tp, d_tp) == (1, 4) else 8
    src = make(0, p_tp, total, page_size=page_size, head_dim=8, layout=layout, is_mla=mla)
    dst = make(d_tp - 1, d_tp, total, page_size=page_size, head_dim=8, layout=layout,
               is_mla=mla, base=0x8000_0000_0000_0000)
    n = data.draw(st.integers(1, 20))
    sp = np.array(data.draw(st.lists(st.integers(0, 63), min_size=n, max_size=n)))
    dp = np.array(data.draw(st.permutations(range(64)))[:n])
    desc = plan_transfer(src, dst, sp, dp)
    assert desc.spans is not None
    s_lo, s_hi, d_lo, d_hi = desc.spans
    for addr, lo, hi in ((desc.src, s_lo, s_hi), (desc.dst, d_lo, d_hi)):
        end = addr + desc.length
        inside = (addr[:, None] >= lo[None, :]) & (end[:, None] <= hi[None, :])
        assert inside.any(axis=1).all()
    regions_s = Regions.of(src.kv_ptrs, src.item_lens * np.uint64(64))
    regions_d = Regions.of(dst.kv_ptrs, dst.item_lens * np.uint64(64))
    plan.check_plan_bounds(desc, regions_s, regions_d, "room")  # spans inside the pools
    if len(desc) == 0:  # disjoint head sets: nothing to write, nothing to check
        return
    shrunk = Regions.of(dst.kv_ptrs, dst.item_lens * np.uint64(int(dp.max())))
    with pytest.raises(BoundsError):  # the highest destination page is no longer registered
        plan.check_plan_bounds(desc, regions_s, shrunk, "room")
