"""kvd.security: recipient-bound seals and HTTP signatures (case S09), O(1) rejection of
forged messages whatever their size (cases S02, S03), freshness and replay."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd import security
from kvd.errors import AuthError, StaleMessage, WrongRecipient
from kvd.security import SEAL_OVERHEAD, Authenticator, recipient_tag

SECRET = b"0123456789abcdef-cluster"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def auth(instance: str = "me", secret: bytes = SECRET, clock: Clock | None = None,
         skew: float = 30.0) -> Authenticator:
    return Authenticator(secret, instance, skew, clock=clock or Clock())


# ---- control frames ---------------------------------------------------------------------

@given(frame=st.binary(max_size=512), me=st.from_regex(r"[A-Za-z0-9._-]{1,64}",
                                                         fullmatch=True))
def test_a_frame_opens_only_at_its_recipient(frame: bytes, me: str) -> None:
    clock = Clock()
    sender, recipient = auth("sender", clock=clock), auth(me, clock=clock)
    sealed = sender.seal(frame, me)
    assert len(sealed) == len(frame) + SEAL_OVERHEAD
    assert recipient.open(sealed) == frame
    other = auth(me + "x", clock=clock)
    with pytest.raises(WrongRecipient) as exc:
        other.open(sender.seal(frame, me))
    assert exc.value.frame == frame  # authentic: the receiver may tell the sender


def test_s09_a_frame_captured_for_one_daemon_is_refused_by_another_and_after_restart() -> None:
    clock = Clock()
    frame = b"KVD\x01room-abort"
    captured = auth("decode", clock=clock).seal(frame, "prefill-A")
    a = auth("prefill-A", clock=clock)
    assert a.open(captured) == frame
    for elsewhere in ("prefill-B", "prefill-A-restarted"):
        with pytest.raises(WrongRecipient):
            auth(elsewhere, clock=clock).open(captured)
    with pytest.raises(StaleMessage, match="replayed"):  # and at A itself: a replay
        a.open(captured)


def test_misaddressed_frame_is_answered_once_then_a_replay() -> None:
    clock = Clock()
    b = auth("B", clock=clock)
    sealed = auth("S", clock=clock).seal(b"x", "A")
    with pytest.raises(WrongRecipient):
        b.open(sealed)
    with pytest.raises(StaleMessage):
        b.open(sealed)


def test_forged_and_tampered_frames_are_refused() -> None:
    clock = Clock()
    me = auth("me", clock=clock)
    with pytest.raises(AuthError, match="no seal"):
        me.open(b"KVD\x01plain frame")
    forged = auth("x", secret=b"another-secret-of-16-bytes", clock=clock).seal(b"f", "me")
    with pytest.raises(AuthError, match="bad frame MAC") as exc:
        me.open(forged)
    assert not isinstance(exc.value, WrongRecipient)
    good = bytearray(auth("s", clock=clock).seal(b"payload", "me"))
    body = bytearray(good)
    body[-1] ^= 1
    with pytest.raises(AuthError, match="does not match its sealed digest"):
        me.open(bytes(body))
    to = bytearray(good)
    to[4] ^= 1  # the recipient field is covered by the MAC: it cannot be re-addressed
    with pytest.raises(AuthError, match="bad frame MAC"):
        me.open(bytes(to))


def test_a_version_1_seal_names_the_older_kvd() -> None:
    old = b"KVA1" + struct.pack(">Q", 1) + bytes(48) + b"frame"
    with pytest.raises(AuthError, match="seal version 1 by an older kvd"):
        auth().open(old)


def test_stale_frames_are_refused_both_ways() -> None:
    clock = Clock()
    sealed = auth("s", clock=clock).seal(b"f", "me")
    me = auth("me", clock=clock, skew=30.0)
    clock.now += 31
    with pytest.raises(StaleMessage, match="outside the 30s window"):
        me.open(sealed)
    clock.now -= 62
    with pytest.raises(StaleMessage):
        me.open(sealed)


def test_forged_frames_cost_no_work_in_their_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged 8 MiB frame is refused from its 116-byte header: its body is never hashed
    (cases S02/S03: refusing must cost O(1), or a flood of big frames stalls the loop)."""
    hashed: list[int] = []
    real = hashlib.sha256

    def spy(data: bytes = b"") -> object:
        hashed.append(len(data))
        return real(data)

    clock = Clock()
    forged = auth("x", secret=b"another-secret-of-16-bytes", clock=clock).seal(
        bytes(8 << 20), "me")
    monkeypatch.setattr(security.hashlib, "sha256", spy)
    with pytest.raises(AuthError):
        auth("me", clock=clock).open(forged)
    assert all(n < 1024 for n in hashed), hashed


