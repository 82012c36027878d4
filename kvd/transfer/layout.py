"""Heterogeneous parallel KV layouts -> transfer descriptors. PURE.

A prefill rank (``src``) writes the KV pages of one request into a decode rank
(``dst``) whose attention-TP size, and pipeline stage, may differ. Each side is
a :class:`RankLayout`; :func:`check_pair` says once per registration whether a
pair can be planned, and :func:`plan_transfer` turns page index arrays into
``(src, dst, length)`` descriptors (bytes, ``numpy.uint64``) with numpy
broadcasting only: no Python loop over layers, pages or token slots.

What is moved is what ``src`` holds AND ``dst`` needs:

* layers: ``src``'s layers ``[layer_start, layer_start + num_layers)`` go to
  ``dst``'s buffers of the same absolute layers (SGLang's
  ``get_mha_kv_ptrs_with_pp`` / ``get_mla_kv_ptrs_with_pp``);
* heads (MHA): the intersection of the two ranks' KV head sets
  (:func:`rank_heads`); MLA latent KV is replicated and never sliced.

Buffer layouts (per layer; MHA: K then V buffers, MLA: one buffer), design.md:
``NHD`` = ``[page][token][head][dim]`` (SGLang's), a head slice is one run per
token slot; ``HND`` = ``[page][head][token][dim]``, a head slice of a page is
one contiguous run. ``fused_kv`` (MHA): one buffer per layer whose ``dim`` is a
token's K then V (``2 * head_dim`` elements; vLLM's CPU cache is HND like this), so
it is planned as K-only MHA with heads twice as wide.

Address arithmetic is ``numpy.uint64`` throughout (pointers may have bit 63
set; every int64 operand is converted explicitly, so nothing becomes float64),
and a plan whose highest address would wrap past 2**64 is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import numpy.typing as npt

from kvd.errors import IndexLengthMismatch, LayoutError, RegistrationError
from kvd.protocol.control import KVArgsWire
from kvd.transfer.plan import (
    U64,
    Addrs,
    Descriptors,
    Pages,
    PlanRefused,
    Tiling,
    _u64,
    as_pages,
    check_distinct,
    interval_diff,
    page_runs,
    plan_pages,
    prove_plan,
    same_runs,
)
from kvd.transfer.retile import Chunk, Side, retile_expected, retile_plan

LAYOUTS = ("NHD", "HND")
#: Layer ranges a :class:`PairPlan` keeps its restriction of (:meth:`PairPlan.layers`).
_MAX_RANGES = 256
_U64_MAX = 2**64 - 1


def rank_heads(tp_rank: int, tp_size: int, total_kv_heads: int) -> tuple[int, int]:
    """``(first_head, n_heads)`` of the KV heads an attention-TP rank holds.

    ``tp_size <= total_kv_heads``: a contiguous block of ``total / tp_size``
    heads (``total`` must be a multiple of ``tp_size``). ``tp_size > total``
    (GQA replication, ``tp_size`` a multiple of ``total``): one head, index
    ``tp_rank * total // tp_size`` -- SGLang's ``MHATokenToKVPool`` sharding
    (``num_kv_head_replicas = tp_size // total``), so ranks ``0..r-1`` hold
    head 0, ``r..2r-1`` head 1 and so on (case K11).

    Raises :class:`RegistrationError` for a rank outside ``[0, tp_size)``,
    non-positive sizes, or heads that do not split evenly over ``tp_size``.
    """
    if tp_size < 1 or total_kv_heads < 1 or not 0 <= tp_rank < tp_size:
        raise RegistrationError(f"invalid attention TP rank {tp_rank} of {tp_size} "
                                f"for {total_kv_heads} KV heads")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise RegistrationError(f"{total_kv_heads} KV heads do not split over "
                                    f"attention TP {tp_size}")
        n = total_kv_heads // tp_size
        return tp_rank * n, n
    if tp_size % total_kv_heads:
        raise RegistrationError(f"attention TP {tp_size} is not a multiple of "
                                f"{total_kv_heads} KV heads (GQA replication)")
    return tp_rank * total_kv_heads // tp_size, 1


def prefill_targets(decode_tp_rank: int, decode_tp_size: int, prefill_tp_size: int) -> range:
    """Prefill attention-TP ranks that write into decode rank ``decode_tp_rank``.

    Mirrors SGLang's decode-side target rule (``get_target_prefill_ranks``):
    equal TP -> the same rank; decode TP > prefill TP -> the one prefill rank
    ``decode_rank // (decode_tp // prefill_tp)`` (it holds the decode rank's
    heads); decode TP < prefill TP -> ranks ``[d*ratio, (d+1)*ratio)``, each
    writing its head slice (MLA: only the first is real, the rest are dummies --
    the daemon's business). Raises :class:`RegistrationError` when neither TP
    size divides the other.
    """
    _check_tp_sizes(prefill_tp_size, decode_tp_size)
    if not 0 <= decode_tp_rank < decode_tp_size:
        raise RegistrationError(f"decode TP rank {decode_tp_rank} outside TP {decode_tp_size}")
    if decode_tp_size >= prefill_tp_size:
        r = decode_tp_rank // (decode_tp_size // prefill_tp_size)
        return range(r, r + 1)
    ratio = prefill_tp_size // decode_tp_size
    return range(decode_tp_rank * ratio, (decode_tp_rank + 1) * ratio)


def _check_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    if prefill_tp < 1 or decode_tp < 1 or max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise RegistrationError(f"attention TP sizes {prefill_tp} (prefill) vs {decode_tp} "
                                f"(decode): neither divides the other")


@dataclass(frozen=True)
class RankLayout:
    """One rank's KV pool geometry, as far as planning needs it.

    ``kv_ptrs`` (uint64, shape ``[B]``) are buffer base addresses: MHA ``B =
    2 * num_layers`` (K of each local layer, then V of each local layer), MLA
    ``B = num_layers``; ``item_lens`` (uint64, ``[B]``) bytes of one page of
    each buffer. Page ``p`` of buffer ``b`` starts at ``kv_ptrs[b] + p *
    item_lens[b]``. ``page_size`` is tokens per page, ``head_dim`` elements,
    ``dtype_size`` bytes per element. ``num_kv_heads`` heads are held by this
    rank (1 when replicated), ``total_kv_heads`` by the model. Local layer
    ``i`` is absolute layer ``layer_start + i``. ``layout`` is ``"NHD"`` or
    ``"HND"``; ``tp_rank``/``tp_size`` the attention-TP rank and size.

    Array fields accept any integer array-like and are stored as uint64.
    Raises :class:`RegistrationError` on a structurally invalid layout (buffer
    count, sizes, rank, layout name); pairing checks live in :func:`check_pair`.
    """

    kv_ptrs: Addrs
    item_lens: Addrs
    page_size: int
    num_kv_heads: int
    total_kv_heads: int
    head_dim: int
    dtype_size: int
    num_layers: int
    layer_start: int
    is_mla: bool
    layout: str
    tp_rank: int
    tp_size: int
    fused_kv: bool = False

    def __post_init__(self) -> None:
        try:
            ptrs, lens = _u64(self.kv_ptrs), _u64(self.item_lens)
        except LayoutError as exc:
            raise RegistrationError(f"invalid KV layout: {exc}") from exc
        object.__setattr__(self, "kv_ptrs", ptrs)
        object.__setattr__(self, "item_lens", lens)
        problems = _structure_problems(self)
        if problems:
            raise RegistrationError("invalid KV layout: " + "; ".join(problems))

    @staticmethod
    def from_wire(wire: KVArgsWire, tp_rank: int, tp_size: int) -> RankLayout:
        """Layout of the rank that sent ``wire`` at attention TP ``tp_rank``/``tp_size``.

        ``total_kv_heads`` comes from the wire when present and non-zero, else
        ``num_kv_heads * tp_size`` (wrong for GQA-replicated ranks, which must
        send it); MLA latent KV is replicated, so there it is ``num_kv_heads``.
        Raises :class:`RegistrationError` like the constructor.
        """
        total = int(getattr(wire, "total_kv_heads", 0) or 0)
        if not total:
            total = wire.num_kv_heads if wire.is_mla else wire.num_kv_heads * tp_size
        return RankLayout(kv_ptrs=np.asarray(wire.kv_data_ptrs, dtype=np.uint64),
                          item_lens=np.asarray(wire.kv_item_lens, dtype=np.uint64),
                          page_size=wire.page_size, num_kv_heads=wire.num_kv_heads,
                          total_kv_heads=total, head_dim=wire.head_dim,
                          dtype_size=wire.dtype_size, num_layers=wire.num_layers,
                          layer_start=wire.layer_start, is_mla=wire.is_mla,
                          layout=wire.layout, tp_rank=tp_rank, tp_size=tp_size,
                          fused_kv=wire.fused_kv)

    @property
    def bufs_per_layer(self) -> int:
        """KV buffers per layer: 2 (MHA: K, V), 1 (MLA, or MHA with fused K and V)."""
        return 1 if self.is_mla or self.fused_kv else 2

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token slot in one buffer (K and V with fused_kv)."""
        return self.head_dim * self.dtype_size * (2 if self.fused_kv else 1)

    @property
    def layer_end(self) -> int:
        """One past the last absolute layer held."""
        return self.layer_start + self.num_layers

    @property
    def heads(self) -> tuple[int, int]:
        """``(first_head, n_heads)`` held (:func:`rank_heads`); MLA: ``(0, 1)``."""
        if self.is_mla:
            return 0, 1
        return rank_heads(self.tp_rank, self.tp_size, self.total_kv_heads)

    def buffer_name(self, buf: int) -> str:
        """Buffer ``buf`` (a local index) as ``"layer L K"``/``"layer L V"`` (``"layer L"``
        for MLA or fused K and V), ``L`` absolute."""
        layer = self.layer_start + buf % self.num_layers
        if self.bufs_per_layer == 1:
            return f"layer {layer}"
        return f"layer {layer} {'KV'[buf // self.num_layers]}"

    def buffer_index(self, layers: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Buffer indices of absolute ``layers`` (int64 ``[L]``): MHA ``[2L]`` K then V."""
        local = np.asarray(layers, dtype=np.int64) - self.layer_start
        if self.bufs_per_layer == 1:
            return local
        return np.concatenate([local, local + self.num_layers])


def _structure_problems(r: RankLayout) -> list[str]:
    problems = []
    nbuf = r.num_layers * r.bufs_per_layer
    if r.kv_ptrs.ndim != 1 or r.item_lens.shape != r.kv_ptrs.shape:
        problems.append(f"kv_ptrs {r.kv_ptrs.shape} and item_lens {r.item_lens.shape} "
                        f"must be 1-D of equal length")
    elif r.kv_ptrs.size != nbuf:
        problems.append(f"{r.kv_ptrs.size} KV buffers for {r.num_layers} layers "
                        f"({'MLA' if r.is_mla else 'MHA'} needs {nbuf})")
    if r.item_lens.size and int(r.item_lens.min()) == 0:
        problems.append("item lengths must be positive")
    sizes = {"page_size": r.page_size, "num_kv_heads": r.num_kv_heads,
             "total_kv_heads": r.total_kv_heads, "head_dim": r.head_dim,
             "dtype_size": r.dtype_size, "num_layers": r.num_layers}
    problems += [f"{k} must be >= 1, got {v}" for k, v in sizes.items() if v < 1]
    if r.layer_start < 0:
        problems.append(f"layer_start must be >= 0, got {r.layer_start}")
    if r.layout not in LAYOUTS:
        problems.append(f"unknown layout {r.layout!r}")
    if not 0 <= r.tp_rank < r.tp_size:
        problems.append(f"attention TP rank {r.tp_rank} outside TP size {r.tp_size}")
    return problems


def check_pair(src: RankLayout, dst: RankLayout, retile: bool = False) -> None:
    """Refuse a (prefill ``src``, decode ``dst``) pair that cannot be planned.

    Checks, all reported at once: one attention-TP size divides the other
    (SGLang's precondition for ``send_kvcache_slice``); equal ``page_size``,
    ``head_dim``, ``dtype_size``, ``is_mla``, ``layout`` and (MHA)
    ``total_kv_heads``; each rank's ``num_kv_heads`` equals what
    :func:`rank_heads` gives it; ``src``'s layer range lies inside ``dst``'s
    (a prefill PP stage writes into a decode rank holding those layers); and
    the item length of every buffer that will be written (case K12): MHA
    ``page_size * heads * head_dim * dtype_size`` on each side, MLA equal on
    both sides.

    ``retile``: the page sizes may differ (the pair is then planned in tokens,
    :meth:`PairPlan.plan_tokens`); item lengths are checked with each side's own page
    size (MLA: equal bytes per token).

    Raises :class:`RegistrationError` naming both values, e.g.
    ``"kv item len mismatch 8192 vs 4096 in layer 0 ..."``.
    """
    problems = _pair_problems(src, dst, retile)
    if problems:
        raise RegistrationError("incompatible KV layouts (prefill vs decode): "
                                + "; ".join(problems))


def _pair_problems(src: RankLayout, dst: RankLayout, retile: bool = False) -> list[str]:
    problems = []
    if max(src.tp_size, dst.tp_size) % min(src.tp_size, dst.tp_size):
        problems.append(f"attention TP sizes {src.tp_size} vs {dst.tp_size}: "
                        f"neither divides the other")
    names = ["head_dim", "dtype_size", "is_mla", "layout", "fused_kv"]
    if not retile:
        names.insert(0, "page_size")
    if not (src.is_mla or dst.is_mla):
        names.append("total_kv_heads")
    problems += [f"{n} {getattr(src, n)} vs {getattr(dst, n)}" for n in names
                 if getattr(src, n) != getattr(dst, n)]
    if not (dst.layer_start <= src.layer_start and src.layer_end <= dst.layer_end):
        problems.append(f"prefill layers [{src.layer_start}, {src.layer_end}) outside decode "
                        f"layers [{dst.layer_start}, {dst.layer_end})")
    if not problems and not src.is_mla:
        problems += [p for r, side in ((src, "prefill"), (dst, "decode"))
                     for p in _heads_problems(r, side)]
    if not problems:
        problems += _item_len_problems(src, dst)
    return problems


def _heads_problems(r: RankLayout, side: str) -> list[str]:
    try:
        n = rank_heads(r.tp_rank, r.tp_size, r.total_kv_heads)[1]
    except RegistrationError as exc:
        return [f"{side}: {exc}"]
    if n != r.num_kv_heads:
        return [f"{side} num_kv_heads {r.num_kv_heads} vs {n} for TP rank {r.tp_rank} of "
                f"{r.tp_size} with {r.total_kv_heads} KV heads"]
    return []


def _item_len_problems(src: RankLayout, dst: RankLayout) -> list[str]:
    layers = np.arange(src.layer_start, src.layer_end, dtype=np.int64)
    s_items = src.item_lens[src.buffer_index(layers)]
    d_items = dst.item_lens[dst.buffer_index(layers)]
    if src.is_mla and src.page_size == dst.page_size:
        s_exp, d_exp = s_items, s_items
    elif src.is_mla:  # re-tiled: equal bytes per token, whole tokens per page
        s_exp = s_items - s_items % U64(src.page_size)
        d_exp = s_exp // U64(src.page_size) * U64(dst.page_size)
    else:
        s_exp = np.full_like(s_items, src.page_size * src.head_bytes * src.num_kv_heads)
        d_exp = np.full_like(d_items, dst.page_size * src.head_bytes * dst.num_kv_heads)
    bad = np.flatnonzero((s_items != s_exp) | (d_items != d_exp))
    if bad.size == 0:
        return []
    i = int(bad[0])
    layer = int(layers[i % layers.size])
    pages = str(src.page_size) if src.page_size == dst.page_size else \
        f"{src.page_size} vs {dst.page_size} tokens"
    what = f"in layer {layer}" if src.is_mla and src.page_size == dst.page_size else (
        f"in layer {layer} (whole tokens per page of {pages}, equal bytes per token: "
        f"expected {int(s_exp[i])} vs {int(d_exp[i])})" if src.is_mla else
        f"in layer {layer} {'KV'[i // layers.size]} (expected {int(s_exp[i])} vs "
        f"{int(d_exp[i])}: page_size {pages} x {src.num_kv_heads} vs "
        f"{dst.num_kv_heads} heads x head_dim {src.head_dim} x {src.dtype_size} bytes)")
    return [f"kv item len mismatch {int(s_items[i])} vs {int(d_items[i])} {what}"]


def head_overlap(src: RankLayout, dst: RankLayout) -> tuple[int, int, int]:
    """``(src_head_offset, dst_head_offset, n_heads)``: the heads both ranks hold.

    Offsets are head indices local to each rank (0 = the rank's first head);
    ``n_heads`` is 0 when the head sets are disjoint. This generalises SGLang's
    ``send_kvcache_slice`` offsets: decode TP > prefill TP gives
    ``src_head_start_offset = (dst_rank * dst_heads) % src_heads``, decode
    TP < prefill TP gives ``dst_head_start_offset = (src_rank % ratio) * src_heads``.
    MLA: ``(0, 0, 1)`` (replicated latent KV).
    """
    if src.is_mla:
        return 0, 0, 1
    (s0, sn), (d0, dn) = src.heads, dst.heads
    lo, hi = max(s0, d0), min(s0 + sn, d0 + dn)
    if hi <= lo:
        return 0, 0, 0
    return lo - s0, lo - d0, hi - lo


def plan_transfer(src: RankLayout, dst: RankLayout, src_pages: npt.ArrayLike,
                  dst_pages: npt.ArrayLike) -> Descriptors:
    """Descriptors moving what prefill ``src`` holds and decode ``dst`` needs.

    ``src_pages``/``dst_pages``: 1-D integer page indices (``[P]`` each; page
    ``src_pages[i]`` goes to page ``dst_pages[i]``). Returns uint64 ``src``,
    ``dst``, ``length`` arrays (addresses and bytes), layer ``l`` of ``src``
    landing in ``dst``'s buffer of the same absolute layer (SGLang's PP rule):

    * MLA, or MHA with equal head sets: whole pages, runs contiguous on both
      sides coalesced (:func:`~kvd.transfer.plan.plan_pages`); ``N = B * runs``.
    * MHA, different head sets: the :func:`head_overlap` slice, empty when
      disjoint. NHD: one descriptor per token slot, ``N = B * P * page_size``,
      order ``[buffer][page][token]`` (SGLang's ``send_kvcache_slice``); HND:
      one per page, ``N = B * P``, order ``[buffer][page]``.

    ``B`` is the number of ``src`` buffers, K buffers before V buffers.
    Raises :class:`RegistrationError` as :func:`check_pair` (called first, it
    is cheap), :class:`IndexLengthMismatch` when the arrays differ in length
    (case K10: ``"index length mismatch N vs M"``), :class:`LayoutError` for
    bad indices or a range wrapping past 2**64. Page indices are not checked
    against pool sizes: callers run ``check_bounds`` on the result.
    """
    return PairPlan.of(src, dst).plan(src_pages, dst_pages)


@dataclass(frozen=True)
class PairPlan:
    """What :func:`plan_transfer` derives from a (prefill, decode) layout pair alone,
    computed once per pair: a 1-page room then costs only its per-page arithmetic.
    :meth:`plan` returns exactly what ``plan_transfer`` does for the same pages."""

    src: RankLayout
    dst: RankLayout
    s_off: int
    d_off: int
    n_heads: int
    sb: Pages
    db: Pages
    s_ptr: Addrs
    d_ptr: Addrs
    s_item: Addrs
    d_item: Addrs

    @staticmethod
    def of(src: RankLayout, dst: RankLayout, retile: bool = False) -> PairPlan:
        """Raises :class:`RegistrationError` as :func:`check_pair` (``retile``: the page
        sizes may differ; such a pair is planned with :meth:`plan_tokens` only)."""
        check_pair(src, dst, retile)
        s_off, d_off, n_heads = head_overlap(src, dst)
        layers = np.arange(src.layer_start, src.layer_end, dtype=np.int64)
        sb, db = src.buffer_index(layers), dst.buffer_index(layers)
        pair = PairPlan(src, dst, s_off, d_off, n_heads, sb, db, src.kv_ptrs[sb],
                        dst.kv_ptrs[db], src.item_lens[sb], dst.item_lens[db])
        pair._check_geometry()
        return pair

    def layers(self, lo: int, hi: int) -> PairPlan:
        """This pair restricted to the SOURCE's local layers ``[lo, hi)`` (layer streaming,
        issue 22 item 4): :meth:`plan`, :meth:`plan_tokens` and their proofs then move and
        check exactly those layers' share -- every byte of those layers of the named pages
        once, nothing of another layer. Kept per range (at most ``_MAX_RANGES``).

        Raises :class:`LayoutError` for a range outside ``[0, src.num_layers)`` or empty."""
        if not 0 <= lo < hi <= self.src.num_layers:
            raise LayoutError(f"layers [{lo}, {hi}) outside the prefill's "
                              f"{self.src.num_layers} layers")
        if (lo, hi) == (0, self.src.num_layers):
            return self
        cache = self._ranges
        sub = cache.get((lo, hi))
        if sub is None:
            absolute = np.arange(self.src.layer_start + lo, self.src.layer_start + hi,
                                 dtype=np.int64)
            sb, db = self.src.buffer_index(absolute), self.dst.buffer_index(absolute)
            sub = replace(self, sb=sb, db=db, s_ptr=self.src.kv_ptrs[sb],
                          d_ptr=self.dst.kv_ptrs[db], s_item=self.src.item_lens[sb],
                          d_item=self.dst.item_lens[db])
            if len(cache) < _MAX_RANGES:
                cache[(lo, hi)] = sub
        return sub

    @cached_property
    def _ranges(self) -> dict[tuple[int, int], PairPlan]:
        return {}

    @property
    def whole_pages(self) -> bool:
        """Does this source write whole decode pages (MLA, or equal head sets)?"""
        return self.src.is_mla or self.n_heads == self.src.num_kv_heads == \
            self.dst.num_kv_heads

    @property
    def writes_aux(self) -> bool:
        """Does this source write the decode's aux slot? Exactly one source per decode
        rank does: the one holding the decode rank's first head (decode-local head 0;
        MLA: every real source, and routing gives a decode rank one, the others being
        dummies). The PP rule -- only the last stage has outputs -- is the caller's."""
        return self.n_heads > 0 and self.d_off == 0

    @property
    def retiled(self) -> bool:
        """Do the two ranks' page sizes differ (planned in tokens, :meth:`plan_tokens`)?"""
        return self.src.page_size != self.dst.page_size

    @cached_property
    def _retile_sides(self) -> tuple[Side, Side, Addrs, bool, bool]:
        """``(src side, dst side, per_token bytes [B], token_major, per_slot)`` for
        :mod:`kvd.transfer.retile`."""
        src, dst, hb = self.src, self.dst, self.src.head_bytes
        nb = self.sb.size
        if self.whole_pages and (src.is_mla or src.layout == "NHD"):
            s_tok, d_tok = self.s_item // U64(src.page_size), self.d_item // U64(dst.page_size)
            zero = np.zeros(1, dtype=U64)
            return (Side(self.s_ptr, self.s_item, s_tok, zero, src.page_size, self.sb),
                    Side(self.d_ptr, self.d_item, d_tok, zero, dst.page_size, self.db),
                    s_tok, True, False)
        heads = np.arange(self.n_heads, dtype=U64)
        if src.layout == "HND":  # [page][head][token][dim]: a head's run per piece
            s_in = (heads + U64(self.s_off)) * U64(src.page_size * hb)
            d_in = (heads + U64(self.d_off)) * U64(dst.page_size * hb)
            one = np.full(nb, hb, dtype=U64)
            return (Side(self.s_ptr, self.s_item, one, s_in, src.page_size, self.sb),
                    Side(self.d_ptr, self.d_item, one, d_in, dst.page_size, self.db),
                    one, False, False)
        s_in = np.array([self.s_off * hb], dtype=U64)  # NHD head slice: per token slot
        d_in = np.array([self.d_off * hb], dtype=U64)
        return (Side(self.s_ptr, self.s_item, np.full(nb, src.num_kv_heads * hb, dtype=U64),
                     s_in, src.page_size, self.sb),
                Side(self.d_ptr, self.d_item, np.full(nb, dst.num_kv_heads * hb, dtype=U64),
                     d_in, dst.page_size, self.db),
                np.full(nb, self.n_heads * hb, dtype=U64), False, True)

    def plan_tokens(self, src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike, lo: int,
                    hi: int, src_first: int = 0, dst_first: int = 0) -> Descriptors:
        """Descriptors moving room tokens ``[lo, hi)`` (token positions) for any two page
        sizes (:mod:`kvd.transfer.retile`): token ``t`` is read from prefill page
        ``src_pages[t // Ps - src_first]`` slot ``t % Ps`` and written to decode page
        ``dst_pages[t // Pd - dst_first]`` slot ``t % Pd``. ``src_first`` is the chunk's
        ``first_page`` in SENDER pages (``src_pages[0]`` is that room page), ``dst_first``
        the first room page ``dst_pages`` names, in DECODE pages. A chunk of sender pages
        ``[f, f + n)`` of a room of ``T`` tokens is ``lo = f * Ps``, ``hi = min((f + n) *
        Ps, T)``. Aux is planned apart (:func:`~kvd.transfer.plan.plan_aux`).

        Raises :class:`LayoutError` when the tokens fall outside the named pages or an
        address would wrap past 2**64.
        """
        sp = as_pages(src_pages, "source page indices")
        dp = as_pages(dst_pages, "destination page indices")
        if self.n_heads == 0 or hi <= lo:
            Chunk(sp, dp, lo, hi, src_first, dst_first).check(self.src.page_size,
                                                              self.dst.page_size)
            return Descriptors.empty()
        s_top, d_top = self._tops
        _check_no_wrap(self.s_ptr, self.s_item, sp, "source", s_top)
        _check_no_wrap(self.d_ptr, self.d_item, dp, "destination", d_top)
        s, d, per_token, token_major, per_slot = self._retile_sides
        return retile_plan(s, d, per_token, Chunk(sp, dp, lo, hi, src_first, dst_first),
                           token_major, per_slot)

    def prove_tokens(self, desc: Descriptors, dst_pages: npt.ArrayLike, lo: int, hi: int,
                     dst_first: int = 0, aux: tuple[Addrs, Addrs, int] | None = None,
                     what: str = "plan") -> None:
        """Prove ``desc`` (a :meth:`plan_tokens` plan, aux after KV) writes every decode byte
        of tokens ``[lo, hi)`` this source owes exactly once (its head share, every
        layer it holds) and nothing outside the room's decode pages ``dst_pages``; the
        expected ranges come from the decode pages alone (:func:`retile_expected`).

        Raises :class:`PlanRefused` (``uncovered``/``doubled``/``outside``), also when a
        decode page is named twice (K42); :class:`LayoutError` as :meth:`plan_tokens`.
        """
        dp = as_pages(dst_pages, "destination page indices")
        check_distinct(dp, "destination")
        aux_iv = None
        if aux is not None:
            ptrs, lens, index = aux
            aux_iv = (ptrs + U64(index) * lens, lens)
        heads = 1
        if self.n_heads == 0:
            e_dst = e_len = np.zeros(0, dtype=U64)
        else:
            chunk = Chunk(dp, dp, lo, hi, dst_first, dst_first)
            chunk.check(self.dst.page_size, self.dst.page_size)
            if dp.size:
                _check_no_wrap(self.d_ptr, self.d_item, dp, "destination", self._tops[1])
            _, d, per_token, _, per_slot = self._retile_sides
            e_dst, e_len = retile_expected(d, per_token, chunk, per_slot)
            heads = d.inner.size
        if _in_order(desc, e_dst, e_len, aux_iv, self.sb.size, heads):
            return
        if aux_iv is not None:
            e_dst, e_len = np.concatenate([e_dst, aux_iv[0]]), np.concatenate([e_len, aux_iv[1]])
        diff = interval_diff(desc.dst, desc.length, e_dst, e_len)
        if diff is None:
            return
        kind, a, b = diff
        where = Tiling(self.d_ptr, self.d_item, self.db, dp[:0], dp[:0],
                       np.zeros(1, dtype=U64), None, aux_iv, self.dst.buffer_name).where(a)
        verb = {"uncovered": "is written by no descriptor", "doubled": "is written twice",
                "outside": "is written but the decode does not read it from this source"}[kind]
        raise PlanRefused(f"{what}: plan refused: destination bytes [{a:#x}, +{b - a}) "
                          f"({where}) {verb} (plan covers {desc.nbytes} bytes, the decode "
                          f"reads {int(e_len.sum(dtype=U64))} from this source, tokens "
                          f"[{lo}, {hi}))", kind, a, b)

    @cached_property
    def _slice(self) -> tuple[Addrs, int]:
        """``(inner, slot)``: byte offsets in a decode page and bytes of each interval of
        the head slice this source writes (head-sliced pairs only)."""
        src, dst, hb = self.src, self.dst, self.src.head_bytes
        if src.layout == "HND":  # [page][head][token][dim]
            run = src.page_size * hb
            return np.array([self.d_off * run], dtype=U64), self.n_heads * run
        tokens = np.arange(src.page_size, dtype=U64)  # [page][token][head][dim]
        return (tokens * U64(dst.num_kv_heads * hb) + U64(self.d_off * hb),
                self.n_heads * hb)

    def _check_geometry(self) -> None:
        """The pair-only half of the proof (once per pair): the decode buffers written
        are distinct, and a head slice's intervals are disjoint and inside one page."""
        if np.unique(self.db).size != self.db.size:
            raise PlanRefused("plan refused: two source layers map to one decode buffer",
                              "doubled")
        if self.whole_pages or self.n_heads == 0 or self.retiled:
            return  # re-tiled slices: inside a slot/page by construction (_retile_sides)
        inner, slot = self._slice
        gaps_ok = inner.size < 2 or bool((np.diff(inner) >= U64(slot)).all())
        page = int(self.d_item.min()) if self.d_item.size else 0
        if not gaps_ok or int(inner[-1]) + slot > page:
            raise PlanRefused(f"plan refused: head slice of {slot} bytes at offsets "
                              f"{inner[:4].tolist()}... does not fit a decode page of "
                              f"{page} bytes", "outside")

    def tiling(self, src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike,
               aux: tuple[Addrs, Addrs, int] | None = None) -> Tiling:
        """What this source must write for one chunk, as a disjoint :class:`Tiling`:
        its share of the decode pages ``dst_pages`` (the source pages only set how whole
        pages are grouped into runs), plus, with ``aux = (ptrs, item_lens, index)`` (the
        DECODE's aux buffers, uint64 ``[A]``, and its slot), the aux slot.

        Raises :class:`PlanRefused` when a destination page is named twice (K42).
        """
        dp = as_pages(dst_pages, "destination page indices")
        check_distinct(dp, "destination")
        aux_iv = None
        if aux is not None:
            ptrs, lens, index = aux
            aux_iv = (ptrs + U64(index) * lens, lens)
        zero = np.zeros(1, dtype=U64)
        if self.n_heads == 0:
            return Tiling(self.d_ptr, self.d_item, self.db, dp[:0], dp[:0], zero, None,
                          aux_iv, self.dst.buffer_name)
        if self.whole_pages:
            _, starts, counts = page_runs(src_pages, dp)
            return Tiling(self.d_ptr, self.d_item, self.db, starts, counts, zero, None,
                          aux_iv, self.dst.buffer_name)
        inner, slot = self._slice
        return Tiling(self.d_ptr, self.d_item, self.db, dp, np.ones(dp.size, dtype=np.int64),
                      inner, slot, aux_iv, self.dst.buffer_name)

    def prove(self, desc: Descriptors, src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike,
              aux: tuple[Addrs, Addrs, int] | None = None, what: str = "plan") -> None:
        """Prove ``desc`` (this pair's plan of one chunk, aux after KV) writes exactly
        :meth:`tiling`; raises :class:`PlanRefused` (:func:`~kvd.transfer.plan.prove_plan`)."""
        if isinstance(dst_pages, np.ndarray) and dst_pages.size == 1 and self.whole_pages \
                and self._one_page(desc, int(dst_pages[0]), aux):
            return  # the 1-page room: the same proof, a handful of byte comparisons
        prove_plan(desc, self.tiling(src_pages, dst_pages, aux), what)

    @cached_property
    def _d_item_bytes(self) -> bytes:
        return self.d_item.tobytes()

    def _one_page(self, desc: Descriptors, page: int,
                  aux: tuple[Addrs, Addrs, int] | None) -> bool:
        """Is ``desc`` exactly whole page ``page`` of every decode buffer (and the aux
        slot)? Same answer as :meth:`Tiling.matches` for one page."""
        b = self.d_ptr.size
        n_aux = 0 if aux is None else aux[0].size
        if desc.dst.size != b + n_aux or desc.length.size != b + n_aux or page < 0:
            return False
        if desc.length[:b].tobytes() != self._d_item_bytes or \
                desc.dst[:b].tobytes() != (self.d_ptr + U64(page) * self.d_item).tobytes():
            return False
        if aux is None:
            return True
        ptrs, lens, index = aux
        return desc.length[b:].tobytes() == lens.tobytes() and \
            desc.dst[b:].tobytes() == (ptrs + U64(index) * lens).tobytes()

    @cached_property
    def _tops(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(max pointer, max item length) of each side, for the wrap check of a plan."""
        return ((int(self.s_ptr.max(initial=0)), int(self.s_item.max(initial=0))),
                (int(self.d_ptr.max(initial=0)), int(self.d_item.max(initial=0))))

    def plan_chunk(self, src_pages: Pages, dst_pages: Pages,
                   tokens: tuple[int, int] | None = None, src_first: int = 0,
                   dst_first: int = 0, aux: tuple[Descriptors, tuple[Addrs, Addrs, int]]
                   | None = None, what: str = "plan") -> Descriptors:
        """One chunk of this pair, planned and proved: the one path every paged kind takes
        (the main KV, extra paged caches, window pools). ``tokens`` None: whole pages,
        ``src_pages[i]`` -> ``dst_pages[i]`` (equal page sizes; :meth:`plan`,
        :meth:`prove`); else room tokens ``(lo, hi)`` re-tiled between the two page sizes
        (``src_first``/``dst_first``: the room page of each list's first page, in each
        side's pages; :meth:`plan_tokens`, :meth:`prove_tokens`). ``aux``: the aux slot's
        descriptors and ``(decode ptrs, item lens, decode index)``, written after the
        KV and proved with it. Raises :class:`PlanRefused`, :class:`LayoutError` (and
        :class:`~kvd.errors.IndexLengthMismatch`) as those."""
        if tokens is None:
            desc = self.plan(src_pages, dst_pages)
        else:
            desc = self.plan_tokens(src_pages, dst_pages, *tokens, src_first, dst_first)
        slot = None
        if aux is not None:
            desc, slot = desc.concat(aux[0]), aux[1]
        if tokens is None:
            self.prove(desc, src_pages, dst_pages, slot, what)
        else:
            self.prove_tokens(desc, dst_pages, *tokens, dst_first, slot, what)
        return desc

    def plan(self, src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike) -> Descriptors:
        """Descriptors for one chunk (see :func:`plan_transfer`)."""
        src, dst = self.src, self.dst
        sp = as_pages(src_pages, "source page indices")
        dp = as_pages(dst_pages, "destination page indices")
        if sp.size != dp.size:
            raise IndexLengthMismatch(f"index length mismatch {sp.size} vs {dp.size}")
        if sp.size == 0 or self.n_heads == 0:
            return Descriptors.empty()
        s_ptr, d_ptr, s_item, d_item = self.s_ptr, self.d_ptr, self.s_item, self.d_item
        sb, db, n_heads = self.sb, self.db, self.n_heads
        s_top, d_top = self._tops
        _check_no_wrap(s_ptr, s_item, sp, "source", s_top)
        _check_no_wrap(d_ptr, d_item, dp, "destination", d_top)
        if src.is_mla or n_heads == src.num_kv_heads == dst.num_kv_heads:
            return plan_pages(s_ptr, d_ptr, s_item, d_item, sp, dp, sb, db)
        head_bytes = src.head_bytes
        if src.layout == "HND":  # [page][head][token][dim]: the slice is one run per page
            run = src.page_size * head_bytes
            s_in = np.array([self.s_off * run], dtype=U64)
            d_in = np.array([self.d_off * run], dtype=U64)
            return _strided((s_ptr, s_item, sp, s_in), (d_ptr, d_item, dp, d_in),
                            n_heads * run, (sb, db))
        tokens = np.arange(src.page_size, dtype=U64)  # [page][token][head][dim]: per slot
        s_in = tokens * U64(src.num_kv_heads * head_bytes) + U64(self.s_off * head_bytes)
        d_in = tokens * U64(dst.num_kv_heads * head_bytes) + U64(self.d_off * head_bytes)
        return _strided((s_ptr, s_item, sp, s_in), (d_ptr, d_item, dp, d_in),
                        n_heads * head_bytes, (sb, db))


def _in_order(desc: Descriptors, e_dst: Addrs, e_len: Addrs,
              aux: tuple[Addrs, Addrs] | None, nb: int, heads: int) -> bool:
    """The re-tiled proof's fast path: does ``desc`` (a :meth:`PairPlan.plan_tokens` plan,
    ``[B][S][H]``, aux after KV) name exactly the bytes of the expected ``[B][S'][H]``
    intervals ``(e_dst, e_len)`` (and then exactly the ``aux`` intervals)? Both are read
    in ``[B][H][S]`` order -- one buffer, one head, tokens in order -- where the plan's
    pieces and the decode's pages name the same byte sequence, so equal runs
    (:func:`~kvd.transfer.plan.same_runs`) prove the tiling in ``O(N)``. ``False``: another
    order or a wrong plan; the caller asks the general sweep."""
    n_aux = 0 if aux is None else aux[0].size
    n = desc.dst.size - n_aux
    if n < 0 or desc.length.size != desc.dst.size or e_dst.size % max(nb * heads, 1) or \
            n % max(nb * heads, 1):
        return False
    if aux is not None and not (np.array_equal(desc.dst[n:], aux[0]) and
                                np.array_equal(desc.length[n:], aux[1])):
        return False
    d, ln = desc.dst[:n], desc.length[:n]
    if n == e_dst.size and np.array_equal(d, e_dst) and np.array_equal(ln, e_len):
        return True  # the same intervals (pieces are whole decode pages' pieces): no runs
    if heads > 1 and n:
        d, ln = (a.reshape(nb, -1, heads).transpose(0, 2, 1).ravel() for a in (d, ln))
        e_dst, e_len = (a.reshape(nb, -1, heads).transpose(0, 2, 1).ravel()
                        for a in (e_dst, e_len))
    return same_runs(d, ln, e_dst, e_len)


_Side = tuple[Addrs, Addrs, Pages, Addrs]


def _strided(src: _Side, dst: _Side, length: int,
             bufs: tuple[Pages, Pages]) -> Descriptors:
    """Descriptors ``[b, i, t] = ptr[b] + pages[i] * item[b] + inner[t]``, each ``length`` bytes.

    Each side is ``(ptr [B], item [B], pages [P], inner [T])``; entries are in
    C order ``[B][P][T]``. All three outputs live in one ``[3, B*P*T]`` block
    written in place: one allocation, no full-size temporaries (the block is
    large, so fresh pages -- not arithmetic -- dominate planning time). ``bufs``: the
    buffer ids ``[B]`` of each side, for per-buffer bounds checks.
    """
    b, p, t = src[0].size, src[2].size, src[3].size
    spans = []
    for ptr, item, pages, inner in (src, dst):  # extremes of each term: cover every entry
        lo = ptr + U64(pages.min()) * item + inner.min()
        spans += [lo, ptr + U64(pages.max()) * item + inner.max() + U64(length)]
    out = np.empty((3, b, p, t), dtype=U64)
    for k, (ptr, item, pages, inner) in enumerate((src, dst)):
        pages_u = pages.astype(U64)
        if t == 1:  # HND: two passes straight into the output
            np.multiply(item[:, None, None], pages_u[None, :, None], out=out[k])
            out[k] += (ptr + inner[0])[:, None, None]
        else:  # NHD: a [B, P] base, then one pass over the output
            base = np.multiply(item[:, None], pages_u[None, :])
            base += ptr[:, None]
            np.add(base[:, :, None], inner[None, None, :], out=out[k])
    out[2] = U64(length)
    flat = out.reshape(3, b * p * t)
    return Descriptors(flat[0], flat[1], flat[2], (spans[0], spans[1], spans[2], spans[3]),
                       (bufs[0].astype(np.int64), bufs[1].astype(np.int64)))


def _check_no_wrap(ptrs: Addrs, items: Addrs, pages: Pages, what: str,
                   tops: tuple[int, int] | None = None) -> None:
    """Refuse when ``ptr + (max_page + 1) * item`` could pass 2**64 (Python ints, exact).
    ``tops``: ``(max(ptrs), max(items))`` when the caller has them."""
    last = (int(pages[0]) if pages.size == 1 else int(pages.max())) + 1
    top_ptr, top_item = tops if tops is not None else (int(ptrs.max()), int(items.max()))
    if top_ptr + last * top_item <= _U64_MAX + 1:  # cheap bound, usual case
        return
    top = max(p + last * n for p, n in zip(ptrs.tolist(), items.tolist(), strict=True))
    if top > _U64_MAX + 1:
        raise LayoutError(f"{what} page {last - 1} would address past 2**64")


def check_coverage(src: RankLayout, dst: RankLayout, pp_rank: int, pp_size: int) -> None:
    """Refuse a pair where some layer the decode will read is written by nobody (K25).

    A prefill stage writes its layers ``[src.layer_start, src.layer_end)``; the
    stages of one prefill instance together must cover every decode layer. One
    stage can check its own edge: the first stage must start at the decode's first
    layer and the last stage must end at its last (with ``pp_size`` 1, both).
    Heads are covered by :func:`check_pair` (every decode head is held by the
    prefill ranks that feed it); pages by the room's index-length check.
    Raises :class:`RegistrationError` naming the uncovered layers.
    """
    problems = []
    if pp_rank == 0 and src.layer_start != dst.layer_start:
        problems.append(f"decode layers [{dst.layer_start}, {src.layer_start}) are not "
                        f"written by any prefill stage")
    if pp_rank == pp_size - 1 and src.layer_end != dst.layer_end:
        problems.append(f"decode layers [{src.layer_end}, {dst.layer_end}) are not written "
                        f"by any prefill stage (prefill has {src.num_layers} layers, decode "
                        f"{dst.num_layers})")
    if problems:
        raise RegistrationError("layer coverage: " + "; ".join(problems))


def prove_sources_tile(dst: RankLayout, sources: list[RankLayout],
                       dummies: list[bool] | None = None) -> None:
    """Prove that the head slices and layer ranges the prefill ``sources`` write into decode
    rank ``dst`` (every TP rank and PP stage routing names for it; ``dummies[i]``: an MLA
    dummy, which writes nothing) cover each (layer, decode head) the decode reads exactly
    once -- the all-sources half of the plan proof; each source then proves its own
    descriptors against its slice (:meth:`PairPlan.tiling`). Pure, a function of the
    layouts only; a grid of ``layers x heads`` counts (one loop per source, not per byte).

    Raises :class:`PlanRefused` (``uncovered`` or ``doubled``) naming the layer and head.
    """
    heads = 1 if dst.is_mla else dst.num_kv_heads
    d_head0 = 0 if dst.is_mla else dst.heads[0]
    count = np.zeros((dst.num_layers, heads), dtype=np.int64)
    for i, src in enumerate(sources):
        if dummies is not None and dummies[i]:
            continue
        _, d_off, n = head_overlap(src, dst)
        lo = max(src.layer_start, dst.layer_start) - dst.layer_start
        hi = min(src.layer_end, dst.layer_end) - dst.layer_start
        if n and hi > lo:
            count[lo:hi, d_off:d_off + n] += 1
    bad = np.argwhere(count != 1)
    if bad.size:
        layer, head = (int(x) for x in bad[0])
        c = int(count[layer, head])
        kind = "uncovered" if c == 0 else "doubled"
        raise PlanRefused(f"plan refused: decode layer {dst.layer_start + layer} head "
                          f"{d_head0 + head} is written by {c} prefill sources, not 1", kind)
