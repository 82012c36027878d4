"""Bounded memory of ended rooms. PURE.

A tombstone keeps an ended room's outcome so that a peer that shows up later
(or a late message) is answered with the original reason instead of being
buffered or waiting for a timeout (cases K21, K30). Entries expire after
``ttl`` seconds and the oldest are evicted beyond ``capacity``, so memory is
bounded however many rooms end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class Bounded(Generic[K, V]):
    """An insertion-ordered map whose entries expire ``ttl`` s after insertion and
    whose size never exceeds ``capacity`` (oldest evicted first)."""

    ttl: float
    capacity: int
    _items: OrderedDict[K, tuple[float, V]] = field(default_factory=OrderedDict)

    def put(self, key: K, value: V, now: float) -> None:
        """Insert or replace ``key`` (it becomes the newest)."""
        self._items.pop(key, None)
        self._items[key] = (now, value)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        return None if item is None else item[1]

    def pop(self, key: K) -> V | None:
        item = self._items.pop(key, None)
        return None if item is None else item[1]

    def expire(self, now: float) -> list[V]:
        """Drop entries older than ``ttl``; returns their values."""
        out = []
        while self._items:
            key, (t, value) = next(iter(self._items.items()))
            if now - t <= self.ttl:
                break
            del self._items[key]
            out.append(value)
        return out

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> Iterator[V]:
        return (v for _, v in self._items.values())
