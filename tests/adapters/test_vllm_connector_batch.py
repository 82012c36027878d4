"""The vLLM connector's worker side batching its room calls per step (issue 21 item 3),
against real daemons over Mooncake TCP loopback (engine stand-ins' memory): socket round
trips per step counted, bytes compared, refusals failing their room in the same step."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvd.client import KVPoll
from kvd.refengine.standin import EngineStandIn
from tests.conftest import PdPair, start_pair, stop_pair

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here: run `make test-vllm`"),
]

BOUND = 30.0
ROOMS = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    # no aux buffers, as vLLM's connector registers (it names aux slot 0 for every room)
    p = start_pair(tmp_path_factory.mktemp("batch"), engine_opts={"use_ring": True,
                                                                   "aux_slots": 0})
    yield p
    stop_pair(p)


class Counted:
    """A connector worker over a stand-in engine's client; its socket round trips by call."""

    def __init__(self, engine: EngineStandIn, batch: bool, monkeypatch: pytest.MonkeyPatch,
                 producer: bool = False, ring: bool = False) -> None:
        from kvd.adapters.vllm.connector import _Worker
        from kvd.adapters.vllm.spec import ConnectorConfig
        from kvd.adapters.vllm.stats import KvdConnectorStats

        w = _Worker.__new__(_Worker)
        extra = {"kvd_socket": engine.client.path, "batch": batch,
                 **({"bootstrap_addr": "h:1"} if producer else {})}
        w.config = ConnectorConfig.from_extra(extra, producer)
        w.client, w.transfers, w.owner, w.stats = engine.client, {}, {}, KvdConnectorStats()
        self.worker, self.calls = w, list[str]()
        real = engine.client._roundtrip

        def counted(call: Any, *args: Any, **kw: Any) -> Any:
            self.calls.append(type(call).__name__)
            return real(call, *args, **kw)

        monkeypatch.setattr(engine.client, "_roundtrip", counted)
        if not ring:  # as the connector's worker opens its client: without a ring
            monkeypatch.setattr(engine.client, "_usable_ring", lambda: None)

    def step(self, meta: Any) -> tuple[list[str], Any]:
        """One engine step: start_load_kv then get_transfer_results; its round trips."""
        self.calls.clear()
        self.worker.start(meta)
        out = self.worker.results(False)
        return list(self.calls), out


def _tasks(pair: PdPair, base: int) -> tuple[Any, Any, dict[int, list[int]],
                                             dict[int, list[int]]]:
    from kvd.adapters.vllm.connector import KvdConnectorMetadata, RecvTask, SendTask

    pe, de = pair.p_engine, pair.d_engine
    rooms = range(base, base + ROOMS)
    src = {r: [(r * 3 + i) % pe.num_pages for i in range(4)] for r in rooms}
    dst = {r: [(r * 5 + i) % de.num_pages for i in range(4)] for r in rooms}
    p_meta = KvdConnectorMetadata(sends=[SendTask(f"p{r}", (r,), src[r]) for r in rooms])
    d_meta = KvdConnectorMetadata(recvs=[RecvTask(f"d{r}", r, pair.bootstrap, dst[r])
                                         for r in rooms])
    return p_meta, d_meta, src, dst


def _until_finished(c: Counted, want: set[str], first: Any = None
                    ) -> tuple[set[str], list[list[str]]]:
    """Steps with no new work until every request of ``want`` finished (``first``: the
    results of the step that started them)."""
    from kvd.adapters.vllm.connector import KvdConnectorMetadata

    done: set[str] = set()
    if first is not None:
        assert not first.failed_recving  # a room refused in the step that started it
        done |= first.finished_sending | first.finished_recving
    steps: list[list[str]] = []
    deadline = time.monotonic() + BOUND
    while done != want:
        assert time.monotonic() < deadline, f"not finished within {BOUND}s: {want - done}"
        calls, out = c.step(KvdConnectorMetadata())
        steps.append(calls)
        done |= out.finished_sending | out.finished_recving
        assert not out.failed_recving
        time.sleep(0.005)
    return done, steps


