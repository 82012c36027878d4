"""SGLang ``KVArgs`` -> kvd ``RegisterKV``. PURE (no SGLang import: duck-typed ``args``).

SGLang describes a rank's KV pool by raw pointers (``kv_data_ptrs``/``_lens``/
``_item_lens``: MHA K buffers of every local layer, then V buffers; MLA one buffer per
layer) plus aux (metadata) buffers. Every pointer must lie in a SHARED mapping of a file
(:mod:`kvd.adapters.shmmaps`): a live file under ``/dev/shm`` is named (``shm`` handle),
any other (a memfd, an unlinked file) is passed as a descriptor (``fd`` handle, given
``fds``); anonymous memory cannot be shared and is refused. ``page_size``,
``kv_head_num``, ``total_kv_head_num``, ``kv_layout`` ("nhd"/"hnd") and
``prefill_start_layer`` carry over; the element size comes from ``kv_cache_dtype_str``
and ``head_dim`` from the item length.

State (SGLang's ``state_types`` components, each a list of buffers) maps onto kvd's hybrid
caches (docs/transfer.md, "State slots and window pages" and "Extra paged caches"):

* ``mamba``: each buffer is one (tensor, layer) of the Mamba pool, an array of per-request
  slots of ``state_item_lens`` bytes; it becomes one kvd state buffer of that layer
  (``state_layer_ids``), kind ``mamba<j>`` for the layer's ``j``-th tensor (conv, then
  temporal). Attention TP splits a slot head-major when SGLang's metadata says so (a
  ``state_dim_per_tensor`` of ``d`` rows, no rows before the split axis, no independently
  sharded sub-blocks): ``heads = d`` of ``d * attn_tp_size``, so kvd reshards between
  TP sizes as SGLang's ``_send_mamba_state_slice`` does. A dim of 0 (SGLang's mark of
  state replicated over attention TP) is one replicated head. Any other buffer (a GDN
  conv state, ``state_conv_shard_groups`` sub-blocks sharded on their own; a channel axis
  after other rows, ``state_slice_outer_counts``) is a whole slot per rank: one head of
  ``attn_tp_size``, so it moves at equal TP and kvd's pairing refuses unequal TP
  (:attr:`SglState.whole_slots` names why, and the decode adapter refuses the room with
  it). Layer types come from ``kv_layer_ids`` (full) and ``state_layer_ids`` (state).
* ``swa``: the SWA pool (K buffers of its layers, then V; ``swa_kv_cache_layout``) is
  kvd's window pool, its heads the KV's ``kv_head_num``, with ``window_tokens`` the model's
  sliding window (given by the caller: ``KVArgs`` does not carry it). SGLang names no
  layer ids for it: the layer types are the full layers, then the window layers, the
  same on every rank of the model (only their counts and order within a kind matter).
* ``dsa``: the indexer K cache, one buffer per layer paged like the KV (a room sends the
  room's KV pages for it), is the ``indexer`` extra paged cache, replicated over TP.

Refused at registration, naming what: draft KV buffers (speculative decoding), any other
state type (``dsa_tail``, ``block_scale``, ``swa_ring``...), state with pipeline
parallelism (``KVArgs`` names only this stage's layers), geometry that does not divide,
and device (GPU) pointers. :func:`room_state` turns a room's ``state_indices`` into kvd's
``state_index`` and ``window_pages``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.adapters.shmmaps import Mapping, NotSharedMemory, handle_for, handle_or_fd
from kvd.protocol.control import GroupSpec, LayerType, StateBufSpec, StateSpec, WindowSpec
from kvd.protocol.memory import MemoryHandle
from kvd.protocol.rpc import EngineRanks, RegisterKV

DTYPE_SIZES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
               "half": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "fp8": 1, "int8": 1, "uint8": 1}


class KVArgsError(ValueError):
    """SGLang KV args that kvd cannot register."""


def dtype_size(name: str | None) -> int:
    """Bytes per element of SGLang's ``kv_cache_dtype_str`` (``"bfloat16"``,
    ``"torch.float16"``, ``"fp8_e4m3"``...). KVArgsError for an unknown name."""
    key = (name or "").removeprefix("torch.").lower()
    if key not in DTYPE_SIZES:
        raise KVArgsError(f"unknown KV cache dtype {name!r}")
    return DTYPE_SIZES[key]


def _handles(ptrs: list[int], lens: list[int], maps: list[Mapping], shm_dir: str,
             what: str, fds: dict[str, int] | None) -> list[MemoryHandle]:
    try:
        if fds is None:
            return [handle_for(int(p), int(n), maps, shm_dir)
                    for p, n in zip(ptrs, lens, strict=True)]
        return [handle_or_fd(int(p), int(n), maps, fds, shm_dir)
                for p, n in zip(ptrs, lens, strict=True)]
    except NotSharedMemory as exc:
        raise KVArgsError(f"{what}: {exc}") from exc
    except ValueError as exc:
        raise KVArgsError(f"{what}: pointer and length lists differ in length") from exc


def _type_name(t: Any) -> str:
    return str(getattr(t, "value", t))


def state_kinds(args: Any) -> list[str]:
    """The kinds of the state components ``args`` registers buffers for (SGLang 0.5.2x:
    ``state_types`` beside ``state_data_ptrs``, one list of buffers per component; older
    versions: one flat list), e.g. ``["mamba", "swa"]``; ``"state"`` where no type is
    named."""
    ptrs = list(getattr(args, "state_data_ptrs", None) or [])
    types = list(getattr(args, "state_types", None) or [])
    nested = any(isinstance(p, list | tuple) for p in ptrs)
    comps = ptrs if nested else ([ptrs] if any(ptrs) else [])
    kinds = []
    for i, comp in enumerate(comps):
        if any(comp):
            kinds.append(_type_name(types[i]) if i < len(types) else "state")
    return kinds


#: The ``state_types`` this adapter maps onto kvd (everything else is refused by name).
SERVED_STATE_TYPES = ("mamba", "swa", "dsa")
#: ``StateBufSpec.dtype`` of SGLang's state buffers: ``KVArgs`` names no state dtype, so a
#: slot is opaque bytes (its size still pairs: ``head_bytes``).
OPAQUE = "bytes"


@dataclass(frozen=True)
class SglState:
    """SGLang's state components as kvd's hybrid caches (:func:`sglang_state`).

    ``spec``/``ptrs``/``lens``: the :class:`StateSpec` (None: no Mamba or SWA state) and
    the memory of its state buffers, then of its window pool (addresses, bytes).
    ``group``/``group_ptrs``/``group_lens``: the ``indexer`` extra paged cache (DSA), or
    None. ``types``: ``state_types`` in SGLang's order (a room's ``state_indices`` are
    parallel to it). ``whole_slots``: one reason per Mamba buffer kvd moves only as a
    whole slot per rank (equal attention TP only), e.g. ``"layer 1 mamba0 (conv
    sub-blocks [8, 8, 16] sharded separately)"``."""

    spec: StateSpec | None = None
    ptrs: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    group: GroupSpec | None = None
    group_ptrs: list[int] = field(default_factory=list)
    group_lens: list[int] = field(default_factory=list)
    types: tuple[str, ...] = ()
    whole_slots: tuple[str, ...] = ()

    def tp_refusal(self, prefill_tp: int, decode_tp: int) -> str | None:
        """Why a prefill of attention TP ``prefill_tp`` cannot feed a decode of
        ``decode_tp`` with this state (None: it can)."""
        if prefill_tp == decode_tp or not self.whole_slots:
            return None
        more = f" and {len(self.whole_slots) - 1} more" if len(self.whole_slots) > 1 else ""
        return (f"SGLang Mamba state buffer {self.whole_slots[0]}{more} cannot be resharded "
                f"between attention TP {prefill_tp} (prefill) and {decode_tp} (decode): kvd "
                f"moves it as a whole slot per rank, so both sides need the same TP")


