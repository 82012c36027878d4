"""The unsigned release route's rate limit (K45/K46, docs/security.md): one bucket per
source address and a shared backstop. Tier 1 on the pure buckets (time passed in), then
the HTTP app over an ASGI transport with two client addresses."""

from __future__ import annotations

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.bootstrap.app import create_app
from kvd.bootstrap.ratelimit import SourceBuckets, TokenBucket
from kvd.protocol.release import ReleaseAnswer, ReleaseRequest


def test_k45_one_source_spending_its_bucket_leaves_the_others_theirs() -> None:
    b = SourceBuckets(rate=10.0, burst=20, shared=TokenBucket(1000.0, 2000))
    assert sum(b.take("10.0.0.66", 0.0) for _ in range(500)) == 20  # the stranger: its burst
    assert all(b.take("10.0.0.1", 0.0) for _ in range(20))  # the proxy: all of its own
    assert not b.take("10.0.0.1", 0.0)
    assert b.take("10.0.0.1", 0.1)  # refills at its rate


def test_k45_the_shared_backstop_bounds_all_sources_together() -> None:
    b = SourceBuckets(rate=10.0, burst=20, shared=TokenBucket(5.0, 30))
    taken = sum(b.take(f"10.0.0.{i}", 0.0) for i in range(10) for _ in range(20))
    assert taken == 30
    assert b.take("10.0.0.99", 1.0)  # the shared bucket refilled


def test_k45_the_source_table_is_bounded_and_evicts_the_least_recently_seen() -> None:
    b = SourceBuckets(rate=1.0, burst=1, sources=3, shared=TokenBucket(1e6, 10**6))
    for s in ("a", "b", "c"):
        assert b.take(s, 0.0)
    assert b.take("a", 0.0) is False  # "a" is now the most recently seen
    assert b.take("d", 0.0) and len(b) == 3  # "b" evicted
    assert b.take("b", 0.0)  # a fresh bucket: eviction never starves a source


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.floats(0, 0.5)), max_size=200))
def test_k45_no_source_gets_more_than_its_rate_and_burst(calls: list[tuple[str, float]]
                                                         ) -> None:
    rate, burst = 4.0, 3
    b = SourceBuckets(rate=rate, burst=burst, sources=16, shared=TokenBucket(1e6, 10**6))
    now, got = 0.0, dict.fromkeys("abcde", 0)
    for source, dt in calls:
        now += dt
        got[source] += b.take(source, now)
    assert all(n <= burst + rate * now + 1e-9 for n in got.values())
    assert len(b) <= 16


def _app(now: list[float]):  # type: ignore[no-untyped-def]
    def release(req: ReleaseRequest) -> ReleaseAnswer:
        return ReleaseAnswer({str(r): "unknown" for r in req.rooms})

    return create_app(lambda: {"status": "ok"}, None, release=release, clock=lambda: now[0])


async def _post(app, host: str) -> int:  # type: ignore[no-untyped-def]
    transport = httpx.ASGITransport(app=app, client=(host, 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        r = await c.post("/v1/rooms/release", json={"rooms": [7], "token": "t" * 43})
        return r.status_code


async def test_k45_a_stranger_flooding_the_release_route_does_not_fail_the_proxys_releases(
        ) -> None:
    """Before: one bucket per daemon (200/s, burst 400) -- 400 posts from anyone and the
    proxy's next release was answered 429."""
    now = [0.0]
    app = _app(now)
    codes = [await _post(app, "203.0.113.9") for _ in range(450)]
    assert codes.count(200) == 400 and codes.count(429) == 50
    assert await _post(app, "10.0.0.1") == 200  # the proxy's own bucket is untouched
