"""The compatibility fingerprint of a (prefill, decode) pair (issue 22 item 5). PURE.

Each rank's KV args carry a :class:`~kvd.protocol.control.Compat`. :func:`fingerprint`
hashes the fields that must be equal (model id, KV dtype, scale layout, layer types,
spec config, kvd wire version); :func:`check_compat` refuses a pair whose fingerprints
differ, naming every differing field with both values, so a mismatched pair fails at its
first room (a registration failure) and never moves bytes that mean something else.
Page size and TP are not in the fingerprint: a pair may differ in them, and the planner
checks those (:func:`kvd.transfer.layout.check_pair`).
"""

from __future__ import annotations

import hashlib

import msgspec

from kvd.errors import RegistrationError
from kvd.protocol.control import Compat

#: The fields :func:`fingerprint` covers, in order.
HASHED = ("model_id", "kv_dtype", "scale_layout", "layer_types", "spec_config",
          "wire_version")


def fingerprint(c: Compat) -> str:
    """SHA-256 (hex, 64 chars) of the :data:`HASHED` fields of ``c``."""
    body = msgspec.msgpack.encode([getattr(c, name) for name in HASHED])
    return hashlib.sha256(body).hexdigest()


def compat_problems(prefill: Compat | None, decode: Compat | None) -> list[str]:
    """``"field 'a' vs 'b'"`` (prefill vs decode) for each hashed field that differs;
    empty when the fingerprints are equal or a side sent none (a peer older than the
    fingerprint: the KV-args checks still apply)."""
    if prefill is None or decode is None or fingerprint(prefill) == fingerprint(decode):
        return []
    return [f"{name} {getattr(prefill, name)!r} vs {getattr(decode, name)!r}"
            for name in HASHED if getattr(prefill, name) != getattr(decode, name)]


def check_compat(prefill: Compat | None, decode: Compat | None) -> None:
    """Raise :class:`RegistrationError` ``"compatibility fingerprint mismatch (prefill vs
    decode): model_id 'a' vs 'b'; ..."`` when the fingerprints differ."""
    problems = compat_problems(prefill, decode)
    if problems:
        raise RegistrationError("compatibility fingerprint mismatch (prefill vs decode): "
                                + "; ".join(problems))