def _component(args: Any, name: str, i: int) -> list[Any]:
    lists = list(getattr(args, name, None) or [])
    return list(lists[i] or []) if i < len(lists) else []


def _mamba_buffer(layer: int, tensor: int, item: int, dim: int | None, outer: int,
                  groups: list[int] | None, tp_size: int) -> tuple[StateBufSpec, str | None]:
    """One Mamba (tensor, layer) buffer as a kvd state buffer, and why it is a whole slot
    per rank (None: resharded by heads or replicated)."""
    kind = f"mamba{tensor}"
    whole = StateBufSpec(layer=layer, kind=kind, slot_bytes=item, dtype=OPAQUE, heads=1,
                         total_heads=tp_size)
    if dim is None:
        return whole, f"layer {layer} {kind} (no state_dim_per_tensor)"
    if dim == 0:  # SGLang: replicated over attention TP
        return StateBufSpec(layer=layer, kind=kind, slot_bytes=item, dtype=OPAQUE, heads=1,
                            total_heads=1), None
    if outer != 1:
        return whole, f"layer {layer} {kind} ({outer} rows before the TP-split axis)"
    if groups is not None and len(groups) > 1 and sum(groups) == dim * tp_size:
        return whole, (f"layer {layer} {kind} (conv sub-blocks {list(groups)} sharded "
                       f"separately)")
    if item % dim:
        raise KVArgsError(f"mamba state layer {layer} tensor {tensor}: item length {item} "
                          f"does not split into {dim} rows")
    return StateBufSpec(layer=layer, kind=kind, slot_bytes=item, dtype=OPAQUE, heads=dim,
                        total_heads=dim * tp_size), None


