"""Extra paged cache groups -> transfer descriptors (issue 22 items 1 and 2). PURE.

Besides its main paged KV a rank may keep more paged caches that follow the same page
table: a speculative-decoding draft model's KV (SGLang's ``draft_token_to_kv_pool``,
whose indices are always the target's), an indexer's K cache (DeepSeek V3.2). Each is a
*group* (:class:`~kvd.protocol.control.GroupSpec`): its own buffers, bytes per page,
layers (numbered from 0 in the group), heads and head size, NHD or HND, head-sliced over
attention TP like the main KV or ``replicated`` (every rank holds the whole cache, one
buffer per layer, MLA-like). A room's pages name the same page of every group as of the
main KV, so a chunk moves its pages of every group too.

A group is a :class:`~kvd.transfer.layout.RankLayout` of its own, so geometry, TP
resharding, re-tiling (different page sizes, in tokens) and the per-source proof are
:class:`~kvd.transfer.layout.PairPlan`'s. What is new here:

* pairing by name (:func:`pair_groups`): a group on one side only, or shaped differently,
  is refused with one reason naming it;
* a replicated group is written by one source per decode rank, the lowest-ranked prefill
  rank routing names for it (:func:`~kvd.transfer.layout.prefill_targets`), so a decode
  byte fed by several replicas is written once -- the MLA rule, where the other sources
  are dummies;
* buffer ids: group buffers are region ids from :data:`GROUP_ID_BASE`, every group's after
  the previous group's, so each descriptor is bounds-checked against the one buffer it was
  planned for;
* the all-sources half (:func:`prove_group_sources_tile`): per group, every (layer, decode
  head) written once by the sources routing names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from kvd.errors import RegistrationError
from kvd.protocol.control import KVArgsWire
from kvd.transfer.layout import (
    PairPlan,
    RankLayout,
    check_coverage,
    prefill_targets,
    prove_sources_tile,
)
from kvd.transfer.plan import U64, Addrs, Descriptors, PlanRefused

#: Buffer id of a rank's first group buffer in its :class:`~kvd.transfer.plan.Regions`
#: (KV ``0..``, aux ``-1, -2, ..``, state from ``STATE_ID_BASE`` = 2**20).
GROUP_ID_BASE = 1 << 21


@dataclass(frozen=True)
class GroupLayout:
    """One rank's group ``name``: its :class:`~kvd.transfer.layout.RankLayout` (``is_mla``
    for a replicated group) and ``id_base``, the region id of its buffer 0."""

    name: str
    layout: RankLayout
    id_base: int

    @property
    def replicated(self) -> bool:
        """Does every TP rank hold the whole cache?"""
        return self.layout.is_mla


def group_memory(wire: KVArgsWire) -> tuple[Addrs, Addrs]:
    """``(ptrs, lens)`` uint64 of every group's buffers, in group order (ids from
    :data:`GROUP_ID_BASE`). Raises :class:`RegistrationError` when a group's lists differ in
    length from its item lengths."""
    for g in wire.groups:
        if not len(g.ptrs) == len(g.lens) == len(g.spec.item_lens):
            raise RegistrationError(f"invalid KV args: paged cache group {g.spec.name!r} has "
                                    f"{len(g.ptrs)} pointers, {len(g.lens)} lengths and "
                                    f"{len(g.spec.item_lens)} item lengths")
    ptrs = [p for g in wire.groups for p in g.ptrs]
    lens = [n for g in wire.groups for n in g.lens]
    return np.array(ptrs, dtype=U64), np.array(lens, dtype=U64)


def group_layouts(wire: KVArgsWire, tp_rank: int, tp_size: int) -> tuple[GroupLayout, ...]:
    """The groups of the rank that sent ``wire`` at attention TP ``tp_rank``/``tp_size``
    (page size: the rank's). ``total_kv_heads`` 0 means ``num_kv_heads * tp_size`` (a
    replicated group: ``num_kv_heads``). Raises :class:`RegistrationError` naming the group
    for a structurally invalid one (as ``RankLayout``), a name used twice, or a group
    buffer that holds fewer pages than the main KV (a room page must name a page of every
    group)."""
    out: list[GroupLayout] = []
    base = GROUP_ID_BASE
    kv_pages = min((n // i for n, i in zip(wire.kv_data_lens, wire.kv_item_lens, strict=False)
                    if i > 0), default=0)
    for g in wire.groups:
        s = g.spec
        if any(x.name == s.name for x in out):
            raise RegistrationError(f"paged cache group {s.name!r} registered twice")
        total = s.total_kv_heads or (s.num_kv_heads if s.replicated
                                     else s.num_kv_heads * tp_size)
        try:
            lay = RankLayout(kv_ptrs=np.asarray(g.ptrs, dtype=U64),
                             item_lens=np.asarray(s.item_lens, dtype=U64),
                             page_size=wire.page_size, num_kv_heads=s.num_kv_heads,
                             total_kv_heads=total, head_dim=s.head_dim,
                             dtype_size=s.dtype_size, num_layers=s.num_layers,
                             layer_start=s.layer_start, is_mla=s.replicated, layout=s.layout,
                             tp_rank=tp_rank, tp_size=tp_size, fused_kv=s.fused_kv)
        except RegistrationError as exc:
            raise RegistrationError(f"paged cache group {s.name!r}: {exc}") from exc
        short = [b for b, (n, i) in enumerate(zip(g.lens, s.item_lens, strict=False))
                 if i > 0 and n // i < kv_pages]
        if short:
            b = short[0]
            raise RegistrationError(f"paged cache group {s.name!r} buffer {b} holds "
                                    f"{g.lens[b] // s.item_lens[b]} pages, the main KV "
                                    f"{kv_pages} (the room's pages index both)")
        out.append(GroupLayout(s.name, lay, base))
        base += len(s.item_lens)
    return tuple(out)


def writes_group(src: RankLayout, dst: RankLayout) -> bool:
    """Does source ``src`` write its share of group layout ``dst``? Head-sliced groups:
    whenever they share heads (:class:`PairPlan`); replicated: only the lowest-ranked
    prefill rank routing names for ``dst``'s rank."""
    if not src.is_mla:
        return True
    return src.tp_rank == prefill_targets(dst.tp_rank, dst.tp_size, src.tp_size).start


