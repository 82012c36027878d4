"""The SGLang backend's state mapping (pure, no SGLang): ``KVArgs`` state components ->
kvd state buffers, window pool and indexer group; a room's ``state_indices`` -> kvd's
state index and window pages; every refusal names what it refuses."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvd.adapters.sglang.kvargs import (
    KVArgsError,
    SglState,
    registration,
    registration_state,
    room_state,
)
from kvd.adapters.shmmaps import read_maps
from kvd.client import ShmPool
from kvd.errors import RegistrationError
from kvd.protocol.control import StateSpec
from kvd.protocol.rpc import EngineRanks
from kvd.transfer.state import StateBuffer, StateLayout, check_state_pair

PAGE, HEADS, HEAD_DIM, PAGES, SLOTS = 4, 2, 8, 16, 8
ITEM = PAGE * HEADS * HEAD_DIM * 2  # bfloat16
CONV_ROWS, CONV_ITEM = 8, 8 * 3 * 2  # [conv_dim / tp, kernel - 1] bfloat16
SSM_HEADS, SSM_ITEM = 2, 2 * 4 * 4 * 4  # [heads / tp, head_dim, state] float32


def _ranks(tp: int = 2, rank: int = 0, pp: int = 1) -> EngineRanks:
    return EngineRanks(attn_tp_rank=rank, attn_tp_size=tp, pp_size=pp)


def _base(pool: ShmPool, **over: Any) -> Any:
    kv = [pool.alloc(PAGES * ITEM)[0] for _ in range(4)]  # 2 full layers: K, K, V, V
    aux = pool.alloc(8 * 32)[0]
    args = SimpleNamespace(
        kv_data_ptrs=[int(b.ctypes.data) for b in kv], kv_data_lens=[b.nbytes for b in kv],
        kv_item_lens=[ITEM] * 4, kv_layer_ids=[0, 2, 0, 2], aux_data_ptrs=[int(aux.ctypes.data)],
        aux_data_lens=[aux.nbytes], aux_item_lens=[32], page_size=PAGE, kv_head_num=HEADS,
        total_kv_head_num=2 * HEADS, kv_cache_dtype_str="bfloat16", kv_layout="nhd",
        prefill_start_layer=0, num_draft_entries=0, state_types=[], state_data_ptrs=[],
        state_data_lens=[], state_item_lens=[], state_layer_ids=[], state_dim_per_tensor=[],
        state_slice_outer_counts=[], state_conv_shard_groups=[], swa_kv_cache_layout=None)
    for k, v in over.items():
        setattr(args, k, v)
    return args


def _add(args: Any, kind: str, bufs: list[np.ndarray], items: list[int], layer_ids: list[int],
         dims: list[int] | None = None, groups: list[Any] | None = None,
         outers: list[int] | None = None) -> Any:
    """Append one state component the way SGLang's ``append_state_component`` does."""
    args.state_types.append(SimpleNamespace(value=kind))
    args.state_data_ptrs.append([int(b.ctypes.data) for b in bufs])
    args.state_data_lens.append([int(b.nbytes) for b in bufs])
    args.state_item_lens.append(items)
    args.state_layer_ids.append(layer_ids)
    args.state_dim_per_tensor.append(dims or [])
    args.state_conv_shard_groups.append(groups or [])
    args.state_slice_outer_counts.append(outers or [])
    return args


def _mamba_args(pool: ShmPool, groups: list[Any] | None = None, dims: list[int] | None = None,
                outers: list[int] | None = None, ranks_per: int = 1) -> Any:
    """Layers 0 and 2 full attention, 1 and 3 Mamba: conv tensor then temporal tensor, each
    per layer (SGLang's ``get_contiguous_buf_infos``: tensor-major x layer). ``ranks_per``:
    how many TP 2 ranks' shares this rank holds (2: a TP 1 rank of the same model)."""
    items = [n * ranks_per for n in (CONV_ITEM, CONV_ITEM, SSM_ITEM, SSM_ITEM)]
    bufs = [pool.alloc(SLOTS * n)[0] for n in items]
    rows = [n * ranks_per for n in (CONV_ROWS, CONV_ROWS, SSM_HEADS, SSM_HEADS)]
    return _add(_base(pool), "mamba", bufs, items, [1, 3, 1, 3], rows if dims is None
                else dims, groups, outers)


def _layout(spec: StateSpec, tp_rank: int, tp_size: int) -> StateLayout:
    bufs = tuple(StateBuffer(b.layer, b.kind, 1 << 30, SLOTS * b.slot_bytes, b.slot_bytes,
                             b.dtype, b.heads, b.total_heads) for b in spec.buffers)
    return StateLayout(bufs, tuple(spec.layer_types), 0, len(spec.layer_types), tp_rank,
                       tp_size)


