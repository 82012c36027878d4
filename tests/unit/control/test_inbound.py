"""kvd.control.inbound: the per-source limiter (pure, injected clock) and the inbound
pipeline over real ZMQ sockets on loopback (case S02)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvd.control.inbound import Admission, Misaddressed, SourceLimiter
from kvd.control.peers import ControlPlane
from kvd.protocol import codec, control
from kvd.security import SEAL_OVERHEAD, Authenticator

SECRET = b"0123456789abcdef-cluster"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- SourceLimiter ----------------------------------------------------------------------

def test_burst_then_penalty_then_back() -> None:
    clock = Clock()
    lim = SourceLimiter(burst=4, refill_per_s=1.0, penalty_s=10.0, clock=clock)
    assert [lim.strike(b"a") for _ in range(4)] == [False] * 4
    assert not lim.blocked(b"a")
    assert lim.strike(b"a") is True  # the fifth in no time
    assert lim.blocked(b"a") and not lim.blocked(b"b")
    clock.now += 9.9
    assert lim.blocked(b"a")
    clock.now += 0.2
    assert not lim.blocked(b"a")


def test_repeat_offences_double_the_penalty_up_to_the_cap() -> None:
    clock = Clock()
    lim = SourceLimiter(burst=1, refill_per_s=0.0, penalty_s=10.0, max_penalty_s=25.0,
                        clock=clock)
    lim.strike(b"a")
    penalties = []
    for _ in range(4):
        assert lim.strike(b"a")
        start = clock.now
        while lim.blocked(b"a"):
            clock.now += 1.0
        penalties.append(clock.now - start)
    assert penalties == [10.0, 20.0, 25.0, 25.0]


def test_a_steady_trickle_within_the_refill_is_never_penalised() -> None:
    clock = Clock()
    lim = SourceLimiter(burst=2, refill_per_s=1.0, clock=clock)
    for _ in range(100):
        assert not lim.strike(b"peer")
        clock.now += 1.0


@given(st.lists(st.tuples(st.floats(0, 5), st.integers(0, 50)), max_size=300),
       st.integers(1, 8), st.integers(1, 16))
def test_limiter_invariants(events: list[tuple[float, int]], burst: int,
                            max_sources: int) -> None:
    clock = Clock()
    lim = SourceLimiter(burst=burst, refill_per_s=0.5, penalty_s=3.0, max_sources=max_sources,
                        clock=clock)
    free: dict[int, int] = {}
    for dt, src in events:
        clock.now += dt
        key = bytes([src])
        if lim.blocked(key):
            continue  # the pipeline drops blocked sources' frames before any strike
        if not lim.strike(key):
            free[src] = free.get(src, 0) + 1
        assert len(lim) <= max_sources
    # Frames that did not cost a penalty are bounded by the burst plus the refill.
    elapsed = sum(dt for dt, _ in events)
    for src, n in free.items():
        forgotten = len({s for _, s in events}) > max_sources  # a fresh budget each time
        assert forgotten or n <= burst + 0.5 * elapsed + 1e-6, (src, n)


# ---- Inbound over ZMQ -------------------------------------------------------------------

@contextlib.asynccontextmanager
async def plane(instance: str = "me", **kw: object):  # type: ignore[no-untyped-def]
    ctl = ControlPlane(Authenticator(SECRET, instance), **kw)  # type: ignore[arg-type]
    ctl.bind("127.0.0.1", 0)
    try:
        yield ctl
    finally:
        ctl.close()


def dealer(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    return sock


def abort(room: int, instance: str = "peer") -> bytes:
    return control.encode(control.RoomAbort(room=room, inc=1, kind="aborted", reason="r",
                                            endpoint="tcp://127.0.0.1:1", instance_id=instance))


async def take(ctl: ControlPlane, n: int, within: float = 10.0) -> list[object]:
    out: list[object] = []

    async def consume() -> None:
        async for msg in ctl.messages():
            out.append(msg)
            if len(out) == n:
                return

    await asyncio.wait_for(consume(), within)
    return out


async def until(pred, within: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(within):
        while not pred():  # noqa: ASYNC110 - polls counters that have no event to wait on
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def consuming(ctl: ControlPlane):  # type: ignore[no-untyped-def]
    """Collect every message ``ctl`` yields while the block runs."""
    out: list[object] = []

    async def consume() -> None:
        async for msg in ctl.messages():
            out.append(msg)

    task = asyncio.create_task(consume())
    try:
        yield out
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_authentic_frames_become_messages_and_junk_is_counted() -> None:
    async with plane() as ctl:
        peer = Authenticator(SECRET, "peer")
        sock = dealer(ctl.endpoint)
        sock.send(b"junk")
        sock.send_multipart([peer.seal(abort(1), "me"), b"extra part"])
        sock.send(peer.seal(abort(2), "me"))
        (msg,) = await take(ctl, 1)
        assert isinstance(msg, control.RoomAbort) and msg.room == 2
        assert ctl.stats.auth_failures == 2 and ctl.stats.accepted == 1
        assert ctl.instance_of("tcp://127.0.0.1:1") == "peer"  # learned from the message
        sock.close()


async def test_a_frame_for_a_previous_instance_comes_as_misaddressed() -> None:
    async with plane("new") as ctl:
        sock = dealer(ctl.endpoint)
        sock.send(Authenticator(SECRET, "peer").seal(abort(3), "old"))
        (msg,) = await take(ctl, 1)
        assert isinstance(msg, Misaddressed) and msg.message.room == 3  # type: ignore[attr-defined]
        assert ctl.stats.misaddressed == 1 and ctl.stats.accepted == 0
        sock.close()


def aborts(rooms: range, instance: str = "peer") -> list[control.ControlMessage]:
    return [control.RoomAbort(room=r, inc=1, kind="aborted", reason="r",
                              endpoint="tcp://127.0.0.1:1", instance_id=instance) for r in rooms]


async def test_a_batch_frame_yields_each_of_its_messages_in_order() -> None:
    async with plane() as ctl:
        sock = dealer(ctl.endpoint)
        sock.send(Authenticator(SECRET, "peer").seal(control.encode_many(aborts(range(5))),
                                                     "me"))
        msgs = await take(ctl, 5)
        assert [m.room for m in msgs] == list(range(5))  # type: ignore[attr-defined]
        assert ctl.stats.received == ctl.stats.accepted == 1  # counted per frame
        sock.close()


async def test_a_batch_for_a_previous_instance_comes_as_misaddressed_messages() -> None:
    async with plane("new") as ctl:
        sock = dealer(ctl.endpoint)
        sock.send(Authenticator(SECRET, "peer").seal(control.encode_many(aborts(range(3))),
                                                     "old"))
        msgs = await take(ctl, 3)
        assert all(isinstance(m, Misaddressed) for m in msgs)
        assert [m.message.room for m in msgs] == [0, 1, 2]  # type: ignore[attr-defined]
        assert ctl.stats.misaddressed == 1 and ctl.stats.accepted == 0
        sock.close()


async def test_an_oversized_batch_is_a_protocol_error_and_nothing_of_it_is_yielded() -> None:
    async with plane() as ctl:
        sock = dealer(ctl.endpoint)
        peer = Authenticator(SECRET, "peer")
        too_many = codec.encode(control.Batch(messages=aborts(range(control.MAX_BATCH + 1))))
        sock.send(peer.seal(too_many, "me"))
        sock.send(peer.seal(abort(7), "me"))
        (msg,) = await take(ctl, 1)
        assert msg.room == 7  # type: ignore[attr-defined]
        assert ctl.stats.protocol_errors == 1 and ctl.stats.accepted == 1
        sock.close()


async def test_a_read_batch_is_bounded_in_messages_too() -> None:
    async with plane() as ctl:
        assert ctl.inbound is not None
        ctl.inbound.batch = 8
        sock = dealer(ctl.endpoint)
        peer = Authenticator(SECRET, "peer")
        for i in range(4):
            sock.send(peer.seal(control.encode_many(aborts(range(10 * i, 10 * i + 10))), "me"))
        await until(lambda: ctl.inbound is not None and bool(ctl.inbound._sync.poll(0)))
        await asyncio.sleep(0.2)  # let all four arrive
        first = ctl.inbound.read_batch()
        assert len(first) == 10  # one whole frame, then the message bound stops the read
        rest = ctl.inbound.read_batch() + ctl.inbound.read_batch() + ctl.inbound.read_batch()
        assert [r.message.room for r in first + rest] == list(range(40))
        sock.close()


def test_batch_frames_count_against_the_source_limits_as_frames() -> None:
    """A Batch is one sealed frame: a forged or tampered one is refused from its seal
    (one strike, nothing parsed, none of its messages yielded) and a source in the penalty
    box has its authentic batches dropped whole, unread."""
    clock = Clock()
    adm = Admission(Authenticator(SECRET, "me"), 1 << 20,
                    SourceLimiter(burst=2, refill_per_s=0.0, clock=clock))
    peer, forger = Authenticator(SECRET, "peer"), Authenticator(b"another-secret-0123", "x")
    batch = control.encode_many(aborts(range(50)))
    assert len(adm.admit(b"ok", peer.seal(batch, "me"))) == 50
    assert adm.admit(b"bad", forger.seal(batch, "me")) == []
    tampered = bytearray(peer.seal(batch, "me"))
    tampered[-5] ^= 1
    assert adm.admit(b"bad", bytes(tampered)) == []
    assert adm.stats.auth_failures == 2 and adm.stats.penalties == 0
    assert adm.admit(b"bad", forger.seal(batch, "me")) == []  # third strike: penalty box
    assert adm.stats.penalties == 1 and adm.limiter.blocked(b"bad")
    assert adm.admit(b"bad", peer.seal(batch, "me")) == []  # even authentic: dropped unread
    assert adm.stats.penalized == 1 and adm.stats.protocol_errors == 0
    assert len(adm.admit(b"ok", peer.seal(batch, "me"))) == 50  # other sources unaffected
    assert adm.stats.received == 6 and adm.stats.accepted == 2


async def test_s02_a_flooding_connection_is_penalised_and_a_healthy_one_is_not() -> None:
    async with plane(limiter=SourceLimiter(burst=8, refill_per_s=0.0)) as ctl:
        flood, healthy = dealer(ctl.endpoint), dealer(ctl.endpoint)
        for _ in range(5000):
            flood.send(b"x" * 16)
        peer = Authenticator(SECRET, "peer")
        for room in range(50):
            healthy.send(peer.seal(abort(room), "me"))
        async with consuming(ctl) as msgs:
            await until(lambda: ctl.stats.received >= 5050)
        assert sorted(m.room for m in msgs) == list(range(50))  # type: ignore[attr-defined]
        assert ctl.stats.auth_failures <= 9 and ctl.stats.penalties == 1
        assert ctl.stats.penalized >= 5000 - 9
        flood.close()
        healthy.close()


async def test_s02_the_loop_runs_between_batches_under_a_flood() -> None:
    """With frames always waiting, an await on the next one never yields: the pipeline
    must yield after each batch, so other tasks run while the backlog drains."""
    async with plane() as ctl:
        assert ctl.inbound is not None
        ctl.inbound.batch = 64
        sock = dealer(ctl.endpoint)
        for _ in range(20_000):
            sock.send(b"y" * 16)
        await asyncio.sleep(0.5)  # let ZMQ queue them
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.create_task(ticker())
        async with consuming(ctl):  # nothing is authentic: nothing is yielded
            await until(lambda: ctl.stats.received >= 20_000, 30.0)
            drained_at = ticks
        tick_task.cancel()
        assert drained_at >= 20_000 // 64 // 2  # the ticker ran between batches
        sock.close()


async def test_send_needs_the_recipient_instance_with_a_secret() -> None:
    async with plane() as ctl, plane("them") as other:
        from kvd.control.peers import PeerSendError

        with pytest.raises(PeerSendError, match="instance id is unknown"):
            await ctl.send(other.endpoint, abort(1))
        ctl.learn(other.endpoint, "them")
        await ctl.send(other.endpoint, abort(1, instance="me"))
        (msg,) = await take(other, 1)
        assert isinstance(msg, control.RoomAbort)


def test_the_latest_sealed_claim_wins_and_undated_claims_only_fill_gaps() -> None:
    ctl = ControlPlane(Authenticator(SECRET, "me"))
    try:
        ctl.learn("tcp://a:1", "boot")  # from the bootstrap table: no date
        assert ctl.instance_of("tcp://a:1") == "boot"
        ctl.learn("tcp://a:1", "new", at=200.0)
        ctl.learn("tcp://a:1", "late-frame-of-the-dead-one", at=150.0)
        ctl.learn("tcp://a:1", "boot-again")
        assert ctl.instance_of("tcp://a:1") == "new"
        ctl.learn("tcp://a:1", None, at=300.0)
        assert ctl.instance_of("tcp://a:1") == "new"
    finally:
        ctl.close()


# ---- S19: frames capped at the largest real message, budget per frame -------------------

async def test_s19_the_control_socket_caps_frames_at_the_largest_real_message() -> None:
    """A frame one byte over the cap is refused by ZMQ unread (the connection is dropped,
    nothing reaches the loop); a frame at the largest real message still arrives."""
    async with plane() as ctl:
        assert ctl.max_frame == control.max_frame() < 64 << 20
        peer = Authenticator(SECRET, "peer")
        big = control.RoomPages(room=9, inc=1, endpoint="tcp://127.0.0.1:1",
                                instance_id="peer",
                                dst_pages=b"\0" * (4 * control.MAX_ROOM_PAGES),
                                aux_index=0, write_within=1.0)
        over = dealer(ctl.endpoint)
        over.send(b"KVA2" + b"\0" * (control.max_frame() + SEAL_OVERHEAD - 3))
        ok = dealer(ctl.endpoint)
        ok.send(peer.seal(control.encode(big), "me"))
        (msg,) = await take(ctl, 1)
        assert isinstance(msg, control.RoomPages) and msg.dst_pages == big.dst_pages
        assert ctl.stats.received == 1  # the oversized frame never became one
        over.close()
        ok.close()


async def test_s19_the_batch_budget_is_checked_after_every_frame() -> None:
    """Big forged frames: one read stops once its byte budget is spent, however many
    frames wait (the old check ran every 32 frames)."""
    async with plane() as ctl:
        assert ctl.inbound is not None
        ctl.inbound.budget_bytes = 3 << 20
        sock = dealer(ctl.endpoint)
        for _ in range(8):
            sock.send(b"KVA2" + b"\0" * (1 << 20))  # forged: refused at the MAC
        reads: list[int] = []
        async with asyncio.timeout(10):
            while ctl.stats.received < 8:
                before = ctl.stats.received
                assert ctl.inbound.read_batch() == []
                if ctl.stats.received > before:
                    reads.append(ctl.stats.received - before)
                await asyncio.sleep(0.01)
        assert sum(reads) == 8 and max(reads) <= 3  # 3 MiB a read, then the loop's turn
        sock.close()


def test_an_authentic_frame_with_an_integer_out_of_bounds_is_refused_logged_and_no_strike(
        caplog: pytest.LogCaptureFixture) -> None:
    """A holder of the secret sends RoomAborts naming room -1 (no uint64): each frame is
    refused at decode (protocol_errors), the log names the field -- at most the log
    bucket's burst of lines however many frames come -- and the sender takes no strike:
    its next good frame, from the same connection, is admitted."""
    import logging

    adm = Admission(Authenticator(SECRET, "me"), 1 << 20,
                    SourceLimiter(burst=2, refill_per_s=0.0, clock=Clock()))
    peer = Authenticator(SECRET, "peer")
    bad = control.RoomAbort(room=-1, inc=0, kind="aborted", reason="r", endpoint="tcp://p:1",
                            instance_id="p")
    with caplog.at_level(logging.WARNING, logger="kvd.control.inbound"):
        for _ in range(50):
            assert adm.admit(b"peer", peer.seal(control.encode(bad), "me")) == []
    assert adm.stats.protocol_errors == 50 and adm.stats.auth_failures == 0
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= adm.malformed_log.burst + 1
    assert all("refused an authentic control frame" in m and "`$.room`" in m for m in lines)
    assert not adm.limiter.blocked(b"peer")
    (got,) = adm.admit(b"peer", peer.seal(abort(7), "me"))
    assert got.message.room == 7  # type: ignore[attr-defined]
