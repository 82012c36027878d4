"""Which layers of which room pages the engine has handed to kvd (layer streaming). PURE.

A prefill engine may hand a room's KV layer by layer as its forward pass computes it
(issue 22 item 4, :meth:`kvd.rooms.sender.SenderRooms.send` with ``layers``). The sender
machine keeps one :class:`Coverage` per room: the room's page positions (0, 1, ... in
the order the engine named the pages) as runs ``[start, end)``, each with the set of
layers named for it as a bit mask (bit ``l``: local layer ``l`` of this rank's pool).
Every (page, layer) cell may be named once; the room may end (its last send, which
carries aux) only once every cell of every page is named.

Runs are split where a send names part of a run and joined again where neighbours
agree, so a room streamed layer by layer, chunk after chunk, holds a handful of runs
whatever its page count (SGLang's page size 1 gives rooms of 100 000 pages).
"""

from __future__ import annotations

import bisect

import numpy as np

from kvd.transfer.plan import Pages

#: Runs of room positions ``(start, end)``, ascending and disjoint.
Runs = list[tuple[int, int]]


def layer_mask(lo: int, hi: int) -> int:
    """Bit mask of layers ``[lo, hi)``."""
    return ((1 << hi) - 1) ^ ((1 << lo) - 1)


def _layer_list(mask: int) -> str:
    """Layers of a bit mask as ranges: ``0-2, 5``."""
    out, bit = [], 0
    while mask >> bit:
        if not mask >> bit & 1:
            bit += 1
            continue
        end = bit
        while mask >> (end + 1) & 1:
            end += 1
        out.append(str(bit) if end == bit else f"{bit}-{end}")
        bit = end + 1
    return ", ".join(out)


def runs_of(positions: Pages) -> Runs:
    """Ascending distinct room positions (int64) as maximal runs ``[start, end)``."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [positions.size]))
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in
            zip(starts.tolist(), ends.tolist(), strict=True)]


def positions_of(runs: Runs) -> Pages:
    """Runs back to int64 room positions, ascending."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs])


class Coverage:
    """The (page, layer) cells of one room named so far, over ``num_layers`` layers.

    :meth:`add` appends new pages, :meth:`mark` names layers of pages already added;
    both refuse a cell named twice. Reads: :meth:`open_runs` (pages missing a layer),
    :meth:`complete_prefix` (leading pages with every layer), :meth:`first_gap`.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.full = layer_mask(0, num_layers)
        self._starts: list[int] = []  # run starts, ascending; run i is [starts[i], ends[i])
        self._ends: list[int] = []
        self._masks: list[int] = []

    @property
    def size(self) -> int:
        """Pages named so far (room positions ``[0, size)``)."""
        return self._ends[-1] if self._ends else 0

    def add(self, n: int, mask: int) -> None:
        """Append ``n`` new pages with layers ``mask`` named."""
        if n <= 0:
            return
        start = self.size
        if self._masks and self._masks[-1] == mask:
            self._ends[-1] = start + n
            return
        self._starts.append(start)
        self._ends.append(start + n)
        self._masks.append(mask)

    def clash(self, runs: Runs, mask: int) -> tuple[int, int] | None:
        """``(position, layer)`` of the first cell of ``runs`` x ``mask`` already named,
        or None. ``runs`` must lie in ``[0, size)``."""
        for a, b in runs:
            i = bisect.bisect_right(self._starts, a) - 1
            while i < len(self._starts) and self._starts[i] < b:
                both = self._masks[i] & mask
                if both:
                    layer = (both & -both).bit_length() - 1
                    return max(a, self._starts[i]), layer
                i += 1
        return None

    def mark(self, runs: Runs, mask: int) -> None:
        """Name layers ``mask`` of the pages in ``runs`` (check :meth:`clash` first)."""
        for a, b in runs:
            self._split(a)
            self._split(b)
            i = bisect.bisect_left(self._starts, a)
            while i < len(self._starts) and self._starts[i] < b:
                self._masks[i] |= mask
                i += 1
        self._join()

    def open_runs(self) -> Runs:
        """Runs of pages that miss at least one layer."""
        return [(a, b) for a, b, m in zip(self._starts, self._ends, self._masks, strict=True)
                if m != self.full]

    def complete_prefix(self) -> int:
        """How many leading pages have every layer named."""
        for a, m in zip(self._starts, self._masks, strict=True):
            if m != self.full:
                return a
        return self.size

    def layer_prefixes(self) -> Pages:
        """int64 ``[num_layers]``: per layer, how many leading pages have it named (re-tiled
        rooms write a layer's tokens up to there, :meth:`SenderRooms.send`)."""
        out = np.full(self.num_layers, self.size, dtype=np.int64)
        open_ = self.full  # layers named on every page so far
        for a, m in zip(self._starts, self._masks, strict=True):
            stop = open_ & ~m
            while stop:
                low = stop & -stop
                out[low.bit_length() - 1] = a
                stop ^= low
            open_ &= m
            if not open_:
                break
        return out

    def gaps(self, most: int = 4) -> str:
        """Which pages miss which layers, for a message: up to ``most`` runs as ``room pages
        [0, 4) miss layers 2-5`` joined by ``; `` (``...`` when there are more); empty when
        every cell is named."""
        parts: list[str] = []
        for a, b, m in zip(self._starts, self._ends, self._masks, strict=True):
            missing = self.full & ~m
            if not missing:
                continue
            if len(parts) == most:
                parts.append("...")
                break
            pages = f"room page {a} misses" if b == a + 1 else f"room pages [{a}, {b}) miss"
            parts.append(f"{pages} layer{'s' if missing & (missing - 1) else ''} "
                         f"{_layer_list(missing)}")
        return "; ".join(parts)

    def first_gap(self) -> tuple[int, int] | None:
        """``(position, layer)`` of the first cell not named yet, or None."""
        for a, m in zip(self._starts, self._masks, strict=True):
            missing = self.full & ~m
            if missing:
                return a, (missing & -missing).bit_length() - 1
        return None

    def _split(self, at: int) -> None:
        """Make ``at`` a run boundary (no-op at an existing boundary or outside)."""
        i = bisect.bisect_right(self._starts, at) - 1
        if i < 0 or at <= self._starts[i] or at >= self._ends[i]:
            return
        self._starts.insert(i + 1, at)
        self._ends.insert(i + 1, self._ends[i])
        self._masks.insert(i + 1, self._masks[i])
        self._ends[i] = at

    def _join(self) -> None:
        """Merge neighbouring runs with equal masks."""
        s: list[int] = []
        e: list[int] = []
        m: list[int] = []
        for a, b, k in zip(self._starts, self._ends, self._masks, strict=True):
            if m and m[-1] == k and e[-1] == a:
                e[-1] = b
            else:
                s.append(a)
                e.append(b)
                m.append(k)
        self._starts, self._ends, self._masks = s, e, m
