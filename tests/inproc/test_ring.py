"""Room calls through the shared-memory submission ring (issue 21 step B), in process: real
daemons on one loop over fakes; the engine's end written here at the protocol level (its
own producer and consumer over the daemon's memfd), so the daemon's side is what is
tested, whatever the client library does."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.engine_rpc import ring as ring_module
from kvd.errors import ProtocolError, RpcError
from kvd.protocol import codec, rpc
from kvd.protocol.codec import pack_indices
from kvd.protocol.ring import Consumer, Producer, Ring
from kvd.rooms import KVPoll
from tests.inproc.harness import SUCCESS, Cluster, Engine, same_pages, settle, until
from tests.inproc.test_many import PREFILL_CALLS, decode_calls

ROOMS = [1, 2, 3, 4]
CREATES = (rpc.SenderCreate, rpc.ReceiverCreate)


class RingEngine:
    """The engine's end of one connection's rings, over the daemon's own memfd."""

    def __init__(self, eng: Engine, result: rpc.RingResult, fds: list[int]) -> None:
        self.eng = eng
        self.memfd, self.wake_kvd, self.wake_engine = fds
        self.map = mmap.mmap(self.memfd, result.size)
        half = result.size // 2
        self.sub = Ring.open(memoryview(self.map)[:half])
        self.comp = Ring.open(memoryview(self.map)[half:])
        self.out, self.inbox = Producer(self.sub), Consumer(self.comp)
        self.answers: dict[int, tuple[str, str]] = {}  # call id -> (kind, error)

    @classmethod
    async def open(cls, eng: Engine, capacity: int = 64, record_bytes: int = 1024
                   ) -> RingEngine:
        result = await eng.call(rpc.OpenRing(capacity=capacity, record_bytes=record_bytes))
        fds = [os.dup(fd) for fd in eng.conn.reply_fds]  # as SCM_RIGHTS would
        eng.conn.reply_fds = []
        return cls(eng, result, fds)

    def push(self, call: rpc.Call, depends: int | None = None, wake: bool = True) -> int:
        """Publish ``call``; its call id. ``depends``: the call id it depends on;
        ``wake``: write ``wake_kvd`` if kvd sleeps."""
        after = 0 if depends is None else self.out.head - depends
        seq = self.out.push(codec.encode(rpc.Request(id=self.out.head, call=call)), after)
        assert seq is not None, "ring full"
        if wake:
            self.wake()
        return seq

    def wake(self) -> None:
        if self.sub.sleeping:
            os.eventfd_write(self.wake_kvd, 1)

    async def drained(self, bound: float = 20.0) -> None:
        """Until kvd ran every record (its eventfd reader runs on the loop)."""
        await until(lambda: self.sub.tail >= self.out.head or self.sub.closed, bound)

    def collect(self) -> None:
        while (payload := self.inbox.peek()) is not None:
            reply = rpc.decode_reply(payload)
            self.inbox.done()
            assert not reply.ok and reply.id not in self.answers
            self.answers[reply.id] = (reply.kind, reply.error)

    def outcome(self, seq: int) -> tuple[Any, ...]:
        """As the socket's outcome of a room call: ``(True, None, "")`` or ``(False, kind,
        error)``."""
        assert self.sub.tail > seq, f"call {seq} not run yet"
        if seq in self.answers:
            return (False, *self.answers[seq])
        return (True, None, "")

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.map.close()
        for fd in (self.memfd, self.wake_kvd, self.wake_engine):
            with contextlib.suppress(OSError):
                os.close(fd)


async def socket_outcome(eng: Engine, call: rpc.Call) -> tuple[Any, ...]:
    try:
        return (True, msgspec.to_builtins(await eng.call(call)), "")
    except Exception as exc:  # every refusal is compared
        kind, error = rpc.failure(exc)
        return (False, kind, error)


def statuses(eng: Engine) -> tuple[list[int], list[int]]:
    polled = eng.node.side.poll(ROOMS)
    return polled.statuses, sorted(polled.releasable)


# ---- equivalence -----------------------------------------------------------------------


