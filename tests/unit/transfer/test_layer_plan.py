"""Plans restricted to a layer range (layer streaming, issue 22 item 4).

``PairPlan.layers(lo, hi)`` plans and proves one source's share of local layers
``[lo, hi)``. Over the plan proof's worlds (MHA/MLA, NHD/HND, hetero TP, PP stages, page
sizes, chunks with ``first_page``), every chunk written layer range by layer range is
accepted and a byte-level simulation shows each byte the decode reads written once and
nothing else; a plan of other layers is refused against the range's proof.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.control.routing import resolve_targets
from kvd.errors import LayoutError
from kvd.transfer.layout import PairPlan
from kvd.transfer.plan import U64, PlanRefused
from tests.unit.transfer.test_plan_proof import (
    World,
    chunk_pages,
    read_bytes,
    rooms,
    worlds,
    writes,
)


@settings(max_examples=150, deadline=None)
@given(worlds(), rooms(), st.data())
def test_i22_layer_range_plans_write_each_read_byte_once(
        w: World, room: tuple[np.ndarray, np.ndarray, int, list[int]],
        data: st.DataObject) -> None:
    src_pages, dst_pages, first, cuts = room
    for d in range(w.decode_tp):
        decode = w.decode(d)
        targets = resolve_targets(7, d, w.decode_tp, w.prefill_tp, 1, w.pp, w.mla)
        written = []
        for t in targets:
            if t.is_dummy:
                continue
            src = w.prefill(t.tp_rank, t.pp_rank)
            pair, nl = PairPlan.of(src, decode), src.num_layers
            for lo, hi in itertools.pairwise(cuts):
                sp, dp = chunk_pages(src_pages, dst_pages, first, lo, hi)
                lcuts = sorted(data.draw(st.sets(st.integers(1, nl - 1)))) if nl > 1 else []
                for a, b in itertools.pairwise([0, *lcuts, nl]):
                    sub = pair.layers(a, b)
                    desc = sub.plan(sp, dp)
                    sub.prove(desc, sp, dp, None, "room 7")  # accepted: no raise
                    written.append(writes(desc))
        got = np.sort(np.concatenate(written)) if written else np.zeros(0, U64)
        assert np.array_equal(got, np.sort(read_bytes(decode, dst_pages)))


def _pair() -> tuple[PairPlan, np.ndarray, np.ndarray]:
    w = World(False, "NHD", 1, 1, 4, 16, 4, (0, 4))
    return PairPlan.of(w.prefill(0, 0), w.decode(0)), np.array([3, 4, 7]), np.array([1, 2, 9])


def test_i22_a_plan_of_other_layers_is_refused_by_the_range_proof() -> None:
    pair, sp, dp = _pair()
    sub = pair.layers(1, 3)
    with pytest.raises(PlanRefused) as outside:  # every layer, proved as layers 1-2
        sub.prove(pair.plan(sp, dp), sp, dp, None, "room 7")
    assert outside.value.kind == "outside" and outside.value.lo == int(pair.d_ptr[0]) + 512
    with pytest.raises(PlanRefused) as uncovered:  # layers 1-2, proved as every layer
        pair.prove(sub.plan(sp, dp), sp, dp, None, "room 7")
    assert uncovered.value.kind == "uncovered"
    with pytest.raises(PlanRefused):  # the neighbouring range is not this one
        sub.prove(pair.layers(2, 4).plan(sp, dp), sp, dp, None, "room 7")


def test_i22_layer_ranges_outside_the_source_are_refused() -> None:
    pair, _, _ = _pair()
    assert pair.layers(0, 4) is pair
    assert pair.layers(1, 2) is pair.layers(1, 2)  # kept per range
    for lo, hi in [(0, 5), (2, 2), (-1, 1), (3, 1)]:
        with pytest.raises(LayoutError, match="outside the prefill's 4 layers"):
            pair.layers(lo, hi)
