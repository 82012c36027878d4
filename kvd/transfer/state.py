"""Per-request state buffers and sliding-window pages -> transfer descriptors. PURE.

Hybrid models keep, next to the paged KV of their full-attention layers (planned by
:mod:`kvd.transfer.layout`), two more kinds of cache, and a room moves both:

* **State buffers** (linear attention / SSM / Mamba: a conv state and an SSM state per
  layer). A state buffer is an array of fixed-size *slots*, one per live request, picked
  by the request's *state index* (SGLang's ``mamba_pool`` index; a room names one on each
  side). Slot ``i`` of buffer ``b`` is the bytes ``[ptr[b] + i * slot_bytes[b], +
  slot_bytes[b])``. A slot is ``[head][rest]``, head-major: the heads (the dimension
  tensor parallelism splits, SSM heads or conv channels) are ``heads[b]`` runs of
  ``head_bytes[b]`` bytes each, so a TP rank's slot holds the contiguous block of heads
  :func:`~kvd.transfer.layout.rank_heads` gives it, and a head slice of a slot is one
  contiguous run. A state tensor whose split axis is not outermost (Mamba2's conv state
  packs x, B and C channels, each sharded separately) is registered as one state buffer
  per section, each head-major.
* **Window layers** (sliding-window attention, SWA): their own paged pool (SGLang's SWA
  pool), laid out like paged KV, of which only the pages holding the last ``window``
  tokens move. The room names those pages (source and destination lists). Geometry,
  TP slicing and the per-source proof are :class:`~kvd.transfer.layout.PairPlan`'s,
  over a :class:`~kvd.transfer.layout.RankLayout` whose layers are the window layers
  numbered ``0..`` in their own index space.

``layer_types`` (one entry per absolute model layer, :data:`LAYER_TYPES`) says which
kind of cache each layer has; pairing refuses a pair whose layer types, state shapes or
dtypes differ, with one reason naming the first difference (:func:`check_state_pair`).

The proof (issue "every byte written exactly once"), per source and per room: the
descriptors write exactly this source's head slice of the decode's state slot, once,
and nothing else (:meth:`StatePairPlan.prove`); across sources, every (state buffer,
decode head) is written by exactly one source (:func:`prove_state_sources_tile`); window
descriptors are proved by ``PairPlan.prove`` after :func:`check_window_pages` refused
more pages than the window holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvd.errors import LayoutError, RegistrationError
from kvd.protocol.control import KVArgsWire
from kvd.transfer.layout import PairPlan, RankLayout, prefill_targets, rank_heads
from kvd.transfer.plan import U64, Addrs, Descriptors, PlanRefused, interval_diff

#: What a layer keeps: paged KV (``full``), a window of paged KV (``window``), or
#: per-request state slots (``state``).
LAYER_TYPES = ("full", "window", "state")
#: Buffer ids of state buffers in a rank's :class:`~kvd.transfer.plan.Regions`: state
#: buffer ``i`` is ``STATE_ID_BASE + i`` (KV buffers are ``0..``, aux ``-1, -2, ..``).
STATE_ID_BASE = 1 << 20
_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class StateBuffer:
    """One state buffer of one rank.

    ``layer``: absolute model layer; ``kind``: what it holds (``"conv"``, ``"ssm"``, a
    conv section such as ``"conv.x"``: names pair buffers across ranks); ``ptr``/``length``:
    base address and registered bytes (u64, the owning daemon's address space);
    ``slot_bytes``: bytes of one slot on this rank (``heads * head_bytes``); ``dtype``:
    element type name (``"bfloat16"``, ``"float32"``: compared, not interpreted);
    ``heads``: heads this rank's slot holds; ``total_heads``: heads of the model's slot
    (split over TP by :func:`~kvd.transfer.layout.rank_heads`).
    """

    layer: int
    kind: str
    ptr: int
    length: int
    slot_bytes: int
    dtype: str
    heads: int
    total_heads: int

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one slot."""
        return self.slot_bytes // max(self.heads, 1)

    @property
    def num_slots(self) -> int:
        """Whole slots the buffer holds."""
        return self.length // self.slot_bytes if self.slot_bytes > 0 else 0

    @property
    def key(self) -> tuple[int, str]:
        """``(layer, kind)``: what pairs this buffer with its peer's."""
        return self.layer, self.kind


@dataclass(frozen=True)
class StateLayout:
    """A rank's state buffers and window pool, as far as planning needs them.

    ``buffers``: the state buffers of the layers this rank holds (PP stage
    ``[layer_start, layer_end)`` of the model's layers), in registration order (buffer
    ``i`` has id ``STATE_ID_BASE + i``). ``layer_types``: one :data:`LAYER_TYPES` entry per
    model layer (all layers, not just this stage's). ``window``: the window pool's layout
    (None: no window layers) and ``window_tokens``: tokens a window layer attends to.
    ``tp_rank``/``tp_size``: attention TP.

    Raises :class:`RegistrationError` listing every structural problem: unknown layer
    type, a state buffer on a layer that is not ``state``, a ``state`` layer of this
    stage without one, a duplicate ``(layer, kind)``, sizes that are not positive or do not
    split (``slot_bytes != heads * head_bytes``, ``heads`` other than what ``rank_heads``
    gives), a buffer shorter than one slot or wrapping past 2**64.
    """

    buffers: tuple[StateBuffer, ...]
    layer_types: tuple[str, ...]
    layer_start: int
    layer_end: int
    tp_rank: int
    tp_size: int
    window: RankLayout | None = None
    window_tokens: int = 0

    def __post_init__(self) -> None:
        problems = _layout_problems(self)
        if problems:
            raise RegistrationError("invalid state layout: " + "; ".join(problems))

    @property
    def has_state(self) -> bool:
        """Any state buffer or window layer to move?"""
        return bool(self.buffers) or self.window is not None

    def max_window_pages(self, page_size: int) -> int:
        """Most pages a window of ``window_tokens`` tokens can touch: ``ceil(W / page_size)``
        plus one (a window that starts inside a page)."""
        return -(-self.window_tokens // page_size) + 1

    def slot_range(self, b: int, index: int) -> tuple[int, int]:
        """``[lo, hi)`` bytes of slot ``index`` of buffer ``b``."""
        buf = self.buffers[b]
        lo = buf.ptr + index * buf.slot_bytes
        return lo, lo + buf.slot_bytes

    def regions(self) -> tuple[Addrs, Addrs, np.ndarray]:
        """``(ptrs, lengths, ids)`` of the state buffers, for
        :meth:`~kvd.transfer.plan.Regions.of` (uint64, uint64, int64 ``[S]``)."""
        ptrs = np.array([b.ptr for b in self.buffers], dtype=U64)
        lens = np.array([b.length for b in self.buffers], dtype=U64)
        return ptrs, lens, STATE_ID_BASE + np.arange(len(self.buffers), dtype=np.int64)


def state_layout(wire: KVArgsWire, tp_rank: int, tp_size: int) -> StateLayout | None:
    """The :class:`StateLayout` of the rank that sent ``wire`` (None: it registered no state
    and no window pool) at attention TP ``tp_rank``/``tp_size``. Its stage is the paged KV's
    PP stage: layers from ``wire.layer_start`` for as many model layers as hold one full-
    attention layer per paged KV layer, window and state layers between them included.

    Raises :class:`RegistrationError` like the constructor (and ``RankLayout``'s for the
    window pool).
    """
    if wire.state is None:
        return None
    spec, ptrs, lens = wire.state.spec, wire.state.ptrs, wire.state.lens
    n = len(spec.buffers)
    if len(ptrs) < n or len(lens) < n:
        raise RegistrationError(f"invalid state layout: {len(ptrs)} state pointers for {n} "
                                f"state buffers")
    bufs = tuple(StateBuffer(b.layer, b.kind, int(p), int(m), b.slot_bytes, b.dtype, b.heads,
                             b.total_heads) for b, p, m in zip(spec.buffers, ptrs, lens,
                                                                strict=False))
    types = tuple(spec.layer_types)
    start, end = spec.stage_start, len(types) if spec.stage_end < 0 else spec.stage_end
    window = None
    if spec.window is not None:
        w = spec.window
        window = RankLayout(kv_ptrs=np.asarray(ptrs[n:], dtype=U64),
                            item_lens=np.asarray(w.item_lens, dtype=U64),
                            page_size=wire.page_size, num_kv_heads=w.num_kv_heads,
                            total_kv_heads=w.total_kv_heads or w.num_kv_heads * tp_size,
                            head_dim=w.head_dim, dtype_size=w.dtype_size,
                            num_layers=w.num_layers, layer_start=w.layer_start, is_mla=False,
                            layout=w.layout, tp_rank=tp_rank, tp_size=tp_size)
    return StateLayout(bufs, types, start, end, tp_rank, tp_size, window, spec.window_tokens)


def _layout_problems(s: StateLayout) -> list[str]:
    problems = [f"layer {i} type {t!r} is not one of {', '.join(LAYER_TYPES)}"
                for i, t in enumerate(s.layer_types) if t not in LAYER_TYPES]
    if not 0 <= s.layer_start <= s.layer_end <= len(s.layer_types):
        problems.append(f"layers [{s.layer_start}, {s.layer_end}) outside the model's "
                        f"{len(s.layer_types)} layers")
    if not 0 <= s.tp_rank < s.tp_size:
        problems.append(f"attention TP rank {s.tp_rank} outside TP size {s.tp_size}")
    if problems:
        return problems
    seen: set[tuple[int, str]] = set()
    for i, b in enumerate(s.buffers):
        problems += [f"state buffer {i} (layer {b.layer} {b.kind}): {p}"
                     for p in _buffer_problems(s, b, b.key in seen)]
        seen.add(b.key)
    have = {b.layer for b in s.buffers}
    problems += [f"state layer {i} has no state buffer" for i in range(s.layer_start,
                 s.layer_end) if s.layer_types[i] == "state" and i not in have]
    if "window" in s.layer_types and s.window_tokens < 1:
        problems.append("a model with window layers needs window_tokens >= 1")
    n_win = s.layer_types[s.layer_start:s.layer_end].count("window")
    if n_win != (0 if s.window is None else s.window.num_layers):
        problems.append(f"{n_win} window layers in this stage, but a window pool of "
                        f"{0 if s.window is None else s.window.num_layers}")
    elif s.window is not None and s.window.layer_start != s.layer_types[:s.layer_start].count(
            "window"):
        problems.append(f"window pool starts at window layer {s.window.layer_start}, but "
                        f"this stage's first window layer is "
                        f"{s.layer_types[:s.layer_start].count('window')}")
    return problems


def _buffer_problems(s: StateLayout, b: StateBuffer, duplicate: bool) -> list[str]:
    out = []
    if duplicate:
        out.append("registered twice")
    if not s.layer_start <= b.layer < s.layer_end or s.layer_types[b.layer] != "state":
        out.append("not a state layer of this stage")
    if min(b.slot_bytes, b.heads, b.total_heads, b.length) < 1 or b.ptr < 0:
        return [*out, "sizes must be positive"]
    if b.slot_bytes % b.heads:
        out.append(f"slot of {b.slot_bytes} bytes does not split into {b.heads} heads")
    try:
        n = rank_heads(s.tp_rank, s.tp_size, b.total_heads)[1]
        if n != b.heads:
            out.append(f"{b.heads} heads vs {n} for TP rank {s.tp_rank} of {s.tp_size} "
                       f"with {b.total_heads} heads")
    except RegistrationError as exc:
        out.append(str(exc))
    if b.length < b.slot_bytes:
        out.append(f"{b.length} bytes is shorter than one slot ({b.slot_bytes} bytes)")
    if b.ptr + b.length > _U64_MAX + 1:
        out.append("wraps past 2**64")
    return out


def check_state_pair(src: StateLayout, dst: StateLayout) -> None:
    """Refuse a (prefill ``src``, decode ``dst``) pair whose hybrid caches cannot be planned,
    with ONE reason: the first of -- layer types differ (naming the layer and both types),
    ``src``'s stage is not inside ``dst``'s, a state buffer of ``src`` has no peer of the
    same ``(layer, kind)`` on ``dst`` (or the other way round, within ``src``'s layers), a
    pair differs in dtype, ``total_heads`` or ``head_bytes`` (its shape), or window
    tokens differ. The window pools' geometry is then checked by ``PairPlan.of``.

    Raises :class:`RegistrationError` ``"incompatible state layouts (prefill vs decode):
    ..."``.
    """
    problem = _state_pair_problem(src, dst)
    if problem:
        raise RegistrationError(f"incompatible state layouts (prefill vs decode): {problem}")


def _state_pair_problem(src: StateLayout, dst: StateLayout) -> str | None:
    if src.layer_types != dst.layer_types:
        if len(src.layer_types) != len(dst.layer_types):
            return f"{len(src.layer_types)} vs {len(dst.layer_types)} layers"
        i = next(i for i, (a, b) in enumerate(zip(src.layer_types, dst.layer_types,
                                                     strict=True)) if a != b)
        return f"layer {i} is {src.layer_types[i]} vs {dst.layer_types[i]}"
    if not (dst.layer_start <= src.layer_start and src.layer_end <= dst.layer_end):
        return (f"prefill layers [{src.layer_start}, {src.layer_end}) outside decode layers "
                f"[{dst.layer_start}, {dst.layer_end})")
    peers = {b.key: b for b in dst.buffers}
    mine = {b.key for b in src.buffers}
    for b in src.buffers:
        p = peers.get(b.key)
        if p is None:
            return f"layer {b.layer} state {b.kind!r} has no decode buffer"
        for name, x, y in (("dtype", b.dtype, p.dtype), ("total_heads", b.total_heads,
                           p.total_heads), ("head_bytes", b.head_bytes, p.head_bytes)):
            if x != y:
                return f"layer {b.layer} state {b.kind!r} {name} {x} vs {y}"
    extra = [k for k in peers if src.layer_start <= k[0] < src.layer_end and k not in mine]
    if extra:
        return f"layer {extra[0][0]} state {extra[0][1]!r} has no prefill buffer"
    if src.window_tokens != dst.window_tokens:
        return f"window tokens {src.window_tokens} vs {dst.window_tokens}"
    return None


def check_state_coverage(src: StateLayout, dst: StateLayout, pp_rank: int,
                         pp_size: int) -> None:
    """Refuse a pair where decode model layers at this stage's edge are written by no
    prefill stage (the state counterpart of :func:`~kvd.transfer.layout.check_coverage`):
    the first stage must start at the decode's first layer, the last end at its last.
    Raises :class:`RegistrationError` naming the uncovered layers."""
    problems = []
    if pp_rank == 0 and src.layer_start != dst.layer_start:
        problems.append(f"decode layers [{dst.layer_start}, {src.layer_start})")
    if pp_rank == pp_size - 1 and src.layer_end != dst.layer_end:
        problems.append(f"decode layers [{src.layer_end}, {dst.layer_end})")
    if problems:
        raise RegistrationError("state layer coverage: " + " and ".join(problems) +
                                " are written by no prefill stage")


def _overlap(s_first: int, s_n: int, d_first: int, d_n: int) -> tuple[int, int, int]:
    lo, hi = max(s_first, d_first), min(s_first + s_n, d_first + d_n)
    return (lo - s_first, lo - d_first, hi - lo) if hi > lo else (0, 0, 0)


def state_share(src: StateLayout, dst: StateLayout, total_heads: int) -> tuple[int, int, int]:
    """``(src_head_offset, dst_head_offset, n_heads)`` of a slot with ``total_heads`` heads
    that ``src`` writes into ``dst``: the heads both hold, offsets local to each rank. A
    replicated source (TP above ``total_heads``) writes nothing when a lower-ranked source
    that routing also names for ``dst`` (:func:`~kvd.transfer.layout.prefill_targets`) holds
    the same head, so a decode head fed by several replicas is written once."""
    s_first, s_n = rank_heads(src.tp_rank, src.tp_size, total_heads)
    d_first, d_n = rank_heads(dst.tp_rank, dst.tp_size, total_heads)
    if src.tp_size > total_heads:  # replicas are consecutive ranks: is a lower one a target?
        first = prefill_targets(dst.tp_rank, dst.tp_size, src.tp_size).start
        if src.tp_rank > first and rank_heads(src.tp_rank - 1, src.tp_size,
                                              total_heads)[0] == s_first:
            return 0, 0, 0
    return _overlap(s_first, s_n, d_first, d_n)


@dataclass(frozen=True)
class StatePairPlan:
    """A (prefill, decode) pair's state planning constants, computed once per pair
    (:meth:`of`); :meth:`plan` is then a few vectorised additions per room.

    Per written buffer pair ``k`` (uint64 ``[K]``): ``s_base``/``d_base`` the address of
    head ``s_off``/``d_off`` in slot 0, ``s_slot``/``d_slot`` slot sizes, ``length`` the
    head slice's bytes; ``s_ids``/``d_ids`` (int64 ``[K]``) the buffers' ids.
    ``window``: the window pools' :class:`~kvd.transfer.layout.PairPlan`, or None.
    """

    src: StateLayout
    dst: StateLayout
    s_base: Addrs
    d_base: Addrs
    s_slot: Addrs
    d_slot: Addrs
    length: Addrs
    s_ids: np.ndarray
    d_ids: np.ndarray
    window: PairPlan | None

    @staticmethod
    def of(src: StateLayout, dst: StateLayout) -> StatePairPlan:
        """Raises :class:`RegistrationError` as :func:`check_state_pair` (and as
        ``PairPlan.of`` for the window pools)."""
        check_state_pair(src, dst)
        peer = {b.key: i for i, b in enumerate(dst.buffers)}
        rows = []
        for i, b in enumerate(src.buffers):
            j = peer[b.key]
            s_off, d_off, n = state_share(src, dst, b.total_heads)
            if n:
                d = dst.buffers[j]
                rows.append((b.ptr + s_off * b.head_bytes, d.ptr + d_off * d.head_bytes,
                             b.slot_bytes, d.slot_bytes, n * b.head_bytes, i, j))
        cols = list(zip(*rows, strict=True)) if rows else [()] * 7
        u = [np.array(c, dtype=U64) for c in cols[:5]]
        ids = [STATE_ID_BASE + np.array(c, dtype=np.int64) for c in cols[5:]]
        window = None
        if src.window is not None and dst.window is not None:
            try:  # other page sizes: re-tiled in tokens, as the paged KV (window_chunk)
                window = PairPlan.of(src.window, dst.window, retile=True)
            except RegistrationError as exc:
                raise RegistrationError(f"window pools: {exc}") from exc
        return StatePairPlan(src, dst, u[0], u[1], u[2], u[3], u[4], ids[0], ids[1], window)

    def _check_index(self, layout: StateLayout, index: int, side: str) -> None:
        slots = min((b.num_slots for b in layout.buffers), default=0)
        if layout.buffers and not 0 <= index < slots:
            raise LayoutError(f"{side} state index {index} outside the {slots} slots "
                              f"registered")

    def plan(self, src_index: int, dst_index: int) -> Descriptors:
        """Descriptors writing this source's head slice of every state buffer from slot
        ``src_index`` into slot ``dst_index``: one per written buffer, buffer order.

        Raises :class:`LayoutError` for an index outside either side's slots.
        """
        self._check_index(self.src, src_index, "source")
        self._check_index(self.dst, dst_index, "destination")
        if self.length.size == 0:
            return Descriptors.empty()
        src = self.s_base + U64(src_index) * self.s_slot
        dst = self.d_base + U64(dst_index) * self.d_slot
        return Descriptors(src, dst, self.length.copy(), (src, src + self.length, dst,
                           dst + self.length), (self.s_ids, self.d_ids))

    def expected(self, dst_index: int) -> tuple[Addrs, Addrs]:
        """``(dst, length)`` uint64 ``[K]``: the decode bytes this source must write for
        slot ``dst_index``, each inside that slot of its buffer (disjoint: distinct
        buffers, which do not overlap)."""
        return self.d_base + U64(dst_index) * self.d_slot, self.length

    @cached_property
    def _names(self) -> list[str]:
        return [f"layer {self.dst.buffers[int(i) - STATE_ID_BASE].layer} state "
                f"{self.dst.buffers[int(i) - STATE_ID_BASE].kind!r}" for i in self.d_ids]

    def prove(self, desc: Descriptors, dst_index: int, what: str = "plan") -> None:
        """Prove ``desc`` writes exactly this source's share of decode slot ``dst_index``:
        every such byte once, nothing outside it. Raises :class:`PlanRefused` naming the
        first uncovered, doubled or outside range as layer, state kind and offset."""
        e_dst, e_len = self.expected(dst_index)
        if np.array_equal(desc.dst, e_dst) and np.array_equal(desc.length, e_len):
            return
        diff = interval_diff(desc.dst, desc.length, e_dst, e_len)
        if diff is None:
            return
        kind, lo, hi = diff
        raise PlanRefused(f"{what}: state plan refused: destination bytes [{lo:#x}, "
                          f"+{hi - lo}) ({self._where(lo, dst_index)}) is {kind}", kind, lo, hi)

    def _where(self, addr: int, dst_index: int) -> str:
        for i, b in enumerate(self.dst.buffers):
            lo, hi = self.dst.slot_range(i, dst_index)
            if lo <= addr < hi:
                return f"layer {b.layer} state {b.kind!r} slot {dst_index}, offset {addr - lo}"
        return f"{addr:#x}, outside the room's state slot {dst_index}"


def check_window_pages(layout: StateLayout, page_size: int, src_pages: np.ndarray,
                       dst_pages: np.ndarray, dst_page_size: int | None = None) -> None:
    """Refuse a room's window pages (int64 ``[P]`` each) that could not be a window: more
    than :meth:`StateLayout.max_window_pages` on either side (``page_size`` the prefill's,
    ``dst_page_size`` the decode's; None: the same), or, with equal page sizes, the two
    lists differing in length. Raises :class:`PlanRefused` (``outside``): window pages
    only."""
    pd = page_size if dst_page_size is None else dst_page_size
    if pd == page_size and src_pages.size != dst_pages.size:
        raise PlanRefused(f"window pages: {src_pages.size} source vs {dst_pages.size} "
                          f"destination", "outside")
    for side, pages, size in (("destination", dst_pages, pd), ("source", src_pages, page_size)):
        most = layout.max_window_pages(size)
        if pages.size > most:
            raise PlanRefused(f"window pages: {pages.size} {side} pages named, but a window "
                              f"of {layout.window_tokens} tokens at page size {size} touches "
                              f"at most {most}", "outside")


@dataclass(frozen=True)
class WindowChunk:
    """What a re-tiled room's window moves (:func:`window_chunk`): room tokens ``tokens``
    from the window pages ``src``/``dst`` (int64), whose first pages are room pages
    ``src_first``/``dst_first`` (in each side's pages)."""

    src: np.ndarray
    dst: np.ndarray
    tokens: tuple[int, int]
    src_first: int
    dst_first: int


def window_chunk(window: PairPlan, src_pages: np.ndarray, dst_pages: np.ndarray,
                 room_end: int, window_tokens: int = 0) -> WindowChunk:
    """The window of a room of ``room_end`` tokens between two page sizes, in tokens. A
    side's window pages are the tail of its room pages: the last of ``n`` window pages
    holds the room's last page ``ceil(T / P) - 1``, the first room page ``ceil(T / P) -
    n``. The tokens both lists hold move, ``[max(first_s * Ps, first_d * Pd), T)``: the
    window each engine kept (the decode's pages before the prefill's first window page
    hold tokens the prefill no longer has, outside the window, and are not written).

    Raises :class:`PlanRefused` (``outside``) when a list is longer than the room has
    pages, and (``uncovered``) when a side's list starts after token ``T - W`` (``W``:
    ``window_tokens``; 0: unchecked): the decode would read Success with window tokens
    [first, T - W .. first) of its own window pages never written (fail-open). ``T`` is
    the room's last write's end, at least the request's token count, so an engine whose
    pages hold its last ``W`` tokens always passes."""
    ps, pd = window.src.page_size, window.dst.page_size
    firsts = []
    for side, pages, size in (("source", src_pages, ps), ("destination", dst_pages, pd)):
        n_room = -(-room_end // size)
        if pages.size > n_room:
            raise PlanRefused(f"window pages: {pages.size} {side} pages named, but the "
                              f"room's {room_end} tokens fill {n_room} pages of {size}",
                              "outside")
        firsts.append(n_room - int(pages.size))
    need = max(0, room_end - window_tokens)
    for side, first, size in (("source", firsts[0], ps), ("destination", firsts[1], pd)):
        if window_tokens and first * size > need:
            raise PlanRefused(f"window pages: the {side}'s window pages start at room token "
                              f"{first * size}, but a window of {window_tokens} tokens of a "
                              f"room of {room_end} tokens starts by token {need}: tokens "
                              f"[{need}, {first * size}) of the window would not move",
                              "uncovered")
    lo = min(max(firsts[0] * ps, firsts[1] * pd), room_end)
    a, b = lo // ps, lo // pd
    return WindowChunk(src_pages[max(a - firsts[0], 0):], dst_pages[max(b - firsts[1], 0):],
                       (lo, room_end), a, b)


def prove_state_sources_tile(dst: StateLayout, sources: list[StateLayout]) -> None:
    """Prove the prefill ``sources`` (every TP rank and PP stage routing names for decode
    rank ``dst``) write each head of each of ``dst``'s state buffers exactly once -- the
    all-sources half of the state proof (one count per (buffer, head), a loop per source
    and buffer, never per byte).

    Raises :class:`PlanRefused` (``uncovered`` or ``doubled``) naming layer, kind, head.
    """
    index = {b.key: i for i, b in enumerate(dst.buffers)}
    counts = [np.zeros(b.heads, dtype=np.int64) for b in dst.buffers]
    for src in sources:
        for b in src.buffers:
            j = index.get(b.key)
            if j is None:
                continue
            _, d_off, n = state_share(src, dst, b.total_heads)
            counts[j][d_off:d_off + n] += 1
    for j, c in enumerate(counts):
        bad = np.flatnonzero(c != 1)
        if bad.size:
            b, h = dst.buffers[j], int(bad[0])
            kind = "uncovered" if c[h] == 0 else "doubled"
            first = rank_heads(dst.tp_rank, dst.tp_size, b.total_heads)[0]
            raise PlanRefused(f"state plan refused: decode layer {b.layer} state {b.kind!r} "
                              f"head {first + h} is written by {int(c[h])} prefill sources, "
                              f"not 1", kind)


def _shift_ids(desc: Descriptors, src_base: int, dst_base: int) -> Descriptors:
    """``desc`` with its span buffer ids moved into the state id range (window buffers
    follow a rank's state buffers: ``STATE_ID_BASE + len(buffers) + b``)."""
    if desc.span_bufs is None:
        return desc
    s, d = desc.span_bufs
    return Descriptors(desc.src, desc.dst, desc.length, desc.spans,
                       (s + src_base, d + dst_base))


def plan_room_state(pair: StatePairPlan, src_index: int, dst_index: int,
                    src_window: np.ndarray, dst_window: np.ndarray,
                    what: str = "plan", room_end: int | None = None) -> Descriptors:
    """Everything of a room's hybrid caches this source writes, proved: its head slice of
    every state buffer from slot ``src_index`` into slot ``dst_index`` (:meth:`StatePairPlan.
    prove`), then its share of the window pages ``src_window`` -> ``dst_window`` (int64
    ``[P]`` each; :func:`check_window_pages`, then the window pools' ``PairPlan.plan_chunk``,
    the path every paged kind takes): page by page when ``room_end`` is None (equal page
    sizes), else the room's window tokens re-tiled (:func:`window_chunk`, ``room_end``: the
    room's token count ``T``). Buffer ids are the ranks' region ids (state buffers from
    :data:`STATE_ID_BASE`, window buffers after them).

    Raises :class:`LayoutError` when a room of a pair with state buffers names no state
    index on a side, or with window layers names window pages on neither side while the
    other does; :class:`PlanRefused` as the proofs.
    """
    out = Descriptors.empty()
    if pair.src.buffers or pair.dst.buffers:
        if src_index < 0 or dst_index < 0:
            raise LayoutError(f"{what}: the model has state layers but the room names no "
                              f"state index (prefill {src_index}, decode {dst_index})")
        out = pair.plan(src_index, dst_index)
        pair.prove(out, dst_index, what)
    if pair.window is None:
        return out
    w = pair.window
    check_window_pages(pair.src, w.src.page_size, src_window, dst_window,
                       None if room_end is None else w.dst.page_size)
    if room_end is None:
        win = w.plan_chunk(src_window, dst_window, what=f"{what}, window pages")
    else:
        c = window_chunk(w, src_window, dst_window, room_end, pair.src.window_tokens)
        win = w.plan_chunk(c.src, c.dst, c.tokens, c.src_first, c.dst_first,
                           what=f"{what}, window pages")
    return out.concat(_shift_ids(win, STATE_ID_BASE + len(pair.src.buffers),
                                 STATE_ID_BASE + len(pair.dst.buffers)))
