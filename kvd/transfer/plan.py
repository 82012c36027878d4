"""KV layouts -> transfer descriptors ``(src_addr, dst_addr, length)``. PURE.

All address arithmetic is done in ``numpy.uint64`` (pointers may have bit 63
set; mixing int64 with uint64 in numpy silently yields float64, so every
operand is converted explicitly first). Overflow of ``addr + length`` past
2**64 is detected and refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from kvd.errors import BoundsError, IndexLengthMismatch, LayoutError

U64 = np.uint64
Pages = npt.NDArray[np.int64]
Addrs = npt.NDArray[np.uint64]
Ids = npt.NDArray[np.int64]


def aux_ids(n: int) -> Ids:
    """Buffer ids of ``n`` aux buffers: ``-1, -2, ...`` (KV buffers are ``0, 1, ...``), so
    one id space names every buffer of a rank (:meth:`Regions.of`, ``span_bufs``)."""
    return -1 - np.arange(n, dtype=np.int64)


@dataclass(frozen=True)
class Descriptors:
    """Parallel uint64 arrays, one entry per transfer-engine descriptor (bytes).

    ``spans``, when the planner provides it, is ``(src_lo, src_hi, dst_lo, dst_hi)``:
    uint64 ``[K]`` byte ranges such that every descriptor's source range lies in one
    ``[src_lo[k], src_hi[k])`` and its destination in ``[dst_lo[k], dst_hi[k])`` -- by
    construction (each descriptor is ``ptr + page * item + inner`` and the span is the
    extreme of each term). :func:`check_plan_bounds` checks the K spans instead of the
    N descriptors (K = buffers, N up to millions).

    ``span_bufs``, when present, is ``(src_ids, dst_ids)``: int64 ``[K]``, the buffer
    each span was planned FROM and TO (KV buffer ``b`` is id ``b``, aux buffer ``a`` is
    ``-1 - a``: :func:`aux_ids`). :func:`check_plan_bounds` then checks every span
    against that one buffer, never against the union of a rank's regions (case S07).
    """

    src: Addrs
    dst: Addrs
    length: Addrs
    spans: tuple[Addrs, Addrs, Addrs, Addrs] | None = None
    span_bufs: tuple[Ids, Ids] | None = None

    @staticmethod
    def empty() -> Descriptors:
        """No descriptors."""
        z = np.zeros(0, dtype=U64)
        i = np.zeros(0, dtype=np.int64)
        return Descriptors(z, z.copy(), z.copy(), (z, z, z, z), (i, i.copy()))

    def __len__(self) -> int:
        return int(self.src.size)

    @property
    def nbytes(self) -> int:
        """Total bytes described."""
        return int(self.length.sum(dtype=U64))

    def concat(self, other: Descriptors) -> Descriptors:
        """Self's entries followed by ``other``'s (spans and their buffer ids kept when
        both have them)."""
        spans = bufs = None
        if self.spans is not None and other.spans is not None:
            a, b = self.spans, other.spans
            spans = (np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]),
                     np.concatenate([a[2], b[2]]), np.concatenate([a[3], b[3]]))
            if self.span_bufs is not None and other.span_bufs is not None:
                x, y = self.span_bufs, other.span_bufs
                bufs = (np.concatenate([x[0], y[0]]), np.concatenate([x[1], y[1]]))
        return Descriptors(np.concatenate([self.src, other.src]),
                           np.concatenate([self.dst, other.dst]),
                           np.concatenate([self.length, other.length]), spans, bufs)

    def batches(self, max_entries: int) -> list[Descriptors]:
        """Split into consecutive sub-batches of at most ``max_entries`` entries."""
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        n = len(self)
        return [Descriptors(self.src[i:i + max_entries], self.dst[i:i + max_entries],
                            self.length[i:i + max_entries]) for i in range(0, n, max_entries)]


def as_pages(pages: npt.ArrayLike, what: str = "page indices") -> Pages:
    """Validate a 1-D integer page-index array and return it as int64.

    Raises :class:`LayoutError` for a non-integer dtype, wrong rank or negatives.
    """
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise LayoutError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":  # np.issubdtype(dtype, np.integer), without its cost
        raise LayoutError(f"{what} must be integers, got dtype {arr.dtype}")
    out = arr if arr.dtype == np.int64 else arr.astype(np.int64)
    low = int(out[0]) if out.size == 1 else int(out.min())
    if low < 0:
        raise LayoutError(f"{what} contain a negative index ({low})")
    return out


def check_page_range(pages: Pages, num_pages: int, what: str) -> None:
    """Raise :class:`BoundsError` if any index is outside ``[0, num_pages)``."""
    if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
        bad = pages[(pages < 0) | (pages >= num_pages)][0]
        raise BoundsError(f"{what} page index {int(bad)} outside the registered pool "
                          f"of {num_pages} pages")


def page_runs(src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike) -> tuple[Pages, Pages, Pages]:
    """Group page pairs into runs contiguous on both sides.

    Returns ``(src_start, dst_start, run_len)`` int64 arrays, one entry per run.
    Page ``i`` joins the run of page ``i-1`` when ``src[i] == src[i-1] + 1`` and
    ``dst[i] == dst[i-1] + 1``. Raises :class:`IndexLengthMismatch` if the two
    arrays differ in length (case K10: "index length mismatch N vs M").
    """
    src = as_pages(src_pages, "source page indices")
    dst = as_pages(dst_pages, "destination page indices")
    if src.size != dst.size:
        raise IndexLengthMismatch(f"index length mismatch {src.size} vs {dst.size}")
    if src.size <= 1:  # no run to join (a 1-page room)
        return src, dst, np.ones(src.size, dtype=np.int64)
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths.astype(np.int64)


def _u64(values: npt.ArrayLike) -> Addrs:
    if isinstance(values, np.ndarray) and values.dtype == U64:  # already checked (PairPlan)
        return values
    if isinstance(values, list | tuple):  # python ints may straddle 2**63: no float64 detour
        if not all(isinstance(v, int | np.integer) for v in values):
            raise LayoutError("addresses and lengths must be integers")
        if any(v < 0 for v in values):
            raise LayoutError("negative address or length")
        try:
            return np.array(values, dtype=U64)
        except (OverflowError, TypeError, ValueError) as exc:
            raise LayoutError(f"addresses must be integers below 2**64: {exc}") from exc
    arr = np.asarray(values)
    if arr.size and np.issubdtype(arr.dtype, np.signedinteger) and arr.min() < 0:
        raise LayoutError("negative address or length")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise LayoutError(f"addresses must be integers, got {arr.dtype}")
    return arr.astype(U64)


def plan_pages(src_ptrs: npt.ArrayLike, dst_ptrs: npt.ArrayLike, src_item_lens: npt.ArrayLike,
               dst_item_lens: npt.ArrayLike, src_pages: npt.ArrayLike,
               dst_pages: npt.ArrayLike, src_ids: npt.ArrayLike | None = None,
               dst_ids: npt.ArrayLike | None = None) -> Descriptors:
    """Descriptors that copy whole pages buffer by buffer (equal TP, any page size).

    ``src_ptrs[b]``/``dst_ptrs[b]`` are the base addresses of buffer ``b`` (B
    buffers: K and V of every layer for MHA, one per layer for MLA) and
    ``*_item_lens[b]`` its bytes per page; page ``p`` of buffer ``b`` lives at
    ``ptr[b] + p * item_len[b]``. Contiguous page runs become one descriptor
    per buffer. Output order: buffer-major, runs in page order. ``src_ids``/``dst_ids``
    (int ``[B]``, default ``0..B-1``) name the buffers for per-buffer bounds checks.

    Raises :class:`LayoutError` on mismatched buffer counts or item lengths
    (case K12: "kv item len mismatch"), :class:`IndexLengthMismatch` on
    unequal page counts.
    """
    sp, dp = _u64(src_ptrs), _u64(dst_ptrs)
    sl, dl = _u64(src_item_lens), _u64(dst_item_lens)
    if not (sp.size == dp.size == sl.size == dl.size):
        raise LayoutError(f"buffer count mismatch: {sp.size} source vs {dp.size} destination")
    if (sl != dl).any():
        b = int(np.flatnonzero(sl != dl)[0])
        raise LayoutError(f"kv item len mismatch in buffer {b}: {int(sl[b])} vs {int(dl[b])}")
    s0, d0, n = page_runs(src_pages, dst_pages)
    if n.size == 0 or sp.size == 0:
        return Descriptors.empty()
    s0u, d0u, nu = s0.astype(U64), d0.astype(U64), n.astype(U64)
    src = (sp[:, None] + s0u[None, :] * sl[:, None]).ravel()
    dst = (dp[:, None] + d0u[None, :] * sl[:, None]).ravel()
    length = (nu[None, :] * sl[:, None]).ravel()
    spans = (sp + U64(s0.min()) * sl, sp + U64((s0 + n).max()) * sl,
             dp + U64(d0.min()) * sl, dp + U64((d0 + n).max()) * sl)
    return Descriptors(src, dst, length, spans, _ids(src_ids, dst_ids, sp.size))


def _ids(src_ids: npt.ArrayLike | None, dst_ids: npt.ArrayLike | None, n: int,
         default: Ids | None = None) -> tuple[Ids, Ids]:
    base = np.arange(n, dtype=np.int64) if default is None else default
    s = base if src_ids is None else np.asarray(src_ids, dtype=np.int64)
    d = base if dst_ids is None else np.asarray(dst_ids, dtype=np.int64)
    if s.shape != (n,) or d.shape != (n,):
        raise LayoutError(f"buffer ids must be [{n}] arrays")
    return s, d


def plan_aux(src_ptrs: npt.ArrayLike, dst_ptrs: npt.ArrayLike, item_lens: npt.ArrayLike,
             src_index: int, dst_index: int) -> Descriptors:
    """One descriptor per aux buffer: slot ``src_index`` -> slot ``dst_index`` (bytes).

    Spans name aux buffer ``a`` on both sides (id ``-1 - a``, :func:`aux_ids`), so a slot
    index past the end of its buffer fails :func:`check_plan_bounds` even when the bytes
    would fall inside another registered buffer (case S07).
    """
    sp, dp, ln = _u64(src_ptrs), _u64(dst_ptrs), _u64(item_lens)
    if not (sp.size == dp.size == ln.size):
        raise LayoutError(f"aux buffer count mismatch: {sp.size} vs {dp.size}")
    if src_index < 0 or dst_index < 0:
        raise LayoutError("negative aux index")
    src, dst = sp + U64(src_index) * ln, dp + U64(dst_index) * ln
    ids = aux_ids(sp.size)
    return Descriptors(src, dst, ln.copy(), (src, src + ln, dst, dst + ln), (ids, ids.copy()))


@dataclass(frozen=True)
class Regions:
    """A rank's registered buffers as byte ranges ``[start, end)`` (uint64), sorted by
    start, never merged (adjacent buffers stay two regions: a range straddling them is
    outside both), with each one's buffer id (``ids``, int64; :func:`aux_ids`)."""

    start: Addrs
    end: Addrs
    ids: Ids

    @staticmethod
    def of(ptrs: npt.ArrayLike, lens: npt.ArrayLike, ids: npt.ArrayLike | None = None
           ) -> Regions:
        """Regions from base pointers and lengths in bytes (``ids`` default ``0..n-1``).

        Raises :class:`LayoutError` if a region wraps past 2**64 or two overlap (bounds
        are per buffer: overlapping buffers would let a write meant for one land in the
        other).
        """
        p, n = _u64(ptrs), _u64(lens)
        end = p + n
        if (end < p).any():
            raise LayoutError("registered region wraps past 2**64")
        idv = np.arange(p.size, dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
        order = np.argsort(p, kind="stable")
        p, end, idv = p[order], end[order], idv[order]
        if p.size > 1 and (p[1:] < end[:-1]).any():
            k = int(np.flatnonzero(p[1:] < end[:-1])[0])
            raise LayoutError(f"buffers {int(idv[k])} and {int(idv[k + 1])} overlap")
        return Regions(p, end, idv)

    @cached_property
    def _by_id(self) -> tuple[Ids, Ids]:
        """(order, ids in that order): the ids sorted once, for :meth:`of_ids`."""
        order = np.argsort(self.ids, kind="stable")
        return order, self.ids[order]

    def of_ids(self, ids: Ids, what: str) -> tuple[Addrs, Addrs]:
        """``(start, end)`` of the buffers named by ``ids``; BoundsError for an unknown id."""
        order, sorted_ids = self._by_id
        pos = np.searchsorted(sorted_ids, ids)
        safe = np.minimum(pos, max(sorted_ids.size - 1, 0))
        if sorted_ids.size == 0 or (sorted_ids[safe] != ids).any():
            raise BoundsError(f"{what}: planned for a buffer the rank did not register")
        idx = order[safe]
        return self.start[idx], self.end[idx]


_BOUNDS_BLOCKS = (2048, 256)  # block sizes of the fast path, coarse to fine


def check_plan_bounds(desc: Descriptors, src: Regions, dst: Regions, what: str) -> None:
    """Raise :class:`BoundsError` unless every descriptor's source range lies in ONE
    buffer of ``src`` and its destination range in ONE buffer of ``dst``: the buffers it
    was planned from and to when the plan says (``span_bufs``), never the union of a
    rank's regions (case S07).

    Uses the planner's spans when present (O(buffers): each span covers every
    descriptor it was built from, see :class:`Descriptors`), else checks every
    descriptor with :func:`check_bounds`.
    """
    if desc.spans is None:
        check_bounds(desc.src, desc.length, src, f"{what} source")
        check_bounds(desc.dst, desc.length, dst, f"{what} destination")
        return
    s_lo, s_hi, d_lo, d_hi = desc.spans
    if (s_hi < s_lo).any() or (d_hi < d_lo).any():
        raise BoundsError(f"{what} range wraps past 2**64")
    if desc.span_bufs is None:
        check_bounds(s_lo, s_hi - s_lo, src, f"{what} source")
        check_bounds(d_lo, d_hi - d_lo, dst, f"{what} destination")
        return
    for lo, hi, ids, regions, side in ((s_lo, s_hi, desc.span_bufs[0], src, "source"),
                                       (d_lo, d_hi, desc.span_bufs[1], dst, "destination")):
        start, end = regions.of_ids(ids, f"{what} {side}")
        bad = (lo < start) | (hi > end)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise BoundsError(f"{what} {side} range [{int(lo[k]):#x}, +{int(hi[k] - lo[k])}) "
                              f"is outside buffer {_name(int(ids[k]))} "
                              f"[{int(start[k]):#x}, +{int(end[k] - start[k])})")


def _name(buf_id: int) -> str:
    return f"aux {-1 - buf_id}" if buf_id < 0 else f"KV {buf_id}"


def check_bounds(addrs: Addrs, lengths: Addrs, regions: Regions, what: str) -> None:
    """Raise :class:`BoundsError` unless every ``[addr, addr+len)`` lies in one region.

    ``addrs``/``lengths``: uint64 ``[N]`` (bytes). Errors: a range wrapping
    past 2**64 is reported first, else the first range (in order) outside
    every region -- the same result as checking entry by entry.

    Vectorised, coarse to fine: entries are cut into blocks (``_BOUNDS_BLOCKS``);
    a block whose lowest address and ``max(addr) + max(len)`` fall in one
    region passes as a whole (row reductions, one ``searchsorted`` per block);
    plans are buffer-major, so nearly every block passes. Entries left over
    go to the next, finer block size, and finally one by one through a
    ``searchsorted`` over the region starts.
    """
    if addrs.size <= _BOUNDS_BLOCKS[-1]:  # small (the daemon's spans): one direct pass
        if (addrs + lengths < addrs).any():
            raise BoundsError(f"{what} range wraps past 2**64")
        _check_entries(addrs, lengths, regions, what)
        return
    wrap_what: str | None = what
    for size in _BOUNDS_BLOCKS:
        if addrs.size == 0:
            return
        addrs, lengths = _unresolved(addrs, lengths, regions, size, wrap_what)
        wrap_what = None  # every entry was checked for wrapping on the first pass
    _check_entries(addrs, lengths, regions, what)


def _unresolved(addrs: Addrs, lengths: Addrs, regions: Regions, size: int,
                wrap_what: str | None) -> tuple[Addrs, Addrs]:
    """Entries of the ``size``-blocks that do not pass as a whole, then the tail, in order.

    With ``wrap_what``, raises :class:`BoundsError` if any entry wraps past 2**64.
    """
    m = addrs.size // size
    a, n = addrs[:m * size].reshape(m, size), lengths[:m * size].reshape(m, size)
    tail_a, tail_n = addrs[m * size:], lengths[m * size:]
    high = a.max(axis=1)
    top = high + n.max(axis=1)
    may_wrap = top < high  # the uint64 sum wrapped: some entry of the block may wrap
    if wrap_what is not None and ((tail_a + tail_n < tail_a).any() or (
            may_wrap.any() and (a[may_wrap] + n[may_wrap] < a[may_wrap]).any())):
        raise BoundsError(f"{wrap_what} range wraps past 2**64")
    if regions.start.size == 0:
        return addrs, lengths
    k = np.searchsorted(regions.start, a.min(axis=1), side="right") - 1
    ok = (k >= 0) & ~may_wrap & (top <= regions.end[np.maximum(k, 0)])
    if np.all(ok):
        return tail_a, tail_n
    bad = np.flatnonzero(~ok)
    return (np.concatenate([a[bad].ravel(), tail_a]),
            np.concatenate([n[bad].ravel(), tail_n]))


def _check_entries(addrs: Addrs, lengths: Addrs, regions: Regions, what: str) -> None:
    """Entry-by-entry check (no range wraps): one ``searchsorted`` over region starts."""
    if addrs.size == 0:
        return
    end = addrs + lengths
    idx = np.searchsorted(regions.start, addrs, side="right") - 1
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    if regions.start.size == 0:
        ok[:] = False
    else:
        ok &= end <= regions.end[safe]
    if not np.all(ok):
        i = int(np.flatnonzero(~ok)[0])
        raise BoundsError(f"{what} range [{int(addrs[i]):#x}, +{int(lengths[i])}) is outside "
                          f"every registered buffer")


# ---- the plan validity proof ------------------------------------------------------------

_PROOF_BLOCK = 1 << 16  # descriptors compared per step of the in-order check (cache-sized)


class PlanRefused(LayoutError):
    """A plan that does not write every byte the decode reads for it exactly once and
    nothing else (:func:`prove_plan`). ``kind`` is ``"uncovered"``, ``"doubled"`` or
    ``"outside"``; ``lo``/``hi`` the first such destination byte range ``[lo, hi)``."""

    def __init__(self, message: str, kind: str = "", lo: int = 0, hi: int = 0) -> None:
        super().__init__(message)
        self.kind, self.lo, self.hi = kind, lo, hi


@dataclass(frozen=True)
class Tiling:
    """The destination byte ranges ONE source must write for one chunk, each exactly once.

    KV interval ``(b, r, t)``, in this (canonical) order, is ``[base[b] + starts[r] *
    item[b] + inner[t], + width)``, ``width = counts[r] * item[b]`` for whole-page runs
    (``slot`` None, ``inner == [0]``) or ``slot`` bytes for a head slice (``counts`` all 1).
    ``base``/``item`` (uint64 ``[B]``, bytes) are the decode's buffers and page sizes,
    ``ids`` (int64 ``[B]``) their buffer ids; ``starts``/``counts`` (int64 ``[R]``) pages;
    ``inner`` (uint64 ``[T]``) byte offsets in a page. ``aux``: ``(dst, length)`` (uint64
    ``[A]``) of the aux slot, after the KV intervals. ``names(buffer_id)`` labels a buffer
    in error messages (e.g. ``"layer 3 V"``).

    Made by :meth:`kvd.transfer.layout.PairPlan.tiling`, which proves it disjoint when it
    builds it (distinct pages, slices inside a page, distinct buffers).
    """

    base: Addrs
    item: Addrs
    ids: Ids
    starts: Pages
    counts: Pages
    inner: Addrs
    slot: int | None
    aux: tuple[Addrs, Addrs] | None = None
    names: Callable[[int], str] | None = None

    @property
    def kv_size(self) -> int:
        """Number of KV intervals (``B * R * T``)."""
        return int(self.base.size * self.starts.size * self.inner.size)

    @property
    def nbytes(self) -> int:
        """Bytes the source must write (what the decode reads from it for this chunk)."""
        if self.slot is None:
            kv = int(self.item.sum(dtype=U64)) * int(self.counts.sum())
        else:
            kv = self.kv_size * self.slot
        return kv + (int(self.aux[1].sum(dtype=U64)) if self.aux is not None else 0)

    def expected(self) -> tuple[Addrs, Addrs]:
        """Every interval materialised in canonical order: ``(dst, length)`` uint64."""
        dst, length = self._block(0, self.base.size)
        if self.aux is None:
            return dst, length
        return np.concatenate([dst, self.aux[0]]), np.concatenate([length, self.aux[1]])

    def _block(self, b0: int, b1: int) -> tuple[Addrs, Addrs]:
        """KV intervals of buffers ``[b0, b1)``, canonical order."""
        item = self.item[b0:b1, None]
        row = self.base[b0:b1, None] + self.starts.astype(U64)[None, :] * item
        dst = (row[:, :, None] + self.inner[None, None, :]).ravel()
        if self.slot is None:
            length = (self.counts.astype(U64)[None, :] * item).ravel()
        else:
            length = np.full(dst.size, self.slot, dtype=U64)
        return dst, length

    def matches(self, dst: Addrs, length: Addrs) -> bool:
        """Are ``dst``/``length`` exactly the intervals, in canonical order? One pass over
        the descriptors in cache-sized blocks of buffers (no full-size temporaries)."""
        n = self.kv_size
        aux_n = 0 if self.aux is None else self.aux[0].size
        if dst.size != n + aux_n or length.size != dst.size:
            return False
        if aux_n and not (np.array_equal(dst[n:], self.aux[0]) and  # type: ignore[index]
                          np.array_equal(length[n:], self.aux[1])):  # type: ignore[index]
            return False
        per_buf = n // max(self.base.size, 1)
        if per_buf == 1:  # one page, whole: the 1-page room's case, no reshaping
            s = U64(self.starts[0])
            return bool((dst[:n] == self.base + s * self.item).all() and
                        (length[:n] == self.item * U64(self.counts[0])).all())
        return n == 0 or self._kv_matches(dst[:n], length[:n], per_buf)

    def _kv_matches(self, dst: Addrs, length: Addrs, per_buf: int) -> bool:
        """The KV part of :meth:`matches`, block by block of buffers into scratch arrays
        reused across blocks (fresh temporaries would cost a page fault per 4 KiB)."""
        r, t = self.starts.size, self.inner.size
        step = max(1, _PROOF_BLOCK // per_buf)
        starts = self.starts.astype(U64)
        scratch = np.empty((min(step, self.base.size), r, t), dtype=U64)
        same = np.empty(scratch.shape, dtype=np.bool_)
        slot = None if self.slot is None else U64(self.slot)
        for b0 in range(0, self.base.size, step):
            b1 = min(self.base.size, b0 + step)
            nb = b1 - b0
            item = self.item[b0:b1, None]
            row = self.base[b0:b1, None] + starts[None, :] * item
            np.add(row[:, :, None], self.inner[None, None, :], out=scratch[:nb])
            blk = dst[b0 * per_buf:b1 * per_buf].reshape(nb, r, t)
            if not np.equal(blk, scratch[:nb], out=same[:nb]).all():
                return False
            lens = length[b0 * per_buf:b1 * per_buf].reshape(nb, r, t)
            if slot is None:  # whole-page runs: T == 1, one length per run
                ok = np.equal(lens[:, :, 0], self.counts.astype(U64)[None, :] * item,
                              out=same[:nb, :, 0]).all()
            else:
                ok = np.equal(lens, slot, out=same[:nb]).all()
            if not ok:
                return False
        return True

    def where(self, addr: int) -> str:
        """``addr`` as ``buffer (name), page, offset`` in the decode's terms."""
        if self.aux is not None:
            a = np.flatnonzero((self.aux[0] <= U64(addr)) &
                               (U64(addr) < self.aux[0] + self.aux[1]))
            if a.size:
                return f"aux {int(a[0])} slot, offset {addr - int(self.aux[0][a[0]])}"
        below = np.flatnonzero(self.base <= U64(addr))
        if below.size == 0:
            return f"{addr:#x}, below every buffer of the room"
        b = int(below[np.argmax(self.base[below])])
        rel, item = addr - int(self.base[b]), int(self.item[b])
        bid = int(self.ids[b])
        name = self.names(bid) if self.names is not None else f"buffer {bid}"
        return f"{name}, page {rel // item}, offset {rel % item}"


def runs(dst: Addrs, length: Addrs) -> tuple[Addrs, Addrs]:
    """``(start, length)`` uint64 of the maximal runs of ``(dst, length)`` taken in order:
    consecutive intervals that abut in memory (the next starts where this one ends) are
    joined; empty intervals (they write nothing) are dropped. The runs are a function of
    the sequence of bytes the intervals name, in order, not of how it is cut."""
    keep = length > 0
    if not keep.all():
        dst, length = dst[keep], length[keep]
    if dst.size == 0:
        return dst, length
    end = dst + length
    heads = np.flatnonzero(np.concatenate(([True], dst[1:] != end[:-1])))
    last = np.concatenate((heads[1:] - 1, [dst.size - 1]))
    return dst[heads], end[last] - dst[heads]


def same_runs(dst: Addrs, length: Addrs, e_dst: Addrs, e_len: Addrs) -> bool:
    """Do ``(dst, length)`` name exactly the bytes of ``(e_dst, e_len)``, in the same
    order (uint64 bytes)? Equal :func:`runs` on both sides: with disjoint expected
    intervals, every expected byte is written exactly once and nothing else -- the
    in-order fast path of :func:`interval_diff` (``O(N)``, no sort); ``False`` says only
    that the order differs or the plan is wrong (ask :func:`interval_diff`)."""
    a, b = runs(dst, length), runs(e_dst, e_len)
    return a[0].size == b[0].size and bool((a[0] == b[0]).all() and (a[1] == b[1]).all())


def interval_diff(dst: Addrs, length: Addrs, e_dst: Addrs, e_len: Addrs
                  ) -> tuple[str, int, int] | None:
    """Where descriptors ``(dst, length)`` fail to cover the disjoint expected intervals
    ``(e_dst, e_len)`` exactly once (all uint64 bytes, any order): ``None`` when they do,
    else ``(kind, lo, hi)`` of the lowest bad byte range -- ``"uncovered"`` (expected,
    written by nobody), ``"doubled"`` (written twice or more), ``"outside"`` (written but
    not expected).

    Sort-and-sweep over the interval ends (``O((N + M) log(N + M))``, no Python loop per
    descriptor): coverage counts are cumulative sums of +1/-1 at each boundary.
    """
    keep = length > 0
    a_lo, a_hi = dst[keep], dst[keep] + length[keep]
    e_keep = e_len > 0
    b_lo, b_hi = e_dst[e_keep], e_dst[e_keep] + e_len[e_keep]
    points = np.unique(np.concatenate([a_lo, a_hi, b_lo, b_hi]))
    if points.size < 2:
        return None
    n = points.size - 1
    a_cov = _coverage(points, a_lo, a_hi, n)
    e_cov = _coverage(points, b_lo, b_hi, n)
    kinds = np.where(a_cov > e_cov,
                     np.where(e_cov > 0, 2, 3), np.where(a_cov < e_cov, 1, 0))
    bad = np.flatnonzero(kinds)
    if bad.size == 0:
        return None
    i = int(bad[0])
    k = int(kinds[i])
    run = kinds[i:] != k  # extend over the following segments of the same kind
    j = i + (int(np.argmax(run)) if run.any() else n - i) - 1
    name = {1: "uncovered", 2: "doubled", 3: "outside"}[k]
    return name, int(points[i]), int(points[j + 1])


def _coverage(points: Addrs, lo: Addrs, hi: Addrs, n: int) -> npt.NDArray[np.int64]:
    """How many intervals ``[lo, hi)`` cover each segment ``[points[i], points[i+1])``."""
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, np.searchsorted(points, lo), 1)
    np.add.at(delta, np.searchsorted(points, hi), -1)
    return np.cumsum(delta)[:n]


def prove_plan(desc: Descriptors, tiling: Tiling, what: str) -> None:
    """Prove that ``desc`` writes every byte of ``tiling`` exactly once and nothing else.

    Fast path: the descriptors are the tiling's intervals in canonical order (one pass,
    :meth:`Tiling.matches`); ``tiling`` itself is disjoint by construction. Otherwise the
    general sweep (:func:`interval_diff`) decides: a plan in another order is accepted;
    anything else raises :class:`PlanRefused` (a :class:`LayoutError`) naming the first
    uncovered, doubled or outside byte range as buffer (layer), page and offset.
    """
    if tiling.matches(desc.dst, desc.length):
        return
    e_dst, e_len = tiling.expected()
    diff = interval_diff(desc.dst, desc.length, e_dst, e_len)
    if diff is None:
        return
    kind, lo, hi = diff
    verb = {"uncovered": "is written by no descriptor", "doubled": "is written twice",
            "outside": "is written but the decode does not read it from this source"}[kind]
    raise PlanRefused(f"{what}: plan refused: destination bytes [{lo:#x}, +{hi - lo}) "
                      f"({tiling.where(lo)}) {verb} (plan covers {desc.nbytes} bytes, the "
                      f"decode reads {tiling.nbytes} from this source)", kind, lo, hi)


def check_distinct(pages: Pages, what: str) -> None:
    """Raise :class:`PlanRefused` (``doubled``) when a page index appears twice in ``pages``
    (int64 ``[P]``): two writes would land in it and one page's KV would be lost (K42)."""
    if pages.size < 2:
        return
    order = np.argsort(pages, kind="stable")
    s = pages[order]
    dup = np.flatnonzero(s[1:] == s[:-1])
    if dup.size:
        k = int(dup[0])
        first, second = sorted((int(order[k]), int(order[k + 1])))
        raise PlanRefused(f"{what} page {int(s[k])} is named twice (positions {first} and "
                          f"{second}): a room's pages must be distinct", "doubled")
