"""When each room next needs the sweep's attention: a deadline heap (PURE, K41).

A machine's ``tick(now)`` used to walk every room it held, every sweep (0.1 s), to
find the few past a deadline: with thousands of rooms that was most of an idle
daemon's CPU. :class:`Deadlines` keeps, per room incarnation, the earliest instant
at which its state may need a decision (a state deadline, its pages turning
releasable, its expiry) and hands back only those that are due. The machine stays
the judge: a due room is re-examined with exactly the rules the walk applied, so a
tick makes the same decisions at the same ``now`` as the walk did (tested against
the walk in ``tests/unit/rooms/test_rooms_deadlines.py``).

Entries are never removed early: a room whose due time moved is scheduled again
at the earlier time (an entry for a later time stays and is skipped when it comes
up), and a room that is gone or a newer incarnation is skipped when it comes up.
Every entry comes up once, so the heap holds at most one entry per schedule call
made since its time passed.
"""

from __future__ import annotations

import heapq
import math

#: A room incarnation: (room id, incarnation or attempt number).
Key = tuple[int, int]


def after(t: float) -> float:
    """The first float later than ``t``: a rule ``now > t`` is due at ``after(t)`` under
    the heap's ``when <= now`` (exactly, with no rounding between the two)."""
    return math.nextafter(t, math.inf)


class Deadlines:
    """A min-heap of ``(when, room, inc)``, at most one live entry per incarnation.

    Times are the machine's monotonic seconds. :meth:`schedule` keeps the earliest of
    what is asked; :meth:`due` pops every incarnation whose time is ``<= now``.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._when: dict[Key, float] = {}  # the live entry of each incarnation

    def __len__(self) -> int:
        """Incarnations with a live entry."""
        return len(self._when)

    def schedule(self, room: int, inc: int, when: float | None) -> None:
        """``room`` incarnation ``inc`` needs a look at ``when`` (None: nothing due), or
        earlier if already scheduled earlier."""
        if when is None:
            return
        key = (room, inc)
        known = self._when.get(key)
        if known is not None and known <= when:
            return
        self._when[key] = when
        heapq.heappush(self._heap, (when, room, inc))

    def due(self, now: float) -> list[Key]:
        """Pop and return every incarnation whose live entry's time is ``<= now``, earliest
        first; each comes up once (it must be scheduled again to come up again)."""
        heap, when, out = self._heap, self._when, []
        while heap and heap[0][0] <= now:
            t, room, inc = heapq.heappop(heap)
            key = (room, inc)
            if when.get(key) == t:  # else: superseded by an earlier entry, already handled
                del when[key]
                out.append(key)
        return out

    def forget(self, room: int, inc: int) -> None:
        """Drop the live entry of ``room`` incarnation ``inc`` (its heap entry is skipped
        when it comes up)."""
        self._when.pop((room, inc), None)

    def clear(self) -> None:
        self._heap.clear()
        self._when.clear()