def _spec(pool: ShmPool, args: Any, ranks: EngineRanks, window: int | None = None
          ) -> tuple[StateSpec, SglState]:
    reg, st = registration_state(args, False, read_maps(), ranks=ranks, window_tokens=window)
    assert reg.state is not None and reg.state == st.spec
    assert len(reg.state_buffers) == len(st.ptrs)
    assert {h.path for h in reg.state_buffers} == {pool.path}  # shm handles, like the KV
    return reg.state, st


def test_mamba_state_becomes_state_buffers_resharded_by_heads_where_sglang_is_head_major(
) -> None:
    pool = ShmPool(1 << 18)
    try:
        spec, st = _spec(pool, _mamba_args(pool), _ranks(tp=2))
        assert spec.layer_types == ["full", "state", "full", "state"]
        got = [(b.layer, b.kind, b.slot_bytes, b.heads, b.total_heads) for b in spec.buffers]
        assert got == [(1, "mamba0", CONV_ITEM, CONV_ROWS, 2 * CONV_ROWS),
                       (3, "mamba0", CONV_ITEM, CONV_ROWS, 2 * CONV_ROWS),
                       (1, "mamba1", SSM_ITEM, SSM_HEADS, 2 * SSM_HEADS),
                       (3, "mamba1", SSM_ITEM, SSM_HEADS, 2 * SSM_HEADS)]
        assert st.whole_slots == () and st.tp_refusal(2, 4) is None
        assert st.types == ("mamba",) and st.group is None
        # kvd's own checks take it, and pair it across attention TP sizes (resharding)
        check_state_pair(_layout(spec, 0, 2), _layout(_spec(pool, _mamba_args(pool),
                                                             _ranks(tp=2, rank=1))[0], 1, 2))
        one = _mamba_args(pool, ranks_per=2)
        check_state_pair(_layout(_spec(pool, one, _ranks(tp=1))[0], 0, 1), _layout(spec, 0, 2))
    finally:
        pool.close()


def test_conv_sub_blocks_move_as_whole_slots_and_unequal_tp_is_refused_naming_the_buffer(
) -> None:
    """A GDN conv state (q, k, v sub-blocks each sharded on its own) is not head-major: it
    moves as one whole slot per rank, so equal TP pairs and unequal TP is refused, by the
    adapter with the buffer named and by kvd's pairing."""
    pool = ShmPool(1 << 18)
    try:
        groups = [[4, 4, 8], [4, 4, 8], None, None]  # sum 16 = 8 rows x TP 2: in force
        spec, st = _spec(pool, _mamba_args(pool, groups=groups), _ranks(tp=2))
        conv = [b for b in spec.buffers if b.kind == "mamba0"]
        assert [(b.heads, b.total_heads) for b in conv] == [(1, 2), (1, 2)]
        assert st.whole_slots == ("layer 1 mamba0 (conv sub-blocks [4, 4, 8] sharded "
                                  "separately)", "layer 3 mamba0 (conv sub-blocks [4, 4, 8] "
                                  "sharded separately)")
        assert st.tp_refusal(2, 2) is None
        why = st.tp_refusal(2, 1)
        assert why is not None and "layer 1 mamba0 (conv sub-blocks [4, 4, 8]" in why
        assert "and 1 more" in why and "TP 2 (prefill) and 1 (decode)" in why
        check_state_pair(_layout(spec, 0, 2), _layout(spec, 0, 2))
        one = _mamba_args(pool, groups=[[4, 4, 8]] * 2 + [None] * 2, ranks_per=2)
        spec1, _ = _spec(pool, one, _ranks(tp=1))
        with pytest.raises(RegistrationError, match="layer 1 state 'mamba0' total_heads 1 vs 2"):
            check_state_pair(_layout(spec1, 0, 1), _layout(spec, 0, 2))
    finally:
        pool.close()


def test_replicated_and_non_outermost_state_map_as_sglang_marks_them() -> None:
    pool = ShmPool(1 << 18)
    try:
        args = _mamba_args(pool, dims=[0, 0, SSM_HEADS, SSM_HEADS], outers=[1, 1, 2, 2])
        spec, st = _spec(pool, args, _ranks(tp=2))
        assert [(b.heads, b.total_heads) for b in spec.buffers] == [(1, 1), (1, 1), (1, 2),
                                                                     (1, 2)]
        assert st.whole_slots[0] == "layer 1 mamba1 (2 rows before the TP-split axis)"
        _, st = _spec(pool, _mamba_args(pool, dims=[]), _ranks(tp=2))
        assert st.whole_slots[0] == "layer 1 mamba0 (no state_dim_per_tensor)"
    finally:
        pool.close()


def _swa_args(pool: ShmPool, layout: str | None = "hnd", item: int = ITEM) -> Any:
    bufs = [pool.alloc(PAGES * item)[0] for _ in range(6)]  # 3 window layers: K, V
    args = _base(pool, kv_layer_ids=[], swa_kv_cache_layout=layout)
    return _add(args, "swa", bufs, [item] * 6, [])