def _mamba(args: Any, i: int, full_layers: list[int], tp_size: int
           ) -> tuple[list[LayerType], list[StateBufSpec], list[str]]:
    ptrs, items = _component(args, "state_data_ptrs", i), _component(args, "state_item_lens", i)
    layers = [int(x) for x in _component(args, "state_layer_ids", i)]
    dims = _component(args, "state_dim_per_tensor", i)
    outers = _component(args, "state_slice_outer_counts", i)
    groups = _component(args, "state_conv_shard_groups", i)
    if len(layers) != len(ptrs) or len(items) != len(ptrs):
        raise KVArgsError(f"mamba state: {len(ptrs)} buffers but {len(layers)} layer ids and "
                          f"{len(items)} item lengths")
    if dims and len(dims) != len(ptrs):
        raise KVArgsError(f"mamba state: {len(ptrs)} buffers but {len(dims)} "
                          f"state_dim_per_tensor entries")
    both = sorted(set(full_layers) & set(layers))
    if both:
        raise KVArgsError(f"layer {both[0]} has both full-attention KV and mamba state")
    n = max([*full_layers, *layers]) + 1
    missing = sorted(set(range(n)) - set(full_layers) - set(layers))
    if missing:
        raise KVArgsError(f"layer {missing[0]} has neither full-attention KV nor mamba state "
                          f"(kv_layer_ids, state_layer_ids)")
    kinds = set(layers)
    types: list[LayerType] = ["state" if x in kinds else "full" for x in range(n)]
    seen: dict[int, int] = {}
    bufs, whole = [], []
    for e, (layer, item) in enumerate(zip(layers, items, strict=True)):
        tensor = seen.get(layer, 0)
        seen[layer] = tensor + 1
        g = groups[e] if e < len(groups) else None
        buf, why = _mamba_buffer(layer, tensor, int(item), int(dims[e]) if dims else None,
                                 int(outers[e]) if e < len(outers) and outers[e] else 1,
                                 list(g) if g else None, tp_size)
        bufs.append(buf)
        if why:
            whole.append(why)
    return types, bufs, whole


