"""The compatibility fingerprint of a (prefill, decode) pair (issue 22 item 5). PURE.

Each rank's KV args carry a :class:`~kvd.protocol.control.Compat`. :func:`fingerprint`
hashes the fields that must be equal (model id, KV dtype, scale layout, layer types,
spec config, aux layout -- the typed aux slot --, kvd wire version); :func:`check_compat`
refuses a pair whose fingerprints differ, naming every differing field with both
values, so a mismatched pair fails at its first room (a registration failure) and never
moves bytes that mean something else.
Page size and TP are not in the fingerprint: a pair may differ in them, and the planner
checks those (:func:`kvd.transfer.layout.check_pair`).
"""

from __future__ import annotations

import hashlib

import msgspec

from kvd.errors import RegistrationError
from kvd.protocol.control import MAX_AUX_LAYOUT, Compat
from kvd.protocol.rpc import RegisterKV

#: The fields :func:`fingerprint` covers, in order.
HASHED = ("model_id", "kv_dtype", "scale_layout", "layer_types", "spec_config",
          "aux_layout", "wire_version")


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


def aux_layout(req: RegisterKV) -> str:
    """The canonical ``Compat.aux_layout`` of a registration: ``""`` without named aux
    fields, else the aux item lengths (bytes) and every field as
    ``buffer:name:dtype@offset+nbytes`` in declaration order, e.g. ``"items 64;
    0:ids:int32@0+4; 0:hidden:float32@4+32"``. Raises :class:`RegistrationError` for a field
    naming no aux buffer, outside its buffer's item, with no bytes, overlapping another
    field of its buffer, or a layout longer than the fingerprint holds."""
    if not req.aux_fields:
        return ""
    items = list(req.aux_item_lens)
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for f in req.aux_fields:
        if not 0 <= f.buffer < len(items):
            raise RegistrationError(f"aux field {f.name!r} names aux buffer {f.buffer} of "
                                    f"{len(items)}")
        if f.nbytes < 1 or f.offset < 0 or f.offset + f.nbytes > items[f.buffer]:
            raise RegistrationError(f"aux field {f.name!r} bytes [{f.offset}, +{f.nbytes}) "
                                    f"outside the {items[f.buffer]}-byte aux item")
        for lo, hi, other in spans.get(f.buffer, []):
            if f.offset < hi and lo < f.offset + f.nbytes:
                raise RegistrationError(f"aux fields {other!r} and {f.name!r} overlap")
        spans.setdefault(f.buffer, []).append((f.offset, f.offset + f.nbytes, f.name))
    text = "; ".join([f"items {','.join(map(str, items))}"] + [
        f"{f.buffer}:{f.name}:{f.dtype}@{f.offset}+{f.nbytes}" for f in req.aux_fields])
    if len(text) > MAX_AUX_LAYOUT:
        raise RegistrationError(f"aux fields: layout of {len(text)} characters exceeds "
                                f"{MAX_AUX_LAYOUT}")
    return text

