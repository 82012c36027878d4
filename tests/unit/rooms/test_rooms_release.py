"""The opener's release rule on the sender machine (K45, K46; S11: only the token's holder)."""

from __future__ import annotations

import pytest
from roomkit import one, pages, registered, room_pages, sender

from kvd.protocol.release import (
    ReleaseError,
    ReleaseOutcome,
    new_token,
    parse_request,
    token_digest,
)
from kvd.rooms.effects import CancelWrites, Report, Write
from kvd.rooms.sender import SenderRooms
from kvd.rooms.state import FailureKind, KVPoll

R = 7
TOKEN = new_token()


def opened(token: str = TOKEN, bind: bool = True) -> SenderRooms:
    s = sender()
    registered(s, 0.0)
    s.create(R, 0.0, token_digest(token))
    s.init(R, 2, 1, 0.0)
    if bind:
        s.on_pages(room_pages(R, 1, (0, 1)), 0.0)
    return s


def test_k45_the_right_token_ends_an_unclaimed_room() -> None:
    s = opened(bind=False)  # Bootstrapping: no decode ever claimed it
    outcome, out = s.release(R, TOKEN, "decode refused", 1.0)
    assert outcome is ReleaseOutcome.RELEASED and out
    p = s.poll(R)
    assert p is not None and p.status == KVPoll.Failed
    assert p.failure is not None and p.failure.kind is FailureKind.ABORTED
    assert "released by its opener" in p.failure.reason


@pytest.mark.parametrize("token", ["x" * 43, TOKEN[:-1] + ("A" if TOKEN[-1] != "A" else "B")],
                         ids=["foreign", "one-char-off"])
def test_k45_a_wrong_token_is_refused_and_the_room_untouched(token: str) -> None:
    s = opened()
    assert s.release(R, token, "", 1.0) == (ReleaseOutcome.REFUSED, [])
    assert s.poll(R).status == KVPoll.WaitingForInput


def test_k45_a_room_without_a_digest_cannot_be_released() -> None:
    s = sender()
    registered(s, 0.0)
    s.create(R, 0.0)
    assert s.release(R, TOKEN, "", 1.0) == (ReleaseOutcome.REFUSED, [])
    assert s.poll(R).status == KVPoll.Bootstrapping


def test_k45_a_replayed_release_finds_the_room_ended() -> None:
    s = opened()
    assert s.release(R, TOKEN, "", 1.0)[0] is ReleaseOutcome.RELEASED
    assert s.release(R, TOKEN, "", 2.0) == (ReleaseOutcome.ENDED, [])
    assert s.release(99, TOKEN, "", 2.0) == (ReleaseOutcome.UNKNOWN, [])


def test_k46_a_new_attempt_of_the_room_has_its_own_token() -> None:
    s = opened()
    s.release(R, TOKEN, "", 1.0)
    other = new_token()
    s.create(R, 2.0, token_digest(other))
    assert s.release(R, TOKEN, "", 3.0) == (ReleaseOutcome.REFUSED, [])
    assert s.release(R, other, "", 3.0)[0] is ReleaseOutcome.RELEASED


def test_k46_release_mid_transfer_cancels_queued_writes_and_reports_twice() -> None:
    s = opened()
    w = one(s.send(R, pages(1), False, 1.0), Write)
    s.send(R, pages(2), True, 1.1)
    outcome, out = s.release(R, TOKEN, "retried", 1.2)
    assert outcome is ReleaseOutcome.RELEASED
    assert one(out, CancelWrites).room == R  # K43: what has not started never will
    assert one(out, Report).quiesced is False
    done = s.write_done(R, w.attempt, None, 10, 0.1, 2.0)
    assert not [e for e in done if isinstance(e, Write)]
    assert one(done, Report).quiesced is True


def test_k46_release_racing_completion_leaves_a_success() -> None:
    s = opened()
    w = one(s.send(R, pages(1, 2), True, 1.0), Write)
    s.write_done(R, w.attempt, None, 10, 0.1, 1.5)
    assert s.poll(R).status == KVPoll.Success
    assert s.release(R, TOKEN, "", 2.0) == (ReleaseOutcome.ENDED, [])
    assert s.poll(R).status == KVPoll.Success


@pytest.mark.parametrize("body", [b"{", b'{"rooms": [], "token": "' + b"a" * 43 + b'"}',
                                  b'{"rooms": [1], "token": "short"}',
                                  b'{"rooms": [-1], "token": "' + b"a" * 43 + b'"}',
                                  b'{"rooms": [1], "token": "' + b"a" * 43 + b'", "x": 1}'])
def test_k45_malformed_releases_are_refused(body: bytes) -> None:
    with pytest.raises(ReleaseError):
        parse_request(body)