async def both(role: str, draw: Any, mode: str = "plain") -> None:
    """The same calls on two identical clusters: one engine over the socket, one over the
    ring. ``mode``: "plain", every room call through the ring (polls over the socket: kvd
    runs the ring's records first); "mixed", each call through the ring or the socket,
    the ring's records published without waking kvd and kvd's wake-up batch cut to one
    record, so a socket call finds records of any number before it and must run them all
    first; "drop", every room call through the ring unwoken, then the connection drops
    (kvd runs them at the drop, refusals reaching nobody): the socket's engine aborts
    the room of each call refused (a create, or a call never sent as its create was
    refused, excepted) at once, what kvd does for it."""
    batch = 1 if mode == "mixed" else ring_module.BATCH
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
            mock.patch.object(ring_module, "BATCH", batch):
        clusters = [Cluster(Path(a)), Cluster(Path(b))]
        ring: RingEngine | None = None
        try:
            engines = []
            for c in clusters:
                p = await c.node("prefill")
                node = p if role == "prefill" else await c.node("decode")
                engines.append(await node.engine(seed=1, engine_id="e1"))
            sock, via_ring = engines
            ring = await RingEngine.open(via_ring)
            strategy = PREFILL_CALLS if role == "prefill" else decode_calls(p.http_addr)
            calls = draw(st.lists(strategy, min_size=1, max_size=25))
            if mode == "drop":
                calls = [c for c in calls if not isinstance(c, rpc.Poll)]
            n = len(calls)
            wait_one = st.booleans() if mode == "plain" else st.sampled_from([True] + [False] * 4)
            waits = draw(st.lists(wait_one, min_size=n, max_size=n))
            chained = draw(st.lists(st.booleans(), min_size=n, max_size=n))
            on_ring = [not isinstance(c, rpc.Poll) and (
                mode != "mixed" or draw(st.booleans())) for c in calls]
            # a call may depend on its room's last create (as a handle's calls do while kvd
            # has not run the create): the socket's engine never makes it when that create
            # was refused (the create raised), the ring's refuses it with the create's kind
            deps: list[int | None] = []
            last_create: dict[int, int] = {}
            for i, call in enumerate(calls):
                room = getattr(call, "room", None)
                dep = last_create.get(room) if chained[i] and room is not None else None
                deps.append(dep if on_ring[i] and not isinstance(call, CREATES) and
                            dep is not None and on_ring[dep] else None)
                if isinstance(call, CREATES):
                    last_create[call.room] = i
            want: list[tuple[Any, ...]] = []
            for call, dep in zip(calls, deps, strict=True):
                if dep is not None and not want[dep][0]:
                    want.append((False, want[dep][1], None))  # never sent
                    continue
                want.append(await socket_outcome(sock, call))
                if mode == "drop" and not want[-1][0] and not isinstance(call, CREATES):
                    await socket_outcome(sock, rpc.Abort(room=call.room, reason="refused"))
            pending: list[tuple[int, int]] = []  # (index, call id) not compared yet
            got: list[tuple[Any, ...] | None] = [None] * n
            seqs: list[int] = []
            for i, (call, wait) in enumerate(zip(calls, waits, strict=True)):
                if not on_ring[i]:  # the socket: the ring's records run first
                    got[i] = await socket_outcome(via_ring, call)
                    assert ring.sub.tail == ring.out.head
                    seqs.append(-1)
                else:
                    dep = deps[i]
                    seqs.append(ring.push(call, None if dep is None else seqs[dep],
                                          wake=mode == "plain"))
                    pending.append((i, seqs[-1]))
                if mode != "drop" and (wait or i == n - 1):
                    ring.wake()
                    await ring.drained()
                    ring.collect()
                    for j, seq in pending:
                        got[j] = ring.outcome(seq)
                    pending.clear()
            if mode == "drop":
                await via_ring.reconnect()  # within the grace: the rooms are kept (K27)
                await sock.reconnect()
                assert ring.sub.closed and ring.sub.tail == ring.out.head  # every one ran
            else:
                for i, w in enumerate(want):
                    if w[2] is None:  # refused as its create was, naming it
                        g = got[i]
                        assert g is not None and g[:2] == w[:2] and "depends on" in g[2]
                        got[i] = w
                assert got == want
                assert not ring.sub.closed
            assert statuses(sock) == statuses(via_ring)
        finally:
            if ring is not None:
                ring.close()
            for c in clusters:
                await c.stop()


