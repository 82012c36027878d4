"""In-process tier: K42 (every byte written exactly once) through the daemons' dispatch --
the engine sees init/send refusals as RoomError, a refused plan fails the room with kind
``layout`` on both sides, and a room next to the refused ones moves byte for byte."""

from __future__ import annotations

import pytest

from kvd.errors import RoomError
from kvd.transfer.layout import PairPlan
from kvd.transfer.plan import Descriptors
from tests.inproc.harness import FAILED, SUCCESS, Cluster, same_pages, settle


async def pair(cluster: Cluster):  # type: ignore[no-untyped-def]
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    return p, d, await p.engine(seed=1), await d.engine(seed=2)


async def test_k42_init_with_a_page_twice_is_refused_and_a_good_room_moves(
        cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    with pytest.raises(RoomError, match=r"page 10 is named twice \(positions 0 and 2\)"):
        await de.receiver(1, [10, 11, 10], p.http_addr)
    await de.init(1, [10, 11, 12])  # the same room, distinct pages: accepted
    await pe.sender(1, [3, 4, 5])
    await settle(cluster)
    assert await de.status(1) == SUCCESS and same_pages(de, pe, [3, 4, 5], [10, 11, 12])


async def test_k42_overlapping_live_rooms_are_refused_until_the_first_is_done(
        cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    await de.receiver(1, [5, 6], p.http_addr)
    with pytest.raises(RoomError, match=r"page 6 \(position 0\) is held by room 1"):
        await de.receiver(2, [6, 7], p.http_addr)
    await pe.sender(1, [1, 2])
    await settle(cluster)
    assert await de.status(1) == SUCCESS and same_pages(de, pe, [1, 2], [5, 6])
    await de.init(2, [6, 7])  # room 1 succeeded: its pages are the engine's again
    await pe.sender(2, [8, 9])
    await settle(cluster)
    assert await de.status(2) == SUCCESS and same_pages(de, pe, [8, 9], [6, 7])


async def test_k42_a_live_rooms_aux_slot_is_refused_and_each_first_token_lands_in_its_own(
        cluster: Cluster) -> None:
    """Two live rooms naming one aux slot: the second room's first token would overwrite
    the first's. The second is refused naming the slot and room 1; with a slot of its own
    both rooms move, each aux byte for byte in its own slot."""
    p, _d, pe, de = await pair(cluster)
    pe.pool.aux[1][:], pe.pool.aux[2][:] = 11, 22
    await de.receiver(1, [5, 6], p.http_addr, aux=3)
    with pytest.raises(RoomError, match=r"aux slot 3 \(position 0\) is held by room 1"):
        await de.receiver(2, [7, 8], p.http_addr, aux=3)
    await de.init(2, [7, 8], aux=4)
    await pe.sender(1, [1, 2], aux=1)
    await pe.sender(2, [3, 4], aux=2)
    await settle(cluster)
    assert [await de.status(r) for r in (1, 2)] == [SUCCESS, SUCCESS]
    assert same_pages(de, pe, [1, 2, 3, 4], [5, 6, 7, 8])
    assert (de.pool.aux[3] == 11).all() and (de.pool.aux[4] == 22).all()
    await de.receiver(3, [9], p.http_addr, aux=3)  # room 1 succeeded: its slot is free


async def test_k42_send_naming_a_source_page_twice_fails_the_room(cluster: Cluster) -> None:
    p, _d, pe, de = await pair(cluster)
    await de.receiver(3, [1, 2, 3], p.http_addr)
    with pytest.raises(RoomError, match="source page 4 is named twice"):
        await pe.sender(3, [4, 5, 4])
    await settle(cluster)
    assert await de.status(3) == FAILED
    kind, reason = await de.failure(3)
    assert kind == "layout" and "source page 4" in reason


async def test_k42_a_plan_that_misses_bytes_is_refused_with_kind_layout(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planner that loses one descriptor (a stand-in for any planning bug): the proof
    refuses it before any byte moves, naming the range, and both sides fail ``layout``."""
    p, _d, pe, de = await pair(cluster)
    real = PairPlan.plan

    def lossy(self: PairPlan, src: object, dst: object) -> Descriptors:
        d = real(self, src, dst)  # type: ignore[arg-type]
        return Descriptors(d.src[:-1], d.dst[:-1], d.length[:-1])

    monkeypatch.setattr(PairPlan, "plan", lossy)
    await de.receiver(4, [20, 21], p.http_addr)
    await pe.sender(4, [6, 7])
    await settle(cluster)
    assert await de.status(4) == FAILED
    kind, reason = await de.failure(4)
    assert kind == "layout" and "plan refused" in reason and "is written by no descriptor" \
        in reason and "page" in reason
    assert p.core.counters.bytes_sent == 0  # refused before anything was written
