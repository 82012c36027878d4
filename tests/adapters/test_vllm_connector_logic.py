"""The vLLM connector's scheduler side against stand-in requests (no engine): samples
claim distinct rooms (K33), prefix hits name their first page, aborts reach kvd."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here: run `make test-vllm`"),
]

BLOCK = 32


def scheduler(producer: bool = False, groups: Any = None) -> Any:
    from kvd.adapters.vllm.connector import _Scheduler
    from kvd.adapters.vllm.spec import ConnectorConfig

    kt = SimpleNamespace(engine_id="e", is_kv_producer=producer, is_kv_consumer=not producer)
    cfg = SimpleNamespace(kv_transfer_config=kt, cache_config=SimpleNamespace(block_size=BLOCK),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                          data_parallel_rank=0))
    extra = {"kvd_socket": "/s", **({"bootstrap_addr": "h:1"} if producer else {})}
    return _Scheduler(cfg, ConnectorConfig.from_extra(extra, producer), groups,
                      tuple(range(len(groups or [0]))))


def request(req_id: str, params: dict[str, Any], prompt: int = 100, status: Any = None
            ) -> Any:
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(request_id=req_id, kv_transfer_params=params,
                           prompt_token_ids=list(range(prompt)), num_prompt_tokens=prompt,
                           status=status or RequestStatus.WAITING)


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_k33_samples_sharing_one_params_dict_claim_distinct_rooms() -> None:
    s = scheduler()
    shared = {"do_remote_prefill": True, "bootstrap_room": 5, "bootstrap_rooms": [5, 77],
              "bootstrap_addr": "h:1"}
    kids = [request(f"{i}_parent", shared) for i in range(3)]  # n=3, but only 2 rooms sent
    assert [s.matched_tokens(k, 0) for k in kids] == [(100, True), (100, True), (0, False)]
    assert s.matched_tokens(kids[0], 0) == (100, True)  # asked again: the same room kept
    for i, k in enumerate(kids):
        s.after_alloc(k, blocks(list(range(10 * i, 10 * i + 4))), 100)
    assert [(r.req_id, r.room) for r in s.meta.recvs] == [("0_parent", 5), ("1_parent", 77)]
    assert shared["do_remote_prefill"] is True  # no child changed the parent's dict
    assert not s.meta.aborts  # the third computes locally, claiming nothing
    again = request("3_parent", shared)  # a retry with the same params gets no room either
    assert s.matched_tokens(again, 0) == (0, False)


def test_a_local_prefix_hit_receives_only_the_pages_after_it() -> None:
    s = scheduler()
    req = request("r", {"do_remote_prefill": True, "bootstrap_room": 9, "bootstrap_addr": "h:1"},
                  prompt=100)  # 4 pages; the decode holds the first 2
    assert s.matched_tokens(req, 2 * BLOCK) == (100 - 2 * BLOCK, True)
    s.after_alloc(req, blocks([40, 41, 42, 43]), 100 - 2 * BLOCK)
    (task,) = s.meta.recvs
    assert (task.first_page, task.block_ids, task.room) == (2, [42, 43], 9)
    unaligned = request("u", {"do_remote_prefill": True, "bootstrap_room": 10,
                              "bootstrap_addr": "h:1"})
    assert s.matched_tokens(unaligned, 40) == (0, False)  # not a block boundary: local
    s.after_alloc(unaligned, blocks([1, 2, 3, 4]), 0)
    assert [(a.room, a.bootstrap_addr) for a in s.meta.aborts] == [(10, "h:1")]


def test_k35_an_aborted_decode_request_cancels_its_room_and_the_engine_steps_once() -> None:
    from vllm.v1.request import RequestStatus

    s = scheduler()
    req = request("r", {"do_remote_prefill": True, "bootstrap_room": 9, "bootstrap_addr": "h:1"})
    s.matched_tokens(req, 0)
    s.after_alloc(req, blocks([1, 2, 3, 4]), 100)
    s.build_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert not s.has_queued()
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.finished(req, ([1, 2, 3, 4],)) == (False, None)
    assert s.meta.cancels == ["r"] and s.has_queued()  # one more step delivers it
    never = request("n", {"do_remote_prefill": True, "bootstrap_room": 11,
                          "bootstrap_addr": "h:1"}, status=RequestStatus.FINISHED_ABORTED)
    s.finished(never, ([],))  # aborted before it was ever scheduled: its room is aborted
    assert [a.room for a in s.meta.aborts] == [11]


def test_the_prefill_sends_one_room_per_sample() -> None:
    from vllm.v1.request import RequestStatus

    s = scheduler(producer=True)
    req = request("p", {"do_remote_decode": True, "bootstrap_room": 3, "num_samples": 3},
                  prompt=70, status=RequestStatus.FINISHED_LENGTH_CAPPED)
    delay, reply = s.finished(req, ([7, 8, 9, 10],))
    assert delay and reply is not None
    (task,) = s.meta.sends
    assert task.block_ids == [7, 8, 9] and task.rooms[0] == 3 and len(set(task.rooms)) == 3
    assert reply["bootstrap_rooms"] == list(task.rooms) and reply["bootstrap_room"] == 3
    stopped = request("q", {"do_remote_decode": True}, status=RequestStatus.FINISHED_STOPPED)
    assert s.finished(stopped, ([1],)) == (False, None)  # ended by EOS: nothing to hand off


WINDOW = 64  # a sliding-window group of 64 tokens beside a full-attention group


def hybrid_groups() -> list[Any]:
    """The groups :func:`cache_groups` derives from vLLM's own specs of a model with
    full-attention and sliding-window layers."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from kvd.adapters.vllm.connector import cache_groups

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=3, head_size=64,
                               dtype=torch.float32, sliding_window=WINDOW)
    config = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full),
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], window)])
    groups, ids = cache_groups(config)
    assert ids == (0, 1)
    return groups