@pytest.mark.parametrize(("batch", "ring"), [(True, False), (True, True), (False, False)])
def test_a_step_of_rooms_costs_round_trips_per_step_not_per_room(
        pair: PdPair, monkeypatch: pytest.MonkeyPatch, batch: bool, ring: bool) -> None:
    """Six requests each way started in one step: batched, two ``Many`` start them (no
    socket round trip at all through a ring) and a step where no room ended reads the
    status table only; one RPC per room call and a Poll per step without ``batch``.
    Every page arrives byte for byte either way."""
    p_meta, d_meta, src, dst = _tasks(pair, 9100 + 100 * (2 * batch + ring))
    pw = Counted(pair.p_engine, batch, monkeypatch, producer=True, ring=ring)
    dw = Counted(pair.d_engine, batch, monkeypatch, ring=ring)
    d_calls, d_first = dw.step(d_meta)
    p_calls, p_first = pw.step(p_meta)
    if batch:
        assert d_calls.count("ReceiverCreate") + d_calls.count("ReceiverInit") == 0
        assert p_calls.count("SenderCreate") + p_calls.count("SenderSend") == 0
        many = 0 if ring else 2  # creates, then inits and sends (+ clears if one ended)
        for calls in (d_calls, p_calls):
            assert many <= calls.count("Many") <= many + 1, calls
        assert d_calls.count("Poll") <= 1 and p_calls.count("Poll") <= 1
    else:
        assert d_calls.count("ReceiverCreate") == ROOMS == d_calls.count("ReceiverInit")
        assert p_calls.count("SenderSend") == ROOMS
    _, d_steps = _until_finished(dw, {f"d{r}" for r in src}, d_first)
    _, p_steps = _until_finished(pw, {f"p{r}" for r in src}, p_first)
    for r in src:
        assert pair.d_engine.pages_equal(pair.p_engine, src[r], dst[r]), f"room {r}"
    per_step = max(len(s) for s in d_steps + p_steps)
    print(f"\nbatch={batch} ring={ring}: start step RPCs p={len(p_calls)} d={len(d_calls)}; "
          f"most RPCs in a later step {per_step}; steps {len(d_steps)}/{len(p_steps)}")
    if batch:
        assert per_step <= 2  # one Poll for the rooms that ended, one Many of clears
        idle = [s for s in d_steps + p_steps if not s]
        assert idle or len(d_steps) + len(p_steps) <= 2
    assert not pw.worker.owner and not dw.worker.owner


@pytest.mark.parametrize("ring", [False, True])
def test_a_refused_create_or_send_fails_its_room_in_the_same_step(
        pair: PdPair, monkeypatch: pytest.MonkeyPatch, ring: bool) -> None:
    """Batched: a room kvd already holds (its create refused) fails at once without an init
    reaching kvd's room, and a send naming a page beyond the pool fails its room at once
    and aborts it; the other room of the step moves byte for byte."""
    from kvd.adapters.vllm.connector import KvdConnectorMetadata, SendTask
    from kvd.client import Sender

    pe = pair.p_engine
    base = 9810 if ring else 9800
    held = Sender(pe.client, base + 1)  # another user of that room in this kvd
    pw = Counted(pe, True, monkeypatch, producer=True, ring=ring)
    meta = KvdConnectorMetadata(sends=[SendTask("dup", (base + 1,), [1, 2]),
                                       SendTask("bad", (base + 2,), [1, pe.num_pages + 3]),
                                       SendTask("ok", (base + 3,), [4, 5])])
    pw.worker.start(meta)
    t = pw.worker.transfers
    assert t["dup"].rooms[0].state == KVPoll.Failed and t["dup"].rooms[0].kind == "engine"
    assert t["bad"].rooms[0].state == KVPoll.Failed and t["bad"].rooms[0].reason
    assert t["ok"].rooms[0].state is None and set(pw.worker.owner) == {base + 3}
    assert held.poll() == KVPoll.Bootstrapping  # no init or send reached the held room
    assert pe.client.submit_all([]) == {}
    out = pw.worker.results(False)
    assert {"dup", "bad"} <= out.finished_sending
    held.clear()
    pw.worker.transfers["ok"].rooms[0].obj.abort("test over")  # no decode for it
    _until_finished(pw, {"ok"})
