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


def scheduler(producer: bool = False) -> Any:
    from kvd.adapters.vllm.connector import _Scheduler
    from kvd.adapters.vllm.spec import ConnectorConfig

    kt = SimpleNamespace(engine_id="e", is_kv_producer=producer, is_kv_consumer=not producer)
    cfg = SimpleNamespace(kv_transfer_config=kt, cache_config=SimpleNamespace(block_size=BLOCK),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                          data_parallel_rank=0))
    extra = {"kvd_socket": "/s", **({"bootstrap_addr": "h:1"} if producer else {})}
    return _Scheduler(cfg, ConnectorConfig.from_extra(extra, producer))


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
    assert s.finished(req, [1, 2, 3, 4]) == (False, None)
    assert s.meta.cancels == ["r"] and s.has_queued()  # one more step delivers it
    never = request("n", {"do_remote_prefill": True, "bootstrap_room": 11,
                          "bootstrap_addr": "h:1"}, status=RequestStatus.FINISHED_ABORTED)
    s.finished(never, [])  # aborted before it was ever scheduled: its room is aborted
    assert [a.room for a in s.meta.aborts] == [11]


def test_the_prefill_sends_one_room_per_sample() -> None:
    from vllm.v1.request import RequestStatus

    s = scheduler(producer=True)
    req = request("p", {"do_remote_decode": True, "bootstrap_room": 3, "num_samples": 3},
                  prompt=70, status=RequestStatus.FINISHED_LENGTH_CAPPED)
    delay, reply = s.finished(req, [7, 8, 9, 10])
    assert delay and reply is not None
    (task,) = s.meta.sends
    assert task.block_ids == [7, 8, 9] and task.rooms[0] == 3 and len(set(task.rooms)) == 3
    assert reply["bootstrap_rooms"] == list(task.rooms) and reply["bootstrap_room"] == 3
    stopped = request("q", {"do_remote_decode": True}, status=RequestStatus.FINISHED_STOPPED)
    assert s.finished(stopped, [1]) == (False, None)  # ended by EOS: nothing to hand off