def _swa(args: Any, i: int, page_size: int, heads: int, total_heads: int, size: int
         ) -> WindowSpec:
    ptrs, items = _component(args, "state_data_ptrs", i), _component(args, "state_item_lens", i)
    if not ptrs or len(ptrs) % 2 or len(items) != len(ptrs):
        raise KVArgsError(f"swa state: {len(ptrs)} buffers ({len(items)} item lengths) do "
                          f"not make K and V of whole window layers")
    layout = (getattr(args, "swa_kv_cache_layout", None) or "nhd").upper()
    if layout not in ("NHD", "HND"):
        raise KVArgsError(f"swa state: SWA pool layout {layout.lower()!r} is not one kvd "
                          f"plans (nhd, hnd)")
    head_dim, rest = divmod(int(items[0]), page_size * heads * size)
    if rest or head_dim < 1 or any(int(n) != int(items[0]) for n in items):
        raise KVArgsError(f"swa state: item lengths {sorted(set(map(int, items)))} are not "
                          f"page_size {page_size} x {heads} heads x dtype {size} B x head_dim")
    return WindowSpec(item_lens=[int(n) for n in items], num_layers=len(ptrs) // 2,
                      num_kv_heads=heads, head_dim=head_dim, dtype_size=size,
                      total_kv_heads=total_heads, layout=layout)


def _dsa(args: Any, i: int, page_size: int) -> GroupSpec:
    ptrs, items = _component(args, "state_data_ptrs", i), _component(args, "state_item_lens", i)
    if not ptrs or len(items) != len(ptrs) or any(int(n) != int(items[0]) for n in items):
        raise KVArgsError(f"dsa state: {len(ptrs)} indexer buffers with item lengths "
                          f"{sorted(set(map(int, items)))} (kvd needs one length)")
    head_dim, rest = divmod(int(items[0]), page_size)
    if rest or head_dim < 1:
        raise KVArgsError(f"dsa state: item length {items[0]} is not whole bytes per token "
                          f"of page_size {page_size}")
    return GroupSpec(name="indexer", item_lens=[int(n) for n in items], num_layers=len(ptrs),
                     num_kv_heads=1, head_dim=head_dim, dtype_size=1, total_kv_heads=1,
                     replicated=True)


