"""Typed refusals and clock offsets of the control plane, pure (injected clocks): which
authentic frames are answered, how often, and never with more bytes (issue 19: push,
don't wait; case K40: a skewed clock is named, not silent; S09: a replay is not answered)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.control.inbound import Admission, Buckets, Misaddressed, Refusals
from kvd.control.peers import Addressing
from kvd.errors import AuthError, Skewed, StaleMessage, WrongRecipient
from kvd.protocol import control
from kvd.security import SEAL_OVERHEAD, Authenticator

SECRET = b"0123456789abcdef-cluster"
HOUR = 3600.0


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def auth(instance: str, clock: Clock, secret: bytes = SECRET) -> Authenticator:
    return Authenticator(secret, instance, max_skew=30.0, clock=clock)


def abort(endpoint: str = "tcp://d:1", instance: str = "D1", reason: str = "x" * 40
          ) -> control.RoomAbort:
    return control.RoomAbort(room=7, inc=9, kind="aborted", reason=reason, endpoint=endpoint,
                             instance_id=instance)


# ---- the seal: skew is authentic-but-stale, and named --------------------------------------

def test_k40_an_authentic_frame_outside_the_window_is_skewed_with_its_offset() -> None:
    d_clock, p_clock = Clock(1e9 + HOUR), Clock(1e9)
    frame = control.encode(abort())
    sealed = auth("D1", d_clock).seal(frame, "P1")
    with pytest.raises(Skewed) as exc:
        auth("P1", p_clock).open_sealed(sealed)
    assert exc.value.offset_s == pytest.approx(HOUR, abs=0.01)
    assert exc.value.frame is None  # the body is not checked yet: O(1) so far
    assert bytes(auth("P1", p_clock).skewed_body(sealed)) == frame


def test_k40_a_forged_skewed_frame_is_not_skewed_but_forged() -> None:
    """Only a holder of the secret learns anything: the MAC is checked before the window."""
    clock = Clock()
    forged = auth("D1", Clock(clock.now + HOUR), secret=b"another-secret-16b").seal(b"f", "P1")
    with pytest.raises(AuthError) as exc:
        auth("P1", clock).open_sealed(forged)
    assert not isinstance(exc.value, StaleMessage) and "MAC" in str(exc.value)
    tampered = bytearray(auth("D1", Clock(clock.now + HOUR)).seal(b"body", "P1"))
    tampered[-1] ^= 1
    with pytest.raises(AuthError, match="digest"):
        auth("P1", clock).skewed_body(bytes(tampered))


def test_k40_a_refusal_dated_as_the_frame_it_answers_opens_at_the_skewed_sender() -> None:
    """P seals its refusal at the refused frame's own time: fresh for D, whose clock is an
    hour ahead, though P's own time would be an hour stale there."""
    d_clock, p_clock = Clock(1e9 + HOUR), Clock(1e9)
    d, p = auth("D1", d_clock), auth("P1", p_clock)
    with pytest.raises(Skewed) as exc:
        p.open_sealed(d.seal(b"register", "P1"))
    answer = p.seal(b"refused", "D1", at=exc.value.sent_at)
    assert d.open(answer) == b"refused"
    with pytest.raises(Skewed):
        d.open(p.seal(b"refused", "D1"))  # dated by P's clock: stale at D


def test_s09_a_misaddressed_frame_is_answered_once_a_replay_is_a_replay() -> None:
    clock = Clock()
    admission = Admission(auth("P2", clock), 1 << 20)
    sealed = auth("D1", clock).seal(control.encode(abort()), "P1")
    (got,) = admission.admit(b"c", sealed)
    assert got.refused == "instance" and got.size == len(sealed)
    assert admission.admit(b"c", sealed) == []  # the nonce was remembered
    assert admission.stats.misaddressed == 1


def test_k40_skewed_bodies_are_checked_only_within_the_skew_gate() -> None:
    """A captured skewed frame can be replayed at will (its nonce outlives the cache), so
    its O(n) body check is budgeted per connection: a replay flood costs O(1) a frame."""
    clock = Clock()
    gate = Buckets(per_s=1.0, burst=2, total_per_s=8.0, clock=clock)
    admission = Admission(auth("P1", clock), 1 << 20, skew_gate=gate)
    sealed = auth("D1", Clock(clock.now + HOUR)).seal(control.encode(abort()), "P1")
    got = [admission.admit(b"replayer", sealed) for _ in range(100)]
    assert sum(len(g) for g in got) == 2 and admission.stats.skewed == 2
    assert got[0][0].refused == "clock_skew"
    assert got[0][0].offset_s == pytest.approx(HOUR, abs=0.01)
    assert len(admission.admit(b"other-connection", sealed)) == 1


