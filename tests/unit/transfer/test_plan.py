"""kvd.transfer.plan: page runs, descriptors applied to real memory, uint64 math, bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import BoundsError, IndexLengthMismatch, LayoutError
from kvd.transfer.plan import (
    Descriptors,
    Regions,
    as_pages,
    check_bounds,
    check_page_range,
    page_runs,
    plan_aux,
    plan_pages,
)

U = np.uint64


def u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=U)


# --------------------------------------------------------------------------- page_runs

def test_page_runs_empty() -> None:
    s, d, n = page_runs([], [])
    assert s.size == d.size == n.size == 0
    assert n.dtype == np.int64


def test_page_runs_single() -> None:
    s, d, n = page_runs([7], [3])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([7], [3], [1])


def test_page_runs_fully_contiguous() -> None:
    s, d, n = page_runs(np.arange(10, 20), np.arange(100, 110))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([10], [100], [10])


def test_page_runs_non_contiguous() -> None:
    s, d, n = page_runs([1, 3, 5], [2, 4, 6])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([1, 3, 5], [2, 4, 6], [1, 1, 1])


def test_page_runs_mixed() -> None:
    s, d, n = page_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 8])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([4, 9, 2], [0, 3, 8], [3, 2, 1])


def test_page_runs_contiguous_on_src_only() -> None:
    s, d, n = page_runs([0, 1, 2, 3], [5, 9, 10, 0])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 1, 3], [5, 9, 0], [1, 2, 1])


def test_page_runs_contiguous_on_dst_only() -> None:
    s, d, n = page_runs([8, 2, 3], [0, 1, 2])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([8, 2], [0, 1], [1, 2])


def test_page_runs_descending_is_not_a_run() -> None:
    s, _, n = page_runs([3, 2, 1], [3, 2, 1])
    assert n.tolist() == [1, 1, 1]
    assert s.tolist() == [3, 2, 1]


def test_k10_page_runs_unequal_raises() -> None:
    with pytest.raises(IndexLengthMismatch, match="index length mismatch 3 vs 2"):
        page_runs([1, 2, 3], [4, 5])
    assert issubclass(IndexLengthMismatch, LayoutError)


@pytest.mark.parametrize("bad", [[-1, 2], [[1, 2]], [1.0, 2.0], np.array([True])])
def test_page_runs_bad_indices(bad: object) -> None:
    with pytest.raises(LayoutError):
        page_runs(bad, [0, 1][: len(np.asarray(bad).ravel())])


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60))
def test_page_runs_expand_back_and_are_maximal(pairs: list[tuple[int, int]]) -> None:
    src = [p[0] for p in pairs]
    dst = [p[1] for p in pairs]
    s, d, n = page_runs(src, dst)
    assert s.size == d.size == n.size
    assert np.all(n >= 1)
    expanded = [(int(a) + k, int(b) + k) for a, b, ln in zip(s, d, n, strict=True)
                for k in range(int(ln))]
    assert expanded == pairs
    for i in range(n.size - 1):  # maximal: the next run could not have been merged
        assert not (s[i + 1] == s[i] + n[i] and d[i + 1] == d[i] + n[i])


# --------------------------------------------------------------------------- as_pages etc.

def test_as_pages() -> None:
    out = as_pages(np.array([3, 1], dtype=np.uint16))
    assert out.dtype == np.int64 and out.tolist() == [3, 1]
    assert as_pages([]).dtype == np.int64
    with pytest.raises(LayoutError, match="negative"):
        as_pages([0, -2])
    with pytest.raises(LayoutError, match="1-D"):
        as_pages(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(LayoutError, match="integers"):
        as_pages([0.5])


def test_check_page_range() -> None:
    check_page_range(np.array([0, 9], dtype=np.int64), 10, "source")
    check_page_range(np.zeros(0, dtype=np.int64), 0, "source")
    with pytest.raises(BoundsError, match=r"source page index 10 .* 10 pages"):
        check_page_range(np.array([3, 10, 11], dtype=np.int64), 10, "source")


# --------------------------------------------------------------------------- plan_pages

@st.composite
def layouts(draw: st.DrawFn) -> dict:
    nbuf = draw(st.integers(1, 6))
    items = draw(st.lists(st.integers(1, 48), min_size=nbuf, max_size=nbuf))
    src_pages_n = draw(st.integers(1, 24))
    dst_pages_n = draw(st.integers(1, 24))
    count = draw(st.integers(0, dst_pages_n))
    dst = draw(st.permutations(range(dst_pages_n)))[:count]  # unique destination pages
    src = draw(st.lists(st.integers(0, src_pages_n - 1), min_size=count, max_size=count))
    if draw(st.booleans()) and count:  # bias towards long runs
        start_s = draw(st.integers(0, max(0, src_pages_n - count)))
        start_d = draw(st.integers(0, dst_pages_n - count))
        if start_s + count <= src_pages_n:
            src = list(range(start_s, start_s + count))
            dst = list(range(start_d, start_d + count))
    gaps = draw(st.lists(st.integers(0, 64), min_size=2 * nbuf, max_size=2 * nbuf))
    return {"items": items, "src_n": src_pages_n, "dst_n": dst_pages_n, "src": src, "dst": dst,
            "gaps": gaps}


def _arena(items: list[int], pages: int, gaps: list[int], rng: np.random.Generator
           ) -> tuple[np.ndarray, list[int]]:
    """One uint8 arena holding every buffer (with gaps between them); returns offsets."""
    offsets, off = [], 0
    for item, gap in zip(items, gaps, strict=True):
        off += gap
        offsets.append(off)
        off += item * pages
    arena = rng.integers(0, 256, size=off + 16, dtype=np.uint8)
    return arena, offsets


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(0, 2**32 - 1))
def test_plan_pages_matches_reference_on_real_memory(lay: dict, seed: int) -> None:
    rng = np.random.default_rng(seed)
    items, nbuf = lay["items"], len(lay["items"])
    src_arena, src_off = _arena(items, lay["src_n"], lay["gaps"][:nbuf], rng)
    dst_arena, dst_off = _arena(items, lay["dst_n"], lay["gaps"][nbuf:], rng)
    src_base, dst_base = src_arena.ctypes.data, dst_arena.ctypes.data
    src_ptrs = [src_base + o for o in src_off]
    dst_ptrs = [dst_base + o for o in dst_off]

    expected = dst_arena.copy()
    src_pages = np.array(lay["src"], dtype=np.int64)
    dst_pages = np.array(lay["dst"], dtype=np.int64)
    for b, item in enumerate(items):
        s_view = src_arena[src_off[b]:src_off[b] + item * lay["src_n"]].reshape(lay["src_n"], item)
        d_view = expected[dst_off[b]:dst_off[b] + item * lay["dst_n"]].reshape(lay["dst_n"], item)
        d_view[dst_pages] = s_view[src_pages]

    desc = plan_pages(src_ptrs, dst_ptrs, items, items, lay["src"], lay["dst"])
    runs = page_runs(lay["src"], lay["dst"])[2].size
    assert len(desc) == nbuf * runs
    for arr in (desc.src, desc.dst, desc.length):
        assert arr.dtype == np.uint64
    assert desc.nbytes == sum(items) * len(lay["src"])

    for s, d, ln in zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist(),
                        strict=True):
        so, do = s - src_base, d - dst_base
        assert so >= 0 and so + ln <= src_arena.size
        assert do >= 0 and do + ln <= dst_arena.size
        dst_arena[do:do + ln] = src_arena[so:so + ln]
    np.testing.assert_array_equal(dst_arena, expected)


def test_plan_pages_order_is_buffer_major() -> None:
    desc = plan_pages([1000, 2000], [5000, 6000], [10, 20], [10, 20], [0, 1, 5], [3, 4, 0])
    assert desc.src.tolist() == [1000, 1050, 2000, 2100]
    assert desc.dst.tolist() == [5030, 5000, 6060, 6000]
    assert desc.length.tolist() == [20, 10, 40, 20]


def test_k12_item_len_mismatch_refused() -> None:
    with pytest.raises(LayoutError, match="kv item len mismatch") as exc:
        plan_pages([0, 100], [0, 100], [16, 32], [16, 64], [0], [0])
    assert "32" in str(exc.value) and "64" in str(exc.value)


def test_plan_pages_buffer_count_mismatch() -> None:
    with pytest.raises(LayoutError, match="buffer count mismatch"):
        plan_pages([0, 100], [0], [16, 16], [16], [0], [0])
    with pytest.raises(LayoutError):
        plan_pages([0, 100], [0, 100], [16], [16], [0], [0])


def test_plan_pages_unequal_pages() -> None:
    with pytest.raises(IndexLengthMismatch, match="index length mismatch 3 vs 2"):
        plan_pages([0], [0], [8], [8], [0, 1, 2], [0, 1])


def test_plan_pages_empty() -> None:
    assert len(plan_pages([0], [0], [8], [8], [], [])) == 0
    assert len(plan_pages([], [], [], [], [1], [2])) == 0
    assert Descriptors.empty().nbytes == 0


def test_plan_pages_negative_pointer_refused() -> None:
    with pytest.raises(LayoutError):
        plan_pages([-4096], [0], [8], [8], [0], [0])
    with pytest.raises(LayoutError):
        plan_pages([0.5], [0], [8], [8], [0], [0])


def test_plan_pages_high_bit_pointers_are_exact_uint64() -> None:
    src_ptr, dst_ptr, item = 0xFFFF_0000_0000_0000, 0x8000_0000_0000_1000, 4096
    desc = plan_pages([src_ptr, src_ptr + 2**32], [dst_ptr, dst_ptr + 2**33], [item, 2 * item],
                      [item, 2 * item], [5, 6, 9], [1, 2, 7])
    for arr in (desc.src, desc.dst, desc.length):
        assert arr.dtype == np.uint64
    assert desc.src.tolist() == [src_ptr + 5 * item, src_ptr + 9 * item,
                                 src_ptr + 2**32 + 5 * 2 * item, src_ptr + 2**32 + 9 * 2 * item]
    assert desc.dst.tolist() == [dst_ptr + 1 * item, dst_ptr + 7 * item,
                                 dst_ptr + 2**33 + 2 * item, dst_ptr + 2**33 + 7 * 2 * item]
    assert desc.length.tolist() == [2 * item, item, 4 * item, 2 * item]
    assert all(type(v) is int for v in desc.src.tolist())


def test_plan_pages_high_bit_pointers_as_numpy_arrays() -> None:
    ptrs = u64(0xFFFF_FFFF_0000_0001)
    desc = plan_pages(ptrs, ptrs, u64(3), u64(3), np.array([2], np.int32), np.array([4], np.int8))
    assert desc.src.tolist() == [0xFFFF_FFFF_0000_0001 + 6]
    assert desc.dst.tolist() == [0xFFFF_FFFF_0000_0001 + 12]


# --------------------------------------------------------------------------- plan_aux

def test_plan_aux() -> None:
    hi = 0xF000_0000_0000_0000
    desc = plan_aux([hi, hi + 4096], [2000, 9000], [64, 8], 3, 5)
    assert desc.src.tolist() == [hi + 192, hi + 4096 + 24]
    assert desc.dst.tolist() == [2000 + 320, 9000 + 40]
    assert desc.length.tolist() == [64, 8]
    assert desc.src.dtype == desc.dst.dtype == desc.length.dtype == np.uint64


@pytest.mark.parametrize("ptrs", [[0xFFFF_0000_0000_0000, 0x1000], [0x1000, 2**63],
                                  [2**64 - 4096, 0]], ids=["high-low", "low-high", "top-zero"])
def test_pointer_lists_mixing_high_and_low_addresses(ptrs: list[int]) -> None:
    """Plain Python lists whose values straddle 2**63 are valid u64 pointers.

    (numpy infers float64 for such a list; the planner must still give exact uint64.)
    """
    n = len(ptrs)
    desc = plan_pages(ptrs, ptrs, [8] * n, [8] * n, [1], [2])
    assert desc.src.dtype == np.uint64
    assert desc.src.tolist() == [p + 8 for p in ptrs]
    assert desc.dst.tolist() == [p + 16 for p in ptrs]
    aux = plan_aux(ptrs, ptrs, [4] * n, 1, 0)
    assert aux.src.tolist() == [p + 4 for p in ptrs]
    regions = Regions.of(ptrs, [1024] * n)
    assert regions.start.tolist() == sorted(ptrs)


def test_region_ending_exactly_at_2_pow_64_is_refused() -> None:
    # Documented rule: region ends must be representable in u64 (no real mapping ends there).
    with pytest.raises(LayoutError, match="wraps"):
        Regions.of([2**64 - 4096], [4096])


def test_plan_aux_refusals() -> None:
    with pytest.raises(LayoutError, match="aux buffer count mismatch"):
        plan_aux([0, 1], [0], [8, 8], 0, 0)
    with pytest.raises(LayoutError, match="negative aux index"):
        plan_aux([0], [0], [8], -1, 0)
    with pytest.raises(LayoutError, match="negative aux index"):
        plan_aux([0], [0], [8], 0, -1)
    assert len(plan_aux([], [], [], 0, 0)) == 0


# --------------------------------------------------------------------------- Descriptors

def _desc(n: int) -> Descriptors:
    return Descriptors(np.arange(n, dtype=U), np.arange(n, dtype=U) + U(1000),
                       np.full(n, 7, dtype=U))


@given(st.integers(0, 300), st.integers(1, 100))
def test_batches_split_sizes_and_order(n: int, max_entries: int) -> None:
    desc = _desc(n)
    batches = desc.batches(max_entries)
    sizes = [len(b) for b in batches]
    full, rest = divmod(n, max_entries)
    assert sizes == [max_entries] * full + ([rest] if rest else [])
    joined = Descriptors.empty()
    for b in batches:
        joined = joined.concat(b)
    assert joined.src.tolist() == desc.src.tolist()
    assert joined.dst.tolist() == desc.dst.tolist()
    assert joined.length.tolist() == desc.length.tolist()


def test_batches_refuses_zero() -> None:
    with pytest.raises(ValueError):
        _desc(3).batches(0)


def test_concat_and_nbytes() -> None:
    a = Descriptors(u64(1), u64(2), u64(2**40))
    b = Descriptors(u64(3, 4), u64(5, 6), u64(10, 20))
    c = a.concat(b)
    assert c.src.tolist() == [1, 3, 4] and c.dst.tolist() == [2, 5, 6]
    assert c.nbytes == 2**40 + 30
    assert len(c) == 3


# --------------------------------------------------------------------------- Regions / bounds

def test_regions_sorted_never_merged() -> None:
    r = Regions.of([500, 0, 1000, 2000, 2010], [100, 100, 10, 10, 5])
    # [2000,2010) and [2010,2015) are adjacent: still two buffers, with their ids
    assert r.start.tolist() == [0, 500, 1000, 2000, 2010]
    assert r.end.tolist() == [100, 600, 1010, 2010, 2015]
    assert r.ids.tolist() == [1, 0, 2, 3, 4]


@pytest.mark.parametrize(("ptrs", "lens"), [([0, 50], [100, 100]), ([0, 10, 20], [1000, 5, 5])])
def test_s07_overlapping_buffers_refused(ptrs: list[int], lens: list[int]) -> None:
    with pytest.raises(LayoutError, match="overlap"):
        Regions.of(ptrs, lens)


def test_regions_wrap_refused() -> None:
    with pytest.raises(LayoutError, match="wraps"):
        Regions.of([2**64 - 10], [20])


def test_check_bounds_inside_and_edges() -> None:
    regions = Regions.of([0x1000, 0x8000], [0x100, 0x100])
    check_bounds(u64(0x1000, 0x10FF, 0x8000), u64(0x100, 1, 0x100), regions, "src")
    with pytest.raises(BoundsError, match="src range"):
        check_bounds(u64(0x1000), u64(0x101), regions, "src")  # one byte past the end
    with pytest.raises(BoundsError):
        check_bounds(u64(0x10FF), u64(2), regions, "src")
    with pytest.raises(BoundsError):
        check_bounds(u64(0xFFF), u64(1), regions, "src")  # below the first region
    with pytest.raises(BoundsError):
        check_bounds(u64(0x10F0), u64(0x7000), regions, "src")  # spans the gap


def test_s07_range_straddling_two_adjacent_buffers_refused() -> None:
    regions = Regions.of([0, 128], [128, 128])
    check_bounds(u64(10, 128), u64(118, 128), regions, "dst")
    with pytest.raises(BoundsError):
        check_bounds(u64(10), u64(180), regions, "dst")  # inside the union, not one buffer


def test_check_bounds_wrap_past_2_64() -> None:
    top = 2**64 - 8192
    regions = Regions.of([top], [4096])
    check_bounds(u64(top), u64(4096), regions, "dst")
    with pytest.raises(BoundsError, match="wraps"):
        check_bounds(u64(2**64 - 8), u64(16), regions, "dst")


def test_check_bounds_no_regions() -> None:
    empty = Regions.of([], [])
    with pytest.raises(BoundsError):
        check_bounds(u64(0), u64(1), empty, "dst")
    check_bounds(np.zeros(0, dtype=U), np.zeros(0, dtype=U), empty, "dst")


def test_check_bounds_names_first_offender() -> None:
    regions = Regions.of([0x1000], [0x100])
    with pytest.raises(BoundsError, match=r"\[0x2000, \+16\)"):
        check_bounds(u64(0x1000, 0x2000, 0x3000), u64(16, 16, 16), regions, "src")


def test_check_bounds_vectorised_100k() -> None:
    rng = np.random.default_rng(0)
    nreg = 64
    starts = (np.arange(nreg, dtype=U) * U(1 << 30)) + U(0x8000_0000_0000_0000)
    regions = Regions.of(starts, np.full(nreg, 1 << 20, dtype=U))
    which = rng.integers(0, nreg, size=100_000)
    offs = rng.integers(0, (1 << 20) - 4096, size=100_000).astype(U)
    addrs = starts[which] + offs
    lens = rng.integers(1, 4097, size=100_000).astype(U)
    check_bounds(addrs, lens, regions, "src")  # 100k ranges, all inside: no error
    addrs[77_777] = starts[5] + U((1 << 20) - 1)
    lens[77_777] = U(2)
    with pytest.raises(BoundsError):
        check_bounds(addrs, lens, regions, "src")
