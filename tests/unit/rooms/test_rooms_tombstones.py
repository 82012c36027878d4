"""kvd.rooms.tombstones.Bounded: expiry in time, eviction by count (tier 1, pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvd.rooms.tombstones import Bounded


def test_put_get_pop() -> None:
    b: Bounded[int, str] = Bounded(ttl=10.0, capacity=3)
    b.put(1, "a", 0.0)
    assert b.get(1) == "a" and 1 in b and len(b) == 1
    assert b.get(2) is None and b.pop(2) is None
    assert b.pop(1) == "a" and 1 not in b and len(b) == 0


def test_expiry_is_strictly_after_ttl() -> None:
    b: Bounded[int, str] = Bounded(ttl=10.0, capacity=8)
    b.put(1, "a", 0.0)
    b.put(2, "b", 5.0)
    assert b.expire(10.0) == [] and len(b) == 2
    assert b.expire(10.01) == ["a"] and list(b.values()) == ["b"]
    assert b.expire(100.0) == ["b"] and len(b) == 0


def test_replacing_a_key_makes_it_newest() -> None:
    b: Bounded[int, str] = Bounded(ttl=10.0, capacity=2)
    b.put(1, "a", 0.0)
    b.put(2, "b", 1.0)
    b.put(1, "a2", 2.0)
    b.put(3, "c", 3.0)  # evicts the oldest: 2
    assert list(b.values()) == ["a2", "c"]
    assert b.expire(11.5) == []  # 1 was re-put at 2.0: not expired at 11.5


@given(st.lists(st.tuples(st.integers(0, 20), st.floats(0, 5)), max_size=200),
       st.integers(1, 10))
def test_never_above_capacity_and_expiry_empties(ops: list[tuple[int, float]],
                                                 capacity: int) -> None:
    b: Bounded[int, int] = Bounded(ttl=3.0, capacity=capacity)
    now = 0.0
    for key, dt in ops:
        now += dt
        b.put(key, key, now)
        assert len(b) <= capacity
        b.expire(now)
        assert len(b) <= capacity
    b.expire(now + 3.01)
    assert len(b) == 0
