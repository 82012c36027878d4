"""The vLLM connector's pure parts: config, transfer params, KV description (no vLLM)."""

from __future__ import annotations

import pytest

from kvd.adapters.vllm.spec import (
    ConnectorConfig,
    KvdAdapterError,
    LayerCache,
    RemotePrefill,
    check_layer_compact,
    num_samples,
    pages_for,
    prefill_reply,
    register_kv,
    room_of,
    sample_rooms,
)
from kvd.protocol.rpc import EngineRanks, ShmHandle


def test_config_parses_and_fills_placeholders() -> None:
    cfg = ConnectorConfig.from_extra({"kvd_socket": "/run/kvd/gpu{tp_rank}-{pp_rank}.sock",
                                      "bootstrap_addr": "10.0.0.1:8998", "idle_wait": 0},
                                     is_producer=True)
    assert cfg.socket_for(3, 1) == "/run/kvd/gpu3-1.sock"
    assert cfg.bootstrap_addr == "10.0.0.1:8998" and cfg.idle_wait == 0.0


def test_s17_config_passes_the_expected_uid_to_the_client() -> None:
    cfg = ConnectorConfig.from_extra({"kvd_socket": "/s", "kvd_expected_uid": 999},
                                     is_producer=False)
    assert cfg.kvd_expected_uid == 999
    assert ConnectorConfig.from_extra({"kvd_socket": "/s"}, False).kvd_expected_uid is None
    for bad in (-1, "999", True):
        with pytest.raises(KvdAdapterError, match="kvd_expected_uid"):
            ConnectorConfig.from_extra({"kvd_socket": "/s", "kvd_expected_uid": bad}, False)


def test_config_lists_every_problem_at_once() -> None:
    with pytest.raises(KvdAdapterError) as err:
        ConnectorConfig.from_extra({"bootstrap_addr": "nope", "rpc_timeout": -1, "x": 1},
                                   is_producer=True)
    text = str(err.value)
    for part in ("kvd_socket", "bootstrap_addr", "rpc_timeout", "unknown keys ['x']"):
        assert part in text
    assert ConnectorConfig.from_extra({"kvd_socket": "/s"}, is_producer=False).bootstrap_addr \
        is None


def test_rooms_and_pages() -> None:
    assert room_of({"bootstrap_room": 2**64 - 1}) == 2**64 - 1
    assert 0 <= room_of({}) < 2**63
    for bad in (-1, 2**64, "7", True):
        with pytest.raises(KvdAdapterError):
            room_of({"bootstrap_room": bad})
    assert [pages_for(n, 32) for n in (0, 1, 32, 33)] == [0, 1, 1, 2]


def test_prefill_reply_round_trips_into_a_remote_prefill() -> None:
    params = prefill_reply([9, 17], "h:1", [4, 5], "eng", 1, 40, dp_rank=1)
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert RemotePrefill.parse(params) == RemotePrefill(9, "h:1", 1, 40, (9, 17), 1)
    with pytest.raises(KvdAdapterError, match="bootstrap_room None, bootstrap_rooms"):
        RemotePrefill.parse({"bootstrap_addr": "x"})
    # an older prefill's reply (no list of rooms): its one room
    old = {"bootstrap_room": 9, "bootstrap_addr": "h:1"}
    assert RemotePrefill.parse(old).rooms == (9,)
    for bad in ([9, 9], [17, 9], [], [9, -1], "9"):
        with pytest.raises(KvdAdapterError, match="bootstrap_rooms"):
            RemotePrefill.parse({**old, "bootstrap_rooms": bad})


def test_k33_sample_rooms_are_distinct_63_bit_and_start_with_the_room() -> None:
    for room in (0, 1, 2**63 - 1, 2**64 - 1):
        rooms = sample_rooms(room, 8)
        assert rooms[0] == room and len(set(rooms)) == 8
        assert all(0 <= r < 2**63 for r in rooms[1:])
    assert sample_rooms(5, 3) == sample_rooms(5, 3)  # a pure function of (room, n)
    assert set(sample_rooms(5, 3)[1:]).isdisjoint(sample_rooms(6, 3)[1:])
    assert sample_rooms(5, 1) == [5]
    for bad in (0, 65, True, "2"):
        with pytest.raises(KvdAdapterError, match="num_samples"):
            sample_rooms(5, bad)  # type: ignore[arg-type]
    assert num_samples({}) == 1 and num_samples({"num_samples": 4}) == 4
    with pytest.raises(KvdAdapterError):
        num_samples({"num_samples": 0})


def _layers(n: int = 3, stride: int = 4096, block: int = 4096, blocks: int = 10,
            dense: bool = True, start: int = 0,
            shape: tuple[int, ...] = (2, 32, 32)) -> list[LayerCache]:
    return [LayerCache(f"model.layers.{i}.self_attn.attn", start + i,
                       0x10000 + i * blocks * stride, blocks, stride, block, dense, shape)
            for i in range(n)]


def test_register_kv_cpu_blocks_are_fused_kv_heads() -> None:
    """vLLM's CPU block [kv_heads][block_size][2 * head_dim]: kvd's fused-KV HND layout,
    so kvd slices heads for heterogeneous TP; the worker's ranks ride along."""
    layers = _layers(start=4)  # 2 heads x 32 slots x 2 * 16 dims x 2 bytes = 4096
    handles = [ShmHandle("/dev/shm/p", i * 40960, 40960) for i in range(3)]
    ranks = EngineRanks(attn_tp_rank=1, attn_tp_size=2)
    reg = register_kv(layers, handles, block_size=32, num_kv_heads=2, head_dim=16,
                      dtype_size=2, total_kv_heads=4, ranks=ranks)
    assert reg.fused_kv and not reg.is_mla and reg.num_layers == 3 and reg.layer_start == 4
    assert (reg.num_kv_heads, reg.total_kv_heads, reg.head_dim) == (2, 4, 16)
    assert reg.kv_item_lens == [4096] * 3 and reg.kv_buffers == handles
    assert reg.aux_buffers == [] and reg.page_size == 32 and reg.layout == "HND"
    assert reg.ranks == ranks


def test_register_kv_other_blocks_are_whole_pages() -> None:
    """A block not shaped like the CPU cache (e.g. K and V apart): whole blocks, equal TP."""
    handles = [ShmHandle("/dev/shm/p", i * 40960, 40960) for i in range(3)]
    reg = register_kv(_layers(shape=(2, 2, 32, 16)), handles, block_size=32, num_kv_heads=2,
                      head_dim=16, dtype_size=2, total_kv_heads=2)
    assert reg.is_mla and not reg.fused_kv and reg.kv_item_lens == [4096] * 3


def test_layouts_kvd_cannot_move_whole_blocks_are_refused() -> None:
    interleaved = _layers(stride=3 * 4096, block=4096)  # block-outermost (BLHNC)
    assert any("block stride" in p for p in check_layer_compact(interleaved))
    assert any("contiguous" in p for p in check_layer_compact(_layers(dense=False)))
    overlapping = [*_layers(1), *_layers(1)]
    assert any("overlap" in p for p in check_layer_compact(overlapping))
    gap = [_layers(1)[0], _layers(3)[2]]
    with pytest.raises(KvdAdapterError, match="not consecutive"):
        register_kv(gap, [ShmHandle("/dev/shm/p", 0, 1)] * 2, block_size=32, num_kv_heads=1,
                    head_dim=1, dtype_size=1, total_kv_heads=1)