@dataclass(frozen=True)
class GroupPairPlan:
    """One group of a (prefill, decode) pair: ``pair`` its planning constants, ``writes``
    whether this source writes it (:func:`writes_group`), ``s_base``/``d_base`` the id of
    buffer 0 on each side."""

    name: str
    pair: PairPlan
    writes: bool
    s_base: int
    d_base: int


def pair_groups(src: tuple[GroupLayout, ...], dst: tuple[GroupLayout, ...], pp_rank: int = 0,
                pp_size: int = 1, src_dummy: bool = False) -> tuple[GroupPairPlan, ...]:
    """Pair the prefill's groups ``src`` with the decode's ``dst`` by name, refusing with ONE
    reason (the first of): a prefill group the decode lacks; a decode group no prefill
    stage holds (``pp_size`` 1: this stage is all of them; with more stages another may
    hold it); a pair ``PairPlan.of`` refuses (item lengths, heads, layout, replication,
    layers -- re-tiling allowed) or whose stage edges leave decode layers unwritten
    (:func:`~kvd.transfer.layout.check_coverage`); a head-sliced group this source would
    owe while it is an MLA dummy for the decode rank (``src_dummy``: it is sent no pages).

    Raises :class:`RegistrationError` ``"paged cache groups (prefill vs decode): ..."``.
    """
    theirs = {g.name: g for g in dst}
    mine = {g.name for g in src}
    out = []
    for g in src:
        d = theirs.get(g.name)
        if d is None:
            _refuse(f"group {g.name!r} only on the prefill (the decode registers "
                    f"{sorted(theirs) or 'none'})")
        try:
            pair = PairPlan.of(g.layout, d.layout, retile=True)
            check_coverage(g.layout, d.layout, pp_rank, pp_size)
        except RegistrationError as exc:
            _refuse(f"group {g.name!r}: {exc}")
        writes = writes_group(g.layout, d.layout)
        if src_dummy and writes and pair.n_heads:
            _refuse(f"group {g.name!r} is head-sliced, but this prefill rank is an MLA dummy "
                    f"for decode rank {d.layout.tp_rank} (it is sent no pages)")
        out.append(GroupPairPlan(g.name, pair, writes and not src_dummy, g.id_base,
                                 d.id_base))
    missing = [n for n in theirs if n not in mine]
    if missing and pp_size == 1:
        _refuse(f"group {missing[0]!r} only on the decode (the prefill registers "
                f"{sorted(mine) or 'none'})")
    return tuple(out)


def _refuse(why: str) -> NoReturn:
    raise RegistrationError(f"paged cache groups (prefill vs decode): {why}")


def _shift(desc: Descriptors, s_base: int, d_base: int) -> Descriptors:
    if desc.span_bufs is None:
        return desc
    s, d = desc.span_bufs
    return Descriptors(desc.src, desc.dst, desc.length, desc.spans, (s + s_base, d + d_base))


def plan_room_groups(plans: tuple[GroupPairPlan, ...], src_pages: np.ndarray,
                     dst_pages: np.ndarray, tokens: tuple[int, int] | None = None,
                     src_first: int = 0, dst_first: int = 0,
                     what: str = "plan") -> Descriptors:
    """Every group's share of one chunk this source writes, proved: the chunk's pages
    ``src_pages`` -> ``dst_pages`` (int64 ``[P]``; page path), or with ``tokens = (lo, hi)``
    the room's tokens re-tiled (``src_first``/``dst_first`` are the first room page of
    each list). Each group is planned and proved on its own by the path every paged kind
    takes (:meth:`PairPlan.plan_chunk`, the failure naming the group), its buffer ids moved to the
    ranks' region ids. Raises :class:`PlanRefused` and :class:`~kvd.errors.LayoutError` as
    those."""
    out = Descriptors.empty()
    for g in plans:
        if not g.writes:
            continue
        desc = g.pair.plan_chunk(src_pages, dst_pages, tokens, src_first, dst_first,
                                 what=f"{what}, group {g.name!r}")
        out = out.concat(_shift(desc, g.s_base, g.d_base))
    return out


def prove_group_sources_tile(dst: tuple[GroupLayout, ...],
                             sources: list[tuple[GroupLayout, ...]]) -> None:
    """Prove the prefill ``sources`` (the groups of every TP rank and PP stage routing names
    for the decode rank) write each (layer, decode head) of each of ``dst``'s groups exactly
    once: :func:`~kvd.transfer.layout.prove_sources_tile` per group, a replicated group's
    non-writing replicas as dummies. Raises :class:`PlanRefused` naming the group."""
    for d in dst:
        held = [g.layout for src in sources for g in src if g.name == d.name]
        dummies = [not writes_group(s, d.layout) for s in held]
        try:
            prove_sources_tile(d.layout, held, dummies)
        except PlanRefused as exc:
            raise PlanRefused(f"group {d.name!r}: {exc}", exc.kind) from exc
