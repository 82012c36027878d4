"""Authentication of the control plane and the bootstrap API with a shared cluster secret.

Threat model: docs/security.md. Anyone who can reach kvd's ports may send anything;
only holders of the cluster secret may register ranks, redirect transfers or report
room status, and what they send is bound to ONE recipient daemon (its instance id):
a captured frame or request is useless at another daemon, or at the same address
after a restart (case S09). PURE apart from the clock and ``os.urandom``.

Both envelopes MAC a fixed-size header that carries the SHA-256 of the body, so a
forged message is refused in O(1) work whatever its size, and an HTTP request is
refused from its headers before its body is read (case S03)::

    control frame (ZMQ), seal version 2:
      b"KVA2" | to (16 B) | ts_ms (u64 BE) | nonce (16 B) | sha256(frame) (32 B)
              | mac (32 B) | frame
      mac = HMAC-SHA256(secret, b"kvd-control-v2\\0" | to | ts | nonce | sha256(frame))

    HTTP request:
      Authorization: KVD-HMAC v=2,to=<instance>,ts=<ms>,nonce=<hex>,body=<sha256 hex>,mac=<hex>
      mac = HMAC-SHA256(secret, "kvd-http-v2\\nMETHOD\\nPATH\\nQUERY\\nTO\\nTS\\nNONCE\\nBODY")

``to`` is the recipient's instance id (the 16-byte :func:`recipient_tag` of it in a
frame). A message is opened only if ``|now - ts| <= max_skew``, the MAC matches, the
nonce was not seen within the window (bounded replay cache), the body matches its
digest and it is addressed to this instance. A frame that passes every check but the
last is authentic but misaddressed: :class:`~kvd.errors.WrongRecipient` carries it so
that the receiver can tell its sender which instance serves the address now. HMAC
(not ZMQ CURVE) keeps one mechanism for ZMQ and HTTP and needs no key distribution
beyond the one secret.

Seal versions (check the magic first; an older peer gets a message naming it):
  1 (b"KVA1") — HMAC over ts|nonce|frame; no recipient (replayable to any daemon).
  2 (b"KVA2") — recipient-bound, header MAC over the body digest (this version).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from kvd.errors import AuthError, Skewed, StaleMessage, WrongRecipient

SEAL_VERSION = 2
SEAL_MAGIC = b"KVA2"
_OLD_MAGICS = {b"KVA1": 1}
_HEAD = struct.Struct(">4s16sQ16s32s32s")
#: Bytes a seal adds in front of a frame.
SEAL_OVERHEAD = _HEAD.size
HEADER = "Authorization"
SCHEME = "KVD-HMAC"
#: Response header of a 401 that names the instance that answered, so that a sender
#: whose cached recipient is stale (the server restarted) can re-address and retry.
INSTANCE_HEADER = "KVD-Instance"
#: Response header of a 401 for a request signed outside the window: the request's
#: signature time minus the server's clock (s), so that the client can name the skew.
CLOCK_HEADER = "KVD-Clock-Offset"
_CONTROL_DOMAIN = b"kvd-control-v2\0"
_HTTP_DOMAIN = b"kvd-http-v2"

def recipient_tag(instance_id: str) -> bytes:
    """The 16 bytes naming ``instance_id`` in a sealed frame (SHA-256 prefix)."""
    return hashlib.sha256(instance_id.encode()).digest()[:16]


#: A received frame: bytes, or a view of the transport's buffer (nothing copied).
Buffer: TypeAlias = bytes | memoryview


@dataclass(frozen=True)
class Opened:
    """An opened control frame: the inner ``frame`` and when it was sealed
    (``sent_at``, seconds since the epoch, by the sender's clock)."""

    frame: Buffer
    sent_at: float


@dataclass(frozen=True)
class HttpClaim:
    """What a request's Authorization header vouches for, checked before its body is
    read: the body must then hash to ``body_sha256`` (hex)."""

    body_sha256: str


class Authenticator:
    """Seals and opens frames, signs and checks HTTP requests, for one daemon instance.

    ``secret`` None means insecure mode: frames pass unsealed and nothing is checked.
    ``instance_id`` is this daemon's (messages must be addressed to it); ``max_skew``
    is in seconds; ``replay_capacity`` bounds the nonce cache (oldest entries are
    evicted first; entries older than twice the window are pruned, after which their
    timestamps are refused anyway). Raises ValueError for a secret under 16 bytes.
    """

    def __init__(self, secret: bytes | None, instance_id: str = "", max_skew: float = 30.0,
                 replay_capacity: int = 1_000_000,
                 clock: Callable[[], float] = time.time) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self._secret = secret
        self.instance_id = instance_id
        self._tag = recipient_tag(instance_id)
        self.max_skew = max_skew
        self.capacity = replay_capacity
        self.clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def __repr__(self) -> str:  # never the secret
        return f"Authenticator(instance={self.instance_id!r}, enabled={self.enabled})"

    @property
    def enabled(self) -> bool:
        """True when a secret is configured."""
        return self._secret is not None

    def _mac(self, *parts: bytes) -> bytes:
        assert self._secret is not None
        return hmac.digest(self._secret, b"".join(parts), "sha256")

    def channel_mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 of ``parts`` under the cluster secret, for the same-host peer
        channel's challenge-response (:mod:`kvd.transfer.backends.peerchannel`, which
        binds its own domain, nonces and instance ids into ``parts``); ``b""`` in
        insecure mode (nothing to prove)."""
        return self._mac(*parts) if self._secret is not None else b""

    # ---- control frames -----------------------------------------------------------------

    def seal(self, frame: bytes, to_instance: str, at: float | None = None) -> bytes:
        """``frame`` with a seal addressed to the daemon ``to_instance`` (unchanged in
        insecure mode), dated ``at`` (s since the epoch; None: now). Only a refusal names
        ``at``: it is dated as the frame it answers, in that sender's clock, so that it is
        fresh for its recipient whatever the two clocks say (K40)."""
        if self._secret is None:
            return frame
        when = self.clock() if at is None else at
        to, ts, nonce = recipient_tag(to_instance), int(when * 1000), os.urandom(16)
        digest = hashlib.sha256(frame).digest()
        mac = self._mac(_CONTROL_DOMAIN, to, struct.pack(">Q", ts), nonce, digest)
        return _HEAD.pack(SEAL_MAGIC, to, ts, nonce, digest, mac) + frame

    def open(self, data: bytes) -> bytes:
        """The inner frame of a sealed message (see :meth:`open_sealed`)."""
        return bytes(self.open_sealed(data).frame)

    def open_sealed(self, data: Buffer) -> Opened:
        """The inner frame of a sealed message and when it was sealed.

        ``data`` may be a ``memoryview`` of the received frame (ZMQ's buffer): nothing is
        copied, and the inner frame is a view of it. Raises :class:`AuthError` if it is
        not sealed (or sealed by an older kvd) or its MAC or body digest does not match;
        :class:`Skewed` if it is authentic but outside the window (its body unchecked:
        see :meth:`skewed_body`); :class:`StaleMessage` if it is a replay;
        :class:`WrongRecipient` (carrying the frame) if it is authentic but addressed to
        another instance. Work before the MAC check, and for any frame the MAC refuses, is
        O(1) in the frame's size (S03, S19). In insecure mode every frame opens, "sent" now.
        """
        if self._secret is None:
            return Opened(data, self.clock())
        if len(data) < _HEAD.size or data[:4] != SEAL_MAGIC:
            raise AuthError(_unsealed_reason(bytes(data[:4])))
        _, to, ts, nonce, digest, mac = _HEAD.unpack_from(data)
        want = self._mac(_CONTROL_DOMAIN, to, struct.pack(">Q", ts), nonce, digest)
        if not hmac.compare_digest(mac, want):
            raise AuthError("bad frame MAC (wrong cluster secret or tampered)")
        sent_at = ts / 1000.0
        offset = sent_at - self.clock()
        if abs(offset) > self.max_skew:
            # Authentic (a holder of the secret sealed it) but not fresh: its nonce is not
            # remembered (it would outlive the replay cache's window), so it is never acted
            # on; the receiver may tell its sender that the clocks disagree (K40).
            raise Skewed(f"stale message ({-offset:+.1f}s outside the {self.max_skew:.0f}s "
                         f"window)", None, sent_at, offset)
        self._check_nonce(nonce)
        frame = data[_HEAD.size:]
        if not hmac.compare_digest(hashlib.sha256(frame).digest(), digest):
            raise AuthError("frame body does not match its sealed digest (tampered)")
        self._remember(nonce, sent_at)  # also when misaddressed: one answer per frame
        if not hmac.compare_digest(to, self._tag):
            raise WrongRecipient("frame addressed to another kvd instance", frame, sent_at)
        return Opened(frame, sent_at)

    def skewed_body(self, data: Buffer) -> Buffer:
        """The inner frame of a frame :meth:`open_sealed` refused as :class:`Skewed`, once
        its body matches its sealed digest (O(n): the caller bounds how often it asks, see
        :class:`kvd.control.inbound.RefusalGate`); raises :class:`AuthError` otherwise."""
        if self._secret is None:
            return data
        digest = _HEAD.unpack_from(data)[4]
        frame = data[_HEAD.size:]
        if not hmac.compare_digest(hashlib.sha256(frame).digest(), digest):
            raise AuthError("frame body does not match its sealed digest (tampered)")
        return frame

    # ---- HTTP ---------------------------------------------------------------------------

    def http_header(self, method: str, path: str, query: str, body: bytes,
                    to_instance: str) -> dict[str, str]:
        """Headers authenticating one HTTP request to the daemon ``to_instance`` (empty in
        insecure mode). ``path`` is the decoded path, ``query`` the raw query string."""
        if self._secret is None:
            return {}
        ts, nonce = int(self.clock() * 1000), os.urandom(16).hex()
        digest = hashlib.sha256(body).hexdigest()
        mac = self._mac(_canonical(method, path, query, to_instance, ts, nonce, digest)).hex()
        return {HEADER: f"{SCHEME} v={SEAL_VERSION},to={to_instance},ts={ts},nonce={nonce},"
                        f"body={digest},mac={mac}"}

    def check_http_headers(self, header: str | None, method: str, path: str,
                           query: str) -> HttpClaim:
        """Check a request's authorization from its headers alone (before its body is
        read); the returned claim says which body digest the request must carry.

        Raises :class:`WrongRecipient`, :class:`StaleMessage` or :class:`AuthError`
        (missing, malformed or forged). In insecure mode every request passes and the
        claim is empty (``body_sha256`` "").
        """
        if self._secret is None:
            return HttpClaim("")
        fields = _parse_authorization(header)
        to, ts, nonce, digest = fields["to"], int(fields["ts"]), fields["nonce"], fields["body"]
        if not hmac.compare_digest(to.encode(), self.instance_id.encode()):
            raise WrongRecipient(f"request addressed to another kvd instance ({to!r})")
        self._check_window(ts / 1000.0)
        want = self._mac(_canonical(method, path, query, to, ts, nonce, digest))
        if not hmac.compare_digest(bytes.fromhex(fields["mac"]), want):
            raise AuthError("bad request MAC (wrong cluster secret or tampered)")
        raw_nonce = bytes.fromhex(nonce)
        self._check_nonce(raw_nonce)
        # Remembered now, not after the body: a concurrent replay of the same headers
        # must not be admitted while the first body is still being read.
        self._remember(raw_nonce, ts / 1000.0)
        return HttpClaim(digest)

    def check_http_body(self, claim: HttpClaim, body_sha256: str) -> None:
        """Raise :class:`AuthError` unless the body read hashes (hex) to the claim's."""
        if self._secret is None:
            return
        if not hmac.compare_digest(claim.body_sha256, body_sha256):
            raise AuthError("request body does not match its signed digest (tampered)")

    def check_http(self, header: str | None, method: str, path: str, query: str,
                   body: bytes) -> None:
        """Headers and body in one call (for callers that already hold the body)."""
        claim = self.check_http_headers(header, method, path, query)
        self.check_http_body(claim, hashlib.sha256(body).hexdigest())

    # ---- freshness ----------------------------------------------------------------------

    def _check_window(self, ts: float) -> None:
        """Raise :class:`Skewed` (no frame) unless ``ts`` is within the window of now."""
        now = self.clock()
        if abs(now - ts) > self.max_skew:
            raise Skewed(f"stale message ({now - ts:+.1f}s outside the "
                         f"{self.max_skew:.0f}s window)", None, ts, ts - now)

    def _check_nonce(self, nonce: bytes) -> None:
        self._prune(self.clock())
        if nonce in self._seen:
            raise StaleMessage("replayed message (nonce seen before)")

    def _remember(self, nonce: bytes, ts: float) -> None:
        self._seen[nonce] = ts
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def _prune(self, now: float) -> None:
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if now - ts <= 2 * self.max_skew:
                return
            del self._seen[nonce]


