"""KV args as numpy arrays, ready for planning and bounds checks. PURE."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.errors import LayoutError, RegistrationError
from kvd.protocol.control import MAX_AUX_BUFFERS, MAX_AUX_ITEM, KVArgsWire
from kvd.transfer.groups import GROUP_ID_BASE, group_layouts, group_memory
from kvd.transfer.plan import Addrs, Regions, _u64, aux_ids
from kvd.transfer.state import STATE_ID_BASE


@dataclass(frozen=True)
class RankArgs:
    """One rank's KV args: uint64 pointers/lengths (bytes) and derived facts.

    ``num_pages`` is the number of whole pages every KV buffer holds;
    ``num_aux_slots`` the same for aux buffers; ``regions`` every registered
    buffer (KV ids ``0..``, aux ids ``-1, -2, ..``, state ids from ``STATE_ID_BASE``,
    paged cache group ids from ``GROUP_ID_BASE``), one region each, for per-buffer
    bounds checks.
    """

    wire: KVArgsWire
    kv_ptrs: Addrs
    kv_item_lens: Addrs
    aux_ptrs: Addrs
    aux_item_lens: Addrs
    num_pages: int
    num_aux_slots: int
    regions: Regions

    @staticmethod
    def of(wire: KVArgsWire) -> RankArgs:
        """Validate ``wire`` and derive arrays; raises :class:`RegistrationError`."""
        _check_lists(wire)
        try:
            kv_ptrs, kv_lens, kv_items = (_u64(x) for x in (
                wire.kv_data_ptrs, wire.kv_data_lens, wire.kv_item_lens))
            aux_ptrs, aux_lens, aux_items = (_u64(x) for x in (
                wire.aux_data_ptrs, wire.aux_data_lens, wire.aux_item_lens))
            st_ptrs, st_lens = _state_memory(wire)
            g_ptrs, g_lens = group_memory(wire)
            regions = Regions.of(np.concatenate([kv_ptrs, aux_ptrs, st_ptrs, g_ptrs]),
                                 np.concatenate([kv_lens, aux_lens, st_lens, g_lens]),
                                 np.concatenate([np.arange(kv_ptrs.size, dtype=np.int64),
                                                 aux_ids(aux_ptrs.size),
                                                 STATE_ID_BASE + np.arange(st_ptrs.size),
                                                 GROUP_ID_BASE + np.arange(g_ptrs.size)]))
        except LayoutError as exc:
            raise RegistrationError(f"invalid KV args: {exc}") from exc
        num_pages = int((kv_lens // kv_items).min()) if kv_ptrs.size else 0
        slots = int((aux_lens // aux_items).min()) if aux_ptrs.size else 0
        if kv_ptrs.size and num_pages == 0:
            raise RegistrationError("invalid KV args: a KV buffer is shorter than one page")
        if aux_ptrs.size and slots == 0:  # case S07: zero slots switched every aux check off
            b = int(np.flatnonzero(aux_lens // aux_items == 0)[0])
            raise RegistrationError(f"invalid KV args: aux buffer {b} ({int(aux_lens[b])} bytes)"
                                    f" is shorter than one aux item ({int(aux_items[b])} bytes)")
        group_layouts(wire, 0, 1)  # structure only: heads per TP rank are checked at pairing
        return RankArgs(wire, kv_ptrs, kv_items, aux_ptrs, aux_items, num_pages, slots, regions)


def check_aux_for_control(args: RankArgs) -> None:
    """A prefill with ``aux_transport = "control"`` sends each room's aux slot inside its
    ``RoomStatus`` frame, whose aux fields are bounded (case S19): at most
    :data:`~kvd.protocol.control.MAX_AUX_BUFFERS` buffers of at most
    :data:`~kvd.protocol.control.MAX_AUX_ITEM` bytes per item. A registration beyond them
    would make every room's final status a frame no decode takes, and the decode's room
    would wait for its deadline (K16's kind): it is refused here instead, naming the bound.
    Raises :class:`RegistrationError`."""
    n = int(args.aux_item_lens.size)
    if n > MAX_AUX_BUFFERS:
        raise RegistrationError(f"invalid KV args for aux_transport = \"control\": {n} aux "
                                f"buffers, at most {MAX_AUX_BUFFERS} travel in a RoomStatus "
                                f"(use aux_transport = \"mooncake\")")
    big = np.flatnonzero(args.aux_item_lens > MAX_AUX_ITEM)
    if big.size:
        b = int(big[0])
        raise RegistrationError(f"invalid KV args for aux_transport = \"control\": aux buffer "
                                f"{b}'s item is {int(args.aux_item_lens[b])} bytes, at most "
                                f"{MAX_AUX_ITEM} travel in a RoomStatus (use aux_transport = "
                                f"\"mooncake\")")


def _state_memory(w: KVArgsWire) -> tuple[Addrs, Addrs]:
    """``(ptrs, lens)`` uint64 of the state buffers then window buffers (ids from
    :data:`~kvd.transfer.state.STATE_ID_BASE`); RegistrationError when the lists do not
    match the spec (the shapes themselves are :class:`~kvd.transfer.state.StateLayout`'s)."""
    if w.state is None:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
    spec = w.state.spec
    want = len(spec.buffers) + (0 if spec.window is None else len(spec.window.item_lens))
    if not len(w.state.ptrs) == len(w.state.lens) == want:
        raise RegistrationError(f"invalid KV args: {len(w.state.ptrs)} state pointers and "
                                f"{len(w.state.lens)} lengths for {len(spec.buffers)} state "
                                f"buffers and the window pool ({want} in all)")
    return _u64(w.state.ptrs), _u64(w.state.lens)


def _check_lists(w: KVArgsWire) -> None:
    problems = []
    if not (len(w.kv_data_ptrs) == len(w.kv_data_lens) == len(w.kv_item_lens)):
        problems.append("kv_data_ptrs, kv_data_lens and kv_item_lens differ in length")
    if not (len(w.aux_data_ptrs) == len(w.aux_data_lens) == len(w.aux_item_lens)):
        problems.append("aux_data_ptrs, aux_data_lens and aux_item_lens differ in length")
    if any(n <= 0 for n in [*w.kv_item_lens, *w.aux_item_lens]):
        problems.append("item lengths must be positive")
    if any(n < 0 for n in [*w.kv_data_ptrs, *w.kv_data_lens, *w.aux_data_ptrs,
                           *w.aux_data_lens]):
        problems.append("pointers and lengths must be non-negative")
    if w.page_size < 1 or w.dtype_size < 1 or w.num_layers < 1:
        problems.append("page_size, dtype_size and num_layers must be >= 1")
    one = w.is_mla or w.fused_kv
    expected_bufs = w.num_layers * (1 if one else 2)
    if len(w.kv_data_ptrs) != expected_bufs:
        kind = "MLA" if w.is_mla else "fused-KV MHA" if w.fused_kv else "MHA"
        problems.append(f"{len(w.kv_data_ptrs)} KV buffers for {w.num_layers} layers "
                        f"({kind} needs {expected_bufs})")
    if w.is_mla and w.fused_kv:
        problems.append("fused_kv is an MHA layout (MLA has one latent buffer per layer)")
    if w.layout not in ("NHD", "HND"):
        problems.append(f"unknown layout {w.layout!r}")
    if problems:
        raise RegistrationError("invalid KV args: " + "; ".join(problems))


def check_compatible(src: RankArgs, dst: RankArgs) -> None:
    """Equal-TP compatibility of a prefill rank (src) and a decode rank (dst).

    Raises :class:`RegistrationError` naming both values (case K12) when page
    size, dtype size, head_dim, layer count, MLA-ness, or item lengths differ.
    """
    a, b = src.wire, dst.wire
    pairs = [("page_size", a.page_size, b.page_size), ("dtype_size", a.dtype_size, b.dtype_size),
             ("head_dim", a.head_dim, b.head_dim), ("is_mla", a.is_mla, b.is_mla),
             ("num_kv_heads", a.num_kv_heads, b.num_kv_heads),
             ("num_layers", a.num_layers, b.num_layers), ("layout", a.layout, b.layout),
             ("fused_kv", a.fused_kv, b.fused_kv),
             ("aux buffers", len(a.aux_item_lens), len(b.aux_item_lens))]
    problems = [f"{name} {x} vs {y}" for name, x, y in pairs if x != y]
    if not problems and a.kv_item_lens != b.kv_item_lens:
        i = next(i for i, (x, y) in enumerate(zip(a.kv_item_lens, b.kv_item_lens, strict=True))
                 if x != y)
        problems.append(f"kv item len mismatch {a.kv_item_lens[i]} vs {b.kv_item_lens[i]} "
                        f"(buffer {i})")
    if not problems and a.aux_item_lens != b.aux_item_lens:
        problems.append(f"aux item len mismatch {a.aux_item_lens} vs {b.aux_item_lens}")
    if problems:
        raise RegistrationError("incompatible KV args (prefill vs decode): " + "; ".join(problems))


def state_region_counts(wire: KVArgsWire) -> tuple[int, int]:
    """``(state slots, window pages)`` a hybrid rank registered: whole slots every state
    buffer holds, whole pages every window buffer holds (0 each without state or a window
    pool). What the decode claims per room (K42, :mod:`kvd.rooms.claims`)."""
    if wire.state is None:
        return 0, 0
    spec, lens = wire.state.spec, wire.state.lens
    n = len(spec.buffers)
    slots = min((int(m) // b.slot_bytes for b, m in zip(spec.buffers, lens, strict=False)
                 if b.slot_bytes > 0), default=0)
    items = [] if spec.window is None else spec.window.item_lens
    pages = min((int(m) // int(i) for i, m in zip(items, lens[n:], strict=False) if i > 0),
                default=0)
    return slots, pages
