"""The vLLM connector's pure parts: config, transfer params, KV description (no vLLM)."""

from __future__ import annotations

import pytest

from kvd.adapters.vllm.spec import (
    CacheGroup,
    ConnectorConfig,
    KvdAdapterError,
    LayerCache,
    RemotePrefill,
    check_groups,
    check_layer_compact,
    groups_signature,
    handed_tokens,
    loaded_tokens,
    num_samples,
    page_views,
    pages_for,
    prefill_reply,
    register_kv,
    room_blocks,
    room_of,
    sample_rooms,
    state_block,
    truncation,
    window_blocks,
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


FULL32 = CacheGroup("full", 32)
WIN32 = CacheGroup("window", 32, 64)


def test_window_blocks_hold_the_tokens_the_decode_keeps_and_no_more() -> None:
    """vLLM's decode keeps tokens from ``T - W + 1`` on after loading ``T``; the window
    blocks are exactly those holding them, never more than ``ceil(W / P) + 1``."""
    assert list(window_blocks(100, 64, 32)) == [1, 2, 3]   # tokens 37..99
    assert list(window_blocks(10, 64, 32)) == [0]           # the whole prompt is in it
    assert list(window_blocks(96, 64, 32)) == [1, 2]        # tokens 33..95
    for t in range(1, 400):
        for w, p in ((64, 32), (17, 16), (4096, 32), (1, 16)):
            blocks = window_blocks(t, w, p)
            keep = range(max(0, t - w + 1), t)
            assert blocks.start <= keep.start // p and blocks.stop == -(-t // p)
            assert len(blocks) <= -(-w // p) + 1


def test_room_blocks_are_full_groups_then_window_groups_in_group_order() -> None:
    ids = ([1, 2, 3, 4], [0, 11, 12, 13], [5, 6, 7, 8])
    groups = [FULL32, WIN32, CacheGroup("full", 32)]
    assert room_blocks(groups, ids, 100) == [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13]
    assert room_blocks([FULL32], ([1, 2, 3, 4],), 100, first_page=2) == [3, 4]
    with pytest.raises(KvdAdapterError, match="null block"):
        room_blocks([FULL32, WIN32], ([1, 2, 3, 4], [0, 0, 12, 13]), 100)
    with pytest.raises(KvdAdapterError, match="holds 3 blocks"):
        room_blocks([FULL32, WIN32], ([1, 2, 3], [0, 11, 12, 13]), 100)
    with pytest.raises(KvdAdapterError, match="prefix hit"):
        room_blocks([FULL32, WIN32], ids[:2], 100, first_page=1)


def test_groups_the_connector_cannot_move_are_refused_with_one_reason() -> None:
    check_groups([FULL32, WIN32])
    with pytest.raises(KvdAdapterError, match=r"group 1 holds a CrossAttentionSpec cache, "
                                              r"layers a, b, c\.\.\.: the kvd connector "
                                              r"moves full-attention and sliding-window KV "
                                              r"and Mamba state only"):
        check_groups([FULL32, CacheGroup("a CrossAttentionSpec cache", 32,
                                         layers=("a", "b", "c", "d"))])
    with pytest.raises(KvdAdapterError, match=r"differ in block size \[16, 32\]"):
        check_groups([FULL32, CacheGroup("window", 16, 64)])
    with pytest.raises(KvdAdapterError, match="pipeline parallelism 2"):
        check_groups([FULL32, WIN32], pp_size=2)
    with pytest.raises(KvdAdapterError, match="no KV cache group"):
        check_groups([])
    assert groups_signature([FULL32, WIN32]) == "full@32 window@32:64"


def test_register_kv_of_shared_group_tensors_numbers_buffers_and_sends_the_groups() -> None:
    """Tensors shared by several groups are named by any of their layers: registered as
    buffers 0.., the groups in the fingerprint."""
    from kvd.protocol.control import Compat

    item = 3 * 32 * 2 * 64 * 4
    layers = [LayerCache(f"model.layers.{i}.self_attn.attn", i, 0x100000 * (k + 1), 4, item,
                         item, True, (3, 32, 128)) for k, i in enumerate((0, 2, 4))]
    handles = [ShmHandle(path=f"/dev/shm/x{i}", offset=0, length=4 * item) for i in range(3)]
    compat = Compat(kv_dtype="float32", layer_types=groups_signature([FULL32, WIN32]))
    with pytest.raises(KvdAdapterError, match="not consecutive"):
        register_kv(layers, handles, block_size=32, num_kv_heads=3, head_dim=64,
                    dtype_size=4, total_kv_heads=3)
    reg = register_kv(layers, handles, block_size=32, num_kv_heads=3, head_dim=64,
                      dtype_size=4, total_kv_heads=3, shared=True, compat=compat)
    assert (reg.num_layers, reg.layer_start, reg.fused_kv) == (3, 0, True)
    assert reg.compat == compat


def test_a_decode_with_window_groups_loads_all_but_the_last_prompt_token() -> None:
    """vLLM's decode keeps window blocks from token ``L - W + 1`` after loading ``L``
    tokens; loading ``T - 1`` keeps token ``T - W``, which its last prompt token attends
    to. A prefill that freed that token's block (``T - W + 1`` a multiple of the block
    size) names the null block: refused, so the decode computes the prompt itself."""
    assert loaded_tokens([FULL32], 127) == 127
    assert loaded_tokens([FULL32, WIN32], 127) == 126 and loaded_tokens([WIN32], 1) == 0
    for t in range(2, 300):
        kept = window_blocks(t - 1, 64, 32)
        assert kept.start * 32 <= max(0, t - 64)  # token T - W is in a named block
    # T = 127: the prefill kept window blocks from token 64 on ([0, 0, 3, 4]); block 1
    # (tokens 32..63) holds token 63, which the decode needs
    with pytest.raises(KvdAdapterError, match="null block"):
        room_blocks([FULL32, WIN32], ([5, 6, 7, 8], [0, 0, 3, 4]), loaded_tokens([WIN32], 127))
    assert room_blocks([FULL32, WIN32], ([5, 6, 7, 8], [0, 9, 3, 4]), 121) == [
        5, 6, 7, 8, 9, 3, 4]


STATE = CacheGroup("state", 1024, layers=("model.layers.0.mixer",),
                   state="tp1:3x544,8x64x16:float32,float32")
FULL64 = CacheGroup("full", 64)


def test_a_state_group_adds_its_running_state_block_after_the_paged_groups() -> None:
    """A room of a Mamba hybrid: the full group's blocks of the tokens the decode loads
    (all but the last), then the state block (vLLM's, less speculative scratch blocks);
    a missing or null state block, or a prefix hit, is refused."""
    assert loaded_tokens([STATE, FULL64], 130) == 129
    assert room_blocks([STATE, FULL64], ([7], [1, 2, 3]), 129) == [1, 2, 3, 7]
    assert room_blocks([FULL64, STATE], ([1, 2], [7]), 128) == [1, 2, 7]
    assert state_block([7], 0) == 7 and state_block([4, 7, 8, 9], 2) == 7
    assert state_block([7], 2) == 7  # before the scratch blocks are allocated
    for bad in ([], [0], [5, 0]):
        with pytest.raises(KvdAdapterError, match="no state block"):
            room_blocks([STATE, FULL64], (bad, [1, 2, 3]), 129)
    with pytest.raises(KvdAdapterError, match="prefix hit"):
        room_blocks([STATE, FULL64], ([7], [1, 2, 3]), 129, first_page=1)


def test_a_prefill_with_state_computes_all_but_the_last_prompt_token() -> None:
    """The prefill drops the last prompt token of a request it hands off (once; not a
    1-token prompt, not a plain request, not without state) and hands off the pages of the
    prompt it ran; one it could not truncate is not handed off (its state is one token past
    where the decode continues)."""
    remote = {"do_remote_decode": True}
    assert truncation([STATE, FULL64], remote, 130) == 1
    assert truncation([STATE, FULL64], {**remote, "_kvd_truncated": 1}, 129) == 0
    assert truncation([STATE, FULL64], remote, 1) == 0
    assert truncation([STATE, FULL64], {}, 130) == truncation([STATE, FULL64], None, 130) == 0
    assert truncation([FULL64, CacheGroup("window", 64, 128)], remote, 130) == 0
    assert handed_tokens([STATE, FULL64], 129, truncated=True) == 129
    assert handed_tokens([FULL64], 130, truncated=False) == 130
    with pytest.raises(KvdAdapterError, match="not truncated"):
        handed_tokens([STATE, FULL64], 130, truncated=False)


def test_state_groups_are_checked_and_fingerprinted_with_their_tp_shapes() -> None:
    """A state group's block size is not a page size (only paged groups must agree); its
    per-rank shapes and TP size are in the fingerprint, so a decode of another TP size
    (other state shapes: whole blocks cannot be resliced) is refused at pairing; prefix
    caching (a state checkpoint per block) and state alone are refused at registration."""
    from kvd.errors import RegistrationError
    from kvd.protocol.control import Compat
    from kvd.transfer.compat import check_compat

    check_groups([STATE, FULL64])
    one = groups_signature([STATE, FULL64])
    assert one == "state@1024:tp1:3x544,8x64x16:float32,float32 full@64"
    two = groups_signature([CacheGroup("state", 1024, state="tp2:3x272,4x64x16:float32,"
                                       "float32"), FULL64])
    with pytest.raises(RegistrationError, match="layer_types"):
        check_compat(Compat(layer_types=one), Compat(layer_types=two))
    cached = CacheGroup("state", 64, layers=("model.layers.0.mixer",), prefix_cached=True)
    with pytest.raises(KvdAdapterError, match=r"group 0 holds Mamba state with prefix caching, "
                                              r"layers model.layers.0.mixer: .*"
                                              r"--no-enable-prefix-caching"):
        check_groups([cached, FULL64])
    with pytest.raises(KvdAdapterError, match="only state KV cache groups"):
        check_groups([STATE])


def test_page_views_of_shared_tensors_are_whole_pages() -> None:
    """A Mamba layer's view (conv + SSM state, 39296 bytes) and an attention layer's view
    (65536 bytes) of one tensor: the region is the attention view; a state-only tensor is
    widened to whole pages (the padding moves too); views that disagree are refused."""
    attn = LayerCache("model.layers.1.self_attn.attn", 1, 0x10000, 8, 65536, 65536, True,
                      (2, 64, 128))
    state = LayerCache("model.layers.0.mixer", 0, 0x10000, 8, 65536, 39296, True,
                       (1, 1, 39296))
    assert page_views([state, attn]) == attn
    wide = page_views([state])
    assert (wide.block_bytes, wide.block_stride, wide.layer) == (65536, 65536, 0)
    assert check_layer_compact([wide]) == []
    with pytest.raises(KvdAdapterError, match="different block layouts"):
        page_views([state, LayerCache("x", 1, 0x10000, 4, 65536, 65536, True)])
    with pytest.raises(KvdAdapterError, match="not one run"):
        page_views([LayerCache("y", 0, 0x10000, 8, 65536, 39296, False)])
