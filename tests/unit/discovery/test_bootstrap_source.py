"""The bootstrap source (``/route`` lookups) against a scripted HTTP callable: no
server, no daemon (it takes ``Core.http`` as a plain callable)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
import pytest

from kvd.control.routing import Target
from kvd.discovery.base import Lookups
from kvd.discovery.bootstrap import BootstrapClient, endpoint_of
from kvd.errors import BootstrapError, ClockSkew
from kvd.security import CLOCK_HEADER

INFO = {"prefill_attn_tp_size": 1, "prefill_dp_size": 1, "prefill_pp_size": 1,
        "instance_id": "i1"}
RANK = {"rank_ip": "10.0.0.1", "rank_port": 7000, "instance_id": "i1"}


class Scripted:
    """Answers each request with the next response of ``script``; counts calls."""

    def __init__(self, *script: httpx.Response, gate: asyncio.Event | None = None) -> None:
        self.script, self.calls, self.gate = list(script), 0, gate

    async def __call__(self, method: str, url: str, *,
                       params: Mapping[str, Any] | None = None) -> httpx.Response:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        return self.script.pop(0)


def test_the_bootstrap_source_implements_lookups() -> None:
    client: Lookups = BootstrapClient(Scripted(), budget=1.0, max_skew=30.0)
    assert client.info == {} and client.ranks == {}


async def test_k01_a_503_is_retried_within_the_budget_then_cached() -> None:
    http = Scripted(httpx.Response(503, text="not all ranks"), httpx.Response(200, json=INFO))
    client = BootstrapClient(http, budget=5.0, max_skew=30.0)
    seen = []
    info = await client.parallel_info("10.0.0.1:8998", seen=seen.append)
    again = await client.parallel_info("10.0.0.1:8998")
    assert info.instance_id == "i1" and again is info and seen == [info]
    assert http.calls == 2  # one 503, one answer; the second lookup is the cache


async def test_k40_a_clock_skew_401_names_the_skew_at_once() -> None:
    http = Scripted(httpx.Response(401, headers={CLOCK_HEADER: "42.0"}))
    client = BootstrapClient(http, budget=5.0, max_skew=30.0)
    with pytest.raises(ClockSkew, match=r"42\.0s behind.*30s freshness window"):
        await client.parallel_info("10.0.0.1:8998")
    assert http.calls == 1


async def test_k01_a_4xx_fails_at_once() -> None:
    client = BootstrapClient(Scripted(httpx.Response(404, text="no such rank")), budget=5.0,
                             max_skew=30.0)
    with pytest.raises(BootstrapError, match="404 no such rank"):
        await client.rank("10.0.0.1:8998", Target(tp_rank=3, dp_group=0, pp_rank=0, is_dummy=False,
                                                      required_dst_info_num=1))


async def test_k17_concurrent_lookups_share_one_request_and_forget_names_endpoints() -> None:
    gate = asyncio.Event()
    http = Scripted(httpx.Response(200, json=RANK), gate=gate)
    client = BootstrapClient(http, budget=5.0, max_skew=30.0)
    t = Target(tp_rank=0, dp_group=0, pp_rank=0, is_dummy=False, required_dst_info_num=1)
    both = asyncio.gather(client.rank("b:1", t), client.rank("b:1", t))
    await asyncio.sleep(0)
    gate.set()
    first, second = await both
    assert http.calls == 1 and first == second
    assert client.forget("b:1") == {endpoint_of(first)} == {"tcp://10.0.0.1:7000"}
    assert client.ranks == {}
