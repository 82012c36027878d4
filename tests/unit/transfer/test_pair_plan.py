"""PairPlan (perf, issue 14: a layout pair's planning constants computed once) plans
exactly what rooms' ``plan_transfer`` planned: MHA and MLA, NHD and HND, heterogeneous
TP (GQA replication too), PP stages, vLLM's fused-KV layout, and the chunks a room's
``first_page`` and partial sends cut out of its pages, with one PairPlan reused."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import IndexLengthMismatch, LayoutError, RegistrationError
from kvd.transfer import layout as L
from kvd.transfer.layout import PairPlan, RankLayout, plan_transfer, rank_heads
from kvd.transfer.plan import U64, Descriptors, as_pages, plan_pages

HIGH = 0x8000_0000_0000_0000


def reference(src: RankLayout, dst: RankLayout, src_pages: npt.ArrayLike,
              dst_pages: npt.ArrayLike) -> Descriptors:
    """rooms' ``plan_transfer`` as it was before PairPlan (f9a07b0), verbatim."""
    L.check_pair(src, dst)
    sp = as_pages(src_pages, "source page indices")
    dp = as_pages(dst_pages, "destination page indices")
    if sp.size != dp.size:
        raise IndexLengthMismatch(f"index length mismatch {sp.size} vs {dp.size}")
    s_off, d_off, n_heads = L.head_overlap(src, dst)
    if sp.size == 0 or n_heads == 0:
        return Descriptors.empty()
    layers = np.arange(src.layer_start, src.layer_end, dtype=np.int64)
    sb, db = src.buffer_index(layers), dst.buffer_index(layers)
    s_ptr, d_ptr = src.kv_ptrs[sb], dst.kv_ptrs[db]
    s_item, d_item = src.item_lens[sb], dst.item_lens[db]
    L._check_no_wrap(s_ptr, s_item, sp, "source")
    L._check_no_wrap(d_ptr, d_item, dp, "destination")
    if src.is_mla or n_heads == src.num_kv_heads == dst.num_kv_heads:
        return plan_pages(s_ptr, d_ptr, s_item, d_item, sp, dp, sb, db)
    head_bytes = src.head_bytes
    if src.layout == "HND":
        run = src.page_size * head_bytes
        s_in, d_in = np.array([s_off * run], dtype=U64), np.array([d_off * run], dtype=U64)
        return L._strided((s_ptr, s_item, sp, s_in), (d_ptr, d_item, dp, d_in), n_heads * run,
                          (sb, db))
    tokens = np.arange(src.page_size, dtype=U64)
    s_in = tokens * U64(src.num_kv_heads * head_bytes) + U64(s_off * head_bytes)
    d_in = tokens * U64(dst.num_kv_heads * head_bytes) + U64(d_off * head_bytes)
    return L._strided((s_ptr, s_item, sp, s_in), (d_ptr, d_item, dp, d_in),
                      n_heads * head_bytes, (sb, db))


def same(a: Descriptors, b: Descriptors) -> None:
    for x, y in ((a.src, b.src), (a.dst, b.dst), (a.length, b.length)):
        assert x.dtype == y.dtype == np.uint64
        assert np.array_equal(x, y)
    assert (a.spans is None) == (b.spans is None)
    if a.spans is not None and b.spans is not None:
        for x, y in zip(a.spans, b.spans, strict=True):
            assert np.array_equal(np.asarray(x), np.asarray(y))
    assert (a.span_bufs is None) == (b.span_bufs is None)
    if a.span_bufs is not None and b.span_bufs is not None:
        for x, y in zip(a.span_bufs, b.span_bufs, strict=True):
            assert np.array_equal(x, y)


def side(tp_rank: int, tp_size: int, total: int, *, page_size: int, head_dim: int,
         num_layers: int, layer_start: int, is_mla: bool, fused: bool, layout: str,
         base: int, pool_pages: int = 64) -> RankLayout:
    heads = 1 if is_mla else rank_heads(tp_rank, tp_size, total)[1]
    item = page_size * heads * head_dim * 2 * (2 if fused and not is_mla else 1)
    nbuf = num_layers * (1 if is_mla or fused else 2)
    ptrs = [base + b * (item * pool_pages + 4096) for b in range(nbuf)]
    return RankLayout(kv_ptrs=np.array(ptrs, dtype=np.uint64),
                      item_lens=np.full(nbuf, item, dtype=np.uint64), page_size=page_size,
                      num_kv_heads=heads, total_kv_heads=1 if is_mla else total,
                      head_dim=head_dim, dtype_size=2, num_layers=num_layers,
                      layer_start=layer_start, is_mla=is_mla, layout=layout,
                      tp_rank=tp_rank, tp_size=tp_size, fused_kv=fused and not is_mla)