def test_hybrid_groups_move_full_blocks_then_the_window_blocks_on_both_sides() -> None:
    """A prefill of a full + sliding-window model sends its full group's prompt blocks,
    then the window group's blocks of the last tokens; the decode names as many, in the
    same order, so room page i means the same layer's block on both sides."""
    from vllm.v1.request import RequestStatus

    groups = hybrid_groups()
    assert [(g.kind, g.window) for g in groups] == [("full", 0), ("window", WINDOW)]
    p = scheduler(producer=True, groups=groups)
    req = request("p", {"do_remote_decode": True, "bootstrap_room": 3}, prompt=100,
                  status=RequestStatus.FINISHED_LENGTH_CAPPED)
    # 100 tokens, the decode loads 99: 4 full blocks; it keeps tokens 36.. -> window
    # blocks 1..3
    delay, reply = p.finished(req, ([10, 11, 12, 13], [0, 21, 22, 23]))
    assert delay and reply is not None
    assert p.meta.sends[0].block_ids == [10, 11, 12, 13, 21, 22, 23]
    d = scheduler(groups=groups)
    params = {"do_remote_prefill": True, "bootstrap_room": 3, "bootstrap_addr": "h:1"}
    dreq = request("d", params, prompt=100)
    assert d.matched_tokens(dreq, 0) == (99, True)  # the decode computes the last token
    d.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8], [0, 1, 2, 3])),
                  99)
    (recv,) = d.meta.recvs
    assert recv.block_ids == [5, 6, 7, 8, 1, 2, 3] and recv.first_page == 0


def test_hybrid_decode_prefix_hit_computes_locally_and_aborts_the_room() -> None:
    """A local hit is not a prefix of a hybrid room's pages: the decode declines the
    remote KV (computes the prompt) and the room is aborted, nothing is received."""
    d = scheduler(groups=hybrid_groups())
    params = {"do_remote_prefill": True, "bootstrap_room": 9, "bootstrap_addr": "h:1"}
    req = request("d", params, prompt=100)
    assert d.matched_tokens(req, BLOCK) == (0, False)
    d.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8], [0, 1, 2, 3])), 0)
    assert not d.meta.recvs and [a.room for a in d.meta.aborts] == [9]