# ---- Refusals: bounded, never amplifying, never to a refusal ---------------------------

def refused(msg: control.ControlMessage, size: int = 1000, why: str = "instance",
            offset: float = 0.0) -> Misaddressed:
    return Misaddressed(msg, why, 5.0, offset, size)


def test_a_refusal_names_this_instance_is_dated_as_the_frame_and_goes_to_its_sender() -> None:
    r = Refusals("tcp://p:1", "P2", 30.0, clock=Clock())
    answer = r.answer(refused(abort(), why="clock_skew", offset=HOUR))
    assert answer is not None and (answer.endpoint, answer.instance) == ("tcp://d:1", "D1")
    assert answer.at == 5.0
    msg = control.decode(answer.frame)
    assert msg == control.Refused(why="clock_skew", endpoint="tcp://p:1", instance_id="P2",
                                  offset_s=HOUR, window_s=30.0)


def test_a_refusal_is_never_answered_and_never_larger_than_its_frame() -> None:
    r = Refusals("tcp://p:1", "P2", 30.0, clock=Clock())
    loop = control.Refused(why="instance", endpoint="tcp://d:1", instance_id="D1")
    assert r.answer(refused(loop)) is None
    tiny = len(control.encode(abort(reason=""))) + SEAL_OVERHEAD
    assert r.answer(refused(abort(reason=""), size=tiny)) is None
    assert r.stats.unanswerable == 1 and r.stats.oversize == 1 and r.stats.sent == 0


@given(st.lists(st.tuples(st.sampled_from(["tcp://a:1", "tcp://b:1", "tcp://c:1"]),
                          st.floats(min_value=0, max_value=2.0)), max_size=300),
       st.integers(min_value=40, max_value=20_000))
def test_refusals_stay_within_their_budget_and_smaller_than_what_triggered_them(
        frames: list[tuple[str, float]], size: int) -> None:
    """Whatever arrives when: per peer at most burst + rate x elapsed refusals, and every
    refusal (sealed) is smaller than the frame it answers."""
    clock = Clock(0.0)
    r = Refusals("tcp://p:1", "P2" * 8, 30.0, per_s=2.0, burst=4, total_per_s=64.0,
                 clock=clock)
    sent: dict[str, int] = {}
    for endpoint, dt in frames:
        clock.now += dt
        a = r.answer(refused(abort(endpoint), size=size))
        if a is not None:
            sent[endpoint] = sent.get(endpoint, 0) + 1
            assert len(a.frame) + SEAL_OVERHEAD < size
    for count in sent.values():
        assert count <= 4 + 2.0 * clock.now + 1e-9


def test_buckets_forget_the_oldest_key_past_their_bound() -> None:
    b = Buckets(per_s=0.0, burst=1, total_per_s=1e9, max_keys=2, clock=Clock())
    assert b.take("a") and b.take("b") and not b.take("a")
    assert b.take("c") and len(b) == 2  # evicts "b": taking "a" again made it the newest
    assert b.take("b")  # forgotten: a fresh budget, nothing worse


# ---- clock offsets --------------------------------------------------------------------------

async def _one(addressing: Addressing, got: list) -> list:
    async def source():  # type: ignore[no-untyped-def]
        for g in got:
            yield g

    return [m async for m in addressing._learning(source())]


async def test_k40_offsets_are_measured_per_peer_and_a_skewed_date_teaches_no_instance() -> None:
    from kvd.control.inbound import Received

    a = Addressing(auth("P1", Clock()))
    msg = abort("tcp://d:1", "D1")
    out = await _one(a, [Received(msg, 0.0, "", 0.25, 100)])
    assert out == [msg] and a.clock_offset("tcp://d:1") == 0.25
    assert a.instance_of("tcp://d:1") == "D1"
    skewed = abort("tcp://e:1", "E1")
    (m,) = await _one(a, [Received(skewed, 9e9, "clock_skew", HOUR, 100)])
    assert isinstance(m, Misaddressed) and m.why == "clock_skew"
    assert a.clock_offset("tcp://e:1") == HOUR and a.instance_of("tcp://e:1") is None
    refusal = control.Refused(why="clock_skew", endpoint="tcp://f:1", instance_id="F",
                              offset_s=-HOUR)  # F saw our frame an hour ahead of it
    await _one(a, [Received(refusal, 0.0, "", 0.0, 100)])
    assert a.clock_offset("tcp://f:1") == HOUR  # theirs minus ours: we are behind


def test_wrong_recipient_still_carries_the_frame() -> None:
    clock = Clock()
    with pytest.raises(WrongRecipient) as exc:
        auth("B", clock).open_sealed(auth("S", clock).seal(b"x", "A"))
    assert bytes(exc.value.frame or b"") == b"x"