def test_insecure_mode_passes_frames_unchanged() -> None:
    a = Authenticator(None, "me")
    assert a.seal(b"f", "anyone") == b"f" and a.open(b"f") == b"f"
    assert not a.enabled


def test_secret_is_not_in_repr_and_must_be_long_enough() -> None:
    assert SECRET.decode() not in repr(auth()) and "enabled=True" in repr(auth())
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Authenticator(b"short", "me")


def test_recipient_tag_is_16_bytes_and_distinct() -> None:
    assert len(recipient_tag("a")) == 16 and recipient_tag("a") != recipient_tag("b")


# ---- HTTP -------------------------------------------------------------------------------

def sign(a: Authenticator, to: str, body: bytes = b"{}", method: str = "PUT",
         path: str = "/route", query: str = "") -> str:
    return a.http_header(method, path, query, body, to)[security.HEADER]


def test_http_signature_is_checked_from_headers_then_body() -> None:
    clock = Clock()
    me = auth("boot", clock=clock)
    header = sign(auth("p", clock=clock), "boot", b'{"x": 1}')
    claim = me.check_http_headers(header, "PUT", "/route", "")
    assert claim.body_sha256 == hashlib.sha256(b'{"x": 1}').hexdigest()
    me.check_http_body(claim, hashlib.sha256(b'{"x": 1}').hexdigest())
    with pytest.raises(AuthError, match="body does not match"):
        me.check_http_body(claim, hashlib.sha256(b'{"x": 2}').hexdigest())


def test_s09_a_request_signed_for_one_bootstrap_is_refused_by_another() -> None:
    clock = Clock()
    header = sign(auth("p", clock=clock), "bootstrap-A")
    auth("bootstrap-A", clock=clock).check_http_headers(header, "PUT", "/route", "")
    with pytest.raises(WrongRecipient, match="another kvd instance"):
        auth("bootstrap-B", clock=clock).check_http_headers(header, "PUT", "/route", "")


@pytest.mark.parametrize("change", ["method", "path", "query"])
def test_http_signature_covers_method_path_and_query(change: str) -> None:
    clock = Clock()
    header = sign(auth("p", clock=clock), "me", method="GET", path="/route", query="a=1")
    args = {"method": "GET", "path": "/route", "query": "a=1"}
    args[change] = {"method": "DELETE", "path": "/v1/status", "query": "a=2"}[change]
    with pytest.raises(AuthError, match="bad request MAC"):
        auth("me", clock=clock).check_http_headers(header, **args)


def test_http_replay_and_stale_and_malformed() -> None:
    clock = Clock()
    me = auth("me", clock=clock)
    header = sign(auth("p", clock=clock), "me")
    me.check_http_headers(header, "PUT", "/route", "")
    with pytest.raises(StaleMessage, match="replayed"):
        me.check_http_headers(header, "PUT", "/route", "")
    old = sign(auth("p", clock=Clock(clock.now - 60)), "me")
    with pytest.raises(StaleMessage):
        me.check_http_headers(old, "PUT", "/route", "")
    for bad in (None, "Bearer x", "KVD-HMAC ts=1", "KVD-HMAC garbage",
                header.replace("v=2", "v=1"), header.replace("mac=", "mac=zz")):
        with pytest.raises(AuthError):
            me.check_http_headers(bad, "PUT", "/route", "")