@st.composite
def pairs(draw: st.DrawFn) -> tuple[RankLayout, RankLayout]:
    p_tp, d_tp = draw(st.sampled_from([(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4),
                                       (1, 4), (4, 1), (8, 2), (2, 8)]))
    total = draw(st.sampled_from([t for t in (1, 2, 4, 8) if all(
        (t % tp == 0) if tp <= t else (tp % t == 0) for tp in (p_tp, d_tp))]))
    is_mla = draw(st.booleans())
    common: dict[str, Any] = {
        "page_size": draw(st.sampled_from([1, 2, 16])),
        "head_dim": draw(st.sampled_from([2, 8])),
        "is_mla": is_mla,
        "fused": draw(st.booleans()),
        "layout": draw(st.sampled_from(["NHD", "HND"])),
    }
    d_layers = draw(st.integers(1, 4))
    s_start = draw(st.integers(0, d_layers - 1))  # a PP stage inside the decode's layers
    s_layers = draw(st.integers(1, d_layers - s_start))
    d_base = draw(st.sampled_from([0x7F00_0000_0000, HIGH + 0x1000]))
    src = side(draw(st.integers(0, p_tp - 1)), p_tp, total, num_layers=s_layers,
               layer_start=s_start, base=0x10_0000_0000, **common)
    dst = side(draw(st.integers(0, d_tp - 1)), d_tp, total, num_layers=d_layers,
               layer_start=0, base=d_base, **common)
    return src, dst


@settings(max_examples=300, deadline=None)
@given(pair=pairs(), data=st.data())
def test_pair_plan_equals_rooms_plan_transfer_chunk_by_chunk(
        pair: tuple[RankLayout, RankLayout], data: Any) -> None:
    src, dst = pair
    n = data.draw(st.integers(0, 12))
    sp = np.array(data.draw(st.lists(st.integers(0, 63), min_size=n, max_size=n)),
                  dtype=np.int64)
    dp = np.array(data.draw(st.permutations(range(64)))[:n], dtype=np.int64)
    plan = PairPlan.of(src, dst)  # one per pair, reused for every chunk of every room
    # a room's first_page skips a prefix; a partial send plans [from, to) of the rest
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=1, max_size=4)))
    for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
        want = reference(src, dst, sp[lo:hi], dp[lo:hi])
        same(plan.plan(sp[lo:hi], dp[lo:hi]), want)
        same(plan_transfer(src, dst, sp[lo:hi], dp[lo:hi]), want)
        same(plan.plan(sp[lo:hi].tolist(), dp[lo:hi].tolist()), want)  # lists as arrays


def test_fused_kv_hetero_tp_is_planned_as_before() -> None:
    """The vLLM case explicitly: fused K|V, HND, prefill TP 1 -> decode TP 2 and back."""
    for p_tp, d_tp in ((1, 2), (2, 1), (2, 2)):
        for d_rank in range(d_tp):
            kw: dict[str, Any] = {"page_size": 16, "head_dim": 8, "is_mla": False,
                                  "fused": True, "layout": "HND"}
            src = side(0, p_tp, 4, num_layers=2, layer_start=0, base=0x1000_0000, **kw)
            dst = side(d_rank, d_tp, 4, num_layers=2, layer_start=0, base=HIGH, **kw)
            sp, dp = np.array([3, 4, 9]), np.array([7, 8, 1])
            same(PairPlan.of(src, dst).plan(sp, dp), reference(src, dst, sp, dp))


def test_pair_plan_refuses_what_plan_transfer_refused() -> None:
    kw: dict[str, Any] = {"page_size": 16, "head_dim": 8, "is_mla": False, "layout": "NHD",
                          "num_layers": 2, "layer_start": 0}
    fused = side(0, 1, 4, fused=True, base=0x1000_0000, **kw)
    split = side(0, 1, 4, fused=False, base=HIGH, **kw)
    with pytest.raises(RegistrationError) as want:
        reference(fused, split, [1], [1])
    with pytest.raises(RegistrationError) as got:
        PairPlan.of(fused, split)
    assert str(got.value) == str(want.value)
    ok = side(0, 1, 4, fused=False, base=0x1000_0000, **kw)
    plan = PairPlan.of(ok, split)
    with pytest.raises(IndexLengthMismatch, match="index length mismatch 2 vs 1"):
        plan.plan([1, 2], [1])
    with pytest.raises(LayoutError):
        plan.plan([-1], [1])
    top = side(0, 1, 4, fused=False, base=2**64 - 4096 * 64, **kw)
    with pytest.raises(LayoutError, match="past 2\\*\\*64"):
        PairPlan.of(ok, top).plan([0], [60])
    with pytest.raises(LayoutError, match="past 2\\*\\*64"):
        reference(ok, top, [0], [60])
