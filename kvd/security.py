"""Authentication of the control plane and the bootstrap API with a shared cluster secret.

Threat model (docs/security.md): anyone who can reach kvd's ports may send
anything; only holders of the cluster secret may register ranks, redirect
transfers or report room status. PURE apart from the clock and ``os.urandom``.

Control frames (kvd <-> kvd, ZMQ) are sealed::

    b"KVA1" | ts_ms (u64 BE) | nonce (16 B) | HMAC-SHA256(secret, ts|nonce|frame) | frame

and opened only if the MAC matches, ``|now - ts| <= max_skew`` and the nonce
was not seen within the skew window (replay cache, bounded). Bootstrap HTTP
requests carry ``Authorization: KVD-HMAC ts=..,nonce=..,mac=..`` over
``METHOD\\nPATH\\nQUERY\\nBODY``. HMAC (not ZMQ CURVE) keeps one mechanism for
ZMQ and HTTP and needs no key distribution beyond the one secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable

from kvd.errors import AuthError

SEAL_MAGIC = b"KVA1"
_HEAD = struct.Struct(">4sQ16s32s")
HEADER = "Authorization"
SCHEME = "KVD-HMAC"


class Authenticator:
    """Seals and opens frames, signs and checks HTTP requests.

    ``secret`` None means insecure mode: frames pass unsealed and nothing is
    checked. ``max_skew`` is in seconds; ``replay_capacity`` bounds the nonce
    cache (oldest entries are evicted first; entries older than the skew window
    are pruned, after which their timestamps are refused anyway).
    """

    def __init__(self, secret: bytes | None, max_skew: float = 30.0,
                 replay_capacity: int = 1_000_000,
                 clock: Callable[[], float] = time.time) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self.secret = secret
        self.max_skew = max_skew
        self.capacity = replay_capacity
        self.clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    @property
    def enabled(self) -> bool:
        """True when a secret is configured."""
        return self.secret is not None

    def _mac(self, *parts: bytes) -> bytes:
        assert self.secret is not None
        return hmac.new(self.secret, b"".join(parts), hashlib.sha256).digest()

    def seal(self, frame: bytes) -> bytes:
        """The frame with its authentication header (unchanged in insecure mode)."""
        if self.secret is None:
            return frame
        ts, nonce = int(self.clock() * 1000), os.urandom(16)
        mac = self._mac(struct.pack(">Q", ts), nonce, frame)
        return _HEAD.pack(SEAL_MAGIC, ts, nonce, mac) + frame

    def open(self, data: bytes) -> bytes:
        """The inner frame of a sealed message; raises :class:`AuthError` if it is not
        sealed with the secret, is outside the time window, or was seen before."""
        if self.secret is None:
            return data
        if len(data) < _HEAD.size or data[:4] != SEAL_MAGIC:
            raise AuthError("unauthenticated frame (no seal)")
        _, ts, nonce, mac = _HEAD.unpack_from(data)
        frame = data[_HEAD.size:]
        if not hmac.compare_digest(mac, self._mac(struct.pack(">Q", ts), nonce, frame)):
            raise AuthError("bad frame MAC (wrong cluster secret or tampered)")
        self._check_fresh(ts / 1000.0, nonce)
        return frame

    def _check_fresh(self, ts: float, nonce: bytes) -> None:
        now = self.clock()
        if abs(now - ts) > self.max_skew:
            raise AuthError(f"stale message ({now - ts:+.1f}s outside the "
                            f"{self.max_skew:.0f}s window)")
        self._prune(now)
        if nonce in self._seen:
            raise AuthError("replayed message (nonce seen before)")
        self._seen[nonce] = ts
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def _prune(self, now: float) -> None:
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if now - ts <= 2 * self.max_skew:
                return
            del self._seen[nonce]

    def http_header(self, method: str, path: str, query: str, body: bytes) -> dict[str, str]:
        """Headers authenticating one HTTP request (empty in insecure mode)."""
        if self.secret is None:
            return {}
        ts, nonce = int(self.clock() * 1000), os.urandom(16).hex()
        mac = self._mac(_canonical(method, path, query, body, ts, nonce)).hex()
        return {HEADER: f"{SCHEME} ts={ts},nonce={nonce},mac={mac}"}

    def check_http(self, header: str | None, method: str, path: str, query: str,
                   body: bytes) -> None:
        """Raise :class:`AuthError` unless ``header`` authenticates this request."""
        if self.secret is None:
            return
        if not header or not header.startswith(SCHEME + " "):
            raise AuthError("missing KVD-HMAC authorization")
        try:
            fields = dict(kv.split("=", 1) for kv in header[len(SCHEME) + 1:].split(","))
            ts, nonce, mac = int(fields["ts"]), fields["nonce"], bytes.fromhex(fields["mac"])
            raw_nonce = bytes.fromhex(nonce)
        except (ValueError, KeyError) as exc:
            raise AuthError("malformed KVD-HMAC authorization") from exc
        want = self._mac(_canonical(method, path, query, body, ts, nonce))
        if not hmac.compare_digest(mac, want):
            raise AuthError("bad request MAC (wrong cluster secret or tampered)")
        self._check_fresh(ts / 1000.0, raw_nonce)


def _canonical(method: str, path: str, query: str, body: bytes, ts: int, nonce: str) -> bytes:
    return b"\n".join([method.upper().encode(), path.encode(), query.encode(),
                       str(ts).encode(), nonce.encode(), body])
