"""The ``bootstrap`` discovery source (the default): SGLang's ``GET /route`` lookups on
a prefill instance's bootstrap server, made by a decode rank.

:class:`BootstrapClient` implements :class:`kvd.discovery.base.Lookups`; the prefill's
half (``PUT /route``) is ``kvd.daemon.prefill``'s ``register_with_bootstrap``. Liveness
in this mode comes from the decode's ``/health`` heartbeats, not from here. The HTTP
request itself is the caller's (``Core.http``: signed, timed out), so this module needs
no daemon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import httpx

from kvd.addr import http_url, join_hostport
from kvd.bootstrap.table import ParallelInfo, RankInfo
from kvd.control.routing import Target
from kvd.errors import BootstrapError, ClockSkew
from kvd.membership.machine import skew_reason
from kvd.security import CLOCK_HEADER


class Http(Protocol):
    """A signed request to another kvd (``Core.http``); raises httpx errors."""

    def __call__(self, method: str, url: str, *, params: Mapping[str, Any] | None = None
                 ) -> Awaitable[httpx.Response]: ...


class BootstrapClient:
    """Cached, bounded lookups on prefill bootstrap servers (one loop, async httpx).

    503 (not every rank registered yet) and connection errors are retried with
    backoff for up to ``budget`` seconds; other 4xx answers fail at once.
    Concurrent lookups of the same key share one request; at most ``slots`` requests
    are in flight at once, the others wait for one within their budget (K41).
    """

    def __init__(self, http: Http, budget: float, max_skew: float, slots: int = 32) -> None:
        self.http = http
        self.budget = budget
        self.max_skew = max_skew  # auth_max_skew: named in a clock-skew 401's reason
        self._slots = asyncio.Semaphore(slots)  # /route requests in flight (K41)
        self.info: dict[str, ParallelInfo] = {}
        self.ranks: dict[tuple[str, int, int, int], RankInfo] = {}
        self._inflight: dict[tuple[object, ...], asyncio.Future[dict[str, object]]] = {}

    def forget(self, addr: str) -> set[str]:
        """Drop everything cached for bootstrap ``addr``; returns its rank endpoints."""
        self.info.pop(addr, None)
        endpoints = set()
        for key in [k for k in self.ranks if k[0] == addr]:
            endpoints.add(endpoint_of(self.ranks.pop(key)))
        return endpoints

    async def _get_shared(self, addr: str, params: dict[str, int],
                          retry: bool = True) -> dict[str, object]:
        # a one-try lookup (peer down) never joins a retrying one: that may run for the
        # whole budget although the rooms that started it failed already
        key = (addr, retry, *sorted(params.items()))
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._get(addr, params, retry))
            self._inflight[key] = fut
            fut.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(fut)

    async def _get(self, addr: str, params: dict[str, int],
                   retry: bool = True) -> dict[str, object]:
        """One ``/route`` answer. 503 (not every rank registered yet) and connection errors
        are retried with backoff within ``budget`` s; without ``retry`` (the peer is down)
        a connection error fails at once, while a 503 -- the server answered: it is up --
        is still retried within the budget."""
        loop = asyncio.get_running_loop()
        url, deadline, delay = http_url(addr, "/route"), loop.time() + self.budget, 0.05
        last = ""
        while True:
            try:
                async with self._slots:
                    if loop.time() > deadline:
                        raise BootstrapError(f"bootstrap {addr}: {last or 'no lookup slot'} "
                                             f"after {self.budget:.0f}s (lookups queued)")
                    resp = await self.http("GET", url, params=params)
                if resp.status_code == 200:
                    result: dict[str, object] = resp.json()
                    return result
                last = f"{resp.status_code} {resp.text.strip()}"
                skew = _skew_of(resp)
                if skew is not None:
                    raise ClockSkew(skew_reason(f"bootstrap {addr}", -skew,
                                                self.max_skew))
                if resp.status_code != 503:
                    raise BootstrapError(f"bootstrap {addr} answered {last}")
            except httpx.HTTPError as exc:
                last = f"bootstrap unreachable ({type(exc).__name__})"
                if not retry:
                    raise BootstrapError(f"bootstrap {addr}: {last} (peer down: one "
                                         f"try)") from exc
            except ValueError as exc:  # a 200 whose body is not JSON
                raise BootstrapError(f"bootstrap {addr} sent a malformed answer: {exc}") from exc
            if loop.time() + delay > deadline:
                raise BootstrapError(f"bootstrap {addr}: {last} after {self.budget:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def parallel_info(self, addr: str, retry: bool = True,
                            seen: Callable[[ParallelInfo], object] | None = None
                            ) -> ParallelInfo:
        """The prefill instance's sizes (cached per bootstrap address). A fresh answer
        goes to ``seen`` before it is cached (the membership machine learns the instance
        it names, which may close older lookups). ``retry``: see :meth:`_get`."""
        cached = self.info.get(addr)
        if cached is not None:
            return cached
        data = await self._get_shared(addr, {"engine_rank": -1, "target_dp_group": -1,
                                             "target_pp_rank": -1}, retry)
        info = ParallelInfo.model_validate(data)
        if seen is not None:
            seen(info)
        self.info[addr] = info
        return info

    async def rank(self, addr: str, t: Target) -> RankInfo:
        """Where prefill rank (tp, dp, pp) listens (cached)."""
        key = (addr, t.tp_rank, t.dp_group, t.pp_rank)
        if key not in self.ranks:
            data = await self._get_shared(addr, {"engine_rank": t.tp_rank, "target_dp_group":
                                                 t.dp_group, "target_pp_rank": t.pp_rank})
            self.ranks[key] = RankInfo.model_validate(data)
        return self.ranks[key]


def endpoint_of(rank: RankInfo) -> str:
    """The control endpoint of a prefill rank from its bootstrap entry."""
    return f"tcp://{join_hostport(rank.rank_ip.strip('[]'), rank.rank_port)}"


def _skew_of(resp: httpx.Response) -> float | None:
    """A 401's claim that our request was signed this far (s) ahead of the server's clock."""
    value = resp.headers.get(CLOCK_HEADER) if resp.status_code == 401 else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
