"""Re-tiling: KV moved between ranks whose page sizes differ (issue 22 item 3). PURE.

A room's token position ``t`` lives in prefill page ``src_pages[t // Ps]`` slot
``t % Ps`` and in decode page ``dst_pages[t // Pd]`` slot ``t % Pd`` (``Ps``/``Pd``
tokens per page on each side). The planner cuts a chunk's token range at every page
boundary of either side (each piece lies in one page on both sides), then emits one
descriptor per piece and buffer (and head, for HND), all with numpy broadcasting:

* token-major pieces (NHD with equal head sets, MLA): a token's bytes are contiguous,
  so pieces whose source and destination both continue in memory (consecutive slots,
  or slot ``P - 1`` of page ``p`` then slot 0 of page ``p + 1``) are joined; ``N = B *
  runs``;
* HND (``[page][head][token][dim]``): one descriptor per piece and head held by both
  ranks (a head's token run is contiguous in a page); ``N = B * pieces * heads``;
* NHD with a head slice (TP resharding): one descriptor per token slot; ``N = B * T``.

Address of entry ``[b, s, h]`` on each side: ``ptr[b] + page[s] * item[b] + slot[s] *
stride[b] + inner[h]``, its length ``count[s] * per_token[b]`` bytes (uint64).

:func:`retile_expected` gives, independently of the source's pages, the decode byte
ranges a chunk must write (cut only at decode page boundaries); the proof compares the
plan to them with the general sweep (:func:`~kvd.transfer.plan.interval_diff`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.errors import LayoutError
from kvd.transfer.plan import U64, Addrs, Descriptors, Ids, Pages


@dataclass(frozen=True)
class Side:
    """One side's geometry for re-tiling, per planned buffer ``[B]`` (uint64 bytes):
    ``ptr`` base addresses, ``item`` bytes per page, ``stride`` bytes between token slots,
    ``inner`` (``[H]``) byte offsets of the heads moved inside a slot run; ``page_size``
    tokens per page; ``ids`` (int64 ``[B]``) buffer ids for bounds checks."""

    ptr: Addrs
    item: Addrs
    stride: Addrs
    inner: Addrs
    page_size: int
    ids: Ids


@dataclass(frozen=True)
class Chunk:
    """A chunk of a room in token terms. ``src_pages[i]`` (int64) is the SENDER's room page
    ``src_first + i`` (``src_first``: sender pages, the chunk's ``first_page``);
    ``dst_pages[j]`` is the decode's room page ``dst_first + j`` (decode pages); the chunk
    moves room tokens ``[lo, hi)`` (token positions, not pages)."""

    src_pages: Pages
    dst_pages: Pages
    lo: int
    hi: int
    src_first: int = 0
    dst_first: int = 0

    def check(self, ps: int, pd: int) -> None:
        """Raise :class:`LayoutError` unless tokens ``[lo, hi)`` lie in the named pages of
        both sides (``ps``/``pd`` tokens per page)."""
        if self.lo < 0 or self.hi < self.lo or self.src_first < 0 or self.dst_first < 0:
            raise LayoutError(f"bad token range [{self.lo}, {self.hi}) or first page "
                              f"({self.src_first}, {self.dst_first})")
        for name, pages, first, size in (("source", self.src_pages, self.src_first, ps),
                                         ("destination", self.dst_pages, self.dst_first, pd)):
            if self.hi > self.lo and not (first * size <= self.lo and
                                          self.hi <= (first + pages.size) * size):
                raise LayoutError(
                    f"tokens [{self.lo}, {self.hi}) are outside the {pages.size} {name} "
                    f"pages from page {first} (page size {size}: tokens "
                    f"[{first * size}, {(first + pages.size) * size}))")


def _pieces(lo: int, hi: int, cuts_at: tuple[int, ...]) -> tuple[Pages, Pages]:
    """``(start, count)`` int64: ``[lo, hi)`` cut at every multiple of each ``cuts_at``."""
    cuts = [np.array([lo], dtype=np.int64)]
    for p in cuts_at:
        first = (lo // p + 1) * p
        cuts.append(np.arange(first, hi, p, dtype=np.int64))
    start = np.unique(np.concatenate(cuts))
    count = np.diff(np.concatenate([start, np.array([hi], dtype=np.int64)]))
    return start, count


def _emit(side: Side, pages: Pages, first: int, start: Pages) -> tuple[Addrs, Pages]:
    """``([B, S, H] addresses, [S] linear slot positions)`` of pieces starting at ``start``."""
    idx = start // side.page_size - first
    page = pages[idx]
    slot = start % side.page_size
    lin = page * side.page_size + slot
    base = side.ptr[:, None] + page.astype(U64)[None, :] * side.item[:, None] \
        + slot.astype(U64)[None, :] * side.stride[:, None]
    return base[:, :, None] + side.inner[None, None, :], lin


def retile_plan(src: Side, dst: Side, per_token: Addrs, chunk: Chunk,
                token_major: bool, per_slot: bool) -> Descriptors:
    """Descriptors moving tokens ``[chunk.lo, chunk.hi)`` from ``src`` to ``dst`` pages.

    ``per_token`` (uint64 ``[B]``): bytes each entry moves per token (a token's whole
    slot when ``token_major``, a head's run for HND, the head slice for NHD).
    ``token_major``: pieces contiguous on both sides are joined; ``per_slot``: one entry
    per token (NHD head slices). Order ``[B][S][H]``. Raises :class:`LayoutError` when the
    tokens are outside the named pages (:meth:`Chunk.check`).
    """
    chunk.check(src.page_size, dst.page_size)
    if chunk.hi == chunk.lo or src.ptr.size == 0 or src.inner.size == 0:
        return Descriptors.empty()
    if per_slot:
        start = np.arange(chunk.lo, chunk.hi, dtype=np.int64)
        count = np.ones(start.size, dtype=np.int64)
    else:
        start, count = _pieces(chunk.lo, chunk.hi, (src.page_size, dst.page_size))
    s_addr, s_lin = _emit(src, chunk.src_pages, chunk.src_first, start)
    d_addr, d_lin = _emit(dst, chunk.dst_pages, chunk.dst_first, start)
    if token_major and start.size > 1:
        joins = (s_lin[1:] == s_lin[:-1] + count[:-1]) & (d_lin[1:] == d_lin[:-1] + count[:-1])
        heads = np.flatnonzero(np.concatenate(([True], ~joins)))
        count = np.add.reduceat(count, heads)
        s_addr, d_addr = s_addr[:, heads], d_addr[:, heads]
    length = np.broadcast_to((count.astype(U64)[None, :] * per_token[:, None])[:, :, None],
                             s_addr.shape)
    s_end, d_end = s_addr + length, d_addr + length
    spans = (s_addr.reshape(s_addr.shape[0], -1).min(axis=1),
             s_end.reshape(s_end.shape[0], -1).max(axis=1),
             d_addr.reshape(d_addr.shape[0], -1).min(axis=1),
             d_end.reshape(d_end.shape[0], -1).max(axis=1))
    return Descriptors(s_addr.ravel(), d_addr.ravel(), np.ascontiguousarray(length).ravel(),
                       spans, (src.ids.astype(np.int64), dst.ids.astype(np.int64)))


def retile_expected(dst: Side, per_token: Addrs, chunk: Chunk, per_slot: bool
                    ) -> tuple[Addrs, Addrs]:
    """``(dst, length)`` uint64: the decode byte ranges tokens ``[chunk.lo, chunk.hi)`` must
    fill, from the decode's pages alone (cut at decode page boundaries, or per token slot
    with ``per_slot``), each exactly once; disjoint when the decode pages are distinct."""
    if chunk.hi == chunk.lo or dst.ptr.size == 0 or dst.inner.size == 0:
        z = np.zeros(0, dtype=U64)
        return z, z.copy()
    if per_slot:
        start = np.arange(chunk.lo, chunk.hi, dtype=np.int64)
        count = np.ones(start.size, dtype=np.int64)
    else:
        start, count = _pieces(chunk.lo, chunk.hi, (dst.page_size,))
    addr, _ = _emit(dst, chunk.dst_pages, chunk.dst_first, start)
    length = np.broadcast_to((count.astype(U64)[None, :] * per_token[:, None])[:, :, None],
                             addr.shape)
    return addr.ravel(), np.ascontiguousarray(length).ravel()
