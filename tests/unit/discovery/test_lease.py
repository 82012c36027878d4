"""Lease keeping, backoff and view freshness of etcd discovery (pure, ``now`` passed)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvd.discovery.lease import Action, Backoff, Freshness, Keeper, Step


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    b = Backoff(0.1, 1.0)
    assert [b.delay() for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.delay() == 0.1


def test_keeper_grants_puts_and_renews_every_third_of_the_ttl() -> None:
    k = Keeper(3.0)
    assert k.next(0.0) == Action(Step.GRANT, 0.0)
    k.granted(42, 3.0, 0.0)
    assert k.next(0.0).step is Step.PUT and not k.registered(0.0)
    k.put_done(0.1)
    assert k.registered(0.1)
    assert k.next(0.5) == Action(Step.WAIT, 1.1)
    assert k.next(1.1).step is Step.KEEPALIVE
    k.renewed(1.2)
    assert k.next(1.3) == Action(Step.WAIT, 2.2)


def test_keeper_registers_again_when_the_lease_is_gone() -> None:
    k = Keeper(3.0)
    k.granted(1, 3.0, 0.0)
    k.put_done(0.0)
    k.lease_lost()  # etcd: TTL 0 (it lost the lease, e.g. restarted without data)
    assert k.next(1.0).step is Step.GRANT and not k.registered(1.0)


def test_keeper_outlives_an_outage_and_starts_over_after_expiry() -> None:
    k = Keeper(3.0)
    k.granted(1, 3.0, 0.0)
    k.put_done(0.0)
    now = 1.0
    steps = set()
    while now < 10.0:  # etcd does not answer for 9 s
        step = k.next(now).step
        steps.add(step)
        # before expiry it renews; after, the old lease is never renewed again
        assert step in ((Step.KEEPALIVE, Step.WAIT) if now < 3.0 else (Step.GRANT, Step.WAIT))
        if step is not Step.WAIT:
            wait = k.failed(now)
            assert 0 < wait <= 1.0  # capped at a third of the TTL: retries stay frequent
        now += 0.25
    assert not k.registered(now) and steps == {Step.KEEPALIVE, Step.GRANT, Step.WAIT}
    assert k.next(now).step in (Step.GRANT, Step.WAIT)
    k.granted(2, 3.0, now)
    k.put_done(now)
    assert k.registered(now) and k.failures == 0


@given(st.lists(st.sampled_from(["ok", "fail", "lost"]), max_size=60),
       st.floats(2.0, 30.0))
def test_keeper_never_renews_past_expiry_and_always_has_a_next_step(outcomes: list,
                                                                    ttl: float) -> None:
    k, now = Keeper(ttl), 0.0
    for outcome in outcomes:
        a = k.next(now)
        assert a.at >= now
        if a.step is Step.WAIT:
            now = a.at
            continue
        if a.step is Step.KEEPALIVE:
            assert now < k.last_ok + k.ttl  # a lease is renewed only while it lives
        if outcome == "fail":
            k.failed(now)
        elif outcome == "lost":
            k.lease_lost()
        elif a.step is Step.GRANT:
            k.granted(len(outcomes), ttl, now)
        elif a.step is Step.PUT:
            k.put_done(now)
        else:
            k.renewed(now)
        now += 0.1


def test_freshness_bounds_the_use_of_the_last_view() -> None:
    f = Freshness(ttl=5.0)
    assert f.stale(100.0) is None
    f.up()
    f.down(10.0, "connection refused")
    f.down(12.0, "connection refused")  # the outage started at the first failure
    assert f.stale(15.0) is None
    reason = f.stale(15.5)
    assert reason is not None and "5.5s" in reason and "connection refused" in reason
    f.up()
    assert f.stale(100.0) is None
