"""Which live room holds each destination region of a decode rank (K42). PURE.

A room names destination regions of its decode rank's registered memory: KV pages, an
aux slot and, for hybrid models, a state slot and window pages. Each region kind is an
index space of its own (page ``3`` and window page ``3`` are different memory). Two rooms
whose writes may still land must never name one region: the second room's bytes (or the
first's late ones) would overwrite the other's, and both would report Success with one
room's KV, state or first token silently lost.

:class:`Claims` is one table keyed by ``(region kind, index)`` for every kind: a kind added
later is one more entry in :data:`REGION_KINDS`, not one more check. An entry names the
``(room, incarnation)`` that claimed it; whether that room still holds it is asked of the
caller when a later claim meets it (``live``), so the table needs no update when a room's
regions free up (the receiver's release rule: Success, or failed with nothing in flight,
K06/K22). A region is claimed only when its kind has a registered size (a kind the engine
registered none of names no memory here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from kvd.errors import RoomError
from kvd.transfer.plan import Pages

PAGE = "page"
AUX = "aux slot"
STATE = "state slot"
WINDOW = "window page"
#: The destination region kinds a room names today, in the order init checks them. A kind
#: is any name: a new kind of memory (another paged pool) is a new name, no new check.
REGION_KINDS = (PAGE, AUX, STATE, WINDOW)

#: ``(room, incarnation)`` of a claim.
Owner = tuple[int, int]
#: Regions of one kind a room names at most for the Python path (an aux slot, a state
#: slot, a few pages); more go through numpy.
SMALL = 16


class Claims:
    """``(region kind, index) -> (room, incarnation)`` for one registered pool.

    ``sizes``: regions of each kind the pool holds (pages, aux slots, state slots, window
    pages); a kind absent or of size 0 is not claimed. Memory per region: the room (uint64:
    a room id is any 64-bit unsigned integer, ``2**64 - 1`` included, case S19), the
    incarnation (int64) and whether it is claimed (bool; no room id is free to be a
    sentinel).
    """

    def __init__(self, sizes: Mapping[str, int] | None = None) -> None:
        self.sizes: dict[str, int] = {}
        self._room: dict[str, np.ndarray] = {}
        self._inc: dict[str, np.ndarray] = {}
        self._held: dict[str, np.ndarray] = {}
        self.reset(sizes or {})

    def reset(self, sizes: Mapping[str, int]) -> None:
        """A new pool (or none: ``{}``): every claim is dropped."""
        self.sizes = {k: int(n) for k, n in sizes.items() if n > 0}
        self._room = {k: np.zeros(n, dtype=np.uint64) for k, n in self.sizes.items()}
        self._inc = {k: np.zeros(n, dtype=np.int64) for k, n in self.sizes.items()}
        self._held = {k: np.zeros(n, dtype=bool) for k, n in self.sizes.items()}

    def check(self, room: int, regions: Mapping[str, Pages],
              live: Callable[[int, int], bool]) -> None:
        """Refuse a claim of ``regions`` (kind -> int64 indices) by ``room``: an index
        outside its kind's size, one named twice, or one whose holder is ``live(room,
        inc)`` (its writes may still land). Raises :class:`RoomError` naming the kind,
        the index, its position and the holding room; claims nothing."""
        for kind, idx in regions.items():
            n = self.sizes.get(kind)
            if n is None or idx.size == 0:
                continue
            if idx.size <= SMALL:  # an aux or state slot, a few pages: no numpy per call
                self._check_small(room, kind, idx.tolist(), n, live)
                continue
            what = f"room {room} destination {kind}"
            if int(idx.min()) < 0 or int(idx.max()) >= n:
                k = int(np.flatnonzero((idx < 0) | (idx >= n))[0])
                raise RoomError(f"{what} {int(idx[k])} (position {k}) outside [0, {n})")
            twice = _named_twice(idx)
            if twice is not None:
                i, a, b = twice
                raise RoomError(f"{what} {i} is named twice (positions {a} and {b}): a room's "
                                f"regions must be distinct")
            self._check_holders(room, kind, idx, live)

    def claim(self, owner: Owner, regions: Mapping[str, Pages],
              live: Callable[[int, int], bool]) -> None:
        """:meth:`check`, then record ``owner`` (room, incarnation) as the holder of every
        region named (all or nothing)."""
        self.check(owner[0], regions, live)
        for kind, idx in regions.items():
            if kind in self.sizes and idx.size:
                self._room[kind][idx] = owner[0]
                self._inc[kind][idx] = owner[1]
                self._held[kind][idx] = True

    def free(self, owner: Owner, regions: Mapping[str, Pages]) -> None:
        """Drop ``owner``'s claims on ``regions`` (those another room claimed since stay)."""
        for kind, idx in regions.items():
            n = self.sizes.get(kind)
            if n is None or idx.size == 0:
                continue
            rooms, incs, held = self._room[kind], self._inc[kind], self._held[kind]
            if idx.size <= SMALL:
                for i in idx.tolist():
                    if 0 <= i < n and held[i] and int(rooms[i]) == owner[0] and \
                            incs[i] == owner[1]:
                        held[i] = False
                continue
            if int(idx.max()) >= n:  # named in a pool registered before this one
                continue
            mine = held[idx] & (rooms[idx] == np.uint64(owner[0])) & (incs[idx] == owner[1])
            held[idx[mine]] = False

    def _check_small(self, room: int, kind: str, idx: list[int], n: int,
                     live: Callable[[int, int], bool]) -> None:
        """:meth:`check` of one kind's few indices, in Python (same refusals)."""
        what = f"room {room} destination {kind}"
        seen: dict[int, int] = {}
        for k, i in enumerate(idx):
            if not 0 <= i < n:
                raise RoomError(f"{what} {i} (position {k}) outside [0, {n})")
            if i in seen:
                raise RoomError(f"{what} {i} is named twice (positions {seen[i]} and {k}): a "
                                f"room's regions must be distinct")
            seen[i] = k
        rooms, incs, claimed = self._room[kind], self._inc[kind], self._held[kind]
        for k, i in enumerate(idx):
            if claimed[i] and live(other := int(rooms[i]), int(incs[i])):
                raise RoomError(_held(room, kind, i, k, other))

    def holders(self, kind: str) -> dict[int, Owner]:
        """``index -> owner`` of every claimed region of ``kind`` (tests, diagnostics)."""
        if kind not in self.sizes:
            return {}
        held = np.flatnonzero(self._held[kind])
        return {int(i): (int(self._room[kind][i]), int(self._inc[kind][i])) for i in held}

    def _check_holders(self, room: int, kind: str, idx: Pages,
                       live: Callable[[int, int], bool]) -> None:
        owners, incs = self._room[kind][idx], self._inc[kind][idx]
        named = np.flatnonzero(self._held[kind][idx])
        if not named.size:
            return
        # the distinct owners as Python ints (a uint64 and an int64 column stacked would
        # be float64: room ids past 2**53 would merge)
        pairs = sorted(set(zip(owners[named].tolist(), incs[named].tolist(), strict=True)))
        held = [(o, i) for o, i in pairs if live(o, i)]
        if not held:
            return
        mask = np.zeros(named.size, dtype=bool)
        for o, i in held:
            mask |= (owners[named] == o) & (incs[named] == i)
        k = int(named[np.flatnonzero(mask)[0]])  # the first position a live room holds
        raise RoomError(_held(room, kind, int(idx[k]), k, int(owners[k])))


def _held(room: int, kind: str, index: int, position: int, other: int) -> str:
    return (f"room {room} destination {kind} {index} (position {position}) is held by room "
            f"{other}, which is live on this decode rank (its writes may still land): two "
            f"live rooms must not name one {kind}")


def _named_twice(idx: Pages) -> tuple[int, int, int] | None:
    """``(index, first position, second position)`` of the smallest index ``idx`` (int64
    ``[n]``) names twice, or None."""
    if idx.size < 2:
        return None
    order = np.argsort(idx, kind="stable")
    s = idx[order]
    dup = np.flatnonzero(s[1:] == s[:-1])
    if not dup.size:
        return None
    k = int(dup[0])
    first, second = sorted((int(order[k]), int(order[k + 1])))
    return int(s[k]), first, second