def mamba_groups(mode: str = "none", tp_size: int = 1) -> list[Any]:
    """The groups :func:`cache_groups` derives from vLLM's own specs of a Mamba2 +
    attention hybrid (GraniteMoeHybrid: the state group first, blocks of 64 tokens)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from kvd.adapters.vllm.connector import cache_groups

    mamba = MambaSpec(block_size=1024, shapes=((3, 544 // tp_size), (8 // tp_size, 64, 16)),
                      dtypes=(torch.float32, torch.float32), page_size_padded=65536,
                      mamba_cache_mode=mode)
    full = FullAttentionSpec(block_size=64, num_kv_heads=2 // tp_size, head_size=64,
                             dtype=torch.float32)
    config = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.mixer", "model.layers.2.mixer"], mamba),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                         full)])
    groups, ids = cache_groups(config, tp_size)
    assert ids == (0, 1)
    return groups


def test_a_mamba_hybrid_moves_its_state_block_after_the_full_blocks_on_both_sides() -> None:
    """vLLM's MambaSpec is a state group. The prefill drops the last prompt token of a
    request it hands off (vLLM's own Request fields), so its state is that of the prompt
    before it, and sends the full blocks of the tokens it ran, then the state block; the
    decode loads as many tokens (computing the last one itself) into the same pages, in
    the same order. The reply counts the whole prompt."""
    from vllm.v1.request import RequestStatus

    from kvd.adapters.vllm.spec import check_groups, groups_signature

    groups = mamba_groups()
    assert [(g.kind, g.spec_blocks) for g in groups] == [("state", 0), ("full", 0)]
    check_groups(groups)
    assert groups_signature(groups) == "state@1024:tp1:3x544,8x64x16:float32,float32 full@64"
    p = scheduler(producer=True, groups=groups)
    req = request("p", {"do_remote_decode": True, "bootstrap_room": 3}, prompt=130)
    req._all_token_ids, req.max_tokens = list(req.prompt_token_ids), 16
    p.new_request(req)
    assert (len(req.prompt_token_ids), len(req._all_token_ids), req.num_prompt_tokens,
            req.max_tokens) == (129, 129, 129, 1)
    p.new_request(req)  # a second call (a rescheduled request) drops nothing more
    assert req.num_prompt_tokens == 129
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, reply = p.finished(req, ([9], [10, 11, 12]))
    assert delay and reply is not None and reply["num_prompt_tokens"] == 130
    assert p.meta.sends[0].block_ids == [10, 11, 12, 9]
    plain = request("q", {"bootstrap_room": 4}, prompt=130)  # asked directly: untouched
    p.new_request(plain)
    logprobs = request("l", {"do_remote_decode": True}, prompt=130)  # skips prefix caches
    logprobs.get_skip_reading_prefix_cache = lambda: True
    p.new_request(logprobs)
    assert plain.num_prompt_tokens == logprobs.num_prompt_tokens == 130
    d = scheduler(groups=groups)
    dreq = request("d", {"do_remote_prefill": True, "bootstrap_room": 3,
                         "bootstrap_addr": "h:1"}, prompt=130)
    assert d.matched_tokens(dreq, 0) == (129, True)
    d.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: ([5], [6, 7, 8])), 129)
    (recv,) = d.meta.recvs
    assert recv.block_ids == [6, 7, 8, 5] and recv.first_page == 0


def test_a_prefill_that_ran_the_whole_prompt_does_not_hand_off_a_state() -> None:
    """A one-token prompt cannot be truncated: its state is past where a decode would
    continue, so the prefill hands nothing off (the decode computes the prompt)."""
    from vllm.v1.request import RequestStatus

    p = scheduler(producer=True, groups=mamba_groups())
    req = request("p", {"do_remote_decode": True, "bootstrap_room": 3}, prompt=1)
    req._all_token_ids, req.max_tokens = [0], 16
    p.new_request(req)
    assert req.num_prompt_tokens == 1
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.finished(req, ([9], [10])) == (False, None) and not p.meta.sends


def test_mamba_state_with_prefix_caching_is_refused_at_registration() -> None:
    """vLLM's prefix caching keeps a Mamba state checkpoint per block (``mamba_cache_mode``
    ``align``): refused before registering, naming the group and the flag to use."""
    from kvd.adapters.vllm.spec import KvdAdapterError, check_groups

    with pytest.raises(KvdAdapterError, match=r"group 0 holds Mamba state with prefix caching, "
                                              r"layers model.layers.0.mixer, model.layers.2"
                                              r".mixer: .*--no-enable-prefix-caching"):
        check_groups(mamba_groups("align"))


def test_a_decode_of_another_tp_size_is_refused_at_pairing_by_the_state_shapes() -> None:
    """Whole state blocks are byte-exact between equal TP sizes only: the per-rank state
    shapes and the TP size are in the fingerprint, so a TP 1 prefill and a TP 2 decode
    are refused at pairing naming both, never planned."""
    from kvd.adapters.vllm.spec import groups_signature
    from kvd.errors import RegistrationError
    from kvd.protocol.control import Compat
    from kvd.transfer.compat import check_compat

    one, two = groups_signature(mamba_groups()), groups_signature(mamba_groups(tp_size=2))
    assert "tp2:3x272,4x64x16" in two
    with pytest.raises(RegistrationError, match=r"layer_types.*tp1.*tp2"):
        check_compat(Compat(layer_types=one), Compat(layer_types=two))


def test_a_mamba_hybrids_shared_tensors_register_once_as_whole_pages() -> None:
    """vLLM 0.32's CPU layout of a Mamba2 + attention hybrid: one buffer, a tensor per
    layer slot shared by a Mamba layer (its state page as int8, 39296 of 65536 bytes) and
    an attention layer (float32 KV, the whole page). Each slot is one region, described by
    the attention view; registered as whole 65536-byte blocks (Mamba: equal TP only)."""
    import torch

    from kvd.adapters.vllm.connector import cache_regions
    from kvd.adapters.vllm.spec import has_state, register_kv
    from kvd.protocol.rpc import ShmHandle

    blocks, page = 8, 65536
    raw = torch.zeros(2 * blocks * page, dtype=torch.int8)
    caches: dict[str, Any] = {}
    for slot, (mixer, attn) in enumerate(((0, 1), (2, 3))):
        base = raw[slot * blocks * page:]
        caches[f"model.layers.{mixer}.mixer"] = torch.as_strided(
            base, (blocks, 1, 1, 39296), (page, 39296, 39296, 1))
        caches[f"model.layers.{attn}.self_attn.attn"] = torch.as_strided(
            base.view(torch.float32), (blocks, 2, 64, 128), (page // 4, 8192, 128, 1))
    regions = cache_regions(caches)
    assert [(c.name, t.dtype) for c, t in regions] == [
        ("model.layers.1.self_attn.attn", torch.float32),
        ("model.layers.3.self_attn.attn", torch.float32)]
    only_state = cache_regions({k: v for k, v in caches.items() if "mixer" in k})
    assert [(c.layer, c.block_bytes) for c, _ in only_state] == [(0, page), (2, page)]
    groups = mamba_groups()
    handles = [ShmHandle(path="/dev/shm/x", offset=i * blocks * page, length=blocks * page)
               for i in range(2)]
    reg = register_kv([c for c, _ in regions], handles, block_size=64, num_kv_heads=2,
                      head_dim=64, dtype_size=4, total_kv_heads=2,
                      is_mla=has_state(groups), shared=True)
    assert (reg.is_mla, reg.fused_kv, reg.kv_item_lens, reg.num_layers) == (
        True, False, [page, page], 2)
