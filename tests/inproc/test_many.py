"""``Many``: several engine calls in one round trip, answered exactly as if sent one by
one (in-process tier: the daemon's dispatch, fake fabric, fake clock)."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from tests.inproc.harness import SUCCESS, Cluster, Engine, same_pages, settle

ROOMS = st.integers(1, 4)
PAGES = st.lists(st.integers(0, 31), min_size=1, max_size=3)

PREFILL_CALLS = st.one_of(
    ROOMS.map(lambda r: rpc.SenderCreate(room=r)),
    st.builds(lambda r, n, a: rpc.SenderInit(room=r, num_pages=n, aux_index=a), ROOMS,
              st.integers(-1, 4), st.integers(-1, 5)),
    st.builds(lambda r, p, last: rpc.SenderSend(room=r, pages=pack_indices(p), is_last=last),
              ROOMS, PAGES, st.booleans()),
    ROOMS.map(lambda r: rpc.Abort(room=r, reason="test")),
    ROOMS.map(lambda r: rpc.Clear(room=r)),
    st.lists(ROOMS, max_size=5).map(lambda rs: rpc.Poll(rooms=rs)),
)


def decode_calls(bootstrap: str) -> st.SearchStrategy[rpc.NowCall]:
    return st.one_of(
        ROOMS.map(lambda r: rpc.ReceiverCreate(room=r, bootstrap_addr=bootstrap)),
        st.builds(lambda r, p, a: rpc.ReceiverInit(room=r, dst_pages=pack_indices(p),
                                                   aux_index=a), ROOMS, PAGES,
                  st.integers(-1, 5)),
        ROOMS.map(lambda r: rpc.Abort(room=r, reason="test")),
        ROOMS.map(lambda r: rpc.Clear(room=r)),
        st.lists(ROOMS, max_size=5).map(lambda rs: rpc.Poll(rooms=rs)),
    )


async def one_by_one(eng: Engine, calls: list[rpc.NowCall]) -> list[tuple[Any, ...]]:
    out = []
    for call in calls:
        try:
            out.append((True, msgspec.to_builtins(await eng.call(call)), ""))
        except Exception as exc:  # every refusal is compared
            kind, error = rpc.failure(exc)
            out.append((False, kind, error))
    return out


async def in_many(eng: Engine, calls: list[rpc.NowCall], cuts: list[int]
                  ) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    bounds = sorted({0, len(calls), *(c % (len(calls) + 1) for c in cuts)})
    for lo, hi in itertools.pairwise(bounds):
        result = await eng.call(rpc.Many(calls=calls[lo:hi]))
        out += [(True, msgspec.to_builtins(o.result), "") if o.ok else (False, o.kind, o.error)
                for o in result.outcomes]
    return out


async def both(role: str, draw: Any) -> None:
    answers = []
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        clusters = [Cluster(Path(a)), Cluster(Path(b))]
        try:
            engines = []
            for c in clusters:
                p = await c.node("prefill")
                node = p if role == "prefill" else await c.node("decode")
                engines.append(await node.engine(seed=1))
            strategy = PREFILL_CALLS if role == "prefill" else decode_calls(p.http_addr)
            calls = draw(st.lists(strategy, min_size=1, max_size=25))
            cuts = draw(st.lists(st.integers(0, 30), max_size=3))
            answers.append(await one_by_one(engines[0], calls))
            answers.append(await in_many(engines[1], calls, cuts))
        finally:
            for c in clusters:
                await c.stop()
    assert answers[0] == answers[1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_many_answers_every_call_as_if_sent_alone(role: str, data: st.DataObject) -> None:
    """Any sequence of room calls (valid or refused) cut into Many frames anywhere gets
    the same results and the same refusals, in order, as the calls sent one by one."""
    asyncio.run(both(role, data.draw))


async def test_many_moves_rooms_byte_exact(cluster: Cluster) -> None:
    """Eight rooms started in one Many per side (decode: create + init; prefill: create +
    init + send) all succeed, every page byte-exact; one Many clears them."""
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    rooms = list(range(10, 18))
    res = await de.call(rpc.Many(calls=[c for r in rooms for c in (
        rpc.ReceiverCreate(room=r, bootstrap_addr=p.http_addr),
        rpc.ReceiverInit(room=r, dst_pages=pack_indices([r - 10]), aux_index=r - 10))]))
    assert all(o.ok for o in res.outcomes)
    res = await pe.call(rpc.Many(calls=[c for r in rooms for c in (
        rpc.SenderCreate(room=r), rpc.SenderInit(room=r, num_pages=1, aux_index=r - 10),
        rpc.SenderSend(room=r, pages=pack_indices([r + 5]), is_last=True))]))
    assert all(o.ok for o in res.outcomes)
    await settle(cluster)
    polled = await de.call(rpc.Many(calls=[rpc.Poll(rooms=rooms)]))
    assert polled.outcomes[0].result.statuses == [SUCCESS] * len(rooms)
    assert same_pages(de, pe, [r + 5 for r in rooms], [r - 10 for r in rooms])
    cleared = await de.call(rpc.Many(calls=[rpc.Clear(room=r) for r in rooms]))
    assert all(o.ok for o in cleared.outcomes)
    assert (await de.poll(rooms[0])).statuses == [-1]


async def test_a_refused_call_leaves_the_rest_of_the_many(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    res = await pe.call(rpc.Many(calls=[
        rpc.SenderCreate(room=1), rpc.SenderCreate(room=1),  # the second is refused
        rpc.SenderInit(room=1, num_pages=1, aux_index=0),
        rpc.SenderSend(room=2, pages=pack_indices([1]), is_last=True),  # unknown room
        rpc.Poll(rooms=[1, 2])]))
    oks = [o.ok for o in res.outcomes]
    assert oks == [True, False, True, False, True]
    assert res.outcomes[1].kind == "RoomError" and "room 1" in res.outcomes[1].error
    assert res.outcomes[4].result.statuses[1] == -1


async def test_a_many_above_the_limit_is_refused_whole(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    with pytest.raises(ProtocolError, match="at most"):
        await pe.call(rpc.Many(calls=[rpc.Poll(rooms=[])] * (rpc.MAX_MANY + 1)))
    assert (await pe.poll(1)).statuses == [-1]


async def test_a_many_polling_too_many_rooms_is_refused_whole(cluster: Cluster) -> None:
    """The same failed room (a long reason) polled by every call of a Many would answer a
    small request with a huge reply (the reason once per Poll): over MAX_MANY_POLLED
    rooms in its polls the Many is refused before anything of it runs."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    await pe.call(rpc.SenderCreate(room=5))
    await pe.call(rpc.Abort(room=5, reason="x" * 64))
    per = rpc.MAX_MANY_POLLED // (rpc.MAX_MANY - 1)
    polls = [rpc.Poll(rooms=[5] * per)] * (rpc.MAX_MANY - 1)
    res = await pe.call(rpc.Many(calls=[rpc.SenderCreate(room=6), *polls]))  # at the limit
    assert res.outcomes[0].ok and all(o.ok for o in res.outcomes)
    over = [rpc.SenderCreate(room=7), *polls, rpc.Poll(rooms=[5] * (per + 1))]
    with pytest.raises(ProtocolError, match="at most"):
        await pe.call(rpc.Many(calls=over))
    assert (await pe.poll(7)).statuses == [-1]  # nothing of it ran


@pytest.mark.parametrize("inner", [
    rpc.Wait(rooms=[1], timeout=1.0), rpc.Info(), rpc.Release(),
    rpc.Many(calls=[rpc.Poll(rooms=[])]),
])
def test_many_carries_only_calls_answered_at_once(inner: rpc.Call) -> None:
    """A Wait, registration, Info, Release or nested Many inside a Many is refused when
    the frame is decoded: nothing of it runs."""
    frame = rpc.encode(rpc.Request(id=1, call=rpc.Many(calls=[inner])))  # type: ignore[list-item]
    with pytest.raises(ProtocolError):
        rpc.decode_request(frame[rpc.LENGTH.size:])
