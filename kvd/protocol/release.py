"""Release tokens: how the opener of a room ends it (cases K45, K46, S11). PURE.

A room nobody will claim (the decode refused the request, the decode leg failed and is
retried with fresh rooms, the client left between the legs) holds prefill KV until its
bootstrap deadline unless the party that knows ends it. That party is the room's
*opener*: the proxy that chose the room. Ending a room must not be open to every holder
of the cluster secret (S11), so the opener binds each attempt to a secret of its own:

1. the proxy draws a fresh random token per attempt (:func:`new_token`) and puts it in
   the prefill leg's ``kv_transfer_params`` (``release_token``);
2. the prefill engine's connector hands kvd only its digest (:func:`token_digest`) when
   it creates each room of the request (``SenderCreate.release_digest``); the token
   itself never reaches kvd until a release, and never leaves the prefill in its reply;
3. ``POST /v1/rooms/release`` with :class:`ReleaseRequest` (the rooms and the token)
   ends each named room whose stored digest matches (constant-time compare) and that is
   still unfinished; every other room is left as it is, with a typed answer
   (:class:`ReleaseOutcome`) per room in :class:`ReleaseAnswer`.

Bounds: a token is :data:`MIN_TOKEN_CHARS`..:data:`MAX_TOKEN_CHARS` characters, a
request names at most :data:`MAX_RELEASE_ROOMS` rooms and its body is at most
:data:`RELEASE_BODY_LIMIT` bytes.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets

import msgspec

#: Fewest characters of a token (``new_token`` makes 43: 256 random bits, URL-safe).
MIN_TOKEN_CHARS = 22
#: Most characters of a token.
MAX_TOKEN_CHARS = 128
#: Most rooms one release names (a request's samples: the vLLM adapter's MAX_SAMPLES).
MAX_RELEASE_ROOMS = 64
#: Largest ``POST /v1/rooms/release`` body (bytes): 64 rooms of 20 digits and a token fit.
RELEASE_BODY_LIMIT = 4096
#: Bytes of a digest (SHA-256).
DIGEST_BYTES = 32


class ReleaseOutcome(enum.Enum):
    """What a release did to one room.

    ``released``: it was unfinished and is now Failed (kind ``aborted``); ``ended``: it
    had ended already (Success or Failed; untouched: a replayed release, or one that
    raced the room's end); ``refused``: no digest bound to it, or the token is not the
    room's (untouched); ``unknown``: no such room on this rank (not created yet, or
    forgotten).
    """

    RELEASED = "released"
    ENDED = "ended"
    REFUSED = "refused"
    UNKNOWN = "unknown"


class ReleaseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/rooms/release``: ``rooms`` (64-bit room ids) and ``token``."""

    rooms: list[int]
    token: str
    reason: str = ""


class ReleaseAnswer(msgspec.Struct, frozen=True):
    """Answer of a release: each named room by its outcome (``ReleaseOutcome.value``)."""

    rooms: dict[str, str]


class ReleaseError(ValueError):
    """A release request that is malformed (answered 400)."""


def new_token() -> str:
    """A fresh release token (256 random bits, URL-safe text, 43 characters)."""
    return secrets.token_urlsafe(32)


def token_digest(token: str) -> bytes:
    """The digest kvd keeps for ``token``: SHA-256 of its UTF-8 bytes (32 bytes)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def token_matches(token: str, digest: bytes) -> bool:
    """True if ``token``'s digest is ``digest`` (constant-time in the digests)."""
    return len(digest) == DIGEST_BYTES and hmac.compare_digest(token_digest(token), digest)


def check_token(token: object) -> str:
    """``token`` if it is a string of allowed length; ReleaseError otherwise."""
    if not isinstance(token, str) or not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ReleaseError(f"release token must be a string of {MIN_TOKEN_CHARS}.."
                           f"{MAX_TOKEN_CHARS} characters")
    return token


def parse_request(body: bytes) -> ReleaseRequest:
    """Decode and check a release body. Raises ReleaseError (the client's 400) for bad
    JSON, unknown fields, more than :data:`MAX_RELEASE_ROOMS` rooms, a room outside
    ``[0, 2**64)``, a bad token or a reason over 256 characters."""
    try:
        req = msgspec.json.decode(body, type=ReleaseRequest)
    except msgspec.DecodeError as exc:
        raise ReleaseError(f"bad release request: {exc}") from None
    if not 1 <= len(req.rooms) <= MAX_RELEASE_ROOMS:
        raise ReleaseError(f"a release names 1..{MAX_RELEASE_ROOMS} rooms, got "
                           f"{len(req.rooms)}")
    if any(not 0 <= r < 2**64 for r in req.rooms):
        raise ReleaseError("rooms are 64-bit unsigned integers")
    if len(req.reason) > 256:
        raise ReleaseError("reason over 256 characters")
    check_token(req.token)
    return req