def sglang_state(args: Any, full_layers: list[int], num_full_layers: int, page_size: int,
                 heads: int, total_heads: int, size: int, ranks: EngineRanks | None,
                 window_tokens: int | None) -> SglState:
    """SGLang's state components of ``args`` as kvd state buffers, a window pool and an
    indexer group (:class:`SglState`). ``full_layers``: the full-attention layers' model
    ids (``kv_layer_ids``), ``num_full_layers`` the paged KV's layers; ``page_size``,
    ``heads``/``total_heads`` (KV heads of this rank / the model), ``size`` (dtype bytes)
    of the paged KV; ``ranks``: the rank's attention TP (needed for state);
    ``window_tokens``: the model's sliding window in tokens (needed for ``swa``).

    Raises KVArgsError naming the first component or buffer kvd cannot serve."""
    kinds = state_kinds(args)
    if not kinds:
        return SglState()
    if not any(isinstance(p, list | tuple) for p in getattr(args, "state_data_ptrs", [])):
        raise KVArgsError("state buffers (state: a flat state_data_ptrs without "
                          "state_types) are not a layout this adapter knows")
    other = [k for k in kinds if k not in SERVED_STATE_TYPES]
    if other:
        raise KVArgsError(f"state buffers of type {', '.join(other)} (the adapter serves "
                          f"{', '.join(SERVED_STATE_TYPES)})")
    if len(set(kinds)) != len(kinds) or {"mamba", "swa"} <= set(kinds):
        raise KVArgsError(f"state components {', '.join(kinds)}: one of each, and mamba "
                          f"and swa not together")
    if ranks is None:
        raise KVArgsError("state buffers need the rank's attention TP, and SGLang did not "
                          "publish its parallel context")
    if ranks.pp_size > 1 or int(getattr(args, "prefill_start_layer", 0) or 0):
        raise KVArgsError("state buffers with pipeline parallelism (KVArgs names only this "
                          "stage's layers, not every layer's type)")
    types = tuple(_type_name(t) for t in getattr(args, "state_types", []))
    tp_size = ranks.attn_tp_size
    out = SglState(types=types)
    spec_bufs: list[StateBufSpec] = []
    layer_types: list[LayerType] = []
    window: WindowSpec | None = None
    ptrs: list[int] = []
    lens: list[int] = []
    whole: list[str] = []
    for i, t in enumerate(types):
        comp_ptrs = [int(p) for p in _component(args, "state_data_ptrs", i)]
        comp_lens = [int(n) for n in _component(args, "state_data_lens", i)]
        if not any(comp_ptrs):
            continue
        if len(comp_lens) != len(comp_ptrs):
            raise KVArgsError(f"{t} state: {len(comp_ptrs)} pointers, {len(comp_lens)} lengths")
        if t == "mamba":
            uniq = list(dict.fromkeys(int(x) for x in full_layers))
            if len(uniq) != num_full_layers:
                raise KVArgsError(f"mamba state: kv_layer_ids name {len(uniq)} full-attention "
                                  f"layers, the KV pool holds {num_full_layers}")
            layer_types, spec_bufs, whole = _mamba(args, i, uniq, tp_size)
            ptrs, lens = comp_ptrs + ptrs, comp_lens + lens
        elif t == "swa":
            if not window_tokens or window_tokens < 1:
                raise KVArgsError("swa state: the model's sliding window size is unknown "
                                  "(KVArgs does not carry it; set SGLANG_KVD_WINDOW_TOKENS)")
            window = _swa(args, i, page_size, heads, total_heads, size)
            full: list[LayerType] = ["full"] * num_full_layers
            win: list[LayerType] = ["window"] * window.num_layers
            layer_types = full + win
            ptrs, lens = ptrs + comp_ptrs, lens + comp_lens
        else:
            out = SglState(group=_dsa(args, i, page_size), group_ptrs=comp_ptrs,
                           group_lens=comp_lens, types=types)
    spec = None
    if layer_types:
        spec = StateSpec(layer_types=layer_types, buffers=spec_bufs, window=window,
                         window_tokens=int(window_tokens or 0) if window else 0)
    return SglState(spec=spec, ptrs=ptrs, lens=lens, group=out.group,
                    group_ptrs=out.group_ptrs, group_lens=out.group_lens, types=types,
                    whole_slots=tuple(whole))


def room_state(types: tuple[str, ...], state_indices: list[Any] | None,
               room_pages: npt.ArrayLike | None = None) -> tuple[int, npt.NDArray[np.int64] | None]:
    """kvd's ``(state_index, window_pages)`` of a room from SGLang's ``state_indices`` (one
    entry per ``state_types``: ``[slot]`` for mamba, the window's pages for swa, the room's
    pages for dsa); ``(-1, None)`` without state. ``room_pages``: the room's KV pages on
    this side, which a dsa entry must equal (kvd moves the indexer cache on the KV pages).

    Raises KVArgsError: a mamba entry that is not one slot, a dsa entry other than the
    room's pages, an entry for a type the registration did not serve."""
    index, window = -1, None
    for i, ind in enumerate(state_indices or []):
        if ind is None or i >= len(types):
            continue
        arr = np.asarray(ind, dtype=np.int64).reshape(-1)
        t = types[i]
        if t == "mamba":
            if arr.size != 1:
                raise KVArgsError(f"mamba state: {arr.size} slot indices (one per room)")
            index = int(arr[0])
        elif t == "swa":
            window = arr
        elif t == "dsa":
            if room_pages is not None and not np.array_equal(
                    arr, np.asarray(room_pages, dtype=np.int64).reshape(-1)):
                raise KVArgsError(f"dsa state: {arr.size} indexer pages that are not the "
                                  f"room's KV pages (kvd moves the indexer cache on those)")
        elif arr.size:
            raise KVArgsError(f"state indices for {t}, which kvd does not move")
    return index, window