def test_swa_pool_becomes_kvds_window_pool() -> None:
    pool = ShmPool(1 << 18)
    try:
        spec, st = _spec(pool, _swa_args(pool), _ranks(tp=2), window=10)
        assert spec.layer_types == ["full", "full", "window", "window", "window"]
        assert spec.buffers == [] and spec.window_tokens == 10 and st.types == ("swa",)
        w = spec.window
        assert w is not None and (w.num_layers, w.num_kv_heads, w.total_kv_heads,
                                  w.head_dim, w.dtype_size, w.layout) == (3, 2, 4, 8, 2, "HND")
        assert w.item_lens == [ITEM] * 6
        with pytest.raises(KVArgsError, match="sliding window size is unknown"):
            registration(_swa_args(pool), False, read_maps(), ranks=_ranks())
        with pytest.raises(KVArgsError, match="'vectorized_5d' is not one kvd plans"):
            registration(_swa_args(pool, "vectorized_5d"), False, read_maps(),
                         ranks=_ranks(), window_tokens=10)
        with pytest.raises(KVArgsError, match=r"item lengths \[100\] are not page_size 4"):
            registration(_swa_args(pool, item=100), False, read_maps(), ranks=_ranks(),
                         window_tokens=10)
    finally:
        pool.close()


def test_dsa_indexer_cache_becomes_the_indexer_group() -> None:
    pool = ShmPool(1 << 18)
    try:
        idx = [pool.alloc(PAGES * PAGE * 132)[0] for _ in range(2)]
        args = _add(_base(pool), "dsa", idx, [PAGE * 132] * 2, [])
        reg, st = registration_state(args, False, read_maps(), ranks=_ranks())
        assert reg.state is None and st.group is not None and reg.groups == [st.group]
        g = reg.groups[0]
        assert (g.name, g.replicated, g.num_layers, g.head_dim, g.dtype_size) == (
            "indexer", True, 2, 132, 1)
        assert len(reg.group_buffers) == 2
        bad = _add(_base(pool), "dsa", idx, [PAGE * 132, PAGE * 64], [])
        with pytest.raises(KVArgsError, match="dsa state: 2 indexer buffers"):
            registration(bad, False, read_maps(), ranks=_ranks())
    finally:
        pool.close()


def test_state_refusals_name_what_they_refuse() -> None:
    pool = ShmPool(1 << 18)
    try:
        maps = read_maps()
        with pytest.raises(KVArgsError, match="did not publish its parallel context"):
            registration(_mamba_args(pool), False, maps)
        with pytest.raises(KVArgsError, match="pipeline parallelism"):
            registration(_mamba_args(pool), False, maps, ranks=_ranks(pp=2))
        args = _mamba_args(pool)
        args.state_layer_ids[0] = [1, 4, 1, 4]
        with pytest.raises(KVArgsError, match="layer 3 has neither full-attention KV nor"):
            registration(args, False, maps, ranks=_ranks())
        args.state_layer_ids[0] = [1, 2, 1, 2]
        with pytest.raises(KVArgsError, match="layer 2 has both full-attention KV and mamba"):
            registration(args, False, maps, ranks=_ranks())
        args = _mamba_args(pool)
        args.kv_layer_ids = [0, 0]
        with pytest.raises(KVArgsError, match="kv_layer_ids name 1 full-attention layers, "
                                              "the KV pool holds 2"):
            registration(args, False, maps, ranks=_ranks())
        with pytest.raises(KVArgsError, match=r"item length 48 does not split into 5 rows"):
            registration(_mamba_args(pool, dims=[5, 5, 2, 2]), False, maps, ranks=_ranks())
    finally:
        pool.close()


def test_a_rooms_state_indices_become_kvds_state_index_and_window_pages() -> None:
    assert room_state((), None) == (-1, None)
    assert room_state(("mamba",), [np.array([5])]) == (5, None)  # the decode's payload
    assert room_state(("mamba", "dsa"), [[7], [3, 4]], np.array([3, 4])) == (7, None)
    index, window = room_state(("swa",), [np.array([9, 2, 6], dtype=np.int32)])
    assert index == -1 and window is not None and window.tolist() == [9, 2, 6]
    assert room_state(("mamba",), [None]) == (-1, None)
    with pytest.raises(KVArgsError, match="mamba state: 2 slot indices"):
        room_state(("mamba",), [[1, 2]])
    with pytest.raises(KVArgsError, match="not the room's KV pages"):
        room_state(("dsa",), [[3, 5]], [3, 4])
    with pytest.raises(KVArgsError, match="state indices for dsa_tail"):
        room_state(("dsa_tail",), [[3]])
