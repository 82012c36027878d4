"""kvd.protocol.control: every integer of a kvd<->kvd control message has a wire bound
(room ids uint64, counts/sizes/pages/incarnations in ``[0, 2**63)``, sentinel indices
int64, parallel sizes at least 1, a room status a KVPoll value). A message with any integer
outside its bound does not decode -- ProtocolError naming the field, alone or inside a
Batch -- and one with every integer inside its bounds round-trips. msgpack carries no
integer outside ``[-2**63, 2**64)``: such a message cannot be encoded at all."""

from __future__ import annotations

from typing import Any, get_args

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.protocol import bounds, codec, control, memory, rpc
from kvd.rooms.state import KVPoll

#: integers around every bound that matters: int64, uint64, the sentinels, and past them
EDGES = st.sampled_from([0, 1, -1, -2, 4, 5, 2**31, 2**63 - 1, 2**63, -(2**63),
                         -(2**63) - 1, 2**64 - 1, 2**64, 2**70, -(2**70)])
INTS = EDGES | st.integers(min_value=-(2**65), max_value=2**65)
MESSAGES: tuple[type, ...] = get_args(control.ControlMessage)
MSGPACK_LO, MSGPACK_HI = -(2**63), 2**64 - 1

Path = tuple[str | int, ...]


def _template(t: Any, owner: type | None = None) -> tuple[Any, list[tuple[Path, Any, type]]]:
    """A valid builtin value of msgspec type ``t`` with every optional part present (one
    element per list, the first member of a union), and the path, type and owning struct
    of each of its integers."""
    if isinstance(t, mi.StructType):
        out: dict[str, Any] = {t.tag_field: t.tag} if t.tag_field else {}
        paths: list[tuple[Path, Any, type]] = []
        for f in t.fields:
            value, inner = _template(f.type, t.cls)
            out[f.encode_name] = value
            paths += [((f.encode_name, *p), it, cls) for p, it, cls in inner]
        return out, paths
    if isinstance(t, mi.UnionType):
        return _template(next(m for m in t.types if not isinstance(m, mi.NoneType)), owner)
    if isinstance(t, mi.ListType):
        value, inner = _template(t.item_type, owner)
        return [value], [((0, *p), it, cls) for p, it, cls in inner]
    if isinstance(t, mi.IntType):
        assert owner is not None
        return max(t.ge if t.ge is not None else 0, 0), [((), t, owner)]
    simple = {mi.StrType: "", mi.BytesType: b"", mi.BoolType: False, mi.FloatType: 0.0}
    if type(t) in simple:
        return simple[type(t)], []
    if isinstance(t, mi.LiteralType):
        return t.values[0], []
    raise AssertionError(f"no template for {t}")


TEMPLATES = {cls: _template(mi.type_info(cls)) for cls in MESSAGES}
FIELDS = [(cls, path, it, owner) for cls in MESSAGES for path, it, owner in TEMPLATES[cls][1]]


def _bounds(it: Any) -> tuple[int, int]:
    return (MSGPACK_LO if it.ge is None else it.ge, MSGPACK_HI if it.le is None else it.le)


def _set(doc: Any, path: Path, value: int) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
    return obj


def _where(path: Path) -> str:
    """The path as msgspec's errors name it (``$.kv_args.kv_data_ptrs[0]``)."""
    return "$" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def _frame(doc: Any) -> bytes:
    return codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(doc)


def test_every_control_integer_is_bounded_and_every_message_has_one() -> None:
    """No integer of a control structure is a bare ``int``, the exported pool's
    (:mod:`kvd.protocol.memory`, ``RegisterRank.pool``) included: each carries a lower
    bound (and an upper one, unless it is a u64)."""
    assert {owner.__module__ for *_, owner in FIELDS} == {control.__name__, memory.__name__}
    unbounded = {(cls.__name__, _where(p)) for cls, p, it, owner in FIELDS if it.ge is None}
    assert not unbounded
    assert {cls for cls, *_ in FIELDS} == set(MESSAGES) - {control.Refused}
    u64 = {_where(p) for cls, p, it, owner in FIELDS if it.le is None}
    assert u64 == {"$.room", "$.kv_args.kv_data_ptrs[0]", "$.kv_args.aux_data_ptrs[0]",
                   "$.kv_args.state.ptrs[0]", "$.kv_args.groups[0].ptrs[0]",
                   "$.pool.buffers[0].address"}