@pytest.mark.parametrize("role", ["prefill", "decode"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_the_ring_answers_every_call_as_the_socket_does(role: str, data: st.DataObject) -> None:
    """Any sequence of room calls (valid or refused), submitted through the ring in runs
    of any length between waits, with polls over the socket in between: every call's
    outcome (refusals with their kind and text, by call id) and every room's status and
    releasability are what the same calls get over the socket, on both roles. A call that
    depends on its room's create (a handle's call made before kvd ran the create) is
    refused with the create's kind when the create was refused, and changes nothing: what
    the socket's engine gets by never making it (the create raised)."""
    asyncio.run(both(role, data.draw))


@pytest.mark.parametrize("role", ["prefill", "decode"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_calls_run_in_the_order_made_whichever_way_each_went(role: str,
                                                             data: st.DataObject) -> None:
    """Each call through the ring (kvd not woken, one record per wake-up turn) or the
    socket: a socket call runs after every record published before it, however many, so
    every outcome and every room's status is what the socket alone gives."""
    asyncio.run(both(role, data.draw, "mixed"))


@pytest.mark.parametrize("role", ["prefill", "decode"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_calls_published_before_a_drop_run_and_their_refusals_fail_the_room(
        role: str, data: st.DataObject) -> None:
    """Calls published through the ring, kvd not woken, then the connection drops and the
    engine reconnects within the grace: every record ran, and the rooms read what the
    socket gives for an engine that aborts a room once a call on it is refused."""
    asyncio.run(both(role, data.draw, "drop"))


async def test_rooms_moved_through_the_ring_arrive_byte_exact(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    pr, dr = await RingEngine.open(pe), await RingEngine.open(de)
    try:
        rooms = list(range(10, 18))
        for r in rooms:
            dr.push(rpc.ReceiverCreate(room=r, bootstrap_addr=p.http_addr))
            dr.push(rpc.ReceiverInit(room=r, dst_pages=pack_indices([r - 10, r + 6]),
                                     aux_index=r - 10))  # a slot of its own (K42)
            pr.push(rpc.SenderCreate(room=r))
            pr.push(rpc.SenderInit(room=r, num_pages=2, aux_index=r % 4))
            pr.push(rpc.SenderSend(room=r, pages=pack_indices([r]), is_last=False))
            pr.push(rpc.SenderSend(room=r, pages=pack_indices([r + 8]), is_last=True))
        await pr.drained()
        await dr.drained()
        await settle(cluster)
        pr.collect()
        dr.collect()
        assert pr.answers == dr.answers == {}
        assert de.node.side.poll(rooms).statuses == [SUCCESS] * len(rooms)
        src = [x for r in rooms for x in (r, r + 8)]
        dst = [x for r in rooms for x in (r - 10, r + 6)]
        assert same_pages(de, pe, src, dst)
    finally:
        pr.close()
        dr.close()


# ---- the set-up ----------------------------------------------------------------------


async def test_one_ring_per_connection_only_after_registration(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe)
    try:
        with pytest.raises(RpcError, match="already"):
            await pe.call(rpc.OpenRing())
        stranger = Engine(p, pe.pool, type(pe.conn)(999))  # connected, never registered
        with pytest.raises(RpcError, match="registered"):
            await stranger.call(rpc.OpenRing())
        assert list(p.daemon.rings) == [pe.conn.id]
    finally:
        ring.close()


@pytest.mark.parametrize(("capacity", "record"), [(0, 1024), (3, 1024), (8192, 1024),
                                                  (64, 256), (64, 1 << 17), (64, 1028),
                                                  (4096, 1 << 16)])
async def test_ring_sizes_out_of_bounds_are_refused(cluster: Cluster, capacity: int,
                                                    record: int) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    with pytest.raises(ProtocolError):
        await pe.call(rpc.OpenRing(capacity=capacity, record_bytes=record))
    assert not p.daemon.rings and pe.conn.reply_fds == []


async def test_a_kvd_with_the_channel_off_refuses_the_ring(cluster: Cluster) -> None:
    p = await cluster.node("prefill", engine_channel=False)
    pe = await p.engine(seed=1)
    with pytest.raises(RpcError, match="engine_channel"):
        await pe.call(rpc.OpenRing())


async def test_the_ring_goes_with_its_connection(cluster: Cluster) -> None:
    """A dropped connection closes its rings (marked closed for the engine) and frees
    their descriptors; a half-written record the engine left is never run (K27's grace
    then applies to its rooms as over the socket)."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1, engine_id="e1")
    ring = await RingEngine.open(pe)
    try:
        ring.push(rpc.SenderCreate(room=5))
        await ring.drained()
        channel = p.daemon.rings[pe.conn.id]
        # the engine dies half way through an abort: written, never published
        ring.sub.write_record(ring.out.head, codec.encode(rpc.Request(
            id=ring.out.head, call=rpc.Abort(room=5, reason="half"))))
        os.eventfd_write(ring.wake_kvd, 1)
        await settle(cluster)
        assert p.side.poll([5]).statuses == [1]  # still Bootstrapping: not aborted
        pe.disconnect()
        assert not p.daemon.rings and channel.closed and channel.fd == -1
        assert ring.sub.closed and ring.comp.closed
        await pe.reconnect()  # the same engine within the grace: its room is kept
        assert p.side.poll([5]).statuses == [1]
        again = await RingEngine.open(pe)  # and a new connection gets a new ring
        again.close()
    finally:
        ring.close()


# ---- hostile rings -------------------------------------------------------------------


async def hostile(draw: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        ring: RingEngine | None = None
        try:
            p = await cluster.node("prefill")
            d = await cluster.node("decode")
            pe, de = await p.engine(seed=1, engine_id="e1"), await d.engine(seed=2)
            ring = await RingEngine.open(pe, capacity=8, record_bytes=512)
            channel = p.daemon.rings[pe.conn.id]
            await pe.call(rpc.SenderCreate(room=50))  # over the socket: not the ring's
            await de.receiver(50, [3], p.http_addr)
            carried = [2, 3]
            for r in carried:
                ring.push(rpc.SenderCreate(room=r))
            await ring.drained()
            await hostile_writes(draw, ring)
            if draw(st.booleans()):  # the connection drops: kvd runs what checks out
                await pe.reconnect()  # (within the grace: K27)
                assert channel.closed and ring.sub.closed
            else:
                ring.wake()
            await pe.call(rpc.Poll(rooms=[50]))  # kvd runs the ring's records first
            await settle(cluster)
            if channel.failed:
                assert ring.sub.closed and ring.comp.closed
                assert all(s in (0, -1) for s in p.side.poll(carried).statuses)
            # whatever happened: the daemon lives, the socket serves, the other rooms are
            # untouched and still move their bytes
            assert p.side.poll([50]).statuses[0] in (1, 2)  # bound to its decode, or not yet
            await pe.call(rpc.SenderInit(room=50, num_pages=1, aux_index=0))
            await pe.call(rpc.SenderSend(room=50, pages=pack_indices([7]), is_last=True))
            await settle(cluster)
            assert (await de.poll(50)).statuses == [SUCCESS]
            assert same_pages(de, pe, [7], [3])
        finally:
            if ring is not None:
                ring.close()
            await cluster.stop()


async def hostile_writes(draw: Any, ring: RingEngine) -> None:
    """Published records of random bytes or random calls, and random bytes anywhere in
    the memfd (both rings' headers included)."""
    calls = st.one_of(PREFILL_CALLS, st.builds(rpc.Many, calls=st.just([])),
                      st.just(rpc.OpenRing()), st.just(rpc.Info()))
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            payload = draw(st.binary(max_size=ring.sub.max_payload))
        else:
            req = rpc.Request(id=ring.out.head + draw(st.sampled_from([0, 0, 1, -1])),
                              call=draw(calls))
            payload = codec.encode(req)
        if ring.out.free() and len(payload) <= ring.sub.max_payload:
            ring.out.push(payload)
    size = len(ring.map)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, size - 1))
        noise = draw(st.binary(min_size=1, max_size=64))
        ring.map[at:at + len(noise)] = noise[:size - at]
    if draw(st.booleans()):
        ring.sub.header[4] = draw(st.integers(0, 2**64 - 1))  # any head


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_hostile_ring_fails_only_its_own_channel_and_rooms(data: st.DataObject) -> None:
    """Random records, random bytes anywhere in both rings and any head, then a wake-up
    or the connection dropping: kvd runs what checks out and otherwise fails the channel
    (rings marked closed, the rooms the ring carried aborted); the daemon lives, the
    socket serves, a room the ring did not carry is untouched and moves its bytes."""
    asyncio.run(hostile(data.draw))


async def test_a_corrupt_record_fails_the_channel_once_and_aborts_its_rooms(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe)
    try:
        await pe.call(rpc.SenderCreate(room=9))  # the socket's room
        ring.push(rpc.SenderCreate(room=1))
        ring.push(rpc.SenderCreate(room=2))
        await ring.drained()
        ring.out.push(b"not a frame")
        ring.out.push(b"nor this")
        ring.wake()
        await until(lambda: ring.sub.closed)
        assert p.side.poll([1, 2, 9]).statuses == [0, 0, 1]
        assert "engine ring failed" in p.side.poll([1]).reasons[1]
        assert sum(r.getMessage().startswith("engine ring failed") for r in caplog.records) == 1
        # the channel stays failed; the engine goes on over the socket
        assert (await pe.call(rpc.Poll(rooms=[9]))).statuses == [1]
        with pytest.raises(RpcError, match="already"):
            await pe.call(rpc.OpenRing())
    finally:
        ring.close()


async def test_a_full_completion_ring_holds_the_submissions_until_read(
        cluster: Cluster) -> None:
    """An engine that does not read its refusals: kvd stops at a full completion ring
    (leaving the rest of the submissions published, not run) and goes on once the engine
    read them and woke it -- no refusal is dropped."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe, capacity=4, record_bytes=512)
    try:
        seqs = [ring.push(rpc.SenderInit(room=100 + i, num_pages=1, aux_index=0))
                for i in range(4)]  # unknown rooms: four refusals fill the completions
        await ring.drained()
        seqs += [ring.push(rpc.SenderCreate(room=200 + i)) for i in range(3)]
        await settle(cluster)
        assert ring.sub.tail == 4 and ring.sub.sleeping
        ring.collect()
        ring.wake()  # the engine read them: kvd may go on
        await ring.drained()
        ring.collect()
        assert [ring.outcome(s)[0] for s in seqs] == [False] * 4 + [True] * 3
        assert np.array_equal(p.side.poll([200, 201, 202]).statuses, [1, 1, 1])
    finally:
        ring.close()


async def test_a_registration_again_on_the_connection_gives_a_fresh_ring(
        cluster: Cluster) -> None:
    """S16's drop lets the same connection register again: its old ring goes with the old
    registration (closed), and the engine's OpenRing after the new one is served."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe)
    try:
        old = p.daemon.rings[pe.conn.id]
        p.daemon.drop_registration("a test")
        await settle(cluster)
        await pe.call(pe.pool.registration)
        assert old.closed and ring.sub.closed and pe.conn.id not in p.daemon.rings
        again = await RingEngine.open(pe)
        again.push(rpc.SenderCreate(room=3))
        await again.drained()
        again.collect()
        assert again.outcome(0) == (True, None, "") and p.side.poll([3]).statuses == [1]
        again.close()
    finally:
        ring.close()


# ---- calls that depend on a create -------------------------------------------------------


async def test_calls_of_a_refused_create_never_act_on_the_live_room(cluster: Cluster) -> None:
    """A duplicate create of a live room is refused; the init, abort and clear that depend
    on it (a handle's calls made before kvd ran its create) are refused with its kind and
    never reach the live room, which goes on; calls depending on a create that succeeded
    run as any call."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe)
    try:
        live = ring.push(rpc.SenderCreate(room=7))
        ring.push(rpc.SenderInit(room=7, num_pages=2, aux_index=0), depends=live)
        dup = ring.push(rpc.SenderCreate(room=7))
        calls = [ring.push(c, depends=dup) for c in (
            rpc.SenderInit(room=7, num_pages=1, aux_index=1),
            rpc.Abort(room=7, reason="the duplicate's abort"), rpc.Clear(room=7))]
        other = ring.push(rpc.SenderCreate(room=8))
        ok = ring.push(rpc.SenderInit(room=8, num_pages=1, aux_index=1), depends=other)
        await ring.drained()
        ring.collect()
        kind = ring.outcome(dup)[1]
        assert ring.outcome(dup)[0] is False and "already active" in ring.outcome(dup)[2]
        for seq in calls:
            refused, k, error = ring.outcome(seq)
            assert refused is False and k == kind and f"call {dup} it depends on" in error
            assert "already active" in error
        assert ring.outcome(ok) == (True, None, "")
        assert p.side.poll([7, 8]).statuses == [1, 1]  # the live room goes on, not aborted
        assert not ring.sub.closed
    finally:
        ring.close()


async def test_a_dependency_beyond_the_ring_fails_the_channel(cluster: Cluster) -> None:
    """A record can depend only on one that was in the ring with it: one that names a call
    more than a ring's capacity back is a hostile producer's, and fails the channel (its
    rooms aborted), not the daemon."""
    p = await cluster.node("prefill")
    pe = await p.engine(seed=1)
    ring = await RingEngine.open(pe, capacity=4)
    try:
        first = ring.push(rpc.SenderCreate(room=11))
        for _ in range(4):
            await ring.drained()
            ring.push(rpc.SenderCreate(room=12))  # refused after the first: records all the same
        await ring.drained()
        ring.push(rpc.Abort(room=11, reason="far"), depends=first)
        await ring.drained()
        assert ring.sub.closed
        await until(lambda: p.side.poll([11]).statuses == [int(KVPoll.Failed)], 20.0)
    finally:
        ring.close()