def _unsealed_reason(magic: bytes) -> str:
    old = _OLD_MAGICS.get(magic)
    if old is not None:
        return (f"frame sealed with seal version {old} by an older kvd "
                f"(this kvd speaks {SEAL_VERSION})")
    return "unauthenticated frame (no seal)"


_FIELDS = ("v", "to", "ts", "nonce", "body", "mac")


def _parse_authorization(header: str | None) -> dict[str, str]:
    """The fields of a ``KVD-HMAC`` header; raises AuthError if missing or malformed."""
    if not header or not header.startswith(SCHEME + " "):
        raise AuthError("missing KVD-HMAC authorization")
    try:
        fields = dict(kv.split("=", 1) for kv in header[len(SCHEME) + 1:].split(","))
        missing = [f for f in _FIELDS if f not in fields]
        int(fields.get("ts", "x"))
        bytes.fromhex(fields.get("nonce", "x"))
        bytes.fromhex(fields.get("mac", "x"))
    except ValueError as exc:
        raise AuthError("malformed KVD-HMAC authorization") from exc
    if missing:
        raise AuthError(f"malformed KVD-HMAC authorization (missing {', '.join(missing)})")
    if fields["v"] != str(SEAL_VERSION):
        raise AuthError(f"KVD-HMAC version {fields['v'][:8]!r} (this kvd speaks "
                        f"{SEAL_VERSION})")
    return fields


def _canonical(method: str, path: str, query: str, to: str, ts: int, nonce: str,
               body_sha256: str) -> bytes:
    return b"\n".join([_HTTP_DOMAIN, method.upper().encode(), path.encode(), query.encode(),
                       to.encode(), str(ts).encode(), nonce.encode(), body_sha256.encode()])