def test_the_templates_decode() -> None:
    for cls in MESSAGES:
        doc, _ = TEMPLATES[cls]
        assert type(control.decode(_frame(doc))) is cls


@settings(max_examples=400)  # about 60 integer fields, each at and around its bounds
@given(st.sampled_from(FIELDS), INTS, st.booleans())
def test_an_integer_outside_its_bound_is_refused_naming_it_and_one_inside_round_trips(
        field: tuple[type, Path, Any, type], value: int, batched: bool) -> None:
    cls, path, it, _owner = field
    doc = msgspec.msgpack.decode(msgspec.msgpack.encode(TEMPLATES[cls][0]))  # a deep copy
    _set(doc, path, value)
    good = TEMPLATES[control.RoomAbort][0]
    if batched:
        doc, path = {"type": "batch", "messages": [good, doc]}, ("messages", 1, *path)
    lo, hi = _bounds(it)
    if not MSGPACK_LO <= value <= MSGPACK_HI:
        with pytest.raises((OverflowError, msgspec.EncodeError)):
            _frame(doc)
        return
    if lo <= value <= hi:
        msgs = control.decode_many(_frame(doc))
        out = msgs[-1]
        assert type(out) is cls and _get(out, path[2:] if batched else path) == value
        assert control.decode_many(control.encode_many(msgs)) == msgs
        return
    with pytest.raises(ProtocolError, match="malformed frame") as err:
        control.decode_many(_frame(doc))
    assert f"at `{_where(path)}`" in str(err.value)


@pytest.mark.parametrize("msg", [
    control.RoomPages(room=-1, inc=1, endpoint="e", instance_id="i", dst_pages=b"",
                      aux_index=0, write_within=1.0),
    control.RoomPages(room=1, inc=2**63, endpoint="e", instance_id="i", dst_pages=b"",
                      aux_index=0, write_within=1.0),
    control.RoomPages(room=1, inc=1, endpoint="e", instance_id="i", dst_pages=b"",
                      aux_index=2**63, write_within=1.0),
    control.RoomPages(room=1, inc=1, endpoint="e", instance_id="i", dst_pages=b"",
                      aux_index=0, write_within=1.0, first_page=-1),
    control.RoomStatus(room=-1, inc=1, status=4, kind="", reason="", endpoint="e",
                       instance_id="i"),
    control.RoomStatus(room=1, inc=1, status=5, kind="", reason="", endpoint="e",
                       instance_id="i"),
    control.RoomAbort(room=-(2**63), inc=0, kind="", reason="", endpoint="e", instance_id="i"),
])
def test_a_peers_negative_room_or_index_past_int64_does_not_decode(msg: Any) -> None:
    """Before, each of these decoded and reached the room machines."""
    with pytest.raises(ProtocolError, match="malformed frame"):
        control.decode(control.encode(msg))


def test_the_largest_room_id_and_incarnation_decode() -> None:
    msg = control.RoomStatus(room=2**64 - 1, inc=2**63 - 1, status=int(KVPoll.Success),
                             kind="", reason="", endpoint="e", instance_id="i")
    assert control.decode(control.encode(msg)) == msg


def test_one_definition_of_the_shared_bounds() -> None:
    """The engine RPC's room calls use the control plane's types; a room status is a
    KVPoll value."""
    for name in ("RoomId", "I64", "Count", "Address", "Size", "I64_MAX"):
        assert getattr(control, name) is getattr(bounds, name), name
    assert rpc.RoomId is bounds.RoomId and rpc.I64 is bounds.I64
    status = mi.type_info(control.StatusCode)
    assert (status.ge, status.le) == (min(KVPoll), max(KVPoll))
