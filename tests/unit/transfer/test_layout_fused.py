"""Fused-KV MHA layouts (vLLM's CPU cache: one buffer per layer, a page is
``[head][token][K dims, V dims]``): heterogeneous TP slices whole heads of ``2 * head_dim``."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import RegistrationError
from kvd.protocol.control import KVArgsWire
from kvd.transfer.kvargs import RankArgs
from kvd.transfer.layout import RankLayout, check_pair, plan_transfer

LAYERS, HEADS, TOKENS, DIM, DTYPE, PAGES = 2, 4, 4, 8, 2, 6
SRC_BASE, DST_BASE = 1 << 20, 1 << 24


def layout(base: int, tp_rank: int, tp_size: int, fused: bool = True) -> RankLayout:
    heads = HEADS // tp_size
    item = heads * TOKENS * (2 if fused else 1) * DIM * DTYPE
    bufs = LAYERS * (1 if fused else 2)
    return RankLayout(kv_ptrs=[base + i * PAGES * item for i in range(bufs)],
                      item_lens=[item] * bufs, page_size=TOKENS, num_kv_heads=heads,
                      total_kv_heads=HEADS, head_dim=DIM, dtype_size=DTYPE,
                      num_layers=LAYERS, layer_start=0, is_mla=False, layout="HND",
                      tp_rank=tp_rank, tp_size=tp_size, fused_kv=fused)


def run(desc, src: np.ndarray, dst: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    """Apply descriptors to two flat byte arrays standing for the two address ranges."""
    for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist(),
                       strict=True):
        dst[d - DST_BASE:d - DST_BASE + n] = src[s - SRC_BASE:s - SRC_BASE + n]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (1, 4), (2, 2)])
def test_fused_kv_moves_each_decode_rank_its_heads(p_tp: int, d_tp: int) -> None:
    rng = np.random.default_rng(0)
    # the model's KV: [layer][page][head][token][2 * dim] elements of DTYPE bytes
    model = rng.integers(0, 256, (LAYERS, PAGES, HEADS, TOKENS, 2 * DIM * DTYPE), np.uint8)
    src_pages, dst_pages = [1, 2, 4], [3, 0, 5]
    for d_rank in range(d_tp):
        dst = layout(DST_BASE, d_rank, d_tp)
        d0, dn = dst.heads
        out = np.zeros(LAYERS * PAGES * dn * TOKENS * 2 * DIM * DTYPE, np.uint8)
        for p_rank in range(p_tp):
            src = layout(SRC_BASE, p_rank, p_tp)
            s0, sn = src.heads
            if s0 + sn <= d0 or d0 + dn <= s0:
                continue  # this prefill rank holds none of the decode rank's heads
            mem = np.ascontiguousarray(model[:, :, s0:s0 + sn]).ravel()
            run(plan_transfer(src, dst, src_pages, dst_pages), mem, out)
        got = out.reshape(LAYERS, PAGES, dn, TOKENS, -1)
        want = model[:, :, d0:d0 + dn]
        assert np.array_equal(got[:, dst_pages], want[:, src_pages])
        untouched = [p for p in range(PAGES) if p not in dst_pages]
        assert not got[:, untouched].any()


def test_fused_and_split_kv_do_not_pair() -> None:
    with pytest.raises(RegistrationError, match="fused_kv True vs False"):
        check_pair(layout(SRC_BASE, 0, 1), layout(DST_BASE, 0, 1, fused=False))


def test_fused_kv_wire_needs_one_buffer_per_layer() -> None:
    item = HEADS * TOKENS * 2 * DIM * DTYPE
    wire = KVArgsWire(session_id="s", kv_data_ptrs=[SRC_BASE, SRC_BASE + PAGES * item],
                      kv_data_lens=[PAGES * item] * 2, kv_item_lens=[item] * 2,
                      aux_data_ptrs=[], aux_data_lens=[], aux_item_lens=[], page_size=TOKENS,
                      num_kv_heads=HEADS, head_dim=DIM, dtype_size=DTYPE, num_layers=2,
                      layout="HND", fused_kv=True)
    assert RankArgs.of(wire).num_pages == PAGES
    assert RankLayout.from_wire(wire, 0, 1).fused_kv
    with pytest.raises(RegistrationError, match="fused-KV MHA needs 4"):
        RankArgs.of(KVArgsWire(**{**{f: getattr(wire, f) for f in wire.__struct_fields__},
                                  "num_layers": 4}))
