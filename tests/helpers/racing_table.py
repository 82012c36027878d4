"""A status table whose writer races its reader: kvd's writer (:class:`SlotMap`) records
its slot writes as single stores, and the reader's three gathers (heads, rooms, heads
again) run a chosen batch of those stores before each one -- every way a write can land
between, or tear across, a read's loads. What each room may read is computed from the
table's states in that window, one store at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.protocol.table import CODE_MASK, GEN_SHIFT, OCCUPIED, RELEASABLE, SlotMap, StatusTable

Store = Callable[[], None]
_LOW = (1 << GEN_SHIFT) - 1


def stores(tab: StatusTable, slot: int, room: int, word: int) -> list[Store]:
    """:meth:`StatusTable.write`'s three stores, one callable each (gen made odd with the
    word kept, the room, gen even again with the new word); each reads the head it
    rewrites when it runs."""
    def odd() -> None:
        head = int(tab.heads[slot])
        tab.heads[slot] = ((head >> GEN_SHIFT) + 1 & _LOW) << GEN_SHIFT | head & _LOW

    def put() -> None:
        tab.rooms[slot] = room

    def even() -> None:
        head = int(tab.heads[slot])
        tab.heads[slot] = ((head >> GEN_SHIFT) + 1 & _LOW) << GEN_SHIFT | word

    return [odd, put, even]


class Recorder:
    """The table as :class:`SlotMap` sees it, every write kept as its stores (not run)."""

    def __init__(self, tab: StatusTable) -> None:
        self.tab = tab
        self.pending: list[Store] = []

    def bucket(self, room: int) -> range:
        return self.tab.bucket(room)

    def write(self, slot: int, room: int, word: int) -> None:
        self.pending += stores(self.tab, slot, room, word)

    def take(self) -> list[Store]:
        out, self.pending = self.pending, []
        return out


def writer(tab: StatusTable) -> tuple[SlotMap, Recorder]:
    """kvd's slot map over ``tab``, its writes recorded (run them with :func:`run`)."""
    rec = Recorder(tab)
    return SlotMap(rec), rec  # type: ignore[arg-type]


def run(batch: list[Store]) -> None:
    for store in batch:
        store()


def answers(tab: StatusTable) -> dict[int, set[tuple[int, bool]]]:
    """What a reader that loads the whole table at once takes from it: per room, the
    ``(status, releasable)`` of each slot that names it, gen even and occupied."""
    out: dict[int, set[tuple[int, bool]]] = {}
    for head, room in zip(tab.heads.tolist(), tab.rooms.tolist(), strict=True):
        if head & (1 << GEN_SHIFT | OCCUPIED) == OCCUPIED:
            out.setdefault(room, set()).add(((head & CODE_MASK) - 1, bool(head & RELEASABLE)))
    return out


class Race:
    """Runs ``batches[i]`` of stores just before the read's i-th load -- a gather of the
    vectorised read, or one word of the plain-Python one (:meth:`StatusTable.read_few`)
    -- and keeps, in :attr:`seen`, what each room may read: its :func:`answers` in every
    state from the first load to the last (after the first batch, then after each store).
    Loads past the last batch run none; batches past the last load never run. ``quiet``:
    no store ran after the first load. :meth:`done` makes the table read plainly again."""

    def __init__(self, tab: StatusTable, batches: list[list[Store]]) -> None:
        self.tab, self.batches = tab, list(batches)
        self.seen: dict[int, set[tuple[int, bool]]] = {}
        self.loads, self.quiet = 0, True
        self.plain = tab.head_rows, tab.room_rows, tab.q
        tab.head_rows = _Racing(self, tab.head_rows)  # type: ignore[assignment]
        tab.room_rows = _Racing(self, tab.room_rows)  # type: ignore[assignment]
        tab.q = _RacingWords(self, tab.q)  # type: ignore[assignment]

    def load(self) -> None:
        first, self.loads = self.loads == 0, self.loads + 1
        for store in self.batches.pop(0) if self.batches else ():
            store()
            if not first:
                self.quiet = False
                self._note()
        if first:
            self._note()

    def done(self) -> None:
        self.tab.head_rows, self.tab.room_rows, self.tab.q = self.plain  # type: ignore[assignment]

    def _note(self) -> None:
        for room, got in answers(self.tab).items():
            self.seen.setdefault(room, set()).update(got)


class _Racing:
    """A table's bucket rows whose ``take`` first runs the race's next batch of stores."""

    def __init__(self, race: Race, rows: np.ndarray) -> None:
        self.race, self.rows = race, rows

    def take(self, at: Any, axis: int = 0) -> np.ndarray:
        self.race.load()
        return self.rows.take(at, axis=axis)


class _RacingWords:
    """A table's words as Python ints whose every load first runs the next batch."""

    def __init__(self, race: Race, q: memoryview) -> None:
        self.race, self.q = race, q

    def __getitem__(self, at: int) -> int:
        self.race.load()
        return int(self.q[at])