def registration(args: Any, is_mla: bool, maps: list[Mapping],
                 shm_dir: str = "/dev/shm", fds: dict[str, int] | None = None,
                 ranks: EngineRanks | None = None, window_tokens: int | None = None
                 ) -> RegisterKV:
    """The :class:`RegisterKV` of SGLang ``args`` (a ``KVArgs``): :func:`registration_state`
    without the state's description. Raises KVArgsError."""
    return registration_state(args, is_mla, maps, shm_dir, fds, ranks, window_tokens)[0]


def registration_state(args: Any, is_mla: bool, maps: list[Mapping],
                       shm_dir: str = "/dev/shm", fds: dict[str, int] | None = None,
                       ranks: EngineRanks | None = None, window_tokens: int | None = None
                       ) -> tuple[RegisterKV, SglState]:
    """The :class:`RegisterKV` of SGLang ``args`` (a ``KVArgs``) with its state
    (:func:`sglang_state`: ``ranks`` and ``window_tokens`` are what it needs), and that
    state's :class:`SglState` (what a room's ``state_indices`` mean). Raises KVArgsError.

    ``fds`` (a dict the caller owns): memory that is a shared file mapping without a name
    under ``shm_dir`` (a memfd, an unlinked file) is passed as a descriptor, opened into
    ``fds``; the caller keeps them open while kvd uses the memory. None: names only."""
    if int(getattr(args, "num_draft_entries", 0) or 0):
        raise KVArgsError("the SGLang adapter cannot register draft KV buffers "
                          "(speculative decoding) yet")
    ptrs, lens = list(args.kv_data_ptrs), list(args.kv_data_lens)
    items = [int(n) for n in args.kv_item_lens]
    per_layer = 1 if is_mla else 2
    if not ptrs or len(ptrs) % per_layer:
        raise KVArgsError(f"{len(ptrs)} KV buffers do not make whole layers "
                          f"({'MLA' if is_mla else 'MHA: K and V per layer'})")
    page_size = int(args.page_size)
    heads = 1 if is_mla else int(args.kv_head_num)
    size = dtype_size(getattr(args, "kv_cache_dtype_str", None))
    head_dim, rest = divmod(items[0], page_size * heads * size)
    if rest or head_dim < 1:
        raise KVArgsError(f"item length {items[0]} is not page_size {page_size} x {heads} "
                          f"heads x dtype {size} B x head_dim")
    layout = (getattr(args, "kv_layout", None) or "nhd").upper()
    if layout not in ("NHD", "HND"):
        raise KVArgsError(f"KV layout {layout.lower()!r} is not one kvd plans (nhd, hnd)")
    total = 1 if is_mla else int(getattr(args, "total_kv_head_num", 0) or heads)
    try:
        st = sglang_state(args, [int(x) for x in getattr(args, "kv_layer_ids", None) or []],
                          len(ptrs) // per_layer, page_size, heads, total, size, ranks,
                          window_tokens)
    except KVArgsError as exc:
        raise KVArgsError(f"the SGLang adapter cannot register {exc}") from exc
    return RegisterKV(
        kv_buffers=_handles(ptrs, lens, maps, shm_dir, "KV buffer", fds), kv_item_lens=items,
        aux_buffers=_handles(list(args.aux_data_ptrs), list(args.aux_data_lens), maps, shm_dir,
                             "aux buffer", fds),
        aux_item_lens=[int(n) for n in args.aux_item_lens], page_size=page_size,
        num_kv_heads=heads, head_dim=head_dim, dtype_size=size,
        num_layers=len(ptrs) // per_layer,
        layer_start=int(getattr(args, "prefill_start_layer", 0) or 0), is_mla=is_mla,
        layout=layout,
        total_kv_heads=total, state=st.spec,
        state_buffers=_handles(st.ptrs, st.lens, maps, shm_dir, "state buffer", fds),
        groups=[st.group] if st.group else [],
        group_buffers=_handles(st.group_ptrs, st.group_lens, maps, shm_dir,
                               "indexer buffer", fds)), st
