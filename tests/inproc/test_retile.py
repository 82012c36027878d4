"""In-process tier: prefill and decode with different page sizes (issue 22 item 3).

A prefill of 16 tokens per page writes a decode of 64 and the other way round, chunked,
with decode prefix hits (``first_page``, in decode pages). The oracle is a token-by-token
copy: every decode byte is compared with what copying each room token from its prefill
page slot to its decode page slot gives, and every byte the room does not name stays as
it was. A pair the planner cannot serve is refused at registration, kind ``registration``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from tests.inproc.harness import FAILED, SUCCESS, Cluster, Engine, settle

HEADS, HEAD_DIM, DTYPE = 2, 8, 2
TOKEN = HEADS * HEAD_DIM * DTYPE  # bytes of one token in one buffer (NHD)


def token_copy(de: Engine, pe: Engine, before: list[np.ndarray], src: list[int],
               dst: list[int], ps: int, pd: int, lo: int, hi: int) -> list[np.ndarray]:
    """The decode's buffers after copying room tokens ``[lo, hi)`` one by one."""
    want = [b.copy() for b in before]
    for w, s in zip(want, pe.pool.kv, strict=True):
        for t in range(lo, hi):
            a, b = (t % ps) * TOKEN, (t % pd) * TOKEN
            w[dst[t // pd], b:b + TOKEN] = s[src[t // ps], a:a + TOKEN]
    return want


async def _room(cluster: Cluster, ps: int, pd: int, src: list[int], dst: list[int],
                first: int, chunks: list[int]) -> tuple[Engine, Engine, list[np.ndarray]]:
    p, d = await cluster.node("prefill"), await cluster.node("decode")
    pe = await p.engine(seed=1, page_size=ps, item_len=ps * TOKEN, head_dim=HEAD_DIM,
                        num_pages=40)
    de = await d.engine(seed=2, page_size=pd, item_len=pd * TOKEN, head_dim=HEAD_DIM,
                        num_pages=40)
    before = [b.copy() for b in de.pool.kv]
    await de.call(rpc.ReceiverCreate(room=9, bootstrap_addr=p.http_addr))
    await de.call(rpc.ReceiverInit(room=9, dst_pages=pack_indices(dst[first:]), aux_index=3,
                                   first_page=first))
    await pe.call(rpc.SenderCreate(room=9))
    await pe.call(rpc.SenderInit(room=9, num_pages=len(src), aux_index=1))
    at = 0
    for i, n in enumerate(chunks):
        await pe.call(rpc.SenderSend(room=9, pages=pack_indices(src[at:at + n]),
                                     is_last=i == len(chunks) - 1))
        at += n
    await settle(cluster)
    return pe, de, before


# 150 tokens: 10 pages of 16, 3 of 64 (16 -> 64); 3 of 64, 10 of 16 (64 -> 16)
CASES = [
    (16, 64, 0, [10]), (16, 64, 1, [3, 4, 3]), (16, 64, 2, [5, 5]), (16, 64, 0, [1] * 10),
    (64, 16, 0, [3]), (64, 16, 3, [1, 1, 1]), (64, 16, 5, [2, 1]), (64, 16, 9, [1, 2]),
]


@pytest.mark.parametrize(("ps", "pd", "first", "chunks"), CASES)
async def test_i22_retiled_room_equals_a_token_by_token_copy(
        cluster: Cluster, ps: int, pd: int, first: int, chunks: list[int]) -> None:
    ns, nd = -(-150 // ps), -(-150 // pd)
    src = [int(x) for x in np.random.default_rng(ps).permutation(40)[:ns]]
    dst = [int(x) for x in np.random.default_rng(pd).permutation(40)[:nd]]
    pe, de, before = await _room(cluster, ps, pd, src, dst, first, chunks)
    assert await pe.status(9) == SUCCESS and await de.status(9) == SUCCESS
    # both sides' pages hold min(ns * ps, nd * pd) tokens; the decode holds first * pd
    want = token_copy(de, pe, before, src, dst, ps, pd, first * pd, min(ns * ps, nd * pd))
    for got, exp in zip(de.pool.kv, want, strict=True):
        assert np.array_equal(got, exp)
    assert (de.pool.aux[3] == pe.pool.aux[1]).all()
    if first:  # the pages the decode already held are untouched
        for got, old in zip(de.pool.kv, before, strict=True):
            assert np.array_equal(got[dst[:first]], old[dst[:first]])


async def test_i22_retiled_pages_that_hold_no_common_token_count_fail_the_room(
        cluster: Cluster) -> None:
    """64 -> 16: 2 prefill pages (65..128 tokens) and 4 decode pages (49..64 tokens)."""
    pe, de, before = await _room(cluster, 64, 16, [3, 4], [1, 2, 5, 6], 0, [2])
    assert await pe.status(9) == FAILED and await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "layout" and "index length mismatch" in reason
    assert all(np.array_equal(g, b) for g, b in zip(de.pool.kv, before, strict=True))


async def test_i22_page_sizes_the_planner_cannot_serve_are_refused_at_registration(
        cluster: Cluster) -> None:
    """A decode pool of 64-token pages padded by 32 bytes: bytes per token differ, so the
    pair is refused with one reason (kind registration) and nothing is written."""
    p, d = await cluster.node("prefill"), await cluster.node("decode")
    pe = await p.engine(seed=1, page_size=16, item_len=16 * TOKEN, head_dim=HEAD_DIM)
    de = await d.engine(seed=2, page_size=64, item_len=64 * TOKEN + 32, head_dim=HEAD_DIM)
    before = [b.copy() for b in de.pool.kv]
    await de.receiver(9, [0, 1], p.http_addr)
    await pe.sender(9, list(range(8)))
    await settle(cluster)
    assert await de.status(9) == FAILED
    kind, reason = await de.failure(9)
    assert kind == "registration" and "kv item len mismatch" in reason
    assert "page_size 16 vs 64 tokens" in reason
    assert all(np.array_equal(g, b) for g, b in zip(de.pool.kv, before, strict=True))
